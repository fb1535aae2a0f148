"""scaled_dot_product_attention and explain: the attention call path.

    interop (context_for) -> checks.check_sdpa -> dispatch.plan_sdpa -> Plan.prepare (kernels/, paths/) -> launch
    -> wrap

A repeated call with the same layout, flags and stream skips everything before the launch (runtime.callcache).
"""
from __future__ import annotations

import numpy as np

from .. import reference
from ..runtime import callcache, interop, workspace
from . import autograd, checks, decode_loop, dispatch, dropout, mods


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, window_size=None, softcap=None, sinks=None, alibi_slopes=None,
                                 score_mod=None, mask_mod=None, aux=None, block_mask=None, backend="auto",
                                 return_lse=False,
                                 allow_tf32=False, workspace_bytes=None, num_splits=None, generator=None):
    """Attention with the semantics of torch's scaled_dot_product_attention and FlashAttention's variants:

        s_ij = softcap · tanh(scale · q_i·k_j / softcap)  (scale · q_i·k_j without softcap)
               − slope_h · |i + S − L − j|                 (with alibi_slopes)
        s_ij <- score_mod(s_ij, b, h, i, j, aux)             (with score_mod)
               + mask_ij                                     (float attn_mask; −inf where a key is not visible)
        out_i = Σ_j exp(s_ij) v_j / (Σ_j exp(s_ij) + exp(sink_h))   (the sink term only with sinks)
        lse_i = log(Σ_j exp(s_ij) + exp(sink_h))

    Key j is visible to query i when a bool attn_mask is True there, j ≤ i (is_causal=True / "top_left") or
    j ≤ i + S − L ("bottom_right"), i + S − L − left ≤ j ≤ i + S − L + right with window_size=(left, right), and
    mask_mod(b, h, i, j, aux) is true (all that apply).

    Arguments:
    - query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev): at least one axis before L/S (the head
      axis), equal leading axes; Ev may differ from E. float16, bfloat16 or float32, all equal (float64: TypeError,
      the float64 reference is cupy_attn.reference). float32 is computed at fp32 accuracy unless ``allow_tf32``.
    - attn_mask: bool (True = takes part) or float (added to the scores), broadcastable to (..., Hq, L, S).
    - dropout_p in [0, 1]: torch's attention dropout, out = (P ∘ Z / (1 − dropout_p)) V with P the softmax and Z a
      keep mask of probability 1 − dropout_p (dropout_p = 1: out = 0); lse is that of the undropped scores. Z comes
      from Philox4x32-10 (Salmon et al. 2011) keyed by a (seed, offset) pair each call draws from ``generator`` on the
      call's stream (cupy_attn.philox defines the mask in NumPy): torch tensors take a torch.Generator of the query's
      device or None (torch's default generator: torch.manual_seed reproduces calls; CUDA-graph replays draw new
      pairs); CuPy / DLPack inputs None (cupy.random's state); NumPy a numpy.random.Generator or None. The backward
      applies the forward's mask (the pair is saved, not the mask).
    - is_causal: False, True / "top_left" (torch's ``tril(ones(L, S))``) or "bottom_right" (FlashAttention's
      alignment, for KV caches). Not together with attn_mask.
    - scale: multiplies q·k; default 1/sqrt(E).
    - enable_gqa: Hq a multiple of Hkv; query head h reads key/value head h // (Hq // Hkv) (not expanded in memory).
      Without it Hkv must equal Hq.
    - window_size: None or (left, right), ints ≥ 0, or −1 / None for an unbounded side (FlashAttention's
      convention; Mistral's sliding_window W is (W − 1, 0) with is_causal).
    - softcap: None or 0 (off), or a float c > 0 (Gemma 2's 50.0).
    - sinks: None or (Hq,) float32 or the query's dtype, natural-log logits (gpt-oss's); differentiable.
    - alibi_slopes: None or (Hq,) / (B, Hq) float32 (Press et al. 2022, FlashAttention's sign and offset).
    - score_mod, mask_mod: CUDA C++ snippets (function bodies) compiled by NVRTC into the kernel, FlexAttention's
      idea (Dong et al. 2024): score_mod returns the new score from ``score, b, h, q_idx, kv_idx, aux``, mask_mod
      returns whether key kv_idx takes part for ``b, h, q_idx, kv_idx, aux`` (b: the flat batch index over the
      query's leading axes). Or score_mod=cupy_attn.AttentionMod (both snippets, their Python forms for CPU inputs
      and the reference, compiled once per aux layout). aux: a dict (or tuple) of arrays of the query's kind and
      device the snippets read as ``aux.<name>`` pointers (``aux.<name>_shape``: int). On Hopper, fp16/bf16 calls
      at head dims 33-256 without dropout or attn_mask run the FA3-design kernel's mod instantiation; others the
      split path's softmax kernel (any head dim). The backward is the split backward's (its rows kernels' mod
      instantiation; a score_mod needs AttentionMod(score_mod_grad=...), its derivative; aux arrays that require
      grad need score_mod_aux_grad, which adds into aux.<name>_grad).
      Not under torch.compile yet (NotImplementedError).
    - block_mask: a cupy_attn.BlockMask of the call's mask_mod and aux (cupy_attn.create_block_mask): the key range
      each block of 128 query rows sees, so that the FA3-design kernel skips the key blocks outside it.
    - return_lse: also return lse (..., Hq, L) float32 (natural log); autograd takes it as a constant (no gradient).
    - backend: "auto", "fused", "split" or "reference" (paths below); CUPY_ATTN_BACKEND overrides "auto" on GPU
      calls. "fused" and "split" need CUDA inputs.
    - num_splits: None (chosen per call) or the decode kernel's key splits (a positive int; not with dropout).
    - workspace_bytes: the split path's score-buffer budget (default 1 GiB or CUPY_ATTN_WORKSPACE_BYTES).

    Inputs and results: torch CUDA tensors and CuPy arrays come in zero-copy (DLPack) and results come back as the
    query's kind on the caller's stream (torch's current stream, or CuPy's); other CUDA ``__dlpack__`` objects give
    CuPy arrays; NumPy arrays and CPU torch tensors run the float64 reference (slow; for checking). All arrays of a
    call are of one kind and on one device. Copies are made only when an input's last axis is not unit-stride or its
    leading axes share no stride (``explain`` lists them); BSHD views (``x.view(B, S, H, D).transpose(1, 2)``) are
    read in place. Inputs that require grad are recorded by autograd and the backward runs our kernels. Rows that see
    no key give out 0 and lse −inf (the sink with sinks), as torch's math backend; NaN/Inf propagate. Empty inputs
    (B, H, L or Ev = 0, or S = 0) give torch's results and launch nothing.

    Returns out (..., Hq, L, Ev) in the query's dtype and kind, contiguous; or (out, lse).

    Raises, before anything is launched: TypeError for non-array inputs, unsupported dtypes, arrays of another kind
    than query's, a softcap that is not a number, sinks/alibi_slopes of the wrong dtype, and a generator of the
    wrong kind; ValueError naming the argument and axis for shape, device, mask, window and flag errors (dropout_p
    outside [0, 1], num_splits with dropout), a generator of another device, backend="fused" that cannot run the
    call, and backend="fused" or "split" with CPU inputs; ValueError with NVRTC's log for a score_mod / mask_mod that
    does not compile, TypeError for aux arrays of another kind or an unsupported dtype. NotImplementedError when a
    window, softcap or ALiBi call that requires grad cannot take the Hopper backward kernel, when a mod call that
    requires grad has a score_mod without score_mod_grad, a window / softcap / ALiBi beside the mod, or aux that
    requires grad without score_mod_aux_grad, and for mod calls under torch.compile.

    Paths (``explain`` says which one a call takes, and why):
    - fused: FlashAttention-2 (Dao 2023) with mma.sync; on Hopper warpgroup MMAs (CUPY_ATTN_WGMMA=0 keeps mma.sync)
      and, for unmasked calls of at least 2^34 FLOPs at head dims 33-256 and for every variant call there, the
      FlashAttention-3-design kernel (Shah et al. 2024: TMA, a producer warpgroup, ping-pong, intra-warpgroup
      overlap, persistent CTAs, 192-row tiles for non-causal head dim 64; CUPY_ATTN_FA3=0 turns it off, =2 / =3
      force its one-tile-per-CTA / persistent form); head dims 257-512 a head-dim-512 kernel. Dropout calls run
      the mma.sync dropout variant or the split path. Key blocks no row of a tile sees (causal, window) are skipped.
    - decode (Flash-Decoding, split-KV): under "auto" for few query rows (L ≤ 16, L·Hq/Hkv ≤ 64) and S ≥ 256,
      or any supported call (fp16/bf16, head dims ≤ 256) given num_splits; CUPY_ATTN_DECODE=0 turns it off.
    - split: cuBLAS Q·Kᵀ into an fp32 score buffer, our mask + softmax kernel (every variant), cuBLAS P·V, in
      chunks of batch·heads under workspace_bytes; float32 uses our 3xTF32 GEMM (CUTLASS's FastF32 split;
      CUPY_ATTN_FP32_GEMM=sgemm: cuBLAS SGEMM). On Hopper, fp16/bf16 calls with S ≤ 512 and no mask or a key-padding
      one run one kernel for Q·Kᵀ and the softmax (CUPY_ATTN_SPLIT_FUSED=0 turns it off), then P·V on our TMA +
      wgmma GEMM where faster (CUPY_ATTN_SPLIT_PV=0 keeps cuBLAS).
    - reference: the float64 NumPy reference on host copies.
    Repeated calls with the same layout, flags and stream replay the first call's prepared launch (~14-16 µs of
    host time for a small fused call with torch tensors; torch's SDPA took 16-18 µs on the same hosts). Decode
    calls on the split-KV kernel whose key length changes each step (a growing KV cache: contiguous key, value and
    mask) replay a launch of their family rewritten for the new length (attention/decode_loop.py). Under
    torch.compile / torch.export the call is one custom op, ``torch.ops.cupy_attn.scaled_dot_product_attention``
    (no graph break); eager calls skip its dispatch (~10 µs).
    """
    if type(window_size) is list:  # hashable for the call cache's key
        window_size = tuple(window_size)
    if score_mod is not None or mask_mod is not None or aux is not None or block_mask is not None:
        return _run_mod(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, generator,
                        (window_size, softcap, sinks, alibi_slopes, score_mod, mask_mod, aux, block_mask),
                        num_splits, workspace_bytes, allow_tf32, return_lse)
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
    family = None
    if call_key is not None:
        entry = callcache.get(call_key)
        if entry is None and attn_mask is not None and call_key[0] == "torch":
            held = _mask_key(call_key, attn_mask)
            entry = None if held is None else _MASK_ENTRIES.get(held)
        if entry is not None:  # the same layout, flags and stream ran before: replay its launch (see _callcache)
            return entry(query, key, value, attn_mask)
        if call_key[0] == "torch":  # a decode loop's growing S (attention/decode_loop.py)
            family = decode_loop.family_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                            backend, return_lse, allow_tf32, workspace_bytes, num_splits, variants,
                                            generator)
            out = None if family is None else decode_loop.replay(family, query, key, value, attn_mask, return_lse,
                                                                 num_splits)
            if out is not None:
                return out
    elif interop.is_tracing_tensor(query):  # FakeTensor / FunctionalTensor (make_fx, AOTAutograd): no data to read
        return _via_torch_op(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
                             return_lse, allow_tf32, workspace_bytes, generator, variants)
    p = checks.check_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, generator,
                          *variants)
    if p.dropout_p > 0:
        _, p.rng = dropout.draw(p.ctx, generator)
    return _run(p, backend, num_splits, workspace_bytes, allow_tf32, return_lse, call_key, (query, key, value,
                                                                                            attn_mask), family)


