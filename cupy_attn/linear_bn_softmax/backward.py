"""Backward of Linear → BatchNorm1d → scale → softmax on torch CUDA tensors: two kernels, then cuBLAS.

    delta = rowsum(dout ∘ out)                        bwd_row_dot        (N,) fp32
    A, B, dγ, dβ, dscale, dbias;  dy                  bwd_columns        column sums, then dy (N, F) in x's dtype
    dx = dy · W                                       cuBLASLt GEMM (only when x needs a gradient)
    dW = dyᵀ · x                                      cuBLASLt GEMM (only when weight needs one)

(cuda_src/linear_bn_softmax/backward.cu has the math and the thread mapping.) The forward keeps out, y (its bias-free
GEMM result) and the (5, F) float32 Affine whose rows 0 and 4 are the mean and invstd it normalized with
(launch.AFFINE_ROWS); no GEMM is recomputed. dy and the scratch ((N,) delta, (F,) dscale terms, a counter) live in
the stream's persistent workspace, the gradients come from torch's allocator on the current stream. Everything that
does not depend on addresses is prepared once per layout (:class:`_Call`), and a recorded forward hands its backward
the prepared call (``memo``), so a repeated training step's backward allocates, fills pointers and launches.
"""
from __future__ import annotations

import dataclasses
import functools
import sys

import numpy as np

from ..runtime import blas, interop, workspace
from ..runtime.compile import KernelFamily
from ..runtime.launch import PreparedLaunch, Step
from .checks import CODE_OF as _CODE_OF
from ..runtime.kernel_abi import C_TYPE, DTYPE_OF_C
from .launch import AFFINE_ROWS, C_DTYPES, DTYPES, VEC_WIDTH, Y_WORKSPACE_MAX_BYTES, stream_workspace

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
    axes={"dtype": C_DTYPES, "threads": (ROW_DOT_THREADS,), "vec": (1, 4, 8)},
    where=lambda row: row["vec"] in (1, VEC_WIDTH[DTYPE_OF_C[row["dtype"]]]),
    structs=(("cupy_attn::lbs::BwdParams", _BWD_PARAMS),),
)

COLUMNS = KernelFamily(
    name="lbs_bwd_columns",
    source="linear_bn_softmax/backward.cu",
    template="cupy_attn::lbs::bwd_columns<{dtype}, {tile[0]}, {tile[1]}, {tile[2]}>",
    axes={"dtype": C_DTYPES, "tile": tuple(COLUMN_TILES.values())},
    where=lambda row: row["tile"][0] in (1, VEC_WIDTH[DTYPE_OF_C[row["dtype"]]]),
    structs=(("cupy_attn::lbs::BwdParams", _BWD_PARAMS),),
)


def column_tile(n_cols: int, dtype) -> tuple[int, int, int]:
    """(kVec, kColThreads, kThreads) of bwd_columns: 16-byte vectors when F is a multiple of the vector width, scalar
    otherwise. Example: F = 8192 fp16 → (8, 4, 256), 256 blocks; F = 1000 fp32 → (4, 8, 256), 32 blocks; F = 999 →
    (1, 32, 256)."""
    wide = VEC_WIDTH[np.dtype(dtype).name]
    return COLUMN_TILES[wide if n_cols % wide == 0 else 1]


def _vec(n_cols: int, dtype) -> int:
    wide = VEC_WIDTH[np.dtype(dtype).name]
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

    row_dot: tuple    # (RawKernel, grid, block)
    columns: tuple
    dx: _Gemm | None  # dX (N, K) = dY (N, F) · W (F, K)
    dw: _Gemm | None  # dW (F, K) = dYᵀ · X (N, K)


