"""Host time of a Linear-BN-softmax training step (fp16, x (1024, 8192), 8192 → 8192), ours and torch's, split into
forward and torch.autograd.grad, each from an idle GPU (median of 50), then torch.profiler's top host entries of
five steps of ours: where the step's host time goes.

    PYTHONPATH=. python3 bench/experiments/host_overhead/host_lbs_step.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_linear_bn_softmax import K, N, F, _model  # noqa: E402
from common import device_ms, median_ms  # noqa: E402
from cupy_attn.torch import LinearBatchNormSoftmax  # noqa: E402


def split_us(model, x, dout, params, n=50):
    fwd, bwd = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = model(x)
        t1 = time.perf_counter()
        torch.autograd.grad(y, params, dout)
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    torch.cuda.synchronize()
    return float(np.median(fwd) * 1e6), float(np.median(bwd) * 1e6)


def main():
    plain = _model(torch.float16).train()
    fused = LinearBatchNormSoftmax.from_module(plain)
    x = torch.randn(N, K, device="cuda").to(torch.float16)
    dout = (torch.randn(N, F, device="cuda") / N).to(torch.float16)
    for name, model in (("ours", fused), ("torch", plain)):
        params = tuple(model.parameters())

        def step(model=model, params=params):
            torch.autograd.grad(model(x), params, dout)
        step()
        f, b = split_us(model, x, dout, params)
        print(f"{name:6s} step from idle {median_ms(step, 30, 5):.3f} ms, device {device_ms(step):.3f} ms; host: "
              f"forward {f:.0f} us, autograd.grad {b:.0f} us", flush=True)
    params = tuple(fused.parameters())
    if "--cprofile" in sys.argv:  # the forward on this thread; the backward where autograd runs it (its own profile)
        import cProfile
        import pstats

        from cupy_attn.linear_bn_softmax import backward as lbs_backward
        fwd, bwd = cProfile.Profile(), cProfile.Profile()
        inner = lbs_backward.grad_inputs
        lbs_backward.grad_inputs = lambda *a, **k: bwd.runcall(inner, *a, **k)
        for _ in range(50):
            torch.cuda.synchronize()
            y = fwd.runcall(fused, x)
            torch.autograd.grad(y, params, dout)
        lbs_backward.grad_inputs = inner
        for name, prof in (("forward", fwd), ("backward.grad_inputs", bwd)):
            print(name)
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            torch.autograd.grad(fused(x), params, dout)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