_PLAIN_NUMBERS = (float, int)


def _mask_key(call_key: tuple, attn_mask) -> tuple | None:
    """The key of a masked call whose launch holds its mask's contents (the mask run as a mod: its array, and the
    visible and full key ranges the pre-pass found in it): the layout's key, the mask's address and its torch version
    counter, which every in-place write through torch bumps (views share it). Hugging Face passes one mask to every
    layer of a forward: layers after the first replay, without the pre-pass. Writes that bypass torch (a CuPy view of
    the mask written in place, ``.data``) are not seen: pass a new mask instead. None for inference tensors, which
    keep no version counter (torch.inference_mode): such calls are not kept."""
    if attn_mask.is_inference():
        return None
    return call_key + ("mask", attn_mask.data_ptr(), attn_mask._version)


# Masked calls run with the mask as a mod (_mask_key -> _MaskModEntry). Each keeps its mask (at least 2^24 pairs: tens
# of MB) and the launch's copy alive, so few are kept: a model's forward passes one mask to all its layers.
_MASK_ENTRIES: dict = {}
MAX_MASK_ENTRIES = 4
workspace.on_release(_MASK_ENTRIES.clear)  # cupy_attn.release_memory() lets their masks go


class _MaskModEntry:
    """A cached masked call run with its mask as a mod: the launch reads the mask through its own arrays (a view of
    the mask, or a contiguous copy of it), so the replay passes no mask pointer (the fused launch refuses one). It
    keeps the caller's mask alive, so that no other mask can take its address (and version 0) while the entry holds
    the ranges found in this one."""

    __slots__ = ("entry", "mask")

    def __init__(self, entry, mask):
        self.entry, self.mask = entry, mask

    def __call__(self, query, key, value, attn_mask):
        return self.entry(query, key, value, None)


