"""The backward's row kernels (cuda_src/attention/bwd_rows.cu): what the backward schedules run around their GEMMs
and fused kernels.

    D  = rowsum(dO ∘ O)                       attn_bwd_delta (and attn_bwd_delta_padded: rows padded for TMA,
                                              lse·log2 e, the fp32 dQ accumulator zeroed)
    P  = 2^(S + mask − lse·log2 e)            attn_bwd_rows<T, false>, P in the input dtype (P∘Z/(1−p): dropout)
    dS = P ∘ (dP − D)                         attn_bwd_rows<T, true>, dS in the input dtype (and fp32 for a mask grad)
                                              (attn_bwd_rows_mod: with a user's mods, :func:`mod_family`)
    x  = Σ_group x32                          attn_bwd_group_sum: dK, dV summed over a GQA group; dQ's rounding

All four families take one struct, BwdParams. :class:`GroupSum` is the group sum's launch; :class:`FusedBackward`
what the two fused backward kernels (flash_bwd, flash_bwd_sm90) share around their launch: scratch, the dQ
accumulator's zeroing, dQ's rounding; :func:`base_params` the split backward's BwdParams of a call.
"""
from __future__ import annotations

import numpy as np

from ... import philox
from ...runtime import workspace
from ...runtime.compile import KernelFamily
from ...runtime.interop import dtype_name
from ...runtime.kernel_abi import C_TYPE, MASK_KIND, set_strides
from ...runtime.launch import PreparedLaunch, Step
from .. import mods

# BwdParams in bwd_rows.cu: every field 8 bytes wide.
BWD_PARAMS = np.dtype([(n, np.float64 if n == "dropout_scale" else np.int64) for n in (
    "scores", "dp", "out", "dmask", "lse", "delta", "mask", "dout", "o", "rows", "rows_per_head", "row0",
    "seqlen_q", "seqlen_k", "ld", "head_dim_v", "head0", "num_heads", "causal_offset", "mask_kind",
    "mask_stride_b", "mask_stride_h", "mask_stride_l", "mask_stride_s", "rng", "dropout_threshold",
    "dropout_scale", "lse_log2", "dq_zero", "dq_cols", "row_threads")])


