"""Decode (split-KV) benchmark: cupy_attn's decode kernels side by side — flash_decode (CUPY_ATTN_DECODE=1) with its
4-warp and its 8-warp tile (CUPY_ATTN_DECODE_WARPS=4 / 8) and with the default rule choosing (unset; auto splits
only), and the streaming flash_decode_sm90 with one (=2) and two (=3) CTAs per SM, each at auto splits and over a
split sweep — vs torch's default SDPA and vs the fused kernel (CUPY_ATTN_DECODE=0), reporting TB/s of K+V bytes read
and ratios.

    PYTHONPATH=. python3 bench/experiments/decode/decode.py [--quick] [--default] [--variants=TEXT] [--cases=TEXT]
    (--quick: auto splits only, no sweep; --default: the default kernel only; --variants / --cases: only the
    variants / cases whose label contains TEXT)

Every row: median ms (cupyx.profiler.benchmark, CUDA events on the shared default stream), TB/s of K and V bytes
read (B·Hkv·S·(E+Ev)·2; Q, out and the partials are < 1% of it), the ratio to the measured copy bandwidth (a 2 GiB
device copy, read + write bytes), speedup vs torch in the same run, and max |err| vs torch's fp32 math on the same
inputs; then the call's device time alone (common.device_ms: queued behind a spin kernel, so the host time before
the launch is not in it) and its share of the copy bandwidth. Each case runs in its own try/except so one failure does not hide the rest. K/V are 0.5-4.3 GB, far past
the 50 MB L2, so no buffer rotation is needed.
"""
import os
import sys
import traceback

import cupy

import cupy_attn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common
import common  # noqa: E402
from common import device_ms, environ  # noqa: E402

# (name, B, Hq, Hkv, L, S, D)
CASES = (
    ("decode (64,32,1,4096,128)", 64, 32, 32, 1, 4096, 128),
    ("decode (8,32,1,32768,128)", 8, 32, 32, 1, 32768, 128),
    ("gqa (8,32q/8kv,1,32768,128)", 8, 32, 8, 1, 32768, 128),
    ("gqa (16,64q/8kv,1,8192,128)", 16, 64, 8, 1, 8192, 128),
)
SWEEP = (1, 2, 4, 8, 16, 32)
# (label, CUPY_ATTN_DECODE, CUPY_ATTN_DECODE_WARPS (None: unset), split sweep?): the decode kernels of every case
VARIANTS = (
    ("v1 flash_decode rule", "1", None, False),   # the default: 8 warps up to 1.5 CTAs per SM, else 4
    ("v1 flash_decode 4 warps", "1", "4", True),
    ("v1 flash_decode 8 warps", "1", "8", True),  # D = 64 and 128 on Hopper (4 warps elsewhere, explain says so)
    ("sm90 stream 1cta", "2", None, True),
    ("sm90 stream 2cta", "3", None, True),
)


def decode_env(value: str, warps: str | None = None):
    """CUPY_ATTN_DECODE=value and CUPY_ATTN_DECODE_WARPS=warps (None: unset) inside the block (the call cache keys on
    both, so each pair has its own plan)."""
    return environ(CUPY_ATTN_DECODE=value, CUPY_ATTN_DECODE_WARPS=warps)


def median_ms(fn, n_repeat=30, n_warmup=5) -> float:
    """common.median_ms with this script's repeat counts."""
    return common.median_ms(fn, n_repeat, n_warmup)


def copy_tbps() -> float:
    """Device-to-device copy bandwidth, read + write bytes, of a 2 GiB buffer."""
    a = cupy.empty(2 << 30, dtype=cupy.uint8)
    b = cupy.empty_like(a)
    ms = median_ms(lambda: b.__setitem__(slice(None), a), n_repeat=10, n_warmup=2)
    return 2 * a.nbytes / ms / 1e9


def run_case(torch, name, B, H, Hkv, L, S, D, dtype, copy_bw, quick):
    F = torch.nn.functional
    g = torch.Generator("cuda").manual_seed(0)
    tdt = getattr(torch, dtype)
    q = torch.randn(B, H, L, D, device="cuda", generator=g, dtype=tdt)
    k = torch.randn(B, Hkv, S, D, device="cuda", generator=g, dtype=tdt)
    v = torch.randn(B, Hkv, S, D, device="cuda", generator=g, dtype=tdt)
    gqa = H != Hkv
    kv_bytes = 2 * B * Hkv * S * D * q.element_size()
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=gqa)
    torch.cuda.synchronize()

    def row(label, fn, base_ms=None):
        try:
            out = fn()
            err = float((out.float() - ref).abs().max())
            ms = median_ms(fn)
            dev = device_ms(fn)  # the call's device time alone (queued behind a spin kernel: no host time in it)
            tbps = kv_bytes / ms / 1e9
            vs = f"  {base_ms / ms:5.2f}x torch" if base_ms else ""
            print(f"  {label:<40} {ms:8.3f} ms  {tbps:5.2f} TB/s  {100 * tbps / copy_bw:5.1f}% copy{vs}"
                  f"  err {err:.2e}  device {dev:.3f} ms ({100 * kv_bytes / dev / 1e9 / copy_bw:5.1f}% copy)",
                  flush=True)
            return ms
        except Exception as exc:  # one failure must not hide the other rows
            print(f"  {label:<40} FAILED: {type(exc).__name__}: {exc}", flush=True)
            return None

    print(f"{name} {dtype}: K+V {kv_bytes / 1e9:.2f} GB", flush=True)
    t_torch = row("torch SDPA (default)", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa))
    variants = VARIANTS[:1] if "--default" in sys.argv else VARIANTS
    only = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--variants=")]
    if only:
        variants = [v for v in variants if only[0] in v[0]]
    for label, env, warps, sweep in variants:
        with decode_env(env, warps):
            try:
                plan = cupy_attn.explain(q, k, v, enable_gqa=gqa)
                print(f"  [{label}] {plan.reason}; {plan.details.get('kernel')}: {plan.details.get('tile')}",
                      flush=True)
            except Exception as exc:
                print(f"  [{label}] explain FAILED: {type(exc).__name__}: {exc}", flush=True)
            row(f"{label} auto", lambda: cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=gqa), t_torch)
            for n in (() if quick or not sweep else SWEEP):
                row(f"{label} num_splits={n}",
                    lambda n=n: cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, num_splits=n),
                    t_torch)
    with decode_env("0"):
        row("fused (CUPY_ATTN_DECODE=0)", lambda: cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
            t_torch)


def main():
    import torch
    quick = "--quick" in sys.argv
    copy_bw = copy_tbps()
    cupy.get_default_memory_pool().free_all_blocks()
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: copy {copy_bw:.2f} TB/s (read + write)",
          flush=True)
    cases = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--cases=")]
    for dtype in ("float16",) if cases else ("float16", "bfloat16"):
        for case in (c for c in CASES if not cases or cases[0] in c[0]):
            try:
                run_case(torch, *case, dtype, copy_bw, quick)
            except Exception:
                print(f"{case[0]} {dtype}: FAILED", flush=True)
                traceback.print_exc()
            torch.cuda.empty_cache()  # the case's inputs (up to 4.3 GB of K/V, 8.6 GB as fp32) are gone
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
