"""torch.library custom ops over cupy_attn's entry points, so torch.compile / torch.export see one opaque op per call.

    torch.ops.cupy_attn.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, rng, is_causal, scale,
        enable_gqa, backend, return_lse, allow_tf32, workspace_bytes, window_left, window_right, softcap, sinks,
        alibi_slopes) -> (out, lse)
    torch.ops.cupy_attn.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
        block_table, is_causal, scale, window_left, window_right, softcap, sinks, alibi_slopes, backend) -> (out, lse)
        (and cupy_attn::varlen_attention_backward, its registered backward: dense backward per sequence)
    torch.ops.cupy_attn.linear_batchnorm_softmax(x, weight, bias, running_mean!, running_var!, bn_weight, bn_bias,
        scale, training, momentum, eps, num_batches_tracked!, allow_tf32) -> out
    torch.ops.cupy_attn.linear_batchnorm_softmax_forward / _backward: the differentiable pair (see Autograd below)

Importing this module (it imports torch) registers the ops and their fake (meta) implementations. Users never call
it directly: ``cupy_attn.scaled_dot_product_attention`` and ``cupy_attn.linear_batchnorm_softmax`` route torch tensors
here when torch is tracing (``torch.compiler.is_compiling()``: Dynamo, torch.export) or when the inputs are tracing
tensors (FakeTensor, FunctionalTensor: make_fx, AOTAutograd), before the call cache, whose key reads data pointers and
the current stream and cannot be traced. Each op's implementation is the eager entry point itself, so a compiled
graph runs exactly the eager code (GPU kernels for CUDA tensors, the float64 reference for CPU tensors).

Eager calls keep the direct path: the dispatcher costs far more than the ~2 µs the host-time budget could spare (a
cached small GPU call is ~28 µs of host time against torch SDPA's ~16). bench/experiments/host_overhead/op_overhead.py, two runs on
a 2-core AMD EPYC, torch 2.13.0+cpu, no-op ops with these exact schemas: SDPA 10.0 / 12.4 µs per call more than the
plain Python function, Linear-BN-softmax 47 / 79 µs more (its three mutable arguments take the slow Python path of
custom ops). So only traced calls take the op, and the route check an eager call pays is
``torch.compiler.is_compiling()`` (~0.1 µs).

Schema choices (a custom op's arguments must be typed, not Python unions):
- is_causal (bool | "top_left" | "bottom_right") travels as a str: "" (not causal), "top_left", "bottom_right".
- return_lse is a flag, and the op always returns (out, lse): lse is (..., Hq, L) float32 when asked for, an empty
  (0,) float32 tensor otherwise, so the schema has one fixed return type.
- scale (float | None), attn_mask (Tensor | None), workspace_bytes (int | None), allow_tf32 (bool | None) map to
  optional schema types.
- The variants: window_size travels as window_left and window_right (ints, -1 for an unbounded side or no window),
  softcap as a float (0: none), sinks and alibi_slopes as optional tensors; sinks is differentiable (the backward op
  returns its gradient).
- Dropout: a schema has no Generator type, so the wrapper draws the call's rng pair (two int64 from ``generator``,
  attention/dropout.draw: a torch.randint, traced as an ordinary RNG op) and the op takes it as ``rng`` (Tensor?,
  None when dropout_p = 0). The op is then a pure function of its inputs, and its registered backward receives the
  same pair, so it applies the forward's keep mask.
- linear_batchnorm_softmax declares running_mean, running_var and num_batches_tracked as mutated: it updates them in
  place in training (functionalization writes them back in compiled graphs).

CUDA graphs (``mode="reduce-overhead"``): torch's cudagraph trees warm a graph up on the stream they later capture
on, so the capture replays the call cache's prepared launch (kernel launches and torch allocations only, which are
capturable). Untested limits, for the GPU run to confirm: the split SDPA path takes a CuPy scratch buffer per call and
Linear-BN-softmax grows its per-stream workspace for a larger shape; a captured graph keeps pointing at such memory
after CuPy's pool has taken it back. Fused SDPA calls and fixed-shape Linear-BN-softmax calls do neither.

Autograd: the SDPA op's backward is a second op, cupy_attn::scaled_dot_product_attention_backward (register_autograd;
its implementation is cupy_attn.attention.autograd.grad_inputs, the eager backward), so AOTAutograd traces both into
compiled training graphs. The forward op always returns lse (the backward needs it); the wrapper drops it when not
asked for.
Linear-BN-softmax: torch refuses a backward formula on an op that mutates its arguments, so recorded calls take a
functional sibling,

    torch.ops.cupy_attn.linear_batchnorm_softmax_forward(same arguments) -> (out, y, stats, running_mean',
        running_var', num_batches_tracked')
    torch.ops.cupy_attn.linear_batchnorm_softmax_backward(grad_out, x, weight, y, out, stats, bn_weight, bn_bias,
        scale, use_batch_stats, needs, allow_tf32) -> (dx, dweight, dbias, dbn_weight, dbn_bias, dscale)

The forward op updates copies of the running stats and returns them (empty (0,) tensors when not updated), and the
wrapper copies them into the buffers (functionalization keeps that a buffer mutation of the compiled graph); y and
stats are what the backward reads (cupy_attn.linear_bn_softmax.api.forward_saving). The backward op returns empty
(0,) tensors for gradients not asked for (needs: six bools). Calls that autograd does not record keep the mutable op
on detached inputs, as before.
"""
from __future__ import annotations

