"""Where the host time of a Linear-BN-softmax training step goes, as a timeline (issue 11's ≥ 1.2× row).

One step = ``torch.autograd.grad(model(x), params, dout)`` from an idle GPU, fp16, x (1024, 8192), 8192 → 8192.
Host timestamps (µs from the step's start, median of 60 steps) at the points that decide the device's critical
path: the forward GEMM's enqueue, the forward's return, the backward's entry (autograd's device thread), its
launches and dW GEMM enqueue, and autograd.grad's return; beside them the fixed cost of torch's autograd machinery
with a trivial Function (identity, same argument count), so what is ours and what is torch's can be told apart.

    PYTHONPATH=. python3 bench/experiments/host_overhead/host_lbs_timeline.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_linear_bn_softmax import K, N, F, _model  # noqa: E402
from common import device_ms, median_ms  # noqa: E402
from cupy_attn.linear_bn_softmax import backward, launch  # noqa: E402
from cupy_attn.torch import LinearBatchNormSoftmax  # noqa: E402

STAMPS: list = []
_now = time.perf_counter


def stamp(name):
    STAMPS.append((name, _now()))


def wrap(owner, attr, before, after):
    inner = getattr(owner, attr)

    def wrapped(*a, **k):
        stamp(before)
        r = inner(*a, **k)
        stamp(after)
        return r
    setattr(owner, attr, wrapped)


def trivial_overhead(n=200):
    """Host µs of Function.apply and of autograd.grad through an identity Function with seven inputs."""
    class Ident(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, a, b, c, d, e, rest):
            ctx.save_for_backward(x, a, b, c, d, e)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g, None, None, None, None, None, None

    x = torch.randn(8, 8, device="cuda", requires_grad=True)
    ps = [torch.randn(8, device="cuda", requires_grad=True) for _ in range(5)]
    fw, bw = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = _now()
        y = Ident.apply(x, *ps, (None, None, None, True, 0.1, 1e-5, False))
        t1 = _now()
        torch.autograd.grad(y, [x], y)
        t2 = _now()
        fw.append(t1 - t0)
        bw.append(t2 - t1)
    return np.median(fw) * 1e6, np.median(bw) * 1e6


def instrumented_saving(self, alloc, x_ptr, w_ptr, vectors):
    """launch.Prepared.execute_saving with stamps."""
    y, y_ptr = alloc(self.shape, False)
    stamp("fwd y allocated")
    self.enqueue_gemm(y_ptr, x_ptr, w_ptr)
    affine, affine_ptr = alloc((launch.AFFINE_ROWS, self.shape[1]), True)
    out, out_ptr = alloc(self.shape, False)
    stamp("fwd affine+out allocated")
    self.enqueue_post(out_ptr, y_ptr, affine_ptr, vectors() if callable(vectors) else vectors)
    return out, y, affine


def main():
    plain = _model(torch.float16).train()
    fused = LinearBatchNormSoftmax.from_module(plain)
    x = torch.randn(N, K, device="cuda").to(torch.float16)
    dout = (torch.randn(N, F, device="cuda") / N).to(torch.float16)
    params = tuple(fused.parameters())
    tparams = tuple(plain.parameters())

    def ours():
        torch.autograd.grad(fused(x), params, dout)

    def theirs():
        torch.autograd.grad(plain(x), tparams, dout)
    for _ in range(5):
        ours()
        theirs()
    torch.cuda.synchronize()
    f_us, b_us = trivial_overhead()
    print(f"trivial Function: apply {f_us:.1f} us, autograd.grad {b_us:.1f} us", flush=True)
    for name, fn in (("ours", ours), ("torch", theirs)):
        print(f"{name}: step from idle {median_ms(fn, 40, 5):.3f} ms, device {device_ms(fn):.3f} ms", flush=True)

    wrap(launch.Prepared, "enqueue_gemm", "fwd gemm enqueue", "fwd gemm enqueued")
    wrap(launch.Prepared, "enqueue_post", "fwd post enqueue", "fwd post enqueued")
    wrap(backward, "grad_inputs", "bwd entry", "bwd return")
    wrap(backward._Gemm, "__call__", "bwd gemm enqueue", "bwd gemm enqueued")
    wrap(launch.Entry, "saving", "fwd cached entry", "fwd entry returned")
    wrap(fused, "forward", "module forward entry", "module forward return")
    for name, fn in (("ours", ours), ("torch", theirs)):
        per = []
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = _now()
            for _ in range(20):
                fn()
            per.append((_now() - t0) / 20 * 1e6)
        torch.cuda.synchronize()
        print(f"{name}: host per step, 20 back to back: {np.median(per):.1f} us", flush=True)
    if "--fine" in sys.argv:
        launch.Prepared.execute_saving = instrumented_saving
    rows = {}
    for _ in range(60):
        torch.cuda.synchronize()
        STAMPS.clear()
        t0 = _now()
        y = fused(x)
        stamp("forward returned")
        torch.autograd.grad(y, params, dout)
        stamp("grad returned")
        seen: dict = {}
        for name, t in STAMPS:  # a name stamped more than once per step (the launches) gets its occurrence number
            seen[name] = seen.get(name, 0) + 1
            rows.setdefault(name if seen[name] == 1 else f"{name} #{seen[name]}", []).append((t - t0) * 1e6)
    torch.cuda.synchronize()
    print("ours, host timeline (us from the step's start, median of 60, idle GPU at the start):")
    for name, ts in sorted(rows.items(), key=lambda kv: np.median(kv[1])):
        print(f"  {name:22s} {np.median(ts):7.1f}  (p10 {np.percentile(ts, 10):6.1f}, p90 {np.percentile(ts, 90):6.1f})")
    if "--cprofile" in sys.argv:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        for _ in range(50):
            torch.cuda.synchronize()
            prof.runcall(ours)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
