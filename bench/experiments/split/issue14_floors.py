"""Floors for issue 14's seed Musts, measured on the GPU in one process (alternating rounds):

1. The seed's memory floor: every element of Q, K, V read once and O written once (what a fused kernel, causal or
   not, cannot avoid), timed as a streaming kernel with 16-byte accesses at the seed's size, a plain copy beside it.
2. The split design's floor: the two batched GEMMs alone (torch.matmul: scores Q·Kᵀ in the input dtype, then P·V), no
   softmax between them.
3. What the best kernels on this GPU reach at the seed's sequence length (L = S = 512) for head dims they support:
   torch's default SDPA (cuDNN on the H200) and its FlashAttention backend, with and without a causal mask, beside
   ours, as TFLOP/s (FLOPs = 4·B·H·L·S·D, halved for causal) and the causal / non-causal time ratio.

    PYTHONPATH=. python3 bench/experiments/split/issue14_floors.py [--quick]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import cupy  # noqa: E402

from common import GEMM_CEILING_TFLOPS, interleaved_ms, print_table, tflops  # noqa: E402


B, H, L = 32, 32, 512


def seed_floors(rounds: int) -> None:
    """1 and 2 at the seed (D = 1024), beside our calls."""
    import torch

    import cupy_attn
    dt = torch.float16
    D = 1024
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dt) for _ in range(3))
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    co = cupy.empty_like(cq)
    # 16-byte loads and stores (CuPy's elementwise kernels move 2 bytes per access here: 1.7 TB/s); the bytes are the
    # point, so the "sum" is an XOR of bit patterns.
    stream3 = cupy.RawKernel(r"""
    extern "C" __global__ void stream3(const uint4* a, const uint4* b, const uint4* c, uint4* o, long long n) {
      for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const uint4 x = a[i], y = b[i], z = c[i];
        o[i] = make_uint4(x.x ^ y.x ^ z.x, x.y ^ y.y ^ z.y, x.z ^ y.z ^ z.z, x.w ^ y.w ^ z.w);
      }
    }""", "stream3")
    n16 = cq.nbytes // 16
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]

    def add3(a, b, c, o):
        stream3((sms * 8,), (512,), (a, b, c, o, cupy.int64(n16)))
    gb = q.numel() * q.element_size() / 1e9
    scale = D ** -0.5
    ms_add3, ms_copy, ms_gemms, ms_ours, ms_ours_causal = interleaved_ms([
        lambda: add3(cq, ck, cv, co),
        lambda: co.__setitem__(Ellipsis, cq),
        lambda: torch.matmul(torch.matmul(q, k.transpose(-1, -2)), v),
        lambda: cupy_attn.scaled_dot_product_attention(q, k, v, scale=scale),
        lambda: cupy_attn.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True),
    ], rounds=rounds)
    flops = 4 * B * H * L * L * D
    rows = [
        {"what": "read q, k, v and write o (4 tensors of the seed)", "ms": ms_add3, "tb_s": 4 * gb / ms_add3},
        {"what": "copy o = q", "ms": ms_copy, "tb_s": 2 * gb / ms_copy},
        {"what": "two batched GEMMs alone (Q·Kᵀ fp16, then ·V)", "ms": ms_gemms, "tflops": tflops(flops, ms_gemms)},
        {"what": "ours, seed", "ms": ms_ours, "tflops": tflops(flops, ms_ours)},
        {"what": "ours, seed causal", "ms": ms_ours_causal, "tflops": tflops(flops / 2, ms_ours_causal),
         "ratio": ms_ours_causal / ms_ours},
    ]
    print_table(rows, [("what", "seed (32,32,512,512,1024) fp16", ""), ("ms", "ms", ".3f"),
                       ("tb_s", "TB/s", ".2f"), ("tflops", "TFLOP/s", ".0f"), ("ratio", "causal / non-causal", ".3f")])


def peers_at_512(rounds: int) -> None:
    """3: S = 512 at the head dims the peers support."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cupy_attn
    dt = torch.float16
    rows = []
    for D in (64, 128, 256):
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dt) for _ in range(3))
        fns, names = [], []
        for causal in (False, True):
            fns.append(lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c))
            names.append(("torch default (cuDNN)", causal))

            def flash(c=causal):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=c)
            fns.append(flash)
            names.append(("torch flash", causal))
            fns.append(lambda c=causal: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=c))
            names.append(("ours", causal))
        ms = interleaved_ms(fns, rounds=rounds)
        by = dict(zip(names, ms))
        flops = 4 * B * H * L * L * D
        for who in ("torch default (cuDNN)", "torch flash", "ours"):
            nc, c = by[(who, False)], by[(who, True)]
            rows.append({"case": f"(32,32,512,512,{D})", "who": who, "ms": nc, "tflops": tflops(flops, nc),
                         "pct": 100 * tflops(flops, nc) / GEMM_CEILING_TFLOPS, "causal_ms": c,
                         "causal_tflops": tflops(flops / 2, c), "ratio": c / nc})
    print_table(rows, [("case", "shape fp16", ""), ("who", "kernel", ""), ("ms", "ms", ".3f"),
                       ("tflops", "TFLOP/s", ".0f"), ("pct", "% of 728", ".0f"), ("causal_ms", "causal ms", ".3f"),
                       ("causal_tflops", "causal TFLOP/s", ".0f"), ("ratio", "causal / non-causal", ".3f")])


def main():
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds = 3 if args.quick else 5
    print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), torch.__version__, flush=True)
    seed_floors(rounds)
    peers_at_512(rounds)


if __name__ == "__main__":
    main()
