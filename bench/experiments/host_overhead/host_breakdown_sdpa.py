"""Where the host time of a cached small SDPA call goes (torch tensors, (1,8,128,128,64) fp16): each step timed
alone in a loop (no GPU sync between calls; µs per call), against the whole call and torch's SDPA.

    PYTHONPATH=. python3 bench/experiments/host_overhead/host_breakdown_sdpa.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import torch  # noqa: E402

from common import per_call_us  # noqa: E402

import cupy_attn  # noqa: E402
from cupy_attn.runtime import callcache  # noqa: E402



def main():
    q, k, v = (torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    F = torch.nn.functional
    sdpa = cupy_attn.scaled_dot_product_attention
    sdpa(q, k, v)
    key = callcache.key(q, k, v, None, 0.0, False, None, False, "auto", False, False, None)
    entry = callcache.get(key)
    run = entry.run
    launch_on, stream_ptr = run.func, run.args[0]  # the prepared launch's replay bound to the stream handle
    out = q.new_empty(q.shape)
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0, 0)
    steps = {
        "whole call cupy_attn": lambda: sdpa(q, k, v),
        "torch F.sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "key": lambda: callcache.key(q, k, v, None, 0.0, False, None, False, "auto", False, False, None),
        "signatures": lambda: callcache.signatures((q, k, v, None)),
        "entry (alloc+launch)": lambda: entry(q, k, v, None),
        "new_empty": lambda: q.new_empty(q.shape),
        "run (PreparedLaunch)": lambda: run(*ptrs),
        "launch_on": lambda: launch_on(stream_ptr, *ptrs),
        "torch.empty_like": lambda: torch.empty_like(q),
    }
    for name, fn in steps.items():
        print(f"{name:28s} {per_call_us(fn):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
