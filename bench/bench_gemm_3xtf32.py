"""Benchmark of the 3xTF32 GEMM alone (kernels/gemm_3xtf32.py): the fp32 split path's two GEMMs at fp32 accuracy.

Rows: the fp32 seed's (32, 32, 512, 512, 1024) Q·Kᵀ and P·V as the split path issues them (one batch of 1024 heads,
or 64 with --quick), median of CUDA-event timings; TFLOP/s of 2·batch·m·n·k
(bench/experiments/gemm/gemm_3xtf32.py compares it with cuBLAS SGEMM and measures its accuracy).

    PYTHONPATH=. python3 bench/bench_gemm_3xtf32.py [--quick]
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import kernel_main, kernel_row, randn  # noqa: E402

LOG2E = 1.4426950408889634
CASES = (  # (name, m, n, k, trans_b, alpha)
    ("Q·Kᵀ", 512, 512, 1024, True, 1024 ** -0.5 * LOG2E),
    ("P·V", 512, 1024, 512, False, 1.0),
)


def benchmark(quick: bool = False) -> list[dict]:
    import cupy

    from cupy_attn.attention.kernels import gemm_3xtf32
    batch = 64 if quick else 1024
    rows = []
    for name, m, n, k, trans_b, alpha in CASES:
        a, b = randn((batch, m, k), "float32", 1), randn((batch, n, k) if trans_b else (batch, k, n), "float32", 2)
        c = cupy.empty((batch, m, n), cupy.float32)
        gemm = gemm_3xtf32.Gemm3xTF32(c_dtype=np.float32, ldc=n, stride_c=m * n, a_dtype=np.float32, lda=k,
                                      stride_a=m * k, trans_a=False, b_dtype=np.float32, ldb=k if trans_b else n,
                                      stride_b=n * k, trans_b=trans_b, m=m, n=n, k=k, batch=batch, alpha=alpha)
        rows.append(kernel_row(name, "float32", (batch, m, n, k), lambda: gemm(c.data.ptr, a.data.ptr, b.data.ptr),
                               flops=2.0 * batch * m * n * k))
    return rows


if __name__ == "__main__":
    kernel_main(benchmark, __doc__)
