"""Autograd for scaled_dot_product_attention on torch tensors: the forward saves out and lse (not the scores) and,
with dropout, the call's rng pair (two int64, not the mask); the backward is planned once (dispatch.plan_backward) and
run by paths/backward.py (FlashAttention-2's backward, P recomputed from lse and the keep mask from the rng pair).

Used by the public function when autograd would record the call (grad mode on and query, key, value or a float
attn_mask requiring grad); calls under ``torch.no_grad()``/``inference_mode`` or on tensors that need no grad keep the
forward-only path and its speed. ``grad_inputs`` is the backward itself, shared with the torch.library registration.
"""
from __future__ import annotations

import dataclasses
import functools
import sys

import numpy as np

from ..runtime import callcache


def needs_grad(query, key, value, attn_mask, sinks=None, *others) -> bool:
    """True when autograd would record this call: torch CUDA tensors, grad mode on, an input requiring grad (sinks
    and ``others``, a mod's aux arrays, included). (CPU tensors run the float64 reference, which records nothing.)"""
    # requires_grad first: it is False on the hot path (inference), and CuPy arrays have no such attribute.
    if not (getattr(query, "requires_grad", False) or getattr(key, "requires_grad", False)
            or getattr(value, "requires_grad", False) or getattr(attn_mask, "requires_grad", False)
            or getattr(sinks, "requires_grad", False) or any(getattr(x, "requires_grad", False) for x in others)):
        return False
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(query, torch.Tensor) and torch.is_grad_enabled()


def cpu_reference(query, key, value, attn_mask, *, is_causal, scale, enable_gqa, return_lse, dropout_p=0.0,
                  rng=None, variants=None, sinks=None):
    """CPU torch tensors that autograd records: the reference math in float64 torch ops (differentiable, so gradients
    flow), cast back to the inputs' dtype; the same conventions as cupy_attn.reference (rows with no visible key give 0
    and lse -inf, or the sink with sinks), dropout by the keep mask of ``rng`` (attention/dropout.py), the variants
    (``variants``, attention/variants.Variants; ``sinks`` the caller's tensor, so that its gradient flows) as the
    reference computes them. Slow, for checking, like the rest of the CPU path."""
    from .. import reference
    torch = sys.modules["torch"]
    q, k, v = (x.double() for x in (query, key, value))
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    L, S = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if variants is not None and variants.softcap is not None:
        s = variants.softcap * torch.tanh(s / variants.softcap)
    if variants is not None and variants.alibi_slopes is not None:
        slopes = variants.alibi_slopes
        if slopes.ndim == 2 and q.ndim != 4:  # (B, Hq) over the folded batch axes
            slopes = slopes.reshape(q.shape[:-3] + slopes.shape[-1:])
        s = s + torch.from_numpy(reference.alibi_bias(slopes, L, S))
    if variants is not None and variants.mod is not None:  # the mod's Python forms on torch index tensors
        from . import mods
        score_mod, mask_mod = mods.reference_forms(  # the caller's aux tensors: their gradients flow
            variants.mod, lambda a: a if isinstance(a, torch.Tensor) else torch.from_numpy(np.asarray(a)),
            originals=True)
        s = reference.apply_mods(s, score_mod, mask_mod, torch)
    window = None if variants is None else variants.window_size
    if is_causal or window is not None:
        keep = torch.from_numpy(reference.visible_keys(L, S, is_causal or False, window))
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.double()
    # S = 0: no key, max -inf (amax refuses an empty axis); the row then gives 0 and lse -inf, as the reference.
    m = s.amax(-1, keepdim=True).detach() if S else s.new_full(s.shape[:-1] + (1,), float("-inf"))
    sink = None
    if sinks is not None:
        sink = sinks.double().reshape(sinks.shape + (1, 1)).expand(m.shape)
        m = torch.maximum(m, sink.detach())
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - m)
    if dropout_p > 0:
        from . import dropout
        from .. import philox
        keep = torch.from_numpy(dropout.keep_mask(rng, tuple(s.shape), dropout_p))
        p = p * keep * philox.dropout_scale(dropout_p)
    out = ((p @ v) / torch.where(denom == 0, torch.ones_like(denom), denom)).to(query.dtype)
    if not return_lse:
        return out
    return out, (m + denom.log()).squeeze(-1).float().detach()


