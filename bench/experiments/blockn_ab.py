"""A/B of the FA3-design forward's key-tile width (flash_fwd_sm90.cu, fused_sm90.SM90_WIDE_BLOCK_N; the run-time
switch is CUPY_ATTN_FA3_BLOCK_N): per case, the default tile of the mode auto picks (dispatch.fa3_mode: "3",
persistent, for causal calls and head dims above 64, else "2", overlap) against every wider tile its bucket offers in
that mode, the ping-pong-only wide tiles (128×192 at D = 128, 128×256 at D = 64) against the ping-pong default
(mode "1"), and torch's default SDPA (cuDNN on the H200), one process, same inputs.

    PYTHONPATH=. python3 bench/experiments/blockn_ab.py            # fp16 and bf16, ~1 minute of kernel time
    PYTHONPATH=. python3 bench/experiments/blockn_ab.py --quick    # fp16 only, fewer repeats

Timing: rounds of every variant back to back with the order rotated each round (so that clock or thermal drift
favours none), each a median of cupyx.profiler.benchmark's CUDA-event times; the median over rounds is printed, with
TFLOP/s for FLOPs = 4·B·H·L·S·D (halved for causal), speedups over the default tile and over torch, and the largest
|difference| of each variant's output from the default tile's (outputs NaN-poisoned first; NaN counts printed). Each
case runs in its own try/except; a first launch that hangs (a barrier mistake) exits after 60 s (common.wait_or_die).
"""
import argparse
import os
import sys
import traceback

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import median_ms, wait_or_die  # noqa: E402
from cupy_attn.attention import fused as _flash  # noqa: E402
from cupy_attn.attention import fused_sm90 as _sm90  # noqa: E402

# Issue 10's cases: 0.92x cuDNN at the first two, 0.72-0.90x at the D = 256 one; the causal one a control (its bucket
# offers no wide tile for causal calls, as FlashAttention-3's table).
CASES = (((8, 16, 2048, 128), None), ((4, 32, 4096, 64), None), ((8, 16, 1024, 256), None),
         ((2, 16, 8192, 128), "top_left"))


def flops(B, H, L, S, D, causal) -> float:
    return 4.0 * B * H * L * S * D / (2 if causal else 1)


def variants(D: int, causal: bool) -> dict:
    """name -> (mode, block_n): the auto mode's default and its wide tiles; for ping-pong-only wide tiles, the mode "1"
    default beside them."""
    auto = "3" if causal or D > 64 else "2"
    out = {f"m{auto} {_sm90.MODE_TILES[auto][D].block_n} (default)": (auto, None)}
    for n, wide in sorted(_sm90.SM90_WIDE_BLOCK_N.get(D, {}).items()):
        if causal and not wide.causal:
            continue
        mode = auto if auto in wide.modes else wide.modes[0]
        if mode != auto:
            out.setdefault(f"m{mode} {_sm90.MODE_TILES[mode][D].block_n}", (mode, None))
        out[f"m{mode} {n}"] = (mode, n)
    return out


def run_case(shape, causal, dtype_name, n_repeat, rounds):
    import torch

    B, H, L, D = shape
    tdt = getattr(torch, dtype_name)
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn((B, H, L, D), generator=g, device="cuda", dtype=torch.float32).to(tdt) for _ in range(3))
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    scale = D ** -0.5
    arch = int(cupy.cuda.Device().compute_capability)
    reason = _flash.fa3_reason(cq, ck, cv, cupy.empty_like(cq), scale=scale, arch=arch)
    if reason:
        raise RuntimeError(f"FA3 kernel not eligible: {reason}")
    ptrs = (cq.data.ptr, ck.data.ptr, cv.data.ptr)
    todo = variants(D, causal is not None)
    outs, runs, tiles = {}, {}, {}
    for name, (mode, n) in todo.items():
        n = n or _sm90.MODE_TILES[mode][D].block_n  # explicit: a CUPY_ATTN_FA3_BLOCK_N in the environment is ignored
        outs[name] = cupy.full((B, H, L, D), np.nan, dtype=cq.dtype)
        launch = _sm90.prepare(cq, ck, cv, outs[name], None, scale=scale, causal=causal, mode=mode, block_n=n)
        tiles[name] = _sm90.tile_for(mode, D, causal is not None, n)[0]
        assert tiles[name].block_n == n, (name, tiles[name])
        runs[name] = lambda launch=launch, out=outs[name]: launch(*ptrs, out.data.ptr)
        runs[name]()
        wait_or_die(f"first launch of {name} {dtype_name} {shape} causal={causal} (grid {launch.grid})")
    runs["torch"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal is not None,
                                                                              scale=scale)
    cupy.cuda.Device().synchronize()
    default = next(iter(todo))
    ref = outs[default].astype(cupy.float32)
    nans = {name: int(cupy.isnan(outs[name]).sum()) for name in todo}
    diff = {name: float(cupy.abs(outs[name].astype(cupy.float32) - ref).max()) for name in todo}

    names = list(runs)
    per_round = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            per_round[name].append(median_ms(runs[name], n_repeat, 5))
    ms = {name: float(np.median(ts)) for name, ts in per_round.items()}
    f = flops(B, H, L, L, D, causal)
    print(f"{dtype_name} {shape} causal={causal}", flush=True)
    for name in names:
        line = f"  {name:18s} {ms[name]:7.3f} ms {f / ms[name] / 1e9:5.0f} TF/s  vs torch {ms['torch'] / ms[name]:.3f}x"
        if name != "torch":
            t = tiles[name]
            line += (f"  vs default {ms[default] / ms[name]:.3f}x  max|-default| {diff[name]:.2e}  NaN {nans[name]}"
                     f"  smem {t.smem_bytes(_sm90.head_bucket(D, D)) // 1024} KB")
        line += "  rounds " + " ".join(f"{x:.3f}" for x in per_round[name])
        print(line, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dtypes = ("float16",) if args.quick else ("float16", "bfloat16")
    print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), flush=True)
    for dtype_name in dtypes:
        for shape, causal in CASES:
            try:
                run_case(shape, causal, dtype_name, 10 if args.quick else 20, 3 if args.quick else 5)
            except Exception:  # one failing case must not hide the others
                print(f"{dtype_name} {shape} causal={causal}: FAILED")
                traceback.print_exc()


if __name__ == "__main__":
    main()
