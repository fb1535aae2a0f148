"""Public entry point of Linear → BatchNorm1d → scale → softmax: the call cache, the checks, the CPU reference path,
then the prepared launch (see launch.py for the kernels and their order).
"""
from __future__ import annotations

import sys

import numpy as np

from .. import reference
from ..runtime import callcache, interop
from ..runtime.kernel_abi import LOG2E
from . import autograd as _autograd
from .checks import check
from .launch import (AFFINE_ROWS, Y_WORKSPACE_MAX_BYTES, Entry, Prepared, VECTORS, cupy_view,  # noqa: F401
                     empty_output, torch_alloc, unit_last_stride, vector_ptr)


def linear_batchnorm_softmax(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, *, training,
                             momentum=0.1, eps=1e-5, num_batches_tracked=None, allow_tf32=None):
    """``softmax(scale · batch_norm(x · weightᵀ + bias), dim=1)``: torch's Linear → BatchNorm1d → ·scale → softmax.

    Shapes: x (N, K); weight (F, K); bias (F,) or None; running_mean, running_var (F,), or both None
    (track_running_stats=False); bn_weight, bn_bias (F,) or None (affine=False); scale (1,), () or (F,), or a Python
    number (int or float, used as a float32 scalar: a one-element array of x's kind is made for it, on the GPU a
    4-byte allocation and fill per call);
    num_batches_tracked: one-element int64 array or None.
    dtypes: x, weight and bias float32, float16 or bfloat16, all equal; the per-feature vectors may each be float32,
    float16 or bfloat16 (e.g. fp32 BatchNorm parameters with fp16 activations). Statistics, the affine and the softmax
    are computed in fp32; the output has x's dtype.

    training=True: normalize with the batch mean and biased batch variance of x·Wᵀ + bias; when running stats are
    given, update them **in place** like torch: running_mean ← (1−m)·running_mean + m·mean, running_var ← (1−m)·
    running_var + m·var·N/(N−1), m = momentum, or 1/(num_batches_tracked+1) when momentum is None (cumulative
    average); num_batches_tracked (if given) += 1. training=False: normalize with the running stats (batch stats when
    they are None, as torch does). eps is added to the variance.

    allow_tf32: fp32 GEMM on TF32 tensor cores. None = torch.backends.cuda.matmul.allow_tf32 for torch inputs, False
    otherwise (exact fp32). Ignored for fp16/bf16.

    Inputs: torch CUDA tensors / CuPy arrays (zero-copy, result of the same kind on the caller's stream; torch inputs
    run on torch's current stream), or NumPy arrays / CPU torch tensors, which run the float64 reference
    (:func:`cupy_attn.reference.linear_batchnorm_softmax`) and update their running stats in place too. x and weight
    are copied only when their last axis is not unit-stride, the small per-feature vectors only when not contiguous.

    Autograd (torch tensors, grad mode on, x, weight, bias, bn_weight, bn_bias or scale requiring grad): the result is
    differentiable with respect to those six, in training and in eval mode (with running statistics BatchNorm is a
    per-feature affine map and its backward one too). The recorded forward keeps y = x·Wᵀ (bias-free, x's dtype) and
    the per-feature mean/invstd in per-call buffers (:func:`forward_saving`); the backward (backward.py,
    cuda_src/linear_bn_softmax/backward.cu) runs two kernels: delta = rowsum(dout ∘ out), then per feature the
    column sums A = Σ_n dz and B = Σ_n dz·ŷ of dz = out ∘ (dout − delta) (dβ = scale·A, dγ = scale·B, dscale =
    γ·B + β·A, summed over features for a one-element scale) and dy = γ·scale·invstd·(dz − A/N − ŷ·B/N) (the
    BatchNorm training backward, Ioffe & Szegedy 2015; without the A and B terms in eval), and cuBLASLt dx = dy·W,
    dW = dyᵀ·x; dbias = Σ_n dy, which is 0 with batch statistics. Gradients have their argument's dtype (fp32
    BatchNorm parameters next to fp16 x get fp32 gradients); gradients not needed are not computed (no dx GEMM for
    data that needs none). Double backward is not supported (RuntimeError). Calls under torch.no_grad /
    inference_mode, or on tensors that need no grad, keep the forward-only path. CPU tensors: the reference math in
    differentiable float64 torch ops. Under torch.compile: the functional op pair
    ``torch.ops.cupy_attn.linear_batchnorm_softmax_forward`` / ``_backward`` (cupy_attn.torch_ops).

    Algorithm: cuBLASLt y = x·Wᵀ (fp32 compute, bias left out: it cancels in the batch-normalized output and is added
    to the running mean; in eval it folds into the shift mu), into a per-stream workspace (up to
    Y_WORKSPACE_MAX_BYTES = 64 MiB; larger y goes into the output buffer). Training: one kernel for per-feature
    batched-Welford/Chan statistics (Chan, Golub & LeVeque 1979) folded into (mu, a, d) plus the running-stat update;
    eval: one thread-per-feature kernel folding the running stats. Then one kernel for a·(y − mu) + d and the row
    softmax (a row held in registers for F ≤ 8192, two passes beyond). On sm_90+ both kernels are launched as
    programmatic dependents (PDL: each launches while the previous kernel drains, and waits inside for its
    output). Empty batches return an empty result (training still counts num_batches_tracked). Repeated calls with torch CUDA tensors (nn.Parameters included) or CuPy arrays
    of the same layout, flags and stream replay the first call's prepared launches (cupy_attn.runtime.callcache).
    Under torch.compile / torch.export and for FakeTensor inputs, torch tensors go through the custom op
    ``torch.ops.cupy_attn.linear_batchnorm_softmax`` (cupy_attn.torch_ops; running stats declared mutated), one
    graph node; eager calls skip it (its dispatch would add ~50 µs of host time).

    Returns: (N, F) array of x's kind and dtype.
    Raises: TypeError for non-arrays and unsupported dtypes, and for arrays of another kind than x's (NumPy or CuPy
    next to torch); ValueError for shapes (naming argument and axis), devices,
    running stats given by halves or not contiguous, momentum=None without num_batches_tracked, and batch size 1 when
    batch statistics are used ("Expected more than 1 value per channel when training").
    """
    if isinstance(scale, _NUMBERS) and not isinstance(scale, (bool, np.bool_)):
        scale = _scale_array(scale, x)  # a Python number: a (1,) float32 array of x's kind, keyed like any array
    traced = interop.torch_compiling()  # Dynamo must see one opaque op, never the call cache's key
    if not traced and _autograd.needs_grad(x, weight, bias, bn_weight, bn_bias, scale):  # autograd records the call
        return _autograd.apply(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale,
                               training=training, momentum=momentum, eps=eps,
                               num_batches_tracked=num_batches_tracked, allow_tf32=allow_tf32)
    arrays = (x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, num_batches_tracked)
    call_key = None if traced else _call_key(arrays, training, momentum, eps, allow_tf32)
    if call_key is not None:
        entry = callcache.get(call_key)
        if entry is not None:  # the same layout, flags and stream ran before: replay its launches (see Prepared)
            return entry(arrays)
    elif traced or interop.is_tracing_tensor(x):  # or FakeTensor / FunctionalTensor inputs (make_fx, AOTAutograd)
        from .. import torch_ops
        return torch_ops.linear_batchnorm_softmax(x, weight, bias, running_mean, running_var, bn_weight, bn_bias,
                                                  scale, training=training, momentum=momentum, eps=eps,
                                                  num_batches_tracked=num_batches_tracked, allow_tf32=allow_tf32)
    call = check(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, training, momentum, eps,
                  num_batches_tracked)
    if not call.ctx.on_gpu:
        return run_reference(call, x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale,
                              training, momentum, eps, num_batches_tracked)
    ctx = call.ctx
    if allow_tf32 is None:
        allow_tf32 = bool(ctx.kind == interop.TORCH and sys.modules["torch"].backends.cuda.matmul.allow_tf32)
    n, f = call.n, call.f
    with ctx.activate():
        if n * f == 0:
            nbt = call.args["num_batches_tracked"]
            if call.update_running and nbt is not None:
                cupy_view(nbt)[...] += 1   # torch counts an empty batch too (and leaves the stats alone)
            return empty_output(ctx, (n, f), call.dtype, like=x)[0]
        xa, wa = (unit_last_stride(call.args[name]) for name in ("x", "weight"))
        prepared = Prepared(call, momentum, eps, bool(allow_tf32), xa.strides()[0], wa.strides()[0])
        keep: list = []  # contiguous copies of strided vectors, alive until the launches are enqueued
        vectors = tuple(0 if call.args[name] is None else vector_ptr(call.args[name], keep) for name in VECTORS)
        out_native = prepared.execute(lambda: empty_output(ctx, (n, f), call.dtype, like=x), xa.ptr(), wa.ptr(),
                                      vectors)
        if call_key is not None and not keep and xa is call.args["x"] and wa is call.args["weight"]:
            callcache.put(call_key, Entry(prepared, ctx, (n, f)))
    return out_native



