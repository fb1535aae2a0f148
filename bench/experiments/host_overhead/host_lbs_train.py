"""Host profile of a Linear-BN-softmax training step (forward + torch.autograd.grad) at (1024, 8192) -> 8192 fp16:
wall µs per step with the GPU idle at the start, torch's plain module beside; per-step ms of 20 steps enqueued back to
back between two CUDA events (a training loop: host time hides behind the device's queue unless it is longer), with
the host µs per step of that loop; then cProfile's top functions of ours.

    PYTHONPATH=. python3 bench/experiments/host_overhead/host_lbs_train.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import torch  # noqa: E402

from bench_linear_bn_softmax import N, K, F, _model  # noqa: E402
from common import print_profile  # noqa: E402
from cupy_attn.torch import LinearBatchNormSoftmax  # noqa: E402


def main():
    plain = _model(torch.float16).train()
    fused = LinearBatchNormSoftmax.from_module(plain)
    x = torch.randn(N, K, device="cuda", dtype=torch.float16)
    dout = torch.randn(N, F, device="cuda", dtype=torch.float16) / N
    for name, model in (("ours", fused), ("torch", plain)):
        params = tuple(model.parameters())

        def step():
            torch.autograd.grad(model(x), params, dout)
        for _ in range(10):
            step()
        ts, us_fwd = [], []
        for _ in range(50):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(x)
            t1 = time.perf_counter()
            torch.autograd.grad(out, params, dout)
            ts.append(time.perf_counter() - t)
            us_fwd.append(t1 - t)
        torch.cuda.synchronize()
        ts.sort(), us_fwd.sort()
        print(f"{name}: step host {ts[25] * 1e6:.1f} us (forward {us_fwd[25] * 1e6:.1f} us)", flush=True)
        loops, hosts = [], []
        for _ in range(7):  # 20 steps back to back, from an idle GPU
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            start.record()
            for _ in range(20):
                step()
            end.record()
            hosts.append((time.perf_counter() - t) / 20)
            end.synchronize()
            loops.append(start.elapsed_time(end) / 20)
        loops.sort(), hosts.sort()
        print(f"{name}: loop of 20 steps {loops[3]:.4f} ms per step (host {hosts[3] * 1e6:.1f} us per step)",
              flush=True)
    params = tuple(fused.parameters())
    print_profile(lambda: torch.autograd.grad(fused(x), params, dout), 50)


if __name__ == "__main__":
    main()
