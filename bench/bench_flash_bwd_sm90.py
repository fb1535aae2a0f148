"""Benchmark of the Hopper fused backward alone (kernels/flash_bwd_sm90.py; head dims up to 256).

Rows: one backward (the D pre-pass, the kernel, dQ's rounding) on the forward's out and lse, prepared once
(kernels/flash_bwd_sm90.py's build, as the autograd backward's call cache replays it), median of CUDA-event timings; TFLOP/s
of 2.5 forwards (FlashAttention's count: 2.5 · 4·B·H·L·S·D, halved for causal). bench/bench_backward.py times whole
training steps against torch; bench/experiments/backward/bwd_sm90.py compares the backwards.

    PYTHONPATH=. python3 bench/bench_flash_bwd_sm90.py [--quick]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import kernel_main, kernel_row, randn  # noqa: E402

CASES = (  # (name, (B, H, L, D), causal, dtype)
    ("d128", (8, 16, 2048, 128), None, "float16"),
    ("d64", (4, 32, 4096, 64), None, "float16"),
    ("d128 causal", (2, 16, 8192, 128), "top_left", "bfloat16"),
    ("d256", (8, 16, 1024, 256), None, "float16"),
)


def benchmark(quick: bool = False) -> list[dict]:
    import cupy

    import cupy_attn
    from cupy_attn.attention import checks
    from cupy_attn.attention.kernels import flash_bwd_sm90
    rows = []
    for name, (B, H, L, D), causal, dtype in CASES[:1] if quick else CASES:
        q, k, v, dout = (randn((B, H, L, D), dtype, seed) for seed in range(4))
        out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal is not None, return_lse=True)
        dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
        p = checks.array_problem(q, k, v, out, lse, scale=D ** -0.5, causal=causal)
        launch = flash_bwd_sm90.build(p, flash_bwd_sm90.head_bucket(D, D))
        ptrs = tuple(a.data.ptr for a in (q, k, v, out, lse, dout, dq, dk, dv))
        flops = 2.5 * 4.0 * B * H * L * L * D / (2 if causal else 1)
        rows.append(kernel_row(name, dtype, (B, H, L, D), lambda: launch(*ptrs), flops=flops))
    return rows


if __name__ == "__main__":
    kernel_main(benchmark, __doc__)
