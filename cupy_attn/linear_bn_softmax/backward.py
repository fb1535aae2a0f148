"""Backward of Linear → BatchNorm1d → scale → softmax on torch CUDA tensors: two kernels, then cuBLAS.

    delta = rowsum(dout ∘ out)                        bwd_row_dot        (N,) fp32
    A, B, dγ, dβ, dscale, dbias;  dy                  bwd_columns        column sums, then dy (N, F) in x's dtype
    dx = dy · W                                       cuBLASLt GEMM (only when x needs a gradient)
    dW = dyᵀ · x                                      cuBLASLt GEMM (only when weight needs one)

(cuda_src/linear_bn_softmax/backward.cu has the math and the thread mapping.) The forward keeps out, y (its bias-free
GEMM result) and the (5, F) float32 Affine whose rows 0 and 4 are the mean and invstd it normalized with
(launch.AFFINE_ROWS); no GEMM is recomputed. Scratch ((N,) delta, (F,) dscale terms, a counter) comes from torch's
allocator on the current stream, as do the gradients. Plans (kernels, grids, cuBLASLt GEMMs) are cached per shape.
"""
from __future__ import annotations

import dataclasses
import functools
import sys

import numpy as np

from ..runtime import blas, interop
from ..runtime.compile import KernelFamily, struct_arg
from .checks import CODE_OF as _CODE_OF
from .launch import AFFINE_ROWS, _C_TYPES, _WIDE, _dtype_name_of_c, _sm_count

# bwd_row_dot<T, kThreads, kVec>: one row per block; 256 threads × 16-byte loads cover 2048 (fp16) features per step.
ROW_DOT_THREADS = 256
# bwd_columns<T, kVec, kColThreads, kThreads>: column_stats' first tile per vector width (launch.STATS_TILES, measured
# there for the same access pattern): strips of 32 features, 256 threads, 16-byte loads (or scalar for odd F).
COLUMN_TILES = {8: (8, 4, 256), 4: (4, 8, 256), 1: (1, 32, 256)}
_FLAG_BATCH_STATS = 1

# BwdParams in backward.cu: fifteen pointers and three int64 (8 bytes), four int32: 160 bytes, no padding.
_BWD_PARAMS = np.dtype(
    [(name, np.uint64) for name in ("dy", "dbias", "dgamma", "dbeta", "dscale", "delta", "dscale_partial", "counter",
                                    "dout", "out", "y", "stats", "gamma", "beta", "scale")]
    + [(name, np.int64) for name in ("n_rows", "n_cols", "scale_stride")]
    + [(name, np.int32) for name in ("gamma_t", "beta_t", "scale_t", "flags")])
assert _BWD_PARAMS.itemsize == 160

ROW_DOT = KernelFamily(
    name="lbs_bwd_row_dot",
    source="linear_bn_softmax/backward.cu",
    template="cupy_attn::lbs::bwd_row_dot<{dtype}, {threads}, {vec}>",
    axes={"dtype": tuple(_C_TYPES.values()), "threads": (ROW_DOT_THREADS,), "vec": (1, 4, 8)},
    where=lambda row: row["vec"] in (1, _WIDE[_dtype_name_of_c(row["dtype"])]),
    structs=(("cupy_attn::lbs::BwdParams", _BWD_PARAMS),),
)

COLUMNS = KernelFamily(
    name="lbs_bwd_columns",
    source="linear_bn_softmax/backward.cu",
    template="cupy_attn::lbs::bwd_columns<{dtype}, {tile[0]}, {tile[1]}, {tile[2]}>",
    axes={"dtype": tuple(_C_TYPES.values()), "tile": tuple(COLUMN_TILES.values())},
    where=lambda row: row["tile"][0] in (1, _WIDE[_dtype_name_of_c(row["dtype"])]),
    structs=(("cupy_attn::lbs::BwdParams", _BWD_PARAMS),),
)


def column_tile(n_cols: int, dtype) -> tuple[int, int, int]:
    """(kVec, kColThreads, kThreads) of bwd_columns: 16-byte vectors when F is a multiple of the vector width, scalar
    otherwise. Example: F = 8192 fp16 → (8, 4, 256), 256 blocks; F = 1000 fp32 → (4, 8, 256), 32 blocks; F = 999 →
    (1, 32, 256)."""
    wide = _WIDE[np.dtype(dtype).name]
    return COLUMN_TILES[wide if n_cols % wide == 0 else 1]


