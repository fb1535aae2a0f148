"""Programmatic dependent launch (PDL) for the Linear-BN-softmax kernels after the GEMM, A/B in one process (fp16 and
bf16, training and eval, seed shape): device µs (behind a spin kernel) and idle-start µs of the GEMM alone and of the
GEMM + the kernels after it, launched plainly or as programmatic dependents (launch.PDL); the outputs of both must
be bit-identical. Then the public call (PDL on) against torch, as the benchmark times it.

    PYTHONPATH=. python3 bench/experiments/linear_bn_softmax/lbs_pdl.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import numpy as np  # noqa: E402

import bench_linear_bn_softmax as B  # noqa: E402
from common import device_ms, interleaved_ms  # noqa: E402


def main():
    import cupy
    import torch

    from cupy_attn.linear_bn_softmax import checks as lbs_checks, launch as lbs
    from cupy_attn.linear_bn_softmax import linear_batchnorm_softmax
    from cupy_attn.runtime import blas
    N, K, F = B.N, B.K, B.F
    print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), flush=True)
    for dname in ("float16", "bfloat16"):
        dt = getattr(torch, dname)
        for training in (True, False):
            plain = B._model(dt)
            plain.train(training)
            bn = plain.bn
            saved = {k: v.clone() for k, v in plain.state_dict().items()}
            xs = [torch.randn(N, K, device="cuda").to(dt) for _ in range(3)]
            xs_c = [cupy.from_dlpack(x) for x in xs]
            w_c = cupy.from_dlpack(plain.gemm.weight.detach())
            y_c = cupy.empty((N, F), dtype=w_c.dtype)
            gemm_op = lbs._gemm_xwt_op(0, w_c.dtype, False, N, F, K, K, K)
            blas.gemm(y_c, xs_c[0], w_c, trans_b=True)
            call = lbs_checks.check(xs[0], plain.gemm.weight, plain.gemm.bias, bn.running_mean, bn.running_var,
                                    bn.weight, bn.bias, plain.scale, training, bn.momentum, bn.eps,
                                    bn.num_batches_tracked)
            sets = {}
            for pdl in (False, True):
                lbs.PDL = pdl
                sets[pdl] = B._post_launches(lbs, call, y_c.data.ptr, bn.momentum, bn.eps)
            lbs.PDL = True
            i = [0]

            def gemm():
                i[0] = (i[0] + 1) % 3
                gemm_op(y_c.data.ptr, xs_c[i[0]].data.ptr, w_c.data.ptr)

            # Same input, both launch kinds: the same bits (running stats restored between them).
            outs = {}
            for pdl in (False, True):
                plain.load_state_dict(saved)
                gemm_op(y_c.data.ptr, xs_c[0].data.ptr, w_c.data.ptr)
                B.run_launches(sets[pdl])
                outs[pdl] = (y_c.copy(), bn.running_mean.clone(), bn.running_var.clone())
            same = bool((outs[False][0] == outs[True][0]).all()) and all(
                torch.equal(a, b) for a, b in zip(outs[False][1:], outs[True][1:]))
            plain.load_state_dict(saved)

            def ours():
                with torch.no_grad():
                    linear_batchnorm_softmax(xs[i[0]], plain.gemm.weight, plain.gemm.bias, bn.running_mean,
                                             bn.running_var, bn.weight, bn.bias, plain.scale, training=training,
                                             momentum=bn.momentum, eps=bn.eps,
                                             num_batches_tracked=bn.num_batches_tracked)

            def torch_call():
                with torch.no_grad():
                    plain(xs[i[0]])

            fns = {"gemm": gemm, "gemm + post, plain": lambda: (gemm(), B.run_launches(sets[False])),
                   "gemm + post, PDL": lambda: (gemm(), B.run_launches(sets[True])),
                   "public call (PDL)": ours, "torch": torch_call}
            for f in fns.values():
                for _ in range(5):
                    f()
            dev = {k: [] for k in fns}
            for _ in range(3):
                for k, f in fns.items():
                    dev[k].append(device_ms(f))
            idle = dict(zip(fns, interleaved_ms(list(fns.values()), rounds=5, repeat=20)))
            plain.load_state_dict(saved)
            g_dev, g_idle = np.median(dev["gemm"]), idle["gemm"]
            print(f"\n{dname} {'training' if training else 'eval'}: PDL output bit-identical to plain: {same}")
            print(f"  {'':24s} {'device us':>10s} {'over gemm':>10s} {'idle-start us':>14s} {'/ gemm':>8s}")
            for k in fns:
                d = 1e3 * np.median(dev[k])
                print(f"  {k:24s} {d:10.1f} {d - 1e3 * g_dev:10.1f} {1e3 * idle[k]:14.1f} {idle[k] / g_idle:8.3f}")


if __name__ == "__main__":
    main()
