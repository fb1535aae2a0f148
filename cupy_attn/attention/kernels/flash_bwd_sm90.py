"""The FlashAttention-3-design fused backward for Hopper (cuda_src/attention/flash_bwd_sm90.cu).

TMA loads into mbarrier rings, a producer warpgroup and two consumer warpgroups running the five backward GEMMs on
wgmma (Shah et al. 2024, FlashAttention-3, §3; FlashAttention-2's Algorithm 2 for the math). It serves fp16 and bf16,
head dims up to 256 (E and Ev each padded to the bucket 64, 128 or 256 by TMA's zero fill, as the forward's FA3 kernel
does), no attn_mask, causal either alignment or none, GQA, any L and S ≥ 1, on compute capability 9.0, for query, key
and value layouts TMA can read in place (16-byte aligned bases, batch / head / row strides multiples of 16 bytes:
BHSD and BSHD both qualify). The plan (dispatch.plan_backward) decides when it runs (``CUPY_ATTN_BWD``); everything
else keeps the mma.sync kernel (flash_bwd.cu) or the split backward. :func:`reason` says whether it serves a call,
:func:`build` prepares a call's :class:`Sm90Backward`.

A launch: one pre-pass (attn_bwd_delta_padded: D = rowsum(dO ∘ O) and lse·log2 e in rows padded to a multiple of
STAT_PAD, so each query block's statistics are one aligned TMA box; it also zeroes the fp32 dQ accumulator), the kernel
(one block per 128 keys of a key/value head, 64 at head dim 256), and the rounding of dQ to the input dtype
(bwd_rows' group sum with one member). The kernel adds each step's dQ tile into the accumulator by TMA reduces
(a writer warp, from a shared staging buffer; at 256 in two halves, with dO single-staged to make room). Six tensor
maps (Q, K, V, dO, the lse/D rows and the dQ accumulator) are encoded through cuda.bindings (~4 µs each on the host)
when their base address differs from the last call's.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from ...runtime.compile import KernelFamily
from ...runtime.launch import Maps, PreparedLaunch, Step
from ...runtime.interop import dtype_name
from ...runtime.kernel_abi import C_TYPE_16, LOG2E, Layout, head_dim_bucket
from ...runtime.tma import F64, I64, MAP, MapSpec, bindings_reason, c_struct, encode_tensor_map, \
    tma_operand_reason
from .. import mods, variants
from . import bwd_rows, flash_fwd_sm90
THREADS = 384  # a producer warpgroup and two consumer warpgroups
# lse·log2(e) and D are stored in rows padded to a multiple of this (every tile's block_m divides it).
STAT_PAD = 128


@dataclasses.dataclass(frozen=True)
class BwdSm90Tile:
    """Query rows per step, keys per block, stages of the Q and dO rings. block_n = 128: two consumer warpgroups of
    64 keys each; block_n = 64: both warpgroups on the same 64 keys, splitting Sᵀ by queries and dK, dV by columns
    (``by_columns``; BwdSplit in cuda_src/attention/sm90/bwd_mainloop.cuh)."""
    block_m: int
    block_n: int = 128
    stages: int = 2

    @property
    def by_columns(self) -> bool:
        return self.block_n == 64

    @property
    def do_stages(self) -> int:
        """Depth of the dO ring (BwdDq::kDoStages): by_columns tiles single-stage dO to make room for the dQ staging
        (as FlashAttention-3's hdim-256 backward); the Q ring keeps ``stages``."""
        return 1 if self.by_columns else self.stages

    def dq_cols(self, head_dim: int) -> int:
        """Columns of a consumer warpgroup's 64-row dQ tile (BwdDq::kN)."""
        return head_dim * (self.block_m // 64) // 2

    def dq_stage_cols(self, head_dim: int) -> int:
        """Columns of that tile staged at a time (BwdDq::kStageCols): half of them when by_columns (two rounds)."""
        return self.dq_cols(head_dim) // (2 if self.by_columns else 1)

    def smem_bytes(self, head_dim: int) -> int:
        """K, V, stages × Q and do_stages × dO tiles, two dSᵀ buffers (and two Pᵀ buffers when by_columns), two dQ
        staging buffers of 64 × dq_stage_cols fp32, (stages + do_stages) rows of lse or D, 8 bytes per mbarrier
        (1 + 2·stages + 2·do_stages), 1 KB of slack for the 1024-byte alignment: BwdSharedStorage::kBytes in
        cuda_src/attention/sm90/bwd_mainloop.cuh.

        >>> [TILES[d].smem_bytes(d) for d in (64, 128, 256)]
        [199752, 198728, 231224]
        """
        score_buffers = 4 if self.by_columns else 2
        rings = self.stages + self.do_stages
        return (2 * self.block_n * head_dim * 2 + rings * self.block_m * head_dim * 2
                + score_buffers * self.block_n * self.block_m * 2 + 2 * 64 * self.dq_stage_cols(head_dim) * 4
                + rings * self.block_m * 4 + 8 * (1 + 2 * rings) + 1024)


# (head dim) -> tile; both dtypes alike. Registers per consumer thread under setmaxnreg's 240: with block_n = 128,
# dK + dV head_dim fp32, Sᵀ + dPᵀ block_m fp32, Pᵀ + dSᵀ block_m/2 packed, dQ 32; with block_n = 64 (by columns),
# dK + dV head_dim/2, Sᵀ + dPᵀ block_m/2, dQ head_dim/4. Shared memory: BwdSm90Tile.smem_bytes of the 227 KB
# (232448 B) per block.
TILES = {
    # 128 queries per step (FlashAttention-3's hdim-64 tile): 64 dK/dV + 128 Sᵀ/dPᵀ registers; 195 KB.
    64: BwdSm90Tile(128),
    # 64 queries per step (FlashAttention-3's hdim-128 tile): 128 dK/dV + 64 Sᵀ/dPᵀ registers; 194 KB.
    128: BwdSm90Tile(64),
    # 64 keys × 64 queries, warpgroups split by columns: 64 keys × 256 columns of dK and dV would be 256 registers,
    # split they are 128, + 32 Sᵀ/dPᵀ + 64 dQ. 226 KB: K and V 64 KB, two stages of Q and one of dO 96 KB, two Pᵀ
    # and two dSᵀ buffers 32 KB, dQ staging 32 KB. (FlashAttention-3: 64 × 80 with dKᵀ, dVᵀ split over the head
    # dim, P and dS in shared memory, single-staged dO and dS; our 64 keys keep wgmma's M = 64 on keys.)
    256: BwdSm90Tile(64, 64),
}

# FlashBwdSm90Params (cuda_src/attention/sm90/bwd_params.cuh), declared once here: its size and field sizes are
# asserted at compile time (KernelFamily.structs), its field order by tests/test_structs.py.
_PARAMS = c_struct([(n, MAP, 64) for n in ("tma_q", "tma_k", "tma_v", "tma_do", "tma_stats", "tma_dq")]
                   + [(n, F64 if n in ("scale", "scale_log2", "softcap_in", "alibi_scale") else I64, 8) for n in (
                             "dk", "dv", "dq_accum", "lse_log2", "delta", "seqlen_q", "seqlen_k", "seqlen_q_padded",
                             "head_dim", "head_dim_v", "num_heads", "groups", "is_causal", "causal_offset", "scale",
                             "scale_log2", "window_lo", "softcap_in", "alibi_slopes", "alibi_stride_b",
                             "alibi_scale", "cu_seqlens_q", "cu_seqlens_k", "seqused_k")])
FLASH_BWD_SM90 = KernelFamily(
    name="flash_bwd_sm90",
    source="attention/flash_bwd_sm90.cu",
    template="cupy_attn::flash_bwd_sm90<{dtype}, {head_dim}, {tile.block_m}, {tile.block_n}, {tile.stages}, "
             "{variants}, {varlen}>",
    axes={
        "dtype": tuple(C_TYPE_16.values()),
        "head_dim": tuple(TILES),
        "tile": tuple(sorted(set(TILES.values()), key=dataclasses.astuple)),
        # true: window (lower bound), softcap and ALiBi read at run time, for every tile
        "variants": ("false", "true"),
        # true: packed batches (varlen_attention's backward: BwdSeq in cuda_src/attention/sm90/bwd_params.cuh), in
        # the variants' instantiations only (the plain one at head dim 64 spilled 100 bytes with the sequence's
        # lengths in registers; the variants' kWindow mode serves plain calls)
        "varlen": ("false", "true"),
    },
    where=lambda row: (row["tile"] == TILES[row["head_dim"]]
                       and (row["varlen"] == "false" or row["variants"] == "true")),
    archs=("sm_90a",),
    structs=(("cupy_attn::FlashBwdSm90Params", _PARAMS),),
    arch="sm_90a",
)


def mod_family(bound):
    """The Hopper backward with a user's mods appended (attention/mods.py): flash_bwd_sm90_mod, dense calls, the
    bucket's tile; ModParams<FlashBwdSm90Params, Mod> (64-byte aligned)."""
    return mods.mod_family(FLASH_BWD_SM90, "cupy_attn::flash_bwd_sm90_mod<{dtype}, {head_dim}, {tile.block_m}, "
                           "{tile.block_n}, {tile.stages}, {mod}>",
                           "cupy_attn::ModParams<cupy_attn::FlashBwdSm90Params, {mod}>",
                           mods.mod_params_dtype(_PARAMS, bound.spec, align=64), bound.mod, bound.spec,
                           {"dtype": tuple(C_TYPE_16.values()), "head_dim": tuple(TILES),
                            "tile": tuple(sorted(set(TILES.values()), key=dataclasses.astuple))},
                           "flash_bwd_sm90_mod", where=lambda row: row["tile"] == TILES[row["head_dim"]])


def head_bucket(head_dim: int, head_dim_v: int) -> int | None:
    """The instantiated head dim (64, 128 or 256) for E and Ev: the smallest ≥ max(E, Ev); None above 256 or below
    1. TMA zero-fills the columns past E (Ev), as in the forward's FA3 kernel (flash_fwd_sm90.head_bucket).

    >>> head_bucket(64, 64), head_bucket(80, 96), head_bucket(8, 40), head_bucket(160, 160), head_bucket(257, 64)
    (64, 128, 64, 256, None)
    """
    return head_dim_bucket(head_dim, head_dim_v, TILES)


def unsupported_reason(dtype, head_dim: int, head_dim_v: int, has_mask: bool, arch: int) -> str | None:
    """None when this kernel can serve a backward of this kind (layout still to check: :func:`layout_reason`).

    >>> unsupported_reason(np.dtype("float16"), 320, 320, False, 90)
    'head dims E=320, Ev=320: the Hopper backward serves head dims up to 256'
    """
    if arch != 90:
        return f"sm_{arch}: the Hopper backward needs sm_90a (H100/H200)"
    if dtype_name(dtype) not in C_TYPE_16:
        return f"dtype {dtype_name(dtype)}: the Hopper backward serves fp16 and bf16"
    if head_bucket(head_dim, head_dim_v) is None:
        return f"head dims E={head_dim}, Ev={head_dim_v}: the Hopper backward serves head dims up to " \
               f"{max(TILES)}"
    if has_mask:
        return "attn_mask: the Hopper backward has no mask input (causal only)"
    return bindings_reason()


def layout_reason(q, k, v, dout) -> str | None:
    """None when TMA can read query, key, value and dout in place: 16-byte aligned bases, batch / head / row strides
    positive multiples of 16 bytes below 2^40 (axes of size 1 exempt), heads and batch within the grid's 65535.
    ``dout``: the array the kernel reads (the launcher passes a contiguous copy: kernel_abi.Layout.contiguous)."""
    for name, a in (("query", q), ("key", k), ("value", v), ("grad_out", dout)):
        why = tma_operand_reason(name, a)
        if why is not None:
            return why
    if k.shape[1] > 65535 or k.shape[0] > 65535:
        return "grid limit: key/value heads and batch must each be <= 65535"
    return None


def reason(p, arch: int) -> str | None:
    """None when this kernel runs the backward of a checked problem (checks.SDPAProblem) on compute capability
    ``arch``; else why not."""
    why = unsupported_reason(p.dtype, p.head_dim, p.head_dim_v, p.mask is not None, arch)
    if why is None and p.head_dim % 4:
        # The kernel adds dQ into its fp32 (B, Hq, L, E) accumulator through a tensor map, whose row stride (4·E
        # bytes) TMA needs a multiple of 16. (Views sliced to such an E can pass layout_reason's stride checks.)
        why = f"head_dim={p.head_dim}: the dQ accumulator's TMA rows need E a multiple of 4"
    if why is None:
        dout = Layout.contiguous((p.batch, p.num_heads, p.seqlen_q, p.head_dim_v), p.dtype)
        why = layout_reason(p.query, p.key, p.value, dout)
    return why


class Sm90Backward(bwd_rows.FusedBackward):
    """The Hopper backward of one problem layout, prepared once (the autograd backward's call cache replays it):
    everything but the pointers and tensor maps is computed here. A call: the pre-pass (attn_bwd_delta_padded: D and
    lse·log2 e in rows padded to STAT_PAD, and the fp32 dQ accumulator zeroed), the kernel, dQ's rounding. Scratch
    from the caller's allocator: the statistics (2 × B·Hq·L' fp32, L' = L rounded up to STAT_PAD), then the dQ
    accumulator (B·Hq·L·E fp32). Tensor maps are re-encoded only when a base address changes (~4 µs each)."""

    prepass_zeroes_dq = True  # attn_bwd_delta_padded zeroes the dQ accumulator's rows (no memset)

    def __init__(self, p, bucket: int):
        self.ctx = p.ctx
        B, Hq, Hkv, L, S, E, Ev = p.batch, p.num_heads, p.num_kv_heads, p.seqlen_q, p.seqlen_k, p.head_dim, \
            p.head_dim_v
        ctype = C_TYPE_16[dtype_name(p.dtype)]
        tile = TILES[bucket]
        l_pad = -(-L // STAT_PAD) * STAT_PAD
        self.delta_offset = B * Hq * l_pad * 4  # lse·log2(e) rows, then D rows, then (aligned) the dQ accumulator
        self.dq32_offset = bwd_rows.round_up_256(2 * self.delta_offset)
        self.scratch_bytes = self.dq32_offset + B * Hq * L * E * 4
        row_threads = bwd_rows.delta_row_threads(E, Ev)
        pre = np.zeros((), dtype=bwd_rows.BWD_PARAMS)
        pre["row_threads"] = row_threads
        pre["rows"], pre["ld"], pre["seqlen_q"], pre["head_dim_v"] = B * Hq * l_pad, l_pad, L, Ev
        pre["dq_cols"] = E  # the pre-pass zeroes the dQ accumulator (dq_zero, set per call)
        # The scratch: lse·log2(e) rows at its base, D rows at delta_offset, the dQ accumulator at dq32_offset.
        self.pre = PreparedLaunch(
            pre, [Step(bwd_rows.BACKWARD_DELTA_PADDED.kernel(dtype=ctype), (-(-B * Hq * l_pad * row_threads // 256),),
                       (256,))],
            args=("dout", "out", "lse", "scratch"),
            pointers={"dout": "dout", "o": "out", "lse": "lse", "lse_log2": "scratch",
                      "delta": ("scratch", self.delta_offset), "dq_zero": ("scratch", self.dq32_offset)})

        prm = self.params = np.zeros((), dtype=_PARAMS)
        prm["seqlen_q"], prm["seqlen_k"], prm["seqlen_q_padded"] = L, S, l_pad
        prm["head_dim"], prm["head_dim_v"], prm["num_heads"], prm["groups"] = E, Ev, Hq, p.groups
        # The bounds and the variants as the forward's (flash_fwd_sm90.set_variant_params): the upper bound (causal
        # and/or a window's right side) as is_causal / causal_offset, window_lo, softcap_in = scale / c with
        # scale_log2 = c·log2(e) (``scale`` stays the softmax scale: dS's own factor), ALiBi in raw-score units.
        flash_fwd_sm90.set_variant_params(prm, p)
        prm["scale"] = p.scale
        kernel_variants = variants.of(p).changes_scores
        bound = variants.of(p).mod
        if bound is not None:  # a user's mods: their instantiation (kUserMod consumers), the aux after the fields
            fam = mod_family(bound)
            with_mod = np.zeros((), fam.structs[0][1])
            for name in _PARAMS.names:
                with_mod[name] = prm[name]
            mods.fill_aux(with_mod, bound, Hq, query_ranges=True)
            prm = self.params = with_mod
            kernel = fam.kernel(dtype=ctype, head_dim=bucket, tile=tile)
        else:
            kernel = FLASH_BWD_SM90.kernel(dtype=ctype, head_dim=bucket, tile=tile,
                                           variants="true" if kernel_variants else "false", varlen="false")
        do = Layout.contiguous((B, Hq, L, Ev), p.dtype)  # dout as the kernel reads it
        # Q, K, V, dO; then lse·log2(e) and D as one fp32 (l_pad, 2·B·Hq) matrix, rows of tile.block_m per box (see
        # bwd_params.cuh).
        inputs = Maps(("tma_q", "tma_k", "tma_v", "tma_do"), ("q", "k", "v", "dout"), tuple(
            MapSpec.of(a, rows).encode for a, rows in ((p.query, tile.block_m), (p.key, tile.block_n),
                                                        (p.value, tile.block_n), (do, tile.block_m))))
        stats = functools.partial(encode_tensor_map, "float32", dims=(l_pad, 2 * B * Hq), strides=(4 * l_pad,),
                                  box=(tile.block_m, 1))
        # dQ's fp32 accumulator (B, Hq, L, E) for the kernel's TMA reduce: boxes of 32 columns (128 bytes, the
        # swizzle's width) × 64 rows. Both maps move with the scratch: a group of their own, since the scratch's base
        # moves between calls while the inputs' often do not.
        dq = functools.partial(encode_tensor_map, "float32", dims=(E, L, Hq, B),
                               strides=(4 * E, 4 * E * L, 4 * E * L * Hq), box=(32, 64, 1, 1), swizzle=128)
        scratch_maps = Maps(("tma_stats", "tma_dq"), ("scratch", ("scratch", self.dq32_offset)), (stats, dq))
        self.kernel = PreparedLaunch(
            prm, [Step(kernel, (math.ceil(S / tile.block_n), Hkv, B), (THREADS,), tile.smem_bytes(bucket))],
            args=("q", "k", "v", "dout", "scratch", "dk", "dv"), maps=(inputs, scratch_maps),
            pointers={"dk": "dk", "dv": "dv", "dq_accum": ("scratch", self.dq32_offset), "lse_log2": "scratch",
                      "delta": ("scratch", self.delta_offset)})
        self.cast = bwd_rows.GroupSum(ctype, B * Hq * L * E, B * Hq * L * E, 1)

    def _launch(self, stream, scratch, q, k, v, out, lse, dout, dk, dv, rng):
        self.pre.launch_on(stream, dout, out, lse, scratch)
        self.kernel.launch_on(stream, q, k, v, dout, scratch, dk, dv)


def build(p, bucket: int) -> Sm90Backward:
    """The prepared backward of a checked problem accepted by :func:`reason` at head-dim bucket ``bucket`` (the
    plan's: dispatch.plan_backward), replayed as ``launch(q, k, v, out, lse, dout, dq, dk, dv, rng)``."""
    return Sm90Backward(p, bucket)


class Sm90VarlenBackward(bwd_rows.FusedBackward):
    """The Hopper backward of a packed batch (varlen_attention), prepared for one call: the statistics pre-pass
    (attn_bwd_delta_varlen: lse·log2 e and D in each sequence's padded columns, +inf / 0 on the padding), the
    kVarlen kernel over grid (⌈max S_b / kBlockN⌉, Hkv, B), dQ's rounding from its fp32 (total_q, Hq, E)
    accumulator (zeroed by a memset). q, k, v, out, dout: the packed (total, H, D) rows, 16-byte aligned with
    16-byte row strides (TMA); dk, dv (total_k, Hkv, E|Ev) zeroed by the caller (rows no sequence covers stay 0).
    ``bounds``: as flash_fwd_sm90.build_varlen's (relative to each sequence's diagonal); the index arrays' addresses
    are baked into the parameters (one launch per call)."""

    def __init__(self, ctx, q, k, v, *, bounds, batch: int, max_seqlen_k: int, cu_seqlens_q: int,
                 cu_seqlens_k: int, seqused_k: int = 0):
        self.ctx = ctx
        total_q, Hq, E = q.shape
        total_k, Hkv, Ev = v.shape
        bucket = head_bucket(E, Ev)
        tile = TILES[bucket]
        ctype = C_TYPE_16[dtype_name(q.dtype)]
        ld = -(-(total_q + (batch + 1) * tile.block_m) // 64) * 64  # every sequence's padded columns fit
        self.dq32_offset = bwd_rows.round_up_256(2 * Hq * ld * 4)
        self.scratch_bytes = self.dq32_offset + total_q * Hq * E * 4
        row_threads = bwd_rows.delta_row_threads(E, Ev)
        pre = np.zeros((), dtype=bwd_rows.VARLEN_STATS_PARAMS)
        pre["cu_seqlens_q"], pre["batch"], pre["num_heads"], pre["total_q"] = cu_seqlens_q, batch, Hq, total_q
        pre["ld"], pre["head_dim_v"], pre["block_m"], pre["row_threads"] = ld, Ev, tile.block_m, row_threads
        self.pre = PreparedLaunch(
            pre, [Step(bwd_rows.BACKWARD_DELTA_VARLEN.kernel(dtype=ctype), (-(-Hq * ld * row_threads // 256),),
                       (256,))],
            args=("dout", "out", "lse", "scratch"), pointers={"dout": "dout", "o": "out", "lse": "lse",
                                                             "stats": "scratch"})
        prm = np.zeros((), dtype=_PARAMS)
        prm["seqlen_q"], prm["seqlen_k"], prm["seqlen_q_padded"] = total_q, total_k, ld
        prm["head_dim"], prm["head_dim_v"], prm["num_heads"], prm["groups"] = E, Ev, Hq, Hq // Hkv
        flash_fwd_sm90.set_variant_params(prm, bounds)
        prm["scale"] = bounds.scale
        prm["cu_seqlens_q"], prm["cu_seqlens_k"], prm["seqused_k"] = cu_seqlens_q, cu_seqlens_k, seqused_k
        def four(shape, strides):  # (total, H, D) rows as the (1, H, total, D) layout TMA reads
            return Layout((1, shape[1], shape[0], shape[2]), (strides[0] * shape[0], strides[1], strides[0],
                                                               strides[2]), q.dtype, 0)
        isz = q.dtype.itemsize  # dout as the caller gives it: contiguous (total_q, Hq, Ev) rows
        do = four((total_q, Hq, Ev), (isz * Hq * Ev, isz * Ev, isz))
        inputs = Maps(("tma_q", "tma_k", "tma_v", "tma_do"), ("q", "k", "v", "dout"), tuple(
            MapSpec.of(a, rows).encode for a, rows in ((four(q.shape, q.strides), tile.block_m),
                                                       (four(k.shape, k.strides), tile.block_n),
                                                       (four(v.shape, v.strides), tile.block_n), (do, tile.block_m))))
        stats = functools.partial(encode_tensor_map, "float32", dims=(ld, 2 * Hq), strides=(4 * ld,),
                                  box=(tile.block_m, 1))
        dq = functools.partial(encode_tensor_map, "float32", dims=(E, total_q, Hq, 1),
                               strides=(4 * Hq * E, 4 * E, 4 * Hq * E * max(total_q, 1)), box=(32, 64, 1, 1),
                               swizzle=128)
        scratch_maps = Maps(("tma_stats", "tma_dq"), ("scratch", ("scratch", self.dq32_offset)), (stats, dq))
        self.kernel = PreparedLaunch(
            prm, [Step(FLASH_BWD_SM90.kernel(dtype=ctype, head_dim=bucket, tile=tile, variants="true",
                                             varlen="true"),
                       (max(1, math.ceil(max_seqlen_k / tile.block_n)), Hkv, batch), (THREADS,),
                       tile.smem_bytes(bucket))],
            args=("q", "k", "v", "dout", "scratch", "dk", "dv"), maps=(inputs, scratch_maps),
            pointers={"dk": "dk", "dv": "dv", "dq_accum": ("scratch", self.dq32_offset), "lse_log2": "scratch",
                      "delta": ("scratch", 4 * Hq * ld)})
        self.cast = bwd_rows.GroupSum(ctype, total_q * Hq * E, total_q * Hq * E, 1)

    def _launch(self, stream, scratch, q, k, v, out, lse, dout, dk, dv, rng):
        self.pre.launch_on(stream, dout, out, lse, scratch)
        self.kernel.launch_on(stream, q, k, v, dout, scratch, dk, dv)
