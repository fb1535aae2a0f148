"""Fused Linear → BatchNorm1d → scale → softmax: ``softmax(scale · BatchNorm1d(x·Wᵀ + bias), dim=1)``.

    y        = x · Wᵀ                      cuBLASLt, fp32 compute, no bias, into a per-stream workspace (or into the
                                           output when y is over Y_WORKSPACE_MAX_BYTES)
    mu, a, d = fold(statistics, γ, β, bias, scale)     training: column_stats kernel (one pass over y, batch stats)
                                                       eval: fold_running_stats kernel (F threads, no pass over y)
    out      = softmax(a ⊙ (y − mu) + d)   softmax_rows kernel, one pass over y

Why the bias is not in the GEMM: in training BatchNorm subtracts the per-feature batch mean, so a per-feature constant
cancels exactly and only shifts the running_mean update (the kernel adds it there); in eval it folds into b. Either way
the GEMM runs with beta = 0 and no bias copy or epilogue is needed.

Passes over the (N, F) activations after the GEMM: training two (statistics, then normalize + softmax), eval one.
Host time before the GEMM is enqueued is kept small, because in a synchronized loop it is idle GPU time: a repeated
call with the same layout, flags and stream is a call-cache hit (the key, then cuBLASLt's bound enqueue); the output
is allocated and the launches after the GEMM are prepared while the GEMM runs.
Kernels: cuda_src/linear_bn_softmax/linear_bn_softmax.cu (header comment: math, thread mapping, tile sizes, version ladder).
The forward autograd records (:meth:`Prepared.execute_saving`) writes y and the Affine to per-call buffers instead,
which the backward (backward.py) reads.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import numpy as np

from ..runtime import blas, interop, workspace
from ..runtime.compile import KernelFamily
from ..runtime.kernel_abi import C_TYPE, DTYPE_OF_C
from ..runtime.launch import PreparedLaunch, Step, pdl_supported
from .checks import CODE_OF as _CODE_OF, Arg, Call

DTYPES = ("float32", "float16", "bfloat16")                  # the kernel tables' element types, in their order
VEC_WIDTH = {"float32": 4, "float16": 8, "bfloat16": 8}       # elements per 16-byte vector
C_DTYPES = tuple(C_TYPE[name] for name in DTYPES)
_FLAG_UPDATE_RUNNING, _FLAG_CUMULATIVE, _FLAG_COUNT_BATCH = 1, 2, 4
# Rows of the per-feature Affine the statistics / fold kernels write (float32, (AFFINE_ROWS, F)): mu, a·log2e, d·log2e,
# b = d − a·mu, invstd. The row kernels read rows 0–3; the backward reads mu (row 0) and invstd (row 4).
AFFINE_ROWS = 5
AFFINE_MU, AFFINE_INVSTD = 0, 4

# ---------------------------------------------------------------------------------------------------------------------
# Kernel tables. The launcher picks rows from these same tuples.

# column_stats<T, kVec, kColThreads, kThreads>: a strip of kVec·kColThreads columns per block, its kThreads threads
# kColThreads across the strip and kThreads / kColThreads rows deep, 8 rows of 16-byte loads in flight per thread.
# Tiles (kVec, kColThreads, kThreads): 16-byte vectors when F allows (8 elements for 16-bit types, 4 for fp32),
# scalar loads otherwise. The first tile of each width is the one the launcher takes; the others are declared for
# the tile sweep (bench/bench_linear_bn_softmax.py --sweep).
#   (8, 4, 256): 32 columns × 64 B rows, 256 blocks at F = 8192, 32 rows per thread: 5.95 µs at the seed shape
#   (fp16), against 6.59 for (8, 8, 512) (128 blocks, one per SM) and 10.1 for (8, 4, 512) (sweep, H200).
#   (4, 8, 256): fp32, 32 columns × 128 B rows, 256 blocks of 256 threads (several resident per SM; 512 threads
#   at 71 registers fit one block per SM: two waves, 13 µs against 8 µs, measured).
STATS_TILES = {8: ((8, 4, 256), (8, 8, 512), (8, 4, 512)), 4: ((4, 8, 256), (4, 8, 512)), 1: ((1, 32, 256),)}

# softmax_rows<T, kThreads, kVec, kChunks, kRows>: a row lives in registers as kThreads × (kVec·kChunks) elements.
# Elements per thread E = kVec·kChunks ∈ {4, 8, 16}: 16 keeps y (2 rows) + mu, a, d at 80 live floats per thread,
# under the 128 registers a 512-thread block may use at 1 block/SM (ptxas: 124-128); thread counts 128 (F ≤ 2048)
# and 512 (≤ 8192). 1024 threads leave 64 registers a thread: at E = 8 they spilled (v1, and sm_80 in v4), and
# <__half, 1024, 8, 1, 2> was slower than 512 × 16 (14.3 vs 10.4 µs, v4 sweep). kRows = 2 rows per block iteration
# (two rows' loads in flight, half the barriers per row).
ROW_THREADS = (128, 512)
ROW_ELEMS = (4, 8, 16)
ROW_ROWS = 2
ROW_MAX_REGISTER_ROW = 8192  # 512 × 16; longer rows take the streaming kernel
# 16-bit rows of 4097–8192 features (16-byte vectors): 256 threads × 32 elements, one row per iteration, so that
# two blocks fit an SM (128 registers) and one block's loads and stores overlap the other's reductions: 7.8 against
# 10.4 µs for <__half, 512, 8, 2, 2> at the seed shape (sweep, H200). (kernel, threads, vec, chunks, rows)
WIDE_ROW_TILE = ("softmax_rows", 256, 8, 4, 1)
# softmax_rows_streaming<T, kThreads, kVec>: rows longer than ROW_MAX_REGISTER_ROW columns.
STREAM_THREADS = 512
# fold_running_stats<kThreads>: one thread per feature.
FOLD_THREADS = 256


def _row_where(row: dict) -> bool:
    wide = VEC_WIDTH[DTYPE_OF_C[row["dtype"]]]
    elems = row["vec"] * row["chunks"]
    if row["threads"] not in ROW_THREADS or row["rows"] != ROW_ROWS:
        return wide == 8 and (row["threads"], row["vec"], row["chunks"], row["rows"]) == WIDE_ROW_TILE[1:]
    return row["vec"] in (1, wide) and elems in ROW_ELEMS


# Params in linear_bn_softmax.cu: ten pointers and three int64 (8 bytes), six int32, two float32: 136 bytes, no padding.
_PARAMS = np.dtype(
    [(name, np.uint64) for name in ("out", "y", "affine", "bias", "gamma", "beta", "scale", "running_mean",
                                    "running_var", "num_batches_tracked")]
    + [(name, np.int64) for name in ("n_rows", "n_cols", "scale_stride")]
    + [(name, np.int32) for name in ("bias_t", "gamma_t", "beta_t", "scale_t", "stats_t", "flags")]
    + [("eps", np.float32), ("momentum", np.float32)])
assert _PARAMS.itemsize == 136
POINTERS = _PARAMS.names[:10]  # Params' pointer fields: a replay's arguments (out, y, affine, then VECTORS)

COLUMN_STATS = KernelFamily(
    name="lbs_column_stats",
    source="linear_bn_softmax/linear_bn_softmax.cu",
    template="cupy_attn::lbs::column_stats<{dtype}, {tile[0]}, {tile[1]}, {tile[2]}>",
    axes={"dtype": C_DTYPES, "tile": tuple(t for tiles in STATS_TILES.values() for t in tiles)},
    where=lambda row: row["tile"][0] in (1, VEC_WIDTH[DTYPE_OF_C[row["dtype"]]]),
    structs=(("cupy_attn::lbs::Params", _PARAMS),),
)

SOFTMAX_ROWS = KernelFamily(
    name="lbs_softmax_rows",
    source="linear_bn_softmax/linear_bn_softmax.cu",
    template="cupy_attn::lbs::softmax_rows<{dtype}, {threads}, {vec}, {chunks}, {rows}>",
    axes={"dtype": C_DTYPES, "threads": ROW_THREADS + (WIDE_ROW_TILE[1],), "vec": (1, 4, 8),
          "chunks": (1, 2, 4, 8, 16), "rows": (1, ROW_ROWS)},
    where=_row_where,
    structs=(("cupy_attn::lbs::Params", _PARAMS),),
)

FOLD_RUNNING_STATS = KernelFamily(
    name="lbs_fold_running_stats",
    source="linear_bn_softmax/linear_bn_softmax.cu",
    template="cupy_attn::lbs::fold_running_stats<{threads}>",
    axes={"threads": (FOLD_THREADS,)},
    structs=(("cupy_attn::lbs::Params", _PARAMS),),
)

SOFTMAX_ROWS_STREAMING = KernelFamily(
    name="lbs_softmax_rows_streaming",
    source="linear_bn_softmax/linear_bn_softmax.cu",
    template="cupy_attn::lbs::softmax_rows_streaming<{dtype}, {threads}, {vec}>",
    axes={"dtype": C_DTYPES, "threads": (STREAM_THREADS,), "vec": (1, 4, 8)},
    where=lambda row: row["vec"] in (1, VEC_WIDTH[DTYPE_OF_C[row["dtype"]]]),
    structs=(("cupy_attn::lbs::Params", _PARAMS),),
)


# The GEMM writes into a per-stream workspace when y is at most this large, so that the output is allocated after the
# GEMM is enqueued (off the host's critical path: ~10 µs of an idle-start call on an H200 host); larger results are
# computed in place in the output.
Y_WORKSPACE_MAX_BYTES = 64 << 20
# Launch the kernels after the GEMM as programmatic dependents on sm_90+ (runtime.launch.Step's pdl). A switch for A/B
# runs (bench/experiments/linear_bn_softmax/lbs_pdl.py); read when a call is prepared.
PDL = True


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """Which softmax kernel runs a row of F features: the register kernel's tile, or the streaming kernel."""

    kernel: str         # "softmax_rows" | "softmax_rows_streaming"
    threads: int
    vec: int
    chunks: int = 0     # 0 for streaming
    rows: int = 1       # rows per block iteration (kRows)


