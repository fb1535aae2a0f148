"""Non-causal calls on the scores kernel: P·V by the pv_sm90 kernel (CUPY_ATTN_SPLIT_PV=2) against cuBLAS (=0), whole
public calls (backend="split"), same process, rotated rounds: where the kernel beats the tuned cuBLAS GEMM.

    PYTHONPATH=. python3 bench/experiments/split/pv_sweep.py [--rounds 3] [--dtype float16]
"""
import argparse
import functools
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common


def main():
    import torch

    import cupy_attn
    from cupy_attn.attention.kernels import pv_sm90
    from common import rotated_ms

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--bh", default="8x16,32x32")
    ap.add_argument("--L", default="256,512,1024")
    ap.add_argument("--S", default="128,200,256,300,384,448,512")
    ap.add_argument("--E", default="320,512,768,1024")
    args = ap.parse_args()
    dt = getattr(torch, args.dtype)
    print("B H L S E | kernel ms | cuBLAS ms | cuBLAS/kernel")
    for bh, L, S, E in itertools.product(args.bh.split(","), *(map(int, getattr(args, a).split(",")) for a in "LSE")):
        B, H = map(int, bh.split("x"))
        q = torch.randn(B, H, L, E, device="cuda", dtype=dt)
        k, v = (torch.randn(B, H, S, E, device="cuda", dtype=dt) for _ in range(2))

        def call(mode):
            os.environ[pv_sm90.ENV] = mode
            return cupy_attn.scaled_dot_product_attention(q, k, v, backend="split")

        ms = rotated_ms({"kernel": functools.partial(call, "2"), "cublas": functools.partial(call, "0")}, args.rounds)
        print(f"{B} {H} {L} {S} {E} | {ms['kernel']:.3f} | {ms['cublas']:.3f} | {ms['cublas'] / ms['kernel']:.3f}",
              flush=True)
    os.environ.pop(pv_sm90.ENV, None)


if __name__ == "__main__":
    main()
