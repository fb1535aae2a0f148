"""Causal calls on the cuBLAS split path by row bands (split.cublas_causal_bands), A/B over the band count: time of
(2, 8, 4096, 4096, 512) bf16 causal (and a second shape) against the same call without causal, and torch's.

    PYTHONPATH=. python3 bench/experiments/causal_bands.py [bands ...]   (default: 1 4 8 16)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cupy_attn  # noqa: E402
from cupy_attn.attention import split  # noqa: E402
from cupy_attn.runtime import callcache  # noqa: E402
from common import median_ms  # noqa: E402


def main():
    bands = [int(x) for x in sys.argv[1:]] or [1, 4, 8, 16]
    for (B, H, L, D, dt) in ((2, 8, 4096, 512, torch.bfloat16), (8, 16, 2048, 512, torch.float16)):
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dt) for _ in range(3))
        flops = 4 * B * H * L * L * D
        base = median_ms(lambda: cupy_attn.scaled_dot_product_attention(q, k, v))
        t_torch = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        print(f"({B},{H},{L},{L},{D}) {dt}: non-causal {base:.3f} ms ({flops / base / 1e9:.0f} TFLOP/s); "
              f"torch causal {t_torch:.3f} ms", flush=True)
        for n in bands:
            split.cublas_causal_bands = lambda L_, n=n: n
            split._SCHEDULES.clear()
            callcache.clear()
            ms = median_ms(lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True))
            print(f"  {n:2d} bands: causal {ms:.3f} ms = {ms / base:.3f}x non-causal, {flops / 2 / ms / 1e9:.0f} "
                  f"TFLOP/s counted, {t_torch / ms:.2f}x torch", flush=True)


if __name__ == "__main__":
    main()
