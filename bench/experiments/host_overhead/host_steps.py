"""Host µs of each step of one SDPA call (seed shape, torch inputs, split path), median over many calls.

    PYTHONPATH=. python3 bench/experiments/host_overhead/host_steps.py
"""
import time

import numpy as np
import torch

import cupy_attn
from cupy_attn.attention import checks as _checks, dispatch as _dispatch
from cupy_attn.attention.paths import split as _split
from cupy_attn.runtime import blas as _cublas, interop as _interop


def med_us(fn, reps=200, sync=False):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        if sync:
            torch.cuda.synchronize()
    return float(np.median(ts) * 1e6)


def _enter_exit(ctx):
    with ctx.activate():
        pass


def main():
    for shape in ((32, 32, 512, 1024), (1, 2, 64, 64)):
        q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.float16) for _ in range(3))
        cupy_attn.scaled_dot_product_attention(q, k, v, backend="split")
        args = (q, k, v, None, 0.0, False, None, False, "split")
        p = _checks.check_sdpa(*args)
        ctx = p.ctx
        B, H, L, E = shape
        with ctx.activate():
            _, out = ctx.empty(shape, p.dtype)
        S = L
        scores = torch.empty(B * H * L * S, device="cuda")
        # Prepared like the split path's (StridedGemm keeps its plan), so only the enqueue is timed.
        gemm1 = _cublas.StridedGemm(c_dtype=np.float32, ldc=S, stride_c=L * S, a_dtype=p.dtype, lda=E,
                                    stride_a=L * E, trans_a=False, b_dtype=p.dtype, ldb=E, stride_b=S * E,
                                    trans_b=True, m=L, n=S, k=E, batch=B * H)
        steps = {
            "context_for": lambda: _interop.context_for(q),
            "kind/device/dtype x3": lambda: [(_interop.device_of(x, _interop.kind_of(x, "q")),
                                              _interop.dtype_of(x, "torch")) for x in (q, k, v)],
            "as_cupy x1": lambda: ctx.as_cupy(q),
            "check_sdpa": lambda: _checks.check_sdpa(*args),
            "plan_sdpa": lambda: _dispatch.plan_sdpa(p, "split"),
            "activate (enter+exit)": lambda: _enter_exit(ctx),
            "ctx.empty": lambda: ctx.empty(shape, p.dtype),
            "gemm1 enqueue": lambda: gemm1(scores.data_ptr(), q.data_ptr(), k.data_ptr()),
            "split_forward": lambda: _split.split_forward(p, _dispatch.split_choice(p, _dispatch.device_arch(p)), out),
            "whole call": lambda: cupy_attn.scaled_dot_product_attention(q, k, v, backend="split"),
        }
        print(f"shape {shape}:", flush=True)
        with ctx.activate():
            for name, fn in steps.items():
                print(f"  {name:22s} {med_us(fn, sync=name in ('gemm1 enqueue', 'split_forward', 'whole call')):7.1f} us",
                      flush=True)


if __name__ == "__main__":
    main()
