"""attention_with_kvcache: decode (and short prefills) against a KV cache, dense or paged, FlashAttention's
``flash_attn_with_kvcache`` layout and names.

    out[b, i] = Σ_j softmax_j(scale · q[b, i]·k_j) v_j over the cache's keys j < cache_seqlens[b] of sequence b
                (causal: j ≤ i + cache_seqlens[b] − L, the query rows being the last L positions)

The decode kernel (flash_decode.cu's flash_decode_paged: split-KV, GQA packing, each tile's rows from its page) runs
the calls it serves; every other call runs varlen_attention (the packed kernel or one dense call per sequence).
"""
from __future__ import annotations

import dataclasses
import math
import types

import numpy as np

from ..runtime import callcache, interop
from . import checks
from .kernels import flash_decode


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, *, causal=False, scale=None,
                           num_splits=None, return_lse=False, softmax_scale=None, seqused_k=None):
    """Attention of a few new query rows per sequence against each sequence's cached keys and values
    (FlashAttention's ``flash_attn_with_kvcache`` without appending to the cache):

        out[b, i] = Σ_{j < S_b} exp(s_bij) v_bj / Σ_{j < S_b} exp(s_bij),   s_bij = scale · q[b, i]·k_bj,
        S_b = cache_seqlens[b]; with causal, key j is visible to query i when j ≤ i + S_b − L (bottom-right: the
        L query rows are the sequence's last L positions).

    Arguments (FlashAttention's names; ``softmax_scale`` and ``seqused_k`` are accepted for scale and
    cache_seqlens):
    - q (B, L, Hq, E): float16 or bfloat16 (float32: the varlen path), CUDA (torch or CuPy), or CPU (the float64
      reference).
    - k_cache, v_cache: (B, S_max, Hkv, E | Ev) dense caches, or with ``block_table`` paged caches (num_blocks,
      page_size, Hkv, E | Ev); Hq a multiple of Hkv (GQA).
    - cache_seqlens (B,) int32: the keys cached per sequence (≤ S_max, or ≤ max_blocks · page_size).
    - block_table (B, max_blocks) int32: sequence b's key j is slot j % page_size of page block_table[b, j //
      page_size].
    - causal, scale (default 1/sqrt(E)), num_splits (the decode kernel's key splits; None: chosen), return_lse.

    Returns out (B, L, Hq, Ev) in q's dtype and kind, or (out, lse (B, Hq, L) float32).

    Paths: the decode kernel with paged reads (flash_decode_paged) for fp16/bf16 at head dims ≤ 256 with L·Hq/Hkv
    ≤ 64 on compute capability ≥ 8.0, when pages hold a multiple of 64 keys (a dense cache: S_max a multiple of 64,
    read as one page per sequence); with CUPY_ATTN_DECODE=2 on Hopper the TMA streaming kernel's paged instantiation
    (flash_decode_sm90_paged; the same device time measured); varlen_attention otherwise (q as B sequences of L rows).
    Rows of a sequence with S_b = 0 give 0 (lse −inf). A decode loop's calls (the same caches, cache_seqlens array,
    updated in place, and block_table; a new q) replay the first call's prepared launch: no checks, no plan. H200,
    64 sequences of 512-8192 keys, 32/8 heads, hd128, pages of 64: 0.296 ms of device time, 3.9 TB/s of K and V.

    Raises before anything is launched: TypeError for dtypes (int32 index arrays) and arrays of another kind than q;
    ValueError naming the argument and axis for shapes, a cache_seqlens or block_table of the wrong length, and both
    scale and softmax_scale (or cache_seqlens and seqused_k).
    """
    scale = checks.alias(scale, softmax_scale, "scale", "softmax_scale")
    cache_seqlens = checks.alias(cache_seqlens, seqused_k, "cache_seqlens", "seqused_k")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required: the keys cached per sequence")
    key = _call_key(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, num_splits)
    entry = None if key is None else callcache.get_holding(key)
    if entry is not None:  # the same layout, caches, lengths array and table ran before: replay (a decode loop)
        out = entry(q, k_cache, v_cache, None)
        return out if return_lse else out[0]
    ctx = interop.context_for(q, "q")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        interop.check_like_query(name, x, ctx, "q")
    if len(q.shape) != 4:
        raise ValueError(f"q must be (B, L, Hq, E), got shape {tuple(q.shape)}")
    B, L, Hq, E = (int(n) for n in q.shape)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be (B, S_max, Hkv, D) or, with block_table, (num_blocks, page_size, Hkv, "
                             f"D), got shape {tuple(x.shape)}")
    if tuple(k_cache.shape[:3]) != tuple(v_cache.shape[:3]):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree on every "
                         f"axis but the last")
    if int(k_cache.shape[3]) != E:
        raise ValueError(f"k_cache's last axis (E={k_cache.shape[3]}) must equal q's (E={E})")
    Hkv, Ev = int(k_cache.shape[2]), int(v_cache.shape[3])
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q's head axis 2 (Hq={Hq}) must be a multiple of the caches' axis 2 (Hkv={Hkv})")
    if block_table is None and int(k_cache.shape[0]) != B:
        raise ValueError(f"k_cache's axis 0 ({k_cache.shape[0]}) must be q's batch B={B} without block_table")
    for name, x, shape in (("cache_seqlens", cache_seqlens, (B,)),
                           ("block_table", block_table, None)):
        if x is None:
            continue
        interop.check_like_query(name, x, ctx, "q")
        if interop.dtype_of(x, interop.kind_of(x, name)) != np.dtype(np.int32):
            raise TypeError(f"{name} must be int32, got {interop.dtype_of(x, interop.kind_of(x, name))}")
        if shape is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape (B,) = ({B},), got {tuple(x.shape)}")
        if shape is None and (len(x.shape) != 2 or int(x.shape[0]) != B):
            raise ValueError(f"block_table must have shape (B, max_blocks) = ({B}, ...), got {tuple(x.shape)}")
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    checks.check_num_splits(num_splits)
    out = None
    if ctx.on_gpu:
        out = _decode(ctx, q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, num_splits)
    if out is not None:
        out, entry = out
        if key is not None and entry is not None:
            callcache.put_holding(key, entry)
    if out is None:
        out = _varlen(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale)
    return out if return_lse else out[0]


