"""Benchmark of the Hopper P·V kernel alone (kernels/pv_sm90.py): out = P V after the scores kernel, each 64-row block
of a causal call stopping at its visible keys.

Rows: the kernel's launch on prepared inputs (P as the scores kernel writes it: rows of probabilities, 0 past each
row's causal limit), median of CUDA-event timings; TFLOP/s of 2·B·H·L·S·Ev (halved for causal); TB/s of P and V read
and out written. The seed's causal variant, where the split path runs it, and an S off the 8-key grid, where it beats
cuBLAS (bench/experiments/split/pv_sweep.py has the sweep against cuBLAS).

    PYTHONPATH=. python3 bench/bench_pv_sm90.py [--quick]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import kernel_main, kernel_row, randn  # noqa: E402

CASES = (  # (name, (B, H, L, S, Ev), causal, dtype)
    ("seed causal", (32, 32, 512, 512, 1024), "top_left", "float16"),
    ("S=300", (8, 16, 1024, 300, 512), None, "float16"),
    ("seed", (32, 32, 512, 512, 1024), None, "bfloat16"),
)


def benchmark(quick: bool = False) -> list[dict]:
    import cupy

    from cupy_attn.attention import checks
    from cupy_attn.attention.kernels import pv_sm90
    rows = []
    for name, (B, H, L, S, Ev), causal, dtype in CASES[:1] if quick else CASES:
        ld = -(-S // 8) * 8
        P = cupy.abs(randn((B, H, L, ld), dtype, 1)) / S
        v, out = randn((B, H, S, Ev), dtype, 2), cupy.empty((B, H, L, Ev), P.dtype)
        q = randn((B, H, L, 8), dtype, 3)  # the problem's query: only its shape is read
        p = checks.array_problem(q, q[:, :, :1].repeat(S, axis=2), v, out, scale=1.0, causal=causal)
        launch = pv_sm90.build(p, out, ld=ld)
        ptrs = (P.data.ptr, v.data.ptr, out.data.ptr)
        flops = 2.0 * B * H * L * S * Ev / (2 if causal else 1)
        nbytes = P.nbytes + v.nbytes + out.nbytes
        rows.append(kernel_row(name, dtype, (B, H, L, S, Ev), lambda: launch(*ptrs), flops=flops, nbytes=nbytes))
    return rows


if __name__ == "__main__":
    kernel_main(benchmark, __doc__)
