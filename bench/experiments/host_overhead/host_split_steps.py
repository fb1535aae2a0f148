"""Host time of a cached split-path call (the seed shape on the scores kernel), step by step: which host work runs
before its first kernel starts (what an idle-GPU timing counts) and after.

    PYTHONPATH=. python3 bench/experiments/host_overhead/host_split_steps.py [--shape B,H,L,S,D]

Wraps the hot path's functions with perf_counter_ns timers (callcache.key, the cache entry's replay,
workspace.scratch, the tensor maps of the scores and P·V launches) and prints the median µs of each over
200 calls, each started on an idle GPU (synchronized before), plus idle-vs-device milliseconds (host_gap.py's).
"""
import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cupy_attn  # noqa: E402
from common import device_ms, median_ms  # noqa: E402

TIMES = collections.defaultdict(list)


def timed(owner, name, label):
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            TIMES[label].append((time.perf_counter_ns() - t) / 1e3)
    setattr(owner, name, wrapper)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="32,32,512,512,1024")
    args = ap.parse_args()
    B, H, L, S, D = map(int, args.shape.split(","))
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(2))
    fn = lambda: cupy_attn.scaled_dot_product_attention(q, k, v)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    print(f"idle {median_ms(fn, n_repeat=20):.4f} ms, device {device_ms(fn):.4f} ms")
    from cupy_attn.runtime import callcache, tma, workspace
    timed(callcache, "key", "callcache.key")
    timed(callcache.Entry, "__call__", "entry (alloc out + run)")
    timed(workspace, "scratch", "workspace.scratch")
    timed(tma.TensorMaps, "__call__", "tensor maps")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    TIMES.clear()
    walls = []
    for _ in range(200):
        torch.cuda.synchronize()
        t = time.perf_counter_ns()
        fn()
        walls.append((time.perf_counter_ns() - t) / 1e3)
    torch.cuda.synchronize()
    print(f"whole call (host wall) median {np.median(walls):.1f} µs")
    for label, xs in TIMES.items():
        print(f"  {label:28s} {np.median(xs):7.1f} µs  (x{len(xs) // 200} per call)")


if __name__ == "__main__":
    main()
