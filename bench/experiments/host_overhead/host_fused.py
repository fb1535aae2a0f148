"""Where the host time of a fused SDPA call goes (torch inputs, public API vs the kernel's launcher).

Prints, for one shape: the call timed from an idle GPU (cupyx.profiler.benchmark) through the public API and through
dispatch.fused_launch, the host µs of each step (median, GPU synchronized between calls), and the top of a cProfile.

    PYTHONPATH=. python3 bench/experiments/host_overhead/host_fused.py [B H L D]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import numpy as np  # noqa: E402
import torch  # noqa: E402
from cupyx.profiler import benchmark  # noqa: E402

import cupy_attn  # noqa: E402
from cupy_attn.attention import checks as _checks, dispatch as _dispatch  # noqa: E402
from common import host_us, print_profile  # noqa: E402


def main():
    B, H, L, D = (int(a) for a in sys.argv[1:5]) if len(sys.argv) > 4 else (4, 16, 2048, 64)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16) for _ in range(3))
    api = lambda: cupy_attn.scaled_dot_product_attention(q, k, v)  # noqa: E731
    api()
    p = _checks.check_sdpa(q, k, v, None, 0.0, False, None, False, "auto")
    with p.ctx.activate():
        _, out = p.ctx.empty((B, H, L, D), p.dtype)
    ptrs = (p.query.data.ptr, p.key.data.ptr, p.value.data.ptr, out.data.ptr)
    direct = lambda: _dispatch.fused_launch(p.query, p.key, p.value, out, None, scale=p.scale)(*ptrs)  # noqa: E731
    direct()
    tc = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    for name, fn in (("public API", api), ("flash_forward", direct), ("torch default", tc)):
        r = benchmark(fn, n_repeat=50, n_warmup=10)
        print(f"{name:16s} {np.median(r.gpu_times[0]) * 1e3:.3f} ms from idle, host {np.median(r.cpu_times) * 1e6:.0f} µs")
    steps = {
        "check_sdpa": lambda: _checks.check_sdpa(q, k, v, None, 0.0, False, None, False, "auto"),
        "plan_sdpa": lambda: _dispatch.plan_sdpa(p, "auto"),
        "ctx.empty": lambda: p.ctx.empty((B, H, L, D), p.dtype),
        "flash_forward": direct,
        "public API": api,
        "torch default": tc,
    }
    for name, fn in steps.items():
        print(f"host {name:16s} {host_us(fn, 200):7.1f} µs")
    print_profile(api, 300)


if __name__ == "__main__":
    main()
