"""Benchmark of the Hopper fused backward alone (kernels/flash_bwd_sm90.py, head dims up to 256): rows of
common.fused_backward_rows on the shapes of bench_backward.py's training steps (bench/experiments/backward/bwd_sm90.py
compares it with the mma.sync and split backwards).

    PYTHONPATH=. python3 bench/bench_flash_bwd_sm90.py [--quick]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import fused_backward_rows, kernel_main  # noqa: E402

CASES = (  # (name, (B, H, L, D), causal, dtype)
    ("d128", (8, 16, 2048, 128), None, "float16"),
    ("d64", (4, 32, 4096, 64), None, "float16"),
    ("d128 causal", (2, 16, 8192, 128), "top_left", "bfloat16"),
    ("d256", (8, 16, 1024, 256), None, "float16"),
)


def benchmark(quick: bool = False) -> list[dict]:
    from cupy_attn.attention.kernels import flash_bwd_sm90
    return fused_backward_rows("flash_bwd_sm90", flash_bwd_sm90.head_bucket, CASES, quick)


if __name__ == "__main__":
    kernel_main(benchmark, __doc__)
