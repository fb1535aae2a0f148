"""Is Q·Kᵀ in fp64 (tensor-core DGEMM) affordable for the fp32 split path? Times torch's batched fp32 and fp64 GEMMs
on the seed shape's first GEMM (1024 × (512 × 1024) · (1024 × 512)), plus the fp32 → fp64 conversion of Q and K.

    PYTHONPATH=. python3 bench/experiments/gemm/dgemm_scores.py
"""
import torch
from cupyx.profiler import benchmark


def ms(fn):
    r = benchmark(fn, n_repeat=10, n_warmup=3)
    return float(sorted(r.gpu_times[0])[len(r.gpu_times[0]) // 2] * 1e3)


torch.backends.cuda.matmul.allow_tf32 = False
B, L, S, E = 1024, 512, 512, 1024
q = torch.randn(B, L, E, device="cuda")
k = torch.randn(B, S, E, device="cuda")
qd, kd = q.double(), k.double()
flops = 2 * B * L * S * E
for name, fn in (("sgemm fp32", lambda: torch.bmm(q, k.transpose(1, 2))),
                 ("dgemm fp64", lambda: torch.bmm(qd, kd.transpose(1, 2))),
                 ("q,k -> fp64", lambda: (q.double(), k.double()))):
    t = ms(fn)
    print(f"{name:12s} {t:8.3f} ms  {flops / t * 1e-9:7.1f} TFLOP/s" if "gemm" in name else f"{name:12s} {t:8.3f} ms")