def forward_saving(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, *, training, momentum,
                   eps, num_batches_tracked, allow_tf32):
    """The forward that autograd records (torch tensors; the arguments, checks, errors and in-place running-stat
    updates of :func:`linear_batchnorm_softmax`): returns (out, y, stats) for the backward.

    out: (N, F) in x's dtype, as the plain call returns. y: (N, F) in x's dtype, x·weightᵀ without the Linear bias,
    the values the statistics and the normalization read. stats: (AFFINE_ROWS = 5, F) float32, the folded per-feature
    Affine: row 0 the bias-free mean the forward normalized with (batch mean of y, or running_mean − bias), row 4
    invstd = 1/sqrt(var + eps) (rows 1–3 are the kernels' slope and shifts in log2 units). All three are fresh
    tensors from torch's allocator (the plain call's y lives in a per-stream workspace that the next call
    overwrites). CPU tensors: the float64 reference, rounded to the same dtypes. Repeated calls replay a cached
    launch, as the plain call does (keyed apart from it).
    """
    return forward_saving_entry(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale,
                                training=training, momentum=momentum, eps=eps,
                                num_batches_tracked=num_batches_tracked, allow_tf32=allow_tf32)[:3]


def forward_saving_entry(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, *, training,
                         momentum, eps, num_batches_tracked, allow_tf32):
    """:func:`forward_saving`, and the call-cache entry that ran it (None when the call is not cached: CPU tensors,
    copied inputs, uncacheable kinds). The entry's ``backward_calls`` dict is where backward.grad_inputs keeps its
    prepared call for this layout (its ``memo``), so that a repeated training step's backward skips its checks."""
    arrays = (x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, num_batches_tracked)
    call_key = _call_key(arrays, training, momentum, eps, allow_tf32)
    if call_key is not None:
        call_key = ("saving", call_key)
        entry = callcache.get(call_key)
        if entry is not None:
            return (*entry.saving(arrays), entry)
    call = check(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, training, momentum, eps,
                  num_batches_tracked)
    if not call.ctx.on_gpu:
        return (*_reference_saving(call, x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale,
                                   training, momentum, eps, num_batches_tracked), None)
    if call.ctx.kind != interop.TORCH:
        raise TypeError("forward_saving takes torch tensors (autograd); got " + type(x).__name__)
    ctx = call.ctx
    if allow_tf32 is None:
        allow_tf32 = bool(sys.modules["torch"].backends.cuda.matmul.allow_tf32)
    n, f = call.n, call.f
    alloc = torch_alloc(x)
    entry = None
    with ctx.activate():
        if n * f == 0:
            nbt = call.args["num_batches_tracked"]
            if call.update_running and nbt is not None:
                cupy_view(nbt)[...] += 1   # torch counts an empty batch too (and leaves the stats alone)
            stats = alloc((AFFINE_ROWS, f), True)[0].zero_()
            return alloc((n, f), False)[0], alloc((n, f), False)[0], stats, None
        xa, wa = (unit_last_stride(call.args[name]) for name in ("x", "weight"))
        prepared = Prepared(call, momentum, eps, bool(allow_tf32), xa.strides()[0], wa.strides()[0])
        keep: list = []
        vectors = tuple(0 if call.args[name] is None else vector_ptr(call.args[name], keep) for name in VECTORS)
        result = prepared.execute_saving(alloc, xa.ptr(), wa.ptr(), vectors)
        if call_key is not None and not keep and xa is call.args["x"] and wa is call.args["weight"]:
            entry = Entry(prepared, ctx, (n, f))
            callcache.put(call_key, entry)
    return (*result, entry)


