"""The cost of attention dropout: forward and forward + backward with dropout_p = 0 and 0.1, ours (fused and split
paths) and torch's SDPA (its default backend), fp16, at the shapes of bench_flash_fwd.

    PYTHONPATH=. python3 bench/experiments/backward/dropout.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import torch  # noqa: E402

import cupy_attn  # noqa: E402
from common import median_ms  # noqa: E402

F = torch.nn.functional
SHAPES = ((8, 16, 2048, 128, False), (4, 32, 4096, 64, False), (2, 16, 8192, 128, True), (8, 16, 1024, 256, False))


def main():
    for B, H, L, D, causal in SHAPES:
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
        dout = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
        flops = 4.0 * B * H * L * L * D / (2 if causal else 1)
        print(f"({B},{H},{L},{D}){' causal' if causal else ''} fp16", flush=True)
        for p in (0.0, 0.1):
            for name, fn in (("ours fused", lambda: cupy_attn.scaled_dot_product_attention(
                                 q, k, v, dropout_p=p, is_causal=causal, backend="fused")),
                             ("ours split", lambda: cupy_attn.scaled_dot_product_attention(
                                 q, k, v, dropout_p=p, is_causal=causal, backend="split")),
                             ("torch", lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=p,
                                                                              is_causal=causal))):
                with torch.no_grad():
                    fwd = median_ms(fn, n_repeat=10)
                both = median_ms(lambda: fn().backward(dout), n_repeat=5)
                print(f"  p={p} {name:10s} forward {fwd:7.3f} ms {flops / fwd / 1e9:5.0f} TFLOP/s   "
                      f"forward+backward {both:7.3f} ms", flush=True)


if __name__ == "__main__":
    main()