import torch

from . import reference
from .attention import dropout as _dropout
from .attention.sdpa import forward as _sdpa_forward
from .attention.sdpa import scaled_dot_product_attention as _sdpa_eager
from .linear_bn_softmax.api import linear_batchnorm_softmax as _lbs_eager

__all__ = ["scaled_dot_product_attention", "varlen_attention", "linear_batchnorm_softmax", "causal_to_str"]

_CAUSAL = {"": False, "top_left": "top_left", "bottom_right": "bottom_right"}


def causal_to_str(is_causal) -> str:
    """is_causal of the public API as the op's str; ValueError (the eager message) for anything else."""
    if is_causal is False or is_causal is None:
        return ""
    if is_causal is True:
        return "top_left"
    if isinstance(is_causal, str) and is_causal in ("top_left", "bottom_right"):
        return is_causal
    raise ValueError(f"is_causal must be a bool, 'top_left' or 'bottom_right', got {is_causal!r}")


def _check_flags(attn_mask, dropout_p: float, is_causal: str, rng=None) -> None:
    """The flag errors of checks.check_sdpa that do not need real data, raised at trace time too."""
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if dropout_p > 0.0 and (rng is None or rng.dtype != torch.int64 or tuple(rng.shape) != (2,)):
        raise ValueError("dropout_p > 0 needs rng, the call's int64 pair (seed, offset) of shape (2,) "
                         "(cupy_attn.torch_ops.scaled_dot_product_attention draws it)")
    if is_causal not in _CAUSAL:
        raise ValueError(f"is_causal must be '', 'top_left' or 'bottom_right', got {is_causal!r}")
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal cannot both be set (as in torch): fold the causal mask into attn_mask")


def _variants(window_left: int, window_right: int, softcap: float, sinks, alibi_slopes) -> tuple:
    """The op's variant arguments as the eager API's (window_size, softcap, sinks, alibi_slopes)."""
    window = None if window_left < 0 and window_right < 0 else (window_left, window_right)
    return window, (softcap or None), sinks, alibi_slopes


def window_to_ints(window_size) -> tuple[int, int]:
    """window_size of the public API as the op's two ints (-1: unbounded); None -> (-1, -1)."""
    left, right = reference.window_bounds(window_size)  # eager's checks and errors
    return (-1 if left is None else left), (-1 if right is None else right)


