"""Host-side cost of one SDPA call: wall time to enqueue vs GPU time, per input kind (cProfile: host_profile.py)."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import cupy  # noqa: E402
import torch  # noqa: E402

import cupy_attn  # noqa: E402
from common import median_ms  # noqa: E402


def host_us(fn, n=20):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def main():
    q, k, v = (torch.randn(32, 32, 512, 1024, device="cuda", dtype=torch.float16) for _ in range(3))
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    small = [torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16) for _ in range(3)]
    cases = {
        "torch seed": lambda: cupy_attn.scaled_dot_product_attention(q, k, v),
        "cupy seed": lambda: cupy_attn.scaled_dot_product_attention(cq, ck, cv),
        "torch small": lambda: cupy_attn.scaled_dot_product_attention(*small),
        "explain only": lambda: cupy_attn.explain(q, k, v),
    }
    for name, fn in cases.items():
        print(f"{name:14s} host {host_us(fn):8.0f} us/call   gpu {median_ms(fn, n_repeat=10):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
