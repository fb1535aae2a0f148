"""The FA3-design kernel (flash_fwd_sm90.cu) in its three variants — "fa3" (ping-pong, CUPY_ATTN_FA3=1), "fa3-ovl"
(intra-warpgroup overlap, =2, today's default for large calls) and "fa3-pers" (overlap as a persistent kernel, =3) —
against today's wgmma kernel (flash_fwd.cu, kWgmma) and torch's default SDPA (cuDNN / FlashAttention, torch's choice),
same run, same inputs, the variants timed back to back in each case (rotating order per round, so that clock or
thermal drift does not favour one).

    PYTHONPATH=. python3 bench/experiments/flash_fwd/fa3_fwd.py            # all cases, fp16 and bf16
    PYTHONPATH=. python3 bench/experiments/flash_fwd/fa3_fwd.py --quick    # fp16 only, fewer repeats

Per case: median ms of kernel launches (cupyx.profiler.benchmark), TFLOP/s with FLOPs = 4·B·H·L·S·D (halved for
causal), ratios to the wgmma kernel and to torch, pers/ovl (the persistent variant's A/B), max |variant - wgmma| of
the outputs, and the host cost of encoding the three tensor maps (what a call with new pointers pays; replays on the
same arrays pay none). Every case runs in its own try/except, so one failure prints its error and the others still
run; a hang of a first launch exits after 60 s (common.wait_or_die).
"""
import os
import sys
import time

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

from common import case_main, fa3_case_inputs, rotated_rounds, wait_or_die  # noqa: E402
from cupy_attn.attention import checks  # noqa: E402
from cupy_attn.attention.kernels import flash_fwd as _flash  # noqa: E402
from cupy_attn.attention.kernels import flash_fwd_sm90 as _sm90  # noqa: E402

# The session-5 cases, plus a causal call whose 512 tiles the one-tile launch's hardware order balances worst (1.27x
# the ideal makespan, 1.03x for the persistent pairs: bench/experiments/flash_fwd/tile_order_sim.py) and a call of many short
# tiles (8 key blocks each), where hiding the epilogue and the next Q load matters most.
CASES = (((8, 16, 2048, 128), None), ((4, 32, 4096, 64), None), ((2, 16, 8192, 128), "top_left"),
         ((8, 16, 1024, 256), None), ((1, 16, 4096, 128), "top_left"), ((16, 16, 1024, 64), None))
# Name -> CUPY_ATTN_FA3 mode (fused_sm90.MODE_TILES).
VARIANTS = {"fa3": "1", "fa3-ovl": "2", "fa3-pers": "3"}


def flops(B, H, L, S, D, causal) -> float:
    return 4.0 * B * H * L * S * D / (2 if causal else 1)


def run_case(shape, causal, dtype_name, n_repeat):
    import torch

    B, H, L, D = shape
    (q, k, v), (cq, ck, cv), scale, outs, ptrs = fa3_case_inputs(shape, dtype_name, [*VARIANTS, "wgmma"])
    probs = {name: checks.array_problem(cq, ck, cv, outs[name], scale=scale, causal=causal) for name in outs}
    launches = {name: _sm90.build(probs[name], _sm90.choose(probs[name], mode), outs[name], None)
                for name, mode in VARIANTS.items()}
    runs = {}
    for name, launch in launches.items():
        runs[name] = lambda launch=launch, out=outs[name]: launch(*ptrs, out.data.ptr)
        runs[name]()
        wait_or_die(f"first {name} launch {dtype_name} {shape} causal={causal} (grid {launch.grid})")
    old = _flash.build(probs["wgmma"], _flash.select(cq.dtype, D, 90), outs["wgmma"], None)
    runs["wgmma"] = lambda: old(*ptrs, outs["wgmma"].data.ptr)
    runs["torch"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal is not None,
                                                                              scale=scale)
    runs["wgmma"]()
    cupy.cuda.Device().synchronize()
    bad = sum(int(cupy.isnan(outs[name]).sum()) for name in VARIANTS)
    ref = outs["wgmma"].astype(cupy.float32)
    diff = {name: float(cupy.abs(outs[name].astype(cupy.float32) - ref).max()) for name in VARIANTS}

    # Host cost of a call on new pointers: three cuTensorMapEncodeTiled calls through cuda.bindings.
    t = time.perf_counter()
    n = 200
    for _ in range(n):
        for spec, ptr in zip(launches["fa3"].maps, ptrs):
            spec.encode(ptr)
    encode_us = (time.perf_counter() - t) / n * 1e6

    # Rounds of every variant back to back, the order rotated each round; the median over rounds per variant.
    per_round = rotated_rounds(runs, 3, n_repeat)
    ms = {name: float(np.median(ts)) for name, ts in per_round.items()}
    f = flops(B, H, L, L, D, causal)
    tf = {name: f / t / 1e9 for name, t in ms.items()}
    print(f"{dtype_name:9s} {str(shape):20s} causal={str(causal):9s} "
          + "  ".join(f"{name} {ms[name]:.3f} ms {tf[name]:4.0f} TF/s" for name in ms)
          + "".join(f"  {name}/wgmma {ms['wgmma'] / ms[name]:.2f}x  {name}/torch {ms['torch'] / ms[name]:.2f}x"
                    for name in VARIANTS)
          + f"  pers/ovl {ms['fa3-ovl'] / ms['fa3-pers']:.3f}x"
          + f" (rounds ovl {' '.join(f'{x:.3f}' for x in per_round['fa3-ovl'])},"
          + f" pers {' '.join(f'{x:.3f}' for x in per_round['fa3-pers'])})"
          + "".join(f"  max|{name}-wgmma| {diff[name]:.2e}" for name in VARIANTS) + f"  NaN {bad}"
          + f"  encode 3 maps {encode_us:.1f} us", flush=True)


def main():
    case_main(run_case, CASES)


if __name__ == "__main__":
    main()