@torch.library.custom_op("cupy_attn::scaled_dot_product_attention", mutates_args=())
def _sdpa_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
             dropout_p: float, rng: torch.Tensor | None, is_causal: str, scale: float | None, enable_gqa: bool,
             backend: str, return_lse: bool, allow_tf32: bool, workspace_bytes: int | None, window_left: int = -1,
             window_right: int = -1, softcap: float = 0.0, sinks: torch.Tensor | None = None,
             alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _check_flags(attn_mask, dropout_p, is_causal, rng)
    variants = _variants(window_left, window_right, softcap, sinks, alibi_slopes)
    # lse is always computed (B·H·L floats): the registered backward needs it whether or not the caller asked.
    if dropout_p > 0.0:
        return _sdpa_forward(query, key, value, attn_mask, is_causal=_CAUSAL[is_causal], scale=scale,
                             enable_gqa=enable_gqa, workspace_bytes=workspace_bytes, allow_tf32=allow_tf32,
                             backend=backend, dropout_p=dropout_p, rng=rng, variants=variants)
    window_size, softcap_, sinks_, slopes = variants
    return _sdpa_eager(query, key, value, attn_mask, dropout_p, _CAUSAL[is_causal], scale, enable_gqa,
                       window_size=window_size, softcap=softcap_, sinks=sinks_, alibi_slopes=slopes,
                       backend=backend, return_lse=True, allow_tf32=allow_tf32, workspace_bytes=workspace_bytes)


