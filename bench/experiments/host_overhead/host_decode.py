"""Host cost of one decode call, ours against torch's: wall µs per call over a pipelined loop of small calls (the GPU
time per call far below the host's), then a cProfile of ours by own time.

    PYTHONPATH=. python3 bench/experiments/host_overhead/host_decode.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cupy_attn  # noqa: E402
from common import print_profile  # noqa: E402


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main():
    for B, Hq, Hkv in ((1, 32, 32), (1, 32, 8)):
        q = torch.randn(B, Hq, 1, 128, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(B, Hkv, 256, 128, device="cuda", dtype=torch.float16) for _ in range(2))
        gqa = Hq != Hkv
        fns = {"ours": lambda: cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
               "torch": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)}
        print(f"(B={B}, Hq={Hq}, Hkv={Hkv}, S=256): " +
              ", ".join(f"{n} {per_call_us(fn):.1f} µs/call" for n, fn in fns.items()))
    print_profile(fns["ours"], 2000)


if __name__ == "__main__":
    main()