def _reference_saving(call, x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, training,
                      momentum, eps, num_batches_tracked):
    """forward_saving for CPU inputs: (out, y, stats) from the float64 reference; y in x's dtype, stats float32."""
    def host(v):
        return None if v is None else np.asarray(interop.to_numpy(v, interop.kind_of(v, "argument")),
                                                 dtype=np.float64)
    n, f = call.n, call.f
    y = host(x) @ host(weight).T
    if not call.use_batch_stats:
        mu, var = host(running_mean) - (0.0 if bias is None else host(bias)), host(running_var)
    elif n == 0:
        mu, var = np.zeros(f), np.ones(f)
    else:
        mu, var = y.mean(axis=0), y.var(axis=0)
    invstd = 1.0 / np.sqrt(var + eps)
    gamma = np.ones(f) if bn_weight is None else host(bn_weight)
    beta = np.zeros(f) if bn_bias is None else host(bn_bias)
    s = np.broadcast_to(host(scale).reshape(-1), (f,)) * LOG2E
    a, d = gamma * invstd * s, beta * s
    stats = np.stack([mu, a, d, d - a * mu, invstd])  # launch.AFFINE_ROWS: mu, a, d, b, invstd
    out = run_reference(call, x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, training,
                         momentum, eps, num_batches_tracked)
    return (out, interop.from_numpy(y, call.ctx.kind, call.dtype),
            interop.from_numpy(stats, call.ctx.kind, np.dtype(np.float32)))


