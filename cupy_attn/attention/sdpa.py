"""scaled_dot_product_attention and explain: the attention call path.

    interop (context_for) -> checks.check_sdpa -> dispatch.plan_sdpa -> Plan.prepare (kernels/, paths/) -> launch
    -> wrap

A repeated call with the same layout, flags and stream skips everything before the launch (runtime.callcache).
"""
from __future__ import annotations

import numpy as np

from .. import reference
from ..runtime import callcache, interop
from . import autograd, checks, dispatch, dropout


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, window_size=None, softcap=None, sinks=None, alibi_slopes=None,
                                 backend="auto", return_lse=False, allow_tf32=False, workspace_bytes=None,
                                 num_splits=None, generator=None):
    """softmax(scale · query keyᵀ + mask) · value, with the semantics of torch's scaled_dot_product_attention.

    Shapes: query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev); at least one axis before L/S (the
    head axis), equal leading axes; Ev may differ from E. Hkv == Hq unless ``enable_gqa``, where Hq must be a multiple
    of Hkv and query head h reads key/value head h // (Hq // Hkv) (K and V are not expanded in memory).
    dtypes: float16, bfloat16, float32, all three equal. float32 is computed at fp32 accuracy unless ``allow_tf32``
    (TF32 GEMMs, ~1e-3 relative): on sm_80+ the split path's GEMMs run 3xTF32 on tensor cores (CUTLASS's FastF32
    split, as torch's memory-efficient kernel, summed per 32-deep k-slice; CUPY_ATTN_FP32_GEMM=sgemm: cuBLAS SGEMM).
    attn_mask: bool (True = takes part) or float (added to the scaled scores), broadcastable to (..., Hq, L, S).
    is_causal: True / "top_left" — query i sees keys j ≤ i (torch's ``tril(ones(L, S))``); "bottom_right" — j ≤ i + S − L
    (FlashAttention's alignment, for KV caches). Not together with attn_mask.
    scale: multiplies the scores; default 1/sqrt(E).
    dropout_p in [0, 1]: torch's attention dropout, out = (P ∘ Z / (1 − dropout_p)) V with P the softmax and Z a keep
    mask of probability 1 − dropout_p (dropout_p = 1: out = 0); lse (return_lse) is that of the undropped scores. Z
    comes from Philox4x32-10 (Salmon et al. 2011) keyed by a (seed, offset) pair that each call draws from
    ``generator`` on the call's stream (cupy_attn/attention/dropout.py; cupy_attn.philox defines the mask in NumPy):
    torch tensors: a torch.Generator of the query's device or None (torch's default generator: torch.manual_seed
    reproduces calls; CUDA-graph replays draw new pairs, as torch's RNG ops do); CuPy / DLPack inputs: None (CuPy's
    global state, cupy.random.seed); NumPy: a numpy.random.Generator or None (np.random's global state). The
    backward applies the forward's mask (the pair is saved, not the mask). Dropout calls run the fused kernel's
    mma.sync dropout variant (never the FA3-design, wgmma or decode kernels) or the split path, and are not cached.
    Rows whose keys are all masked give output 0 (lse -inf), as torch's math backend; NaN/Inf inputs propagate.
    Empty inputs (B, H, L or Ev = 0, or S = 0) give torch's results (S = 0: out 0, lse -inf) and launch no kernel.

    Inputs: torch CUDA tensors and CuPy arrays (zero-copy through DLPack; results come back as the query's kind, on
    the caller's stream: torch's current stream for torch tensors, CuPy's current stream otherwise); other CUDA
    ``__dlpack__`` objects (results as CuPy arrays); NumPy arrays and CPU torch tensors run the float64 NumPy
    reference (slow; for checking). All arrays of one call must be of one kind (torch, NumPy, or CuPy / CUDA DLPack)
    and on one device. Inputs that require grad are recorded by autograd (torch tensors; the backward runs our
    kernels).
    Copies are made only when an input's last axis is not unit-stride or its leading axes have no common stride
    (``explain`` lists them); BSHD views (``x.view(B, S, H, D).transpose(1, 2)``) are read in place.

    backend: "auto" (``explain`` says what it picks; env CUPY_ATTN_BACKEND overrides it for GPU calls; CPU inputs
    always run the reference), "fused" (FlashAttention-2 kernel, Dao 2023; on Hopper, unmasked calls of at least 2^34
    FLOPs at head dims 33-256 run the FlashAttention-3-design kernel, Shah et al. 2024: TMA, a producer warpgroup,
    ping-pong and intra-warpgroup overlap, persistent, 192-row tiles of three consumer warpgroups for non-causal
    calls at head dim 64, CUPY_ATTN_FA3=0 turns it off, =2 forces the one-tile-per-CTA overlap variant, =3 the
    persistent one; the others
    use warpgroup MMAs, CUPY_ATTN_WGMMA=0 keeps mma.sync), "split" (cuBLAS Q·Kᵀ into an fp32 score buffer, our fused
    mask+softmax kernel, cuBLAS P·V; for float32 our 3xTF32 GEMM in place of cuBLAS; the buffer is processed in
    chunks of batch·heads under ``workspace_bytes``, default 1 GiB or CUPY_ATTN_WORKSPACE_BYTES; on Hopper,
    fp16/bf16 calls with S ≤ 512 and no attn_mask or one that varies only along the keys (key padding),
    causal or not, run one kernel for Q·Kᵀ and the softmax instead, writing P in the
    input dtype, in chunks of batches when P of all batch·heads exceeds the budget; CUPY_ATTN_SPLIT_FUSED=0 turns it
    off; after it, causal calls, and others where it is faster, multiply P·V on our own TMA + wgmma GEMM whose row
    blocks stop at their visible keys, CUPY_ATTN_SPLIT_PV=0 keeps cuBLAS), or
    "reference". "fused" and "split" need CUDA inputs.
    return_lse: also return lse (..., Hq, L) float32, the natural-log log-sum-exp of each row's masked scaled scores.
    num_splits: the decode (split-KV, Flash-Decoding) kernel's key splits. Under backend "auto", calls with few query
    rows (L ≤ 16, L·Hq/Hkv ≤ 64) and S ≥ 256 take that kernel with num_splits=None choosing the count from the
    SM count; a positive int sends any call the kernel supports (fp16/bf16, head dims ≤ 256; backend "auto" or
    "fused") to it with that many splits, at most one per key tile (64 keys). CUPY_ATTN_DECODE=0 turns it off;
    =2 (=3) runs its Hopper streaming variant (TMA into an mbarrier ring; one (two) CTAs per SM), opt-in for now.
    Repeated calls with torch CUDA tensors (or CuPy arrays) of the same layout, flags and stream replay the first
    call's prepared launch (checks and planning skipped: ~14-16 µs of host time instead of ~127 for a small fused
    call with torch tensors, where torch's own SDPA took 16-18 µs on the same hosts).
    torch.compile / torch.export (``fullgraph=True``, ``mode="reduce-overhead"``) and FakeTensor inputs: torch tensors
    go through the custom op ``torch.ops.cupy_attn.scaled_dot_product_attention`` (cupy_attn.torch_ops), one node in
    the graph, no graph break. Eager calls skip the op: its dispatch would add ~10 µs of host time per call.

    Returns: out (..., Hq, L, Ev) in the query's dtype and kind, contiguous; or (out, lse).
    Raises (all before anything is launched): TypeError for non-array inputs, unsupported dtypes, and arrays of
    another kind than query's (NumPy or CuPy next to torch); ValueError for shape, device, mask or flag errors (naming
    the argument and axis; dropout_p outside [0, 1]; num_splits with dropout_p > 0, the decode kernel having no
    dropout); TypeError for a generator of the wrong kind, ValueError for one of another device; ValueError when
    backend="fused" cannot run the call, and for backend="fused" or "split" with CPU inputs.
    """
    if type(window_size) is list:  # hashable for the call cache's key
        window_size = tuple(window_size)
    variants = (window_size, softcap, sinks, alibi_slopes)
    if interop.torch_compiling():  # Dynamo must see one opaque op, never the call cache's key (pointers, stream)
        return _via_torch_op(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
                             return_lse, allow_tf32, workspace_bytes, generator, variants)
    checks.check_num_splits(num_splits)  # before the cache key, which must hash it
    if autograd.needs_grad(query, key, value, attn_mask, sinks):  # torch tensors that autograd records
        if generator is None and type(dropout_p) in _PLAIN_NUMBERS and dropout_p == 0 and query.is_cuda:
            # No rng pair to draw and no CPU reference: the forward inside the Function checks the call (its call
            # cache skips that on a repeat), so it is not checked twice here.
            return autograd.apply(query, key, value, attn_mask, is_causal=is_causal, scale=scale,
                                  enable_gqa=enable_gqa, return_lse=return_lse, workspace_bytes=workspace_bytes,
                                  allow_tf32=allow_tf32, backend=backend, num_splits=num_splits, dropout_p=0.0,
                                  variants=variants)
        p = checks.check_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
                              generator, *variants)
        rng = dropout.draw(p.ctx, generator)[0] if p.dropout_p > 0 else None  # saved for the backward
        if not p.ctx.on_gpu:  # CPU tensors: the reference math in differentiable float64 torch ops
            return autograd.cpu_reference(query, key, value, attn_mask, is_causal=p.causal, scale=p.scale,
                                          enable_gqa=enable_gqa, return_lse=return_lse, dropout_p=p.dropout_p,
                                          rng=rng, variants=p.variants, sinks=sinks)
        return autograd.apply(query, key, value, attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                              return_lse=return_lse, workspace_bytes=workspace_bytes, allow_tf32=allow_tf32,
                              backend=backend, num_splits=num_splits, dropout_p=p.dropout_p, rng=rng,
                              variants=variants)
    # Dropout calls (and calls naming a generator) are never cached: each draws its own rng pair, which a replayed
    # launch would not. Calls with sinks or ALiBi slopes are not cached either: their launches hold those arrays'
    # addresses. The test is a few type checks on the hot path.
    if generator is None and type(dropout_p) in _PLAIN_NUMBERS and dropout_p == 0 and sinks is None \
            and alibi_slopes is None:
        call_key = callcache.key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
                                 return_lse, allow_tf32, workspace_bytes, num_splits, window_size, softcap)
    else:
        call_key = None
    if call_key is not None:
        entry = callcache.get(call_key)
        if entry is not None:  # the same layout, flags and stream ran before: replay its launch (see _callcache)
            return entry(query, key, value, attn_mask)
    elif interop.is_tracing_tensor(query):  # FakeTensor / FunctionalTensor (make_fx, AOTAutograd): no data to read
        return _via_torch_op(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
                             return_lse, allow_tf32, workspace_bytes, generator, variants)
    p = checks.check_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, generator,
                          *variants)
    if p.dropout_p > 0:
        _, p.rng = dropout.draw(p.ctx, generator)
    return _run(p, backend, num_splits, workspace_bytes, allow_tf32, return_lse, call_key, (query, key, value,
                                                                                            attn_mask))


