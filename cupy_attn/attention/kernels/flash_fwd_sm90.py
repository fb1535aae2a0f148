"""The FlashAttention-3-design forward kernel for Hopper (cuda_src/attention/flash_fwd_sm90.cu).

TMA loads into an mbarrier K/V ring, a producer warpgroup and two ping-ponging consumer warpgroups. It serves fp16 and
bf16, head dims 33-256 (run at 64, 96, 128 or 256), no attn_mask, causal or not, GQA, on compute capability 9.0.
Variants, by mode (``CUPY_ATTN_FA3``, read once by the plan: dispatch.fa3_mode; unset, for calls of at least
dispatch.FA3_MIN_FLOPS on Hopper: "3"):

* ``1``: one 128-row tile per CTA, ping-pong consumers (TILES);
* ``2``: the same with FA3's intra-warpgroup overlap (OVERLAP_TILES);
* ``3``: ``2`` as a persistent kernel (PERSISTENT_TILES): min(#SMs, #work units) CTAs, each looping over its tiles in
  the static order of cuda_src/attention/sm90/tile_scheduler.cuh, the producer loading the next tile's Q and K/V
  during the current tile's epilogue (:func:`grid_for`). Faster than ``2`` at most measured shapes
  (bench/notes/flash.md).

Non-causal calls at head dim 64 in modes ``2`` and ``3`` run FlashAttention-3's own hdim-64 tile, 192 rows with
three consumer warpgroups (M192_MODE_TILES, :func:`tile_for`); ``CUPY_ATTN_FA3_M192=1`` forces it for causal calls
too, ``0`` turns it off.

Everything else keeps flash_fwd.cu (the plan asks :func:`reason` first). :func:`choose` makes the choice of a mode
(bucket, tile, S GEMM columns), :func:`build` its launch.

Tensor maps (runtime.tma: cuTensorMapEncodeTiled, through ``cuda.bindings.driver``, imported lazily) embed the
arrays' base addresses, so a launch re-encodes them when the pointers change (the last three are remembered: replaying
a call on the same arrays encodes nothing). Each map is 4-D, (E, seqlen, heads, batch) with the arrays' own strides,
so BHSD and BSHD views are read in place; TMA requires a 16-byte aligned base and strides that are multiples of 16
bytes. The box is one swizzle atom wide (:func:`swizzle_bytes`): 64 columns in the 128-byte swizzle, 32 in the
64-byte one (D = 96).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from typing import NamedTuple

from ...runtime import env
from ...runtime.compile import KernelFamily
from ...runtime.interop import device_sms, dtype_name
from ...runtime.kernel_abi import C_TYPE_16, LOG2E, element_strides, head_dim_bucket, set_strides
from ...runtime.launch import AlignFlag, Maps, PreparedLaunch, Step
from ...runtime.tma import F64, I64, MAP, MapSpec, c_struct, exp2_tma_reason, o_tma_reason, \
    tma_operand_reason
from .. import mods, variants

# CUPY_ATTN_FA3_M192: unset, head dim 64 in modes "2" and "3" runs the 192-row tile (three consumer warpgroups,
# M192_MODE_TILES) for non-causal calls; 1 forces it for causal calls too; 0 keeps the 128-row tile. Part of the call
# cache's key.
ENV_M192 = "CUPY_ATTN_FA3_M192"


@dataclasses.dataclass(frozen=True)
class Tile:
    """Query rows per block (block_m / 64 consumer warpgroups of 64 rows: two or three), key rows per K/V stage, stages
    in the ring."""
    block_m: int
    block_n: int
    stages: int = 2
    overlap: bool = False  # FA3's intra-warpgroup overlap (softmax of S_i during P_{i-1} V_{i-1}; mainloop.cuh)
    persistent: bool = False  # one CTA per SM looping over tiles (tile_scheduler.cuh); only with overlap

    @property
    def threads(self) -> int:
        """Threads per block: the producer warpgroup and block_m / 64 consumer warpgroups (384 or 512)."""
        return 128 * (self.block_m // 64 + 1)

    @property
    def overlap_flag(self) -> str:
        return "true" if self.overlap else "false"

    @property
    def persistent_flag(self) -> str:
        return "true" if self.persistent else "false"

    def smem_bytes(self, head_dim: int) -> int:
        """Q + stages × (K + V) tiles, the epilogue's O staging (per consumer warpgroup 64 rows × min(head_dim, 128)
        columns), 8 bytes per mbarrier (2 + 4·stages: q_full, q_empty and four per stage), with three consumer
        warpgroups 8 bytes per consumer thread (the row-sum anchor of the overlap mainloop), 1 KB of slack for the
        1024-byte alignment of the swizzle atoms: SharedStorage::kBytes in cuda_src/attention/sm90/mainloop.cuh."""
        sink = (self.threads - 128) * 8 if self.block_m == 192 else 0
        o_stage = (self.block_m // 64) * 64 * min(head_dim, 128) * 2
        return ((self.block_m + 2 * self.stages * self.block_n) * head_dim * 2 + o_stage + 8 * (2 + 4 * self.stages)
                + sink + 1024)


# (head dim) -> tile; both dtypes alike. Registers per consumer thread: S block_n/2 + O head_dim/2 fp32 + P block_n/4,
# under setmaxnreg's 240. Shared memory: Tile.smem_bytes of the 227 KB (232448 B) per block.
TILES = {
    # 128×128: 64 S + 32 O + 32 P registers; 81 KB.
    64: Tile(128, 128, 2),
    # 128×128: 64 S + 48 O + 32 P; 169 KB with 3 stages (121 KB with 2). 64-byte swizzle, P·V at N = 96
    # (FlashAttention-3's hdim-96 layout). A K/V stage is 3/4 of D = 128's GEMM work, so two stages give the loads
    # a quarter less time ahead of use; the third costs no occupancy (one CTA per SM either way: 384 threads at 168
    # registers fill the register file) and a `% 3` per ring index. Ev = 80 runs N = 96 too: a 64-byte-swizzled
    # MN-major B operand spans whole 32-column atoms (CUTLASS's canonical ((8,4,m),(8,k)) layout), N = 80 would be
    # 2.5; it would take V in the 32-byte swizzle and an 80 bucket of its own for 1/6 of the P·V work (unmeasured).
    96: Tile(128, 128, 3),
    # 128×128: 64 S + 64 O + 32 P; 161 KB.
    128: Tile(128, 128, 2),
    # 128×64: 32 S + 128 O + 16 P; 193 KB (kBlockN = 128 would need 321 KB for two stages).
    256: Tile(128, 64, 2),
}
# The same tiles with the intra-warpgroup overlap (CUPY_ATTN_FA3=2): the same registers (S stays fp32 while the
# previous P·V runs, P is packed after it) and shared memory.
OVERLAP_TILES = {d: dataclasses.replace(tile, overlap=True) for d, tile in TILES.items()}
# The overlap tiles as a persistent kernel (CUPY_ATTN_FA3=3): the same shared memory (q_empty is in every variant's
# barrier block), a few consumer registers for the tile loop.
PERSISTENT_TILES = {d: dataclasses.replace(tile, persistent=True) for d, tile in OVERLAP_TILES.items()}
# Packed variable-length batches (varlen_attention): the persistent tiles, whose CTAs walk the sequences' tiles
# (VarlenTileScheduler in cuda_src/attention/sm90/tile_scheduler.cuh).
VARLEN_TILES = PERSISTENT_TILES
# mode (CUPY_ATTN_FA3, dispatch.fa3_mode) -> its tile table.
MODE_TILES = {"1": TILES, "2": OVERLAP_TILES, "3": PERSISTENT_TILES}
# FlashAttention-3's head-dim-64 tile for causal calls (hopper/tile_size.h: 192 × 128, three consumer warpgroups + the
# producer, 512 threads; FA3 runs 192 × 192 with P through shared memory when not causal), the default for
# non-causal calls in modes "2" and "3" (:func:`tile_for`). Registers: setmaxnreg 32 for the producer, 160 for
# the consumers (128·32 + 384·160 = 65536; S 64 + O 32 + P 32 registers as in the 128-row tile, 80 fewer of headroom;
# no spills). Shared memory 116 KB: Q 24 KB + 2 stages × (K + V) 64 KB + 24 KB of O staging (epilogue.cuh) +
# barriers + the 3 KB row-sum anchor (mainloop.cuh) + 1 KB. At D = 64 the per-block softmax is large against the two
# GEMMs; a third warpgroup keeps the tensor cores fed while two others run theirs (faster than the 128-row tile on
# non-causal calls, not on causal ones: bench/notes/flash.md).
M192_MODE_TILES = {"2": {64: Tile(192, 128, 2, overlap=True)},
                   "3": {64: Tile(192, 128, 2, overlap=True, persistent=True)}}


def tile_for(mode: str, head_dim: int, causal: bool = False) -> Tile:
    """The tile a call of this mode ("1", "2", "3"), head-dim bucket and causality runs: the 192-row tile of
    M192_MODE_TILES (head dim 64, modes "2" and "3") for non-causal calls, else MODE_TILES[mode][head_dim].
    CUPY_ATTN_FA3_M192=1 forces the 192-row tile where there is one (causal calls too), 0 turns it off.

    Why: at head dim 64 the 192-row tile measured 1.05-1.15× the 128-row one in its mode on non-causal calls, e.g.
    (4,32,4096,64) fp16 1.09×, and 0.82-1.06× on causal ones, where a 192-row tile masks more of its diagonal blocks
    (bench/experiments/flash_fwd/m192_ab.py; bench/notes/flash.md). So a causal (2,16,8192,64) call runs 128 rows, a
    non-causal (8,16,2048,64) one 192.

    >>> tile_for("2", 64).block_m, tile_for("3", 64, causal=True).block_m, tile_for("3", 128).block_m
    (192, 128, 128)
    """
    m192 = env.get(ENV_M192)
    if m192 == "1" or (m192 != "0" and not causal):
        tile = M192_MODE_TILES.get(mode, {}).get(head_dim)
        if tile is not None:
            return tile
    return MODE_TILES[mode][head_dim]


def _all_tables() -> tuple:
    return (*MODE_TILES.values(), *M192_MODE_TILES.values())


# FlashFwdSm90Params (cuda_src/attention/sm90/params.cuh), declared once here: its size and field sizes are asserted
# at compile time (KernelFamily.structs), its field order by tests/test_structs.py.
PARAMS = c_struct([("tma_q", MAP, 64), ("tma_k", MAP, 64), ("tma_v", MAP, 64), ("tma_o", MAP, 64)]
                   + [(n, F64 if n in ("scale_log2", "softcap_in", "alibi_scale") else I64, 8) for n in (
                       "out", "lse", "seqlen_q", "seqlen_k", "head_dim_v", "groups", "is_causal", "causal_offset",
                       "scale_log2", "out_stride_b", "out_stride_h", "out_stride_l",
                       "lse_stride_b", "lse_stride_h", "lse_stride_l", "batch", "num_heads", "tile_pairs",
                       "o_tma", "window_lo", "sinks", "sinks_kind", "softcap_in", "alibi_slopes", "alibi_stride_b",
                       "alibi_scale", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "max_blocks",
                       "page_size")])
# Columns of Q and K the S GEMM reads (qk_dim) besides the bucket itself: E = 65-80 in the 96 bucket skips the zero-
# filled k step (5 of 6); E = 65-80 and 81-96 with Ev = 97-128 in the 128 bucket skip 3 or 2 of 8 (P·V keeps
# N = 128). Other E run every k step of their bucket.
QK_DIMS = {96: (80,), 128: (80, 96)}
FLASH_FWD_SM90_TMA = KernelFamily(
    name="flash_fwd_sm90_tma",
    source="attention/flash_fwd_sm90.cu",
    template=("cupy_attn::flash_fwd_sm90<{dtype}, {head_dim}, {tile.block_m}, {tile.block_n}, {tile.stages}, "
              "{tile.overlap_flag}, {tile.persistent_flag}, {qk_dim}, {variants}, {varlen}>"),
    axes={
        "dtype": tuple(C_TYPE_16.values()),
        "head_dim": tuple(TILES),
        "tile": tuple(sorted({t for table in _all_tables() for t in table.values()}, key=dataclasses.astuple)),
        "qk_dim": tuple(sorted(set(TILES) | {d for dims in QK_DIMS.values() for d in dims})),
        "variants": ("false", "true"),
        "varlen": ("false", "true"),
    },
    # The variants (window, softcap, ALiBi, sinks) only in the persistent tiles (mode "3", which every variant call
    # takes) at the bucket's own S GEMM width: 10 instantiations instead of 46 more. Packed batches (varlen): the
    # VARLEN_TILES at the bucket's width, plain and with the variants' code: 16 more.
    where=lambda row: (any(row["tile"] == table.get(row["head_dim"]) for table in _all_tables())
                       and (row["qk_dim"] == row["head_dim"] or row["qk_dim"] in QK_DIMS.get(row["head_dim"], ()))
                       and (row["variants"] == "false" or (row["tile"].persistent and row["qk_dim"] == row["head_dim"]))
                       and (row["varlen"] == "false" or (row["tile"] == VARLEN_TILES[row["head_dim"]]
                                                         and row["qk_dim"] == row["head_dim"]))),
    archs=("sm_90a",),
    structs=(("cupy_attn::FlashFwdSm90Params", PARAMS),),
    arch="sm_90a",
)


def head_bucket(head_dim: int, head_dim_v: int) -> int | None:
    """The instantiated head dim (64, 96, 128 or 256) a call runs at: the smallest ≥ max(E, Ev), for 33 ≤ E, Ev ≤ 256;
    None otherwise. Q, K and V are padded by TMA itself: the tensor maps keep the real E (Ev), and a box past it is
    zero-filled, so E = 80 runs the D = 96 kernel on zeros beyond column 80 (no copy); the epilogue stores Ev columns.
    The S GEMM skips the zero k steps (:func:`qk_dim`); P·V pays the padding (Ev 80 → 96: 1.2×, against 1.6× in the
    128 bucket that served E = 80 before the 96 one). Head dims ≤ 32 stay on flash_fwd.cu (2× padding).

    >>> head_bucket(80, 80), head_bucket(96, 64), head_bucket(72, 128), head_bucket(160, 160), head_bucket(32, 32)
    (96, 96, 128, 256, None)
    """
    return head_dim_bucket(head_dim, head_dim_v, TILES, floor=32)


def qk_dim(head_dim: int, bucket: int) -> int:
    """The S GEMM's columns for query/key head dim E in this bucket: the smallest of QK_DIMS[bucket] ≥ E, else
    the bucket.

    >>> qk_dim(80, 96), qk_dim(72, 96), qk_dim(96, 96), qk_dim(72, 128), qk_dim(100, 128), qk_dim(160, 256)
    (80, 80, 96, 80, 128, 256)
    """
    return next((d for d in QK_DIMS.get(bucket, ()) if d >= head_dim), bucket)


def swizzle_bytes(head_dim: int) -> int:
    """The shared-memory swizzle of a bucket's tiles, in bytes: 128 when a row (head_dim · 2 bytes) is a multiple of
    128 bytes, else 64 (CuTe's smem selector, as FlashAttention-3 picks it); TMA boxes are one atom wide
    (swizzle_bytes / 2 columns). The kernel's rule: SharedStorage::kSwizzleBytes in
    cuda_src/attention/sm90/mainloop.cuh.

    >>> [swizzle_bytes(d) for d in (64, 96, 128, 256)]
    [128, 64, 128, 128]
    """
    return 128 if head_dim * 2 % 128 == 0 else 64


def reason(p, arch: int, out=None) -> str | None:
    """None when this kernel runs the problem ``p`` (checks.SDPAProblem: its kind, and the layout of its arrays where
    it has them) on compute capability ``arch`` with output ``out`` (None: the call's own, contiguous); else why not.

    >>> import types
    >>> reason(types.SimpleNamespace(dtype=np.dtype("float16"), head_dim=32, head_dim_v=32, mask_kind="none",
    ...                              scale=0.1, query=None), 90)
    'head dims E=32, Ev=32: the FA3 kernel serves head dims 33-256 (padded to (64, 96, 128, 256))'
    """
    if arch != 90:
        return f"sm_{arch}: the FA3 kernel needs sm_90a (H100/H200)"
    if dtype_name(p.dtype) not in C_TYPE_16:
        return f"dtype {dtype_name(p.dtype)}: the FA3 kernel serves fp16 and bf16"
    if head_bucket(p.head_dim, p.head_dim_v) is None:
        return (f"head dims E={p.head_dim}, Ev={p.head_dim_v}: the FA3 kernel serves head dims 33-256 (padded to "
                f"{tuple(TILES)})")
    if p.mask_kind != "none":
        return "attn_mask: the FA3 kernel has no mask input (causal only)"
    why = exp2_tma_reason("the FA3 kernel", p.scale)
    if why is not None:
        return why
    if p.query is None:  # a plan made without arrays (tests): the layout is not known
        return None
    return layout_reason(p.query, p.key, p.value, out)


def layout_reason(q, k, v, out) -> str | None:
    """None when TMA can read q, k, v in place and the epilogue can store out: 16-byte aligned bases, batch / head /
    row strides multiples of 16 bytes (any order: BHSD and BSHD), element pairs of out 4-byte aligned (out=None:
    not checked)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        why = tma_operand_reason(name, a)
        if why is not None:
            return why
    if out is not None and (out.data.ptr % 4 or any(s % 2 for s in element_strides(out)[:-1])):
        return "out element pairs are not 4-byte aligned"
    if q.shape[1] > 65535 or q.shape[0] > 65535:
        return "grid limit: heads and batch must each be <= 65535"
    return None


def grid_for(tile: Tile, B: int, Hq: int, L: int, causal: bool, num_sms: int) -> tuple[tuple, bool]:
    """(grid, tile_pairs) of a launch. One tile per CTA: (⌈L / block_m⌉, Hq, B). Persistent: min(num_sms, units) CTAs
    that stride over the work units of sm90/tile_scheduler.cuh; causal calls with more tiles than SMs pair the m-blocks
    (M−1−k, k) of a head into units of equal cost (tile_pairs), others have one m-block per unit.

    Examples on 132 SMs: (2, 16, 8192) causal: 64 m-blocks per head, 2048 tiles → 1024 pairs, 132 CTAs of 7-8 pairs
    (the last round 100 of 132 busy: makespan 8 pairs against 7.76 ideal, 1.03); (1, 8, 1024) causal: 64 tiles, one
    per CTA, no pairs; (8, 16, 2048) not causal: 2048 tiles, 132 CTAs of 15-16.

    >>> t = PERSISTENT_TILES[128]
    >>> grid_for(t, 2, 16, 8192, True, 132), grid_for(t, 1, 8, 1024, True, 132), grid_for(t, 8, 16, 2048, False, 132)
    (((132, 1, 1), True), ((64, 1, 1), False), ((132, 1, 1), False))
    >>> grid_for(OVERLAP_TILES[128], 2, 16, 8192, True, 132)
    ((64, 16, 2), False)
    >>> grid_for(M192_MODE_TILES["3"][64], 4, 32, 4096, True, 132), grid_for(M192_MODE_TILES["2"][64], 1, 1, 1000, False, 132)
    (((132, 1, 1), True), ((6, 1, 1), False))
    """
    m_blocks = -(-L // tile.block_m)
    if not tile.persistent:
        return (m_blocks, Hq, B), False
    pairs = causal and m_blocks * Hq * B > num_sms
    units = Hq * B * (-(-m_blocks // 2) if pairs else m_blocks)
    return (min(num_sms, units), 1, 1), pairs


class Choice(NamedTuple):
    """What a call runs: the mode ("1" ping-pong, "2" intra-warpgroup overlap, "3" overlap and persistent), the
    instantiated head dim, the tile, the S GEMM's columns, and whether it is the variants' instantiation."""
    mode: str
    head_dim: int
    tile: Tile
    qk_dim: int
    variants: bool = False

    @property
    def variant(self) -> str:
        return "overlap, persistent" if self.tile.persistent else "overlap" if self.tile.overlap else "ping-pong"


def choose(p, mode: str) -> Choice:
    """The choice for a problem this kernel serves (:func:`reason`) in ``mode``: its bucket (:func:`head_bucket`),
    tile (:func:`tile_for`) and S GEMM columns (:func:`qk_dim`). The plan's, made once (dispatch). A call with
    variants (attention/variants.py) takes their instantiation, which exists in mode "3" at the bucket's full S GEMM
    width only; windowed calls take the 128-row tiles, as causal ones (a 192-row tile masks more at a window's edges),
    and calls with a user's mods always do, whatever CUPY_ATTN_FA3_M192 says (their instantiations: :func:`mod_family`;
    three consumer warpgroups at 160 registers would leave a mod less room; KeyRanges count 128-row blocks)."""
    bucket = head_bucket(p.head_dim, p.head_dim_v)
    var = variants.of(p)
    if var.mod is not None:  # the mod family declares these tiles only (and KeyRanges count 128-row blocks)
        return Choice("3", bucket, PERSISTENT_TILES[bucket], bucket, True)
    if not var.plain:
        return Choice("3", bucket, tile_for("3", bucket, p.causal is not None or var.has_window), bucket, True)
    return Choice(mode, bucket, tile_for(mode, bucket, p.causal is not None), qk_dim(p.head_dim, bucket))


def set_variant_params(prm: np.ndarray, p) -> None:
    """The variant fields of FlashFwdSm90Params for a call (this kernel's, flash_fwd_d512_sm90's and, but for the
    sinks, the Hopper backward's FlashBwdSm90Params), and its bounds:
    the upper one (causal and/or a window's right side) as is_causal / causal_offset, the lower one as window_lo
    (common/visibility.cuh); softcap c as softcap_in = scale / c with scale_log2 = c·log2(e) and ALiBi in raw-score
    units (common/score_mod.cuh); the sinks' and slopes' addresses (the launch holds them: such calls are not kept
    by the call cache)."""
    bounded, upper = p.key_upper
    prm["is_causal"] = bounded
    prm["causal_offset"] = upper if bounded else 0
    prm["window_lo"] = p.window_lo
    prm["scale_log2"] = float(p.scale) * LOG2E
    var = variants.of(p)
    natural = float(p.scale)  # raw scores times this are the scaled scores (before a softcap)
    if var.softcap is not None:
        prm["softcap_in"] = float(p.scale) / var.softcap
        prm["scale_log2"] = var.softcap * LOG2E
        natural = var.softcap
    prm["alibi_scale"] = 1.0 / natural
    if var.sinks is not None and "sinks" in prm.dtype.names:  # (the backward's struct has none: nothing to do there)
        prm["sinks"], prm["sinks_kind"] = var.sinks.data.ptr, 0 if var.sinks.dtype == np.float32 else 1
    if var.alibi_slopes is not None:
        a = var.alibi_slopes
        prm["alibi_slopes"] = a.data.ptr
        prm["alibi_stride_b"] = a.strides[0] // a.itemsize if a.ndim == 2 else 0


def mod_family(bound):
    """The FA3-design forward with a user's mods appended (attention/mods.py): flash_fwd_sm90_mod on the persistent
    tiles at the bucket's own S GEMM width (where the variants are), dense and packed; ModParams<FlashFwdSm90Params,
    Mod> (64-byte aligned: the tensor maps)."""
    return mods.mod_family(
        FLASH_FWD_SM90_TMA,
        "cupy_attn::flash_fwd_sm90_mod<{dtype}, {head_dim}, {tile.block_m}, {tile.block_n}, {tile.stages}, "
        "{tile.overlap_flag}, {tile.persistent_flag}, {head_dim}, {varlen}, {mod}>",
        "cupy_attn::ModParams<cupy_attn::FlashFwdSm90Params, {mod}>",
        mods.mod_params_dtype(PARAMS, bound.spec, align=64), bound.mod, bound.spec,
        {"dtype": tuple(C_TYPE_16.values()), "head_dim": tuple(TILES),
         "tile": tuple(sorted(set(PERSISTENT_TILES.values()), key=dataclasses.astuple)), "varlen": ("false", "true")},
        "flash_fwd_sm90_mod", where=lambda row: row["tile"] == PERSISTENT_TILES[row["head_dim"]])


def build(p, choice: Choice, out, lse) -> PreparedLaunch:
    """The launch of ``choice`` for a checked problem accepted by :func:`reason`, replayed as ``launch_on(stream, q,
    k, v, out, lse=0, mask=0)`` (:func:`build_launch`): out (B, Hq, L, Ev) in q's dtype, lse None or (B, Hq, L)
    float32."""
    q, k, v = p.query, p.key, p.value
    B, Hq, L, E = q.shape
    _, Hkv, S, Ev = v.shape
    D, tile = choice.head_dim, choice.tile
    bound = variants.of(p).mod
    if bound is not None and bound.mask_source is not None:  # an attn_mask as a mod: its array and key ranges now
        bound = mods.materialize(bound, p)
    if bound is not None:  # a user's mods: their instantiation (choose gave the persistent tile at full width)
        fam = mod_family(bound)
        kernel = fam.kernel(dtype=C_TYPE_16[dtype_name(q.dtype)], head_dim=D, tile=tile, varlen="false")
        prm = np.zeros((), dtype=fam.structs[0][1])
        mods.fill_aux(prm, bound, Hq, key_ranges=True)
    else:
        kernel = FLASH_FWD_SM90_TMA.kernel(dtype=C_TYPE_16[dtype_name(q.dtype)], head_dim=D, tile=tile,
                                           qk_dim=choice.qk_dim, variants="true" if choice.variants else "false",
                                           varlen="false")
        prm = np.zeros((), dtype=PARAMS)
    prm["seqlen_q"], prm["seqlen_k"], prm["head_dim_v"], prm["groups"] = L, S, Ev, Hq // Hkv
    set_variant_params(prm, p)
    num_sms = 0
    if tile.persistent:
        import cupy
        num_sms = device_sms(cupy.cuda.Device().id)
    grid, pairs = grid_for(tile, B, Hq, L, bool(prm["is_causal"]), num_sms)
    prm["batch"], prm["num_heads"], prm["tile_pairs"] = B, Hq, pairs
    set_strides(prm, ("out", out, "bhl"), ("lse", lse, "bhl"))
    cols = swizzle_bytes(D) // 2
    maps = tuple(MapSpec.of(a, rows, cols) for a, rows in ((q, tile.block_m), (k, tile.block_n), (v, tile.block_n)))
    # The epilogue stores out by TMA (through shared memory) where TMA can write it exactly: Ev a multiple of 8 (the
    # 16-byte chunk at the Ev edge stays inside the row) and 16-byte row, head and batch strides; the base's
    # alignment is checked per replay (build_launch). Else 4-byte stores from registers.
    o_map = None
    if o_tma_reason(out) is None:
        o_map = MapSpec.of(out, 64, cols)
    launch = build_launch(kernel, prm, maps, grid, (tile.threads,), tile.smem_bytes(D), o_map)
    launch.info["mod"] = bound  # the aux arrays and key ranges it reads, alive as long as the launch
    return launch


def build_launch(kernel, params: np.ndarray, maps: tuple, grid: tuple, block: tuple, smem: int,
                 o_map: MapSpec | None = None) -> PreparedLaunch:
    """The launch of a FlashFwdSm90Params kernel (this module's and flash_fwd_d512_sm90's) with ``params`` prepared,
    replayed as ``launch_on(stream, q, k, v, out, lse=0, mask=0)`` like flash_fwd's (mask must be 0: these kernels take
    no attn_mask). q, k and v reach the kernel as tensor maps of the layouts ``maps`` (MapSpec each), encoded again only
    when q, k or v moved; out and lse as pointers. ``o_map``: out's map where the epilogue may store it by TMA
    (:func:`build`), used by the replays whose out is 16-byte aligned (o_tma = 1, the map encoded again only when out
    moved); the others, and every replay without it, store out by 4-byte stores from registers (o_tma = 0)."""
    out_maps, flags = (), ()
    if o_map is not None:
        out_maps = (Maps(("tma_o",), ("out",), (o_map.encode,), align=16),)
        flags = (AlignFlag("o_tma", "out", 16, 1),)
    return PreparedLaunch(params, [Step(kernel, grid, block, smem)], args=("q", "k", "v", "out", "lse", "mask"),
                          pointers={"out": "out", "lse": "lse"},
                          maps=(Maps(("tma_q", "tma_k", "tma_v"), ("q", "k", "v"), tuple(m.encode for m in maps)),
                                *out_maps),
                          flags=flags, refuse={"mask": "the FA3 kernel takes no attn_mask"})


def paged_reason(page_size: int, head_dim: int, head_dim_v: int) -> str | None:
    """None when the packed kernel reads pages of ``page_size`` keys (load_kv_paged in sm90/mainloop.cuh): a multiple
    of 8 rows (a swizzle period: boxes land where one whole-tile box would put them) that divides the tile's key block
    or is a multiple of it (no box crosses a page)."""
    block_n = VARLEN_TILES[head_bucket(head_dim, head_dim_v)].block_n
    if page_size % 8 or (page_size % block_n and block_n % page_size):
        return (f"page size {page_size}: the packed kernel reads pages of a multiple of 8 keys that divides, or is a "
                f"multiple of, its {block_n}-key block")
    return None


def build_varlen(q4, k4, v4, out4, lse3, *, bounds, batch: int, causal: bool, page_size: int = 0,
                 max_blocks: int = 0, mod=None) -> PreparedLaunch:
    """The launch of the packed-batch instantiation (varlen = true: VARLEN_TILES; the variants' code when
    ``bounds.variants`` has any) on the 4-D views of FlashAttention's varlen layout, batch 1 of every sequence's rows:
    q4 (1, Hq, total_q, E), k4 (1, Hkv, total_k, E), v4 (1, Hkv, total_k, Ev), out4 (1, Hq, total_q, Ev) and lse3 (1,
    Hq, total_q). ``bounds``: what :func:`set_variant_params` reads (key_upper, window_lo, scale, variants), with the
    bounds relative to each sequence's diagonal S_b − L_b (the kernel adds it: SeqSpan in
    cuda_src/attention/sm90/params.cuh). Persistent CTAs, one per SM: the tile count is not known on the host
    (VarlenTileScheduler walks the sequences on the device; causal calls in m-block pairs); CTAs without a tile exit.
    Replayed as ``launch_on(stream, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k=0, block_table=0)``. Paged
    caches (``page_size`` > 0, :func:`paged_reason`): k4 / v4 are the caches' rows (1, Hkv, num_blocks·page_size, E|Ev),
    the (B, max_blocks) block table is passed at the replay, and the maps' boxes are min(page_size, block_n) rows
    (load_kv_paged in sm90/mainloop.cuh). out is stored by TMA where its layout allows (o_tma, as :func:`build`; not at
    head dim 256), but for a warpgroup whose 64 rows cross its sequence's end (a TMA box would write the next sequence's
    rows): that one stores from registers."""
    _, Hq, _, E = q4.shape
    _, Hkv, _, Ev = v4.shape
    D = head_bucket(E, Ev)
    tile = VARLEN_TILES[D]
    if mod is not None:  # a user's mods (b: the sequence): the mod family's packed instantiation
        fam = mod_family(mod)
        kernel = fam.kernel(dtype=C_TYPE_16[dtype_name(q4.dtype)], head_dim=D, tile=tile, varlen="true")
        prm = np.zeros((), dtype=fam.structs[0][1])
        mods.fill_aux(prm, mod, Hq)
    else:
        kernel = FLASH_FWD_SM90_TMA.kernel(dtype=C_TYPE_16[dtype_name(q4.dtype)], head_dim=D, tile=tile, qk_dim=D,
                                           variants="false" if bounds.variants.plain else "true", varlen="true")
        prm = np.zeros((), dtype=PARAMS)
    # seqlen_q / seqlen_k: the rows the kernel clamps each sequence to (SeqSpan): the arrays', or with pages the keys
    # a block-table row addresses
    keys = max_blocks * page_size if page_size else k4.shape[2]
    prm["seqlen_q"], prm["seqlen_k"], prm["head_dim_v"], prm["groups"] = q4.shape[2], keys, Ev, Hq // Hkv
    prm["max_blocks"], prm["page_size"] = max_blocks, page_size
    set_variant_params(prm, bounds)
    # m-block pairs balance causal tiles only (a window alone makes tiles of one cost)
    prm["batch"], prm["num_heads"], prm["tile_pairs"] = batch, Hq, causal
    set_strides(prm, ("out", out4, "bhl"), ("lse", lse3, "bhl"))
    cols = swizzle_bytes(D) // 2
    kv_rows = min(page_size, tile.block_n) if page_size else tile.block_n
    maps = tuple(MapSpec.of(a, rows, cols) for a, rows in ((q4, tile.block_m), (k4, kv_rows), (v4, kv_rows)))
    import cupy
    grid = (device_sms(cupy.cuda.Device().id), 1, 1)
    out_maps, flags = (), ()
    if D < 256 and o_tma_reason(out4) is None:  # (head dim 256: register stores only, mainloop.cuh's kTmaStore)
        out_maps = (Maps(("tma_o",), ("out",), (MapSpec.of(out4, 64, cols).encode,), align=16),)
        flags = (AlignFlag("o_tma", "out", 16, 1),)
    return PreparedLaunch(prm, [Step(kernel, grid, (tile.threads,), tile.smem_bytes(D))],
                          args=("q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "seqused_k",
                                "block_table"),
                          pointers={"out": "out", "lse": "lse", "cu_seqlens_q": "cu_seqlens_q",
                                    "cu_seqlens_k": "cu_seqlens_k", "seqused_k": "seqused_k",
                                    "block_table": "block_table"},
                          maps=(Maps(("tma_q", "tma_k", "tma_v"), ("q", "k", "v"), tuple(m.encode for m in maps)),
                                *out_maps),
                          flags=flags, info={"tile": tile, "head_dim": D})
