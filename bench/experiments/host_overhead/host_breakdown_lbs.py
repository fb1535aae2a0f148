"""Where the host time of a cached Linear-BN-softmax call goes (torch tensors, fp16 training): each step timed alone
in a loop (µs per call, no GPU sync inside the loop; small (64, 256) → 512 so the GPU never backs up), then the seed
shape (1024, 8192) → 8192 per call from an idle GPU.

    PYTHONPATH=. python3 bench/experiments/host_overhead/host_breakdown_lbs.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import per_call_us  # noqa: E402

from cupy_attn.linear_bn_softmax import api, linear_batchnorm_softmax  # noqa: E402
from cupy_attn.runtime import callcache, cublaslt, workspace  # noqa: E402



def idle_us(fn, n=200):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return float(np.median(ts) * 1e6)


def model(n, k, f, dt):
    lin = torch.nn.Linear(k, f).cuda().to(dt)
    bn = torch.nn.BatchNorm1d(f).cuda().to(dt).train()
    scale = torch.nn.Parameter(torch.ones(1, device="cuda", dtype=dt))
    x = torch.randn(n, k, device="cuda").to(dt)
    args = (x, lin.weight, lin.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias, scale)
    kw = dict(training=True, momentum=bn.momentum, eps=bn.eps, num_batches_tracked=bn.num_batches_tracked)
    return args, kw, (lin, bn, scale)


def main():
    print("cuBLASLt via nvmath:", cublaslt.available())
    torch.set_grad_enabled(False)
    args, kw, _ = model(64, 256, 512, torch.float16)
    call = lambda: linear_batchnorm_softmax(*args, **kw)  # noqa: E731
    call()
    arrays = (*args, kw["num_batches_tracked"])
    key = api._call_key(arrays, True, kw["momentum"], kw["eps"], None)
    entry = callcache.get(key)
    prep = entry.prepared
    stream = prep.stream_ptr
    x = args[0]
    steps = {
        "whole call": call,
        "call key": lambda: api._call_key(arrays, True, kw["momentum"], kw["eps"], None),
        "signatures": lambda: callcache.signatures(arrays),
        "entry(arrays)": lambda: entry(arrays),
        "workspace.persistent": lambda: workspace.persistent(prep.device_id, stream, "lbs_work", prep.work_bytes),
        "capturing()": lambda: workspace.capturing(stream),
        "new_empty": lambda: x.new_empty((64, 512)),
        "gemm (bound)": lambda: prep._matmul(0 + prep.affine_bytes + workspace.pointer(
            workspace.persistent(prep.device_id, stream, "lbs_work", prep.work_bytes)), x.data_ptr(), args[1].data_ptr()),
        "torch module fwd": lambda: torch.softmax(args[7] * torch.nn.functional.batch_norm(
            torch.nn.functional.linear(x, args[1], args[2]), args[3], args[4], args[5], args[6], True), dim=1),
    }
    for name, fn in steps.items():
        print(f"{name:24s} {per_call_us(fn):7.2f} us", flush=True)
    for dt in (torch.float16, torch.bfloat16):
        args, kw, (lin, bn, scale) = model(1024, 8192, 8192, dt)
        ours = lambda: linear_batchnorm_softmax(*args, **kw)  # noqa: E731
        theirs = lambda: torch.softmax(scale * bn(lin(args[0])), dim=1)  # noqa: E731
        for name, fn in (("ours", ours), ("torch", theirs)):
            for _ in range(20):
                fn()
            print(f"seed {dt} training {name}: {idle_us(fn):.1f} us host from idle", flush=True)


if __name__ == "__main__":
    main()
