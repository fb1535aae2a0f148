"""Host time of a cached call against torch's own, in one process (issue 12's target: ≤ torch's for a small call).

    PYTHONPATH=. python3 bench/host_time.py

Host µs = median wall time of one call, the GPU synchronized before each call (so nothing queues behind it): what a
small call costs the Python thread. Rows: SDPA (1,8,128,128,64) fp16 through cupy_attn with torch tensors and with
CuPy arrays, torch's default SDPA on the same tensors; Linear-BN-softmax (64, 256) → 512 fp16 eval against the plain
torch module.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import host_us, print_table  # noqa: E402


def measure(n: int = 200) -> list[dict]:
    import cupy
    import torch

    import cupy_attn
    from cupy_attn.torch import LinearBatchNormSoftmax
    q, k, v = (torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.float16) for _ in range(3))  # L = S = 128
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    F = torch.nn.functional
    plain = torch.nn.Sequential()
    plain.gemm, plain.bn, plain.scale = torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512), torch.nn.Parameter(
        torch.ones(1))
    plain = plain.cuda().half().eval()
    fused = LinearBatchNormSoftmax.from_module(plain)
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    cases = {
        "sdpa (1,8,128,128,64) fp16 cupy_attn torch": lambda: cupy_attn.scaled_dot_product_attention(q, k, v),
        "sdpa (1,8,128,128,64) fp16 cupy_attn cupy": lambda: cupy_attn.scaled_dot_product_attention(cq, ck, cv),
        "sdpa (1,8,128,128,64) fp16 torch default": lambda: F.scaled_dot_product_attention(q, k, v),
        "linear_bn_softmax (64,256)->512 fp16 eval cupy_attn": lambda: fused(x),
        "linear_bn_softmax (64,256)->512 fp16 eval torch": lambda: torch.softmax(
            plain.scale * plain.bn(plain.gemm(x)), dim=1),
    }
    rows = []
    with torch.no_grad():
        for name, fn in cases.items():
            for _ in range(20):
                fn()
            rows.append({"case": name, "host_us": host_us(fn, n)})
    return rows


def main() -> None:
    rows = measure()
    print_table(rows, [("case", "case", "s"), ("host_us", "host µs", ".1f")], "host time per call (GPU idle at start)")


if __name__ == "__main__":
    main()
