"""SDPA benchmark: cupy_attn against torch's SDPA (its default and each backend that accepts the shape), same run.

Rows: ms, TFLOP/s (FLOPs = 4·B·H·L·S·D, halved for causal), speedup vs torch's default and best backend, and max error
against the float64 reference on the first two (batch, head) pairs. Ours and torch's default are timed in five
alternating rounds (common.interleaved_ms), torch's other backends in a block each. ``python bench/bench_sdpa.py
[--quick]``.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (GEMM_CEILING_TFLOPS, environment, interleaved_ms, median_ms, print_table, save_json,  # noqa: E402
                    tflops)

SEED = (32, 32, 512, 1024)  # (B, H, L=S, D): head dim 1024 rules out torch's flash and cuDNN backends
COLUMNS = [("name", "case", ""), ("dtype", "dtype", ""), ("backend", "path", ""), ("ms", "ms", ".3f"),
           ("tflops", "TFLOP/s", ".0f"), ("torch_default_ms", "torch ms", ".3f"), ("torch_best", "torch best", ""),
           ("speedup_default", "× torch", ".2f"), ("speedup_best", "× best", ".2f"), ("max_err", "max err", ".2e"),
           ("torch_err", "torch err", ".2e")]


def _torch_backends():
    from torch.nn.attention import SDPBackend
    return {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def bench_case(name, B, H, L, S, D, dtype="float16", causal=False, mask=None, Dv=None, backend="auto",
               check_heads=2, n_repeat=10, skip_math_above_bytes=8 << 30, **ours_kw):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    import cupy_attn
    from cupy_attn import reference

    Dv = Dv or D
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    q = torch.randn(B, H, L, D, device="cuda", dtype=tdt)
    k = torch.randn(B, H, S, D, device="cuda", dtype=tdt)
    v = torch.randn(B, H, S, Dv, device="cuda", dtype=tdt)
    kw = {"is_causal": causal, "attn_mask": mask}
    ours = lambda: cupy_attn.scaled_dot_product_attention(q, k, v, backend=backend, **kw, **ours_kw)  # noqa: E731
    plan = cupy_attn.explain(q, k, v, backend=backend, **kw)
    out = ours()
    torch_default = lambda: F.scaled_dot_product_attention(q, k, v, **kw)  # noqa: E731
    # Ours and torch's default in alternating rounds (common.interleaved_ms): the ratio the tables lead with.
    ms, default_ms = interleaved_ms((ours, torch_default), rounds=5, repeat=max(n_repeat // 2, 2))
    flops = 2.0 * B * H * L * S * (D + Dv) / (2 if causal else 1)
    row = {"name": name, "dtype": dtype, "shape": (B, H, L, S, D, Dv), "causal": causal, "backend": plan.backend,
           "ms": ms, "tflops": tflops(flops, ms), "ceiling_pct": 100 * tflops(flops, ms) / GEMM_CEILING_TFLOPS}
    # Accuracy on the first heads (the full float64 reference of the seed shape would take minutes on the host); one
    # head once a head's float64 score matrix passes 64 MiB.
    check_heads = 1 if L * S * 8 > 64 << 20 else check_heads
    qs, ks, vs = (x.flatten(0, 1)[:check_heads].double().cpu().numpy() for x in (q, k, v))
    ms_ = None if mask is None else mask.expand(B, H, L, S).flatten(0, 1)[:check_heads].cpu().numpy()
    ref = reference.scaled_dot_product_attention(qs, ks, vs, ms_, is_causal=causal)
    row["max_err"] = float(np.abs(out.flatten(0, 1)[:check_heads].double().cpu().numpy() - ref).max())
    t_default = F.scaled_dot_product_attention(q, k, v, **kw)
    row["torch_err"] = float(np.abs(t_default.flatten(0, 1)[:check_heads].double().cpu().numpy() - ref).max())
    del t_default
    row["torch_default_ms"] = default_ms
    best = ("default", row["torch_default_ms"])
    score_bytes = B * H * L * S * q.element_size() * 3
    for bname, b in _torch_backends().items():
        if bname == "math" and score_bytes > skip_math_above_bytes:
            continue
        try:
            with sdpa_kernel(b):
                F.scaled_dot_product_attention(q, k, v, **kw)
                t = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, **kw), n_repeat=n_repeat)
        except RuntimeError:  # this backend does not accept the call
            t = float("nan")
        row[f"torch_{bname}_ms"] = t
        if t == t and t < best[1]:
            best = (bname, t)
    row["torch_best"], row["torch_best_ms"] = best
    row["speedup_default"] = row["torch_default_ms"] / ms
    row["speedup_best"] = best[1] / ms
    del q, k, v, out
    torch.cuda.empty_cache()
    return row


def benchmark(quick: bool = False) -> list[dict]:
    """Seed workload (fp16, bf16, fp32, fp32 with the TF32 opt-in); then 4x the seed batch (memory budget), causal and
    key-padding-masked seed, S = 300 plain, causal and key-padded, a head-dim sweep (64…1024) and a sequence sweep
    (256…8192) in fp16/bf16, fp32 spot checks.
    Head dims ≤ 512 run twice where auto takes a fused kernel: ``auto`` (the dispatcher's choice) and the split path,
    to show the crossover."""
    import torch
    B, H, L, D = SEED
    rows = [bench_case("seed", B, H, L, L, D, dtype=dt) for dt in ("float16", "bfloat16", "float32")]
    rows.append(bench_case("seed fp32 tf32 opt-in", B, H, L, L, D, dtype="float32", allow_tf32=True))
    if quick:
        return rows
    rows.append(bench_case("seed x4 batch", 4 * B, H, L, L, D, check_heads=1, n_repeat=5))
    rows.append(bench_case("seed causal", B, H, L, L, D, causal=True))
    # issue 14's second causal row: the causal call against the same call without causal (≤ 0.6× its time)
    for causal in (False, True):
        rows.append(bench_case("(2,8,4096,4096,512)" + (" causal" if causal else ""), 2, 8, 4096, 4096, 512,
                               dtype="bfloat16", causal=causal))
    pad = torch.rand(B, 1, 1, L, device="cuda") > 0.1
    rows.append(bench_case("seed key-padding mask", B, H, L, L, D, mask=pad))
    # S off the 8-key grid: P·V on our kernel, where cuBLAS's GEMM is slow (split.pv_reason); causal; key padding on
    # the masked scores kernel's 512-key tile (no 384-key tile).
    for causal in (False, True):
        rows.append(bench_case("(16,32,512,300,1024)" + (" causal" if causal else ""), 16, 32, 512, 300, 1024,
                               causal=causal))
    pad = torch.rand(16, 1, 1, 300, device="cuda") > 0.1
    rows.append(bench_case("(16,32,512,300,1024) key-padding mask", 16, 32, 512, 300, 1024, mask=pad))
    for dt in ("float16", "bfloat16"):
        for d in (64, 128, 256, 512, 1024):
            rows.append(bench_case(f"D={d}", 4, 16, 2048, 2048, d, dtype=dt))
            if d <= 512 and rows[-1]["backend"] != "split":
                rows.append(bench_case(f"D={d}", 4, 16, 2048, 2048, d, dtype=dt, backend="split"))
        for n in (256, 1024, 4096, 8192):
            rows.append(bench_case(f"L=S={n}", max(1, 32768 // n), 16, n, n, 512, dtype=dt))
    for d in (64, 256, 1024):
        rows.append(bench_case(f"D={d}", 4, 16, 1024, 1024, d, dtype="float32"))
    return rows


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sweep, seen = [], set()
    for r in rows:  # the auto row of each head dim (a forced-split row follows it where auto chose fused)
        if r["name"].startswith("D=") and r["dtype"] == "float16" and r["shape"][2] == 2048 and r["name"] not in seen:
            seen.add(r["name"])
            sweep.append(r)
    if not sweep:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["shape"][4] for r in sweep]
    ax.plot(xs, [r["tflops"] for r in sweep], "o-", label="cupy_attn")
    flops = [r["tflops"] * r["ms"] for r in sweep]
    ax.plot(xs, [f / r["torch_default_ms"] for f, r in zip(flops, sweep)], "s--", label="torch default")
    ax.axhline(GEMM_CEILING_TFLOPS, color="gray", lw=0.8, label="fp16 GEMM ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("head dim (B=4, H=16, L=S=2048, fp16)")
    ax.set_ylabel("TFLOP/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="seed workload only")
    args = parser.parse_args(argv)
    rows = benchmark(args.quick)
    print_table(rows, COLUMNS, title=f"SDPA ({environment()})")
    path = save_json("sdpa.json", {"env": environment(), "rows": rows})
    plot(rows, os.path.join(os.path.dirname(path), "sdpa_head_dim.png"))


if __name__ == "__main__":
    main()
