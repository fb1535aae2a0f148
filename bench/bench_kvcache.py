"""Decode against a paged KV cache: attention_with_kvcache (flash_decode's paged instantiation) against
FlashAttention-4's flash_attn_varlen_func with a page_table and torch's SDPA on the gathered, padded cache, same
process.

    PYTHONPATH=. python bench/bench_kvcache.py [--rounds 7]

Rows follow issue 34's table: 64 sequences of 512-8192 cached tokens (a fixed random draw), 32 query heads over 8 KV
heads, head dim 128, bf16, one query row per sequence; pages of 64 and 128 keys in a shuffled order, and the same
cache dense (B, S_max, Hkv, D). TB/s count the K and V bytes the sequences hold: Σ_b S_b · Hkv · (E + Ev) · 2.
Timings: medians of event timings, ours and the peers alternating in rotated rounds (bench/common.rotated_ms).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from common import device_ms, environ, fa4, print_table, rotated_ms  # noqa: E402

COLUMNS = [("row", "row", ""), ("ms", "ms", ".3f"), ("tbs", "TB/s", ".2f"), ("fa4_ms", "FA4 ms", ".3f"),
           ("x_fa4", "× FA4", ".2f"), ("torch_ms", "torch ms", ".3f"), ("x_torch", "× torch", ".2f"),
           ("dev_ms", "device ms", ".3f"), ("dev_tbs", "device TB/s", ".2f"), ("dev_fa4", "FA4 device ms", ".3f"),
           ("dev_torch", "torch device ms", ".3f"), ("max_err", "max |ours − FA4|", ".2e")]


def run(rounds: int, splits: tuple = (), stream: bool = False) -> list[dict]:
    import torch
    import cupy_attn
    peer = fa4("flash_attn_varlen_func")
    rng = np.random.default_rng(0)
    B, Hq, Hkv, D = 64, 32, 8, 128
    lens = rng.integers(512, 8193, B)
    S_max = int(-(-lens.max() // 128) * 128)
    q = torch.randn((B, 1, Hq, D), device="cuda", dtype=torch.bfloat16)
    used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    dense_k = torch.randn((B, S_max, Hkv, D), device="cuda", dtype=torch.bfloat16)
    dense_v = torch.randn((B, S_max, Hkv, D), device="cuda", dtype=torch.bfloat16)
    nbytes = float(lens.sum()) * Hkv * 2 * D * 2
    rows = []
    for page in (64, 128, 0):
        if page:
            per = S_max // page
            perm = torch.randperm(B * per, generator=torch.Generator().manual_seed(page))
            table = perm.reshape(B, per).to(torch.int32).cuda()
            k_cache = torch.empty((B * per, page, Hkv, D), device="cuda", dtype=torch.bfloat16)
            v_cache = torch.empty_like(k_cache)
            k_cache[table.long().reshape(-1)] = dense_k.reshape(B * per, page, Hkv, D)
            v_cache[table.long().reshape(-1)] = dense_v.reshape(B * per, page, Hkv, D)
            name = f"pages of {page}"
        else:
            table, k_cache, v_cache, name = None, dense_k, dense_v, "dense cache"

        def ours():
            return cupy_attn.attention_with_kvcache(q, k_cache, v_cache, used, table)

        fns = {"ours": ours}
        if stream:  # the TMA streaming kernel's paged instantiation beside flash_decode's (--stream)
            def ours_stream():
                with environ(CUPY_ATTN_DECODE="2"):
                    return cupy_attn.attention_with_kvcache(q, k_cache, v_cache, used, table)
            fns["stream"] = ours_stream
        for n in splits:  # forced split counts beside the automatic one (--splits)
            fns[f"n{n}"] = (lambda n=n: cupy_attn.attention_with_kvcache(q, k_cache, v_cache, used, table,
                                                                        num_splits=n))
        if peer is not None and page:
            def theirs():
                o = peer(q, k_cache, v_cache, seqused_k=used, page_table=table, max_seqlen_q=1, max_seqlen_k=S_max)
                return o[0] if isinstance(o, tuple) else o
            fns["fa4"] = theirs
        if not page:  # torch's SDPA on the padded dense cache with a key-padding mask
            keep = (torch.arange(S_max, device="cuda")[None] < used[:, None])[:, None, None]
            qt, kt, vt = q.transpose(1, 2), dense_k.transpose(1, 2), dense_v.transpose(1, 2)
            fns["torch"] = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep,
                                                                                   enable_gqa=True).transpose(1, 2)
        with torch.no_grad():
            outs = {n: fn() for n, fn in fns.items()}
            ms = rotated_ms(fns, rounds=rounds)
            dev = {n: float(np.median([device_ms(fn, reps=5) for _ in range(rounds)])) for n, fn in fns.items()}
        row = {"row": name, "ms": ms["ours"], "tbs": nbytes / ms["ours"] / 1e9, "dev_ms": dev["ours"],
               "dev_tbs": nbytes / dev["ours"] / 1e9}
        row.update({f"dev_{n}": dev[n] for n in dev if n != "ours"})
        row.update({f"ms_{n}": ms[n] for n in ms if n.startswith("n")})
        if "stream" in ms:
            row.update(stream_ms=ms["stream"], stream_tbs=nbytes / ms["stream"] / 1e9,
                       stream_err=float((outs["stream"].float() - outs["ours"].float()).abs().max()))
        if "fa4" in ms:
            row.update(fa4_ms=ms["fa4"], x_fa4=ms["fa4"] / ms["ours"],
                       max_err=float((outs["ours"].float() - outs["fa4"].float()).abs().max()))
        if "torch" in ms:
            row.update(torch_ms=ms["torch"], x_torch=ms["torch"] / ms["ours"])
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--splits", default="", help="comma-separated num_splits to time beside the automatic choice")
    ap.add_argument("--stream", action="store_true", help="time the TMA streaming kernel's paged instantiation too")
    args = ap.parse_args(argv)
    rows = run(args.rounds, tuple(int(n) for n in args.splits.split(",") if n), args.stream)
    print_table(rows, COLUMNS, "attention_with_kvcache: 64 sequences of 512-8192 cached tokens, 32/8 heads, hd128, bf16")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