def grad_inputs(query, key, value, attn_mask, out, lse, grad_out, *, is_causal, scale, enable_gqa,
                need_mask_grad: bool, workspace_bytes=None, allow_tf32=False, dropout_p=0.0, rng=None,
                cache_key=None, variants=(None, None, None, None)):
    """(dq, dk, dv, dmask) for torch CUDA tensors: dq/dk/dv in the inputs' shapes and dtype, dmask (or None) in
    attn_mask's shape and dtype (the gradient summed over the mask's broadcast axes). dropout_p > 0: ``rng`` is the
    forward's rng pair, so the backward applies the forward's keep mask. Raises as the forward's checks.
    ``cache_key`` (backward_key's): when the call runs a fused backward kernel on the caller's tensors in place, its
    prepared launch is kept under that key for the next call of the same layout (:class:`BackwardEntry`).
    """
    from . import checks, dropout

    window_size, softcap, sinks, alibi_slopes = variants
    p = checks.check_sdpa(query.detach(), key.detach(), value.detach(),
                          None if attn_mask is None else attn_mask.detach(), dropout_p, is_causal, scale, enable_gqa,
                          "auto", None, window_size, softcap, None if sinks is None else sinks.detach(), alibi_slopes)
    if p.dropout_p > 0:
        p.rng = dropout.as_array(p.ctx, rng)
    return problem_grads(p, query, key, value, attn_mask, out, lse, grad_out, need_mask_grad=need_mask_grad,
                         workspace_bytes=workspace_bytes, allow_tf32=allow_tf32, cache_key=cache_key)


def problem_grads(p, query, key, value, attn_mask, out, lse, grad_out, *, need_mask_grad: bool, workspace_bytes=None,
                  allow_tf32=False, cache_key=None, cache=None):
    """:func:`grad_inputs` for a problem checked already (checks.SDPAProblem of the forward, its rng pair set).
    ``cache``: the table a prepared launch is kept in under ``cache_key`` (None: _BACKWARD_CACHE)."""
    from . import dispatch
    from .paths import backward

    torch = sys.modules["torch"]
    B, Hq, Hkv, L, S = p.batch, p.num_heads, p.num_kv_heads, p.seqlen_q, p.seqlen_k
    E, Ev = p.head_dim, p.head_dim_v
    empty = min(query.numel(), key.numel(), value.numel(), grad_out.numel()) == 0
    plan = None if empty else dispatch.plan_backward(p, allow_tf32=allow_tf32)
    if plan is not None and plan.mask_as_mod:  # the mask as a mod in the Hopper kernel, unless it needs a gradient
        if need_mask_grad:
            plan = dispatch.BackwardPlan("split", None, "attn_mask needs a gradient: the split backward")
        else:
            p = dispatch.masked_backward(p)
    if cache_key is not None and not empty and not need_mask_grad and not p.copies and out.is_contiguous() \
            and lse.is_contiguous() and grad_out.is_contiguous():
        launch = backward.prepare(p, plan)
        if launch is not None:
            entry = (_BACKWARD_CACHE if cache is None else cache)[cache_key] = BackwardEntry(p.ctx, launch)
            return (*entry(query, key, value, out, lse, grad_out), None)
    dq = torch.empty_like(query, memory_format=torch.contiguous_format)
    dk = torch.empty_like(key, memory_format=torch.contiguous_format)
    dv = torch.empty_like(value, memory_format=torch.contiguous_format)
    if empty:
        dmask = None if not need_mask_grad else torch.zeros_like(attn_mask)
        return dq.zero_(), dk.zero_(), dv.zero_(), dmask
    dmask_full = None
    if need_mask_grad:
        dmask_full = torch.empty(query.shape[:-2] + (L, S), device=query.device, dtype=torch.float32)
    ctx = p.ctx
    views = [ctx.as_cupy(t) for t in (out.detach(), lse.detach(), grad_out.detach(), dq, dk, dv)]
    o4, lse3, do4, dq4, dk4, dv4 = (
        v.reshape(shape) for v, shape in zip(views, ((B, Hq, L, Ev), (B, Hq, L), (B, Hq, L, Ev), (B, Hq, L, E),
                                                     (B, Hkv, S, E), (B, Hkv, S, Ev))))
    dm4 = None if dmask_full is None else ctx.as_cupy(dmask_full).reshape(B, Hq, L, S)
    backward.sdpa_backward(p, plan, o4, lse3, do4, dq4, dk4, dv4, dm4, workspace_bytes=workspace_bytes,
                           allow_tf32=allow_tf32)
    dmask = None
    if dmask_full is not None:
        dmask = dmask_full.sum_to_size(attn_mask.shape).to(attn_mask.dtype)
    return dq, dk, dv, dmask


