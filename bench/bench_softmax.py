"""Benchmark of the split path's mask + softmax pass alone (kernels/softmax.py) over an fp32 score buffer.

Rows: one pass over B·H·L rows of S scores (pitch ⌈S/8⌉·8), P written in place in the input dtype, lse written; median
of CUDA-event timings; TB/s of the fp32 scores read and P written. The fp16 seed's buffer (1024 heads of 512 × 512:
what the split path runs where the Hopper scores kernel does not), its causal variant, and a long row
(bench/experiments/split/probe_softmax.py has the tile A/B).

    PYTHONPATH=. python3 bench/bench_softmax.py [--quick]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import kernel_main, kernel_row, randn  # noqa: E402

CASES = (  # (name, (heads, L, S), causal, dtype)
    ("seed", (1024, 512, 512), None, "float16"),
    ("seed causal", (1024, 512, 512), "top_left", "float16"),
    ("S=8192", (64, 1024, 8192), None, "bfloat16"),
)


def benchmark(quick: bool = False) -> list[dict]:
    import cupy

    from cupy_attn.attention import checks
    from cupy_attn.attention.kernels import softmax
    rows = []
    for name, (heads, L, S), causal, dtype in CASES[:1] if quick else CASES:
        ld = -(-S // 8) * 8
        scores = randn((heads, L, ld), "float32", 1)
        lse = cupy.empty((heads, L), cupy.float32)
        q, k = randn((1, heads, L, 8), dtype, 2), randn((1, heads, S, 8), dtype, 3)
        p = checks.array_problem(q, k, k, scale=1.0, causal=causal)
        # All heads as one GEMM batch axis: lse row stride L, Philox's (batch, head) index stepping by 1.
        base = softmax.base_params(p, ld, [(1, 0, 0, 0), (1, 0, 0, 0), (heads, 0, L, 1)])
        launch = softmax.build(p, base, batches=heads, rows=L, row0=0, batch0=0, bh0=0, seqlen_k=S)
        ptrs = (scores.data.ptr, 0, lse.data.ptr, 0)
        nbytes = scores.nbytes * (1 + q.itemsize / 4)
        rows.append(kernel_row(name, dtype, (heads, L, S), lambda: launch(*ptrs), nbytes=nbytes))
    return rows


if __name__ == "__main__":
    kernel_main(benchmark, __doc__)
