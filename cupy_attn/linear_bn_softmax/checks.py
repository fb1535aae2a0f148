"""Argument checks for linear_batchnorm_softmax: every error is raised here, before anything is launched.

Kept cheap (no DLPack conversions, no device work): for torch callers the host time until the GEMM is enqueued shows
up as idle GPU time in a synchronized timing loop.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import numpy as np

from ..runtime import interop

# Keyed by dtype object: np.dtype.name costs ~3 µs a call, and the checks run on every call before the GEMM.
CODE_OF = {np.dtype(np.float32): 1, np.dtype(np.float16): 2}   # DtypeCode in the .cu; 0 = absent
try:
    import ml_dtypes  # NumPy's name for bfloat16 (a project dependency; without it bf16 arrays cannot occur)
    BF16 = np.dtype(ml_dtypes.bfloat16)
    CODE_OF[BF16] = 3
except ImportError:  # pragma: no cover
    BF16 = None
_CODE_OF, _BF16 = CODE_OF, BF16


@dataclasses.dataclass
class Arg:
    """One array argument: the object, its kind, NumPy dtype and shape."""

    obj: Any
    kind: str
    dtype: np.dtype
    shape: tuple

    def ptr(self) -> int:
        if self.kind == interop.TORCH:
            return self.obj.data_ptr()
        if self.kind == interop.CUPY:
            return self.obj.data.ptr
        return interop.dlpack_view(self.obj).data.ptr

    def strides(self) -> tuple:
        """Strides in elements."""
        if self.kind == interop.TORCH:
            return tuple(self.obj.stride())
        a = self.obj if self.kind == interop.CUPY else interop.dlpack_view(self.obj)
        return tuple(st // a.itemsize for st in a.strides)


@dataclasses.dataclass
class Call:
    ctx: interop.CallContext
    dtype: np.dtype
    n: int
    k: int
    f: int
    use_batch_stats: bool
    update_running: bool
    args: dict            # name -> Arg or None


def _arg(v: Any, name: str, ctx: interop.CallContext) -> Arg:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        # Fast path: a handful of attribute reads (~0.5 µs) instead of interop's generic kind/device/dtype helpers.
        dev = v.get_device()  # -1 on the CPU
        if (dev >= 0) != ctx.on_gpu:
            raise ValueError(f"{name} is on {'a GPU' if dev >= 0 else 'the CPU'} but x is not")
        kind = interop.TORCH if dev >= 0 else interop.TORCH_CPU
        if kind is not ctx.kind:
            interop.check_same_kind(name, kind, "x", ctx.kind)
        if dev >= 0 and dev != ctx.device_id:
            raise ValueError(f"{name} is on device {dev}, x on device {ctx.device_id}")
        return Arg(v, kind, interop.torch_to_numpy_dtype(v.dtype), tuple(v.shape))
    kind = interop.kind_of(v, name)
    if (kind in interop.CPU_KINDS) != (not ctx.on_gpu):
        raise ValueError(f"{name} is on {'the CPU' if kind in interop.CPU_KINDS else 'a GPU'} but x is not")
    interop.check_same_kind(name, kind, "x", ctx.kind)
    if ctx.on_gpu:
        dev = interop.device_of(v, kind)
        if dev != ctx.device_id:
            raise ValueError(f"{name} is on device {dev}, x on device {ctx.device_id}")
    return Arg(v, kind, interop.dtype_of(v, kind), tuple(int(d) for d in v.shape))


def _vector(v: Any, name: str, f: int, ctx: interop.CallContext, *, allow_scalar: bool = False) -> Arg | None:
    """A per-feature vector: shape (F,) (or (1,)/() when allow_scalar), float32/float16/bfloat16, x's device."""
    if v is None:
        return None
    a = _arg(v, name, ctx)
    if a.dtype not in _CODE_OF:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {a.dtype.name}")
    if not (a.shape == (f,) or (allow_scalar and a.shape in ((1,), ()))):
        want = f"({f},), (1,) or ()" if allow_scalar else f"({f},)"
        raise ValueError(f"{name} must have shape {want} (axis 0 = out_features), got {a.shape}")
    return a


def check(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, training, momentum, eps,
           num_batches_tracked) -> Call:
    ctx = interop.context_for(x, "x")
    xa = _arg(x, "x", ctx)
    if xa.dtype not in _CODE_OF:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {xa.dtype.name}")
    if len(xa.shape) != 2:
        raise ValueError(f"x must be 2-D (batch, in_features), got shape {xa.shape}")
    n, k = xa.shape
    wa = _arg(weight, "weight", ctx)
    if wa.dtype != xa.dtype:
        raise TypeError(f"weight dtype {wa.dtype.name} differs from x dtype {xa.dtype.name}")
    if len(wa.shape) != 2:
        raise ValueError(f"weight must be 2-D (out_features, in_features), got shape {wa.shape}")
    if wa.shape[1] != k:
        raise ValueError(f"weight axis 1 (in_features) is {wa.shape[1]} but x axis 1 is {k}")
    f = wa.shape[0]
    args = {"x": xa, "weight": wa}
    args["bias"] = _vector(bias, "bias", f, ctx)
    if args["bias"] is not None and args["bias"].dtype != xa.dtype:
        raise TypeError(f"bias dtype must equal x dtype {xa.dtype.name}, got {args['bias'].dtype.name}")
    args["gamma"] = _vector(bn_weight, "bn_weight", f, ctx)
    args["beta"] = _vector(bn_bias, "bn_bias", f, ctx)
    if scale is None:
        raise TypeError("scale must be a number or an array of shape (1,), () or (out_features,), got None")
    args["scale"] = _vector(scale, "scale", f, ctx, allow_scalar=True)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must both be given or both be None")
    args["running_mean"] = _vector(running_mean, "running_mean", f, ctx)
    args["running_var"] = _vector(running_var, "running_var", f, ctx)
    if running_mean is not None:
        if args["running_mean"].dtype != args["running_var"].dtype:
            raise TypeError("running_mean and running_var must have the same dtype")
        if ctx.on_gpu and f > 1 and (args["running_mean"].strides()[0] != 1 or args["running_var"].strides()[0] != 1):
            raise ValueError("running_mean and running_var must be contiguous: they are updated in place")
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(f"training must be a bool, got {type(training).__name__}")
    if momentum is not None and not isinstance(momentum, (int, float)):
        raise TypeError(f"momentum must be a float or None, got {type(momentum).__name__}")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    use_batch_stats = bool(training) or running_mean is None
    update_running = bool(training) and running_mean is not None
    if update_running and momentum is None and num_batches_tracked is None:
        raise ValueError("momentum=None (cumulative moving average) needs num_batches_tracked")
    args["num_batches_tracked"] = None
    if num_batches_tracked is not None:
        a = _arg(num_batches_tracked, "num_batches_tracked", ctx)
        if a.dtype != np.int64 or math.prod(a.shape) != 1:
            raise TypeError("num_batches_tracked must be a one-element int64 array")
        args["num_batches_tracked"] = a
    if use_batch_stats and n == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {(n, f)}")
    return Call(ctx, xa.dtype, n, k, f, use_batch_stats, update_running, args)

