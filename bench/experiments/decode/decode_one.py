"""One decode call, repeated, for a profiler (ncu): (B, Hq, Hkv, S) from argv, L = 1, D = 128, bf16,
CUPY_ATTN_DECODE as set by the caller. A fifth argument `torch` profiles torch's own SDPA call instead
(its default backend), to compare the two kernels' launch shape and memory traffic.

    PYTHONPATH=. ncu --section SpeedOfLight ... python3 bench/experiments/decode/decode_one.py 16 64 8 8192
    PYTHONPATH=. ncu --set full ... python3 bench/experiments/decode/decode_one.py 8 32 32 32768 torch
"""
import sys

import torch

import cupy_attn


def main(B=16, Hq=64, Hkv=8, S=8192, who="ours", reps=3):
    q = torch.randn(B, Hq, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    call = (torch.nn.functional.scaled_dot_product_attention if who == "torch"
            else cupy_attn.scaled_dot_product_attention)
    for _ in range(reps):
        call(q, k, v, enable_gqa=Hq != Hkv)
    torch.cuda.synchronize()
    if who != "torch":
        print(cupy_attn.explain(q, k, v, enable_gqa=Hq != Hkv))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*(int(x) for x in args[:4]), *args[4:5])