_PLAIN_NUMBERS = (float, int)


def _run(p, backend, num_splits, workspace_bytes, allow_tf32, return_lse, call_key, inputs):
    """Plan and launch a checked problem (its rng pair drawn when dropout_p > 0); cache the launch under
    ``call_key`` (None: not cached) when it read the caller's ``inputs`` in place."""
    plan = dispatch.plan_sdpa(p, backend, num_splits=num_splits, workspace_bytes=workspace_bytes,
                              allow_tf32=allow_tf32)
    if plan.backend == "reference":
        return _run_reference(p, return_lse)
    if plan.backend == "empty":
        return _run_empty(p, return_lse)
    ctx = p.ctx
    B, H, L, Ev = p.batch, p.num_heads, p.seqlen_q, p.head_dim_v
    with ctx.activate():
        out_native, out = ctx.empty(p.batch_shape + (L, Ev), p.dtype)
        out4 = out.reshape(B, H, L, Ev)
        lse_native = lse3 = None
        if return_lse:
            lse_native, lse = ctx.empty(p.batch_shape + (L,), np.dtype(np.float32))
            lse3 = lse.reshape(B, H, L)
        run = plan.prepare(out4, lse3)
        run(p.query.data.ptr, p.key.data.ptr, p.value.data.ptr, out4.data.ptr,
            0 if lse3 is None else lse3.data.ptr, 0 if p.mask is None else p.mask.data.ptr)
        if call_key is not None and _replayable(p, *inputs):
            callcache.put(call_key, callcache.Entry(ctx, tuple(out_native.shape),
                                                      None if lse_native is None else tuple(lse_native.shape), run))
    return (out_native, lse_native) if return_lse else out_native


