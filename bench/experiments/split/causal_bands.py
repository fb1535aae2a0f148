"""Causal split calls by row bands, A/B over the band count and the number of streams the bands run on at once
(split.cublas_causal_bands / split.causal_row_bands, split.causal_streams): time of a causal call against the same
call without causal, and torch's, same process. Rows: (2, 8, 4096, 4096, 512) bf16 and (8, 16, 2048, 2048, 512) fp16 on
the cuBLAS split path; the seed (32, 32, 512, 512, 1024) fp16 on the scores kernel (only P·V is banded there).

    PYTHONPATH=. python3 bench/experiments/split/causal_bands.py [--bands 1,4,8,16] [--streams 1,2,4]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cupy_attn  # noqa: E402
from cupy_attn.attention.paths import split  # noqa: E402
from cupy_attn.runtime import callcache  # noqa: E402
from common import median_ms  # noqa: E402

SHAPES = ((2, 8, 4096, 512, torch.bfloat16, "cublas_causal_bands"), (8, 16, 2048, 512, torch.float16,
          "cublas_causal_bands"), (32, 32, 512, 1024, torch.float16, "causal_row_bands"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bands", default="1,4,8,16")
    ap.add_argument("--streams", default="1,2,4")
    ap.add_argument("--shapes", default="0,1,2", help="indices into SHAPES")
    args = ap.parse_args()
    bands = [int(x) for x in args.bands.split(",")]
    streams = [int(x) for x in args.streams.split(",")]
    for i in (int(x) for x in args.shapes.split(",")):
        B, H, L, D, dt, rule = SHAPES[i]
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dt) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        flops = 4 * B * H * L * L * D
        base = median_ms(lambda: cupy_attn.scaled_dot_product_attention(q, k, v))
        t_torch = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        print(f"({B},{H},{L},{L},{D}) {dt}: non-causal {base:.3f} ms ({flops / base / 1e9:.0f} TFLOP/s); "
              f"torch causal {t_torch:.3f} ms; bands by split.{rule}", flush=True)
        for n in bands:
            for ns in streams:
                setattr(split, rule, lambda L_, n=n: n)
                split.causal_streams = lambda L_, b, ns=ns: ns
                split._SCHEDULES.clear()
                callcache.clear()
                out = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
                err = (out.float() - ref).abs().max().item()
                ms = median_ms(lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True))
                print(f"  {n:2d} bands, {ns} streams: causal {ms:.3f} ms = {ms / base:.3f}x non-causal, "
                      f"{flops / 2 / ms / 1e9:.0f} TFLOP/s counted, {t_torch / ms:.2f}x torch, max err {err:.2e}",
                      flush=True)


if __name__ == "__main__":
    main()