@_sdpa_op.register_fake
def _sdpa_fake(query, key, value, attn_mask, dropout_p, rng, is_causal, scale, enable_gqa, backend, return_lse,
               allow_tf32, workspace_bytes, window_left=-1, window_right=-1, softcap=0.0, sinks=None,
               alibi_slopes=None):
    _check_flags(attn_mask, dropout_p, is_causal, rng)
    if query.dim() < 3 or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(f"query, key and value must have the same number of axes (at least 3), got "
                         f"{query.dim()}, {key.dim()}, {value.dim()}")
    out = query.new_empty(tuple(query.shape[:-1]) + (value.shape[-1],))
    lse = query.new_empty(tuple(query.shape[:-1]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("cupy_attn::scaled_dot_product_attention_backward", mutates_args=())
def _sdpa_backward_op(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, dropout_p: float,
                      rng: torch.Tensor | None, is_causal: str, scale: float | None, enable_gqa: bool,
                      need_mask_grad: bool, allow_tf32: bool, workspace_bytes: int | None, window_left: int = -1,
                      window_right: int = -1, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                      alibi_slopes: torch.Tensor | None = None,
                      need_sinks_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    from .attention import autograd
    grad_out = grad_out.contiguous()
    dq, dk, dv, dmask = autograd.grad_inputs(query, key, value, attn_mask, out, lse, grad_out,
                                             is_causal=_CAUSAL[is_causal], scale=scale, enable_gqa=enable_gqa,
                                             need_mask_grad=need_mask_grad, workspace_bytes=workspace_bytes,
                                             allow_tf32=allow_tf32, dropout_p=dropout_p, rng=rng,
                                             variants=_variants(window_left, window_right, softcap, sinks,
                                                                alibi_slopes))
    dsinks = autograd.sinks_grad(sinks, out, lse, grad_out) if need_sinks_grad else query.new_empty((0,))
    return dq, dk, dv, query.new_empty((0,)) if dmask is None else dmask, dsinks


@_sdpa_backward_op.register_fake
def _sdpa_backward_fake(grad_out, query, key, value, attn_mask, out, lse, dropout_p, rng, is_causal, scale,
                        enable_gqa, need_mask_grad, allow_tf32, workspace_bytes, window_left=-1, window_right=-1,
                        softcap=0.0, sinks=None, alibi_slopes=None, need_sinks_grad=False):
    dmask = attn_mask.new_empty(attn_mask.shape) if need_mask_grad else query.new_empty((0,))
    dsinks = sinks.new_empty(sinks.shape) if need_sinks_grad else query.new_empty((0,))
    return (torch.empty_like(query, memory_format=torch.contiguous_format),
            torch.empty_like(key, memory_format=torch.contiguous_format),
            torch.empty_like(value, memory_format=torch.contiguous_format), dmask, dsinks)


def _sdpa_setup_context(ctx, inputs, output):
    (query, key, value, attn_mask, dropout_p, rng, is_causal, scale, enable_gqa, _, _, allow_tf32, workspace_bytes,
     window_left, window_right, softcap, sinks, alibi_slopes) = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, attn_mask, out, lse, rng, sinks, alibi_slopes)
    ctx.flags = (dropout_p, is_causal, scale, enable_gqa, allow_tf32, workspace_bytes, window_left, window_right,
                 softcap)


def _sdpa_backward(ctx, grad_out, _grad_lse):
    query, key, value, attn_mask, out, lse, rng, sinks, alibi_slopes = ctx.saved_tensors
    dropout_p, is_causal, scale, enable_gqa, allow_tf32, workspace_bytes, window_left, window_right, softcap = \
        ctx.flags
    need_mask = attn_mask is not None and ctx.needs_input_grad[3]
    need_sinks = sinks is not None and ctx.needs_input_grad[16]
    dq, dk, dv, dmask, dsinks = torch.ops.cupy_attn.scaled_dot_product_attention_backward(
        grad_out, query, key, value, attn_mask, out, lse, dropout_p, rng, is_causal, scale, enable_gqa, need_mask,
        allow_tf32, workspace_bytes, window_left, window_right, softcap, sinks, alibi_slopes, need_sinks)
    return (dq, dk, dv, dmask if need_mask else None) + (None,) * 12 + (dsinks if need_sinks else None, None)


_sdpa_op.register_autograd(_sdpa_backward, setup_context=_sdpa_setup_context)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, backend="auto", return_lse=False, allow_tf32=False,
                                 workspace_bytes=None, generator=None, window_size=None, softcap=None, sinks=None,
                                 alibi_slopes=None):
    """:func:`cupy_attn.scaled_dot_product_attention` (same arguments, results and errors) through the custom op.

    dropout_p > 0: the call's rng pair is drawn here from ``generator`` (torch.Generator or None: torch's default
    generator of the query's device; attention/dropout.draw), then handed to the op, which is deterministic given it.
    """
    dropout_p = float(dropout_p)
    rng = None
    if dropout_p > 0.0 and 0.0 <= dropout_p <= 1.0:
        rng = _dropout.torch_draw(query.device, generator)
    out, lse = torch.ops.cupy_attn.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, rng, causal_to_str(is_causal),
        None if scale is None else float(scale), bool(enable_gqa), backend, bool(return_lse), bool(allow_tf32),
        workspace_bytes, *window_to_ints(window_size), float(softcap or 0.0), sinks, alibi_slopes)
    return (out, lse) if return_lse else out


@torch.library.custom_op("cupy_attn::varlen_attention", mutates_args=())
def _varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
               seqused_k: torch.Tensor | None, block_table: torch.Tensor | None, is_causal: bool,
               scale: float | None, window_left: int, window_right: int, softcap: float, sinks: torch.Tensor | None,
               alibi_slopes: torch.Tensor | None, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    from .attention.varlen import varlen_attention
    window_size, softcap_, sinks_, slopes = _variants(window_left, window_right, softcap, sinks, alibi_slopes)
    return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
                            block_table=block_table, is_causal=is_causal, scale=scale, window_size=window_size,
                            softcap=softcap_, sinks=sinks_, alibi_slopes=slopes, backend=backend, return_lse=True)


