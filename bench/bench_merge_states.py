"""Benchmark of merge_attention_states (kernels/merge_states.py): two partial results and their lse merged into one.

Rows: the public call on CuPy arrays (the kernel and the call's host work), median of CUDA-event timings; TB/s of
out_a, out_b and both lse read and out and lse written (the kernel is bandwidth-bound: the copy ceiling is 4.2-4.3
TB/s on an H200). Decode-sized (a split-KV combine of one query row per head) and prefill-sized rows.

    PYTHONPATH=. python3 bench/bench_merge_states.py [--quick]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import kernel_main, kernel_row, randn  # noqa: E402

CASES = (  # (name, (B, H, L, Ev), dtype)
    ("prefill", (8, 32, 2048, 128), "bfloat16"),
    ("decode", (64, 32, 1, 128), "bfloat16"),
    ("prefill fp32", (8, 32, 2048, 128), "float32"),
)


def benchmark(quick: bool = False) -> list[dict]:
    import cupy

    import cupy_attn
    rows = []
    for name, (B, H, L, Ev), dtype in CASES[:1] if quick else CASES:
        oa, ob = randn((B, H, L, Ev), dtype, 1), randn((B, H, L, Ev), dtype, 2)
        la, lb = (randn((B, H, L), "float32", s) for s in (3, 4))
        out_bytes = oa.nbytes
        lse_bytes = la.nbytes
        nbytes = 3 * out_bytes + 3 * lse_bytes
        rows.append(kernel_row(name, dtype, (B, H, L, Ev), lambda: cupy_attn.merge_attention_states(oa, la, ob, lb),
                               nbytes=nbytes))
        del oa, ob, la, lb
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


if __name__ == "__main__":
    kernel_main(benchmark, __doc__)
