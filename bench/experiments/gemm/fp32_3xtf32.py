"""Probe for issue 14's fp32 accuracy (design note in bench/notes/split.md, session 9): is S = Q·Kᵀ by three TF32
tensor-core GEMMs on a hi/lo split (3xTF32) more accurate than cuBLAS's SGEMM, and is the attention output computed
from it within 2× torch's own fp32 error? Torch ops only (torch.matmul with allow_tf32 on/off), same inputs, float64
reference; also the time of the S GEMMs at the fp32 seed shape.

    PYTHONPATH=. python3 bench/experiments/gemm/fp32_3xtf32.py
"""
import torch


def tf32_rn(x):
    """x rounded to TF32 (10 explicit mantissa bits), round to nearest even, as float32."""
    i = x.view(torch.int32)
    bias = 0xFFF + ((i >> 13) & 1)
    return ((i + bias) & ~0x1FFF).view(torch.float32)


def scores(q, k, how):
    torch.backends.cuda.matmul.allow_tf32 = how != "sgemm"
    try:
        if how == "sgemm":
            return q @ k.transpose(-1, -2)
        if how == "tf32":
            return q @ k.transpose(-1, -2)
        qh, kh = tf32_rn(q), tf32_rn(k)
        ql, kl = q - qh, k - kh
        kt, klt = kh.transpose(-1, -2), kl.transpose(-1, -2)
        return qh @ klt + ql @ kt + qh @ kt  # small terms first
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def attention(q, k, v, scale, how):
    s = scores(q, k, how) * scale
    p = torch.softmax(s, dim=-1)
    return p @ v


def main():
    torch.manual_seed(0)
    F = torch.nn.functional
    print(f"{'case':34s} {'S err sgemm':>12s} {'S err 3xtf32':>12s} {'S err tf32':>11s} | "
          f"{'out sgemm':>10s} {'out 3xtf32':>10s} {'torch':>10s}  bound(2x torch)")
    for (B, H, L, S, E), mult, scale in (((1, 4, 200, 300, 192), 4.0, None), ((1, 4, 200, 300, 512), 1.0, 1.0),
                                          ((1, 4, 200, 300, 1024), 1.0, 1.0), ((1, 4, 128, 256, 1024), 3.0, None)):
        q = torch.randn(B, H, L, E, device="cuda") * mult
        k = torch.randn(B, H, S, E, device="cuda") * mult
        v = torch.randn(B, H, S, E, device="cuda")
        sc = E ** -0.5 if scale is None else scale
        s64 = q.double() @ k.double().transpose(-1, -2)
        ref = torch.softmax(s64 * sc, -1) @ v.double()
        errs = {how: (scores(q, k, how).double() - s64).abs().max().item() for how in ("sgemm", "3xtf32", "tf32")}
        outs = {how: (attention(q, k, v, sc, how).double() - ref).abs().max().item() for how in ("sgemm", "3xtf32")}
        t = (F.scaled_dot_product_attention(q, k, v, scale=sc).double() - ref).abs().max().item()
        maxs = (s64 * sc).abs().max().item()
        print(f"{str((B, H, L, S, E)) + f' |s|max {maxs:.0f}':34s} {errs['sgemm']:12.2e} {errs['3xtf32']:12.2e} "
              f"{errs['tf32']:11.2e} | {outs['sgemm']:10.2e} {outs['3xtf32']:10.2e} {t:10.2e}  {2 * t:.2e}",
              flush=True)
    # Time of the S GEMM(s) at the fp32 seed (32, 32, 512, 512, 1024), CUDA events, median of 10.
    q = torch.randn(32, 32, 512, 1024, device="cuda")
    k = torch.randn(32, 32, 512, 1024, device="cuda")
    for how in ("sgemm", "3xtf32"):
        for _ in range(2):
            scores(q, k, how)
        ts = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            scores(q, k, how)
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        print(f"seed S GEMM(s) {how}: {sorted(ts)[5]:.2f} ms (3xtf32 includes the hi/lo split by torch ops)")


if __name__ == "__main__":
    main()
