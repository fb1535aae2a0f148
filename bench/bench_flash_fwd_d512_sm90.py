"""Benchmark of the head-dim 257-512 forward kernel alone (kernels/flash_fwd_d512_sm90.py, Hopper).

Rows: the kernel's launch on prepared inputs (no host work but the launch), median of CUDA-event timings; TFLOP/s of
4·B·H·L·S·D (halved for causal). The shapes are those its dispatch rule was measured on (bench/notes/split.md).

    PYTHONPATH=. python3 bench/bench_flash_fwd_d512_sm90.py [--quick]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import kernel_main, kernel_row, randn  # noqa: E402

CASES = (  # (name, (B, H, L, S, D), causal, dtype)
    ("d512", (4, 16, 2048, 2048, 512), None, "float16"),
    ("d512 causal", (4, 16, 2048, 2048, 512), "top_left", "float16"),
    ("d512 long", (2, 8, 4096, 4096, 512), None, "bfloat16"),
    ("d384", (4, 16, 2048, 2048, 384), None, "float16"),
)


def benchmark(quick: bool = False) -> list[dict]:
    import cupy

    from cupy_attn.attention import checks
    from cupy_attn.attention.kernels import flash_fwd_d512_sm90 as d512
    rows = []
    for name, (B, H, L, S, D), causal, dtype in CASES[:1] if quick else CASES:
        q, k, v = randn((B, H, L, D), dtype, 1), randn((B, H, S, D), dtype, 2), randn((B, H, S, D), dtype, 3)
        out, lse = cupy.empty_like(q), cupy.empty((B, H, L), cupy.float32)
        p = checks.array_problem(q, k, v, out, lse, scale=D ** -0.5, causal=causal)
        launch = d512.build(p, d512.Choice(), out, lse)
        ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr)
        flops = 4.0 * B * H * L * S * D / (2 if causal else 1)
        rows.append(kernel_row(name, dtype, (B, H, L, S, D), lambda: launch(*ptrs), flops=flops))
    return rows


if __name__ == "__main__":
    kernel_main(benchmark, __doc__)