def _vec(n_cols: int, dtype) -> int:
    wide = _WIDE[np.dtype(dtype).name]
    return wide if n_cols % wide == 0 else 1


class _Gemm:
    """A prepared cuBLAS GEMM: the first call per stream plans (and may tune) it, later ones take the bound call."""

    def __init__(self, op: blas.StridedGemm):
        self.op, self.bound = op, {}

    def __call__(self, c_ptr: int, a_ptr: int, b_ptr: int, stream_ptr: int) -> None:
        fn = self.bound.get(stream_ptr)
        if fn is not None:
            fn(c_ptr, a_ptr, b_ptr)
            return
        self.op(c_ptr, a_ptr, b_ptr, stream_ptr)  # CuPy's current stream must be stream_ptr's (the caller's activate)
        fn = self.op.bind(stream_ptr)              # None while the stream is being captured: not kept
        if fn is not None:
            self.bound[stream_ptr] = fn


@dataclasses.dataclass
class _Plan:
    """What a backward call needs besides pointers, for one (device, dtype, N, K, F, strides, TF32, needs)."""

    row_dot: tuple    # (Function, grid, block)
    columns: tuple
    dx: _Gemm | None  # dX (N, K) = dY (N, F) · W (F, K)
    dw: _Gemm | None  # dW (F, K) = dYᵀ · X (N, K)


