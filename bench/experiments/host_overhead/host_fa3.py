"""Host µs of a cached forward call whose q/k/v change every call (rotating over 3 buffer sets, as in training), on
the FA3-design kernel (CUPY_ATTN_FA3=2) and on the wgmma kernel (CUPY_ATTN_FA3=0), with torch's SDPA beside, plus
the device-time crossover: ms of both kernels at growing sizes (fp16, D = 128, same process).

    PYTHONPATH=. python3 bench/experiments/host_overhead/host_fa3.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import torch  # noqa: E402

from common import per_call_us  # noqa: E402
from cupyx.profiler import benchmark  # noqa: E402

import cupy_attn  # noqa: E402



def sets(B, H, L, D):
    return [tuple(torch.randn(B, H, L, D, device="cuda", dtype=torch.float16) for _ in range(3)) for _ in range(3)]


def main():
    small = sets(1, 8, 128, 128)
    it = [0]

    def call(f):
        def run():
            it[0] = (it[0] + 1) % 3
            return f(*small[it[0]])
        return run
    for mode in ("2", "0"):
        os.environ["CUPY_ATTN_FA3"] = mode
        print(f"host (1,8,128,128,128) fp16 rotating buffers, FA3={mode}: "
              f"{per_call_us(call(cupy_attn.scaled_dot_product_attention), 300, 3):.1f} us", flush=True)
    print(f"host torch SDPA: {per_call_us(call(torch.nn.functional.scaled_dot_product_attention), 300, 3):.1f} us")
    for B, H, L in ((1, 8, 512), (1, 16, 1024), (2, 16, 1024), (1, 32, 2048), (4, 16, 2048)):
        q, k, v = sets(B, H, L, 128)[0]
        row = []
        for mode in ("2", "0"):
            os.environ["CUPY_ATTN_FA3"] = mode
            r = benchmark(lambda: cupy_attn.scaled_dot_product_attention(q, k, v), n_repeat=30, n_warmup=5)
            row.append(float(sorted(r.gpu_times[0])[15] * 1e3))
        r = benchmark(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), n_repeat=30, n_warmup=5)
        t = float(sorted(r.gpu_times[0])[15] * 1e3)
        fl = 4 * B * H * L * L * 128
        print(f"({B},{H},{L},{L},128) {fl:.2e} FLOPs: fa3 {row[0]:.4f} ms, wgmma {row[1]:.4f} ms, torch {t:.4f} ms, "
              f"fa3/wgmma {row[1] / row[0]:.2f}x", flush=True)
    os.environ.pop("CUPY_ATTN_FA3")


if __name__ == "__main__":
    main()
