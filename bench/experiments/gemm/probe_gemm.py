"""cuBLASLt (cached heuristic algorithm) against classic cuBLAS gemmStridedBatchedEx and torch on our GEMM shapes.

For each problem: the classic API (CuPy's binding, what the paths used before), cuBLASLt's heuristic choice, each of
its next candidates, and torch's nearest call. Device time medians (cupyx.profiler.benchmark), fresh random inputs.

    PYTHONPATH=. python3 bench/experiments/gemm/probe_gemm.py [--candidates 8] [--only "PV after"]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common
import common  # noqa: E402


def problems(cp, torch):
    """(name, dtype, allow_tf32, flops, GemmKey-like kwargs, arrays, torch call)."""
    out = []
    for dt, tf32 in (("float16", False), ("bfloat16", False), ("float32", False), ("float32", True)):
        tdt = getattr(torch, dt)
        x = torch.randn(1024, 8192, device="cuda", dtype=tdt)
        w = torch.randn(8192, 8192, device="cuda", dtype=tdt) / 90
        b = torch.randn(8192, device="cuda", dtype=tdt)
        y = torch.empty(1024, 8192, device="cuda", dtype=tdt)
        kw = dict(c=y, c_dtype=dt, ldc=8192, stride_c=0, a=x, lda=8192, stride_a=0, trans_a=False,
                  b=w, ldb=8192, stride_b=0, trans_b=True, m=1024, n=8192, k=8192, batch=1)
        out.append((f"linear {dt}{'+tf32' if tf32 else ''}", dt, tf32, 2 * 1024 * 8192 * 8192, kw,
                    {"F.linear": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                     "F.linear+bias": lambda x=x, w=w, b=b: torch.nn.functional.linear(x, w, b)}))
    bh, L, S, D = 1024, 512, 512, 1024
    for dt, tf32 in (("float16", False), ("bfloat16", False), ("float32", False)):
        tdt = getattr(torch, dt)
        q = torch.randn(32, 32, L, D, device="cuda", dtype=tdt)
        k = torch.randn(32, 32, S, D, device="cuda", dtype=tdt)
        v = torch.randn(32, 32, S, D, device="cuda", dtype=tdt)
        scores = torch.empty(bh * L * S, device="cuda", dtype=torch.float32)
        o = torch.empty(32, 32, L, D, device="cuda", dtype=tdt)
        kw1 = dict(c=scores, c_dtype="float32", ldc=S, stride_c=L * S, a=q, lda=D, stride_a=L * D, trans_a=False,
                   b=k, ldb=D, stride_b=S * D, trans_b=True, m=L, n=S, k=D, batch=bh)
        pitch = S * 4 // tdt.itemsize
        kw2 = dict(c=o, c_dtype=dt, ldc=D, stride_c=L * D, a=scores, lda=pitch, stride_a=L * pitch, trans_a=False,
                   b=v, ldb=D, stride_b=S * D, trans_b=False, m=L, n=D, k=S, batch=bh)
        out.append((f"sdpa QK^T {dt}", dt, tf32, 2 * bh * L * S * D, kw1,
                    {"q@k^T": lambda q=q, k=k: torch.matmul(q, k.transpose(-1, -2))}))
        out.append((f"sdpa PV {dt}", dt, tf32, 2 * bh * L * S * D, kw2,
                    {"p@v": lambda q=q, v=v: torch.matmul(q[..., :S], v)}))
        if dt != "float32":  # P·V as the split path runs it after the Hopper scores kernel: P in the dtype, ld = S
            p16 = torch.randn(bh * L * S, device="cuda", dtype=tdt)
            kw3 = dict(c=o, c_dtype=dt, ldc=D, stride_c=L * D, a=p16, lda=S, stride_a=L * S, trans_a=False,
                       b=v, ldb=D, stride_b=S * D, trans_b=False, m=L, n=D, k=S, batch=bh)
            out.append((f"sdpa PV after scores kernel {dt}", dt, tf32, 2 * bh * L * S * D, kw3,
                        {"p@v": lambda q=q, v=v: torch.matmul(q[..., :S], v)}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--candidates", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--only", default="", help="problems whose name contains this string")
    args = ap.parse_args()
    import cupy as cp
    import torch
    from cupy_attn.runtime import blas as _cublas, cublaslt as _cublaslt
    print("cuBLASLt version", _cublaslt.version(), "lib", _cublaslt.library_path(), flush=True)
    rows = []
    for name, dt, tf32, flops, kw, torch_calls in problems(cp, torch):
        if args.only not in name:
            continue
        ptr = {r: kw[r].data_ptr() for r in ("a", "b", "c")}
        a_dtype = np.dtype(dt) if dt != "bfloat16" else __import__("ml_dtypes").bfloat16
        c_dtype = np.dtype(kw["c_dtype"]) if kw["c_dtype"] != "bfloat16" else a_dtype

        problem = dict(c_dtype=c_dtype, a_dtype=a_dtype, b_dtype=a_dtype, allow_tf32=tf32,
                       **{f: kw[f] for f in ("ldc", "stride_c", "lda", "stride_a", "trans_a", "ldb", "stride_b",
                                             "trans_b", "m", "n", "k", "batch")})
        lt = _cublas.StridedGemm(**problem)   # what the paths call: cached plan, tuned on its first call
        _cublas.USE_CUBLASLT = False
        classic = _cublas.StridedGemm(**problem)
        _cublas.USE_CUBLASLT = True

        torch.backends.cuda.matmul.allow_tf32 = tf32
        times = {"classic": common.median_ms(lambda: classic(ptr["c"], ptr["a"], ptr["b"]), args.repeat),
                 "lt": common.median_ms(lambda: lt(ptr["c"], ptr["a"], ptr["b"]), args.repeat)}
        plan = _cublaslt.Plan(lt._lt_key, candidates=args.candidates)
        one = np.array(1.0, np.float32)
        zero = np.array(0.0, np.float32)
        cand = []
        for i, r in enumerate(plan.algos):
            t = common.median_ms(lambda i=i: plan.run(ptr["c"], ptr["a"], ptr["b"], one.ctypes.data,
                                                      zero.ctypes.data, cp.cuda.get_current_stream().ptr, choice=i),
                                 args.repeat)
            cand.append(f"{t:.3f}(ws {r.workspace_size >> 20}M)")
        for tname, fn in torch_calls.items():
            times[tname] = common.median_ms(fn, args.repeat)
        torch.backends.cuda.matmul.allow_tf32 = False
        row = {"problem": name, **{k: v for k, v in times.items()}, "lt_tflops": common.tflops(flops, times["lt"]),
               "candidates": " ".join(cand)}
        rows.append(row)
        print(row, flush=True)
    common.save_json("probe_gemm.json", rows)
    for r in rows:
        print(f"{r['problem']:24s} classic {r['classic']:.3f}  lt {r['lt']:.3f} ({r['lt_tflops']:.0f} TF)  " +
              "  ".join(f"{k} {v:.3f}" for k, v in r.items() if k not in ("problem", "classic", "lt", "lt_tflops",
                                                                           "candidates")))
        print("    candidates:", r["candidates"])


if __name__ == "__main__":
    main()
