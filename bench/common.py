"""Timing and reporting helpers shared by the benchmark scripts (run from the repo root or via bench/main.py).

Times are medians of CUDA-event timings from ``cupyx.profiler.benchmark`` after warm-up, on fresh random inputs.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import platform

import numpy as np

GEMM_CEILING_TFLOPS = 728.0   # measured fp16 cuBLAS ceiling on the H200 (see bench/RESULTS.md)
OUT_DIR = os.environ.get("CUPY_ATTN_BENCH_OUT", os.path.join(os.path.dirname(__file__), "out"))


def fa4(name: str = "flash_attn_func"):
    """FlashAttention-4's ``flash_attn.cute.interface.<name>`` (flash_attn_func, flash_attn_varlen_func), or None when
    it is not installed (the peer wheels staged by ../shared/tools/peer_wheels.sh go to /tmp/site on the device)."""
    import site
    if os.path.isdir("/tmp/site"):
        site.addsitedir("/tmp/site")
    try:
        from flash_attn.cute import interface
        return getattr(interface, name)
    except Exception as exc:  # not installed, or no CUTLASS DSL for this machine
        print(f"FlashAttention-4 not available: {type(exc).__name__}: {exc}", flush=True)
        return None


def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver / no device / no CuPy
        return False


def median_ms(fn, n_repeat: int = 20, n_warmup: int = 3) -> float:
    """Median GPU time of fn() in ms (CUDA events on CuPy's current stream, which torch's default stream shares)."""
    from cupyx.profiler import benchmark
    res = benchmark(fn, (), n_repeat=n_repeat, n_warmup=n_warmup)
    return float(np.median(res.gpu_times[0]) * 1e3)


def interleaved_ms(fns, rounds: int = 5, repeat: int = 10, warmup: int = 5, host: bool = False) -> list:
    """Median GPU-event ms of each of ``fns`` (with ``host``: (ms, median host µs per call)), timed in ``rounds``
    alternating rounds of ``repeat`` calls each (``warmup`` calls before the first round, 2 before later ones), the
    medians taken over all rounds' samples. Side-by-side ratios need this: a block of one library's calls followed by
    a block of the other's compares two moments of the GPU's clock and the host as much as two kernels (a main job
    once read one row 15% slow in one block and normal in every other run)."""
    from cupyx.profiler import benchmark
    gpu = [[] for _ in fns]
    cpu = [[] for _ in fns]
    for r in range(rounds):
        for i, fn in enumerate(fns):
            res = benchmark(fn, n_repeat=repeat, n_warmup=warmup if r == 0 else 2)
            gpu[i].extend(res.gpu_times[0])
            cpu[i].extend(res.cpu_times)
    ms = [float(np.median(g) * 1e3) for g in gpu]
    return [(m, float(np.median(c) * 1e6)) for m, c in zip(ms, cpu)] if host else ms


def rotated_ms(fns: dict, rounds: int, repeat: int = 10, warmup: int = 3) -> dict:
    """Median GPU-event ms of each named fn, timed in ``rounds`` rounds of ``repeat`` calls (``warmup`` before each)
    whose order rotates by one a round (round r starts at the r-th fn), every round's samples pooled: variants of one
    kernel at one shape each meet every position in the order as the clock drifts over the run."""
    from cupyx.profiler import benchmark
    names = list(fns)
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].extend(benchmark(fns[n], n_repeat=repeat, n_warmup=warmup, name=n).gpu_times[0] * 1e3)
    return {n: float(np.median(t)) for n, t in times.items()}


def rotated_rounds(fns: dict, rounds: int, n_repeat: int, n_warmup: int = 5) -> dict:
    """{name: [median_ms(fn, n_repeat, n_warmup) of each round]}: ``rounds`` rounds over every named fn, the order
    rotated by one a round (round r starts at the r-th fn). Unlike rotated_ms, which pools every sample, this keeps
    one median per round, so the caller can take the median over rounds and print the rounds' spread."""
    names = list(fns)
    per_round = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            per_round[name].append(median_ms(fns[name], n_repeat, n_warmup))
    return per_round


def host_us(fn, n: int = 20) -> float:
    """Median host µs of fn(), the GPU synchronized before each call (so every call starts from an idle GPU)."""
    import time

    import cupy
    ts = []
    for _ in range(n):
        cupy.cuda.Device().synchronize()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    cupy.cuda.Device().synchronize()
    return float(np.median(ts) * 1e6)



