"""Where the Linear-BN-softmax forward's device time over the GEMM goes (fp16 and bf16 training, seed shape):
device time (each enqueued behind a spin kernel, bench/common.device_ms) of the GEMM alone, the GEMM + column_stats,
the GEMM + both kernels after it, the whole call; and the two kernels after the GEMM alone with y hot in L2 (just
read by a previous run) against y evicted (a 128 MB buffer written between).

    PYTHONPATH=. python3 bench/experiments/linear_bn_softmax/lbs_post_parts.py
"""
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import bench_linear_bn_softmax as B  # noqa: E402
from common import device_ms  # noqa: E402


def timed_after(prep, fn):
    """Median device ms of fn() alone, with prep() enqueued (untimed) before it, both behind a spin kernel."""
    return device_ms(fn, prep=prep)


def main():
    import cupy
    import torch

    from cupy_attn.linear_bn_softmax import checks as lbs_checks, launch as lbs
    from cupy_attn.linear_bn_softmax import linear_batchnorm_softmax
    N, K, F = B.N, B.K, B.F
    flush = cupy.empty(128 << 20, dtype=cupy.uint8)
    for dname in ("float16", "bfloat16"):
        dt = getattr(torch, dname)
        plain = B._model(dt)
        plain.train(True)
        bn = plain.bn
        xs = [torch.randn(N, K, device="cuda").to(dt) for _ in range(3)]
        xs_c = [cupy.from_dlpack(x) for x in xs]
        cyc, cyc_c = itertools.cycle(xs), itertools.cycle(xs_c)
        w_c = cupy.from_dlpack(plain.gemm.weight.detach())
        y_c = cupy.empty((N, F), dtype=w_c.dtype)
        gemm_op = lbs._gemm_xwt_op(0, w_c.dtype, False, N, F, K, K, K)
        from cupy_attn.runtime import blas
        blas.gemm(y_c, xs_c[0], w_c, trans_b=True)
        call = lbs_checks.check(xs[0], plain.gemm.weight, plain.gemm.bias, bn.running_mean, bn.running_var,
                                bn.weight, bn.bias, plain.scale, True, bn.momentum, bn.eps, bn.num_batches_tracked)
        launches = B._post_launches(lbs, call, y_c.data.ptr, bn.momentum, bn.eps)

        def gemm():
            gemm_op(y_c.data.ptr, next(cyc_c).data.ptr, w_c.data.ptr)

        def ours():
            with torch.no_grad():
                linear_batchnorm_softmax(next(cyc), plain.gemm.weight, plain.gemm.bias, bn.running_mean,
                                         bn.running_var, bn.weight, bn.bias, plain.scale, training=True,
                                         momentum=bn.momentum, eps=bn.eps,
                                         num_batches_tracked=bn.num_batches_tracked)

        for _ in range(10):
            gemm(); B.run_launches(launches); ours()
        rows = {}
        for rnd in range(3):
            rows.setdefault("gemm", []).append(device_ms(gemm))
            rows.setdefault("gemm + stats", []).append(device_ms(lambda: (gemm(), B.run_launches(launches[:1]))))
            rows.setdefault("gemm + stats + rows", []).append(device_ms(lambda: (gemm(), B.run_launches(launches))))
            rows.setdefault("whole call", []).append(device_ms(ours))
            rows.setdefault("stats + rows, y hot", []).append(
                timed_after(lambda: B.run_launches(launches), lambda: B.run_launches(launches)))
            rows.setdefault("stats + rows, y evicted", []).append(
                timed_after(lambda: flush.fill(rnd + 1), lambda: B.run_launches(launches)))
            rows.setdefault("stats, y evicted", []).append(
                timed_after(lambda: flush.fill(rnd + 1), lambda: B.run_launches(launches[:1])))
            rows.setdefault("stats + rows, after the gemm", []).append(
                timed_after(gemm, lambda: B.run_launches(launches)))
            rows.setdefault("stats, after the gemm", []).append(
                timed_after(gemm, lambda: B.run_launches(launches[:1])))
        print(f"\n{dname} training, device us (median of 15, three rounds)")
        for k, v in rows.items():
            print(f"  {k:34s} " + " ".join(f"{1e3 * t:8.1f}" for t in v))


if __name__ == "__main__":
    main()