# The autograd backward's call cache: backward_key -> BackwardEntry. Cleared when full, like runtime.callcache's.
_BACKWARD_CACHE: dict = {}
# Mod calls' backward entries hold their aux arrays and BlockMask: a small table of their own (callcache.MAX_HOLDING).
_MOD_BACKWARD_CACHE: dict = {}


def sinks_grad(sinks, out, lse, grad_out):
    """The sinks' gradient: d loss / d sink_h = −Σ_{b,i} e^(sink_h − lse_bhi) · D_bhi with D = rowsum(dO ∘ O) (the
    sink's softmax weight times the row's D, since its logit takes part in the denominator only; lse includes it),
    summed over every axis but the head's, in the sinks' dtype. Torch ops (out, lse, grad_out: the call's)."""
    torch = sys.modules["torch"]
    d = (grad_out.float() * out.float()).sum(-1)  # (..., Hq, L)
    w = torch.exp(sinks.float().reshape(sinks.shape + (1,)) - lse.float())
    dims = tuple(i for i in range(d.ndim) if i != d.ndim - 2)
    return (-(w * d).sum(dims)).to(sinks.dtype)


def backward_key(query, key, value, attn_mask, out, lse, grad_out, flags: tuple) -> tuple | None:
    """The backward's cache key: the seven tensors' signatures (shape, strides, dtype, device, address mod 16; the
    stream), the forward's flags with their types, and the environment overrides (runtime.callcache.ENV_KEYS, which
    include CUPY_ATTN_BWD); None when not cacheable (dropout, a float mask, tensors of another kind, variants)."""
    if attn_mask is not None or flags[5] or flags[6] is not None:  # flags[5]: dropout_p; flags[6]: the variants
        return None
    sig = callcache.signatures((query, key, value, out, lse, grad_out))
    if sig is None:
        return None
    return (*sig, callcache.typed(*flags), callcache.env_values())


class BackwardEntry:
    """A prepared fused backward replayed on new tensors: allocates dq, dk, dv (contiguous, torch's allocator on the
    current stream, which the key fixed) and enqueues the launch; no checks, no plan, no CuPy views."""

    __slots__ = ("ctx", "launch", "_get_device")

    def __init__(self, ctx, launch):
        from cupy.cuda import runtime
        self.ctx, self.launch, self._get_device = ctx, launch, runtime.getDevice

    def __call__(self, query, key, value, out, lse, grad_out):
        if self._get_device() != self.ctx.device_id:
            with self.ctx.activate():
                return self._run(query, key, value, out, lse, grad_out)
        return self._run(query, key, value, out, lse, grad_out)

    def _run(self, query, key, value, out, lse, grad_out):
        dq, dk, dv = query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)
        self.launch(query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), lse.data_ptr(),
                    grad_out.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
        return dq, dk, dv