def forward(query, key, value, attn_mask, *, is_causal, scale, enable_gqa, workspace_bytes, allow_tf32,
            backend="auto", num_splits=None, dropout_p=0.0, rng=None, variants=(None, None, None, None)):
    """(out, lse) of the forward on detached inputs, for autograd and the custom op (lse float32, natural log), on
    the path the caller's backend and num_splits choose. dropout_p > 0: ``rng`` is the call's drawn pair (a torch
    int64 tensor of shape (2,), attention/dropout.draw), which the backward reads again. ``variants``: (window_size,
    softcap, sinks, alibi_slopes) as the public function takes them."""
    query, key, value = query.detach(), key.detach(), value.detach()
    attn_mask = None if attn_mask is None else attn_mask.detach()
    window_size, softcap, sinks, alibi_slopes = variants
    sinks = None if sinks is None else sinks.detach()
    if not dropout_p:
        return scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa,
                                            window_size=window_size, softcap=softcap, sinks=sinks,
                                            alibi_slopes=alibi_slopes, backend=backend, return_lse=True,
                                            workspace_bytes=workspace_bytes, allow_tf32=allow_tf32,
                                            num_splits=num_splits)
    checks.check_num_splits(num_splits)
    p = checks.check_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, None,
                          window_size, softcap, sinks, alibi_slopes)
    p.rng = dropout.as_array(p.ctx, rng)
    return _run(p, backend, num_splits, workspace_bytes, allow_tf32, True, None, None)


