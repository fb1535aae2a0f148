"""torch modules over cupy_attn's kernels (import only where torch is installed).

LinearBatchNormSoftmax: a drop-in for ``softmax(scale · BatchNorm1d(Linear(x)), dim=1)``, the module

    class Model(nn.Module):
        def __init__(self, in_features, out_features):
            self.gemm = nn.Linear(in_features, out_features)
            self.bn = nn.BatchNorm1d(out_features)
            self.scale = nn.Parameter(torch.ones(1))
        def forward(self, x):
            return torch.softmax(self.scale * self.bn(self.gemm(x)), dim=1)

with the same submodules and parameters, hence the same state_dict keys and shapes (gemm.weight, gemm.bias, bn.weight,
bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked, scale): weights load across in both directions.

Importing this module also registers the custom ops of cupy_attn.torch_ops (``torch.ops.cupy_attn.*``), which the
entry points use under torch.compile: a model calling cupy_attn compiles with ``fullgraph=True``.
"""
from __future__ import annotations

import torch
from torch import nn

from . import torch_ops  # noqa: F401  (registers torch.ops.cupy_attn.*)
from .linear_bn_softmax import linear_batchnorm_softmax

__all__ = ["LinearBatchNormSoftmax"]


class LinearBatchNormSoftmax(nn.Module):
    """``softmax(scale · bn(gemm(x)), dim=1)`` with the fused cupy_attn forward on CUDA tensors.

    Args: in_features, out_features; bias (Linear bias); eps, momentum (None = cumulative average), affine,
    track_running_stats (BatchNorm1d's); scale_shape: (1,) as in the plain model, or (out_features,); device, dtype.

    forward(x): x (N, in_features) CUDA tensor, float32/float16/bfloat16 → (N, out_features), same dtype. Train/eval
    follow ``self.bn.training`` (set by ``.train()``/``.eval()``); in training the running stats and
    num_batches_tracked are updated in place, as nn.BatchNorm1d does. fp32 GEMMs use TF32 only when
    ``torch.backends.cuda.matmul.allow_tf32`` is set.

    Training: when autograd records the call (grad mode on, x or a parameter requiring grad) the fused forward keeps
    y and the per-feature mean/invstd, and backward runs two kernels (softmax, scale and BatchNorm backward) and
    cuBLAS for dx and the Linear weight (:func:`cupy_attn.linear_batchnorm_softmax`); gradients reach x,
    gemm.weight, gemm.bias, bn.weight, bn.bias and scale, in train and eval mode. Calls under ``torch.no_grad()`` /
    ``torch.inference_mode()`` keep the forward-only path. CPU tensors run the plain torch ops.
    Raises ValueError for batch size 1 in training (torch's message) and for bad shapes, before any launch.
    Under ``torch.compile`` (``fullgraph=True`` and ``mode="reduce-overhead"`` included) the fused path is one custom
    op node, ``torch.ops.cupy_attn.linear_batchnorm_softmax``, whose running-stat updates are declared mutations.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, eps: float = 1e-5,
                 momentum: float | None = 0.1, affine: bool = True, track_running_stats: bool = True,
                 scale_shape: tuple[int, ...] = (1,), device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.gemm = nn.Linear(in_features, out_features, bias=bias, **kw)
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum, affine=affine,
                                 track_running_stats=track_running_stats, **kw)
        if tuple(scale_shape) not in ((1,), (out_features,)):
            raise ValueError(f"scale_shape must be (1,) or ({out_features},), got {tuple(scale_shape)}")
        self.scale = nn.Parameter(torch.ones(tuple(scale_shape), **kw))

    @classmethod
    def from_module(cls, plain: nn.Module) -> "LinearBatchNormSoftmax":
        """A fused module with ``plain``'s configuration, device, dtype, weights, buffers and train/eval mode.

        ``plain`` needs ``gemm`` (nn.Linear), ``bn`` (nn.BatchNorm1d) and ``scale`` (Parameter) attributes, like the
        model in this module's docstring. The tensors are copied, not shared.
        """
        for name in ("gemm", "bn", "scale"):
            if not hasattr(plain, name):
                raise TypeError(f"from_module: {type(plain).__name__} has no attribute {name!r}")
        gemm, bn, scale = plain.gemm, plain.bn, plain.scale
        if not isinstance(gemm, nn.Linear) or not isinstance(bn, nn.BatchNorm1d):
            raise TypeError("from_module: plain.gemm must be nn.Linear and plain.bn nn.BatchNorm1d")
        fused = cls(gemm.in_features, gemm.out_features, bias=gemm.bias is not None, eps=bn.eps,
                    momentum=bn.momentum, affine=bn.affine, track_running_stats=bn.track_running_stats,
                    scale_shape=tuple(scale.shape), device=gemm.weight.device, dtype=gemm.weight.dtype)
        fused.load_state_dict(plain.state_dict())
        fused.train(plain.training)
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return torch.softmax(self.scale * self.bn(self.gemm(x)), dim=1)
        bn = self.bn
        return linear_batchnorm_softmax(
            x, self.gemm.weight, self.gemm.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias, self.scale,
            training=bn.training, momentum=bn.momentum, eps=bn.eps,
            num_batches_tracked=bn.num_batches_tracked if bn.training else None)
