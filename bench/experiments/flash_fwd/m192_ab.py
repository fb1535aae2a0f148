"""A/B of the opt-in 192-row tile of the FA3-design kernel at head dim 64 (CUPY_ATTN_FA3_M192=1: three consumer
warpgroups, fused_sm90.M192_MODE_TILES) against today's default (the 128-row tile in the mode dispatch.fa3_mode picks:
"2" overlap for non-causal calls, "3" persistent for causal ones) and torch's default SDPA (cuDNN / FlashAttention,
torch's choice), same process, same inputs, rounds back to back with the order rotated each round.

    PYTHONPATH=. python3 bench/experiments/flash_fwd/m192_ab.py            # all cases, fp16 and bf16
    PYTHONPATH=. python3 bench/experiments/flash_fwd/m192_ab.py --quick    # fp16 only, fewer repeats

Variants per case: "default" (128 rows, auto's mode), "m192" (192 rows, the same mode), "m192-other" (192 rows, the
other of modes "2" and "3"), "torch". Per case: median ms of kernel launches (cupyx.profiler.benchmark through
common.median_ms), TFLOP/s with FLOPs = 4·B·H·L·S·D (halved for causal), the ratios m192/default and to torch (> 1:
faster than it), the per-round medians of default and m192, max |variant − default| of the outputs and a NaN count.
Every case runs in its own try/except; a hang of a first launch exits after 60 s (common.wait_or_die).
"""
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

from common import case_main, environ, fa3_case_inputs, rotated_rounds, wait_or_die  # noqa: E402
from cupy_attn.attention import checks  # noqa: E402
from cupy_attn.attention.kernels import flash_fwd_sm90 as _sm90  # noqa: E402

# Issue 10's case (0.94x cuDNN with the 128-row tile), a short-sequence one, and a causal one; each causal and not.
SHAPES = ((4, 32, 4096, 64), (16, 16, 1024, 64), (8, 16, 2048, 64))
CASES = tuple((shape, causal) for shape in SHAPES for causal in (None, "top_left"))


def flops(B, H, L, S, D, causal) -> float:
    return 4.0 * B * H * L * S * D / (2 if causal else 1)


def prepare(cq, ck, cv, out, *, scale, causal, mode, m192):
    """flash_fwd_sm90.build with CUPY_ATTN_FA3_M192 set to m192 for the choice (flash_fwd_sm90.choose: the tile)."""
    with environ(**{_sm90.ENV_M192: m192}):
        prob = checks.array_problem(cq, ck, cv, out, scale=scale, causal=causal)
        return _sm90.build(prob, _sm90.choose(prob, mode), out, None)


def run_case(shape, causal, dtype_name, n_repeat):
    import torch

    B, H, L, D = shape
    auto = "3" if causal is not None else "2"  # dispatch.fa3_mode at D = 64 before the 192-row tile became its default
    other = "2" if auto == "3" else "3"
    variants = {"default": (auto, "0"), "m192": (auto, "1"), "m192-other": (other, "1")}
    (q, k, v), (cq, ck, cv), scale, outs, ptrs = fa3_case_inputs(shape, dtype_name, list(variants))
    runs, tiles = {}, {}
    for name, (mode, m192) in variants.items():
        launch = prepare(cq, ck, cv, outs[name], scale=scale, causal=causal, mode=mode, m192=m192)
        tiles[name] = f"{launch.block[0]}thr grid {launch.grid}"
        runs[name] = lambda launch=launch, out=outs[name]: launch(*ptrs, out.data.ptr)
        runs[name]()
        wait_or_die(f"first {name} launch {dtype_name} {shape} causal={causal} ({tiles[name]})")
    runs["torch"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal is not None,
                                                                              scale=scale)
    runs["torch"]()
    cupy.cuda.Device().synchronize()
    bad = sum(int(cupy.isnan(outs[name]).sum()) for name in variants)
    ref = outs["default"].astype(cupy.float32)
    diff = {name: float(cupy.abs(outs[name].astype(cupy.float32) - ref).max()) for name in variants if name != "default"}

    names = list(runs)
    per_round = rotated_rounds(runs, 5, n_repeat)
    ms = {name: float(np.median(ts)) for name, ts in per_round.items()}
    f = flops(B, H, L, L, D, causal)
    print(f"{dtype_name:9s} {str(shape):19s} causal={str(causal):9s} mode {auto}  "
          + "  ".join(f"{name} {ms[name]:.3f} ms {f / ms[name] / 1e9:4.0f} TF/s" for name in names)
          + f"  m192/default {ms['default'] / ms['m192']:.3f}x  m192-other/default "
          + f"{ms['default'] / ms['m192-other']:.3f}x"
          + "".join(f"  {name}/torch {ms['torch'] / ms[name]:.3f}x" for name in variants)
          + f"  (rounds default {' '.join(f'{x:.3f}' for x in per_round['default'])},"
          + f" m192 {' '.join(f'{x:.3f}' for x in per_round['m192'])})"
          + "".join(f"  max|{name}-default| {d:.2e}" for name, d in diff.items()) + f"  NaN {bad}", flush=True)


def main():
    case_main(run_case, CASES)


if __name__ == "__main__":
    main()
