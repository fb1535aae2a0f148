"""A/B of the persistent scores kernel: the working tree's source against a baseline copy, same process, rotated
rounds, kernel alone (device time of the launch, cupyx.profiler.benchmark), and P / lse compared bit for bit.

    git show REV:cuda_src/attention/scores_softmax_sm90.cu > cuda_src/attention/scores_ab_base.cu   # on the CPU host
    PYTHONPATH=. python3 bench/experiments/split/scores_ab.py [--shape B,H,L,S,E] [--dtype float16] [--causal] [--rounds 5]

The baseline file is a scratch copy (not committed); it includes the tree's common/ headers.
"""
import argparse
import dataclasses

import cupy
import numpy as np
import torch
from cupyx.profiler import benchmark

from cupy_attn.attention import checks
from cupy_attn.attention.kernels import scores_sm90

BASE = "attention/scores_ab_base.cu"


def launch_for(family, q, k, lse, ld, causal):
    """The persistent kernel's launch (variant 3) prepared from `family` (a variant of SCORES_SOFTMAX_SM90: another
    source or options) in place of the declared one."""
    saved = scores_sm90.SCORES_SOFTMAX_SM90
    scores_sm90.SCORES_SOFTMAX_SM90 = family
    try:
        prob = checks.array_problem(q, k, k, None, lse, scale=q.shape[-1] ** -0.5, causal=causal)
        return scores_sm90.build(prob, scores_sm90.choose(prob, 3), lse, ld=ld)
    finally:
        scores_sm90.SCORES_SOFTMAX_SM90 = saved


def problem(ap):
    """Parse --shape/--dtype/--causal (and the caller's own arguments on `ap`): (args, (B, H, L, S, E), torch dtype,
    q, k as CuPy views of fresh random torch tensors, P's row pitch ld, causal)."""
    ap.add_argument("--shape", default="32,32,512,512,1024")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    B, H, L, S, E = map(int, args.shape.split(","))
    tdt = getattr(torch, args.dtype)
    q = cupy.from_dlpack(torch.randn(B, H, L, E, device="cuda", dtype=tdt))
    k = cupy.from_dlpack(torch.randn(B, H, S, E, device="cuda", dtype=tdt))
    return args, (B, H, L, S, E), tdt, q, k, -(-S // 8) * 8, "top_left" if args.causal else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args, (B, H, L, S, E), tdt, q, k, ld, causal = problem(ap)
    fams = {"base": dataclasses.replace(scores_sm90.SCORES_SOFTMAX_SM90, source=BASE),
            "tree": scores_sm90.SCORES_SOFTMAX_SM90}
    outs, launches = {}, {}
    for name, fam in fams.items():
        p = torch.empty(B * H * L * ld, device="cuda", dtype=tdt)
        lse = cupy.empty((B, H, L), cupy.float32)
        launches[name] = launch_for(fam, q, k, lse, ld, causal)
        outs[name] = (p, lse)
    ptrs = {n: (q.data.ptr, k.data.ptr, outs[n][0].data_ptr(), outs[n][1].data.ptr) for n in fams}
    for n in fams:
        launches[n](*ptrs[n])
    cupy.cuda.Device().synchronize()
    same_p = torch.equal(outs["base"][0], outs["tree"][0])
    same_lse = bool((outs["base"][1] == outs["tree"][1]).all())
    print(f"{args.shape} {args.dtype} causal={args.causal}: P identical {same_p}, lse identical {same_lse}")
    times = {n: [] for n in fams}
    order = list(fams)
    for r in range(args.rounds):
        for n in (order if r % 2 == 0 else order[::-1]):
            t = benchmark(lambda n=n: launches[n](*ptrs[n]), n_repeat=30, n_warmup=5).gpu_times
            times[n].append(float(np.median(t)) * 1e3)
    flops = 2 * B * H * L * S * E / (2 if args.causal else 1)
    for n in fams:
        med = float(np.median(times[n]))
        print(f"  {n:5s} {med:.4f} ms ({flops / med / 1e9:.0f} TFLOP/s)  rounds " +
              " ".join(f"{t:.4f}" for t in times[n]))
    print(f"  tree / base: {np.median(times['tree']) / np.median(times['base']):.4f}")


if __name__ == "__main__":
    main()
