"""Benchmark of the Hopper scores kernel alone (kernels/scores_sm90.py): P = softmax(scale · Q Kᵀ) in the input dtype
and lse, whole rows of S ≤ 512 keys on chip, as the split path runs it (the persistent variant, CUPY_ATTN_SPLIT_FUSED's
default).

Rows: the kernel's launch on prepared inputs, median of CUDA-event timings; TFLOP/s of 2·B·H·L·S·E (halved for causal);
TB/s of Q, K read and P written. The seed (32, 32, 512, 512, 1024) and its causal variant, and a shorter row
(bench/experiments/split/scores_sm90.py has the variants' A/B).

    PYTHONPATH=. python3 bench/bench_scores_sm90.py [--quick]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import kernel_main, kernel_row, randn  # noqa: E402

CASES = (  # (name, (B, H, L, S, E), causal, dtype)
    ("seed", (32, 32, 512, 512, 1024), None, "float16"),
    ("seed causal", (32, 32, 512, 512, 1024), "top_left", "float16"),
    ("S=300", (16, 32, 512, 300, 1024), None, "bfloat16"),
)


def benchmark(quick: bool = False) -> list[dict]:
    import cupy

    from cupy_attn.attention import checks
    from cupy_attn.attention.kernels import scores_sm90
    rows = []
    for name, (B, H, L, S, E), causal, dtype in CASES[:1] if quick else CASES:
        q, k = randn((B, H, L, E), dtype, 1), randn((B, H, S, E), dtype, 2)
        ld = -(-S // 8) * 8
        P, lse = cupy.empty((B, H, L, ld), q.dtype), cupy.empty((B, H, L), cupy.float32)
        p = checks.array_problem(q, k, k, None, lse, scale=E ** -0.5, causal=causal)
        launch = scores_sm90.build(p, scores_sm90.choose(p, 3), lse, ld=ld)
        ptrs = (q.data.ptr, k.data.ptr, P.data.ptr, lse.data.ptr)
        flops = 2.0 * B * H * L * S * E / (2 if causal else 1)
        nbytes = (q.nbytes + k.nbytes + P.nbytes)
        rows.append(kernel_row(name, dtype, (B, H, L, S, E), lambda: launch(*ptrs), flops=flops, nbytes=nbytes))
    return rows


if __name__ == "__main__":
    kernel_main(benchmark, __doc__)
