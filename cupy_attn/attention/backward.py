"""Attention backward, split path: cuBLAS GEMMs and the elementwise kernels of cuda_src/attention/backward.cu.

FlashAttention-2's backward (Dao 2023, Algorithm 2) with the probabilities recomputed from the forward's lse, in
chunks of (batch·head, query rows) whose fp32 score buffers fit ``workspace_bytes``:

    D  = rowsum(dO ∘ O)                       attn_bwd_delta
    S  = scale·log2(e) · Q Kᵀ                 GEMM, fp32 out
    P  = 2^(S + mask − lse·log2 e)            attn_bwd_rows<T, false>, P in the input dtype (P∘Z/(1−p): dropout)
    dV += Pᵀ dO                               GEMM, fp32 accumulators across query-row chunks
    dP = dO Vᵀ                                GEMM, fp32 out (times Z/(1−p) in the next kernel: dropout)
    dS = P ∘ (dP − D)                         attn_bwd_rows<T, true>, dS in the input dtype (and fp32 for a mask grad)
    dQ = scale · dS K                         GEMM, written in the input dtype
    dK += scale · dSᵀ Q                       GEMM, fp32 accumulators

Every dtype (fp16, bf16, fp32: fp32 stays exact unless ``allow_tf32``), every head dim, every mask kind, both causal
alignments and GQA (K and V are read per query head; dK and dV are summed over each group in fp32). Inputs of any
strides are copied to contiguous scratch first (a cost this first version accepts). Memory comes from the caller's
allocator (runtime.workspace).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from .. import philox
from ..runtime import blas, workspace
from ..runtime import env as runtime_env
from ..runtime.compile import KernelFamily
from ..runtime.launch import AlignFlag, PreparedLaunch, Step, launch_struct
from ..runtime.interop import dtype_name
from ..runtime.kernel_abi import C_TYPE, LOG2E, MASK_KIND

# BwdParams in backward.cu: every field 8 bytes wide.
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
    source="attention/backward.cu",
    template="cupy_attn::attn_bwd_rows<{dtype}, {grad}, {dropout}>",
    axes={"dtype": tuple(C_TYPE.values()), "grad": ("false", "true"), "dropout": ("false", "true")},
    structs=(("cupy_attn::BwdParams", BWD_PARAMS),),
)
BACKWARD_GROUP_SUM = KernelFamily(
    name="attn_bwd_group_sum",
    source="attention/backward.cu",
    template="cupy_attn::attn_bwd_group_sum<{dtype}, {vec}>",
    axes={"dtype": tuple(C_TYPE.values()), "vec": (1, 4)},
    structs=(("cupy_attn::BwdParams", BWD_PARAMS),),
)
BACKWARD_DELTA_PADDED = KernelFamily(
    name="attn_bwd_delta_padded",
    source="attention/backward.cu",
    template="cupy_attn::attn_bwd_delta_padded<{dtype}>",
    axes={"dtype": ("__half", "__nv_bfloat16")},
    structs=(("cupy_attn::BwdParams", BWD_PARAMS),),
)
BACKWARD_DELTA = KernelFamily(
    name="attn_bwd_delta",
    source="attention/backward.cu",
    template="cupy_attn::attn_bwd_delta<{dtype}>",
    axes={"dtype": tuple(C_TYPE.values())},
    structs=(("cupy_attn::BwdParams", BWD_PARAMS),),
)

# The fused backward (cuda_src/attention/flash_bwd.cu): head-dim bucket -> (warps, kBlockM); kBlockN = 16 · warps.
# Both buckets: 4 warps, 64 keys × 64 queries per step; at D = 128 dK and dV take 128 accumulators per thread and the
# kernel sits at 255 registers with no spills (the dQ loop over keys is not unrolled, the Sᵀ loop by 2: fully
# unrolled they spilled 8 bytes). Head dims above 128 take the split backward.
FLASH_BWD_TILES = {64: (8, 64), 128: (8, 64)}
FLASH_BWD_TILE_CHOICES = ((8, 64),)
# Which backward runs (tests, comparisons): "split" the split backward, "mma" the mma.sync kernel (flash_bwd.cu) where
# it applies, "sm90" the Hopper wgmma kernel (flash_bwd_sm90.cu) wherever it applies; unset or "auto": plan_backward.
ENV_BWD = "CUPY_ATTN_BWD"
_ENV_BWD_VALUES = ("", "auto", "split", "mma", "sm90")

_FLASH_PARAMS = np.dtype([(n, np.float64 if n in ("scale", "scale_log2", "dropout_scale") else np.int64) for n in (
    "dk", "dv", "dq_accum", "q", "k", "v", "dout", "lse", "delta", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v",
    "num_heads", "groups", "is_causal", "causal_offset", "vec_flags", "scale", "scale_log2",
    "q_stride_b", "q_stride_h", "q_stride_l", "k_stride_b", "k_stride_h", "k_stride_s",
    "v_stride_b", "v_stride_h", "v_stride_s", "do_stride_b", "do_stride_h", "do_stride_l", "rng",
    "dropout_threshold", "dropout_scale")])

FLASH_BWD = KernelFamily(
    name="flash_bwd",
    source="attention/flash_bwd.cu",
    template="cupy_attn::flash_bwd<{dtype}, {head_dim}, {tile[0]}, {tile[1]}, {dropout}>",
    axes={"dtype": ("__half", "__nv_bfloat16"), "head_dim": tuple(FLASH_BWD_TILES),
          "tile": FLASH_BWD_TILE_CHOICES, "dropout": ("false", "true")},
    structs=(("cupy_attn::FlashBwdParams", _FLASH_PARAMS),),
)


def fused_bucket(p) -> int | None:
    """The fused backward's head-dim bucket for a checked problem, or None when it takes the split backward:
    fp16/bf16, no attn_mask, max(E, Ev) ≤ 128 on compute capability ≥ 8.0 or ≤ 256 on 9.0 (plan_backward's rules;
    ``CUPY_ATTN_BWD=split`` forces split)."""
    plan = plan_backward(p)
    return plan.bucket if plan.kernel != "split" else None


# No size threshold for the Hopper backward (there was one, 2^34 forward FLOPs, taken from the forward's FA3 rule):
# its prepared launch re-encodes a tensor map only when a base address moves, and at every size measured it was as
# fast as the mma.sync kernel or faster. H200, fp16 training steps through autograd, same process (session 19,
# bench/notes/backward.md): (1,8,256,64) 0.382 ms against 0.489; (2,8,512,128) 0.213 against 0.245; (4,16,512,128)
# 0.285 against 0.364; (2,16,1024,128) 0.411 against 0.533.


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """Which backward a call runs: ``kernel`` "sm90" (flash_bwd_sm90.cu), "mma" (flash_bwd.cu) or "split"; ``bucket``
    the fused kernels' head-dim bucket (None for split); ``reason`` why, for explain-style printing."""
    kernel: str
    bucket: int | None
    reason: str

    def __str__(self) -> str:
        bucket = f", head-dim bucket {self.bucket}" if self.bucket else ""
        return f"backward: {self.kernel}{bucket} ({self.reason})"


