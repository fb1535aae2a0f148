"""Benchmark of the mma.sync fused backward alone (kernels/flash_bwd.py, sm_80+, head dims up to 128): rows of
common.fused_backward_rows (one prepared backward on the forward's out and lse, TFLOP/s of 2.5 forwards) at the
forward benchmark's head dims 64 and 128. bench/bench_backward.py times whole training steps against torch.

    PYTHONPATH=. python3 bench/bench_flash_bwd.py [--quick]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import fused_backward_rows, kernel_main  # noqa: E402

CASES = (  # (name, (B, H, L, D), causal, dtype)
    ("d64", (4, 32, 2048, 64), None, "float16"),
    ("d128", (8, 16, 2048, 128), None, "float16"),
    ("d128 causal", (2, 16, 8192, 128), "top_left", "bfloat16"),
)


def benchmark(quick: bool = False) -> list[dict]:
    from cupy_attn.attention.kernels import flash_bwd
    return fused_backward_rows("flash_bwd", flash_bwd.head_dim_bucket, CASES, quick)


if __name__ == "__main__":
    kernel_main(benchmark, __doc__)