@_varlen_op.register_fake
def _varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table, is_causal,
                 scale, window_left, window_right, softcap, sinks, alibi_slopes, backend):
    if q.dim() != 3 or v.dim() not in (3, 4):
        raise ValueError(f"q must be (total_q, Hq, E) and v (total_k, Hkv, Ev) or paged, got {tuple(q.shape)} and "
                         f"{tuple(v.shape)}")
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("cupy_attn::varlen_attention_backward", mutates_args=())
def _varlen_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                        seqused_k: torch.Tensor | None, is_causal: bool, scale: float | None, window_left: int,
                        window_right: int, softcap: float, sinks: torch.Tensor | None,
                        alibi_slopes: torch.Tensor | None,
                        need_sinks_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .attention import varlen
    window_size, softcap_, sinks_, slopes = _variants(window_left, window_right, softcap, sinks, alibi_slopes)
    vp = varlen.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
                             block_table=None, is_causal=is_causal, scale=scale, dropout_p=0.0, backend="auto",
                             window_size=window_size, softcap=softcap_, sinks=sinks_, alibi_slopes=slopes)
    dq, dk, dv, dsinks = varlen.backward_sequences(vp, out, lse, grad_out.contiguous(), sinks)
    return dq, dk, dv, dsinks if need_sinks_grad and dsinks is not None else q.new_empty((0,))


@_varlen_backward_op.register_fake
def _varlen_backward_fake(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          seqused_k, is_causal, scale, window_left, window_right, softcap, sinks, alibi_slopes,
                          need_sinks_grad):
    dsinks = sinks.new_empty(sinks.shape) if need_sinks_grad else q.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table, is_causal, scale,
     window_left, window_right, softcap, sinks, alibi_slopes, _) = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens_q, cu_seqlens_k, seqused_k, sinks, alibi_slopes)
    ctx.flags = (max_seqlen_q, max_seqlen_k, is_causal, scale, window_left, window_right, softcap)
    ctx.paged = block_table is not None


def _varlen_backward(ctx, grad_out, _grad_lse):
    if ctx.paged:
        raise NotImplementedError("varlen_attention under torch.compile: no backward through a block table (paged "
                                  "caches are for inference)")
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, sinks, alibi_slopes = ctx.saved_tensors
    max_seqlen_q, max_seqlen_k, is_causal, scale, window_left, window_right, softcap = ctx.flags
    need_sinks = sinks is not None and ctx.needs_input_grad[14]
    dq, dk, dv, dsinks = torch.ops.cupy_attn.varlen_attention_backward(
        grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, is_causal,
        scale, window_left, window_right, softcap, sinks, alibi_slopes, need_sinks)
    return (dq, dk, dv) + (None,) * 11 + (dsinks if need_sinks else None, None, None)


_varlen_op.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_k=None,
                     block_table=None, is_causal=False, scale=None, window_size=None, softcap=None, sinks=None,
                     alibi_slopes=None, dropout_p=0.0, return_lse=False, backend="auto"):
    """:func:`cupy_attn.varlen_attention` (same arguments, results and errors) through the custom op. dropout_p > 0
    raises NotImplementedError: the per-sequence path draws each sequence's dropout mask in its own dense call, which
    the op's backward could not reproduce."""
    if dropout_p:
        raise NotImplementedError("varlen_attention with dropout_p > 0 under torch.compile / torch.export")
    if is_causal not in (True, False, None, "bottom_right"):
        raise ValueError(f"is_causal must be a bool or 'bottom_right' (varlen masks are bottom-right aligned, as "
                         f"FlashAttention's), got {is_causal!r}")
    out, lse = torch.ops.cupy_attn.varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), seqused_k, block_table,
        bool(is_causal), None if scale is None else float(scale), *window_to_ints(window_size),
        float(softcap or 0.0), sinks, alibi_slopes, backend)
    return (out, lse) if return_lse else out


