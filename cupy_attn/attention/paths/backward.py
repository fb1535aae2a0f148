"""The attention backward's schedules: the fused kernels' launch, or the split backward's GEMMs and row kernels.

The plan (dispatch.plan_backward, made once per call by autograd.grad_inputs) chooses the kernel: flash_bwd_sm90
(Hopper), flash_bwd (mma.sync) or the split backward. :func:`prepare` builds a fused plan's launch,
:func:`sdpa_backward` runs the plan on CuPy arrays. The split backward is FlashAttention-2's backward (Dao 2023,
Algorithm 2) with the probabilities recomputed from the forward's lse, in chunks of (batch·head, query rows) whose fp32
score buffers fit ``workspace_bytes``, on cuBLAS GEMMs and the row kernels of kernels/bwd_rows.py:

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
strides are copied to contiguous scratch first. Memory comes from the caller's allocator (runtime.workspace), the
GEMMs' cuBLASLt workspace included, and goes back to it when the call returns.
"""
from __future__ import annotations

import math

import numpy as np

from ...runtime import blas, workspace
from ...runtime.interop import bits_view, dtype_name
from ...runtime.kernel_abi import C_TYPE, LOG2E
from ...runtime.launch import launch_struct
from .. import variants
from ..kernels import bwd_rows, flash_bwd, flash_bwd_sm90, gemm_3xtf32

DEFAULT_WORKSPACE_BYTES = 1 << 30
# Bytes of chunk buffers per score: S and dP in fp32 (pitch ld), P/dS in the input dtype (pitch ld), dmask fp32.
_BYTES_PER_SCORE = 4 + 4 + 4
KERNELS = {"sm90": flash_bwd_sm90, "mma": flash_bwd}  # a plan's kernel -> the module that builds it


def _scratch(ctx, shape, dtype):
    """(holder, CuPy view) of an uninitialised array from the caller's allocator."""
    import cupy
    dtype = np.dtype(dtype)
    holder, ptr = workspace.scratch(ctx, math.prod(shape) * dtype.itemsize)
    mem = cupy.cuda.UnownedMemory(ptr, max(1, math.prod(shape)) * dtype.itemsize, holder, ctx.device_id)
    return holder, cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))


def _contiguous(ctx, x, keep: list):
    """x itself when C-contiguous, else a contiguous copy in scratch (kept alive through ``keep``)."""
    if x.flags.c_contiguous:
        return x
    holder, y = _scratch(ctx, x.shape, x.dtype)
    keep.append(holder)
    bits_view(y)[...] = bits_view(x)
    return y


def prepare(p, plan):
    """The prepared fused backward (flash_bwd.FlashBackward or flash_bwd_sm90.Sm90Backward) of a plan whose kernel
    is "sm90" or "mma" (dispatch.plan_backward's), or None for a split plan. Replays need out, lse and dout
    contiguous."""
    module = KERNELS.get(plan.kernel)
    return None if module is None else module.build(p, plan.bucket)


def _run_fused(launch, p, out, lse, dout, dq, dk, dv) -> None:
    """Run a prepared fused backward on CuPy arrays, out, lse and dout copied to contiguous scratch when they are
    not contiguous."""
    keep: list = []
    with p.ctx.activate():
        o, do, lse = (_contiguous(p.ctx, x, keep) for x in (out, dout, lse))
        launch(p.query.data.ptr, p.key.data.ptr, p.value.data.ptr, o.data.ptr, lse.data.ptr, do.data.ptr,
               dq.data.ptr, dk.data.ptr, dv.data.ptr, 0 if p.rng is None else p.rng.data.ptr)
        del keep