@functools.cache
def _function():
    """The torch.autograd.Function, built on first use (cupy_attn never imports torch itself)."""
    torch = sys.modules["torch"]

    class ScaledDotProductAttention(torch.autograd.Function):
        @staticmethod
        def forward(fctx, query, key, value, attn_mask, sinks, is_causal, scale, enable_gqa, workspace_bytes,
                    allow_tf32, backend, num_splits, dropout_p, rng, variants):
            from .sdpa import forward
            full = None if variants is None else (variants[0], variants[1], sinks, variants[3])
            out, lse = forward(query, key, value, attn_mask, is_causal=is_causal, scale=scale,
                               enable_gqa=enable_gqa, workspace_bytes=workspace_bytes, allow_tf32=allow_tf32,
                               backend=backend, num_splits=num_splits, dropout_p=dropout_p, rng=rng,
                               variants=full or (None, None, None, None))
            fctx.save_for_backward(query, key, value, attn_mask, out, lse, rng, sinks)
            fctx.flags = (is_causal, scale, enable_gqa, workspace_bytes, allow_tf32, dropout_p, variants)
            fctx.mark_non_differentiable(lse)
            # lse carries no gradient and out may take no part in the loss: without this, autograd would launch a
            # torch.zeros for each missing gradient (which measured ~0.7 ms of host time per step on an H200 host).
            fctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(fctx, grad_out, _grad_lse):
            none = (None,) * 11  # the flags'
            if grad_out is None:  # out took no part in the loss (grads are not materialized: no zeros launched)
                return (None,) * 5 + none
            query, key, value, attn_mask, out, lse, rng, sinks = fctx.saved_tensors
            is_causal, scale, enable_gqa, workspace_bytes, allow_tf32, dropout_p, variants = fctx.flags
            need_mask = attn_mask is not None and fctx.needs_input_grad[3]
            grad_out = grad_out.contiguous()
            dsinks = None
            if sinks is not None and fctx.needs_input_grad[4]:
                dsinks = sinks_grad(sinks, out, lse, grad_out)
            cache_key = backward_key(query, key, value, attn_mask, out, lse, grad_out, fctx.flags)
            entry = None if cache_key is None else _BACKWARD_CACHE.get(cache_key)
            if entry is not None:
                dq, dk, dv = entry(query, key, value, out, lse, grad_out)
                return (dq, dk, dv, None, dsinks) + none
            if len(_BACKWARD_CACHE) >= callcache.MAX_ENTRIES:
                _BACKWARD_CACHE.clear()
            full = (None,) * 4 if variants is None else (variants[0], variants[1], sinks, variants[3])
            dq, dk, dv, dmask = grad_inputs(query, key, value, attn_mask, out, lse, grad_out,
                                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                            need_mask_grad=need_mask, workspace_bytes=workspace_bytes,
                                            allow_tf32=allow_tf32, dropout_p=dropout_p, rng=rng,
                                            cache_key=cache_key, variants=full)
            return (dq, dk, dv, dmask, dsinks) + none

    return ScaledDotProductAttention


