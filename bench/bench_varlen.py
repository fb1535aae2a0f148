"""Packed variable-length batches (varlen_attention) against FlashAttention-4's flash_attn_varlen_func, same process.

    PYTHONPATH=. python bench/bench_varlen.py [--rounds 7]

Rows: the issue's packed batch (12 causal sequences of 256-4096 tokens, 25,701 in all; bf16, 32 query heads over 8
KV heads, head dim 128) forward, forward + backward, the same at head dims 64 and 256, and the forward with the
sequences in descending length (the order a longest-first schedule would take), and the forward reading K and V from
paged caches (pages of 64 and 16 keys in a shuffled order; FA4 through its page_table). TFLOP/s count the visible
(query, key) pairs: 4·H·Σ_b pairs_b·D. Timings: medians of event timings, ours and the peer alternating in rounds:
"ms" from an idle GPU per call (host time the GPU waits for included), "device ms" behind a spin kernel (host time
excluded: the GPU-bound case of a model's layers).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from common import device_ms, environ, fa4, print_table, rotated_ms  # noqa: E402

LENS = [256, 4096, 1024, 3000, 512, 2048, 3500, 777, 1999, 4001, 1488, 3000]  # 25,701 tokens
COLUMNS = [("row", "row", "s"), ("ms", "ms", ".3f"), ("tflops", "TFLOP/s", ".0f"), ("fa4_ms", "FA4 ms", ".3f"),
           ("x_fa4", "× FA4", ".2f"), ("dev_ms", "device ms", ".3f"), ("fa4_dev_ms", "FA4 device ms", ".3f"),
           ("x_fa4_dev", "device × FA4", ".2f"), ("max_err", "max err vs FA4", ".2e")]


def visible_pairs(lens, causal: bool) -> int:
    return sum(n * (n + 1) // 2 if causal else n * n for n in lens)


def paged_cache(k, v, lens, page: int):
    """k, v (total, Hkv, D) as paged caches (num_pages, page, Hkv, D) with their pages in a shuffled order, the
    (B, max_pages) block table and seqused_k (B,)."""
    import torch
    pages = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(0))
    table = torch.zeros((len(lens), max(pages)), dtype=torch.int32)
    caches = [torch.zeros((sum(pages), page) + x.shape[1:], dtype=x.dtype, device=x.device) for x in (k, v)]
    at = start = 0
    for b, (n, p) in enumerate(zip(lens, pages)):
        ids = perm[at:at + p]
        table[b, :p] = ids
        for c, x in zip(caches, (k, v)):
            flat = torch.zeros((p * page,) + x.shape[1:], dtype=x.dtype, device=x.device)
            flat[:n] = x[start:start + n].detach()
            c[ids.to(x.device)] = flat.view((p, page) + x.shape[1:])
        at, start = at + p, start + n
    used = torch.tensor(lens, dtype=torch.int32, device=k.device)
    return caches[0], caches[1], table.to(k.device), used


def run(rounds: int, only: str = "", bwd_kernel: bool = False) -> list[dict]:
    import torch
    import cupy_attn
    peer = fa4("flash_attn_varlen_func")
    rows = []
    for name, D, backward, lens, page in (
            ("fwd hd128", 128, False, LENS, 0), ("fwd+bwd hd128", 128, True, LENS, 0),
            ("fwd hd64", 64, False, LENS, 0), ("fwd hd256", 256, False, LENS, 0),
            ("fwd hd128, longest first", 128, False, sorted(LENS, reverse=True), 0),
            ("fwd hd128, pages of 64", 128, False, LENS, 64), ("fwd hd128, pages of 16", 128, False, LENS, 16)):
        if only and only not in name:
            continue
        Hq, Hkv = 32, 8
        total = sum(lens)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
        q = torch.randn((total, Hq, D), device="cuda", dtype=torch.bfloat16, requires_grad=backward)
        k = torch.randn((total, Hkv, D), device="cuda", dtype=torch.bfloat16, requires_grad=backward)
        v = torch.randn((total, Hkv, D), device="cuda", dtype=torch.bfloat16, requires_grad=backward)
        dout = torch.randn((total, Hq, D), device="cuda", dtype=torch.bfloat16)
        mx = max(lens)
        kv = {"k": k, "v": v, "cu_seqlens_k": cu}
        if page:
            kc, vc, table, used = paged_cache(k, v, lens, page)
            kv = {"k": kc, "v": vc, "cu_seqlens_k": None, "seqused_k": used}

        def ours():
            return cupy_attn.varlen_attention(q, cu_seqlens_q=cu, max_seqlen_q=mx, max_seqlen_k=mx, is_causal=True,
                                              **kv, **({"block_table": table} if page else {}))

        fns = {"ours": ours}
        if backward and bwd_kernel:  # the packed Hopper backward (CUPY_ATTN_VARLEN_BWD=kernel) beside the default
            def ours_kernel():
                with environ(CUPY_ATTN_VARLEN_BWD="kernel"):
                    return ours()
            fns["kernel"] = ours_kernel
        if peer is not None:
            def theirs():
                o = peer(q, cu_seqlens_q=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=True, **kv,
                         **({"page_table": table} if page else {}))
                return o[0] if isinstance(o, tuple) else o
            fns["fa4"] = theirs
        outs = {}
        for key, fn in list(fns.items()):
            if backward:
                def step(fn=fn, key=key):
                    # the knob must hold through the backward, which reads it
                    with environ(CUPY_ATTN_VARLEN_BWD="kernel") if key == "kernel" else contextlib.nullcontext():
                        torch.autograd.grad(fn(), (q, k, v), dout)
                outs[key] = fn().detach()
                fns[key] = step
            else:
                with torch.no_grad():
                    outs[key] = fn()
        with torch.no_grad() if not backward else torch.enable_grad():
            ms = rotated_ms(fns, rounds=rounds)
            dev = {key: [] for key in fns}
            for r in range(rounds):  # device time only (the host runs ahead behind a spin kernel), alternating
                for key in list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]:
                    dev[key].append(device_ms(fns[key], reps=3))
            dev = {key: float(np.median(t)) for key, t in dev.items()}
        flops = 4.0 * Hq * visible_pairs(lens, True) * D * (3.5 if backward else 1.0)
        row = {"row": name, "ms": ms["ours"], "tflops": flops / ms["ours"] / 1e9, "dev_ms": dev["ours"]}
        if "fa4" in ms:
            row.update(fa4_ms=ms["fa4"], x_fa4=ms["fa4"] / ms["ours"], fa4_dev_ms=dev["fa4"],
                       x_fa4_dev=dev["fa4"] / dev["ours"],
                       max_err=float((outs["ours"].float() - outs["fa4"].float()).abs().max()))
        if "kernel" in ms:
            row.update(kernel_ms=ms["kernel"], kernel_dev_ms=dev["kernel"],
                       kernel_err=float((outs["kernel"].float() - outs["ours"].float()).abs().max()))
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--only", default="", help="the rows whose name contains this text")
    ap.add_argument("--bwd-kernel", action="store_true",
                    help="time the packed Hopper backward (CUPY_ATTN_VARLEN_BWD=kernel) beside the default backward")
    args = ap.parse_args(argv)
    rows = run(args.rounds, args.only, args.bwd_kernel)
    print_table(rows, COLUMNS, "varlen_attention: 12 packed causal sequences, 25,701 tokens, bf16, 32/8 heads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
