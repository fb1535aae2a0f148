"""Where a call's time goes: measured from an idle GPU (what benchmarks report) vs device time alone.

``idle ms``: median of GPU events around one call starting on an idle GPU (cupyx.profiler.benchmark), so host time
before the first launch counts. ``device ms``: the same call enqueued behind a 3 ms spin kernel, events recorded
around it on the stream, so the host runs ahead and only device work (and gaps the device cannot hide) is timed.
The difference is host time the GPU waits for. ``host us``: wall time of one call's enqueue. Then a cProfile of the
slowest cases, by own time.

    PYTHONPATH=. python3 bench/experiments/host_overhead/host_gap.py
    PYTHONPATH=. python3 bench/experiments/host_overhead/host_gap.py --sweep   # the head-dim sweep's (4,16,2048,2048,D), ours and torch
"""
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import torch  # noqa: E402

import cupy_attn  # noqa: E402
from common import device_ms, host_us, median_ms  # noqa: E402

def sweep():
    """bench_sdpa's head-dim sweep shapes (B=4, H=16, L=S=2048), fp16 and bf16, ours and torch's default SDPA."""
    for dt in (torch.float16, torch.bfloat16):
        for D in (64, 128, 256):
            q, k, v = (torch.randn(4, 16, 2048, D, device="cuda", dtype=dt) for _ in range(3))
            for name, fn in (("ours", lambda: cupy_attn.scaled_dot_product_attention(q, k, v)),
                             ("torch", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))):
                for _ in range(5):
                    fn()
                idle = median_ms(fn, n_repeat=30)
                dev = device_ms(fn)
                print(f"{str(dt)[6:]:9s} D={D:3d} {name:6s} idle {idle:.4f} ms  device {dev:.4f} ms  gap "
                      f"{1e3 * (idle - dev):6.1f} us  host {host_us(fn):6.1f} us", flush=True)


def main():
    if "--sweep" in sys.argv:
        sweep()
        return
    q, k, v = (torch.randn(32, 32, 512, 1024, device="cuda", dtype=torch.float16) for _ in range(3))
    x = torch.randn(1024, 8192, device="cuda", dtype=torch.float16)
    w = torch.randn(8192, 8192, device="cuda", dtype=torch.float16) / 90
    vecs = [torch.randn(8192, device="cuda") for _ in range(5)]
    rm, rv = vecs[0], vecs[1].abs() + 0.5
    b = vecs[2].half()
    sc = torch.ones(1, device="cuda")
    cases = {
        "sdpa seed fp16": lambda: cupy_attn.scaled_dot_product_attention(q, k, v),
        "lbs fp16 train": lambda: cupy_attn.linear_batchnorm_softmax(x, w, b, rm, rv, vecs[3], vecs[4], sc,
                                                                     training=True),
        "lbs fp16 eval": lambda: cupy_attn.linear_batchnorm_softmax(x, w, b, rm, rv, vecs[3], vecs[4], sc,
                                                                    training=False),
        "torch F.linear fp16": lambda: torch.nn.functional.linear(x, w),
    }
    for name, fn in cases.items():
        fn()
        idle = median_ms(fn, n_repeat=20)
        dev = device_ms(fn)
        print(f"{name:22s} idle {idle:.4f} ms  device {dev:.4f} ms  gap {1e3 * (idle - dev):6.1f} us  "
              f"host {host_us(fn):6.1f} us", flush=True)
    for name in ("sdpa seed fp16", "lbs fp16 train"):
        fn = cases[name]
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            fn()
            torch.cuda.synchronize()
        pr.disable()
        print(f"===== {name} (200 calls, each synchronized)")
        pstats.Stats(pr).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
