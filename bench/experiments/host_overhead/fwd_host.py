"""Host time on the forward's timeline: for issue 10's rows, ours and torch's default SDPA from an idle GPU (the
host's time before the launch included, as every benchmark row measures) and their device time alone
(common.device_ms), in alternating rounds, same process. New q/k/v each round (fresh random data), reused within it.

    PYTHONPATH=. python3 bench/experiments/host_overhead/fwd_host.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from cupyx.profiler import benchmark  # noqa: E402

import cupy_attn  # noqa: E402
from common import device_ms  # noqa: E402

ROWS = (((8, 16, 2048, 128), False), ((4, 32, 4096, 64), False), ((2, 16, 8192, 128), True),
        ((8, 16, 1024, 256), False), ((4, 32, 2048, 96), False))


def main(rounds=5):
    for dtype in (torch.float16, torch.bfloat16):
        for shape, causal in ROWS:
            B, H, L, D = shape
            res = {"ours": [], "torch": [], "ours dev": [], "torch dev": []}
            for _ in range(rounds):
                q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype) for _ in range(3))
                fns = {"ours": lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal),
                       "torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
                for name, fn in fns.items():
                    res[name].extend(benchmark(fn, n_repeat=10, n_warmup=3).gpu_times[0] * 1e3)
                    res[name + " dev"].append(device_ms(fn, reps=5))
            med = {n: float(np.median(v)) for n, v in res.items()}
            flops = 4 * B * H * L * L * D / (2 if causal else 1)
            print(f"{str(shape):20s} {'causal' if causal else '      '} {str(dtype)[6:]:8s} ours {med['ours']:.3f} ms "
                  f"(device {med['ours dev']:.3f}, {flops / med['ours'] / 1e9:.0f} TF/s) torch {med['torch']:.3f} "
                  f"(device {med['torch dev']:.3f}) x{med['torch'] / med['ours']:.3f} (device "
                  f"x{med['torch dev'] / med['ours dev']:.3f})", flush=True)


if __name__ == "__main__":
    main()