@torch.library.custom_op("cupy_attn::linear_batchnorm_softmax",
                         mutates_args=("running_mean", "running_var", "num_batches_tracked"))
def _lbs_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, running_mean: torch.Tensor | None,
            running_var: torch.Tensor | None, bn_weight: torch.Tensor | None, bn_bias: torch.Tensor | None,
            scale: torch.Tensor, training: bool, momentum: float | None, eps: float,
            num_batches_tracked: torch.Tensor | None, allow_tf32: bool | None) -> torch.Tensor:
    return _lbs_eager(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, training=training,
                      momentum=momentum, eps=eps, num_batches_tracked=num_batches_tracked, allow_tf32=allow_tf32)


@_lbs_op.register_fake
def _lbs_fake(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, training, momentum, eps,
              num_batches_tracked, allow_tf32):
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must have shape (N, K) and weight (F, K), got {tuple(x.shape)} and {tuple(weight.shape)}")
    return x.new_empty((x.shape[0], weight.shape[0]))


_F32 = torch.float32


def _absent(x: torch.Tensor, dtype=_F32) -> torch.Tensor:
    """The placeholder of an absent tensor result (the schemas have fixed return types): an empty (0,) tensor."""
    return x.new_empty((0,), dtype=dtype)


@torch.library.custom_op("cupy_attn::linear_batchnorm_softmax_forward", mutates_args=())
def _lbs_forward_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                    bn_weight: torch.Tensor | None, bn_bias: torch.Tensor | None, scale: torch.Tensor,
                    training: bool, momentum: float | None, eps: float, num_batches_tracked: torch.Tensor | None,
                    allow_tf32: bool | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor, torch.Tensor]:
    from .linear_bn_softmax.api import forward_saving
    update = training and running_mean is not None
    if update:  # functional: the update goes to copies, returned; the wrapper copies them into the buffers
        running_mean, running_var = running_mean.clone(), running_var.clone()
        if num_batches_tracked is not None:
            num_batches_tracked = num_batches_tracked.clone()
    out, y, stats = forward_saving(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale,
                                   training=training, momentum=momentum, eps=eps,
                                   num_batches_tracked=num_batches_tracked, allow_tf32=allow_tf32)
    counted = update and num_batches_tracked is not None
    return (out, y, stats, running_mean if update else _absent(x), running_var if update else _absent(x),
            num_batches_tracked if counted else _absent(x, torch.int64))


@_lbs_forward_op.register_fake
def _lbs_forward_fake(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, training, momentum, eps,
                      num_batches_tracked, allow_tf32):
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must have shape (N, K) and weight (F, K), got {tuple(x.shape)} and {tuple(weight.shape)}")
    from .linear_bn_softmax.launch import AFFINE_ROWS
    n, f = x.shape[0], weight.shape[0]
    update = training and running_mean is not None
    counted = update and num_batches_tracked is not None
    return (x.new_empty((n, f)), x.new_empty((n, f)), x.new_empty((AFFINE_ROWS, f), dtype=_F32),
            running_mean.new_empty(running_mean.shape) if update else _absent(x),
            running_var.new_empty(running_var.shape) if update else _absent(x),
            num_batches_tracked.new_empty(num_batches_tracked.shape) if counted else _absent(x, torch.int64))


@torch.library.custom_op("cupy_attn::linear_batchnorm_softmax_backward", mutates_args=())
def _lbs_backward_op(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor,
                     out: torch.Tensor, stats: torch.Tensor, bn_weight: torch.Tensor | None,
                     bn_bias: torch.Tensor | None, scale: torch.Tensor, use_batch_stats: bool, needs: list[bool],
                     allow_tf32: bool | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                       torch.Tensor, torch.Tensor]:
    from .linear_bn_softmax import autograd
    grads = autograd.grad_inputs(grad_out, x, weight, y, out, stats, bn_weight, bn_bias, scale,
                                 use_batch_stats=use_batch_stats, needs=tuple(needs), allow_tf32=allow_tf32)
    # The eager backward may return the per-feature gradients as views of one allocation; a custom op's outputs must
    # not alias each other, so views are copied here (F-element vectors: a few µs on the compiled path only).
    return tuple(_absent(x, x.dtype) if g is None else (g.clone() if g._base is not None else g) for g in grads)


