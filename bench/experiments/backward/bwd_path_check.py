"""Forward + backward through the public API (autograd), timed per CUPY_ATTN_BWD setting, to see which backward the
autograd path takes and what the whole step costs beyond the kernels; --host adds the step's device time (queued
behind a spin kernel, so host gaps do not count), its host µs and cProfile's top functions of its host work.

    PYTHONPATH=. python3 bench/experiments/backward/bwd_path_check.py [--host]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import torch  # noqa: E402

import cupy_attn  # noqa: E402
from common import device_ms, host_us, median_ms, print_profile  # noqa: E402


def main(host: bool = False):
    for (B, H, L, D) in ((8, 16, 1024, 256), (8, 16, 2048, 128)):
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
        dout = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)

        def step():
            out = cupy_attn.scaled_dot_product_attention(q, k, v)
            torch.autograd.grad(out, (q, k, v), dout)

        def fwd():
            with torch.no_grad():
                cupy_attn.scaled_dot_product_attention(q, k, v)
        for env in ("auto", "sm90", "split"):
            os.environ["CUPY_ATTN_BWD"] = env
            print(f"({B},{H},{L},{D}) CUPY_ATTN_BWD={env}: step {median_ms(step, 10, 3):.3f} ms "
                  f"(forward alone {median_ms(fwd, 10, 3):.3f})", flush=True)
        os.environ.pop("CUPY_ATTN_BWD")
        print(cupy_attn.explain(q, k, v))
        if host:
            print(f"  step from idle {median_ms(step, 10, 3):.3f} ms, device {device_ms(step):.3f} ms, "
                  f"host {host_us(step):.0f} us", flush=True)
    if host:
        print_profile(step, 10, "cumulative", 25)


if __name__ == "__main__":
    main("--host" in sys.argv[1:])