_NUMBERS = (int, float, np.integer, np.floating)


def _scale_array(value, x):
    """A Python/NumPy number as a (1,) float32 array of x's kind, on x's device (the caller's stream for GPU kinds)."""
    kind = interop.kind_of(x, "x")
    if kind in (interop.TORCH, interop.TORCH_CPU):
        torch = sys.modules["torch"]
        return torch.full((1,), float(value), dtype=torch.float32, device=x.device)
    if kind == interop.NUMPY:
        return np.full(1, value, dtype=np.float32)
    import cupy
    with cupy.cuda.Device(interop.device_of(x, kind)):
        return cupy.full(1, value, dtype=cupy.float32)


def _call_key(arrays: tuple, training, momentum, eps, allow_tf32) -> tuple | None:
    """Call-cache key (see cupy_attn.runtime.callcache): the arrays' signatures and stream (callcache.signatures),
    the flags with their types, and the TF32 setting that applies (torch's global flag when allow_tf32 is None)."""
    sigs = callcache.signatures(arrays)
    if sigs is None:
        return None
    if allow_tf32 is None and sigs[0] == interop.TORCH:
        allow_tf32 = sys.modules["torch"].backends.cuda.matmul.allow_tf32
    return ("linear_batchnorm_softmax", *sigs, type(training), training, type(momentum), momentum, type(eps), eps,
            type(allow_tf32), allow_tf32)


def run_reference(call, x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, training,
                   momentum, eps, num_batches_tracked):
    """CPU inputs: the float64 reference; running stats and num_batches_tracked updated in place."""
    def host(v):
        return None if v is None else np.asarray(interop.to_numpy(v, interop.kind_of(v, "argument")),
                                                 dtype=np.float64)
    nbt = None
    if num_batches_tracked is not None:
        kind = interop.kind_of(num_batches_tracked, "num_batches_tracked")
        nbt = int(np.asarray(interop.to_numpy(num_batches_tracked, kind)).ravel()[0])
    out, rm, rv, nbt_new = reference.linear_batchnorm_softmax(
        host(x), host(weight), host(bias), host(running_mean), host(running_var), host(bn_weight), host(bn_bias),
        host(scale), training=bool(training), momentum=momentum, eps=eps, num_batches_tracked=nbt)
    for dst, new in ((running_mean, rm), (running_var, rv)):
        if dst is not None and new is not None:
            _write_in_place(dst, new)
    if num_batches_tracked is not None and nbt_new is not None:
        _write_in_place(num_batches_tracked, np.full(num_batches_tracked.shape, nbt_new, dtype=np.int64))
    return interop.from_numpy(out, call.ctx.kind, call.dtype)


def _write_in_place(dst, new: np.ndarray) -> None:
    if interop.is_torch_tensor(dst):
        import torch
        with torch.no_grad():
            # reshape: ascontiguousarray makes 0-d arrays 1-d, and BatchNorm1d's num_batches_tracked is 0-d
            dst.copy_(torch.from_numpy(np.ascontiguousarray(new).reshape(dst.shape)).to(dst.dtype))
    else:
        dst[...] = new.astype(dst.dtype)