@functools.lru_cache(maxsize=256)
def _plan(device_id: int, dtype: np.dtype, n: int, k: int, f: int, ldx: int, ldw: int, allow_tf32: bool,
          need_dx: bool, need_dw: bool) -> _Plan:
    ctype = C_TYPE[np.dtype(dtype).name]
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
    return _Plan(row_dot=(row_dot, (min(n, 16 * interop.device_sms(device_id)),), (ROW_DOT_THREADS,)),
                 columns=(columns, (-(-f // (tile[0] * tile[1])),), (tile[2],)), dx=dx, dw=dw)


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


# BwdParams' fields after the pointers, (n_rows, n_cols, scale_stride, gamma_t, beta_t, scale_t, flags), as the
# five 8-byte words they occupy: a call copies them after its fifteen pointers.
_TAIL = np.dtype([(name, np.int64) for name in ("n_rows", "n_cols", "scale_stride")]
                 + [(name, np.int32) for name in ("gamma_t", "beta_t", "scale_t", "flags")])
_POINTERS = 15
_INPUTS = ("dout", "out", "y", "stats", "gamma", "beta", "scale")  # BwdParams' pointers to the call's inputs
assert _POINTERS * 8 + _TAIL.itemsize == _BWD_PARAMS.itemsize


class _Call:
    """A prepared backward for one layout (device, stream, dtypes, N, K, F, the GEMM operands' row strides, the
    scale's shape, batch or running statistics, which gradients, TF32): the plan, the params words that do not depend
    on the inputs' addresses, and how the outputs are allocated. Built once per layout (``_prepared``); a recorded
    forward keeps the call for its layout (api.forward_saving_entry), so the backward of a repeated training step only
    allocates, fills seven pointers and launches.

    Order of host work per call, chosen so that the dW GEMM (on the device's critical path when the step starts from
    an idle GPU: the host's time until it is enqueued shows as idle GPU) is enqueued as early as possible: dW and dx
    from torch's allocator on the current stream; the two kernels, which write dy and the per-feature gradients into
    the stream's persistent Linear-BN-softmax workspace (launch._workspace "work", which the forward-only path uses
    for y: calls on one stream are ordered, so they may share it; a per-call buffer while the stream is captured);
    the GEMMs; then one allocation per dtype of the per-feature gradients (split into views when it holds several)
    and one stream-ordered device copy each from the workspace. dy is in the workspace only up to
    launch.Y_WORKSPACE_MAX_BYTES, a per-call allocation beyond. The CuPy device and stream are entered only when
    another device is current or a GEMM has not been bound to the stream yet (its first call plans on CuPy's current
    stream).
    """

    def __init__(self, ctx, device_id: int, stream_ptr: int, x_dtype, n: int, k: int, f: int, ldx: int, ldw: int,
                 vector_dtypes: tuple, scale_shape: tuple, use_batch_stats: bool, needs: tuple, allow_tf32: bool):
        torch = sys.modules["torch"]
        self.ctx, self.device_id, self.stream_ptr, self.dtype = ctx, device_id, stream_ptr, x_dtype
        self.needs = needs
        need_dx, need_dw, need_db, need_dg, need_dbeta, need_ds = needs
        dtype = interop.torch_to_numpy_dtype(x_dtype)
        self.plan = _plan(device_id, dtype, n, k, f, ldx, ldw, bool(allow_tf32), need_dx, need_dw)
        self.gemms = tuple(g for g in (self.plan.dx, self.plan.dw) if g is not None)
        self.need_dy = need_dx or need_dw
        self.x_shape, self.w_shape = (n, k), (f, k)
        gamma_t, beta_t, scale_t = (0 if t is None else _CODE_OF[interop.torch_to_numpy_dtype(t)]
                                    for t in vector_dtypes)
        scale_stride = 1 if tuple(scale_shape) == (f,) and f > 1 else 0
        tail = np.array((n, f, scale_stride, gamma_t, beta_t, scale_t,
                         _FLAG_BATCH_STATS if use_batch_stats else 0), dtype=_TAIL).reshape(1).view(np.uint64)
        # The per-feature gradients (dbias, dbn_weight, dbn_bias, dscale: result positions 2-5, params words 1-4)
        # grouped by dtype: one allocation per dtype, split into views when it holds several (one in all when they
        # share x's dtype).
        groups: dict = {}
        for pos, need, dt, shape in ((2, need_db, x_dtype, (f,)), (3, need_dg, vector_dtypes[0], (f,)),
                                     (4, need_dbeta, vector_dtypes[1], (f,)), (5, need_ds, vector_dtypes[2],
                                                                              tuple(scale_shape))):
            if need:
                groups.setdefault(dt, []).append((pos, shape))
        # Workspace layout: delta (N,) and the dscale terms (F,) in fp32, the counter, then each dtype group's
        # gradients packed as in their allocation (the copy out is one per group; the kernels write the gradients
        # element by element, so parts need no alignment), each group 16-byte aligned; dy after them at a 256-byte
        # boundary when it fits in the workspace.
        n4, f4 = -(-n // 4) * 4, -(-f // 4) * 4
        offsets = {"delta": 0, "partial": 4 * n4, "counter": 4 * (n4 + f4)}
        end = offsets["counter"] + 16
        grad_offsets = {}
        self.groups = []
        for dt, members in groups.items():
            sizes = [int(np.prod(shape)) for _, shape in members]
            itemsize = torch.empty((), dtype=dt).element_size()
            end = -(-end // 16) * 16
            group_off = end
            for (pos, _), size in zip(members, sizes):
                grad_offsets[pos] = end
                end += size * itemsize
            self.groups.append((dt, tuple(members), sizes, sum(sizes), group_off, sum(sizes) * itemsize))
        scratch_bytes = -(-end // 256) * 256
        dy_bytes = n * f * dtype.itemsize
        self.dy_in_work = self.need_dy and dy_bytes <= Y_WORKSPACE_MAX_BYTES
        self.work_bytes = scratch_bytes + (dy_bytes if self.dy_in_work else 0)
        self.f = f
        self.dy_off = scratch_bytes
        # BwdParams: the pointers into the workspace are offsets from its base (an argument of the replay: it may move
        # between calls), the gradients not needed stay 0; dy is the workspace's unless it is a per-call allocation.
        params = np.zeros((), dtype=_BWD_PARAMS)
        params.reshape(1).view(np.uint64)[_POINTERS:] = tail
        pointers = {name: ("work", off) for name, off in (
            ("dbias", grad_offsets.get(2)), ("dgamma", grad_offsets.get(3)), ("dbeta", grad_offsets.get(4)),
            ("dscale", grad_offsets.get(5)), ("delta", offsets["delta"]), ("dscale_partial", offsets["partial"]),
            ("counter", offsets["counter"])) if off is not None}
        if self.dy_in_work:
            pointers["dy"] = ("work", self.dy_off)
        elif self.need_dy:
            pointers["dy"] = "dy"
        pointers.update({name: name for name in _INPUTS})
        self.ready = False  # the GEMMs are bound to the stream: the CuPy context is needed only for another device
        self._get_device = _get_device_fn()
        self._split = torch.split_with_sizes
        self.launch = PreparedLaunch(params, [Step(fn, grid, block) for fn, grid, block in (self.plan.row_dot,
                                                                                               self.plan.columns)],
                                     args=("work", "dy") + _INPUTS, pointers=pointers)
        self._copy = _memcpy_fn()

    def takes(self, grad_out) -> bool:
        """grad_out can be read as is (x's dtype, contiguous, 16-byte aligned) and the current stream is the call's."""
        return (grad_out.dtype == self.dtype and grad_out.is_contiguous() and grad_out.data_ptr() & 15 == 0
                and interop.current_torch_stream(self.device_id) == self.stream_ptr)

    def __call__(self, grad_out, x, weight, y, out, stats, gamma, beta, scale):
        """(dx, dweight, dbias, dbn_weight, dbn_bias, dscale), None where not needed. grad_out as ``takes`` accepts;
        x and weight with the prepared strides; y, out and stats as the forward wrote them; gamma, beta and scale
        contiguous."""
        if self.ready and self._get_device() == self.device_id:
            return self._run(grad_out, x, weight, y, out, stats, gamma, beta, scale)
        with self.ctx.activate():
            grads = self._run(grad_out, x, weight, y, out, stats, gamma, beta, scale)
        self.ready = all(self.stream_ptr in g.bound for g in self.gemms)
        return grads

    def _run(self, grad_out, x, weight, y, out, stats, gamma, beta, scale):
        need_dx, need_dw = self.needs[0], self.needs[1]
        dw = weight.new_empty(self.w_shape) if need_dw else None
        dx = x.new_empty(self.x_shape) if need_dx else None
        work = stream_workspace(self.device_id, self.stream_ptr, "work", self.work_bytes)
        base = workspace.pointer(work)
        dy = None
        if self.dy_in_work:
            dy_ptr = base + self.dy_off
        elif self.need_dy:
            dy = x.new_empty((self.x_shape[0], self.f))
            dy_ptr = dy.data_ptr()
        else:
            dy_ptr = 0
        stream_ptr = self.stream_ptr
        self.launch.launch_on(stream_ptr, base, dy_ptr, grad_out.data_ptr(), out.data_ptr(), y.data_ptr(),
                              stats.data_ptr(), _ptr(gamma), _ptr(beta), scale.data_ptr())
        plan = self.plan
        if plan.dx is not None:  # (K = 0: dx and dw are empty, no GEMM)
            plan.dx(dx.data_ptr(), dy_ptr, weight.data_ptr(), stream_ptr)
        if plan.dw is not None:
            plan.dw(dw.data_ptr(), dy_ptr, x.data_ptr(), stream_ptr)
        # The per-feature gradients, from the workspace into their own allocations (stream-ordered).
        grads = [dx, dw, None, None, None, None]
        for dt, members, sizes, total, off, nbytes in self.groups:
            if len(members) == 1:
                pos, shape = members[0]
                buf = grads[pos] = x.new_empty(shape, dtype=dt)
            else:
                buf = x.new_empty((total,), dtype=dt)
                for (pos, shape), part in zip(members, self._split(buf, sizes)):
                    grads[pos] = part if len(shape) == 1 else part.view(shape)  # () for a 0-d scale
            self._copy(buf.data_ptr(), base + off, nbytes, _DEVICE_TO_DEVICE, stream_ptr)
        del work, dy  # held until the work reading them is enqueued
        return tuple(grads)


_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


_GET_DEVICE: list = []


def _get_device_fn():
    if not _GET_DEVICE:
        import cupy
        _GET_DEVICE.append(cupy.cuda.runtime.getDevice)
    return _GET_DEVICE[0]


def _memcpy_fn():
    import cupy
    return cupy.cuda.runtime.memcpyAsync


_CALLS: dict = {}  # layout key -> _Call
_MAX_CALLS = 256


def _forget_bound_gemms() -> None:
    """The prepared calls and plans, whose GEMMs keep bound calls holding the stream's cuBLASLt workspace: dropped by
    release_memory(graphs=True), which frees that workspace."""
    _CALLS.clear()
    _plan.cache_clear()


workspace.on_release(_forget_bound_gemms)


def _prepared(ctx, x, weight, bn_weight, bn_bias, scale, use_batch_stats: bool, needs: tuple,
              allow_tf32: bool) -> _Call:
    """The prepared call for this layout on ctx's device and stream (x and weight as cuBLAS reads them)."""
    n, k = x.shape
    vector_dtypes = tuple(None if t is None else t.dtype for t in (bn_weight, bn_bias, scale))
    key = (ctx.device_id, ctx.stream.ptr, x.dtype, n, k, weight.shape[0], x.stride(0), weight.stride(0),
           vector_dtypes, tuple(scale.shape), bool(use_batch_stats), needs, bool(allow_tf32))
    call = _CALLS.get(key)
    if call is None:
        if len(_CALLS) >= _MAX_CALLS:
            _CALLS.clear()
        call = _CALLS[key] = _Call(ctx, ctx.device_id, ctx.stream.ptr, x.dtype, n, k, weight.shape[0],
                                   x.stride(0), weight.stride(0), vector_dtypes, tuple(scale.shape),
                                   bool(use_batch_stats), needs, bool(allow_tf32))
    return call


def grad_inputs(grad_out, x, weight, y, out, stats, bn_weight, bn_bias, scale, *, use_batch_stats: bool,
                needs: tuple, allow_tf32: bool, memo: dict | None = None):
    """(dx, dweight, dbias, dbn_weight, dbn_bias, dscale) for torch CUDA tensors, None where ``needs`` is False.

    grad_out, out, y: (N, F) in x's dtype (y: the forward's bias-free GEMM result); x (N, K); weight (F, K); stats
    (AFFINE_ROWS, F) float32 from the forward (row 0 mean, row 4 invstd); bn_weight, bn_bias (F,) or None; scale (1,),
    () or (F,). needs: six bools in the order of the result (bias, bn_weight and bn_bias only when given).
    use_batch_stats: the forward normalized with batch statistics. Each gradient has its argument's shape and dtype
    (dbias: (F,) in x's dtype) and is contiguous; the per-feature gradients may be views of one allocation. Runs on
    torch's current stream.

    memo: a dict that keeps the prepared call (:class:`_Call`) per ``needs`` for inputs of one layout whose x and
    weight have unit last strides and whose vectors are contiguous (a recorded forward's call-cache entry, see
    api.forward_saving_entry); a later call with a grad_out the call takes (x's dtype, contiguous, aligned, the same
    stream) skips every check. Without it, the call is looked up by its layout (a few µs more).
    """
    if memo is not None:
        call = memo.get(needs)
        if call is not None and call.takes(grad_out):
            return call(grad_out, x, weight, y, out, stats, bn_weight, bn_bias, scale)
    torch = sys.modules["torch"]
    need_dx, need_dw, need_db, need_dg, need_dbeta, need_ds = needs
    n, k = x.shape
    f = weight.shape[0]
    if n * f == 0:  # nothing flows back: every gradient is 0 (an empty batch, or no features)
        likes = ((x, need_dx), (weight, need_dw), (None, need_db), (bn_weight, need_dg), (bn_bias, need_dbeta),
                 (scale, need_ds))
        return tuple(None if not need else (x.new_zeros((f,)) if like is None else
                                            torch.zeros_like(like, memory_format=torch.contiguous_format))
                     for like, need in likes)
    if stats.shape != (AFFINE_ROWS, f) or stats.dtype != torch.float32:
        raise ValueError(f"stats must be the forward's ({AFFINE_ROWS}, {f}) float32 Affine, got "
                         f"{tuple(stats.shape)} {stats.dtype}")
    ctx = interop.context_for(grad_out, "grad_out")
    xg = _gemm_operand(x, torch) if need_dw else x
    wg = _gemm_operand(weight, torch) if need_dx else weight
    if grad_out.dtype != x.dtype:
        grad_out = grad_out.to(x.dtype)
    dout, out, y, stats = (_aligned(t, torch) for t in (grad_out, out, y, stats))
    gamma, beta, scale_c = (None if t is None else t.contiguous() for t in (bn_weight, bn_bias, scale))
    call = _prepared(ctx, xg, wg, gamma, beta, scale_c, use_batch_stats, tuple(needs), allow_tf32)
    if memo is not None and xg is x and wg is weight and gamma is bn_weight and beta is bn_bias and scale_c is scale:
        memo[tuple(needs)] = call
    return call(dout, xg, wg, y, out, stats, gamma, beta, scale_c)
