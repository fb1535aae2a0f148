"""Autograd for linear_batchnorm_softmax on torch tensors.

The forward autograd records keeps out, y (its bias-free GEMM result) and the (5, F) float32 Affine (mean and invstd in
rows 0 and 4) in per-call buffers (api.forward_saving); the backward is backward.grad_inputs (two kernels after which
cuBLAS computes dx = dy·W and dW = dyᵀ·x). Nothing is recomputed by GEMM.

Used by the public function when autograd would record the call (grad mode on and x, weight, bias, bn_weight, bn_bias
or scale requiring grad); calls under ``torch.no_grad()``/``inference_mode`` or on tensors that need no grad keep the
forward-only path and its speed. Eager calls take the torch.autograd.Function here (no dispatcher: ~50 µs less host
time than the custom op); traced calls (torch.compile) take the functional custom op
``cupy_attn::linear_batchnorm_softmax_forward`` with its registered backward (cupy_attn.torch_ops), whose
implementations are :func:`forward_saving`'s and :func:`grad_inputs`. CPU tensors take the reference math in
differentiable float64 torch ops (:func:`cpu_reference`).

Train and eval alike: with running statistics (eval) the BatchNorm is a per-feature affine map and its backward drops
the batch-statistics terms; with batch statistics (training, or no running stats) they are included.
Double backward is not supported (the backward is not differentiable: once_differentiable raises).
"""
from __future__ import annotations

import functools

import sys

import numpy as np

from .. import reference
from ..runtime import interop


