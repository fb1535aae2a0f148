"""Why the head-dim-512 kernel alone (d512_wall.py) runs faster than the same call in the main job: the kernel launch
alone, the public call alone, and each in alternating rounds with torch's default SDPA (as bench_sdpa.bench_case
measures), with the SM clock sampled by nvidia-smi during each phase.

    PYTHONPATH=. python3 bench/experiments/d512/d512_clock.py [--shape 4,16,2048,2048,512] [--dtype float16]
"""
import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import cupy  # noqa: E402
import numpy as np  # noqa: E402

from common import interleaved_ms, tflops  # noqa: E402


class Clock:
    """nvidia-smi sampling the SM clock and power every 20 ms while a phase runs."""

    def __enter__(self):
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                      "-lms", "20"], stdout=subprocess.PIPE, text=True)
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        lines = self.proc.communicate()[0].split("\n")[10:]
        vals = np.array([[float(x) for x in ln.split(",")] for ln in lines if ln.count(",") == 1])
        self.mhz, self.watts = (np.median(vals[:, 0]), np.median(vals[:, 1])) if len(vals) else (0.0, 0.0)


def main():
    import torch
    import torch.nn.functional as F

    import cupy_attn
    from cupy_attn.attention import checks
    from cupy_attn.attention.kernels import flash_fwd_d512_sm90 as fused_d512
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,16,2048,2048,512")
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()
    B, H, L, S, D = (int(x) for x in args.shape.split(","))
    tdt = getattr(torch, args.dtype)
    q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=tdt) for n in (L, S, S))
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    out = cupy.empty((B, H, L, D), cq.dtype)
    lse = cupy.empty((B, H, L), cupy.float32)
    prob = checks.array_problem(cq, ck, cv, out, lse, scale=D ** -0.5)
    launch = fused_d512.build(prob, fused_d512.Choice(), out, lse)

    def bare():
        launch.launch_on(cupy.cuda.get_current_stream().ptr, cq.data.ptr, ck.data.ptr, cv.data.ptr, out.data.ptr,
                         lse.data.ptr)

    def call():
        return cupy_attn.scaled_dot_product_attention(q, k, v)

    def theirs():
        return F.scaled_dot_product_attention(q, k, v)

    print(cupy_attn.explain(q, k, v).backend)
    flops = 4.0 * B * H * L * S * D
    for name, fns in (("bare alone", (bare,)), ("call alone", (call,)), ("bare + torch", (bare, theirs)),
                      ("call + torch", (call, theirs)), ("bare alone x40", (bare,))):
        with Clock() as clk:
            ms = interleaved_ms(fns, rounds=5, repeat=40 if "x40" in name else 5)
        print(f"{name:16s} ours {ms[0]:.3f} ms ({tflops(flops, ms[0]):.0f} TFLOP/s)"
              + (f", torch {ms[1]:.3f}" if len(ms) > 1 else "") + f"; SM clock {clk.mhz:.0f} MHz, {clk.watts:.0f} W",
              flush=True)


if __name__ == "__main__":
    main()