def plan_backward(p, arch: int | None = None) -> BackwardPlan:
    """Choose the backward of a checked problem (checks.SDPAProblem on the GPU; ``arch``: compute capability as an int,
    read from the call's device when None, so that tests can pass one).

    The split backward serves everything; the mma.sync fused kernel (flash_bwd.cu) fp16/bf16 without attn_mask at head
    dims ≤ 128 on compute capability ≥ 8.0; the Hopper kernel (flash_bwd_sm90.cu) fp16/bf16 without attn_mask or
    dropout at head dims ≤ 256 on 9.0 for layouts TMA reads in place (backward_sm90.problem_reason). ``CUPY_ATTN_BWD``:
    "split", "mma" (never sm90), "sm90" (sm90 wherever it applies); unset or "auto": sm90 wherever it applies, at any
    size (measured as fast as the mma.sync kernel or faster down to (1, 8, 256, 64)), else mma at head dims ≤ 128 and
    split above. ValueError for another value of the variable.
    Example: (8, 16, 1024, 256) fp16 on an H100 plans sm90 with bucket 256; under CUPY_ATTN_BWD=mma it plans split;
    E = 160 plans sm90 with bucket 256 (TMA zero-fills columns 160-255).
    """
    env = runtime_env.get(ENV_BWD, "")
    if env not in _ENV_BWD_VALUES:
        raise ValueError(f"{ENV_BWD} must be one of split, mma, sm90 or auto, got {env!r}")
    if env == "split":
        return BackwardPlan("split", None, f"forced by {ENV_BWD}=split")
    if p.mask is not None:
        return BackwardPlan("split", None, "attn_mask: the fused backward kernels have no mask input")
    if dtype_name(p.dtype) not in ("float16", "bfloat16"):
        return BackwardPlan("split", None, f"dtype {dtype_name(p.dtype)}: the fused backward serves fp16 and bf16")
    from . import backward_sm90
    need = max(p.head_dim, p.head_dim_v)
    bucket = next((d for d in FLASH_BWD_TILES if d >= need), None)  # the mma.sync kernel's, None above 128
    top = max(backward_sm90.SM90_BWD_TILES)
    if need > top:
        return BackwardPlan("split", None, f"head dims E={p.head_dim}, Ev={p.head_dim_v}: the fused backward kernels "
                                           f"serve head dims up to {top}")
    if arch is None:
        import cupy
        arch = int(cupy.cuda.Device(p.ctx.device_id).compute_capability)
    if arch < 80:
        return BackwardPlan("split", None, f"sm_{arch}: the fused backward needs sm_80 (mma.sync, cp.async)")
    no_mma = f"head dims E={p.head_dim}, Ev={p.head_dim_v}: the mma.sync kernel serves head dims up to " \
             f"{max(FLASH_BWD_TILES)}"
    if env == "mma":
        return (BackwardPlan("mma", bucket, f"mma.sync kernel forced by {ENV_BWD}=mma") if bucket else
                BackwardPlan("split", None, f"{ENV_BWD}=mma and {no_mma}"))
    if p.dropout_p > 0:
        return (BackwardPlan("mma", bucket, "mma.sync kernel: dropout (the Hopper kernel has no dropout variant)")
                if bucket else BackwardPlan("split", None, f"dropout (the Hopper kernel has none) and {no_mma}"))
    why_not = f"sm_{arch}: the Hopper kernel needs sm_90a" if arch != 90 else backward_sm90.problem_reason(p)
    if why_not is None:
        sm90_bucket = backward_sm90.head_bucket(p.head_dim, p.head_dim_v)
        if env == "sm90":
            return BackwardPlan("sm90", sm90_bucket, f"Hopper wgmma kernel forced by {ENV_BWD}=sm90")
        return BackwardPlan("sm90", sm90_bucket, "Hopper wgmma kernel (TMA, warp-specialized, FlashAttention-3 design)")
    if bucket is None:
        return BackwardPlan("split", None, f"{no_mma}; Hopper kernel not used: {why_not}")
    return BackwardPlan("mma", bucket, f"mma.sync kernel; Hopper kernel not used: {why_not}")