@functools.cache
def _mod_function():
    """The torch.autograd.Function of score_mod / mask_mod calls on the GPU: the problem is checked and its backward
    planned before the forward runs (sdpa._run_mod), and both run on it (no second check)."""
    torch = sys.modules["torch"]

    class ModAttention(torch.autograd.Function):
        @staticmethod
        def forward(fctx, query, key, value, attn_mask, sinks, run, p, backward_args, cache_key, *aux):
            out, lse = run()
            fctx.save_for_backward(query, key, value, attn_mask, out, lse, sinks)
            fctx.p, fctx.backward_args, fctx.n_aux, fctx.cache_key = p, backward_args, len(aux), cache_key
            fctx.mark_non_differentiable(lse)
            fctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(fctx, grad_out, _grad_lse):
            none = (None,) * 4
            if grad_out is None:
                return (None,) * (9 + fctx.n_aux)
            query, key, value, attn_mask, out, lse, sinks = fctx.saved_tensors
            grad_out = grad_out.contiguous()
            dsinks = sinks_grad(sinks, out, lse, grad_out) if sinks is not None and fctx.needs_input_grad[4] else None
            need_mask = attn_mask is not None and fctx.needs_input_grad[3]
            p, aux_grads = fctx.p, [None] * fctx.n_aux
            bound = p.variants.mod
            # The backward's cache: the forward's key (mods, aux and BlockMask addresses, flags) with the backward's
            # tensors; not with an attn_mask or aux gradients (their accumulators are new each call).
            cache_key = None
            if fctx.cache_key is not None and attn_mask is None and not any(fctx.needs_input_grad[9:]):
                bk = backward_key(query, key, value, None, out, lse, grad_out, (None,) * 5 + (0.0, None))
                cache_key = None if bk is None else (fctx.cache_key, bk)
                entry = None if cache_key is None else _MOD_BACKWARD_CACHE.get(cache_key)
                if entry is not None:
                    return (*entry(query, key, value, out, lse, grad_out), None, dsinks) + none + tuple(aux_grads)
                if len(_MOD_BACKWARD_CACHE) >= callcache.MAX_HOLDING:
                    _MOD_BACKWARD_CACHE.clear()
            if any(fctx.needs_input_grad[9:]):  # fp32 accumulators the backward's score_mod_aux_grad adds into
                accs = [torch.zeros(a.shape, dtype=torch.float32, device=query.device) if fctx.needs_input_grad[9 + i]
                        else None for i, a in enumerate(bound.originals)]
                grads = tuple(0 if acc is None else acc.data_ptr() for acc in accs)
                p = dataclasses.replace(p, variants=dataclasses.replace(
                    p.variants, mod=dataclasses.replace(bound, grads=grads)))
                aux_grads = [None if acc is None else acc.to(a.dtype) for acc, a in zip(accs, bound.originals)]
            dq, dk, dv, dmask = problem_grads(p, query, key, value, attn_mask, out, lse, grad_out,
                                              need_mask_grad=need_mask, cache_key=cache_key,
                                              cache=_MOD_BACKWARD_CACHE, **fctx.backward_args)
            return (dq, dk, dv, dmask, dsinks) + none + tuple(aux_grads)

    return ModAttention


def apply_mod(query, key, value, attn_mask, sinks, run, p, *, workspace_bytes, allow_tf32, return_lse,
              cache_key=None):
    """A recorded score_mod / mask_mod call: ``run()`` gives (out, lse) of the checked problem ``p``. ``cache_key``
    (the forward's call-cache key, sdpa._mod_call_key; None: not cached) keys the backward's prepared launch too."""
    if attn_mask is not None and attn_mask.dtype == sys.modules["torch"].bool and attn_mask.requires_grad:
        raise TypeError("attn_mask: a bool mask cannot require grad")
    out, lse = _mod_function().apply(query, key, value, attn_mask, sinks, run, p,
                                     {"workspace_bytes": workspace_bytes, "allow_tf32": allow_tf32}, cache_key,
                                     *p.variants.mod.originals)
    return (out, lse) if return_lse else out


def apply(query, key, value, attn_mask, *, is_causal, scale, enable_gqa, return_lse, workspace_bytes, allow_tf32,
          backend="auto", num_splits=None, dropout_p=0.0, rng=None, variants=(None, None, None, None)):
    """The recorded call: (out, lse) through the autograd Function; lse carries no gradient. backend and num_splits
    choose the forward's path as in an unrecorded call; dropout_p > 0 with the call's rng pair (saved for the
    backward). ``variants``: (window_size, softcap, sinks, alibi_slopes); sinks is an input of the Function (its
    gradient is returned), the others are flags."""
    if attn_mask is not None and attn_mask.dtype == sys.modules["torch"].bool and attn_mask.requires_grad:
        raise TypeError("attn_mask: a bool mask cannot require grad")
    window_size, softcap, sinks, alibi_slopes = variants
    flags = None if all(x is None for x in variants) else (window_size, softcap, None, alibi_slopes)
    out, lse = _function().apply(query, key, value, attn_mask, sinks, is_causal, scale, enable_gqa, workspace_bytes,
                                 allow_tf32, backend, num_splits, dropout_p, rng, flags)
    return (out, lse) if return_lse else out