# Prepared decode calls (_call_key -> callcache.Entry) live in runtime.callcache's holding table (the launch keeps the
# lengths and table arrays). A decode loop calls with the same caches, lengths array and table (the lengths updated in
# place) and a new q each step: a hit skips the checks, the plan and the launch's construction.


def _call_key(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, num_splits) -> tuple | None:
    """The call cache's key: the five arrays' signatures (shape, strides, dtype, device, address mod 16; the stream),
    the addresses of the caches, lengths and table (the launch holds them), the flags with their types and the
    environment overrides; None when not cacheable (not all torch CUDA tensors or all CuPy arrays)."""
    sig = callcache.signatures((q, k_cache, v_cache, cache_seqlens, block_table))
    if sig is None:
        return None
    try:
        scale = None if scale is None else float(scale)
    except (TypeError, ValueError):
        return None  # the checks raise
    ptr = (lambda a: a.data_ptr()) if sig[0] == "torch" else (lambda a: a.data.ptr)  # noqa: E731
    return (sig, ptr(k_cache), ptr(v_cache), ptr(cache_seqlens), None if block_table is None else ptr(block_table),
            type(causal), causal, type(scale), scale, type(num_splits), num_splits, callcache.env_values())


def decode_reason(ctx, q, k_cache, v_cache, block_table) -> str | None:
    """None when flash_decode_paged runs the call (see attention_with_kvcache), else why not."""
    B, L, Hq, E = (int(n) for n in q.shape)
    Hkv, Ev = int(k_cache.shape[2]), int(v_cache.shape[3])
    if interop.dtype_name(interop.dtype_of(q, ctx.kind)) not in ("float16", "bfloat16"):
        return "dtype: the decode kernel serves fp16 and bf16"
    if flash_decode.head_dim_bucket(E, Ev) is None:
        return f"head dims E={E}, Ev={Ev}: the decode kernel serves up to 256"
    if L * (Hq // Hkv) > 64:
        return f"L·Hq/Hkv = {L * (Hq // Hkv)} query rows per KV head: more than the decode kernel's 64"
    page = int(k_cache.shape[1])
    if page % 64:
        return f"{'page size' if block_table is not None else 'S_max'} {page}: the decode kernel's tiles need a " \
               f"multiple of 64 keys"
    return None


def _decode(ctx, q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, num_splits):
    """((out (B, L, Hq, Ev), lse (B, Hq, L)), replay) by flash_decode_paged, or None when it does not run the call;
    replay (a callcache.Entry, or None when the launch holds a copy of the lengths or the table) runs it again on a
    new q."""
    if decode_reason(ctx, q, k_cache, v_cache, block_table) is not None:
        return None
    import cupy
    B, L, Hq, E = (int(n) for n in q.shape)
    nb, ps, Hkv, _ = (int(n) for n in k_cache.shape)
    Ev = int(v_cache.shape[3])
    with ctx.activate():
        arch = int(cupy.cuda.Device(ctx.device_id).compute_capability)
        if arch < 80:
            return None
        qc, kc, vc, used = (ctx.as_cupy(x) for x in (q, k_cache, v_cache, cache_seqlens))
        if block_table is None:  # a dense cache: one page of S_max keys per sequence
            table = cupy.arange(B, dtype=cupy.int32).reshape(B, 1)
        else:
            table = ctx.as_cupy(block_table)
        # The launch reads the caller's lengths and table in place unless they had to be copied (then not replayed).
        in_place = used.flags.c_contiguous and (block_table is None or table.flags.c_contiguous)
        table = table if table.flags.c_contiguous else cupy.ascontiguousarray(table)
        used = used if used.flags.c_contiguous else cupy.ascontiguousarray(used)
        max_blocks = int(table.shape[1])
        S_max = max_blocks * ps
        if any(x.strides[-1] != x.itemsize for x in (qc, kc, vc)):
            return None
        if any(c.strides[0] != c.shape[1] * c.strides[1] for c in (kc, vc)):  # pages (sequences) not evenly strided
            return None
        # The caches' rows as (B, Hkv, S_max, D) views with no batch stride: the kernel finds each tile's rows
        # through the table (k_stride_s: one slot, k_stride_h: one head), the views only carry base and strides.
        k4, v4 = (cupy.lib.stride_tricks.as_strided(c, (B, Hkv, S_max, c.shape[3]), (0, c.strides[2], c.strides[1],
                                                                                     c.itemsize)) for c in (kc, vc))
        q4 = qc.transpose(0, 2, 1, 3)
        out_native, out = ctx.empty((B, L, Hq, Ev), np.dtype(qc.dtype))
        lse_native, lse = ctx.empty((B, Hq, L), np.dtype(np.float32))
        out4 = out.transpose(0, 2, 1, 3)
        p = types.SimpleNamespace(query=q4, key=k4, value=v4, mask=None, dtype=np.dtype(qc.dtype), head_dim=E,
                                  head_dim_v=Ev, batch=B, num_heads=Hq, num_kv_heads=Hkv, groups=Hq // Hkv,
                                  seqlen_q=L, seqlen_k=S_max, causal="bottom_right" if causal else None,
                                  causal_offset=S_max - L, scale=scale, ctx=ctx)
        num_sms = interop.device_sms(ctx.device_id)
        # The streaming variant (TMA from each tile's page) where CUPY_ATTN_DECODE asks for it, sm_90 and the
        # bindings allow it and its key tile divides the pages; else flash_decode's paged instantiation.
        p.key = p.value = None  # the maps are the cache rows' (below), not these views'
        choice = flash_decode.choose(p, arch, num_sms, num_splits)
        p.key, p.value = k4, v4
        map_views = None
        if choice.family is flash_decode.FLASH_DECODE_SM90 and ps % choice.tile.block_n == 0:
            rows = kc.shape[0] * ps  # the whole cache as one sequence of rows: (1, Hkv, pages · page_size, D)
            map_views = tuple(cupy.lib.stride_tricks.as_strided(c, (1, Hkv, rows, c.shape[3]), (
                c.strides[0] * kc.shape[0], c.strides[2], c.strides[1], c.itemsize)) for c in (kc, vc))
            if flash_decode.stream_layout_reason(*map_views) is not None:
                map_views = None
        if map_views is not None:
            choice = dataclasses.replace(choice, family=flash_decode.FLASH_DECODE_SM90_PAGED)
        else:
            choice = flash_decode.choose(p, arch, num_sms, num_splits, variant="v1")
            if ps % choice.tile.block_n:  # the 8-warp tile's 128 keys: the 4-warp tile's 64 divide every page here
                choice = flash_decode.choose(p, arch, num_sms, num_splits, variant="v1", warps=4)
            choice = dataclasses.replace(choice, family=flash_decode.FLASH_DECODE_PAGED)
        launch = flash_decode.build(p, choice, out4, lse, fields={
            "seqused_k": used.data.ptr, "block_table": table.data.ptr, "max_blocks": max_blocks, "page_size": ps},
            map_views=map_views)
        launch.info["keep"] = (table, used)  # the launch reads them
        run = launch.bind(ctx.stream)
        run(q4.data.ptr, k4.data.ptr, v4.data.ptr, out4.data.ptr, lse.data.ptr, 0)
    # callcache's Entry replays it: out and lse from the caller's allocator, q, k and v (the caches' bases) by
    # address; the lengths and table stay the launch's.
    replay = callcache.Entry(ctx, (B, L, Hq, Ev), (B, Hq, L), run) if in_place else None
    return (out_native, lse_native), replay


def _varlen(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale):
    """The call as varlen_attention: B sequences of L query rows (q reshaped to (B·L, Hq, E)), the caches paged
    (block_table) or dense (B sequences of S_max rows, cache_seqlens of each used)."""
    from .varlen import varlen_attention
    ctx = interop.context_for(q, "q")
    B, L, Hq, E = (int(n) for n in q.shape)
    lib = _array_lib(ctx, q)
    cu_q = lib.arange(0, (B + 1) * L, L, dtype=lib.int32)
    if ctx.kind in (interop.TORCH, interop.TORCH_CPU):
        cu_q = cu_q.to(q.device)
    flat_q = q.reshape(B * L, Hq, E)
    if block_table is not None:
        out, lse = varlen_attention(flat_q, k_cache, v_cache, cu_q, None, L, int(block_table.shape[1]) *
                                    int(k_cache.shape[1]), seqused_k=cache_seqlens, block_table=block_table,
                                    is_causal=causal, scale=scale, return_lse=True)
    else:
        S_max = int(k_cache.shape[1])
        cu_k = lib.arange(0, (B + 1) * S_max, S_max, dtype=lib.int32)
        if ctx.kind in (interop.TORCH, interop.TORCH_CPU):
            cu_k = cu_k.to(q.device)
        out, lse = varlen_attention(flat_q, k_cache.reshape((B * S_max,) + tuple(k_cache.shape[2:])),
                                    v_cache.reshape((B * S_max,) + tuple(v_cache.shape[2:])), cu_q, cu_k, L, S_max,
                                    seqused_k=cache_seqlens, is_causal=causal, scale=scale, return_lse=True)
    Ev = int(v_cache.shape[3])
    return out.reshape(B, L, Hq, Ev), lse.reshape(Hq, B, L).transpose(1, 0, 2) if ctx.kind not in (
        interop.TORCH, interop.TORCH_CPU) else lse.reshape(Hq, B, L).permute(1, 0, 2)


def _array_lib(ctx, like):
    if ctx.kind in (interop.TORCH, interop.TORCH_CPU):
        import torch
        return torch
    if ctx.kind == interop.NUMPY:
        return np
    import cupy
    return cupy
