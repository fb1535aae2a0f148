"""What paces the persistent scores kernel's mainloop (issue 14's seed): its device time with parts removed at compile
time (-DCUPY_ATTN_SCORES_ABLATE=bits, see 725cf17's cuda_src/attention/scores_softmax_sm90.cu; ablated kernels write
wrong P).

Runs against commit 725cf17's library: its kernels still read -DCUPY_ATTN_SCORES_ABLATE and -DCUPY_ATTN_SCORES_P_TMA,
which the library kernels no longer carry (an ablation passes its -D options to a KernelFamily variant, see
bench/experiments/README.md). cupy_attn comes from PYTHONPATH (no experiment script puts a repository root on sys.path),
so, from the repository root:

    git worktree add /tmp/old 725cf17
    PYTHONPATH=/tmp/old python3 bench/experiments/split/scores_wall.py [--shape B,H,L,S,E] [--causal] [--dtype float16] [--rounds 5]

Rows (kernel alone, median over rotated rounds, same process, same inputs): the full kernel; without the epilogue
(mainloop pace); without epilogue and wgmma (the load ring alone); without epilogue and loads (the tensor work alone);
the same with only the first K box loaded (40 of 72 KB per stage), with and without wgmma. Per row: ms, cycles per k
block at the clock given by --ghz (scores_trace.py measures it: 1.35 GHz at the seed), TMA bytes per k block and
the L2 → SM rate they imply, TFLOP/s of the wgmma work; last, the kernel with P staged through the tile's last
stage and stored by TMA (-DCUPY_ATTN_SCORES_P_TMA, the epilogue before session 13). If the load ring alone takes as long as the mainloop, loads
pace it; if halving the bytes halves the load ring's time, the rate is a bandwidth, if not, a per-stage latency.
"""
import argparse
import dataclasses
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import cupy  # noqa: E402
import torch  # noqa: E402

from cupy_attn.attention import scores_sm90  # noqa: E402
from common import rotated_ms  # noqa: E402


# launch_for and problem: scores_ab.py's, as at commit 725cf17 (this script and scores_trace.py run against that
# commit's library, which still has the ablation macros; scores_ab.py follows the current tree).
def launch_for(family, q, k, lse, ld, causal):
    """The persistent kernel's launch (variant 3) prepared from `family` (a variant of SCORES_SOFTMAX_SM90: another
    source or options) in place of the declared one."""
    saved = scores_sm90.SCORES_SOFTMAX_SM90
    scores_sm90.SCORES_SOFTMAX_SM90 = family
    try:
        return scores_sm90.prepare(q, k, lse, scale=q.shape[-1] ** -0.5, ld=ld, variant=3, causal=causal)
    finally:
        scores_sm90.SCORES_SOFTMAX_SM90 = saved


def problem(ap):
    """Parse --shape/--dtype/--causal (and the caller's own arguments on `ap`): (args, (B, H, L, S, E), torch dtype,
    q, k as CuPy views of fresh random torch tensors, P's row pitch ld, causal)."""
    ap.add_argument("--shape", default="32,32,512,512,1024")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    B, H, L, S, E = map(int, args.shape.split(","))
    tdt = getattr(torch, args.dtype)
    q = cupy.from_dlpack(torch.randn(B, H, L, E, device="cuda", dtype=tdt))
    k = cupy.from_dlpack(torch.randn(B, H, S, E, device="cuda", dtype=tdt))
    return args, (B, H, L, S, E), tdt, q, k, -(-S // 8) * 8, "top_left" if args.causal else None


# bits: 1 no wgmma, 2 no loads, 4 first K box only, 8 no epilogue, 32 no exp, 64 no P stores
ROWS = (("full kernel", 0), ("no epilogue", 8), ("loads only (no wgmma, no epilogue)", 9),
        ("wgmma only (no loads, no epilogue)", 10), ("no epilogue, first K box only", 12),
        ("loads only, first K box only", 13), ("no wgmma (loads + epilogue)", 1), ("first K box only", 4),
        ("P by TMA stores through the last stage", "tma"), ("no exponentials", 32), ("no P stores", 64), ("no exponentials, no P stores", 96))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ghz", type=float, default=1.35)
    ap.add_argument("--base", default=None, help="a scratch copy of the kernel source under cuda_src/ (e.g. "
                    "attention/scores_ab_base.cu from `git show REV:...`): one more row, that source unablated")
    ap.add_argument("--only", default=None, help="comma-separated row names to keep (plus the base row)")
    args, (B, H, L, S, E), tdt, q, k, ld, causal = problem(ap)
    p = cupy.from_dlpack(torch.empty(B * H * L * ld, device="cuda", dtype=tdt))
    lse = cupy.empty((B, H, L), cupy.float32)
    launches = {}
    rows = ROWS if args.only is None else tuple(r for r in ROWS if r[0] in args.only.split(","))
    rows = rows if any(r[0] == "full kernel" for r in rows) else (ROWS[0],) + rows
    if args.base:
        rows += (("base source", "base"),)
    for name, bits in rows:
        if bits == "base":
            launches[name] = launch_for(dataclasses.replace(scores_sm90.SCORES_SOFTMAX_SM90, source=args.base), q, k,
                                        lse, ld, causal)
            continue
        opt = "-DCUPY_ATTN_SCORES_P_TMA" if bits == "tma" else f"-DCUPY_ATTN_SCORES_ABLATE={bits}"
        fam = dataclasses.replace(scores_sm90.SCORES_SOFTMAX_SM90, options=(opt,))
        launches[name] = launch_for(fam, q, k, lse, ld, causal)
    ptrs = (q.data.ptr, k.data.ptr, p.data.ptr, lse.data.ptr)
    ms_of = rotated_ms({name: functools.partial(launches[name], *ptrs) for name, _ in rows}, args.rounds)
    tile = launches["full kernel"].tile
    half_n = tile.half_n
    m_blocks, k_blocks = -(-L // 64), -(-E // 64)
    tiles = m_blocks * H * B
    n_sm = launches["full kernel"].grid[0]
    kb_per_sm = tiles * k_blocks / n_sm
    flop = 2.0 * B * H * L * S * E
    print(f"shape (B,H,L,S,E)=({B},{H},{L},{S},{E}) {args.dtype} causal={causal} tile {tile} grid {n_sm} "
          f"k blocks per CTA {kb_per_sm:.0f}")
    print(f"{'row':40s} {'bits':>4s} {'ms':>7s} {'cyc/kb':>7s} {'KB/kb':>6s} {'L2->SM TB/s':>11s} {'TFLOP/s':>8s}")
    for name, bits in rows:
        ms = ms_of[name]
        bits = 0 if isinstance(bits, str) else bits
        cyc = ms * 1e-3 * args.ghz * 1e9 / kb_per_sm
        kbytes = 0 if bits & 2 else (8 + (1 if bits & 4 else 2) * half_n * 128 / 1024)
        tbps = kbytes * 1024 * tiles * k_blocks / (ms * 1e-3) / 1e12
        tf = 0 if bits & 1 else flop / (ms * 1e-3) / 1e12
        print(f"{name:40s} {bits:4d} {ms:7.3f} {cyc:7.0f} {kbytes:6.0f} {tbps:11.2f} {tf:8.1f}")


if __name__ == "__main__":
    main()
