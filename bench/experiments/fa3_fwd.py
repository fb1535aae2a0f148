"""The opt-in FA3-design kernel (flash_fwd_sm90.cu; "fa3", and "fa3-ovl": its intra-warpgroup-overlap variant) against
today's wgmma kernel (flash_fwd.cu, kWgmma) and torch's default SDPA (cuDNN / FlashAttention, torch's choice), same
run, same inputs.

    PYTHONPATH=. python3 bench/experiments/fa3_fwd.py            # all cases, fp16 and bf16
    PYTHONPATH=. python3 bench/experiments/fa3_fwd.py --quick    # fp16 only, one repeat round

Per case: median ms of kernel launches (cupyx.profiler.benchmark), TFLOP/s with FLOPs = 4·B·H·L·S·D (halved for
causal), ratios, max |FA3 - wgmma| of the outputs, and the host cost of encoding the three tensor maps (what a call
with new pointers pays; replays on the same arrays pay none). Every case runs in its own try/except, so one failure
prints its error and the others still run.
"""
import argparse
import os
import sys
import time
import traceback

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import median_ms, wait_or_die  # noqa: E402
from cupy_attn.attention import fused as _flash  # noqa: E402
from cupy_attn.attention import fused_sm90 as _sm90  # noqa: E402

CASES = (((8, 16, 2048, 128), None), ((4, 32, 4096, 64), None), ((2, 16, 8192, 128), "top_left"),
         ((8, 16, 1024, 256), None))


def flops(B, H, L, S, D, causal) -> float:
    return 4.0 * B * H * L * S * D / (2 if causal else 1)




def run_case(shape, causal, dtype_name, n_repeat):
    import torch

    B, H, L, D = shape
    tdt = getattr(torch, dtype_name)
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn((B, H, L, D), generator=g, device="cuda", dtype=torch.float32).to(tdt) for _ in range(3))
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    scale = D ** -0.5
    out_fa3 = cupy.full((B, H, L, D), np.nan, dtype=cq.dtype)
    out_ovl = cupy.full((B, H, L, D), np.nan, dtype=cq.dtype)
    out_old = cupy.full((B, H, L, D), np.nan, dtype=cq.dtype)

    reason = _flash.fa3_reason(cq, ck, cv, out_fa3, scale=scale, arch=int(cupy.cuda.Device().compute_capability))
    if reason:
        raise RuntimeError(f"FA3 kernel not eligible: {reason}")
    fa3 = _sm90.prepare(cq, ck, cv, out_fa3, None, scale=scale, causal=causal)
    ovl = _sm90.prepare(cq, ck, cv, out_ovl, None, scale=scale, causal=causal, overlap=True)
    family, tile, head_dim = _flash.select(cq.dtype, D, 90)
    kern = family.kernel(dtype=_flash._C_TYPES[dtype_name], head_dim=head_dim, tile=tile, has_mask="false")
    old = _flash.FlashLaunch.build(kern, tile, head_dim, cq, ck, cv, out_old, None, scale=scale, causal=causal,
                                   mask=None)
    ptrs = (cq.data.ptr, ck.data.ptr, cv.data.ptr)
    run_fa3 = lambda: fa3(*ptrs, out_fa3.data.ptr)  # noqa: E731
    run_ovl = lambda: ovl(*ptrs, out_ovl.data.ptr)  # noqa: E731
    run_old = lambda: old(*ptrs, out_old.data.ptr)  # noqa: E731
    run_torch = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q, k, v, is_causal=causal is not None, scale=scale)

    run_fa3()
    wait_or_die(f"first FA3 launch {dtype_name} {shape} causal={causal}")
    run_ovl()
    wait_or_die(f"first FA3 overlap launch {dtype_name} {shape} causal={causal}")
    run_old()
    cupy.cuda.Device().synchronize()
    bad = int(cupy.isnan(out_fa3).sum()) + int(cupy.isnan(out_ovl).sum())
    diff = float(cupy.abs(out_fa3.astype(cupy.float32) - out_old.astype(cupy.float32)).max())
    diff_ovl = float(cupy.abs(out_ovl.astype(cupy.float32) - out_old.astype(cupy.float32)).max())

    # Host cost of a call on new pointers: three cuTensorMapEncodeTiled calls through cuda.bindings.
    t = time.perf_counter()
    n = 200
    for _ in range(n):
        for spec, ptr in zip(fa3.maps, ptrs):
            spec.encode(ptr)
    encode_us = (time.perf_counter() - t) / n * 1e6

    ms = {"fa3": median_ms(run_fa3, n_repeat, 5), "fa3-ovl": median_ms(run_ovl, n_repeat, 5),
          "wgmma": median_ms(run_old, n_repeat, 5), "torch": median_ms(run_torch, n_repeat, 5)}
    f = flops(B, H, L, L, D, causal)
    tf = {name: f / t / 1e9 for name, t in ms.items()}
    print(f"{dtype_name:9s} {str(shape):20s} causal={str(causal):9s} "
          + "  ".join(f"{name} {ms[name]:.3f} ms {tf[name]:4.0f} TF/s" for name in ms)
          + f"  fa3/wgmma {ms['wgmma'] / ms['fa3']:.2f}x  fa3/torch {ms['torch'] / ms['fa3']:.2f}x"
          + f"  fa3-ovl/wgmma {ms['wgmma'] / ms['fa3-ovl']:.2f}x  fa3-ovl/torch {ms['torch'] / ms['fa3-ovl']:.2f}x"
          + f"  max|fa3-wgmma| {diff:.2e}  max|fa3ovl-wgmma| {diff_ovl:.2e}  NaN {bad}"
          + f"  encode 3 maps {encode_us:.1f} us", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dtypes = ("float16",) if args.quick else ("float16", "bfloat16")
    print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), flush=True)
    for dtype_name in dtypes:
        for shape, causal in CASES:
            try:
                run_case(shape, causal, dtype_name, 10 if args.quick else 30)
            except Exception:  # one failing case must not hide the others
                print(f"{dtype_name} {shape} causal={causal}: FAILED")
                traceback.print_exc()


if __name__ == "__main__":
    main()