@functools.lru_cache(maxsize=256)
def _plan(device_id: int, dtype: np.dtype, n: int, k: int, f: int, ldx: int, ldw: int, allow_tf32: bool,
          need_dx: bool, need_dw: bool) -> _Plan:
    ctype = _C_TYPES[np.dtype(dtype).name]
    row_dot = ROW_DOT.kernel(dtype=ctype, threads=ROW_DOT_THREADS, vec=_vec(f, dtype))
    tile = column_tile(f, dtype)
    columns = COLUMNS.kernel(dtype=ctype, tile=tile)
    dx = dw = None
    if need_dx and k > 0:
        dx = _Gemm(blas.StridedGemm(c_dtype=dtype, ldc=k, stride_c=0, a_dtype=dtype, lda=f, stride_a=0, trans_a=False,
                                    b_dtype=dtype, ldb=ldw, stride_b=0, trans_b=False, m=n, n=k, k=f, batch=1,
                                    allow_tf32=allow_tf32))
    if need_dw and k > 0:
        dw = _Gemm(blas.StridedGemm(c_dtype=dtype, ldc=k, stride_c=0, a_dtype=dtype, lda=f, stride_a=0, trans_a=True,
                                    b_dtype=dtype, ldb=ldx, stride_b=0, trans_b=False, m=f, n=k, k=n, batch=1,
                                    allow_tf32=allow_tf32))
    # Up to 16 row blocks per SM resident (256 threads): more rows than that take the grid-stride loop.
    return _Plan(row_dot=(row_dot.kernel, (min(n, 16 * _sm_count(device_id)),), (ROW_DOT_THREADS,)),
                 columns=(columns.kernel, (-(-f // (tile[0] * tile[1])),), (tile[2],)), dx=dx, dw=dw)


def _aligned(t, torch):
    """t when contiguous and 16-byte aligned (the kernels' vector loads), else a contiguous copy."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _gemm_operand(t, torch):
    """t when cuBLAS can read it as row-major (unit stride along the last axis), else a contiguous copy."""
    if t.stride(1) == 1 and t.stride(0) >= t.shape[1]:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def grad_inputs(grad_out, x, weight, y, out, stats, bn_weight, bn_bias, scale, *, use_batch_stats: bool,
                needs: tuple, allow_tf32: bool):
    """(dx, dweight, dbias, dbn_weight, dbn_bias, dscale) for torch CUDA tensors, None where ``needs`` is False.

    grad_out, out, y: (N, F) in x's dtype (y: the forward's bias-free GEMM result); x (N, K); weight (F, K); stats
    (AFFINE_ROWS, F) float32 from the forward (row 0 mean, row 4 invstd); bn_weight, bn_bias (F,) or None; scale (1,),
    () or (F,). needs: six bools in the order of the result (bias, bn_weight and bn_bias only when given).
    use_batch_stats: the forward normalized with batch statistics. Each gradient has its argument's shape and dtype
    (dbias: (F,) in x's dtype) and is contiguous. Runs on torch's current stream.
    """
    torch = sys.modules["torch"]
    need_dx, need_dw, need_db, need_dg, need_dbeta, need_ds = needs
    n, k = x.shape
    f = weight.shape[0]
    dgamma = torch.empty_like(bn_weight, memory_format=torch.contiguous_format) if need_dg else None
    dbeta = torch.empty_like(bn_bias, memory_format=torch.contiguous_format) if need_dbeta else None
    dscale = torch.empty_like(scale, memory_format=torch.contiguous_format) if need_ds else None
    dbias = x.new_empty((f,)) if need_db else None
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else None
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_dw else None
    if n * f == 0:  # nothing flows back: every gradient is 0 (an empty batch, or no features)
        return tuple(None if g is None else g.zero_() for g in (dx, dw, dbias, dgamma, dbeta, dscale))
    if stats.shape != (AFFINE_ROWS, f) or stats.dtype != torch.float32:
        raise ValueError(f"stats must be the forward's ({AFFINE_ROWS}, {f}) float32 Affine, got "
                         f"{tuple(stats.shape)} {stats.dtype}")
    ctx = interop.context_for(grad_out, "grad_out")
    dtype = interop.torch_to_numpy_dtype(x.dtype)
    need_dy = dx is not None or dw is not None
    xg = _gemm_operand(x, torch) if dw is not None else x
    wg = _gemm_operand(weight, torch) if dx is not None else weight
    if grad_out.dtype != x.dtype:
        grad_out = grad_out.to(x.dtype)
    dout, out, y, stats = (_aligned(t, torch) for t in (grad_out, out, y, stats))
    gamma, beta, scale = (None if t is None else t.contiguous() for t in (bn_weight, bn_bias, scale))
    dy = x.new_empty((n, f)) if need_dy else None
    # Scratch: delta (N,) and the dscale terms (F,) in fp32, then the counter; each 16-byte aligned.
    n4, f4 = -(-n // 4) * 4, -(-f // 4) * 4
    scratch = torch.empty(n4 + f4 + 4, dtype=torch.float32, device=x.device)
    base = scratch.data_ptr()

    def ptr(t):
        return 0 if t is None else t.data_ptr()

    def code(t):
        return 0 if t is None else _CODE_OF[interop.torch_to_numpy_dtype(t.dtype)]
    scale_stride = 1 if tuple(scale.shape) == (f,) and f > 1 else 0
    params = np.array((ptr(dy), ptr(dbias), ptr(dgamma), ptr(dbeta), ptr(dscale), base, base + 4 * n4,
                       base + 4 * (n4 + f4), dout.data_ptr(), out.data_ptr(), y.data_ptr(), stats.data_ptr(),
                       ptr(gamma), ptr(beta), scale.data_ptr(), n, f, scale_stride, code(gamma), code(beta),
                       code(scale), _FLAG_BATCH_STATS if use_batch_stats else 0), dtype=_BWD_PARAMS)
    arg = (struct_arg(params),)
    stream = ctx.stream
    with ctx.activate():  # the device's kernels; CuPy's current stream = torch's, where a GEMM's first call plans
        plan = _plan(ctx.device_id, dtype, n, k, f, xg.stride(0), wg.stride(0), bool(allow_tf32), dx is not None,
                     dw is not None)
        for fn, grid, block in (plan.row_dot, plan.columns):
            fn(grid, block, arg, 0, stream)
        if plan.dx is not None:  # (K = 0: dx and dw are empty, no GEMM)
            plan.dx(dx.data_ptr(), dy.data_ptr(), wg.data_ptr(), stream.ptr)
        if plan.dw is not None:
            plan.dw(dw.data_ptr(), dy.data_ptr(), xg.data_ptr(), stream.ptr)
    return dx, dw, dbias, dgamma, dbeta, dscale
