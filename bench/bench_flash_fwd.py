"""Benchmark of the fused forward (kernels/flash_fwd.py, kernels/flash_fwd_sm90.py: the kernels the plan picks for
head dims ≤ 256) against torch's SDPA backends, in one process.

Each row: our public API forced to the fused kernel (torch tensors in, as users call it; host time included, as
torch's), torch's FLASH_ATTENTION backend and torch's default choice (cuDNN on Hopper; with a mask, the backend
torch picks for that call), all timed by ``cupyx.profiler.benchmark`` (median of GPU event times after
warm-up, five alternating rounds: common.interleaved_ms) on the same random inputs on the null stream. TFLOP/s use
``flops()`` (4·B·H·L·S·D, halved for causal).
``max_err`` is our max |error| against a float64 reference of batch 0, heads 0 and H-1 (computed with CuPy in fp64).

    PYTHONPATH=. python3 bench/bench_flash_fwd.py [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_ms  # noqa: E402

# (name, (B, H, L, D), causal, mask): the Hopper forward issue's table (cuDNN is torch's default there), then the
# key-padding-mask call.
CASES = (
    ("d128", (8, 16, 2048, 128), None, None),
    ("d64", (4, 32, 4096, 64), None, None),
    ("d128 causal", (2, 16, 8192, 128), "top_left", None),
    ("d256", (8, 16, 1024, 256), None, None),
    ("d80", (4, 32, 2048, 80), None, None),
    ("d96", (4, 32, 2048, 96), None, None),
    ("d128 causal 32k", (1, 32, 32768, 128), "top_left", None),
    ("d128 keypad", (8, 16, 2048, 128), None, "keypad"),
)
QUICK = ("d128", "d128 keypad")
GEMM_CEILING_TFLOPS = 728.0


def flops(B: int, H: int, L: int, S: int, D: int, Dv: int | None = None, causal: bool = False) -> float:
    """2·B·H·L·S·(D + Dv) multiply-adds ×2; a causal mask keeps about half of the L×S scores."""
    f = 2.0 * B * H * L * S * (D + (D if Dv is None else Dv))
    return f / 2 if causal else f


def _ref_head(q, k, v, scale, causal, mask):
    """float64 reference of one (L, D) head on the GPU (same math as cupy_attn.reference)."""
    import cupy

    s = (q.astype(cupy.float64) @ k.astype(cupy.float64).T) * scale
    L, S = s.shape
    if causal:
        off = 0 if causal == "top_left" else S - L
        s = cupy.where(cupy.tri(L, S, k=off, dtype=bool), s, -cupy.inf)
    if mask is not None:
        s = cupy.where(mask, s, -cupy.inf)
    m = s.max(axis=-1, keepdims=True)
    m = cupy.where(m == -cupy.inf, 0.0, m)
    p = cupy.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    return cupy.where(den == 0, 0.0, (p @ v.astype(cupy.float64)) / cupy.where(den == 0, 1.0, den))


def run_case(name, shape, causal, mask_kind, dtype_name, n_repeat=20, tile=None) -> dict:
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cupy_attn
    from cupy_attn.attention import checks
    from cupy_attn.attention.kernels import flash_fwd as _flash

    B, H, L, D = shape
    S = L
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=tdt, generator=gen) for _ in range(3))
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    out = cupy.full((B, H, L, D), np.nan, dtype=cq.dtype)  # poisoned: an unwritten element fails max_err
    scale = D ** -0.5
    tmask = cmask = None
    if mask_kind == "keypad":  # (B, 1, 1, S) bool, each batch keeps a random prefix of at least S/2 keys
        lengths = torch.randint(S // 2, S + 1, (B,), generator=gen, device="cuda")
        tmask = (torch.arange(S, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
        cmask = cupy.broadcast_to(cupy.from_dlpack(tmask), (B, H, L, S))

    if tile is None:  # the public API with torch tensors, as a user calls it (torch is timed through its own)
        def ours():
            return cupy_attn.scaled_dot_product_attention(q, k, v, attn_mask=tmask, is_causal=causal == "top_left",
                                                          scale=scale, backend="fused")
    else:  # tile sweep: a one-row family outside the table, launched by the same code (flash_fwd.build)
        hd = _flash.head_dim_bucket(D, D)
        base = _flash.FLASH_FWD_SM90A if tile.wgmma else _flash.FLASH_FWD
        fam = dataclasses.replace(base, axes=dict(base.axes, tile=(tile,)), where=None)
        p = checks.array_problem(cq, ck, cv, out, scale=scale, causal=causal, mask=cmask)
        launch = _flash.build(p, _flash.Choice(fam, tile, hd), out, None)
        ptrs = (cq.data.ptr, ck.data.ptr, cv.data.ptr, out.data.ptr, 0, 0 if cmask is None else cmask.data.ptr)
        ours = lambda: launch(*ptrs)  # noqa: E731
    is_causal = causal == "top_left"

    def torch_call():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=tmask, is_causal=is_causal, scale=scale)

    def torch_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch_call()

    # Ours, torch's FLASH_ATTENTION backend (no mask) and torch's default, in alternating rounds (common.interleaved_ms).
    fns = (ours, torch_call) if tmask is not None else (ours, torch_call, torch_flash)
    ms, default_ms, *flash = interleaved_ms(fns, rounds=5, repeat=max(n_repeat // 2, 4))
    flash_ms = flash[0] if flash else None
    if tile is None:
        out = cupy.from_dlpack(ours())

    err = 0.0
    for h in sorted({0, H - 1}):
        m = None if cmask is None else cmask[0, h]
        ref = _ref_head(cq[0, h], ck[0, h], cv[0, h], scale, causal, m)
        got = out[0, h].astype(cupy.float64)
        if bool(cupy.isnan(got).any()):
            err = float("nan")
            break
        err = max(err, float(cupy.abs(got - ref).max()))

    f = flops(B, H, L, S, D, causal=causal is not None)
    return dict(name=name, dtype=dtype_name, shape=(B, H, L, D), causal=causal, mask=mask_kind, ms=ms,
                tflops=f / ms / 1e9, torch_flash_ms=flash_ms, torch_default_ms=default_ms,
                speedup_vs_flash=None if flash_ms is None else flash_ms / ms, speedup_vs_default=default_ms / ms,
                max_err=err, tile=None if tile is None else dataclasses.astuple(tile))


def benchmark(quick: bool = False) -> list[dict]:
    """One row per (case, dtype); quick: the D=128 and key-padding rows in fp16 only."""
    rows = []
    for name, shape, causal, mask_kind in CASES:
        if quick and name not in QUICK:
            continue
        for dtype_name in ("float16",) if quick else ("float16", "bfloat16"):
            rows.append(run_case(name, shape, causal, mask_kind, dtype_name))
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'name':<13}{'dtype':<10}{'shape':<20}{'ms':>8}{'TFLOP/s':>9}{'%ceil':>7}{'fa2 ms':>8}{'dflt ms':>9}"
            f"{'x fa2':>7}{'x dflt':>8}{'max_err':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        fa = "-" if r["torch_flash_ms"] is None else f"{r['torch_flash_ms']:.3f}"
        xfa = "-" if r["speedup_vs_flash"] is None else f"{r['speedup_vs_flash']:.2f}"
        lines.append(f"{r['name']:<13}{r['dtype']:<10}{str(r['shape']):<20}{r['ms']:>8.3f}{r['tflops']:>9.1f}"
                     f"{100 * r['tflops'] / GEMM_CEILING_TFLOPS:>6.0f}%{fa:>8}{r['torch_default_ms']:>9.3f}"
                     f"{xfa:>7}{r['speedup_vs_default']:>8.2f}{r['max_err']:>10.2e}")
    return "\n".join(lines)


def sweep_tiles(dtype_names: tuple = ("float16",)) -> list[dict]:
    """Tile candidates per head dim on the target shapes (the measurements behind flash_fwd.TILES)."""
    from cupy_attn.attention.kernels.flash_fwd import Tile

    candidates = {  # mma.sync (the table's sm_90 entries), then sm_90a wgmma shapes
        "d64": [Tile(128, 128, 4, 2), Tile(128, 128, 8, 2, True), Tile(128, 64, 8, 2, True),
                Tile(64, 128, 4, 2, True)],
        "d128": [Tile(128, 64, 4, 2), Tile(128, 128, 8, 2, True), Tile(128, 64, 8, 2, True),
                 Tile(64, 128, 4, 2, True)],
        "d128 causal": [Tile(128, 64, 4, 2), Tile(128, 128, 8, 2, True), Tile(128, 64, 8, 2, True)],
        "d256": [Tile(64, 64, 4, 1), Tile(128, 64, 8, 2, True)],
    }
    rows = []
    for dtype_name in dtype_names:
        for name, shape, causal, mask_kind in CASES:
            for tile in candidates.get(name, []):
                rows.append(run_case(name, shape, causal, mask_kind, dtype_name, tile=tile))
                print(name, dtype_name, rows[-1]["tile"], f"{rows[-1]['tflops']:.1f} TFLOP/s", flush=True)
    return rows


def sanitize_run() -> int:
    """Every instantiation once on small odd shapes (partial tiles, causal, bool and float masks, lse): the workload
    for compute-sanitizer memcheck/racecheck. Returns the number of launches."""
    import cupy

    from cupy_attn.attention import checks
    from cupy_attn.attention.kernels import flash_fwd as _flash

    rng = np.random.default_rng(0)
    n = 0
    families = [_flash.FLASH_FWD] + ([_flash.FLASH_FWD_SM90A] if cupy.cuda.Device().compute_capability == "90" else [])
    for family, row in ((f, r) for f in families for r in f.variants()):
        tile, d = row["tile"], row["head_dim"]
        dt = "float16" if row["dtype"] == "__half" else "bfloat16"
        B, H, L, S, E = 1, 2, 2 * tile.block_m + 3, 3 * tile.block_n + 5, d - 3
        cdt = cupy.float16 if dt == "float16" else cupy.dtype("bfloat16")
        q, k, v = (cupy.asarray(rng.standard_normal((B, H, n_, E)), dtype=cupy.float32).astype(cdt)
                   for n_ in (L, S, S))
        out = cupy.full((B, H, L, E), np.nan, dtype=cdt)
        lse = cupy.empty((B, H, L), dtype=cupy.float32)
        masks = [None] if row["has_mask"] == "false" else [
            cupy.broadcast_to(cupy.asarray(rng.random((B, 1, 1, S)) > 0.3), (B, H, L, S)),
            cupy.broadcast_to(cupy.asarray(rng.standard_normal((L, S)), dtype=cupy.float32), (B, H, L, S))]
        for mask in masks:
            for causal in (None, "bottom_right"):
                p = checks.array_problem(q, k, v, out, lse, scale=E ** -0.5, causal=causal, mask=mask)
                _flash.build(p, _flash.Choice(family, tile, d), out, lse)(
                    q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr,
                    0 if mask is None else mask.data.ptr)
                n += 1
    cupy.cuda.Device().synchronize()
    return n


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time tile candidates instead")
    ap.add_argument("--sanitize", action="store_true", help="run every instantiation once (for compute-sanitizer)")
    args = ap.parse_args()
    if args.sanitize:
        print(f"{sanitize_run()} launches")
    else:
        print(format_table(sweep_tiles(("float16", "bfloat16")) if args.sweep else benchmark(quick=args.quick)))
