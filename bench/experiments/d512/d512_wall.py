"""What paces the head-dim-512 fused kernel (issue 14's hd512 Must): its device time with parts removed at compile time
(-DCUPY_ATTN_D512_ABLATE=bits, see 725cf17's cuda_src/attention/flash_fwd_d512_sm90.cu; ablated kernels write wrong
results).

Runs against commit 725cf17's library: its kernels still read -DCUPY_ATTN_D512_ABLATE and -DCUPY_ATTN_D512_P_PARTS,
which the library kernels no longer carry (an ablation passes its -D options to a KernelFamily variant, see
bench/experiments/README.md). cupy_attn comes from PYTHONPATH (no experiment script puts a repository root on sys.path),
so, from the repository root:

    git worktree add /tmp/old 725cf17
    PYTHONPATH=/tmp/old python3 bench/experiments/d512/d512_wall.py [--shape B,H,L,S,D] [--dtype float16] [--causal] [--rounds 5]

Rows (kernel alone, median over rotated rounds, same process, same inputs): the full kernel; without the softmax;
without softmax and P stores (the mainloop: S and P·V wgmma on the ring); the load ring alone; the tensor work alone;
the loads with the softmax (no wgmma); one tile per CTA (not persistent); P in one part (v1.2's order: all
exponentials, then P·V) and in two parts (-DCUPY_ATTN_D512_P_PARTS); without the row-max exchange, the exponentials,
or both. Per row: ms, cycles per 256-key block at --ghz, the ring's L2 → SM rate, TFLOP/s (4·B·H·L·S·D, halved for
causal). --only takes row names separated by ";".
"""
import argparse
import dataclasses
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import cupy  # noqa: E402

from common import rotated_ms  # noqa: E402
from cupy_attn.attention import fused_d512  # noqa: E402

# bits: 1 no wgmma, 2 no loads, 4 no softmax, 8 no P stores, 16 no row-max exchange, 32 no exponentials
ROWS = (("full kernel", 0), ("no softmax", 4), ("no softmax, no P stores", 12), ("loads only", 13),
        ("wgmma only", 14), ("wgmma + softmax + P (no loads)", 2), ("loads + softmax + P (no wgmma)", 1),
        ("P in 1 part (v1.2 order)", "parts1"), ("P in 2 parts", "parts2"), ("no row-max exchange", 16),
        ("no exponentials", 32), ("no exchange, no exponentials", 48), ("one tile per CTA", "onetile"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,16,2048,2048,512")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ghz", type=float, default=1.4)
    ap.add_argument("--base", default=None, help="a scratch copy of the kernel source under cuda_src/: one more row")
    ap.add_argument("--only", default=None, help="row names to keep, separated by ';' (the full kernel always)")
    args = ap.parse_args()
    B, H, L, S, D = (int(x) for x in args.shape.split(","))
    import torch
    tdt = getattr(torch, args.dtype)
    q, k, v = (cupy.from_dlpack(torch.randn(B, H, n, D, device="cuda", dtype=tdt)) for n in (L, S, S))
    out = cupy.from_dlpack(torch.empty(B, H, L, D, device="cuda", dtype=tdt))
    lse = cupy.empty((B, H, L), cupy.float32)
    causal = "top_left" if args.causal else None
    keep = None if args.only is None else {"full kernel", *args.only.split(";")}
    rows = ROWS if keep is None else tuple(r for r in ROWS if r[0] in keep)
    rows += (("base source", "base"),) if args.base else ()
    base = fused_d512.FLASH_FWD_D512_SM90
    launches = {}
    for name, bits in rows:
        if bits == "base":
            fam = dataclasses.replace(base, source=args.base)
        elif bits == "onetile":
            fam = base
        elif isinstance(bits, str):
            fam = dataclasses.replace(base, options=(f"-DCUPY_ATTN_D512_P_PARTS={bits[5:]}",))
        else:
            fam = dataclasses.replace(base, options=(f"-DCUPY_ATTN_D512_ABLATE={bits}",))
        launch = fused_d512.prepare(q, k, v, out, lse, scale=D ** -0.5, causal=causal, family=fam,
                                    persistent=bits != "onetile")
        launches[name] = functools.partial(launch.launch_on, cupy.cuda.get_current_stream().ptr, q.data.ptr,
                                           k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr)
    ms_of = rotated_ms({name: launches[name] for name, _ in rows}, args.rounds)
    n_sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    m_blocks = -(-L // 64)
    if causal:
        kb = sum(min(-(-S // 256), (min(64 * (i + 1), L) - 1) // 256 + 1) for i in range(m_blocks))
    else:
        kb = m_blocks * -(-S // 256)
    kb_total = kb * B * H
    flop = 4.0 * B * H * L * S * D / (2 if causal else 1)
    print(f"shape (B,H,L,S,D)=({B},{H},{L},{S},{D}) {args.dtype} causal={bool(causal)}; key blocks {kb_total}, "
          f"{kb_total / n_sm:.0f} per SM; 512 KB of K and V per block")
    print(f"{'row':34s} {'bits':>4s} {'ms':>7s} {'cyc/blk':>7s} {'L2->SM TB/s':>11s} {'TFLOP/s':>8s}")
    for name, bits in rows:
        ms = ms_of[name]
        bits = 0 if isinstance(bits, str) else bits
        cyc = ms * 1e-3 * args.ghz * 1e9 / (kb_total / n_sm)
        tbps = 0 if bits & 2 else 512 * 1024 * kb_total / (ms * 1e-3) / 1e12
        print(f"{name:34s} {bits:4d} {ms:7.3f} {cyc:7.0f} {tbps:11.2f} {flop / (ms * 1e-3) / 1e12:8.1f}")


if __name__ == "__main__":
    main()