def row_plan(n_cols: int, dtype) -> RowPlan:
    """Smallest register tile that holds a row: first thread count, then elements per thread; 16-bit rows of
    4097–8192 features with 16-byte vectors take WIDE_ROW_TILE.

    Example: F = 8192 fp16 (16-byte vectors of 8) → WIDE_ROW_TILE, softmax_rows<__half, 256, 8, 4, 1>. F = 8192
    fp32: 128 × 16 = 2048 < 8192, 512 × 8 = 4096 < 8192, 512 × 16 = 8192 fits → <float, 512, 4, 4, 2>.
    F = 1000 fp16: 128 × 8 = 1024 → <__half, 128, 8, 1, 2>. F = 3: not a multiple of 8, scalar loads, 128 × 4 →
    <__half, 128, 1, 4, 2>. F = 8200: no tile → streaming kernel.
    """
    name = np.dtype(dtype).name
    vec = VEC_WIDTH[name] if n_cols % VEC_WIDTH[name] == 0 else 1
    kernel, threads, wide_vec, chunks, rows = WIDE_ROW_TILE
    if vec == wide_vec and threads * wide_vec * chunks // 2 < n_cols <= threads * wide_vec * chunks:
        return RowPlan(kernel, threads, vec, chunks, rows)
    for threads in ROW_THREADS:
        for elems in ROW_ELEMS:
            if elems % vec == 0 and n_cols <= threads * elems <= ROW_MAX_REGISTER_ROW:
                return RowPlan("softmax_rows", threads, vec, elems // vec, ROW_ROWS)
    return RowPlan("softmax_rows_streaming", STREAM_THREADS, vec)


def stats_tile(n_cols: int, dtype) -> tuple[int, int, int]:
    """(kVec, kColThreads, kThreads) of column_stats: 16-byte loads when F is a multiple of the vector width, scalar
    otherwise. Example: F = 8192 fp16 → (8, 4, 256), grid 8192 / 32 = 256 blocks; F = 1000 fp16 → (8, 4, 256),
    32 blocks; F = 8192 fp32 → (4, 8, 256), 256 blocks; F = 3 → (1, 32, 256), one block."""
    wide = VEC_WIDTH[np.dtype(dtype).name]
    return STATS_TILES[wide if n_cols % wide == 0 else 1][0]


def _blocks_per_sm(kernel, threads: int) -> int:
    """Resident blocks per SM from the kernel's register count (65536 registers, 2048 threads, 32 blocks per SM;
    registers are allocated per warp in units of 256)."""
    regs_per_warp = -(-max(kernel.num_regs, 1) * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * (threads // 32))
    return max(1, min(by_regs, 2048 // threads, 32))



# order (x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, num_batches_tracked).
VECTORS = ("bias", "gamma", "beta", "scale", "running_mean", "running_var", "num_batches_tracked")
assert POINTERS[3:] == VECTORS
VECTOR_ARGS = (2, 5, 6, 7, 3, 4, 8)


class Prepared:
    """Everything a GPU call needs that depends on shapes, dtypes, flags, device and stream but not on addresses: the
    GEMM (cuBLASLt plan), the kernels after it with their grids, the workspaces and the constant fields of Params.
    The call cache replays it (the checks that built it hold for any arrays with the same signatures).

    Order of work: y = x·Wᵀ into the y workspace (or into the output when y is large), then the output allocation
    (after the GEMM is enqueued, so it costs no idle GPU time), then the launches after the GEMM.
    """

    def __init__(self, call: Call, momentum, eps, allow_tf32: bool, ldx: int, ldw: int):
        n, k, f = call.n, call.k, call.f
        args = call.args
        self.ctx = call.ctx
        self.device_id = call.ctx.device_id
        self.stream_ptr = call.ctx.stream.ptr
        self.shape = (n, f)
        self.gemm = None if k == 0 else _gemm_xwt_op(self.device_id, call.dtype, allow_tf32, n, f, k, ldx, ldw)
        self._matmul = None
        self.y_bytes = n * f * call.dtype.itemsize
        self.in_place = self.gemm is None or self.y_bytes > Y_WORKSPACE_MAX_BYTES
        launches = _launch_plan(self.device_id, call.dtype, n, f, call.use_batch_stats)
        # The per-stream workspace: (AFFINE_ROWS, F) float32 folded per-feature affine, 256-byte aligned, then y unless
        # in place.
        self.affine_bytes = -(-AFFINE_ROWS * 4 * f // 256) * 256
        self.work_bytes = self.affine_bytes + (0 if self.in_place else self.y_bytes)
        flags = 0
        if call.update_running:
            flags |= _FLAG_UPDATE_RUNNING
            if momentum is None:
                flags |= _FLAG_CUMULATIVE
            if args["num_batches_tracked"] is not None:
                flags |= _FLAG_COUNT_BATCH
        codes = [0 if args[name] is None else _CODE_OF[args[name].dtype] for name in ("bias", "gamma", "beta", "scale")]
        rm = args["running_mean"]
        params = np.zeros((), dtype=_PARAMS)
        for name, value in zip(_PARAMS.names[len(POINTERS):], (
                n, f, 1 if args["scale"].shape == (f,) and f > 1 else 0, *codes,
                0 if rm is None else _CODE_OF[rm.dtype], flags, eps, 0.0 if momentum is None else momentum)):
            params[name] = value
        # The kernels after the GEMM on the one Params, its ten pointers written per call: one cuLaunchKernel each on
        # the raw stream handle (~1 µs of host time against ~6 through CuPy's Function call; no current-stream switch
        # on the replay path). On sm_90+ both as programmatic dependents (PDL): each is launched while the kernel
        # before it drains, and waits inside for that kernel's output.
        pdl = PDL and pdl_supported(self.device_id)
        self.launch = PreparedLaunch(params, [Step(ln.kernel, (ln.grid,), (ln.block,), pdl=pdl) for ln in launches],
                                     args=POINTERS, pointers={name: name for name in POINTERS})

    def execute(self, alloc, x_ptr: int, w_ptr: int, vectors):
        """Enqueue the call on the prepared stream (the prepared device current) and return the output.

        ``alloc()`` -> (output array, its pointer), called after the GEMM is enqueued unless y is computed in place;
        ``vectors``: pointers in VECTORS order (0 for absent ones), or a function returning them, called after the
        GEMM is enqueued.
        """
        # One workspace per call, looked up per call and held until the launches are enqueued: [affine | y] (y only
        # when not computed in the output). It may have grown for another shape on this stream, and under CUDA-graph
        # capture it is a per-call buffer (runtime.workspace.persistent); one look-up, one capture test.
        work = stream_workspace(self.device_id, self.stream_ptr, "work", self.work_bytes)
        affine_ptr = workspace.pointer(work)
        if self.in_place:
            out, out_ptr = alloc()
            y_ptr = out_ptr
            if self.gemm is None:  # K = 0: y = 0
                import cupy
                cupy.cuda.runtime.memsetAsync(y_ptr, 0, self.y_bytes, self.stream_ptr)
            self.enqueue_gemm(y_ptr, x_ptr, w_ptr)
        else:
            y_ptr = affine_ptr + self.affine_bytes
            self.enqueue_gemm(y_ptr, x_ptr, w_ptr)
            out, out_ptr = alloc()
        self.enqueue_post(out_ptr, y_ptr, affine_ptr, vectors() if callable(vectors) else vectors)
        del work
        return out

    def execute_saving(self, alloc, x_ptr: int, w_ptr: int, vectors):
        """The forward autograd records: y and the Affine go to per-call buffers that the backward keeps (not the
        per-stream workspace, which the next call overwrites), and out never aliases y. ``alloc(shape, float32)`` ->
        (array, pointer): x's dtype, or float32 when ``float32``; ``vectors`` as in :meth:`execute`. Returns (out (N,
        F), y (N, F), affine (AFFINE_ROWS, F) float32)."""
        y, y_ptr = alloc(self.shape, False)
        if self.gemm is None:  # K = 0: y = 0
            import cupy
            cupy.cuda.runtime.memsetAsync(y_ptr, 0, self.y_bytes, self.stream_ptr)
        self.enqueue_gemm(y_ptr, x_ptr, w_ptr)
        affine, affine_ptr = alloc((AFFINE_ROWS, self.shape[1]), True)
        out, out_ptr = alloc(self.shape, False)
        self.enqueue_post(out_ptr, y_ptr, affine_ptr, vectors() if callable(vectors) else vectors)
        return out, y, affine

    def enqueue_gemm(self, y_ptr: int, x_ptr: int, w_ptr: int) -> None:
        if self.gemm is None:
            return
        if self._matmul is not None:
            self._matmul(y_ptr, x_ptr, w_ptr)
            return
        self.gemm(y_ptr, x_ptr, w_ptr, self.stream_ptr)  # the first call may tune the cuBLASLt algorithm
        self._matmul = self.gemm.bind(self.stream_ptr)    # later calls: the bound C call (None: classic cuBLAS)

    def enqueue_post(self, out_ptr: int, y_ptr: int, affine_ptr: int, vectors: tuple) -> None:
        """The launches after the GEMM; ``vectors``: pointers in VECTORS order, 0 for absent ones."""
        self.launch.launch_on(self.stream_ptr, out_ptr, y_ptr, affine_ptr, *vectors)


class Entry:
    """A call-cache entry: allocate the output for the new arrays and replay the prepared launches on their
    pointers. Host time before the GEMM is enqueued: the cache key, the allocation and cuBLASLt's enqueue.
    ``backward_calls``: the backward's prepared calls for this layout, by which gradients are needed (entries of
    the recorded forward only; backward.grad_inputs' memo)."""

    def __init__(self, prepared: Prepared, ctx: interop.CallContext, out_shape: tuple):
        import cupy
        self.prepared, self.ctx, self.out_shape = prepared, ctx, out_shape
        self.backward_calls: dict = {}
        self._get_device = cupy.cuda.runtime.getDevice
        self._ptr = _torch_ptr if ctx.kind == interop.TORCH else _cupy_ptr

    def __call__(self, arrays: tuple):
        if self._get_device() != self.prepared.device_id:
            with self.ctx.activate():
                return self._run(arrays)
        return self._run(arrays)

    def _run(self, arrays: tuple):
        x, ptr = arrays[0], self._ptr
        if self.ctx.kind == interop.TORCH:
            def alloc():  # x's dtype and device, torch's allocator on the current stream
                out = x.new_empty(self.out_shape)
                return out, out.data_ptr()
        else:
            def alloc():
                import cupy
                with self.ctx.stream:  # CuPy's pool orders the allocation on the current stream
                    out = cupy.empty(self.out_shape, dtype=x.dtype)
                return out, out.data.ptr
        return self.prepared.execute(alloc, ptr(x), ptr(arrays[1]),
                                     lambda: tuple(ptr(arrays[i]) for i in VECTOR_ARGS))


    def saving(self, arrays: tuple):
        """:meth:`Prepared.execute_saving` on new torch tensors: (out, y, affine) from torch's allocator."""
        if self._get_device() != self.prepared.device_id:
            with self.ctx.activate():
                return self._run_saving(arrays)
        return self._run_saving(arrays)

    def _run_saving(self, arrays: tuple):
        x, ptr = arrays[0], self._ptr
        return self.prepared.execute_saving(torch_alloc(x), ptr(x), ptr(arrays[1]),
                                            lambda: tuple(ptr(arrays[i]) for i in VECTOR_ARGS))


def torch_alloc(x):
    """alloc(shape, float32) for :meth:`Prepared.execute_saving`: x's dtype (or float32) and device, torch's
    allocator on the current stream."""
    f32 = sys.modules["torch"].float32

    def alloc(shape, float32):
        t = x.new_empty(shape, dtype=f32) if float32 else x.new_empty(shape)
        return t, t.data_ptr()
    return alloc


def _torch_ptr(a) -> int:
    return 0 if a is None else a.data_ptr()


def _cupy_ptr(a) -> int:
    return 0 if a is None else a.data.ptr


@functools.lru_cache(maxsize=256)
def _gemm_xwt_op(device_id: int, dtype: np.dtype, allow_tf32: bool, m: int, n: int, k: int, ldx: int,
                 ldw: int) -> blas.StridedGemm:
    """C (m, n) = X (m, k) · Wᵀ with W (n, k), row-major, batch 1: prepared once per shape (device_id keys the
    cache: a cuBLASLt plan belongs to one device)."""
    return blas.StridedGemm(c_dtype=dtype, ldc=n, stride_c=0, a_dtype=dtype, lda=ldx, stride_a=0, trans_a=False,
                               b_dtype=dtype, ldb=ldw, stride_b=0, trans_b=True, m=m, n=n, k=k, batch=1,
                               allow_tf32=allow_tf32)


def empty_output(ctx: interop.CallContext, shape: tuple, dtype: np.dtype, like=None):
    """(native output, device pointer); torch outputs come from torch's allocator without a DLPack round trip."""
    if ctx.kind == interop.TORCH and like is not None:
        t = like.new_empty(shape)  # x's dtype and device, torch's allocator and current stream
        return t, t.data_ptr()
    native, view = ctx.empty(shape, dtype)
    return native, view.data.ptr


_NAME_OF = {dt: name for name, dt in zip(DTYPES, _CODE_OF)}


def cupy_view(a: Arg):
    import cupy
    if a.kind == interop.CUPY:
        return a.obj
    if a.kind == interop.TORCH:
        return cupy.from_dlpack(a.obj.detach())
    return cupy.from_dlpack(a.obj)


def unit_last_stride(a: Arg) -> Arg:
    """cuBLAS reads any row stride but needs unit stride along the last axis: copy only when it is not
    (:func:`contiguous_copy`)."""
    st = a.strides()
    if st[1] == 1 and st[0] >= a.shape[1]:
        return a
    return contiguous_copy(a)


def vector_ptr(a: Arg, keep: list) -> int:
    """Pointer to a contiguous copy of a per-feature vector (the array itself when already contiguous)."""
    if a.shape == () or a.shape == (1,) or a.strides()[0] == 1:
        return a.ptr()
    c = contiguous_copy(a)
    keep.append(c.obj)  # alive until the launches are enqueued (both allocators are stream-ordered)
    return c.ptr()


def contiguous_copy(a: Arg) -> Arg:
    """A contiguous copy of ``a`` from the caller's allocator on the call's stream (torch tensors: torch's; otherwise
    CuPy's pool)."""
    if a.kind == interop.TORCH:
        return Arg(a.obj.detach().contiguous(), interop.TORCH, a.dtype, a.shape)
    import cupy
    return Arg(cupy.ascontiguousarray(cupy_view(a)), interop.CUPY, a.dtype, a.shape)


@dataclasses.dataclass(frozen=True)
class _Launch:
    """One kernel launch after the GEMM."""

    kernel: Any           # cupy.RawKernel
    grid: int
    block: int


@functools.lru_cache(maxsize=256)
def _launch_plan(device_id: int, dtype: np.dtype, n: int, f: int, use_batch_stats: bool) -> tuple[_Launch, _Launch]:
    """The two launches after the GEMM for one (device, dtype, N, F, batch-stats): column_stats (training) or
    fold_running_stats (eval), then softmax_rows or the streaming kernel.

    One cooperative kernel for both (statistics, grid barrier, rows) was tried: 1.5 µs slower in a CUDA graph at the
    seed shape (the barrier costs more than the launch it saves) and ~7 µs slower on a stream, where a cooperative
    launch waits for the GEMM to drain (bench/notes/linear_bn_softmax.md).
    """
    ctype = C_TYPE[_NAME_OF[dtype]]
    if use_batch_stats:
        tile = stats_tile(f, dtype)
        first = _Launch(COLUMN_STATS.kernel(dtype=ctype, tile=tile), -(-f // (tile[0] * tile[1])), tile[2])
    else:
        first = _Launch(FOLD_RUNNING_STATS.kernel(threads=FOLD_THREADS), -(-f // FOLD_THREADS), FOLD_THREADS)
    plan = row_plan(f, dtype)
    if plan.kernel == "softmax_rows":
        rows = SOFTMAX_ROWS.kernel(dtype=ctype, threads=plan.threads, vec=plan.vec, chunks=plan.chunks, rows=plan.rows)
        groups = -(-n // plan.rows)
    else:
        rows = SOFTMAX_ROWS_STREAMING.kernel(dtype=ctype, threads=plan.threads, vec=plan.vec)
        groups = n
    resident = interop.device_sms(device_id) * _blocks_per_sm(rows, plan.threads)
    return first, _Launch(rows, min(groups, resident), plan.threads)


def stream_workspace(device_id: int, stream_ptr: int, name: str, nbytes: int):
    """The stream's persistent buffer ``name`` (runtime.workspace: from the stream owner's allocator, grown on demand;
    calls on one stream are ordered, so they may share it)."""
    return workspace.persistent(device_id, stream_ptr, f"lbs_{name}", nbytes)