DEFAULT_WORKSPACE_BYTES = 1 << 30
# Bytes of chunk buffers per score: S and dP in fp32 (pitch ld), P/dS in the input dtype (pitch ld), dmask fp32.
_BYTES_PER_SCORE = 4 + 4 + 4


def _scratch(ctx, shape, dtype):
    """(holder, CuPy view) of an uninitialised array from the caller's allocator."""
    import cupy
    dtype = np.dtype(dtype)
    holder, ptr = workspace.scratch(ctx, math.prod(shape) * dtype.itemsize)
    mem = cupy.cuda.UnownedMemory(ptr, max(1, math.prod(shape)) * dtype.itemsize, holder, ctx.device_id)
    return holder, cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))


def _bits(x):
    """The same bytes as unsigned integers of the element's size: copies then run on any dtype (bf16 included)."""
    return x.view({2: np.uint16, 4: np.uint32, 1: np.uint8}[x.itemsize])


def _contiguous(ctx, x, keep: list):
    """x itself when C-contiguous, else a contiguous copy in scratch (kept alive through ``keep``)."""
    if x.flags.c_contiguous:
        return x
    holder, y = _scratch(ctx, x.shape, x.dtype)
    keep.append(holder)
    _bits(y)[...] = _bits(x)
    return y


def _rows16(a) -> bool:
    """Every row start 16-byte aligned (cp.async may copy 16 bytes at a time)."""
    return a.data.ptr % 16 == 0 and all(st % 16 == 0 for st in a.strides[:-1])


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