def _mod_call_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, generator,
                  variants, num_splits, workspace_bytes, allow_tf32, return_lse) -> tuple | None:
    """The call cache's key of a mod call that needs no gradient, or None (not cacheable): the plain call's key, then
    the mods' snippets (their digest), the aux arrays' names, signatures and addresses (the launch holds them) and
    the BlockMask object (its tables' addresses; held by the key, so its identity is not reused while cached).
    Dropout, a generator, sinks and ALiBi slopes are not cached, as for plain calls."""
    window_size, softcap, sinks, alibi_slopes, score_mod, mask_mod, aux, block_mask = variants
    if generator is not None or type(dropout_p) not in _PLAIN_NUMBERS or dropout_p != 0 or sinks is not None \
            or alibi_slopes is not None:
        return None
    try:
        mod = mods.as_mod(score_mod, mask_mod)
        items = mods.named_aux(aux)
    except (TypeError, ValueError):
        return None  # the checks raise it
    if mod is None and not items:
        return None
    base = callcache.key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, return_lse,
                         allow_tf32, workspace_bytes, num_splits, window_size, softcap)
    arrays = tuple(a for _, a in items)
    if any(a is None for a in arrays):
        return None  # the checks name it
    sigs = callcache.signatures((query,) + arrays) if base is not None else None
    if sigs is None or sigs[0] != base[0] or any(getattr(a, "requires_grad", False) for a in arrays):
        return None
    ptrs = tuple(a.data_ptr() if sigs[0] == "torch" else a.data.ptr for a in arrays)
    return base + ("mod", None if mod is None else mod.key, tuple(n for n, _ in items), sigs[1][1:], ptrs,
                   block_mask)


