"""gemm_3xtf32 against cuBLAS SGEMM on the fp32 seed's two GEMMs, and the fp32 seed SDPA on each (issue 14).

    PYTHONPATH=. python3 bench/experiments/gemm/gemm_3xtf32.py [--quick]

1. GEMMs of the fp32 seed (32, 32, 512, 512, 1024), as the split path issues them (one chunk of 1024 batch·heads):
   Q·Kᵀ: 1024 × (512×1024)·(1024×512)ᵀ, alpha = scale·log2 e;  P·V: 1024 × (512×512)·(512×1024).
   Rows: ms (median of CUDA-event timings, cupyx.profiler.benchmark), TFLOP/s (2·batch·m·n·k), and max |C − C₆₄| over
   the first 4 batches against a float64 product, for ours (gemm_3xtf32.Gemm3xTF32, two-level accumulation; the
   single-accumulator tile measured here in session 10 was removed, bench/notes/split.md), the split path's SGEMM
   (blas.StridedGemm, CUBLAS_COMPUTE_32F_PEDANTIC: what CUPY_ATTN_FP32_GEMM=sgemm runs), torch.baddbmm with TF32 off,
   and TF32 (blas.StridedGemm, allow_tf32=True) for scale. Inputs: randn, randn·4 + a direction shared by every row
   (large |scale·q·k|, the regime of issue 14), and for P·V rows of a softmax.
2. SDPA fp32 seed (32, 32, 512, 512, 1024): cupy_attn with CUPY_ATTN_FP32_GEMM=3xtf32 and =sgemm, and torch's
   default: ms, × torch, max error against the float64 reference on the first 2 heads; then the same at large logits
   (q, k ~ N(0, 16): |scale·q·k| up to ~80).
Needs ~12 GB of GPU memory (the seed's Q, K, V and the outputs in fp32).
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common
from common import median_ms, tflops  # noqa: E402

import cupy_attn  # noqa: E402
from cupy_attn import reference  # noqa: E402
from cupy_attn.attention import gemm_3xtf32  # noqa: E402
from cupy_attn.runtime import blas  # noqa: E402

LOG2E = 1.4426950408889634


def problem(batch, m, n, k, trans_b, alpha):
    """StridedGemm / Gemm3xTF32 keywords for contiguous (batch, m, k) · (batch, n, k)ᵀ or (batch, k, n)."""
    return dict(c_dtype=np.float32, ldc=n, stride_c=m * n, a_dtype=np.float32, lda=k, stride_a=m * k, trans_a=False,
                b_dtype=np.float32, ldb=k if trans_b else n, stride_b=n * k, trans_b=trans_b, m=m, n=n, k=k,
                batch=batch, alpha=alpha)


def gemm_rows(name, batch, m, n, k, trans_b, alpha, a, b, check=4):
    c = torch.empty(batch, m, n, device="cuda")
    kw = problem(batch, m, n, k, trans_b, alpha)
    ours = gemm_3xtf32.Gemm3xTF32(**kw)
    sgemm = blas.StridedGemm(**kw)
    tf32 = blas.StridedGemm(**kw, allow_tf32=True)
    bt = b.transpose(1, 2) if trans_b else b
    ref = alpha * torch.matmul(a[:check].double(), bt[:check].double())
    flops = 2.0 * batch * m * n * k
    rows = []

    def launch(gemm):
        gemm(c.data_ptr(), a.data_ptr(), b.data_ptr())
        return c

    def bmm():  # one kernel: alpha folded in, as in the others
        torch.backends.cuda.matmul.allow_tf32 = False
        return torch.baddbmm(c, a, bt, beta=0, alpha=alpha)

    for label, fn in (("3xtf32 (ours, two-level)", lambda: launch(ours)),
                      ("cuBLAS SGEMM (split path)", lambda: launch(sgemm)),
                      ("torch baddbmm, TF32 off", bmm), ("cuBLAS TF32", lambda: launch(tf32))):
        c.fill_(float("nan"))
        out = fn()
        torch.cuda.synchronize()
        err = (out[:check].double() - ref).abs().max().item()
        del out
        ms = median_ms(fn, n_repeat=10)
        rows.append((name, label, ms, tflops(flops, ms), err))
    return rows


def sdpa_rows(B, H, L, D, mult, label):
    q, k, v = (torch.randn(B, H, L, D, device="cuda") * s for s in (mult, mult, 1.0))
    qs, ks, vs = (x.flatten(0, 1)[:2].double().cpu().numpy() for x in (q, k, v))
    ref = reference.scaled_dot_product_attention(qs, ks, vs)
    err = lambda out: float(np.abs(out.flatten(0, 1)[:2].double().cpu().numpy() - ref).max())  # noqa: E731
    s_max = (q[0, :2].double() @ k[0, :2].double().transpose(-1, -2)).abs().max().item() / D ** 0.5
    t_out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    t_ms = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), n_repeat=10)
    rows = [(label, f"torch default (|s|max {s_max:.0f})", t_ms, 1.0, err(t_out))]
    del t_out
    for setting in gemm_3xtf32.CHOICES:
        os.environ[gemm_3xtf32.ENV_FP32_GEMM] = setting
        schedule = cupy_attn.explain(q, k, v).details["schedule"]
        want = {"3xtf32": "3xTF32 (", "sgemm": "cuBLAS SGEMM"}[setting]
        assert schedule.startswith(want), schedule
        out = cupy_attn.scaled_dot_product_attention(q, k, v)
        ms = median_ms(lambda: cupy_attn.scaled_dot_product_attention(q, k, v), n_repeat=10)
        rows.append((label, f"cupy_attn {setting}", ms, t_ms / ms, err(out)))
        del out
    os.environ.pop(gemm_3xtf32.ENV_FP32_GEMM)
    torch.cuda.empty_cache()
    return rows


def main(argv):
    quick = "--quick" in argv
    torch.manual_seed(0)
    B, H, L, D = (4, 32, 512, 1024) if quick else (32, 32, 512, 1024)
    batch = B * H
    print(f"{'GEMM':24s} {'kernel':28s} {'ms':>9s} {'TFLOP/s':>8s} {'max err':>9s}", flush=True)
    q = torch.randn(batch, L, D, device="cuda")
    k = torch.randn(batch, L, D, device="cuda")
    alpha = D ** -0.5 * LOG2E
    rows = gemm_rows("Q·Kᵀ randn", batch, L, L, D, True, alpha, q, k)
    offset = torch.randn(1, 1, D, device="cuda")  # a direction shared by all rows: scores grow like D, not √D
    q4, k4 = (torch.randn(batch, L, D, device="cuda") * 4 + offset for _ in range(2))  # alpha·q·k ~ 45 ± 23
    rows += gemm_rows("Q·Kᵀ large logits", batch, L, L, D, True, alpha, q4, k4)
    del q, k, q4, k4
    p = torch.softmax(torch.randn(batch, L, L, device="cuda") * 3, -1)
    v = torch.randn(batch, L, D, device="cuda")
    rows += gemm_rows("P·V", batch, L, D, L, False, 1.0, p, v)
    del p, v
    torch.cuda.empty_cache()
    for r in rows:
        print(f"{r[0]:24s} {r[1]:28s} {r[2]:9.3f} {r[3]:8.1f} {r[4]:9.2e}", flush=True)
    print(f"\n{'SDPA fp32':24s} {'path':28s} {'ms':>9s} {'x torch':>8s} {'max err':>9s}")
    for mult, label in ((1.0, f"seed {(B, H, L, L, D)}"), (4.0, "seed, q,k ~ N(0, 16)")):
        for r in sdpa_rows(B, H, L, D, mult, label):
            print(f"{r[0]:24s} {r[1]:28s} {r[2]:9.3f} {r[3]:8.2f} {r[4]:9.2e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