def round_up_256(nbytes: int) -> int:
    """nbytes rounded up to a multiple of 256 (the scratch regions' alignment)."""
    return -(-nbytes // 256) * 256


class FlashBackward(FusedBackward):
    """The mma.sync fused backward (flash_bwd.cu) of one problem layout, prepared once (the call cache of the
    autograd backward replays it): D = rowsum(dO ∘ O) by attn_bwd_delta, the kernel (dQ accumulated in fp32 by
    atomics), dQ's rounding. Scratch: D (B·Hq·L fp32) and the dQ accumulator (B·Hq·L·E fp32)."""

    def __init__(self, p, bucket: int):
        self.ctx = ctx = p.ctx
        B, Hq, Hkv, L, S, E, Ev = p.batch, p.num_heads, p.num_kv_heads, p.seqlen_q, p.seqlen_k, p.head_dim, \
            p.head_dim_v
        ctype = C_TYPE[dtype_name(p.dtype)]
        self.dq32_offset = round_up_256(B * Hq * L * 4)
        self.scratch_bytes = self.dq32_offset + B * Hq * L * E * 4
        delta = np.zeros((), dtype=BWD_PARAMS)
        delta["rows"], delta["head_dim_v"] = B * Hq * L, Ev
        self.delta = PreparedLaunch(delta, [Step(BACKWARD_DELTA.kernel(dtype=ctype), (-(-B * Hq * L // 8),), (256,))],
                                    args=("dout", "out", "scratch"),
                                    pointers={"dout": "dout", "o": "out", "delta": "scratch"})

        warps, block_m = FLASH_BWD_TILES[bucket]
        prm = self.params = np.zeros((), dtype=_FLASH_PARAMS)
        prm["seqlen_q"], prm["seqlen_k"], prm["head_dim"], prm["head_dim_v"] = L, S, E, Ev
        prm["num_heads"], prm["groups"] = Hq, p.groups
        prm["is_causal"] = p.causal is not None
        prm["causal_offset"] = S - L if p.causal == "bottom_right" else 0
        do = Layout.contiguous((B, Hq, L, Ev), p.dtype)  # dout as the kernel reads it (base: per call)
        prm["vec_flags"] = _rows16(p.query) | _rows16(p.key) << 1 | _rows16(p.value) << 2
        do_vec_flag = _rows16(do) << 3  # when dout's base is 16-byte aligned too
        prm["scale"], prm["scale_log2"] = p.scale, p.scale * LOG2E
        if p.dropout_p > 0:
            prm["dropout_threshold"] = philox.dropout_threshold(p.dropout_p)
            prm["dropout_scale"] = philox.dropout_scale(p.dropout_p)
        for name, arr, axes in (("q", p.query, "bhl"), ("k", p.key, "bhs"), ("v", p.value, "bhs"),
                                ("do", do, "bhl")):
            for axis, stride in zip(axes, arr.strides):
                prm[f"{name}_stride_{axis}"] = stride // p.dtype.itemsize
        if Hkv > 65535 or B > 65535:
            raise ValueError(f"fused backward: grid limit: heads {Hkv} and batch {B} must each be <= 65535")
        kernel = FLASH_BWD.kernel(dtype=ctype, head_dim=bucket, tile=(warps, block_m),
                                  dropout="true" if p.dropout_p > 0 else "false")
        block_n = 16 * warps
        smem = ((2 * block_n + 4 * block_m) * (bucket + 8) + block_n * (block_m + 8)) * 2 + 2 * block_m * 4
        self.kernel = PreparedLaunch(
            prm, [Step(kernel, (-(-S // block_n), Hkv, B), (warps * 32,), smem)],
            args=("q", "k", "v", "dout", "lse", "scratch", "dk", "dv", "rng"),
            pointers={"q": "q", "k": "k", "v": "v", "dout": "dout", "lse": "lse", "delta": "scratch",
                      "dq_accum": ("scratch", self.dq32_offset), "dk": "dk", "dv": "dv", "rng": "rng"},
            flags=[AlignFlag("vec_flags", "dout", 16, do_vec_flag)])
        self.cast = GroupSum(ctype, B * Hq * L * E, B * Hq * L * E, 1)

    def _launch(self, stream, scratch, q, k, v, out, lse, dout, dk, dv, rng):
        self.delta.launch_on(stream, dout, out, scratch)
        self.kernel.launch_on(stream, q, k, v, dout, lse, scratch, dk, dv, rng)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Shape, byte strides, dtype and base address of an array, read as the launchers read a CuPy array's: an array
    the kernel will read whose memory does not exist yet (dout's contiguous layout)."""
    shape: tuple
    strides: tuple
    dtype: np.dtype
    ptr: int

    @property
    def data(self):
        return self

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @classmethod
    def contiguous(cls, shape, dtype, ptr: int = 0) -> "Layout":
        dtype = np.dtype(dtype)
        strides, step = [], dtype.itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= n
        return cls(tuple(shape), tuple(reversed(strides)), dtype, ptr)


def prepare(p):
    """The prepared fused backward (FlashBackward or backward_sm90.Sm90Backward) that plan_backward chooses for a
    checked problem, or None when it plans the split backward. Replays need out, lse and dout contiguous."""
    plan = plan_backward(p)
    if plan.kernel == "sm90":
        from . import backward_sm90
        return backward_sm90.Sm90Backward(p, plan.bucket)
    if plan.kernel == "mma":
        return FlashBackward(p, plan.bucket)
    return None


def _run_fused(launch, p, out, lse, dout, dq, dk, dv) -> None:
    """Run a prepared fused backward on CuPy arrays, out, lse and dout copied to contiguous scratch when they are
    not contiguous."""
    keep: list = []
    with p.ctx.activate():
        o, do, lse = (_contiguous(p.ctx, x, keep) for x in (out, dout, lse))
        launch(p.query.data.ptr, p.key.data.ptr, p.value.data.ptr, o.data.ptr, lse.data.ptr, do.data.ptr,
               dq.data.ptr, dk.data.ptr, dv.data.ptr, 0 if p.rng is None else p.rng.data.ptr)
        del keep


def sdpa_backward(p, out, lse, dout, dq, dk, dv, dmask=None, *, workspace_bytes: int | None = None,
                  allow_tf32: bool = False) -> None:
    """Gradients of scaled_dot_product_attention for a checked problem ``p`` (checks.SDPAProblem, GPU).

    out (B, Hq, L, Ev) and lse (B, Hq, L) float32: the forward's results; dout: dL/dout, out's shape and dtype.
    Writes dq (B, Hq, L, E), dk (B, Hkv, S, E), dv (B, Hkv, S, Ev) in the input dtype (CuPy views, any strides with a
    unit last axis) and, when given, dmask (B, Hq, L, S) float32 = dL/d(scores) for a float mask (the caller sums it
    over the mask's broadcast axes). dq, dk, dv and dmask must be C-contiguous (the caller allocates them). Runs on
    the call's stream (``p.ctx``); S ≥ 1, L ≥ 1.
    """

    if dmask is None and all(a.flags.c_contiguous for a in (dq, dk, dv)):
        launch = prepare(p)
        if launch is not None:
            _run_fused(launch, p, out, lse, dout, dq, dk, dv)
            return
    ctx = p.ctx
    B, Hq, Hkv, L, S, E, Ev = p.batch, p.num_heads, p.num_kv_heads, p.seqlen_q, p.seqlen_k, p.head_dim, p.head_dim_v
    g, n_heads = p.groups, p.batch * p.num_heads
    dtype = p.dtype
    ctype = C_TYPE[dtype_name(dtype)]
    budget = workspace_bytes or DEFAULT_WORKSPACE_BYTES
    keep: list = []
    with ctx.activate():
        q, o, do = (_contiguous(ctx, x, keep) for x in (p.query, out, dout))
        k, v = p.key, p.value
        if g > 1 or not k.flags.c_contiguous or not v.flags.c_contiguous:  # one K/V per query head (GQA: repeated)
            holder_k, k_rep = _scratch(ctx, (B, Hq, S, E), dtype)
            holder_v, v_rep = _scratch(ctx, (B, Hq, S, Ev), dtype)
            keep += [holder_k, holder_v]
            _bits(k_rep).reshape(B, Hkv, g, S, E)[...] = _bits(k)[:, :, None]
            _bits(v_rep).reshape(B, Hkv, g, S, Ev)[...] = _bits(v)[:, :, None]
            k, v = k_rep, v_rep
        lse = _contiguous(ctx, lse, keep)
        holder, dk32 = _scratch(ctx, (B, Hq, S, E), np.float32)
        keep.append(holder)
        holder, dv32 = _scratch(ctx, (B, Hq, S, Ev), np.float32)
        keep.append(holder)
        holder, delta = _scratch(ctx, (B, Hq, L), np.float32)
        keep.append(holder)
        if not all(a.flags.c_contiguous for a in (dq, dk, dv) + (() if dmask is None else (dmask,))):
            raise ValueError("sdpa_backward: dq, dk, dv and dmask must be C-contiguous")

        ld = -(-S // 8) * 8
        per_score = _BYTES_PER_SCORE + (4 if dmask is not None else 0)
        rows = L if L * ld * per_score <= budget else max(1, budget // (ld * per_score))
        heads = max(1, min(n_heads, budget // (rows * ld * per_score))) if rows == L else 1
        holder, s32 = _scratch(ctx, (heads * rows * ld,), np.float32)
        keep.append(holder)
        holder, dp32 = _scratch(ctx, (heads * rows * ld,), np.float32)
        keep.append(holder)
        holder, pbuf = _scratch(ctx, (heads * rows * ld,), dtype)
        keep.append(holder)

        base = np.zeros((), dtype=BWD_PARAMS)
        base["lse"], base["delta"], base["seqlen_q"], base["seqlen_k"], base["ld"] = lse.data.ptr, delta.data.ptr, L, S, ld
        base["head_dim_v"], base["num_heads"] = Ev, Hq
        base["causal_offset"] = {None: S, "top_left": 0, "bottom_right": S - L}[p.causal]
        if p.mask is not None:
            m = p.mask
            base["mask_kind"] = MASK_KIND["bool" if p.mask_kind == "bool" else dtype_name(m.dtype)]
            base["mask"] = m.data.ptr
            for axis, stride in zip("bhls", m.strides):
                base[f"mask_stride_{axis}"] = stride // m.itemsize

        prm = base.copy()
        prm["rows"], prm["dout"], prm["o"] = n_heads * L, do.data.ptr, o.data.ptr
        launch_struct(BACKWARD_DELTA.kernel(dtype=ctype), (-(-n_heads * L // 8),), (256,), prm, ctx.stream.ptr)
        drop = "true" if p.dropout_p > 0 else "false"
        if p.dropout_p > 0:
            base["rng"] = p.rng.data.ptr
            base["dropout_threshold"] = philox.dropout_threshold(p.dropout_p)
            base["dropout_scale"] = philox.dropout_scale(p.dropout_p)
        rows_kernel = BACKWARD_ROWS.kernel(dtype=ctype, grad="false", dropout=drop)
        grad_kernel = BACKWARD_ROWS.kernel(dtype=ctype, grad="true", dropout=drop)
        alpha = p.scale * LOG2E
        isz = dtype.itemsize
        gemms: dict = {}
        # S is recomputed by the forward's own GEMM (fp32: gemm_3xtf32 unless CUPY_ATTN_FP32_GEMM=sgemm or allow_tf32),
        # so that P = 2^(S − lse) matches the forward's lse: an SGEMM S against a 3xTF32 lse put dQ's error at 2.7e-6
        # against a bound of 1.6e-6 (tests/test_backward.py "long", fp32, H200). The other four stay cuBLAS's
        # (transposed operands and beta = 1 accumulation are not in gemm_3xtf32).
        from . import gemm_3xtf32
        from .dispatch import device_arch
        scores_gemm = functools.partial(gemm_3xtf32.strided_gemm, allow_tf32=allow_tf32, arch=device_arch(p))

        def gemm_set(nb: int, lc: int, accumulate: bool):
            """The five GEMMs for nb heads × lc query rows; dK/dV accumulate (beta = 1) after the first row chunk."""
            key = (nb, lc, accumulate)
            if key not in gemms:
                beta = 1.0 if accumulate else 0.0
                common = dict(batch=nb, allow_tf32=allow_tf32)
                gemms[key] = (
                    # S = alpha · Q Kᵀ  (lc × S)
                    scores_gemm(c_dtype=np.float32, ldc=ld, stride_c=lc * ld, a_dtype=dtype, lda=E, stride_a=L * E,
                                trans_a=False, b_dtype=dtype, ldb=E, stride_b=S * E, trans_b=True, m=lc, n=S, k=E,
                                alpha=alpha, batch=nb),
                    # dV (+)= Pᵀ dO  (S × Ev)
                    blas.StridedGemm(c_dtype=np.float32, ldc=Ev, stride_c=S * Ev, a_dtype=dtype, lda=ld,
                                     stride_a=lc * ld, trans_a=True, b_dtype=dtype, ldb=Ev, stride_b=L * Ev,
                                     trans_b=False, m=S, n=Ev, k=lc, beta=beta, **common),
                    # dP = dO Vᵀ  (lc × S)
                    blas.StridedGemm(c_dtype=np.float32, ldc=ld, stride_c=lc * ld, a_dtype=dtype, lda=Ev,
                                     stride_a=L * Ev, trans_a=False, b_dtype=dtype, ldb=Ev, stride_b=S * Ev,
                                     trans_b=True, m=lc, n=S, k=Ev, **common),
                    # dQ = scale · dS K  (lc × E)
                    blas.StridedGemm(c_dtype=dtype, ldc=E, stride_c=L * E, a_dtype=dtype, lda=ld,
                                     stride_a=lc * ld, trans_a=False, b_dtype=dtype, ldb=E, stride_b=S * E,
                                     trans_b=False, m=lc, n=E, k=S, alpha=p.scale, **common),
                    # dK (+)= scale · dSᵀ Q  (S × E)
                    blas.StridedGemm(c_dtype=np.float32, ldc=E, stride_c=S * E, a_dtype=dtype, lda=ld,
                                     stride_a=lc * ld, trans_a=True, b_dtype=dtype, ldb=E, stride_b=L * E,
                                     trans_b=False, m=S, n=E, k=lc, alpha=p.scale, beta=beta, **common))
            return gemms[key]

        for h0 in range(0, n_heads, heads):
            nb = min(heads, n_heads - h0)
            for r0 in range(0, L, rows):
                lc = min(rows, L - r0)
                g_s, g_dv, g_dp, g_dq, g_dk = gemm_set(nb, lc, r0 > 0)
                q0, do0 = q.data.ptr + (h0 * L + r0) * E * isz, do.data.ptr + (h0 * L + r0) * Ev * isz
                k0, v0 = k.data.ptr + h0 * S * E * isz, v.data.ptr + h0 * S * Ev * isz
                g_s(s32.data.ptr, q0, k0)
                prm = base.copy()
                prm["scores"], prm["dp"], prm["out"] = s32.data.ptr, dp32.data.ptr, pbuf.data.ptr
                prm["rows"], prm["rows_per_head"], prm["row0"], prm["head0"] = nb * lc, lc, r0, h0
                launch_struct(rows_kernel, (nb * lc,), (128,), prm, ctx.stream.ptr)
                g_dv(dv32.data.ptr + h0 * S * Ev * 4, pbuf.data.ptr, do0)
                g_dp(dp32.data.ptr, do0, v0)
                if dmask is not None:  # (rows, S) of this chunk: heads h0.., rows r0.. of a (heads, L, S) array
                    prm["dmask"] = dmask.data.ptr + (h0 * L + r0) * S * 4
                launch_struct(grad_kernel, (nb * lc,), (128,), prm, ctx.stream.ptr)
                g_dq(dq.data.ptr + (h0 * L + r0) * E * isz, pbuf.data.ptr, k0)
                g_dk(dk32.data.ptr + h0 * S * E * 4, pbuf.data.ptr, q0)

        for src, dst, inner in ((dk32, dk, S * E), (dv32, dv, S * Ev)):
            GroupSum(ctype, dst.size, inner, g).run(ctx.stream.ptr, src.data.ptr, dst.data.ptr)
        del keep