def _run_mod(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, generator, variants,
             num_splits, workspace_bytes, allow_tf32, return_lse):
    """A call with score_mod / mask_mod (attention/mods.py): checked, then the split path (GPU) or the reference
    with the mod's Python forms (CPU tensors that require grad: in differentiable torch ops). Calls that need no
    gradient are cached like plain ones (_mod_call_key: the aux arrays' and the BlockMask's addresses in the key),
    when the launch reads the aux arrays in place."""
    if interop.torch_compiling() or interop.is_tracing_tensor(query):
        raise NotImplementedError("score_mod / mask_mod calls cannot be traced by torch.compile yet: call "
                                  "cupy_attn.scaled_dot_product_attention outside the compiled region")
    checks.check_num_splits(num_splits)
    aux_all = variants[6].values() if isinstance(variants[6], dict) else variants[6] or ()
    grad = autograd.needs_grad(query, key, value, attn_mask, variants[2], *aux_all)
    # Recorded calls key their forward with lse (the Function saves it) and, when no aux array needs a gradient, their
    # backward under the same key (autograd.apply_mod); unrecorded ones replay here without any check.
    call_key = _mod_call_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
                             generator, variants, num_splits, workspace_bytes, allow_tf32, return_lse or grad)
    if not grad:
        entry = None if call_key is None else callcache.get_holding(call_key)
        if entry is not None:  # the same layout, mods, aux and stream ran before: replay its launch
            return entry(query, key, value, attn_mask)
    p = checks.check_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, generator,
                          *variants)
    if call_key is not None and p.variants.mod is not None and \
            tuple(a.data.ptr for a in p.variants.mod.arrays) != call_key[-2]:
        call_key = None  # an aux array was copied (not contiguous, another dtype): the launch holds the copy
    if p.dropout_p > 0:
        rng, p.rng = dropout.draw(p.ctx, generator)
    if grad:
        if not p.ctx.on_gpu:
            return autograd.cpu_reference(query, key, value, attn_mask, is_causal=p.causal, scale=p.scale,
                                          enable_gqa=enable_gqa, return_lse=return_lse, dropout_p=p.dropout_p,
                                          rng=rng if p.dropout_p > 0 else None, variants=p.variants,
                                          sinks=variants[2])
        if any(getattr(a, "requires_grad", False) for a in aux_all) and p.variants.mod.mod.score_mod_aux_grad is None:
            raise NotImplementedError("an aux array requires grad: its gradient needs AttentionMod(score_mod_aux_grad="
                                      "...), which adds d loss / d aux into aux.<name>_grad; or pass it detached")
        dispatch.plan_backward(p, allow_tf32=allow_tf32)  # raises before the forward for what it cannot run
        inputs = (query, key, value, attn_mask)

        def run():
            entry = None if call_key is None else callcache.get_holding(call_key)
            if entry is not None:
                return entry(*inputs)
            return _run(p, backend, num_splits, workspace_bytes, allow_tf32, True, call_key, inputs)
        return autograd.apply_mod(query, key, value, attn_mask, variants[2], run, p, workspace_bytes=workspace_bytes,
                                  allow_tf32=allow_tf32, return_lse=return_lse, cache_key=call_key)
    return _run(p, backend, num_splits, workspace_bytes, allow_tf32, return_lse, call_key,
                (query, key, value, attn_mask))


