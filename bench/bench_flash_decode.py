"""Benchmark: decode (one or a few query rows against a long KV cache), ours against torch's default SDPA: issue 10's
decode rows and two GQA rows.

Every row, same process, fresh random K/V (0.5-4.3 GB, far past the L2): ``ms`` (our call on torch tensors from an
idle GPU, host time before the launch included, as every row in this benchmark) and ``torch_ms`` (torch's default
SDPA), timed in three alternating rounds (medians of all samples); ``device_ms`` / ``torch_device_ms`` (the call's
device time alone: queued behind a spin kernel); ``tbps`` (K+V bytes read, B·Hkv·S·(E+Ev)·2, per second) and
``pct_copy`` (against the measured device-to-device copy, read + write bytes: torch's read-only stream passes 100%);
``speedup`` = torch_ms / ms; ``max_err`` / ``torch_err``: max |out − ref| against torch's fp32 math on the same inputs.

    PYTHONPATH=. python3 bench/bench_flash_decode.py [--quick]
"""
from __future__ import annotations

import numpy as np

from common import device_ms, interleaved_ms

# (name, B, Hq, Hkv, L, S, D)
CASES = (("decode", 64, 32, 32, 1, 4096, 128), ("decode", 8, 32, 32, 1, 32768, 128),
         ("decode gqa", 8, 32, 8, 1, 32768, 128), ("decode gqa", 16, 64, 8, 1, 8192, 128))
COLUMNS = [("name", "name", ""), ("dtype", "dtype", ""), ("shape", "(B, Hq/Hkv, L, S, D)", ""), ("ms", "ms", ".3f"),
           ("tbps", "TB/s", ".2f"), ("pct_copy", "% copy", ".1f"), ("device_ms", "device ms", ".3f"),
           ("torch_ms", "torch ms", ".3f"), ("torch_tbps", "torch TB/s", ".2f"),
           ("torch_device_ms", "torch device ms", ".3f"), ("speedup", "× torch", ".2f"), ("max_err", "max err", ".2e"),
           ("torch_err", "torch err", ".2e")]


def copy_tbps() -> float:
    """Device-to-device copy bandwidth, read + write bytes, of a 2 GiB buffer (median of 10)."""
    import cupy
    from cupyx.profiler import benchmark as cupy_benchmark
    a = cupy.empty(2 << 30, dtype=cupy.uint8)
    b = cupy.empty_like(a)
    res = cupy_benchmark(lambda: b.__setitem__(slice(None), a), n_repeat=10, n_warmup=2)
    return 2 * a.nbytes / float(np.median(res.gpu_times[0])) / 1e12


def benchmark(quick: bool = False) -> list[dict]:
    import torch
    import torch.nn.functional as F

    import cupy_attn
    copy = copy_tbps()
    rows = []
    for dname in ("float16",) if quick else ("float16", "bfloat16"):
        dt = getattr(torch, dname)
        for name, B, Hq, Hkv, L, S, D in CASES:
            q = torch.randn(B, Hq, L, D, device="cuda", dtype=dt)
            k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=dt) for _ in range(2))
            gqa = Hq != Hkv
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=gqa)
            fns = {"ours": lambda: cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
                   "torch": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)}
            errs = {n: float((fn().float() - ref).abs().max()) for n, fn in fns.items()}
            del ref
            ms, torch_ms = interleaved_ms((fns["ours"], fns["torch"]), rounds=3, repeat=10, warmup=3)
            kv_bytes = 2 * B * Hkv * S * D * q.element_size()
            rows.append(dict(name=name, dtype=dname, shape=f"({B}, {Hq}/{Hkv}, {L}, {S}, {D})", ms=ms,
                             tbps=kv_bytes / ms / 1e9, pct_copy=100 * kv_bytes / ms / 1e9 / copy,
                             device_ms=device_ms(fns["ours"]), torch_ms=torch_ms,
                             torch_tbps=kv_bytes / torch_ms / 1e9, torch_device_ms=device_ms(fns["torch"]),
                             speedup=torch_ms / ms, max_err=errs["ours"], torch_err=errs["torch"], copy_tbps=copy))
            del q, k, v
    return rows


if __name__ == "__main__":
    import argparse

    from common import print_table
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    print_table(benchmark(ap.parse_args().quick), COLUMNS, title="bench_flash_decode")
