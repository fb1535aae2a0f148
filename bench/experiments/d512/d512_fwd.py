"""The head-dim-512 fused kernel (fused_d512) against the split path and torch's default, same process, alternating
rounds (common.interleaved_ms): whole calls through the public API, ms and TFLOP/s (4·B·H·L·S·D, halved for causal),
max error against a float64 reference of the first head.

    PYTHONPATH=. python3 bench/experiments/d512/d512_fwd.py [--quick]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import numpy as np  # noqa: E402

from common import interleaved_ms, tflops  # noqa: E402

SHAPES = [  # (B, H, L, S, D, dtype, causal)
    (4, 16, 2048, 2048, 512, "float16", False),
    (4, 16, 2048, 2048, 512, "float16", True),
    (2, 8, 4096, 4096, 512, "bfloat16", False),
    (2, 8, 4096, 4096, 512, "bfloat16", True),
    (8, 16, 1024, 1024, 512, "float16", False),
    (4, 16, 2048, 2048, 384, "float16", False),
    (4, 16, 2048, 2048, 320, "bfloat16", True),
]


def main():
    import torch

    import cupy_attn
    from cupy_attn import reference
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    shapes = SHAPES[:4] if args.quick else SHAPES
    print("| (B,H,L,S,D) | dtype | causal | d512 ms | TFLOP/s | split ms | torch ms | split/d512 | torch/d512 | "
          "err d512 | err split |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for B, H, L, S, D, dname, causal in shapes:
        dt = getattr(torch, dname)
        q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=dt) for n in (L, S, S))

        def d512():
            os.environ["CUPY_ATTN_D512"] = "1"
            try:
                return cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal)
            finally:
                del os.environ["CUPY_ATTN_D512"]

        def split():
            return cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal, backend="split")

        def theirs():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        ref = reference.scaled_dot_product_attention(*(x[:1, :1].double().cpu().numpy() for x in (q, k, v)),
                                                     is_causal=causal)
        errs = [float(np.abs(f()[:1, :1].double().cpu().numpy() - ref).max()) for f in (d512, split)]
        ms = interleaved_ms((d512, split, theirs), 5, 6, 5)
        flops = 4 * B * H * L * S * D / (2 if causal else 1)
        print(f"| ({B},{H},{L},{S},{D}) | {dname} | {causal} | {ms[0]:.3f} | {tflops(flops, ms[0]):.0f} | "
              f"{ms[1]:.3f} | {ms[2]:.3f} | {ms[1] / ms[0]:.2f} | {ms[2] / ms[0]:.2f} | {errs[0]:.2e} | {errs[1]:.2e} |",
              flush=True)


if __name__ == "__main__":
    main()
