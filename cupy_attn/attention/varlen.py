"""varlen_attention: attention over packed batches of sequences of different lengths (FlashAttention's varlen API).

    checks (check_varlen) -> the packed kernel (one launch for every sequence: kernels/flash_fwd_sm90.build_varlen)
                          or per-sequence calls of scaled_dot_product_attention on views (every other call)

The packed kernel is the FlashAttention-3-design forward with a SeqSpan per tile (cuda_src/attention/sm90/params.cuh):
the tensor maps cover every sequence's rows as batch 1, and each CTA reads its sequence's offsets and lengths from
cu_seqlens_q / cu_seqlens_k / seqused_k on the device, so a call needs no host copy of them (CUDA graphs capture it).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types
from typing import Any

import numpy as np

from .. import reference
from ..runtime import callcache, env, interop
from . import checks, variants as _variants

INDEX_DTYPE = np.dtype(np.int32)


@dataclasses.dataclass
class VarlenProblem:
    """One checked varlen call. q/k/v and the index arrays as the caller passed them (their kind: ``ctx.kind``)."""

    ctx: interop.CallContext
    q: Any
    k: Any
    v: Any
    cu_seqlens_q: Any
    cu_seqlens_k: Any
    seqused_k: Any
    block_table: Any
    batch: int
    total_q: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    max_seqlen_q: int
    max_seqlen_k: int
    dtype: np.dtype
    scale: float
    causal: bool
    dropout_p: float
    variants: _variants.Variants
    window_size: Any
    softcap: Any
    sinks: Any
    alibi_slopes: Any


def _index_array(name: str, x, ctx, shape_text: str, ndim: int, length: int | None = None):
    """An int32 index argument of the call's kind and device, ``ndim`` axes (axis 0 of size ``length`` where given)."""
    kind = interop.check_like_query(name, x, ctx, "q")
    shape = tuple(x.shape)
    if len(shape) != ndim or (length is not None and shape[0] != length):
        raise ValueError(f"{name} must have shape {shape_text}, got {shape}")
    if interop.dtype_of(x, kind) != INDEX_DTYPE:
        raise TypeError(f"{name} must be int32, got {interop.dtype_of(x, kind)}")
    return x