def _run(p, backend, num_splits, workspace_bytes, allow_tf32, return_lse, call_key, inputs, family=None):
    """Plan and launch a checked problem (its rng pair drawn when dropout_p > 0); cache the launch under
    ``call_key`` (None: not cached) when it read the caller's ``inputs`` in place, and a decode launch under its
    ``family`` (decode_loop.family_key) for calls of other S."""
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
        # The plan's problem: the call's, or for a mask run as a mod (dispatch._mask_fa3_plan) the call without its
        # mask, which the launch holds (such launches are not cached: the next call's mask is another array).
        pp = plan.problem if plan.problem is not None else p
        run(p.query.data.ptr, p.key.data.ptr, p.value.data.ptr, out4.data.ptr,
            0 if lse3 is None else lse3.data.ptr, 0 if pp.mask is None else pp.mask.data.ptr)
        # A user's mods: the call's own problem's (its aux addresses are in the key); an attn_mask run as a mod: the
        # plan's, whose mask array and ranges hold this mask's contents: kept under the mask's address and torch
        # version (_mask_key) in the holding table.
        if call_key is not None and _replayable(p, *inputs):
            entry = callcache.Entry(ctx, tuple(out_native.shape),
                                    None if lse_native is None else tuple(lse_native.shape), run)
            if pp.variants.mod is p.variants.mod:
                (callcache.put if p.variants.mod is None else callcache.put_holding)(call_key, entry)
            elif p.variants.mod is None and call_key[0] == "torch" and inputs[3] is not None:
                held = _mask_key(call_key, inputs[3])  # the mask run as a mod: only this call's plan holds it
                if held is not None:
                    if len(_MASK_ENTRIES) >= MAX_MASK_ENTRIES:
                        _MASK_ENTRIES.clear()
                    _MASK_ENTRIES[held] = _MaskModEntry(entry, inputs[3])
            if family is not None and plan.backend == "decode":
                decode_loop.remember(family, plan, out4, lse3, dispatch.device_arch(p),
                                     interop.device_sms(ctx.device_id))
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
            window_size=None, softcap=None, sinks=None, alibi_slopes=None, score_mod=None, mask_mod=None, aux=None,
            block_mask=None, backend="auto", num_splits=None, generator=None, allow_tf32=False) -> dispatch.Plan:
    """The path ``scaled_dot_product_attention`` takes for these arguments, and why; nothing is launched (no random
    numbers are drawn).

    Takes the same arguments and raises the same errors. Returns a Plan (``.backend``, ``.reason``, ``.details``,
    ``.copies``); ``print(plan)`` gives a readable summary. On the split path ``.details["GEMMs"]`` names the GEMMs
    (for float32: the 3xTF32 tensor-core GEMM, cuBLAS SGEMM under CUPY_ATTN_FP32_GEMM=sgemm, or TF32 with
    ``allow_tf32``).
    """
    checks.check_num_splits(num_splits)
    p = checks.check_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, generator,
                          window_size, softcap, sinks, alibi_slopes, score_mod, mask_mod, aux, block_mask)
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
    score_mod, mask_mod = mods.reference_forms(var.mod, lambda a: _host(ctx, a))
    out, lse = reference.scaled_dot_product_attention(q, k, v, mask, is_causal=p.causal or False, scale=p.scale,
                                                      enable_gqa=p.num_heads != p.num_kv_heads, return_lse=True,
                                                      dropout_p=p.dropout_p, dropout_mask=keep,
                                                      window_size=var.window_size, softcap=var.softcap,
                                                      sinks=sinks, alibi_slopes=slopes, score_mod=score_mod,
                                                      mask_mod=mask_mod)
    L, Ev = p.seqlen_q, p.head_dim_v
    out = interop.from_numpy(out.reshape(p.batch_shape + (L, Ev)), ctx.kind, p.dtype, ctx.device_id)
    if not return_lse:
        return out
    return out, interop.from_numpy(lse.reshape(p.batch_shape + (L,)), ctx.kind, np.dtype(np.float32), ctx.device_id)