def per_call_us(fn, n: int = 2000, rounds: int = 5) -> float:
    """Host µs per call of fn() in a loop without GPU synchronization (best of ``rounds`` loops of n calls, after 50
    warm-up calls): the Python thread's cost when the GPU keeps up (use small problems, or the queue fills)."""
    import time

    import cupy
    for _ in range(50):
        fn()
    cupy.cuda.Device().synchronize()
    best = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t) / n * 1e6)
        cupy.cuda.Device().synchronize()
    return min(best)


def print_profile(fn, calls: int, sort: str = "tottime", top: int = 18) -> None:
    """cProfile of ``calls`` calls of fn() back to back (the GPU not synchronized between them, then once after),
    printed sorted by ``sort``, the first ``top`` functions: where a call's host time goes."""
    import cProfile
    import pstats

    import cupy
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    cupy.cuda.Device().synchronize()
    pstats.Stats(prof).sort_stats(sort).print_stats(top)


@contextlib.contextmanager
def environ(**values):
    """Environment variables set inside the block (a value of None: unset), the previous values restored after it,
    also when the block raises: e.g. the CUPY_ATTN_* knob a variant of a call is planned under."""
    old = {name: os.environ.get(name) for name in values}

    def apply(settings):
        for name, value in settings.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        apply(values)
        yield
    finally:
        apply(old)


def wait_or_die(what: str, timeout_s: float = 60.0) -> None:
    """Wait for the work queued on CuPy's current stream, or exit the process after ``timeout_s``: a wrong mbarrier
    transaction count or phase hangs a TMA kernel, and a benchmark should stop instead of waiting forever."""
    import os
    import time

    import cupy
    ev = cupy.cuda.Event()
    ev.record()
    t = time.time()
    while not ev.done:
        if time.time() - t > timeout_s:
            print(f"ERROR: {what} did not finish in {timeout_s:.0f} s (mbarrier/TMA hang?)", flush=True)
            os._exit(3)
        time.sleep(0.001)

_SPIN_SOURCE = r'''
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}'''


@functools.lru_cache(maxsize=None)
def _spin_kernel():
    import cupy
    return cupy.RawKernel(_SPIN_SOURCE, "spin")


def device_ms(fn, reps: int = 15, prep=None) -> float:
    """Median device time of fn() in ms, the host time excluded: each call is enqueued behind a ~3 ms spin kernel,
    so the host runs ahead and the events around the call time only device work and gaps the device cannot hide.
    The difference to median_ms (an idle GPU at the start) is host time the GPU waits for. ``prep()``, when given,
    is enqueued after the spin kernel and before the timed call, untimed (e.g. work that leaves L2 in some state)."""
    import cupy
    spin = _spin_kernel()
    stream = cupy.cuda.get_current_stream()
    times = []
    for _ in range(reps):
        spin((1,), (1,), (np.int64(6_000_000),))
        if prep is not None:
            prep()
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(stream)
        fn()
        e1.record(stream)
        e1.synchronize()
        times.append(cupy.cuda.get_elapsed_time(e0, e1))
    return float(np.median(times))


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms and ms == ms else float("nan")


