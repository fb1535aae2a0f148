"""Training benchmark: forward + backward of scaled_dot_product_attention, cupy_attn against torch in one process.

    PYTHONPATH=. python3 bench/bench_backward.py [--quick]

Rows: ms of forward + backward (torch.autograd.grad of out against a fixed dout, so no .grad accumulation), TFLOP/s
counting the backward as 2.5× the forward (FlashAttention's convention: FLOPs = 3.5 · 4·B·H·L·S·D, halved for
causal), and ratios against torch's default backend and its FLASH_ATTENTION backend (where it accepts the call).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import median_ms, print_table, save_json, tflops  # noqa: E402

CASES = [  # (name, B, H, L, D, causal)
    ("seed", 32, 32, 512, 1024, False),
    ("d128", 8, 16, 2048, 128, False),
    ("d64", 4, 32, 4096, 64, False),
    ("d128 causal", 2, 16, 8192, 128, True),
    ("d256", 8, 16, 1024, 256, False),
]
COLUMNS = [("name", "case", ""), ("dtype", "dtype", ""), ("ms", "fwd+bwd ms", ".3f"), ("tflops", "TFLOP/s", ".0f"),
           ("torch_ms", "torch ms", ".3f"), ("speedup", "× torch", ".2f"), ("flash_ms", "torch FA2 ms", ".3f"),
           ("speedup_flash", "× FA2", ".2f")]


def bench(name, B, H, L, D, causal, dtype):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cupy_attn
    F = torch.nn.functional
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, L, D, device="cuda", dtype=dtype)

    def step(fn):
        def run():
            out = fn()
            torch.autograd.grad(out, (q, k, v), dout)
        return run

    ours = step(lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal))
    theirs = step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    row = {"name": name, "dtype": str(dtype)[6:], "ms": median_ms(ours, n_repeat=20, n_warmup=3)}
    row["torch_ms"] = median_ms(theirs, n_repeat=20, n_warmup=3)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            theirs()
            row["flash_ms"] = median_ms(theirs, n_repeat=20, n_warmup=3)
    except RuntimeError:
        row["flash_ms"] = None
    flops = 3.5 * 4.0 * B * H * L * L * D / (2 if causal else 1)
    row["tflops"] = tflops(flops, row["ms"])
    row["speedup"] = row["torch_ms"] / row["ms"]
    row["speedup_flash"] = None if row["flash_ms"] is None else row["flash_ms"] / row["ms"]
    return row


def benchmark(quick: bool = False) -> list[dict]:
    """One row per (case, dtype); quick: fp16 only (bench/main.py's section)."""
    import torch
    rows = []
    for dtype in (torch.float16,) if quick else (torch.float16, torch.bfloat16):
        for case in CASES:
            try:
                rows.append(bench(*case, dtype))
            except Exception as exc:  # one failing row must not hide the others
                print(f"{case[0]} {dtype}: {type(exc).__name__}: {exc}", flush=True)
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fp16 only")
    args = parser.parse_args(argv)
    rows = benchmark(args.quick)
    save_json("bench_backward.json", rows)
    print_table(rows, COLUMNS, "forward + backward (torch.autograd.grad), same process")
    return rows


if __name__ == "__main__":
    main()