def _via_torch_op(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, return_lse,
                  allow_tf32, workspace_bytes, generator=None, variants=(None, None, None, None)):
    """The call as torch.ops.cupy_attn.scaled_dot_product_attention (see cupy_attn.torch_ops), for traced calls."""
    from .. import torch_ops
    window_size, softcap, sinks, alibi_slopes = variants
    return torch_ops.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                  enable_gqa, backend=backend, return_lse=return_lse,
                                                  allow_tf32=allow_tf32, workspace_bytes=workspace_bytes,
                                                  generator=generator, window_size=window_size, softcap=softcap,
                                                  sinks=sinks, alibi_slopes=alibi_slopes)


def _replayable(p, query, key, value, attn_mask) -> bool:
    """The launch read the caller's arrays in place (no copies), so it can be replayed on their data pointers."""
    ptr = (lambda a: a.data_ptr()) if p.ctx.kind == interop.TORCH else (lambda a: a.data.ptr)  # noqa: E731
    return not p.copies and p.query.data.ptr == ptr(query) and p.key.data.ptr == ptr(key) and \
        p.value.data.ptr == ptr(value) and (attn_mask is None or p.mask.data.ptr == ptr(attn_mask))


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
            window_size=None, softcap=None, sinks=None, alibi_slopes=None, backend="auto", num_splits=None,
            generator=None, allow_tf32=False) -> dispatch.Plan:
    """The path ``scaled_dot_product_attention`` takes for these arguments, and why; nothing is launched (no random
    numbers are drawn).

    Takes the same arguments and raises the same errors. Returns a Plan (``.backend``, ``.reason``, ``.details``,
    ``.copies``); ``print(plan)`` gives a readable summary. On the split path ``.details["GEMMs"]`` names the GEMMs
    (for float32: the 3xTF32 tensor-core GEMM, cuBLAS SGEMM under CUPY_ATTN_FP32_GEMM=sgemm, or TF32 with
    ``allow_tf32``).
    """
    checks.check_num_splits(num_splits)
    p = checks.check_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, generator,
                          window_size, softcap, sinks, alibi_slopes)
    return dispatch.plan_sdpa(p, backend, num_splits=num_splits, allow_tf32=allow_tf32)


