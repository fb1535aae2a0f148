"""The packed kernel against the dense one on the same work, and its variants instantiation against its plain one.

    PYTHONPATH=.:/tmp/site python bench/experiments/varlen/packed_vs_dense.py

Rows: the issue's 12 packed causal sequences; 12 × 2048 and 6 × 4096 equal sequences, which the dense call also runs
(BSHD views of the same arrays). "variants" forces the variants' instantiation by a window that never binds. FA4's
flash_attn_varlen_func beside them when installed. Medians of event timings, rotated rounds (bench/common.rotated_ms).
"""
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))

import cupy_attn  # noqa: E402
from common import fa4, rotated_ms  # noqa: E402

LENS = [256, 4096, 1024, 3000, 512, 2048, 3500, 777, 1999, 4001, 1488, 3000]


def run(lens, label, peer):
    total, mx = sum(lens), max(lens)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    q = torch.randn(total, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fns = {"plain": lambda: cupy_attn.varlen_attention(q, k, v, cu, cu, mx, mx, is_causal=True),
           "variants": lambda: cupy_attn.varlen_attention(q, k, v, cu, cu, mx, mx, is_causal=True,
                                                          window_size=(1 << 20, 0))}
    if peer is not None:
        fns["fa4"] = lambda: peer(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx,
                                  causal=True)
    if len(set(lens)) == 1:
        B, L = len(lens), lens[0]
        qd, kd, vd = (x.view(B, L, x.shape[1], 128).transpose(1, 2) for x in (q, k, v))
        fns["dense"] = lambda: cupy_attn.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
    for f in fns.values():
        f()
    ms = rotated_ms(fns, rounds=7)
    flops = 4 * 32 * sum(n * (n + 1) / 2 for n in lens) * 128
    print(label, {key: f"{t:.3f} ms {flops / t / 1e9:.0f} TF/s" for key, t in ms.items()}, flush=True)


def main():
    peer = fa4("flash_attn_varlen_func")
    run(LENS, "issue lens", peer)
    run([2048] * 12, "12 x 2048", peer)
    run([4096] * 6, "6 x 4096", peer)


if __name__ == "__main__":
    main()