def delta_row_threads(head_dim: int, head_dim_v: int) -> int:
    """Threads per row of attn_bwd_delta_padded: enough for one 16-byte load (8 elements) each over a row of
    head_dim_v 16-bit elements, and for at most four 16-byte stores each over the row of head_dim fp32 dQ
    accumulators it zeroes, as a power of two ≤ 32 (a warp's lanes split into whole rows); 32 when head_dim_v is not a
    multiple of 8 (element-wise loads).

    >>> [delta_row_threads(e, e) for e in (64, 128, 256, 512, 96, 40)], delta_row_threads(100, 100)
    ([8, 16, 32, 32, 16, 8], 32)
    >>> delta_row_threads(256, 8)  # 16 threads zero 256 floats, 16 each
    16
    """
    if head_dim_v % 8:
        return 32
    need = max(-(-head_dim_v // 8), -(-head_dim // 16))
    return min(32, 1 << max(0, (need - 1).bit_length()))


BACKWARD_ROWS = KernelFamily(
    name="attn_bwd_rows",
    source="attention/bwd_rows.cu",
    template="cupy_attn::attn_bwd_rows<{dtype}, {grad}, {dropout}>",
    axes={"dtype": tuple(C_TYPE.values()), "grad": ("false", "true"), "dropout": ("false", "true")},
    structs=(("cupy_attn::BwdParams", BWD_PARAMS),),
)
def mod_family(bound):
    """attn_bwd_rows with a user's mods appended (attention/mods.py): attn_bwd_rows_mod<T, grad, dropout, Mod> on
    ModParams<BwdParams, Mod>."""
    return mods.mod_family(BACKWARD_ROWS, "cupy_attn::attn_bwd_rows_mod<{dtype}, {grad}, {dropout}, {mod}>",
                           "cupy_attn::ModParams<cupy_attn::BwdParams, {mod}>",
                           mods.mod_params_dtype(BWD_PARAMS, bound.spec), bound.mod, bound.spec,
                           dict(BACKWARD_ROWS.axes), "attn_bwd_rows_mod")


def with_mod(base: np.ndarray, bound, num_heads: int) -> np.ndarray:
    """BwdParams ``base`` as ModParams<BwdParams, Mod>: its fields, then the head count and the call's aux."""
    out = np.zeros((), mods.mod_params_dtype(BWD_PARAMS, bound.spec))
    for name in BWD_PARAMS.names:
        out[name] = base[name]
    mods.fill_aux(out, bound, num_heads)
    return out


BACKWARD_GROUP_SUM = KernelFamily(
    name="attn_bwd_group_sum",
    source="attention/bwd_rows.cu",
    template="cupy_attn::attn_bwd_group_sum<{dtype}, {vec}>",
    axes={"dtype": tuple(C_TYPE.values()), "vec": (1, 4)},
    structs=(("cupy_attn::BwdParams", BWD_PARAMS),),
)
BACKWARD_DELTA_PADDED = KernelFamily(
    name="attn_bwd_delta_padded",
    source="attention/bwd_rows.cu",
    template="cupy_attn::attn_bwd_delta_padded<{dtype}>",
    axes={"dtype": ("__half", "__nv_bfloat16")},
    structs=(("cupy_attn::BwdParams", BWD_PARAMS),),
)
# BwdVarlenStatsParams in bwd_rows.cu: the packed backward's statistics pre-pass.
VARLEN_STATS_PARAMS = np.dtype([(n, np.int64) for n in (
    "dout", "o", "lse", "stats", "cu_seqlens_q", "batch", "num_heads", "total_q", "ld", "head_dim_v", "block_m",
    "row_threads")])
BACKWARD_DELTA_VARLEN = KernelFamily(
    name="attn_bwd_delta_varlen",
    source="attention/bwd_rows.cu",
    template="cupy_attn::attn_bwd_delta_varlen<{dtype}>",
    axes={"dtype": ("__half", "__nv_bfloat16")},
    structs=(("cupy_attn::BwdVarlenStatsParams", VARLEN_STATS_PARAMS),),
)
BACKWARD_DELTA = KernelFamily(
    name="attn_bwd_delta",
    source="attention/bwd_rows.cu",
    template="cupy_attn::attn_bwd_delta<{dtype}>",
    axes={"dtype": tuple(C_TYPE.values())},
    structs=(("cupy_attn::BwdParams", BWD_PARAMS),),
)


def base_params(p, lse_ptr: int, delta_ptr: int, ld: int) -> np.ndarray:
    """The split backward's BwdParams shared by every chunk of the call ``p`` (checks.SDPAProblem): lse and D (device
    pointers), the sizes, the score buffers' pitch ``ld`` (elements), the causal limit (checks.SDPAProblem.visible_offset:
    the kernels have no is_causal flag), and the mask's kind, pointer and strides. Dropout's fields are set by the schedule after
    the D pass (:func:`dropout_params`)."""
    L, S = p.seqlen_q, p.seqlen_k
    base = np.zeros((), dtype=BWD_PARAMS)
    base["lse"], base["delta"], base["seqlen_q"], base["seqlen_k"], base["ld"] = lse_ptr, delta_ptr, L, S, ld
    base["head_dim_v"], base["num_heads"] = p.head_dim_v, p.num_heads
    base["causal_offset"] = p.visible_offset
    if p.mask is not None:
        m = p.mask
        base["mask_kind"] = MASK_KIND["bool" if p.mask_kind == "bool" else dtype_name(m.dtype)]
        base["mask"] = m.data.ptr
        set_strides(base, ("mask", m, "bhls"))
    return base


def dropout_params(p, params: np.ndarray) -> None:
    """Dropout's fields of BwdParams for a call with dropout_p > 0: the rng pair's address, the keep threshold and
    1/(1 − p)."""
    params["rng"] = p.rng.data.ptr
    params["dropout_threshold"] = philox.dropout_threshold(p.dropout_p)
    params["dropout_scale"] = philox.dropout_scale(p.dropout_p)


class GroupSum:
    """attn_bwd_group_sum for one size: ``rows`` output elements, each the sum of ``groups`` fp32 source elements
    ``inner`` apart in blocks of ``inner`` (dQ's rounding: groups 1). ``run(stream, src, dst)`` takes the 4-wide
    kernel when the sizes and the pointers' alignment allow, else the scalar one."""

    def __init__(self, ctype: str, rows: int, inner: int, groups: int):
        self.vec = rows % 4 == 0 and inner % 4 == 0
        self.dst_align = 4 * (4 if ctype == "float" else 2)  # bytes of 4 outputs
        self.params = np.zeros((), dtype=BWD_PARAMS)
        self.params["rows"], self.params["ld"], self.params["num_heads"] = rows, inner, groups
        self.launches = {vec: PreparedLaunch(self.params, [Step(BACKWARD_GROUP_SUM.kernel(dtype=ctype, vec=vec),
                                                                (-(-rows // (256 * vec)),), (256,))],
                                             args=("src", "dst"), pointers={"scores": "src", "out": "dst"})
                         for vec in ((1, 4) if self.vec else (1,))}

    def run(self, stream: int, src: int, dst: int) -> None:
        self.launches[4 if self.vec and src % 16 == 0 and dst % self.dst_align == 0 else 1].launch_on(stream, src, dst)


def round_up_256(nbytes: int) -> int:
    """nbytes rounded up to a multiple of 256 (the scratch regions' alignment)."""
    return -(-nbytes // 256) * 256


class FusedBackward:
    """What the two fused backward kernels share around their launch: scratch from the caller's allocator (the
    statistics the pre-pass writes, then the fp32 dQ accumulator), the accumulator's zeroing, and dQ's rounding to
    the input dtype; all on the stream of the context the launch was prepared for. Subclasses set ``ctx``,
    ``dq32_offset``, ``scratch_bytes`` and ``cast`` and implement ``_launch(stream, scratch, ...)``; one whose
    pre-pass zeroes the accumulator itself sets ``prepass_zeroes_dq`` (no memset then)."""

    prepass_zeroes_dq = False

    def __call__(self, q: int, k: int, v: int, out: int, lse: int, dout: int, dq: int, dk: int, dv: int,
                 rng: int = 0) -> None:
        """Enqueue the backward for these device pointers (out, lse and dout contiguous; dq, dk, dv contiguous, in
        the input dtype). The context's device must be current."""
        from cupy.cuda import runtime
        stream = self.ctx.stream.ptr
        holder, scratch = workspace.scratch(self.ctx, self.scratch_bytes)
        dq32 = scratch + self.dq32_offset
        if not self.prepass_zeroes_dq:
            runtime.memsetAsync(dq32, 0, self.scratch_bytes - self.dq32_offset, stream)
        self._launch(stream, scratch, q, k, v, out, lse, dout, dk, dv, rng)
        self.cast.run(stream, dq32, dq)
        del holder  # freed stream-ordered: the work above is enqueued