def _run_empty(p, return_lse):
    """A GPU call with nothing to compute (checks.SDPAProblem.empty; dispatch.empty_reason): torch's results in the
    query's kind on the caller's stream, no kernel of ours launched. out (..., Hq, L, Ev): empty, or zeros when S = 0;
    lse (..., Hq, L) float32: -inf where no row sees a key (each head's sink logit with ``sinks``: its term alone in
    the denominator), or empty. Ev = 0 with keys: out is empty but lse is each row's log-sum-exp, from the float64
    reference on host copies of query and key (the problem holds the caller's arrays: an empty call makes no views)."""
    ctx, L = p.ctx, p.seqlen_q
    out = ctx.full(p.batch_shape + (L, p.head_dim_v), p.dtype, 0)
    if not return_lse:
        return out
    lse_shape = p.batch_shape + (L,)
    sinks, slopes = _host_variant_arrays(p)
    if p.batch * p.num_heads * L == 0 or (p.seqlen_k == 0 and sinks is None):
        return out, ctx.full(lse_shape, np.dtype(np.float32), -np.inf)
    if p.seqlen_k == 0:
        lse = np.broadcast_to(sinks.astype(np.float64)[:, None], lse_shape)
    else:
        q, k = (_host(ctx, x) for x in (p.query, p.key))
        mask = None if p.mask is None else _host(ctx, p.mask)
        var = p.variants
        _, lse = reference.scaled_dot_product_attention(q, k, np.zeros(k.shape[:-1] + (0,)), mask,
                                                        is_causal=p.causal or False, scale=p.scale,
                                                        enable_gqa=p.num_heads != p.num_kv_heads, return_lse=True,
                                                        window_size=var.window_size, softcap=var.softcap,
                                                        sinks=sinks, alibi_slopes=slopes)
    return out, interop.from_numpy(np.ascontiguousarray(lse).reshape(lse_shape), ctx.kind, np.dtype(np.float32),
                                   ctx.device_id)


def _host(ctx, x) -> np.ndarray:
    """A host (NumPy) copy of one of the problem's arrays: a CuPy view on the GPU, else the caller's CPU array."""
    if ctx.on_gpu:
        import cupy
        with ctx.activate():
            return cupy.asnumpy(ctx.as_cupy(x))
    return interop.to_numpy(x, interop.kind_of(x, "input"))


def _host_variant_arrays(p) -> tuple:
    """(sinks, alibi_slopes) of the call on the host, or None each; (B, Hq) slopes are unfolded to the caller's batch
    axes (the reference broadcasts them over (..., Hq))."""
    var, ctx = p.variants, p.ctx
    sinks = None if var.sinks is None else _host(ctx, var.sinks)
    slopes = None if var.alibi_slopes is None else _host(ctx, var.alibi_slopes)
    if slopes is not None and slopes.ndim == 2 and len(p.batch_shape) != 2:  # (B, Hq) over the folded batch axes
        slopes = slopes.reshape(p.batch_shape[:-1] + slopes.shape[-1:])
    return sinks, slopes


def _run_reference(p, return_lse):
    """The float64 NumPy reference on host copies; results in the query's kind and dtype (lse as float32)."""
    ctx = p.ctx
    if ctx.on_gpu and p.empty:  # backend "reference" on an empty GPU call: no views to copy, the same results
        return _run_empty(p, return_lse)

    q, k, v = (_host(ctx, x) for x in (p.query, p.key, p.value))
    mask = _host(ctx, p.mask) if p.mask is not None else None
    keep = None
    if p.dropout_p > 0:
        keep = dropout.keep_mask(p.rng, p.batch_shape + (p.seqlen_q, p.seqlen_k), p.dropout_p)
    var = p.variants
    sinks, slopes = _host_variant_arrays(p)
    out, lse = reference.scaled_dot_product_attention(q, k, v, mask, is_causal=p.causal or False, scale=p.scale,
                                                      enable_gqa=p.num_heads != p.num_kv_heads, return_lse=True,
                                                      dropout_p=p.dropout_p, dropout_mask=keep,
                                                      window_size=var.window_size, softcap=var.softcap,
                                                      sinks=sinks, alibi_slopes=slopes)
    L, Ev = p.seqlen_q, p.head_dim_v
    out = interop.from_numpy(out.reshape(p.batch_shape + (L, Ev)), ctx.kind, p.dtype, ctx.device_id)
    if not return_lse:
        return out
    return out, interop.from_numpy(lse.reshape(p.batch_shape + (L,)), ctx.kind, np.dtype(np.float32), ctx.device_id)
