"""Forward + backward through the public API: device time of the step (queued behind a spin kernel, so host gaps do
not count) against the time from an idle GPU, and cProfile's top functions of the step's host work.

    PYTHONPATH=. python3 bench/experiments/bwd_step_host.py
"""
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import cupy_attn  # noqa: E402
from common import device_ms, host_us, median_ms  # noqa: E402


def main():
    for (B, H, L, D) in ((8, 16, 1024, 256), (8, 16, 2048, 128)):
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
        dout = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)

        def step():
            out = cupy_attn.scaled_dot_product_attention(q, k, v)
            torch.autograd.grad(out, (q, k, v), dout)
        print(f"({B},{H},{L},{D}): from idle {median_ms(step, 10, 3):.3f} ms, device {device_ms(step):.3f} ms, "
              f"host {host_us(step):.0f} us", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        step()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