def _int_arg(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{name} must be an int >= 0, got {x!r}")
    return int(x)


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_k, block_table,
                 is_causal, scale, dropout_p, backend, window_size, softcap, sinks, alibi_slopes, score_mod=None,
                 mask_mod=None, aux=None) -> VarlenProblem:
    """Validate a varlen_attention call before anything is launched; raise TypeError/ValueError naming the argument
    and axis. The index arrays' values are not read (that would wait for the device): see varlen_attention."""
    if backend not in checks.BACKENDS:
        raise ValueError(f"backend must be one of {checks.BACKENDS}, got {backend!r}")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if is_causal not in (True, False, None, "bottom_right"):
        raise ValueError(f"is_causal must be a bool or 'bottom_right' (varlen masks are bottom-right aligned, as "
                         f"FlashAttention's), got {is_causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    ctx = interop.context_for(q, "q")
    for name, x in (("k", k), ("v", v)):
        interop.check_like_query(name, x, ctx, "q")
    dtype = interop.dtype_of(q, ctx.kind)
    if interop.dtype_name(dtype) not in checks.FLOAT_DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {dtype}")
    for name, x in (("k", k), ("v", v)):
        if interop.dtype_of(x, ctx.kind) != dtype:
            raise TypeError(f"{name} must have q's dtype {dtype}, got {interop.dtype_of(x, ctx.kind)}")
    if len(q.shape) != 3:
        raise ValueError(f"q must be (total_q, Hq, E), got shape {tuple(q.shape)}")
    total_q, Hq, E = (int(n) for n in q.shape)
    paged = block_table is not None
    kv_ndim, kv_text = (4, "(num_blocks, block_size, Hkv, E)") if paged else (3, "(total_k, Hkv, E)")
    for name, x in (("k", k), ("v", v)):
        if len(x.shape) != kv_ndim:
            raise ValueError(f"{name} must be {kv_text}{' with block_table' if paged else ''}, got shape "
                             f"{tuple(x.shape)}")
    if tuple(k.shape[:-1]) != tuple(v.shape[:-1]):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on every axis but the last")
    Hkv, Ev = int(v.shape[-2]), int(v.shape[-1])
    if int(k.shape[-1]) != E:
        raise ValueError(f"k's last axis (E={k.shape[-1]}) must equal q's (E={E})")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q's head axis 1 (Hq={Hq}) must be a multiple of k's head axis {kv_ndim - 2} (Hkv={Hkv})")
    _index_array("cu_seqlens_q", cu_seqlens_q, ctx, "(B + 1,)", 1)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q must have shape (B + 1,), got {tuple(cu_seqlens_q.shape)}")
    B = int(cu_seqlens_q.shape[0]) - 1
    if cu_seqlens_k is None and not paged:
        raise ValueError("cu_seqlens_k is required without block_table")
    if cu_seqlens_k is not None:
        _index_array("cu_seqlens_k", cu_seqlens_k, ctx, f"(B + 1,) = ({B + 1},)", 1, B + 1)
    if seqused_k is not None:
        _index_array("seqused_k", seqused_k, ctx, f"(B,) = ({B},)", 1, B)
    elif paged:
        raise ValueError("block_table needs seqused_k, the keys cached per sequence")
    if paged:
        _index_array("block_table", block_table, ctx, f"(B, max_blocks) = ({B}, ...)", 2, B)
    max_seqlen_q = _int_arg("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _int_arg("max_seqlen_k", max_seqlen_k)
    var = _variants.check_variants(window_size, softcap, sinks, alibi_slopes, ctx=ctx, batch=B, num_heads=Hq,
                                   dtype=dtype, score_mod=score_mod, mask_mod=mask_mod, aux=aux)
    return VarlenProblem(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, B, total_q, Hq, Hkv, E, Ev,
                         max_seqlen_q, max_seqlen_k, np.dtype(dtype), 1.0 / math.sqrt(E) if scale is None else
                         float(scale), bool(is_causal), float(dropout_p), var, window_size, softcap, sinks,
                         alibi_slopes)


def fused_reason(vp: VarlenProblem, backend: str) -> str | None:
    """None when the packed kernel runs the call; else why not (the call then runs per sequence)."""
    from .kernels import flash_fwd_sm90 as fa3
    from ..runtime.kernel_abi import C_TYPE_16
    from ..runtime.tma import exp2_tma_reason
    if backend not in ("auto", "fused"):
        return f"backend={backend!r}"
    if not vp.ctx.on_gpu:
        return "CPU inputs: the float64 reference"
    if vp.dropout_p > 0:
        return "dropout: the packed kernel has none"
    if interop.dtype_name(vp.dtype) not in C_TYPE_16:
        return f"dtype {vp.dtype}: the packed kernel serves fp16 and bf16"
    if fa3.head_bucket(vp.head_dim, vp.head_dim_v) is None:
        return f"head dims E={vp.head_dim}, Ev={vp.head_dim_v}: the packed kernel serves 33-256"
    from .dispatch import device_arch
    arch = device_arch(vp)
    if arch != 90:
        return f"sm_{arch}: the packed kernel needs sm_90a"
    if vp.block_table is not None:
        why = fa3.paged_reason(int(vp.k.shape[1]), vp.head_dim, vp.head_dim_v)
        if why is not None:
            return why
    return exp2_tma_reason("the packed kernel", vp.scale)


def _bounds(vp: VarlenProblem):
    """What set_variant_params reads, with the bounds relative to each sequence's diagonal (L = S = 0 here: the
    kernel adds S_b − L_b per sequence)."""
    lo, hi = vp.variants.key_offsets(0, 0, "bottom_right" if vp.causal else None)
    bounded = vp.causal or vp.variants.window_right is not None
    return types.SimpleNamespace(key_upper=(bounded, hi if bounded else 0), window_lo=lo, scale=vp.scale,
                                 variants=vp.variants)


def _packed4(x):
    """(total, H, D) -> the (1, H, total, D) view the 4-D kernels read (BSHD, batch 1)."""
    return x[None].transpose(0, 2, 1, 3)


def _page_rows(ctx, cache):
    """A paged cache (num_blocks, page_size, H, D) as its rows (num_blocks · page_size, H, D): a view when pages and
    slots are evenly strided, else a contiguous copy."""
    nb, ps, h, d = cache.shape
    if cache.strides[0] != ps * cache.strides[1]:
        cache = ctx.contiguous(cache)
    return cache.reshape(nb * ps, h, d)


def run_fused(vp: VarlenProblem, call_key: tuple | None = None):
    """(out, lse) of the packed kernel as the caller's kind, or None when the arrays' layout does not suit TMA (the
    caller then runs per sequence). out (total_q, Hq, Ev), lse (Hq, total_q) float32. ``call_key``: keep the launch
    under it (:func:`cache_key`) when it read the caller's arrays in place."""
    from .kernels import flash_fwd_sm90 as fa3
    ctx = vp.ctx
    with ctx.activate():
        given = [ctx.as_cupy(x) for x in (vp.q, vp.k, vp.v)]
        q, k, v = (x if x.strides[-1] == x.itemsize else ctx.contiguous(x) for x in given)
        paging = {}
        if vp.block_table is not None:  # the caches' pages as rows: (num_blocks · page_size, Hkv, D)
            k, v = (_page_rows(ctx, x) for x in (k, v))
            paging = {"page_size": int(vp.k.shape[1]), "max_blocks": int(vp.block_table.shape[1])}
        cu_k = None if paging else vp.cu_seqlens_k  # paged: keys by page (the kernel ignores cu_seqlens_k there too)
        given_idx = [None if x is None else ctx.as_cupy(x)
                     for x in (vp.cu_seqlens_q, cu_k, vp.seqused_k, vp.block_table)]
        idx = [x if x is None or x.flags.c_contiguous else ctx.contiguous(x) for x in given_idx]
        out_native, out = ctx.empty((vp.total_q, vp.num_heads, vp.head_dim_v), vp.dtype)
        lse_native, lse = ctx.empty((vp.num_heads, vp.total_q), np.dtype(np.float32))
        q4, k4, v4, out4 = (_packed4(x) for x in (q, k, v, out))
        if fa3.layout_reason(q4, k4, v4, out4) is not None:
            return None
        launch = fa3.build_varlen(q4, k4, v4, out4, lse[None], bounds=_bounds(vp), batch=vp.batch,
                                  causal=vp.causal, mod=vp.variants.mod, **paging)
        run = launch.bind(ctx.stream)
        run(q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr, *(0 if x is None else x.data.ptr
                                                                              for x in idx))
        in_place = all(a is b for a, b in zip(given + given_idx, [q, k, v] + idx))
        if call_key is not None and in_place:
            callcache.put(call_key, VarlenEntry(ctx, tuple(out_native.shape), tuple(lse_native.shape), run))
    return out_native, lse_native


def cache_key(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, flags: tuple) -> tuple | None:
    """The call cache's key of a varlen call (runtime/callcache.py): the six arrays' signatures (shape, strides,
    dtype, device, address mod 16; the stream) and the flags with their types, or None when the call is not
    cacheable (arrays that are not exact torch CUDA tensors or CuPy arrays). The sizes are keyed through the shapes
    (total_q, total_k, B): the tensor maps hold them. max_seqlen_q/k are not: the packed kernel does not read them."""
    sig = callcache.signatures((q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k))
    if sig is None:
        return None
    return ("varlen", *sig, callcache.typed(*flags), callcache.env_values())


class VarlenEntry(callcache.Entry):
    """A prepared packed-kernel call replayed on new arrays: allocates out and lse and launches (no checks, no
    plan)."""

    __slots__ = ()

    def _replay(self, q, k, v, idx):
        if self.ctx.kind == interop.TORCH:
            out = q.new_empty(self.out_shape)
            lse = q.new_empty(self.lse_shape, dtype=sys.modules["torch"].float32)
            self.run(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                     *(0 if x is None else x.data_ptr() for x in idx))
        else:
            import cupy
            with self.ctx.stream:
                out = cupy.empty(self.out_shape, dtype=q.dtype)
                lse = cupy.empty(self.lse_shape, dtype=cupy.float32)
            self.run(q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr,
                     *(0 if x is None else x.data.ptr for x in idx))
        return out, lse


def host_sequences(vp: VarlenProblem) -> list[tuple[int, int, int, int]]:
    """reference.varlen_sequences of the call's index arrays, read to the host (waits for the device), checked: every
    sequence inside q's and k's rows (or the block table's pages), none overlapping the one before."""
    def host(x):
        if x is None:
            return None
        if interop.is_torch_tensor(x):
            return x.detach().cpu().numpy()
        return interop.to_numpy(x, vp.ctx.kind)
    seqs = reference.varlen_sequences(host(vp.cu_seqlens_q), host(vp.cu_seqlens_k), host(vp.seqused_k))
    total_k = int(vp.k.shape[0])
    pages = None if vp.block_table is None else int(vp.block_table.shape[1]) * int(vp.k.shape[1])
    table = None if vp.block_table is None else host(vp.block_table)
    end_q = end_k = 0
    for b, (q0, L, k0, S) in enumerate(seqs):
        if L < 0 or q0 < end_q or q0 + L > vp.total_q:
            raise ValueError(f"cu_seqlens_q: sequence {b} (rows {q0} ... {q0 + L - 1}) must follow the one before "
                             f"and lie within q's axis 0 ({vp.total_q} rows)")
        if L > vp.max_seqlen_q:
            raise ValueError(f"max_seqlen_q ({vp.max_seqlen_q}) is below sequence {b}'s length {L}")
        if S < 0 or (pages is None and (k0 < end_k or k0 + S > total_k)) or (pages is not None and S > pages):
            where = f"k's axis 0 ({total_k} rows)" if pages is None else f"its block table row ({pages} slots)"
            raise ValueError(f"cu_seqlens_k / seqused_k: sequence {b}'s keys ({k0} ... {k0 + S - 1}) must follow "
                             f"the one before and lie within {where}")
        if S > vp.max_seqlen_k:
            raise ValueError(f"max_seqlen_k ({vp.max_seqlen_k}) is below sequence {b}'s key count {S}")
        if pages is not None and S > 0:
            used = table[b, :-(-S // int(vp.k.shape[1]))]
            if used.min() < 0 or used.max() >= int(vp.k.shape[0]):
                raise ValueError(f"block_table: sequence {b}'s pages {used.tolist()} must lie in 0 ... "
                                 f"{int(vp.k.shape[0]) - 1} (k's axis 0, num_blocks)")
        end_q, end_k = q0 + L, (k0 + S if pages is None else 0)
    return seqs


def _sequence_kv(vp: VarlenProblem, b: int, k0: int, S: int):
    """Sequence b's keys and values as (1, Hkv, S, E | Ev) views (contiguous rows), gathered from the pages of its
    block table row when the cache is paged."""
    k, v = vp.k, vp.v
    if vp.block_table is None:
        kb, vb = k[k0:k0 + S], v[k0:k0 + S]
    else:
        bs = int(k.shape[1])
        n = -(-S // bs)
        rows = vp.block_table[b][:n]
        kb = k[rows].reshape((n * bs,) + tuple(k.shape[2:]))[:S]
        vb = v[rows].reshape((n * bs,) + tuple(v.shape[2:]))[:S]
    return _heads_first(kb), _heads_first(vb)


def _heads_first(x):
    """(rows, H, D) -> (1, H, rows, D), a view for every kind."""
    if interop.is_torch_tensor(x):
        return x.transpose(0, 1).unsqueeze(0)
    return x.swapaxes(0, 1)[None]


def run_sequences(vp: VarlenProblem, *, backend, num_splits, generator, seqs=None):
    """(out, lse) by one scaled_dot_product_attention call per sequence on views of q, k and v (bottom-right causal
    mask and window, the sequence's ALiBi slopes), assembled in the caller's kind: rows no sequence covers are 0 in
    out and −inf in lse. torch tensors stay in autograd's graph (slices and torch.cat)."""
    from .sdpa import scaled_dot_product_attention
    seqs = host_sequences(vp) if seqs is None else seqs
    slopes = vp.alibi_slopes
    outs, lses = [], []
    for b, (q0, L, k0, S) in enumerate(seqs):
        if L == 0:
            continue
        kb, vb = _sequence_kv(vp, b, k0, S)
        sl = None if slopes is None else (slopes[b] if len(slopes.shape) == 2 else slopes)
        o, l = scaled_dot_product_attention(
            _heads_first(vp.q[q0:q0 + L]), kb, vb, dropout_p=vp.dropout_p, is_causal="bottom_right" if vp.causal
            else False, scale=vp.scale, enable_gqa=True, window_size=vp.window_size, softcap=vp.softcap,
            sinks=vp.sinks, alibi_slopes=sl, backend=backend, return_lse=True, num_splits=num_splits,
            generator=generator)
        outs.append((q0, L, o[0], l[0]))
    return _assemble(vp, outs)


def _assemble(vp: VarlenProblem, pieces):
    """out (total_q, Hq, Ev) and lse (Hq, total_q) from per-sequence (q0, L, out (Hq, L, Ev), lse (Hq, L)) pieces."""
    Hq, Ev, total = vp.num_heads, vp.head_dim_v, vp.total_q
    if interop.is_torch_tensor(vp.q):
        torch = sys.modules["torch"]
        dev = vp.q.device
        o_parts, l_parts, cursor = [], [], 0
        for q0, L, o, l in pieces:
            if q0 > cursor:
                o_parts.append(torch.zeros((q0 - cursor, Hq, Ev), dtype=vp.q.dtype, device=dev))
                l_parts.append(torch.full((Hq, q0 - cursor), -math.inf, dtype=torch.float32, device=dev))
            o_parts.append(o.transpose(0, 1))
            l_parts.append(l.float())
            cursor = q0 + L
        o_parts.append(torch.zeros((total - cursor, Hq, Ev), dtype=vp.q.dtype, device=dev))
        l_parts.append(torch.full((Hq, total - cursor), -math.inf, dtype=torch.float32, device=dev))
        return torch.cat(o_parts, 0), torch.cat(l_parts, 1)
    if vp.ctx.on_gpu:
        import cupy as xp
        ctx = vp.ctx
        with ctx.activate():
            out = xp.zeros((total, Hq, Ev), dtype=vp.dtype)
            lse = xp.full((Hq, total), -np.inf, dtype=np.float32)
            for q0, L, o, l in pieces:
                out[q0:q0 + L] = ctx.as_cupy(o).swapaxes(0, 1)
                lse[:, q0:q0 + L] = ctx.as_cupy(l)
        return out, lse
    out = np.zeros((total, Hq, Ev), dtype=vp.dtype)
    lse = np.full((Hq, total), -np.inf, dtype=np.float32)
    for q0, L, o, l in pieces:
        out[q0:q0 + L] = np.swapaxes(o, 0, 1)
        lse[:, q0:q0 + L] = l
    return out, lse


def backward_sequences(vp: VarlenProblem, out, lse, grad_out, sinks):
    """dq, dk, dv (and dsinks, float32 summed then in the sinks' dtype, or None) of a packed call (torch tensors, no
    block table) from its saved out and lse: per sequence, the dense backward (autograd.grad_inputs) on views,
    scattered into packed gradients (rows of no sequence: 0); CPU tensors: the float64 reference backward."""
    from . import autograd
    torch = sys.modules["torch"]
    seqs = host_sequences(vp)
    if kernel_backward_default(vp) and kernel_backward_reason(vp) is None:
        return backward_kernel(vp, seqs, out, lse, grad_out, sinks)
    if bucketable(vp, seqs):
        return backward_buckets(vp, seqs, out, lse, grad_out, sinks)
    if not vp.ctx.on_gpu:
        return _backward_recompute(vp, out, lse, grad_out, sinks)
    q, k, v = vp.q, vp.k, vp.v
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float32, device=sinks.device)
    slopes = vp.alibi_slopes
    for b, (q0, L, k0, S) in enumerate(seqs):
        if L == 0 or S == 0:
            continue
        rows = slice(q0, q0 + L)
        o_b, go_b = _heads_first(out[rows]), _heads_first(grad_out[rows])
        lse_b = lse[:, rows].contiguous().unsqueeze(0)
        sl = None if slopes is None else (slopes[b] if slopes.dim() == 2 else slopes)
        dq_b, dk_b, dv_b, _ = autograd.grad_inputs(
            _heads_first(q[rows]), _heads_first(k[k0:k0 + S]), _heads_first(v[k0:k0 + S]), None, o_b, lse_b, go_b,
            is_causal="bottom_right" if vp.causal else False, scale=vp.scale, enable_gqa=True, need_mask_grad=False,
            variants=(vp.window_size, vp.softcap, sinks, sl))
        dq[rows] = dq_b[0].transpose(0, 1)
        dk[k0:k0 + S] += dk_b[0].transpose(0, 1)
        dv[k0:k0 + S] += dv_b[0].transpose(0, 1)
        if sinks is not None:
            dsinks += autograd.sinks_grad(sinks.float(), o_b, lse_b, go_b)
    return dq, dk, dv, None if dsinks is None else dsinks.to(sinks.dtype)


def kernel_backward_default(vp: VarlenProblem) -> bool:
    """Whether the packed Hopper backward is asked for: CUPY_ATTN_VARLEN_BWD=kernel always, =dense never; unset for
    calls without a window, softcap or ALiBi (causal or not, GQA, sinks, cross lengths: what its GPU tests cover).
    H200, the issue's 12 causal sequences (25,701 tokens, 32/8 heads, hd128, bf16): forward + backward 5.95 ms
    against 9.33 ms on the dense backward's padded buckets (bench/RESULTS.md)."""
    choice = env.get("CUPY_ATTN_VARLEN_BWD")
    if choice in ("kernel", "dense"):
        return choice == "kernel"
    var = vp.variants
    return not (var.has_window or var.softcap is not None or var.alibi_slopes is not None)


def kernel_backward_reason(vp: VarlenProblem) -> str | None:
    """None when the packed Hopper backward (flash_bwd_sm90's kVarlen instantiations) can run this call's backward:
    on the GPU, the Hopper backward's dtypes and head dims, no block table, no seqused_k (its gaps between sequences
    are read, masked, by whole key blocks: 0 × a NaN there would reach dQ), head dims whose contiguous rows TMA reads
    (multiples of 8), B within the grid's 65535; else why not."""
    from .dispatch import device_arch
    from .kernels import flash_bwd_sm90 as bwd
    if not vp.ctx.on_gpu or vp.block_table is not None or vp.dropout_p > 0 or vp.seqused_k is not None:
        return "CPU inputs, a block table, seqused_k or dropout"
    if min(vp.batch, vp.total_q, int(vp.k.shape[0])) == 0:
        return "empty"
    if vp.batch > 65535:
        return "grid limit: batch must be <= 65535"
    why = bwd.unsupported_reason(vp.dtype, vp.head_dim, vp.head_dim_v, False, device_arch(vp))
    if why is None and (vp.head_dim % 8 or vp.head_dim_v % 8):
        why = f"head dims E={vp.head_dim}, Ev={vp.head_dim_v}: TMA reads contiguous rows of multiples of 8 elements"
    return why


def backward_kernel(vp: VarlenProblem, seqs, out, lse, grad_out, sinks):
    """backward_sequences by the packed Hopper backward (kernel_backward_default: the default without a window,
    softcap or ALiBi; CUPY_ATTN_VARLEN_BWD=kernel always): one launch for every sequence
    (kernels/flash_bwd_sm90.Sm90VarlenBackward) on contiguous copies where the arrays are not, dK and dV zeroed first
    (rows no sequence covers stay 0). The tensor maps end at the last sequence's last row and key, so the rows after
    them (out and dO unwritten there, q and k whatever the caller left) arrive as TMA's zeros. dsinks from the covered
    rows."""
    from . import autograd
    from .kernels import flash_bwd_sm90 as bwd
    torch = sys.modules["torch"]
    ctx = vp.ctx
    end_q = max((q0 + L for q0, L, _, _ in seqs), default=0)
    end_k = max((k0 + S for _, _, k0, S in seqs), default=0)
    q, k, v, out, lse, grad_out = (x.contiguous() for x in (vp.q, vp.k, vp.v, out, lse, grad_out))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if end_q and end_k:
        idx = [x.contiguous() for x in (vp.cu_seqlens_q, vp.cu_seqlens_k)]
        with ctx.activate():
            views = [ctx.as_cupy(x) for x in (q[:end_q], k[:end_k], v[:end_k])]
            run = bwd.Sm90VarlenBackward(ctx, *views, bounds=_bounds(vp), batch=vp.batch,
                                         max_seqlen_k=max(S for _, _, _, S in seqs),
                                         cu_seqlens_q=idx[0].data_ptr(), cu_seqlens_k=idx[1].data_ptr())
            lse_rows = lse[:, :end_q].contiguous()  # (Hq, end_q): the pre-pass's row pitch is end_q
            run(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse_rows.data_ptr(), grad_out.data_ptr(),
                dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
    dsinks = None
    if sinks is not None:
        rows = [torch.arange(q0, q0 + L) for q0, L, _, S in seqs if L and S]
        dsinks = torch.zeros(sinks.shape, dtype=torch.float32, device=sinks.device)
        if rows:
            r = torch.cat(rows).to(q.device)
            dsinks = autograd.sinks_grad(sinks.float(), _heads_first(out.index_select(0, r)).float(),
                                         lse.index_select(1, r).unsqueeze(0),
                                         _heads_first(grad_out.index_select(0, r)).float())
        dsinks = dsinks.to(sinks.dtype)
    return dq, dk, dv, dsinks


def bucketable(vp: VarlenProblem, seqs) -> bool:
    """Whether the backward may run on padded dense batches (:func:`backward_buckets`): causal self-attention
    sequences (each L_b = S_b), whose rows past a sequence's end in a padded batch see only rows before them."""
    return vp.causal and vp.block_table is None and all(L == S for _, L, _, S in seqs)


def buckets(seqs, floor: int = 128) -> list[list[int]]:
    """The sequences (indices into ``seqs``, those with L > 0) grouped by the power of two at or above their length
    (``floor`` at least), longest group first: each group is one padded dense backward of its longest length, so a
    sequence pays at most 2× its own work in padding and a call of B sequences makes at most log2(max L) launches.

    >>> buckets([(0, 256, 0, 256), (256, 4096, 256, 4096), (4352, 0, 4352, 0), (4352, 3000, 4352, 3000),
    ...          (7352, 100, 7352, 100)])
    [[1, 3], [0], [4]]
    """
    groups: dict[int, list[int]] = {}
    for b, (_, L, _, _) in enumerate(seqs):
        if L > 0:
            groups.setdefault(max(floor, 1 << (L - 1).bit_length()), []).append(b)
    return [groups[size] for size in sorted(groups, reverse=True)]


def backward_buckets(vp: VarlenProblem, seqs, out, lse, grad_out, sinks):
    """backward_sequences for causal self-attention (:func:`bucketable`): per bucket of similar lengths
    (:func:`buckets`), the sequences right-padded into one dense batch (nb, H, L_pad, D) with the top-left causal
    mask (with L = S it is each sequence's own), and one dense backward. A padded row sees real keys, but its dO is
    0 and its lse +inf, so P = 0 there and dS = P ∘ (dP − D) = 0: it adds nothing to dK and dV, and its dQ is
    dropped. GPU: autograd.grad_inputs (our Hopper / mma.sync backward); CPU: the float64 reference backward."""
    torch = sys.modules["torch"]
    from . import autograd
    q, k, v = vp.q, vp.k, vp.v
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float32, device=sinks.device)
    slopes = vp.alibi_slopes
    for group in buckets(seqs):
        Lp, nb = max(seqs[b][1] for b in group), len(group)

        def pad(x, starts, fill=0.0):
            """(nb, H, Lp, D) of each sequence's rows of the packed x (total, H, D), right-padded with fill."""
            y = x.new_full((nb, Lp) + tuple(x.shape[1:]), fill)
            for i, b in enumerate(group):
                y[i, :seqs[b][1]] = x[starts[b]:starts[b] + seqs[b][1]]
            return y.transpose(1, 2)
        qs = [s[0] for s in seqs]
        ks = [s[2] for s in seqs]
        qp, op, gp = pad(q, qs), pad(out, qs), pad(grad_out, qs)
        kp, vp_ = pad(k, ks), pad(v, ks)
        lp = pad(lse.transpose(0, 1).unsqueeze(-1), qs, math.inf)[..., 0].contiguous()  # (nb, Hq, Lp), +inf pads
        sl = None if slopes is None else (slopes[group] if slopes.dim() == 2 else slopes)
        if vp.ctx.on_gpu:
            g = autograd.grad_inputs(qp, kp, vp_, None, op, lp, gp.contiguous(), is_causal="top_left",
                                     scale=vp.scale, enable_gqa=True, need_mask_grad=False,
                                     variants=(vp.window_size, vp.softcap, sinks, sl))[:3]
        else:
            as64 = (lambda x: x.detach().double().numpy())
            g = reference.scaled_dot_product_attention_backward(
                *(as64(x) for x in (qp, kp, vp_, op, lp, gp)), "top_left", vp.scale, True,
                window_size=vp.window_size, softcap=vp.softcap, sinks=None if sinks is None else as64(sinks),
                alibi_slopes=None if sl is None else as64(sl))[:3]
            g = [torch.from_numpy(x) for x in g]
        for i, b in enumerate(group):
            q0, L, k0, S = seqs[b]
            dq[q0:q0 + L] = g[0][i, :, :L].transpose(0, 1).to(dq.dtype)
            dk[k0:k0 + S] += g[1][i, :, :S].transpose(0, 1).to(dk.dtype)
            dv[k0:k0 + S] += g[2][i, :, :S].transpose(0, 1).to(dv.dtype)
        if sinks is not None:
            dsinks += autograd.sinks_grad(sinks.float(), op.float(), lp, gp.float())
    return dq, dk, dv, None if dsinks is None else dsinks.to(sinks.dtype)


def _backward_recompute(vp: VarlenProblem, out, lse, grad_out, sinks):
    """backward_sequences for CPU tensors: reference.scaled_dot_product_attention_backward per sequence (float64)."""
    torch = sys.modules["torch"]
    as64 = (lambda x: x.detach().double().numpy())
    q, k, v, o, do, lse64 = (as64(x) for x in (vp.q, vp.k, vp.v, out, grad_out, lse))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dsinks = None if sinks is None else np.zeros(tuple(sinks.shape))
    slopes = None if vp.alibi_slopes is None else as64(vp.alibi_slopes)
    sk = None if sinks is None else as64(sinks)
    for b, (q0, L, k0, S) in enumerate(host_sequences(vp)):
        if L == 0 or S == 0:  # rows without keys: out 0, so no gradient reaches anything (nor the sinks)
            continue
        rows, keys = slice(q0, q0 + L), slice(k0, k0 + S)
        sl = None if slopes is None else (slopes[b] if slopes.ndim == 2 else slopes)
        g = reference.scaled_dot_product_attention_backward(
            *(x[rows].swapaxes(0, 1) for x in (q,)), k[keys].swapaxes(0, 1), v[keys].swapaxes(0, 1),
            o[rows].swapaxes(0, 1), lse64[:, rows], do[rows].swapaxes(0, 1), "bottom_right" if vp.causal else False,
            vp.scale, True, window_size=vp.window_size, softcap=vp.softcap, sinks=sk, alibi_slopes=sl)
        dq[rows] = g[0].swapaxes(0, 1)
        dk[keys] += g[1].swapaxes(0, 1)
        dv[keys] += g[2].swapaxes(0, 1)
        if dsinks is not None:
            dsinks += g[3]
    back = (lambda a, like: torch.from_numpy(a).to(like.dtype))
    return (back(dq, vp.q), back(dk, vp.k), back(dv, vp.v), None if sinks is None else back(dsinks, sinks))


@functools.cache
def _function():
    """The torch.autograd.Function of packed-kernel calls, built on first use (cupy_attn never imports torch itself):
    the forward is the packed kernel, the backward the dense one per sequence."""
    torch = sys.modules["torch"]

    class VarlenAttention(torch.autograd.Function):
        @staticmethod
        def forward(fctx, q, k, v, sinks, vp):
            res = run_fused(dataclasses.replace(vp, q=q.detach(), k=k.detach(), v=v.detach(),
                                                sinks=None if sinks is None else sinks.detach()))
            out, lse = res
            fctx.save_for_backward(q, k, v, sinks, out, lse)
            fctx.vp = vp
            fctx.mark_non_differentiable(lse)
            fctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(fctx, grad_out, _grad_lse):
            if grad_out is None:
                return None, None, None, None, None
            q, k, v, sinks, out, lse = fctx.saved_tensors
            vp = dataclasses.replace(fctx.vp, q=q.detach(), k=k.detach(), v=v.detach())
            dq, dk, dv, dsinks = backward_sequences(vp, out, lse, grad_out.contiguous(),
                                                     None if sinks is None else sinks.detach())
            return dq, dk, dv, dsinks if sinks is not None and fctx.needs_input_grad[3] else None, None

    return VarlenAttention


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_k=None,
                     block_table=None, is_causal=False, scale=None, window_size=None, softcap=None, sinks=None,
                     alibi_slopes=None, dropout_p=0.0, return_lse=False, num_splits=None, backend="auto",
                     generator=None, causal=None, softmax_scale=None, score_mod=None, mask_mod=None, aux=None):
    """Attention over a packed batch of B sequences (FlashAttention's ``flash_attn_varlen_func``): sequence b's
    queries attend to its own keys only,

        out[i] = Σ_j exp(s_ij) v[j] / (Σ_j exp(s_ij) + exp(sink_h)),   lse[h, i] = log(Σ_j exp(s_ij) + exp(sink_h)),

    for i in rows cu_seqlens_q[b] ... cu_seqlens_q[b+1] − 1 and j in keys cu_seqlens_k[b] ... + S_b − 1, with s_ij
    as in :func:`scaled_dot_product_attention` (scale, softcap, ALiBi) and the sink term only with ``sinks``. Causal
    masks and windows are bottom-right aligned per sequence (FlashAttention's): with L_b queries and S_b keys, query
    row r (0-based in its sequence) sees keys c with r + S_b − L_b − left ≤ c ≤ r + S_b − L_b (+ right).

    Arguments (FlashAttention's names; ``causal`` and ``softmax_scale`` are accepted for is_causal and scale):
    - q (total_q, Hq, E); k (total_k, Hkv, E), v (total_k, Hkv, Ev): float16, bfloat16 or float32, one dtype; Hq a
      multiple of Hkv (GQA: query head h reads key/value head h // (Hq // Hkv)).
    - cu_seqlens_q, cu_seqlens_k: (B + 1,) int32 on q's device, non-decreasing offsets of each sequence's first row
      (cu_seqlens_q[B] ≤ total_q); S_b = cu_seqlens_k[b+1] − cu_seqlens_k[b], or seqused_k[b] (B,) int32 when given.
    - max_seqlen_q, max_seqlen_k: ints ≥ the longest sequence's L_b and S_b (FlashAttention's arguments; the packed
      kernel finds each sequence's size on the device and does not read them, the per-sequence path checks them).
    - block_table (B, max_blocks) int32 with k, v paged caches (num_blocks, block_size, Hkv, E | Ev) and seqused_k:
      sequence b's key j is slot j % block_size of page block_table[b, j // block_size] (cu_seqlens_k may be None).
    - is_causal, window_size, softcap, sinks (Hq,), alibi_slopes (Hq,) or (B, Hq): as the dense call's, aligned as
      above. dropout_p, generator, num_splits: as the dense call's.
    - backend: "auto" (the packed kernel where it runs the call, else per sequence), "fused" (the packed kernel or a
      ValueError saying why not), "split" / "reference" (per sequence on that dense path).
    - return_lse: also return lse (Hq, total_q) float32 (natural log).
    - score_mod, mask_mod, aux: as the dense call's (cupy_attn.AttentionMod), with b the sequence index and q_idx,
      kv_idx counted within the sequence. GPU calls need the packed kernel (NotImplementedError otherwise, and for
      calls that record grad); CPU calls run the mod's Python forms in the float64 reference.

    Returns out (total_q, Hq, Ev) in q's dtype and kind (or (out, lse)). Rows no sequence covers (before
    cu_seqlens_q[0], past cu_seqlens_q[B]) are not attended: the packed kernel leaves them unwritten, the per-sequence
    path writes out 0 and lse −inf there. The packed kernel does not check the index arrays (it clamps each sequence
    to q's and k's rows); the per-sequence path reads them on the host and checks them.
    Sequences with L_b = 0 write nothing; S_b = 0 gives out 0 and lse −inf (the sink with sinks).

    Paths: on Hopper, fp16/bf16 calls at head dims 33-256 without dropout run one launch of the
    FlashAttention-3-design forward whose tiles read their sequence's offsets on the device (Shah et al. 2024; varlen
    as FlashAttention's), persistent CTAs walking the sequences' tiles. With a block table its producer reads each
    key block from its pages (block_size a multiple of 8 that divides, or is a multiple of, the kernel's 64- or
    128-key block: 16, 32, 64, 128, 256 all are; page ids are not checked there, and an id outside the cache reads
    zeros). Every other call runs one dense call per sequence on views (the pages gathered for a block table, and
    checked). torch tensors that require grad are differentiated:
    the packed forward's backward runs the dense backward from the saved out and lse, on padded buckets of similar
    lengths for causal self-attention (:func:`backward_buckets`), else per sequence; the per-sequence path through
    autograd of its dense calls. Under torch.compile / torch.export the call is one custom op,
    ``torch.ops.cupy_attn.varlen_attention`` (no graph break; its backward, the per-sequence one, a second op; no
    dropout there, and no backward through a block table).

    Raises before anything is launched: TypeError for dtypes (q's float types; int32 index arrays), arrays of another
    kind than q, and a non-numeric scale or softcap; ValueError naming the argument and axis for shapes (q 3-D, k/v
    3-D or 4-D with block_table, heads), index arrays of the wrong length, block_table without seqused_k, negative
    max_seqlen, dropout_p outside [0, 1], a top-left is_causal, window/sinks/ALiBi errors as the dense call's, and
    backend="fused" for a call the packed kernel cannot run. The per-sequence path reads the index arrays on the host
    and raises ValueError for sequences that overlap or overrun q, k, max_seqlen_q or max_seqlen_k.
    """
    is_causal = checks.alias(is_causal, causal, "is_causal", "causal")
    scale = checks.alias(scale, softmax_scale, "scale", "softmax_scale")
    mods_given = score_mod is not None or mask_mod is not None or aux is not None
    if interop.torch_compiling() or interop.is_tracing_tensor(q):  # one opaque op for Dynamo / AOTAutograd
        from .. import torch_ops
        if mods_given:
            raise NotImplementedError("score_mod / mask_mod calls cannot be traced by torch.compile yet")
        if num_splits is not None or generator is not None:
            raise ValueError("num_splits and generator are not taken under torch.compile / torch.export")
        return torch_ops.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          seqused_k=seqused_k, block_table=block_table, is_causal=is_causal,
                                          scale=scale, window_size=window_size, softcap=softcap, sinks=sinks,
                                          alibi_slopes=alibi_slopes, dropout_p=dropout_p, return_lse=return_lse,
                                          backend=backend)
    if type(window_size) is list:
        window_size = tuple(window_size)
    checks.check_num_splits(num_splits)
    # A repeated call of the same layout and flags (sizes: through the shapes) replays its launch; max_seqlen_q/k only
    # need to be ints. Calls with dropout, a block table, sinks, ALiBi slopes or a generator are not cached, nor are
    # calls that autograd records.
    call_key = None
    if type(dropout_p) in (int, float) and dropout_p == 0 and block_table is None and sinks is None \
            and not mods_given and alibi_slopes is None and generator is None and type(max_seqlen_q) is int \
            and type(max_seqlen_k) is int and not _records_grad(q, k, v):
        call_key = cache_key(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                             (is_causal, scale, window_size, softcap, backend, num_splits))
        entry = None if call_key is None else callcache.get(call_key)
        if entry is not None and max_seqlen_q >= 0 and max_seqlen_k >= 0:
            out, lse = entry(q, k, v, (cu_seqlens_q, cu_seqlens_k, seqused_k, None))
            return (out, lse) if return_lse else out
    vp = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
                      block_table=block_table, is_causal=is_causal, scale=scale, dropout_p=dropout_p, backend=backend,
                      window_size=window_size, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes,
                      score_mod=score_mod, mask_mod=mask_mod, aux=aux)
    if vp.variants.mod is not None:
        out, lse = _run_mod(vp, backend, q, k, v, sinks)
        return (out, lse) if return_lse else out
    if vp.ctx.kind == interop.DLPACK:  # other CUDA objects: CuPy views from here on (results come back as CuPy)
        vp = dataclasses.replace(vp, **{f: vp.ctx.as_cupy(getattr(vp, f)) for f in (
            "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "sinks", "alibi_slopes")
            if getattr(vp, f) is not None})
    why = fused_reason(vp, backend)
    if why is None and min(vp.total_q, vp.num_heads, vp.head_dim_v, vp.batch, vp.max_seqlen_q) == 0:
        why = "empty"
    if why is None and int(vp.k.shape[0]) == 0:
        why = "no keys"
    res = None
    if why is None:
        if _records_grad(q, k, v, sinks):  # paged caches: per sequence (gathered pages, whose gradients flow back)
            res = _function().apply(q, k, v, sinks, vp) if vp.block_table is None and _layout_ok(vp) else None
        else:
            res = run_fused(vp, call_key)
    if res is None:
        if backend == "fused":
            raise ValueError(f"backend='fused': the packed kernel cannot run this call ({why or 'layout'})")
        res = run_sequences(vp, backend=backend, num_splits=num_splits, generator=generator)
    out, lse = res
    return (out, lse) if return_lse else out


def _run_mod(vp: VarlenProblem, backend: str, q, k, v, sinks):
    """(out, lse) of a call with score_mod / mask_mod: the packed kernel's mod instantiation on the GPU (flash_fwd_sm90
    mod_family, varlen; b = the sequence), the float64 reference with the mod's Python forms on the CPU (b likewise).
    NotImplementedError for GPU calls the packed kernel cannot run and for calls that record grad (no varlen mod
    backward yet)."""
    if _records_grad(q, k, v, sinks):
        raise NotImplementedError("varlen_attention with score_mod / mask_mod has no backward yet: call under "
                                  "torch.no_grad(), or use scaled_dot_product_attention per sequence")
    if not vp.ctx.on_gpu:
        return _reference_with_mods(vp)
    why = fused_reason(vp, backend)
    if why is None and min(vp.total_q, vp.num_heads, vp.head_dim_v, vp.batch) > 0 and int(vp.k.shape[0]) > 0:
        res = run_fused(vp)
        if res is not None:
            return res
        why = "the arrays' layout does not suit TMA"
    raise NotImplementedError(f"varlen_attention with score_mod / mask_mod runs on the packed kernel only, which "
                              f"cannot run this call ({why or 'an empty call'}); scaled_dot_product_attention per "
                              f"sequence takes the mod")


def _reference_with_mods(vp: VarlenProblem):
    """The CPU path of a mod call: reference.varlen_attention with the mod's Python forms, in the caller's kind."""
    from .. import reference
    from . import mods
    score, mask = mods.reference_forms(vp.variants.mod, lambda a: a)
    host = [interop.to_numpy(x, vp.ctx.kind) if x is not None else None
            for x in (vp.q, vp.k, vp.v, vp.cu_seqlens_q, vp.cu_seqlens_k, vp.seqused_k, vp.block_table)]
    out, lse = reference.varlen_attention(*host[:5], seqused_k=host[5], block_table=host[6], is_causal=vp.causal,
                                          scale=vp.scale, window_size=vp.window_size, softcap=vp.softcap,
                                          sinks=None if vp.sinks is None else interop.to_numpy(vp.sinks, vp.ctx.kind),
                                          alibi_slopes=None if vp.alibi_slopes is None else
                                          interop.to_numpy(vp.alibi_slopes, vp.ctx.kind), return_lse=True,
                                          score_mod=score, mask_mod=mask)
    return (interop.from_numpy(out, vp.ctx.kind, vp.dtype), interop.from_numpy(lse, vp.ctx.kind,
                                                                                np.dtype(np.float32)))


def _records_grad(*xs) -> bool:
    """Whether autograd records a call on these arrays (torch tensors that require grad, grad mode on)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.is_grad_enabled() and any(
        interop.is_torch_tensor(x) and x.requires_grad for x in xs)


def _layout_ok(vp: VarlenProblem) -> bool:
    """Whether q, k and v suit the packed kernel's tensor maps as they are (the autograd Function must not fall back
    inside its forward)."""
    from .kernels import flash_fwd_sm90 as fa3
    with vp.ctx.activate():
        q, k, v = (vp.ctx.as_cupy(x) for x in (vp.q, vp.k, vp.v))
        if any(x.strides[-1] != x.itemsize for x in (q, k, v)):
            return False
        return fa3.layout_reason(_packed4(q), _packed4(k), _packed4(v), None) is None


def explain(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_k=None, block_table=None,
            is_causal=False, scale=None, window_size=None, softcap=None, sinks=None, alibi_slopes=None,
            dropout_p=0.0, backend="auto", causal=None, softmax_scale=None):
    """The path :func:`varlen_attention` takes for these arguments, and why; nothing is launched and the index
    arrays are not read. Same arguments and errors. Returns a dispatch.Plan: ``backend`` "packed" (one launch of the
    packed kernel; ``details``: its head-dim bucket, tile, instantiation and grid) or "per-sequence" (``reason``:
    why the packed kernel does not run it); ``print(plan)`` gives a readable summary. The backward's path (padded
    buckets for causal self-attention, else per sequence) is decided from the index arrays' values, when it runs."""
    from . import dispatch
    if causal is not None:
        is_causal = causal if not is_causal else is_causal
    scale = softmax_scale if softmax_scale is not None else scale
    vp = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
                      block_table=block_table, is_causal=is_causal, scale=scale, dropout_p=dropout_p, backend=backend,
                      window_size=window_size, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes)
    why = fused_reason(vp, backend)
    if why is not None:
        return dispatch.Plan("per-sequence", f"the packed kernel does not run it: {why}",
                             describe=lambda: {"sequences": f"{vp.batch}, each a dense scaled_dot_product_attention "
                                                            "call on views"})

    def describe():
        from .kernels import flash_fwd_sm90 as fa3
        bucket = fa3.head_bucket(vp.head_dim, vp.head_dim_v)
        tile = fa3.VARLEN_TILES[bucket]
        return {"kernel": f"flash_fwd_sm90 (varlen, {'variants' if not vp.variants.plain else 'plain'})",
                "head-dim bucket": bucket, "tile": f"{tile.block_m} x {tile.block_n}, {tile.stages} stages",
                "grid": "one persistent CTA per SM, walking (sequence, head, m-block) units",
                "variants": ", ".join(vp.variants.names()) or "none"}
    return dispatch.Plan("packed", "fp16/bf16 at head dims 33-256 on Hopper: one launch for every sequence",
                         describe=describe)
