"""Causal against non-causal time on the split path (head dims > 256), same process: issue 14's "causal ≤ 0.6×".

    PYTHONPATH=. python3 bench/experiments/split/causal_split.py [--bands 2,4,8] [--quick]

--bands: also time the causal calls with split.causal_row_bands forced to each count (one process per count: the
schedule and call caches are per process). --quick: the seed shapes only.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import torch  # noqa: E402

import cupy_attn  # noqa: E402
from common import median_ms  # noqa: E402


def main():
    import argparse
    import subprocess
    ap = argparse.ArgumentParser()
    ap.add_argument("--bands", default="")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    forced = os.environ.get("CAUSAL_BANDS")
    if forced:
        from cupy_attn.attention.paths import split
        split.causal_row_bands = lambda L: int(forced)
    F = torch.nn.functional
    cases = (((32, 32, 512, 512, 1024), torch.float16), ((32, 32, 512, 512, 1024), torch.bfloat16),
             ((2, 8, 4096, 4096, 512), torch.bfloat16), ((4, 16, 2048, 2048, 512), torch.float16))
    for (B, H, L, S, D), dt in cases[:2] if args.quick else cases:
        q = torch.randn(B, H, L, D, device="cuda", dtype=dt)
        k, v = torch.randn_like(q), torch.randn_like(q)
        full = median_ms(lambda: cupy_attn.scaled_dot_product_attention(q, k, v))
        causal = median_ms(lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True))
        br = median_ms(lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal="bottom_right"))
        tc = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), n_repeat=5)
        fl = 4.0 * B * H * L * S * D
        print(f"{(B, H, L, S, D)} {str(dt)[6:]}: full {full:.3f} ms ({fl / full / 1e9:.0f} TFLOP/s), causal "
              f"{causal:.3f} ms ({fl / 2 / causal / 1e9:.0f}), ratio {causal / full:.3f}; bottom-right {br:.3f}; "
              f"torch causal {tc:.3f} ms (x{tc / causal:.2f})" + (f" [bands forced {forced}]" if forced else ""),
              flush=True)
    for n in filter(None, args.bands.split(",")):
        subprocess.call([sys.executable, __file__, "--quick"], env={**os.environ, "CAUSAL_BANDS": n})


if __name__ == "__main__":
    main()
