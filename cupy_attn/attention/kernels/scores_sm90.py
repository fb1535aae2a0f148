"""Attention probabilities on Hopper, the softmax in the GEMM's epilogue (cuda_src/attention/scores_sm90.cu).

    P   = softmax(scale · Q Kᵀ)        (B, Hq, L, S) in the input dtype, rows ``ld`` elements apart
    lse = log Σ_j exp(scale · q·k_j)   (B, Hq, L) float32, natural log

for seqlen_k ≤ 512 (a CTA holds whole score rows: 64 query rows × all keys in wgmma accumulators), fp16/bf16, any head
dim E with 16-byte row strides, no mask, is_causal in both alignments (the one-CTA kernel; P is 0 past each row's
limit), GQA by head index; with the persistent kernel, an attn_mask that varies only along the keys. The split path
(paths/split.py) runs it in place of its Q·Kᵀ GEMM + softmax pass where the plan says so (dispatch: unless
``CUPY_ATTN_SPLIT_FUSED=0``, :func:`enabled`), and its P·V GEMM reads P directly: no fp32 score buffer (head dims
above 256, e.g. the seed (32, 32, 512, 1024)). Three variants of the kernel (:data:`KERNELS`, chosen by
``CUPY_ATTN_SPLIT_FUSED``, see :func:`setting`): one CTA per 64-row block (1); clusters of two CTAs of adjacent row
blocks sharing each K tile by TMA multicast, half the L2 → shared-memory traffic (2); persistent CTAs, one per SM,
each walking its row blocks so that one block's softmax and P stores overlap the next block's loads (3, the default;
P leaves it by 16-byte stores from registers, the one-tile kernels stage it for TMA stores). Under a causal mask the
persistent kernel's 256-key tile runs a narrow row block and a wide one of the same head as one tile
(:func:`causal_pairs`). :func:`choose` makes a call's choice (variant, kernel, tile), :func:`build` its launch.

Tensor maps are 4-D, (E, seqlen, heads, batch), with the arrays' own strides (runtime.tma.MapSpec), encoded when the
q/k pointers change (the last pair is remembered).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from ...runtime import env
from ...runtime.compile import KernelFamily
from ...runtime.interop import device_sms, dtype_name
from ...runtime.kernel_abi import C_TYPE_16, LOG2E, MASK_KIND, set_strides
from ...runtime.launch import Maps, PreparedLaunch, Step
from ...runtime.tma import F64, I64, MAP, MapSpec, c_struct, exp2_tma_reason, tma_operand_reason
from .. import variants

THREADS = 384        # a producer warpgroup and two consumer warpgroups
BLOCK_M = 64         # query rows per CTA
MAX_SEQLEN_K = 512   # 2 × 256: two warpgroups of m64n256 fp32 accumulators (128 registers per thread each)
ENV_SPLIT_FUSED = "CUPY_ATTN_SPLIT_FUSED"
# variant -> the kernel. 1: one CTA per row block. 2: clusters of two CTAs (along the row blocks of one head); each
# CTA's producer loads one of a stage's two K boxes and multicasts it to both CTAs, so K crosses from L2 once per 128
# query rows instead of once per 64. 3: persistent, one CTA per SM walking the row blocks (a tile scheduler).
KERNELS = {1: "scores_softmax_sm90", 2: "scores_softmax_sm90_cluster2", 3: "scores_softmax_sm90_persistent"}
CLUSTER_M = {1: 1, 2: 2, 3: 1}  # variant -> CTAs per cluster
# The persistent kernel with a key-only attn_mask added in its epilogue (key padding: a mask that does not vary along
# the query rows), its own instantiation: the unmasked kernels' code is untouched.
MASKED_KERNEL = "scores_softmax_sm90_persistent_masked"
MASKED_NOT_BUILT = (192,)  # tiles (half_n) without a masked instantiation (SCORES_SOFTMAX_SM90.where)
# Masked tiles that calls are sent to: those whose GPU tests have run.
MASKED_DISPATCHED = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class ScoresTile:
    """Keys per consumer warpgroup (kHalfN: the CTA covers 2·half_n ≥ S keys) and stages in the TMA ring."""
    half_n: int
    stages: int

    def smem_bytes(self) -> int:
        """stages × (Q 64×64 + K 2·half_n×64) 16-bit tiles, 16 bytes of barriers per stage, 1 KB of row statistics
        (two warpgroups × 64 rows × (max, sum)), 1 KB of alignment slack: SharedStorage::kBytes in
        scores_sm90.cu."""
        return self.stages * (BLOCK_M * 128 + 2 * self.half_n * 128) + 16 * self.stages + 2 * BLOCK_M * 8 + 1024


# half_n -> tile, the smallest half_n with 2·half_n ≥ S taken. Shared memory of the 227 KB (232448 B) per block:
TILES = {
    64: ScoresTile(64, 4),     # 4 × 24 KB = 98 KB (more stages would not help: the ring covers 4 head-dim steps)
    128: ScoresTile(128, 4),   # 4 × 40 KB = 162 KB
    192: ScoresTile(192, 4),   # 4 × 56 KB = 226 KB: the most that fits
    256: ScoresTile(256, 3),   # 3 × 72 KB = 218 KB (4 stages would need 290 KB)
}

# ScoresSm90Params (cuda_src/attention/scores_sm90.cu), declared once here.
_PARAMS = c_struct([("tma_q", MAP, 64), ("tma_k", MAP, 64), ("tma_p", MAP, 64)]
                   + [(n, F64 if n == "scale_log2" else I64, 8) for n in (
                       "lse", "seqlen_q", "seqlen_k", "head_dim", "groups", "scale_log2",
                       "lse_stride_b", "lse_stride_h", "lse_stride_l", "is_causal", "causal_offset",
                       "num_heads", "batch", "p", "ld", "pair_p0", "pair_n", "pair_count",
                       "read_rows", "read_keys", "mask", "mask_kind", "mask_stride_b", "mask_stride_h",
                       "mask_stride_k")]
                   + [("tma_k64", MAP, 64)])

SCORES_SOFTMAX_SM90 = KernelFamily(
    name="scores_softmax_sm90",
    source="attention/scores_sm90.cu",
    template="cupy_attn::{kernel}<{dtype}, {tile.half_n}, {tile.stages}>",
    axes={"kernel": tuple(KERNELS.values()) + (MASKED_KERNEL,), "dtype": tuple(C_TYPE_16.values()),
          "tile": tuple(TILES.values())},
    # The masked kernel's 192-key tile made ptxas serialize its wgmma (C7511: the mask loads' registers on the tile
    # whose four stages fill shared memory): not built; masked calls with 257-384 keys take the 256-key tile.
    where=lambda row: row["kernel"] != MASKED_KERNEL or row["tile"].half_n not in MASKED_NOT_BUILT,
    archs=("sm_90a",),
    structs=(("cupy_attn::ScoresSm90Params", _PARAMS),),
    arch="sm_90a",
)


def setting() -> int:
    """``CUPY_ATTN_SPLIT_FUSED``: 0 (the split path keeps its cuBLAS Q·Kᵀ + softmax pass), 1 (this kernel, one CTA per
    64-row block), 2 (its cluster variant: CTA pairs sharing K by TMA multicast), 3 (persistent CTAs; the default,
    unset or any other value). Why 3: at the seed (32,32,512,512,1024) it measured 7% faster than 1 (causal 5%), and
    2 slower than 1 (bench/experiments/split/scores_sm90.py; bench/notes/split.md)."""
    return {"0": 0, "1": 1, "2": 2}.get(env.get(ENV_SPLIT_FUSED, "3"), 3)


def enabled() -> bool:
    """``CUPY_ATTN_SPLIT_FUSED`` is not 0: the split path runs this kernel wherever :func:`reason` allows
    (:func:`setting` picks the variant)."""
    return setting() > 0


def grid_for(batch: int, num_heads: int, seqlen_q: int, variant: int = 1, num_sms: int = 132) -> tuple:
    """Variants 1 and 2: (row blocks, Hq, B), ⌈L / 64⌉ blocks of 64 query rows, rounded up to a multiple of the
    cluster's CTAs (variant 2: pairs adjacent along x; an odd count gets one CTA past L, which loads its share of K
    and stores nothing). Variant 3 (persistent): (min(row blocks · Hq · B, num_sms), 1, 1), one CTA per SM.

    >>> grid_for(32, 32, 512, 2), grid_for(2, 3, 130, 2), grid_for(2, 3, 130, 1), grid_for(1, 1, 1, 2)
    ((8, 32, 32), (4, 3, 2), (3, 3, 2), (2, 1, 1))
    >>> grid_for(32, 32, 512, 3), grid_for(2, 3, 130, 3)
    ((132, 1, 1), (18, 1, 1))
    """
    if variant not in KERNELS:
        raise ValueError(f"variant={variant}: the scores kernel's variants are {sorted(KERNELS)}")
    blocks = -(-seqlen_q // BLOCK_M)
    if variant == 3:
        return (min(blocks * num_heads * batch, num_sms), 1, 1)
    m = CLUSTER_M[variant]
    return (-(-blocks // m) * m, num_heads, batch)


def tile_for(seqlen_k: int, masked: bool = False) -> ScoresTile:
    """The tile whose two warpgroups cover seqlen_k keys with the least padding (1 ≤ seqlen_k ≤ 512); masked: among
    the masked kernel's built tiles (the 384-key tile is not: S 257-384 takes the 512-key one, its keys past S
    masked like any tile's).

    >>> [tile_for(s).half_n for s in (1, 64, 100, 128, 129, 256, 300, 384, 385, 512)]
    [64, 64, 64, 64, 128, 128, 192, 192, 256, 256]
    >>> [tile_for(s, masked=True).half_n for s in (256, 257, 384)]
    [128, 256, 256]
    """
    if not 1 <= seqlen_k <= MAX_SEQLEN_K:
        raise ValueError(f"seqlen_k={seqlen_k}: the scores kernel holds rows of 1-{MAX_SEQLEN_K} keys")
    return next(TILES[n] for n in sorted(TILES)
                if 2 * n >= seqlen_k and not (masked and n in MASKED_NOT_BUILT))


def visible_keys(seqlen_q: int, seqlen_k: int, causal_offset: int, m0: int) -> int:
    """Keys 0 ... n - 1 visible to some row of the 64-row block starting at row m0 under a causal mask (key j visible
    to row i iff j ≤ i + causal_offset): the limit of its last row, clipped to [0, seqlen_k]. The kernel's
    visible_keys."""
    last_row = min(m0 + BLOCK_M, seqlen_q) - 1
    return max(0, min(seqlen_k, last_row + causal_offset + 1))


def causal_pairs(seqlen_q: int, seqlen_k: int, causal_offset: int, half_n: int) -> tuple:
    """(p0, n, pairs): the persistent kernel's causal pair tiles. Row blocks p0 ... p0 + n - 1 see some but not all
    of the keys (the window; under a causal mask the visible keys grow by 64 from one block to the next); the outer
    ``pairs`` pairs of the window, (p0 + j, p0 + n - 1 - j), run as one tile each when their visible keys, rounded up
    to 64, add up to at most 2·half_n = 512 (the window is cut short at its wide end where that pairs more blocks):
    warpgroup 0 takes the wide block's first 256 keys, warpgroup 1 the rest
    of them and all of the narrow block's (scores_sm90.cu, Tile). So a square causal call does about half the
    tiles, each a whole tile's work: a narrow block alone is paced by its loads like a full one. Only the 256-key tile
    (S > 384) pairs; (0, 0, 0) otherwise. At the seed's causal variant (32, 32, 512, 512, 1024) the pairs measured
    20-25% off the kernel's time (bench/notes/split.md).

    >>> causal_pairs(512, 512, 0, 256), causal_pairs(448, 448, 0, 256), causal_pairs(1024, 512, -512, 256)
    ((0, 7, 3), (0, 6, 3), (8, 7, 3))
    >>> causal_pairs(256, 512, 256, 256), causal_pairs(512, 512, 0, 192), causal_pairs(500, 500, 0, 256)
    ((0, 3, 0), (0, 0, 0), (0, 7, 3))
    >>> causal_pairs(450, 512, 0, 256), causal_pairs(1000, 512, -488, 256)  # the widest block left out of the window
    ((0, 7, 3), (7, 7, 3))
    """
    if half_n != 256:
        return (0, 0, 0)
    L, S = seqlen_q, seqlen_k
    # Blocks whose last row sees between 1 and S - 1 keys: last_row in [-offset, S - offset - 2].
    first = max(0, (-causal_offset) // BLOCK_M - 1)
    stop = min(-(-L // BLOCK_M), max(0, (S - causal_offset) // BLOCK_M + 2))
    window = [r for r in range(first, stop) if 0 < visible_keys(L, S, causal_offset, r * BLOCK_M) < S]
    if not window:
        return (0, 0, 0)
    p0, n = window[0], len(window)
    assert window == list(range(p0, p0 + n)), window

    def width(r: int) -> int:
        return -(-visible_keys(L, S, causal_offset, r * BLOCK_M) // 64) * 64

    def folded(m: int) -> int:  # the valid outer pairs of the window's first m blocks
        pairs = 0
        while pairs < m // 2 and width(p0 + pairs) + width(p0 + m - 1 - pairs) <= 2 * half_n:
            pairs += 1
        return pairs

    # Where rounding up to 64 makes the outer pair too wide (L or the alignment off the 64-row grid), leaving the
    # widest blocks out of the window (as tiles of their own) can still pair the rest.
    best = max(range(n, 0, -1), key=folded)
    return (p0, best, folded(best))


def mask_reason(mask, seqlen_q: int) -> str | None:
    """None when the masked kernel reads ``mask`` (a (B, Hq, L, S) view, the call's attn_mask broadcast): one that does
    not vary along the query rows (stride 0 there, or L = 1), bool or float; else why not.

    >>> import numpy as np
    >>> pad = np.broadcast_to(np.ones((2, 1, 1, 300), bool), (2, 4, 100, 300))
    >>> mask_reason(pad, 100) is None, mask_reason(np.ones((2, 4, 100, 300), np.float16), 100)
    (True, 'attn_mask varies along the query rows (stride 300 elements): the scores kernel adds key-only masks')
    """
    if dtype_name(mask.dtype) not in MASK_KIND:
        return f"attn_mask dtype {dtype_name(mask.dtype)}: the scores kernel reads bool, float16, bfloat16, float32"
    if seqlen_q > 1 and mask.strides[2] != 0:
        return (f"attn_mask varies along the query rows (stride {mask.strides[2] // mask.itemsize} elements): the "
                "scores kernel adds key-only masks")
    return None


def reason(p, arch: int, variant: int) -> str | None:
    """None when this kernel, in ``variant`` (:func:`setting`), can produce P and lse for a checked problem ``p``
    (checks.SDPAProblem) on compute capability ``arch``, else why not (the split path then keeps its GEMM + softmax
    pass).

    Needs sm_90 (wgmma, TMA), fp16/bf16, 1 ≤ S ≤ 512, no dropout, attn_mask only key-only (mask_reason) and on the
    persistent kernel, is_causal not in the cluster variant (variant 2's clusters pair row blocks that would see
    different keys), scale > 0 (folded into exp2), q and k readable by TMA in place.
    """
    if arch != 90:
        return f"sm_{arch}: the scores kernel needs sm_90a"
    if dtype_name(p.dtype) not in C_TYPE_16:
        return f"dtype {dtype_name(p.dtype)}: the scores kernel serves fp16 and bf16"
    if not 1 <= p.seqlen_k <= MAX_SEQLEN_K:
        return f"seqlen_k={p.seqlen_k}: the scores kernel holds whole rows of at most {MAX_SEQLEN_K} keys"
    if p.dropout_p > 0:
        return "dropout is not in the scores kernel"
    if not variants.of(p).plain:
        return f"{', '.join(variants.of(p).names())}: not in the scores kernel (the softmax kernel applies them)"
    if p.mask is not None:
        why = mask_reason(p.mask, p.seqlen_q)
        if why is not None:
            return why
        if variant != 3:
            return f"attn_mask: only the persistent scores kernel ({ENV_SPLIT_FUSED}=3, the default) adds it"
        half_n = tile_for(p.seqlen_k, masked=True).half_n
        if half_n not in MASKED_DISPATCHED:
            return (f"attn_mask with seqlen_k={p.seqlen_k}: the masked scores kernel's {2 * half_n}-key tile has not "
                    "run on a GPU yet")
    if p.causal is not None and variant == 2:
        return f"is_causal: the scores kernel's cluster variant ({ENV_SPLIT_FUSED}=2) is not causal"
    why = exp2_tma_reason("the scores kernel", p.scale)
    if why is not None:
        return why
    if p.query is None:  # a plan made without arrays (tests): the layout is not known
        return None
    for name, a in (("q", p.query), ("k", p.key)):
        why = tma_operand_reason(name, a)
        if why is not None:
            return why
    if p.query.shape[1] > 65535 or p.query.shape[0] > 65535:
        return "grid limit: heads and batch must each be <= 65535"
    return None


class Choice(NamedTuple):
    """What a call runs: the variant (:data:`KERNELS`), the kernel (its variant's, or the masked persistent one) and
    the tile."""
    variant: int
    kernel: str
    tile: ScoresTile


def choose(p, variant: int) -> Choice:
    """The choice for a problem this kernel serves in ``variant`` (:func:`reason`): the masked kernel for a call with
    an attn_mask, the variant's otherwise; the tile covering seqlen_k (:func:`tile_for`). The plan's, made once."""
    masked = p.mask is not None
    return Choice(variant, MASKED_KERNEL if masked else KERNELS[variant], tile_for(p.seqlen_k, masked=masked))


def build(p, choice: Choice, lse, *, ld: int, p_read: tuple | None = None) -> PreparedLaunch:
    """The launch for the problem ``p``'s q (B, Hq, L, E) and k (B, Hkv, S, E), its causal alignment and attn_mask,
    and lse (None or (B, Hq, L) float32), accepted by :func:`reason`. P is written packed by heads: (b, h) at
    (b·Hq + h)·L·ld elements, rows ld (≥ S, a multiple of 8) elements apart; in the persistent kernel the chunk of 8
    keys holding key S − 1 is written whole (zeros past S, within the pitch), the columns past it are not written.
    The grid comes from :func:`grid_for` (variant 3: one CTA per SM of q's device). Causal (key j visible to row i iff
    j ≤ i + p.causal_offset): P is 0 past each row's limit. p_read: None, or (rows, keys) when the reader of P (the
    split path's causal P·V bands) reads only keys < keys of rows < rows: the persistent kernel then leaves those rows'
    zeros past ``keys`` unwritten (their P there is undefined). An attn_mask (variant 3: the masked kernel) is read
    by the pointer passed per launch. Raises ValueError for a short ld or one not a multiple of 8, causal with variant
    2, or a mask with another variant or with causal."""
    q, k, mask, causal, variant = p.query, p.key, p.mask, p.causal, choice.variant
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if ld < S or ld % 8:
        raise ValueError(f"ld={ld}: P rows need a pitch of at least seqlen_k={S} elements, a multiple of 8 (TMA "
                         "stores: 16-byte row strides)")
    if causal is not None and variant == 2:
        raise ValueError(f"causal={causal!r}: the cluster variant (variant=2) is not causal")
    if mask is not None and (variant != 3 or causal is not None):
        raise ValueError(f"mask: the masked scores kernel is persistent (variant=3, not {variant}) and not causal")
    num_sms = device_sms(q.device.id) if variant == 3 else 0
    grid = grid_for(B, Hq, L, variant, num_sms)
    tile = choice.tile
    kernel = SCORES_SOFTMAX_SM90.kernel(kernel=choice.kernel, dtype=C_TYPE_16[dtype_name(q.dtype)], tile=tile)
    prm = np.zeros((), dtype=_PARAMS)
    prm["seqlen_q"], prm["seqlen_k"], prm["head_dim"], prm["groups"] = L, S, E, Hq // Hkv
    prm["scale_log2"] = float(p.scale) * LOG2E
    prm["is_causal"] = causal is not None
    prm["causal_offset"] = p.causal_offset
    prm["num_heads"], prm["batch"], prm["ld"] = Hq, B, ld
    if causal is not None and variant == 3:
        prm["pair_p0"], prm["pair_n"], prm["pair_count"] = causal_pairs(L, S, p.causal_offset, tile.half_n)
    if p_read is not None and variant == 3:
        prm["read_rows"], prm["read_keys"] = p_read
    if mask is not None:
        prm["mask_kind"] = MASK_KIND[dtype_name(mask.dtype)]
        prm["mask_stride_b"], prm["mask_stride_h"], prm["mask_stride_k"] = (mask.strides[i] // mask.itemsize
                                                                            for i in (0, 1, 3))
    set_strides(prm, ("lse", lse, "bhl"))
    isz = q.dtype.itemsize
    p_map = MapSpec(dtype_name(q.dtype), (S, L, Hq, B), (ld * isz, L * ld * isz, Hq * L * ld * isz), BLOCK_M)
    maps = (MapSpec.of(q, BLOCK_M), MapSpec.of(k, tile.half_n), p_map)
    if prm["pair_count"] > 0:  # a pair tile loads keys 256 ... in 64-row pieces
        maps += (MapSpec.of(k, 64),)
    return build_launch(kernel, prm, maps, grid, tile, variant)


def build_launch(kernel, params: np.ndarray, maps: tuple, grid: tuple, tile: ScoresTile,
                 variant: int = 1) -> PreparedLaunch:
    """The launch of a ScoresSm90Params kernel with ``params`` prepared, replayed as ``launch_on(stream, q, k, p,
    lse=0, mask=0)``: tensor maps of q, k and P (``maps``: their MapSpecs, and a fourth of k in 64-row boxes for the
    causal pair tiles), encoded again only when q, k or P moved; the lse, P (the persistent kernel's 16-byte stores)
    and mask pointers. ``variant`` (:data:`KERNELS`; variant 2's CTAs per cluster are compiled into the kernel by
    __cluster_dims__: a plain launch of a grid whose x is a multiple of it), ``tile`` and ``maps`` are kept in ``info``.
    A replay writes the words and the changed maps (bench/notes/split.md: the host time this saves)."""
    fields, args = ("tma_q", "tma_k", "tma_p", "tma_k64")[:len(maps)], ("q", "k", "p", "k")[:len(maps)]
    return PreparedLaunch(params, [Step(kernel, grid, (THREADS,), tile.smem_bytes())],
                          args=("q", "k", "p", "lse", "mask"), pointers={"lse": "lse", "p": "p", "mask": "mask"},
                          maps=(Maps(fields, args, tuple(m.encode for m in maps)),),
                          info={"variant": variant, "tile": tile, "maps": maps})


def describe(launch: PreparedLaunch) -> str:
    """What a launch of :func:`prepare` runs, in words."""
    variant, tile = launch.info["variant"], launch.info["tile"]
    shared = {2: ", clusters of 2 CTAs sharing K by TMA multicast",
              3: ", persistent: one CTA per SM walks its row blocks"}.get(variant, "")
    pairs = int(launch.params["pair_count"])
    if pairs:
        shared += f"; causal: {pairs} pairs of row blocks per head share a tile"
    return (f"{KERNELS[variant]} (64 rows x {2 * tile.half_n} keys per CTA, {tile.stages} TMA "
            f"stages, wgmma m64n{tile.half_n} x 2 warpgroups, softmax in the epilogue{shared}; grid "
            f"{launch.grid})")
