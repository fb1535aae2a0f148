"""Per-kernel device times of one public call (torch.profiler, CUDA activity), averaged over repeats: which kernels a
call launches and how long each takes on the GPU.

    PYTHONPATH=. [CAUSAL_BANDS=n] python3 bench/experiments/tools/kernel_times.py [--shape B,H,L,S,D] [--dtype float16]
"""
import argparse
import collections
import os

import torch

import cupy_attn


def kernel_times(fn, repeats=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    tot = collections.defaultdict(float)
    cnt = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            cnt[e.name] += 1
    return {k: (v / repeats, cnt[k] / repeats) for k, v in tot.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="32,32,512,512,1024")
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()
    if os.environ.get("CAUSAL_BANDS"):  # the split path's causal row bands, forced (A/B): both paths' rules
        from cupy_attn.attention.paths import split
        split.causal_row_bands = split.cublas_causal_bands = lambda L: int(os.environ["CAUSAL_BANDS"])
    B, H, L, S, D = map(int, args.shape.split(","))
    dt = getattr(torch, args.dtype)
    q = torch.randn(B, H, L, D, device="cuda", dtype=dt)
    k, v = torch.randn(B, H, S, D, device="cuda", dtype=dt), torch.randn(B, H, S, D, device="cuda", dtype=dt)
    for causal in (False, True):
        t = kernel_times(lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal))
        total = sum(v[0] for v in t.values())
        print(f"{(B, H, L, S, D)} {args.dtype} causal={causal}: device total {total / 1e3:.3f} ms per call")
        for name, (us, n) in sorted(t.items(), key=lambda kv: -kv[1][0]):
            print(f"   {us:9.1f} us  x{n:.0f}  {name[:110]}")


if __name__ == "__main__":
    main()