def environment() -> dict:
    env = {"date": datetime.date.today().isoformat(), "python": platform.python_version()}
    try:
        import cupy
        env["cupy"] = cupy.__version__
        env["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        env["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    except Exception:
        pass
    try:
        import torch
        env["torch"] = torch.__version__
    except ImportError:
        pass
    return env


def fmt(x, spec=".3f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]], title: str = "") -> str:
    """columns: (key, header, format spec). Returns the markdown table it printed."""
    lines = [f"| {' | '.join(h for _, h, _ in columns)} |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(k), s) if s else str(r.get(k, "")) for k, _, s in columns) + " |")
    text = (f"\n{title}\n" if title else "") + "\n".join(lines)
    print(text, flush=True)
    return text


def save_json(name: str, payload) -> str:
    os.makedirs(OUT_DIR, exist_ok=True)
    path = os.path.join(OUT_DIR, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    return path


def case_main(run_case, cases) -> None:
    """The main() of an A/B script over (shape, causal) cases: ``--quick`` (fp16 only, 10 repeats; else fp16 and
    bf16, 20), the GPU's name, then run_case(shape, causal, dtype_name, repeats) per case, each in its own
    try/except so that one failing case does not hide the others."""
    import argparse
    import traceback

    import cupy
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dtypes = ("float16",) if args.quick else ("float16", "bfloat16")
    print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), flush=True)
    for dtype_name in dtypes:
        for shape, causal in cases:
            try:
                run_case(shape, causal, dtype_name, 10 if args.quick else 20)
            except Exception:
                print(f"{dtype_name} {shape} causal={causal}: FAILED")
                traceback.print_exc()


def fa3_case_inputs(shape, dtype_name, names):
    """Inputs of an FA3-kernel A/B case: seeded random q, k, v (B, H, L, D) as torch tensors and their CuPy views,
    the scale D^-0.5, NaN-filled outputs per variant name (so a launch that writes nothing shows), and the q/k/v
    pointers. RuntimeError when the FA3-design kernel cannot take the call."""
    import cupy
    import torch

    from cupy_attn.attention import checks, dispatch
    from cupy_attn.attention.kernels import flash_fwd_sm90
    B, H, L, D = shape
    g = torch.Generator("cuda").manual_seed(0)
    tdt = getattr(torch, dtype_name)
    q, k, v = (torch.randn((B, H, L, D), generator=g, device="cuda", dtype=torch.float32).to(tdt) for _ in range(3))
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    scale = D ** -0.5
    outs = {name: cupy.full((B, H, L, D), np.nan, dtype=cq.dtype) for name in names}
    p = checks.array_problem(cq, ck, cv, outs[names[0]], scale=scale)
    reason = flash_fwd_sm90.reason(p, dispatch.device_arch(p), outs[names[0]])
    if reason:
        raise RuntimeError(f"FA3 kernel not eligible: {reason}")
    return (q, k, v), (cq, ck, cv), scale, outs, (cq.data.ptr, ck.data.ptr, cv.data.ptr)


KERNEL_COLUMNS = [("name", "case", ""), ("dtype", "dtype", ""), ("shape", "shape", ""), ("ms", "ms", ".3f"),
                  ("tflops", "TFLOP/s", ".1f"), ("tbps", "TB/s", ".2f")]


def randn(shape, dtype_name: str, seed: int = 0, scale: float = 1.0):
    """A CuPy array of standard normal values (times ``scale``) in float16, bfloat16 or float32."""
    import cupy
    x = cupy.random.RandomState(seed).standard_normal(shape, dtype=cupy.float32) * scale
    return x.astype(cupy.dtype("bfloat16") if dtype_name == "bfloat16" else getattr(cupy, dtype_name))


def kernel_row(name: str, dtype_name: str, shape: tuple, fn, flops: float = 0.0, nbytes: float = 0.0,
               n_repeat: int = 20) -> dict:
    """One row of a per-family benchmark (bench/bench_<family>.py): fn() launches the kernel alone on prepared inputs
    (no allocation, no host work but the launch), timed by :func:`median_ms`; TFLOP/s from ``flops``, TB/s from the
    bytes the kernel must move (``nbytes``), either 0 for n/a."""
    ms = median_ms(fn, n_repeat=n_repeat, n_warmup=3)
    return dict(name=name, dtype=dtype_name, shape=shape, ms=ms, tflops=tflops(flops, ms) if flops else None,
                tbps=nbytes / (ms * 1e-3) / 1e12 if nbytes else None)


def kernel_main(benchmark, doc: str) -> None:
    """The main() of a per-family benchmark: ``--quick``, then its rows as a table."""
    import argparse
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first case in fp16 only")
    print_table(benchmark(quick=ap.parse_args().quick), KERNEL_COLUMNS)


def fused_backward_rows(stem: str, bucket, cases, quick: bool) -> list[dict]:
    """The rows of bench_flash_bwd.py / bench_flash_bwd_sm90.py: for each (name, (B, H, L, D), causal, dtype) case,
    one backward of kernels/<stem>.py (the D pre-pass, the kernel, dQ's rounding) on the forward's out and lse,
    prepared once by the module's build at ``bucket(D, D)`` as the autograd backward's call cache replays it; TFLOP/s
    of 2.5 forwards (FlashAttention's count: 2.5 · 4·B·H·L·S·D, halved for causal)."""
    import importlib

    import cupy

    import cupy_attn
    from cupy_attn.attention import checks
    module = importlib.import_module(f"cupy_attn.attention.kernels.{stem}")
    rows = []
    for name, (B, H, L, D), causal, dtype in cases[:1] if quick else cases:
        q, k, v, dout = (randn((B, H, L, D), dtype, seed) for seed in range(4))
        out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal is not None, return_lse=True)
        dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
        p = checks.array_problem(q, k, v, out, lse, scale=D ** -0.5, causal=causal)
        launch = module.build(p, bucket(D, D))
        ptrs = tuple(a.data.ptr for a in (q, k, v, out, lse, dout, dq, dk, dv))
        flops = 2.5 * 4.0 * B * H * L * L * D / (2 if causal else 1)
        rows.append(kernel_row(name, dtype, (B, H, L, D), lambda: launch(*ptrs), flops=flops))
    return rows