def needs_grad(x, weight, bias, bn_weight, bn_bias, scale) -> bool:
    """True when autograd would record this call: torch tensors, grad mode on, one of the differentiable arguments
    requiring grad. ~0.1 µs for CuPy/NumPy inputs or under no_grad."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor) or not torch.is_grad_enabled():
        return False
    return (x.requires_grad or getattr(weight, "requires_grad", False) or getattr(bias, "requires_grad", False)
            or getattr(bn_weight, "requires_grad", False) or getattr(bn_bias, "requires_grad", False)
            or getattr(scale, "requires_grad", False))


def cpu_reference(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, *, training, momentum, eps,
                  num_batches_tracked):
    """CPU torch tensors that autograd records: the reference math in float64 torch ops (differentiable), cast to x's
    dtype; the running stats and num_batches_tracked are updated in place by the NumPy reference, as on the
    forward-only CPU path. Slow, for checking, like the rest of the CPU path."""
    from .api import run_reference
    from .checks import check
    torch = sys.modules["torch"]
    call = check(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, training, momentum, eps,
                 num_batches_tracked)
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    if call.use_batch_stats:
        if call.n == 0:
            mean, var = y.sum(0), y.sum(0) + 1.0  # no rows: nothing to normalize (the result is empty)
        else:
            mean, var = y.mean(0), y.var(0, unbiased=False)
    else:
        mean, var = running_mean.double(), running_var.double()
    z = (y - mean) / torch.sqrt(var + eps)
    if bn_weight is not None:
        z = z * bn_weight.double()
    if bn_bias is not None:
        z = z + bn_bias.double()
    out = torch.softmax(scale.double().reshape(-1) * z, dim=1).to(x.dtype)
    with torch.no_grad():  # the running-stat update, in place, by the reference (its output is not used)
        run_reference(call, *(None if t is None else t.detach() for t in (x, weight, bias)), running_mean,
                       running_var, *(None if t is None else t.detach() for t in (bn_weight, bn_bias, scale)),
                       training, momentum, eps, num_batches_tracked)
    return out


def grad_inputs(grad_out, x, weight, y, out, stats, bn_weight, bn_bias, scale, *, use_batch_stats: bool,
                needs: tuple, allow_tf32):
    """(dx, dweight, dbias, dbn_weight, dbn_bias, dscale): backward.grad_inputs on CUDA tensors, the float64 reference
    (reference.linear_batchnorm_softmax_backward, cast to each argument's dtype) on CPU tensors; None where ``needs``
    is False. allow_tf32 None: torch.backends.cuda.matmul.allow_tf32."""
    torch = sys.modules["torch"]
    if grad_out.is_cuda:
        from . import backward
        if allow_tf32 is None:
            allow_tf32 = torch.backends.cuda.matmul.allow_tf32
        return backward.grad_inputs(grad_out, x, weight, y, out, stats, bn_weight, bn_bias, scale,
                                    use_batch_stats=use_batch_stats, needs=tuple(needs), allow_tf32=bool(allow_tf32))

    def host(t):
        return None if t is None else t.detach().double().numpy()
    from .launch import AFFINE_INVSTD, AFFINE_MU
    s = host(stats)
    g = reference.linear_batchnorm_softmax_backward(
        host(grad_out), host(x), host(weight), host(out), host(y), s[AFFINE_MU], s[AFFINE_INVSTD], host(bn_weight),
        host(bn_bias), host(scale), use_batch_stats=use_batch_stats)
    likes = (x, weight, x, bn_weight, bn_bias, scale)
    result = []
    for key, like, need in zip(("x", "weight", "bias", "bn_weight", "bn_bias", "scale"), likes, needs):
        result.append(torch.from_numpy(np.array(g[key])).to(like.dtype) if need else None)  # 0-d stays 0-d
    return tuple(result)


@functools.cache
def _function():
    """The torch.autograd.Function, built on first use (cupy_attn never imports torch itself).

    apply takes the six differentiable tensors and one tuple of everything else (running stats, the batch counter
    and the flags): autograd inspects every argument of apply, and these need no gradient. The forward computes
    which gradients the backward will need (ctx.needs_input_grad is known then) and keeps, with the forward's
    call-cache entry, the dict in which backward.grad_inputs keeps its prepared call for the layout, so that the
    backward of a repeated step does not check or plan again."""
    torch = sys.modules["torch"]
    from torch.autograd.function import once_differentiable

    from . import backward as _backward
    from .api import forward_saving_entry

    class LinearBatchNormSoftmax(torch.autograd.Function):
        @staticmethod
        def forward(fctx, x, weight, bias, bn_weight, bn_bias, scale, rest):
            running_mean, running_var, num_batches_tracked, training, momentum, eps, allow_tf32 = rest
            out, y, stats, entry = forward_saving_entry(
                x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, training=training,
                momentum=momentum, eps=eps, num_batches_tracked=num_batches_tracked, allow_tf32=allow_tf32)
            fctx.save_for_backward(x, weight, y, out, stats, bn_weight, bn_bias, scale)
            n = fctx.needs_input_grad
            needs = (n[0], n[1], n[2] and bias is not None, n[3] and bn_weight is not None,
                     n[4] and bn_bias is not None, n[5])
            fctx.flags = (bool(training) or running_mean is None, allow_tf32, needs,
                          None if entry is None else entry.backward_calls)
            return out

        @staticmethod
        def backward(fctx, grad_out):
            # Grad mode is on in a backward only under create_graph=True: then once_differentiable's wrapper (a
            # double backward raises). Otherwise that wrapper would only add a no_grad block around the body
            # (~1.5 µs of host time locally, several on a slower host).
            if is_grad_enabled():
                return backward_once(fctx, grad_out)
            return backward_body(fctx, grad_out)

    def backward_body(fctx, grad_out):
        x, weight, y, out, stats, bn_weight, bn_bias, scale = fctx.saved_tensors
        use_batch_stats, allow_tf32, needs, memo = fctx.flags
        grads = _backward.grad_inputs(grad_out, x, weight, y, out, stats, bn_weight, bn_bias, scale,
                                      use_batch_stats=use_batch_stats, needs=needs, allow_tf32=allow_tf32, memo=memo)
        return (*grads, None)

    backward_once = once_differentiable(backward_body)
    is_grad_enabled = torch.is_grad_enabled
    return LinearBatchNormSoftmax


def apply(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, *, training, momentum, eps,
          num_batches_tracked, allow_tf32):
    """The recorded call (``needs_grad`` was True): out, differentiable with respect to x, weight, bias, bn_weight,
    bn_bias and scale. CPU tensors: :func:`cpu_reference`; tracing tensors (make_fx): the custom op; CUDA tensors:
    the autograd Function (allow_tf32 None resolved now, so that forward and backward agree)."""
    torch = sys.modules["torch"]
    if interop.is_tracing_tensor(x):
        from .. import torch_ops
        return torch_ops.linear_batchnorm_softmax(x, weight, bias, running_mean, running_var, bn_weight, bn_bias,
                                                  scale, training=training, momentum=momentum, eps=eps,
                                                  num_batches_tracked=num_batches_tracked, allow_tf32=allow_tf32)
    if not x.is_cuda:
        return cpu_reference(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale,
                             training=training, momentum=momentum, eps=eps, num_batches_tracked=num_batches_tracked)
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    return _function().apply(x, weight, bias, bn_weight, bn_bias, scale,
                             (running_mean, running_var, num_batches_tracked, training, momentum, eps,
                              bool(allow_tf32)))
