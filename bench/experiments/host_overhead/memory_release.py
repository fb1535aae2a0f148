"""Device memory held after the seed call, and its per-call time, with the workspaces the call gives back (issue 35).

One process, the seed shape (32, 32, 512, 1024) fp16 torch tensors (bench_sdpa.py's SEED: the split path, scores
kernel then cuBLAS P·V), first the memory, then the time:

1. baseline: after torch's CUDA set-up and the inputs, torch.cuda.empty_cache();
2. after the first call (compile from the cache, cuBLASLt tuning, the output alive), after dropping the output and
   empty_cache, and after cupy_attn.release_memory() (and graphs=True) and empty_cache: device memory taken beyond
   the baseline (torch.cuda.mem_get_info), torch's reserved bytes, CuPy's pool;
3. the time of repeated calls: ``idle ms`` (median of events around a call on an idle GPU, as bench_sdpa.py's ms
   column), ``device ms`` (the call queued behind a spin kernel: device work only) and ``host us`` (one call's
   enqueue), each in rounds; compare with bench/RESULTS.md's seed rows (fp16 split 2.254 ms before this change, the
   cuBLASLt workspace then a persistent buffer of a torch MemPool instead of a region of the call's scratch).

    PYTHONPATH=. python3 bench/experiments/host_overhead/memory_release.py [--shape B,H,L,D] [--dtype bfloat16]
        [--warm]   # first a small split call with a cuBLAS GEMM (CuPy's and cuBLASLt's handles, nvmath), released,
                   # so that the held memory after the seed call is the seed call's own, not the library's set-up
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cupy_attn  # noqa: E402
from common import device_ms, host_us, median_ms  # noqa: E402

MiB = 1 << 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="32,32,512,1024", help="B,H,L=S,D (default: the seed)")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warm", action="store_true")
    args = ap.parse_args()
    B, H, L, D = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    import cupy
    pool = cupy.get_default_memory_pool()

    torch.cuda.init()
    if args.warm:  # the library's one-time set-up outside the baseline (a B·H·L > 32768 call: cuBLAS P·V)
        w = torch.randn(1, 80, 512, 320, device="cuda", dtype=dtype)
        cupy_attn.scaled_dot_product_attention(w, w, w, backend="split")
        del w
        cupy_attn.release_memory(graphs=True)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype) for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0, reserved0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()

    def report(what):
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        print(f"{what:44s} held {(free0 - free) / MiB:8.1f} MiB   torch reserved "
              f"{(torch.cuda.memory_reserved() - reserved0) / MiB:8.1f} MiB   CuPy pool {pool.total_bytes() / MiB:6.1f} "
              f"MiB", flush=True)

    print(f"shape {(B, H, L, L, D)} {args.dtype}; output {B * H * L * D * q.element_size() / MiB:.0f} MiB")
    print(cupy_attn.explain(q, k, v), "\n")
    out = cupy_attn.scaled_dot_product_attention(q, k, v)
    report("first call, output alive")
    del out
    report("output dropped")
    torch.cuda.empty_cache()
    report("+ torch.cuda.empty_cache()")
    cupy_attn.release_memory()
    torch.cuda.empty_cache()
    report("+ release_memory() + empty_cache()")
    cupy_attn.release_memory(graphs=True)
    torch.cuda.empty_cache()
    report("+ release_memory(graphs=True) + empty_cache()")
    for _ in range(10):
        cupy_attn.scaled_dot_product_attention(q, k, v)
    torch.cuda.empty_cache()
    report("after 10 more calls + empty_cache()")

    def call():
        cupy_attn.scaled_dot_product_attention(q, k, v)

    idle, dev, host = [], [], []
    for _ in range(args.rounds):
        idle.append(median_ms(call, n_repeat=20))
        dev.append(device_ms(call))
        host.append(host_us(call))
    print(f"\nper call over {args.rounds} rounds (median [min, max] of the rounds' medians):")
    for name, xs, unit in (("idle", idle, "ms"), ("device", dev, "ms"), ("host", host, "us")):
        print(f"  {name:6s} {np.median(xs):9.4f} {unit} [{min(xs):.4f}, {max(xs):.4f}]")


if __name__ == "__main__":
    main()