@_lbs_backward_op.register_fake
def _lbs_backward_fake(grad_out, x, weight, y, out, stats, bn_weight, bn_bias, scale, use_batch_stats, needs,
                       allow_tf32):
    likes = (x, weight, x.new_empty((weight.shape[0],)), bn_weight, bn_bias, scale)
    return tuple(torch.empty_like(like, memory_format=torch.contiguous_format) if need else _absent(x, x.dtype)
                 for like, need in zip(likes, needs))


def _lbs_forward_setup_context(ctx, inputs, output):
    x, weight, bias, running_mean, _, bn_weight, bn_bias, scale, training, _, _, _, allow_tf32 = inputs
    out, y, stats = output[:3]
    ctx.save_for_backward(x, weight, y, out, stats, bn_weight, bn_bias, scale)
    ctx.flags = (bool(training) or running_mean is None, allow_tf32, bias is not None)


def _lbs_forward_backward(ctx, grad_out, *_grads_of_saved):
    x, weight, y, out, stats, bn_weight, bn_bias, scale = ctx.saved_tensors
    use_batch_stats, allow_tf32, has_bias = ctx.flags
    n = ctx.needs_input_grad  # inputs: x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, ...
    needs = [n[0], n[1], n[2] and has_bias, n[5] and bn_weight is not None, n[6] and bn_bias is not None, n[7]]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grads = torch.ops.cupy_attn.linear_batchnorm_softmax_backward(grad_out, x, weight, y, out, stats, bn_weight,
                                                                  bn_bias, scale, use_batch_stats, needs, allow_tf32)
    dx, dw, db, dg, dbeta, ds = (g if need else None for g, need in zip(grads, needs))
    return dx, dw, db, None, None, dg, dbeta, ds, None, None, None, None, None


_lbs_forward_op.register_autograd(_lbs_forward_backward, setup_context=_lbs_forward_setup_context)


def linear_batchnorm_softmax(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, *, training,
                             momentum=0.1, eps=1e-5, num_batches_tracked=None, allow_tf32=None):
    """:func:`cupy_attn.linear_batchnorm_softmax` (same arguments, results, in-place updates) through the custom ops.

    When autograd records the call (grad mode on, an argument requiring grad): the functional op
    ``linear_batchnorm_softmax_forward`` (differentiable; the mutable op cannot carry a backward formula), whose
    running-stat results are copied into the buffers here. Otherwise the mutable op, on detached inputs.
    """
    momentum = None if momentum is None else float(momentum)
    allow_tf32 = None if allow_tf32 is None else bool(allow_tf32)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, weight, bias, bn_weight, bn_bias, scale)):
        out, _, _, rm, rv, nbt = torch.ops.cupy_attn.linear_batchnorm_softmax_forward(
            x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, bool(training), momentum,
            float(eps), num_batches_tracked, allow_tf32)
        if training and running_mean is not None:
            running_mean.copy_(rm.detach())
            running_var.copy_(rv.detach())
            if num_batches_tracked is not None:
                num_batches_tracked.copy_(nbt)
        return out

    def d(t):
        return None if t is None else t.detach()
    # running stats are buffers (no grad) and mutated: passed as they are, so the mutation reaches them
    return torch.ops.cupy_attn.linear_batchnorm_softmax(
        x.detach(), weight.detach(), d(bias), running_mean, running_var, d(bn_weight), d(bn_bias), scale.detach(),
        bool(training), momentum, float(eps), num_batches_tracked, allow_tf32)
