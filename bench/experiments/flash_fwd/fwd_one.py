"""One forward call, repeated three times, for a profiler (ncu): (B, H, L, D) from argv, fp16; `causal` makes it
causal, `torch` profiles torch's default SDPA (cuDNN on Hopper) instead of ours.

    PYTHONPATH=. ncu --section SpeedOfLight ... python3 bench/experiments/flash_fwd/fwd_one.py 8 16 2048 128 [causal] [torch]
"""
import sys

import torch
import torch.nn.functional as F

import cupy_attn


def main():
    B, H, L, D = (int(x) for x in sys.argv[1:5])
    causal = "causal" in sys.argv
    fn = F.scaled_dot_product_attention if "torch" in sys.argv else cupy_attn.scaled_dot_product_attention
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16) for _ in range(3))
    for _ in range(3):
        fn(q, k, v, is_causal=causal)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