def sdpa_backward(p, plan, out, lse, dout, dq, dk, dv, dmask=None, *, workspace_bytes: int | None = None,
                  allow_tf32: bool = False) -> None:
    """Gradients of scaled_dot_product_attention for a checked problem ``p`` (checks.SDPAProblem, GPU) by the plan
    ``plan`` (dispatch.plan_backward's for ``p``).

    out (B, Hq, L, Ev) and lse (B, Hq, L) float32: the forward's results; dout: dL/dout, out's shape and dtype.
    Writes dq (B, Hq, L, E), dk (B, Hkv, S, E), dv (B, Hkv, S, Ev) in the input dtype (CuPy views, any strides with a
    unit last axis) and, when given, dmask (B, Hq, L, S) float32 = dL/d(scores) for a float mask (the caller sums it
    over the mask's broadcast axes). dq, dk, dv and dmask must be C-contiguous (the caller allocates them). Runs on
    the call's stream (``p.ctx``); S ≥ 1, L ≥ 1. A fused plan runs its kernel when dq, dk and dv are contiguous and
    no dmask is asked for; otherwise (and for a split plan) the split backward runs, its scores GEMM of the plan's
    kind (``plan.gemm``: the forward's, so that P = 2^(S − lse) matches the forward's lse).
    """

    if dmask is None and all(a.flags.c_contiguous for a in (dq, dk, dv)):
        launch = prepare(p, plan)
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
            bits_view(k_rep).reshape(B, Hkv, g, S, E)[...] = bits_view(k)[:, :, None]
            bits_view(v_rep).reshape(B, Hkv, g, S, Ev)[...] = bits_view(v)[:, :, None]
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
        work = None  # the cuBLASLt GEMMs' workspace, per call like the buffers above (none outlives the call)
        if ws_bytes := blas.lt_workspace_bytes():
            holder, ws_ptr = workspace.scratch(ctx, ws_bytes)
            keep.append(holder)
            work = (ws_ptr, ws_bytes)

        base = bwd_rows.base_params(p, lse.data.ptr, delta.data.ptr, ld)

        prm = base.copy()
        prm["rows"], prm["dout"], prm["o"] = n_heads * L, do.data.ptr, o.data.ptr
        launch_struct(bwd_rows.BACKWARD_DELTA.kernel(dtype=ctype), (-(-n_heads * L // 8),), (256,), prm,
                      ctx.stream.ptr)
        drop = "true" if p.dropout_p > 0 else "false"
        if p.dropout_p > 0:
            bwd_rows.dropout_params(p, base)
        rows_family = bwd_rows.BACKWARD_ROWS
        if (bound := variants.of(p).mod) is not None:  # a user's mods: their instantiation, the aux after BwdParams
            rows_family = bwd_rows.mod_family(bound)
            base = bwd_rows.with_mod(base, bound, p.num_heads)
        rows_kernel = rows_family.kernel(dtype=ctype, grad="false", dropout=drop)
        grad_kernel = rows_family.kernel(dtype=ctype, grad="true", dropout=drop)
        alpha = p.scale * LOG2E
        isz = dtype.itemsize
        gemms: dict = {}
        # S is recomputed by the forward's own GEMM (the plan's kind: fp32 runs gemm_3xtf32 unless
        # CUPY_ATTN_FP32_GEMM=sgemm or allow_tf32), so that P = 2^(S − lse) matches the forward's lse: an SGEMM S
        # against a 3xTF32 lse put dQ's error over its bound (tests/test_sdpa_backward.py "long", fp32). The other
        # four stay cuBLAS's (transposed operands and beta = 1 accumulation are not in gemm_3xtf32).
        def scores_gemm(**problem):
            return gemm_3xtf32.strided_gemm(plan.gemm, allow_tf32=allow_tf32, **problem)

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
                g_s(s32.data.ptr, q0, k0, work=work)
                prm = base.copy()
                prm["scores"], prm["dp"], prm["out"] = s32.data.ptr, dp32.data.ptr, pbuf.data.ptr
                prm["rows"], prm["rows_per_head"], prm["row0"], prm["head0"] = nb * lc, lc, r0, h0
                launch_struct(rows_kernel, (nb * lc,), (128,), prm, ctx.stream.ptr)
                g_dv(dv32.data.ptr + h0 * S * Ev * 4, pbuf.data.ptr, do0, work=work)
                g_dp(dp32.data.ptr, do0, v0, work=work)
                if dmask is not None:  # (rows, S) of this chunk: heads h0.., rows r0.. of a (heads, L, S) array
                    prm["dmask"] = dmask.data.ptr + (h0 * L + r0) * S * 4
                launch_struct(grad_kernel, (nb * lc,), (128,), prm, ctx.stream.ptr)
                g_dq(dq.data.ptr + (h0 * L + r0) * E * isz, pbuf.data.ptr, k0, work=work)
                g_dk(dk32.data.ptr + h0 * S * E * 4, pbuf.data.ptr, q0, work=work)

        for src, dst, inner in ((dk32, dk, S * E), (dv32, dv, S * Ev)):
            bwd_rows.GroupSum(ctype, dst.size, inner, g).run(ctx.stream.ptr, src.data.ptr, dst.data.ptr)
        del keep
