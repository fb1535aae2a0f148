"""One decode call, repeated, for a profiler (ncu): (B, Hq, Hkv, S) from argv, L = 1, D = 128, bf16,
CUPY_ATTN_DECODE as set by the caller.

    ncu --section SpeedOfLight ... python3 bench/experiments/decode_one.py 16 64 8 8192
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import cupy_attn  # noqa: E402


def main(B=16, Hq=64, Hkv=8, S=8192, reps=3):
    q = torch.randn(B, Hq, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(reps):
        cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != Hkv)
    torch.cuda.synchronize()
    print(cupy_attn.explain(q, k, v, enable_gqa=Hq != Hkv))


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:5]))
