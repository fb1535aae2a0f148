"""Where the persistent scores kernel's time goes, phase by phase (clock64 stamps compiled in by
-DCUPY_ATTN_SCORES_TRACE; see scores_trace in 725cf17's cuda_src/attention/scores_softmax_sm90.cu). The traced build
differs from the default (its mainloop is not unrolled; the stamps cost time): the script prints both kernels' times,
and the phases are read as shares of the traced tile.

Runs against commit 725cf17's library: its kernels still read -DCUPY_ATTN_SCORES_TRACE, which the library kernels no
longer carry (an ablation passes its -D options to a KernelFamily variant, see bench/experiments/README.md). cupy_attn
comes from PYTHONPATH (no experiment script puts a repository root on sys.path), so, from the repository root:

    git worktree add /tmp/old 725cf17
    PYTHONPATH=/tmp/old python3 bench/experiments/split/scores_trace.py [--shape B,H,L,S,E] [--causal] [--dtype float16]

Per tile and consumer warpgroup (the leader thread's view): mainloop (tile start → wgmma drained), of which waiting on
full barriers (TMA data not there) and on wgmma.wait_group, then the epilogue's steps: row max, exp + sum + the
statistics exchange, P into shared memory + store barrier, TMA store issue + read wait + release; the gap to the next tile. Also
the producer's cycles waiting on empty barriers, the SM clock (cycles per globaltimer ns), the traced kernel's time
against the untraced one's (the stamps' own cost), and per row block (causal: how a block's time follows its keys).
"""
import argparse
import dataclasses

import cupy
import numpy as np

from cupy_attn.attention import scores_sm90
from cupy_attn.runtime import compile as _compile
from scores_wall import launch_for, problem

TILES, FIELDS, CTAS = 80, 8, 160  # scores_trace::kTiles, kFields, kCtas


def launch_and_module(family, q, k, lse, ld, causal):
    """scores_wall.launch_for, and the CuPy module its kernel was loaded into (None if it was loaded before)."""
    n_before = len(_compile._CUBIN_MODULES)
    launch = launch_for(family, q, k, lse, ld, causal)
    return launch, (_compile._CUBIN_MODULES[-1] if len(_compile._CUBIN_MODULES) > n_before else None)


def main():
    import torch
    _, (B, H, L, S, E), tdt, q, k, ld, causal = problem(argparse.ArgumentParser())
    p = cupy.from_dlpack(torch.empty(B * H * L * ld, device="cuda", dtype=tdt))
    lse = cupy.empty((B, H, L), cupy.float32)
    traced = dataclasses.replace(scores_sm90.SCORES_SOFTMAX_SM90, options=("-DCUPY_ATTN_SCORES_TRACE",))
    plain, _ = launch_and_module(scores_sm90.SCORES_SOFTMAX_SM90, q, k, lse, ld, causal)
    tr, module = launch_and_module(traced, q, k, lse, ld, causal)
    ptrs = (q.data.ptr, k.data.ptr, p.data.ptr, lse.data.ptr)
    from cupyx.profiler import benchmark
    t_plain = benchmark(lambda: plain(*ptrs), n_repeat=30, n_warmup=5).gpu_times.mean() * 1e3
    t_tr = benchmark(lambda: tr(*ptrs), n_repeat=30, n_warmup=5).gpu_times.mean() * 1e3
    print(f"kernel ms: untraced {t_plain:.3f}, traced {t_tr:.3f}  grid {plain.grid}  tile {plain.tile}")
    buf = module.get_global("g_scores_trace")
    trace = cupy.ndarray((CTAS * TILES * 2 * FIELDS + CTAS * 4,), cupy.uint64, buf)
    trace.fill(0)
    cupy.cuda.Device().synchronize()
    tr(*ptrs)
    cupy.cuda.Device().synchronize()
    h = trace.get().astype(np.int64)
    rec = h[:CTAS * TILES * 2 * FIELDS].reshape(CTAS, TILES, 2, FIELDS)
    cta = h[CTAS * TILES * 2 * FIELDS:].reshape(CTAS, 4)
    n_cta = plain.grid[0]
    span_ns = cta[:n_cta, 2] - cta[:n_cta, 1]
    valid = rec[:n_cta, :, :, 7] > 0
    last = np.array([rec[c, valid[c, :, 0], 0, 7].max() for c in range(n_cta)])
    ghz = np.median((last - cta[:n_cta, 3]) / span_ns)
    print(f"SM clock {ghz:.3f} GHz (cycles per globaltimer ns), CTA span {np.median(span_ns) / 1e3:.1f} µs, "
          f"tiles per CTA {valid[:, :, 0].sum(1).min()}-{valid[:, :, 0].sum(1).max()}")
    r = rec[:n_cta][valid]  # (tiles·wg, FIELDS)
    parts = {
        "tile (start → end)": r[:, 7] - r[:, 0],
        "mainloop (start → wgmma drained)": r[:, 3] - r[:, 0],
        "  of which full-barrier waits": r[:, 1],
        "  of which wgmma wait_group": r[:, 2],
        "row max": r[:, 4] - r[:, 3],
        "exp + sum + exchange": r[:, 5] - r[:, 4],
        "P to smem + barrier": r[:, 6] - r[:, 5],
        "TMA store + read wait + release": r[:, 7] - r[:, 6],
    }
    nxt = rec[:n_cta, 1:, :, 0] - rec[:n_cta, :-1, :, 7]
    parts["gap to next tile"] = nxt[valid[:, 1:]]
    print(f"{'phase':36s} {'median cyc':>10s} {'p10':>8s} {'p90':>8s} {'µs':>7s}")
    for name, x in parts.items():
        print(f"{name:36s} {np.median(x):10.0f} {np.percentile(x, 10):8.0f} {np.percentile(x, 90):8.0f} "
              f"{np.median(x) / ghz / 1e3:7.2f}")
    print(f"producer empty-barrier wait per CTA: median {np.median(cta[:n_cta, 0]) / ghz / 1e3:.1f} µs")
    k_blocks = -(-E // 64)
    print(f"k blocks per tile {k_blocks}: mainloop per k block {np.median(parts['mainloop (start → wgmma drained)']) / k_blocks:.0f} cycles")
    # per row block (the tile index t = blockIdx.x + i·gridDim.x; row block = t % m_blocks)
    m_blocks = -(-L // 64)
    tiles = np.arange(TILES)[None, :] * n_cta + np.arange(n_cta)[:, None]
    mb = np.broadcast_to((tiles % m_blocks)[:, :, None], valid.shape)[valid]
    print("per row block: tile cycles / mainloop cycles / full-wait / mma-wait (median over tiles and warpgroups)")
    for b in range(m_blocks):
        sel = mb == b
        print(f"  block {b}: {np.median(parts['tile (start → end)'][sel]):8.0f} "
              f"{np.median(parts['mainloop (start → wgmma drained)'][sel]):8.0f} "
              f"{np.median(parts['  of which full-barrier waits'][sel]):8.0f} "
              f"{np.median(parts['  of which wgmma wait_group'][sel]):8.0f}")


if __name__ == "__main__":
    main()
