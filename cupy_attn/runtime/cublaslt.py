"""cuBLASLt matmuls through nvmath-python's bindings: the GEMM interface torch's Linear and bmm use, with plans cached
per shape.

CuPy binds the classic cuBLAS API only. ``cublasGemmStridedBatchedEx`` picks its kernel by an internal heuristic on
every call and, on an H200, ran our GEMMs 4–10% slower than torch's cuBLASLt calls on the same shapes (see
bench/notes/split.md, bench/notes/linear_bn_softmax.md). cuBLASLt lets us ask its heuristic once per problem with a
workspace, keep the chosen algorithm, and enqueue later calls with one C call (no per-call descriptor work).

The binding is ``nvmath.bindings.cublasLt`` (nvmath-python, NVIDIA's maintained Cython bindings): enums, attribute
dtypes and the heuristic-result struct come from it, and it loads libcublasLt itself through cuda-pathfinder, which
returns a copy already in the process before searching the wheels and the loader path. :func:`_lib` therefore loads
CuPy's libcublas (and with it libcublasLt) first, imports nvmath after, and accepts the binding only when its library
has the major version of CuPy's libcublas. Without nvmath, without a driver or on a major mismatch, :func:`available` is
False and callers fall back to ``cupy.cuda.cublas`` (runtime/blas.py). Importing nvmath costs ~1.2 s once per process
(it imports its fft/linalg/sparse packages and cuda.core, and preloads the CUDA math libraries it finds), so it happens
on the first :func:`available` call, not when cupy_attn is imported.

Host time of one bound call (``Plan.bind``'s closure), measured without a GPU against a stub libcublasLt whose
``cublasLtMatmul`` returns at once (bench/experiments/host_overhead/binding_overhead.py; AMD EPYC host, Python 3.11, median of
7 × 200k calls, timeit's ~0.05 µs lambda floor included): the closure 0.58–0.60 µs, of which nvmath's ``matmul`` on 16
Python ints is 0.51; the ctypes closure it replaces (fixed arguments pre-built as ``c_void_p``) 2.9–3.2 µs. A
no-argument call (``cublasLtGetVersion``): nvmath 0.12 µs, ctypes 0.38–0.43 µs.

Layouts: callers pass row-major operands (unit stride along the last axis, row strides ``ld*`` and batch strides
``stride_*`` in elements). cuBLASLt is column-major, so row-major C = op(A)·op(B) runs as column-major Cᵀ = op(B)ᵀ·
op(A)ᵀ: the operands swap places and each row-major matrix is read as its column-major transpose.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import warnings
import weakref

import numpy as np

from . import env, workspace

# Workspace offered to the heuristic. torch gives cuBLASLt 32 MiB on Hopper (CUBLASLT_WORKSPACE_SIZE default); split-K
# and stream-K kernels need it for large-K problems such as the Linear-BN-softmax GEMM (K = 8192).
WORKSPACE_BYTES = 32 << 20


class CublasLtError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def _lib():
    """``nvmath.bindings.cublasLt`` bound to a libcublasLt of CuPy's cuBLAS major, or None."""
    try:
        from cupy.cuda import cublas, device
        # Loads CuPy's libcublas and its libcublasLt before nvmath searches, so that nvmath finds that copy loaded.
        cupy_major = cublas.getVersion(device.get_cublas_handle()) // 10000
    except Exception:  # no GPU, no driver, no CuPy: callers use cupy.cuda.cublas (or nothing)
        return None
    try:
        from nvmath.bindings import cublasLt
    except Exception as e:  # not installed: the classic API, silently (a supported configuration); broken: say so
        if not (isinstance(e, ModuleNotFoundError) and e.name == "nvmath"):
            warnings.warn(f"cupy_attn: nvmath-python does not import ({e!r}); GEMMs use classic cuBLAS",
                          RuntimeWarning, stacklevel=2)
        return None
    try:
        lt_major = cublasLt.get_version() // 10000  # the binding's first call loads the library
    except Exception as e:  # nvmath's loader found no usable libcublasLt (NotSupportedError, a RuntimeError)
        warnings.warn(f"cupy_attn: nvmath-python cannot load libcublasLt ({e}); GEMMs use classic cuBLAS",
                      RuntimeWarning, stacklevel=2)
        return None
    if lt_major != cupy_major:
        warnings.warn(f"cupy_attn: nvmath-python loaded cuBLASLt {lt_major}.x but CuPy uses cuBLAS {cupy_major}.x; "
                      "GEMMs use classic cuBLAS", RuntimeWarning, stacklevel=2)
        return None
    return cublasLt


def available() -> bool:
    """True when nvmath's cuBLASLt binding loaded CuPy's CUDA major; False sends callers to ``cupy.cuda.cublas``."""
    return _lib() is not None


def version() -> int | None:
    lt = _lib()
    return None if lt is None else int(lt.get_version())


def library_path() -> str | None:
    """The libcublasLt file nvmath loaded (cuda-pathfinder caches the load, so this is the same handle)."""
    if _lib() is None:
        return None
    from cuda import pathfinder
    return pathfinder.load_nvidia_dynamic_lib("cublasLt").abs_path


def _set(setter, dtype_of, obj: int, attr, value) -> None:
    """Set ``attr`` of a descriptor to ``value`` in the C type the binding declares for it."""
    buf = np.array(value, dtype=dtype_of(attr))
    setter(obj, attr, buf.ctypes.data, buf.nbytes)


def _destroy(owned: list) -> None:
    """Destroy a plan's descriptors (weakref.finalize: the plan was collected or the interpreter is exiting)."""
    while owned:
        destroy, obj = owned.pop()
        destroy(obj)


@functools.lru_cache(maxsize=None)
def _handle(device_id: int) -> int:
    lt = _lib()
    h = lt.create()
    atexit.register(lt.destroy, h)
    return h


@dataclasses.dataclass(frozen=True)
class GemmKey:
    """One strided-batched GEMM problem in row-major terms (see the module docstring); all strides in elements."""

    device_id: int
    a_type: int          # cudaDataType_t of A
    b_type: int          # cudaDataType_t of B
    c_type: int          # cudaDataType_t of C (= D)
    compute: int         # cublasComputeType_t
    m: int
    n: int
    k: int
    batch: int
    trans_a: bool
    trans_b: bool
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int


class Plan:
    """Descriptors and candidate algorithms for one GemmKey, built once (heuristic query ~50–200 µs); the descriptors
    are destroyed when the plan is collected (a bound closure keeps its plan alive)."""

    def __init__(self, key: GemmKey, candidates: int = 1):
        import nvmath
        lt = _lib()
        self.key = key
        self._owned: list = []  # (destroy function, descriptor) in creation order
        self._finalizer = weakref.finalize(self, _destroy, self._owned)
        try:
            self.desc = self._own(lt.matmul_desc_destroy, lt.matmul_desc_create(key.compute,
                                                                                nvmath.CudaDataType.CUDA_R_32F))
            # Column-major Cᵀ (n × m) = op(B)ᵀ (n × k) · op(A)ᵀ (k × m): cuBLASLt's A is our B and its B our A.
            for attr, trans in ((lt.MatmulDescAttribute.TRANSA, key.trans_b), (lt.MatmulDescAttribute.TRANSB,
                                                                                key.trans_a)):
                _set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, self.desc, attr, int(trans))
            lt_a = (key.k, key.n) if key.trans_b else (key.n, key.k)
            lt_b = (key.m, key.k) if key.trans_a else (key.k, key.m)
            self.layout_a = self._layout(lt, key.b_type, *lt_a, key.ldb, key.stride_b)
            self.layout_b = self._layout(lt, key.a_type, *lt_b, key.lda, key.stride_a)
            self.layout_c = self._layout(lt, key.c_type, key.n, key.m, key.ldc, key.stride_c)
            self._results = lt.MatmulHeuristicResult(candidates)
            count = np.zeros(1, np.int32)
            pref = lt.matmul_preference_create()  # needed by the query only
            try:
                _set(lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype, pref,
                     lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, WORKSPACE_BYTES)
                lt.matmul_algo_get_heuristic(_handle(key.device_id), self.desc, self.layout_a, self.layout_b,
                                             self.layout_c, self.layout_c, pref, candidates, self._results.ptr,
                                             count.ctypes.data)
            finally:
                lt.matmul_preference_destroy(pref)
        except lt.cuBLASLtError as e:
            raise CublasLtError(f"cuBLASLt plan for {key}: {e}") from e
        # Views into self._results (state 0 = CUBLAS_STATUS_SUCCESS); each view's .ptr is its cublasLtMatmulAlgo_t,
        # the struct's first member.
        self.algos = [r for r in (self._results[i] for i in range(int(count[0]))) if r.state == 0]
        if not self.algos:
            raise CublasLtError(f"cuBLASLt has no algorithm for {key}")
        self.choice = 0
        self.times: list[float] = []

    def _own(self, destroy, obj: int) -> int:
        self._owned.append((destroy, obj))
        return obj

    def _layout(self, lt, dtype: int, rows: int, cols: int, ld: int, stride: int) -> int:
        layout = self._own(lt.matrix_layout_destroy, lt.matrix_layout_create(dtype, rows, cols, ld))
        if self.key.batch > 1:
            for attr, value in ((lt.MatrixLayoutAttribute.BATCH_COUNT, self.key.batch),
                                (lt.MatrixLayoutAttribute.STRIDED_BATCH_OFFSET, stride)):
                _set(lt.matrix_layout_set_attribute, lt.get_matrix_layout_attribute_dtype, layout, attr, value)
        return layout

    def run(self, c_ptr: int, a_ptr: int, b_ptr: int, alpha_ptr: int, beta_ptr: int, stream_ptr: int,
            choice: int | None = None, work: tuple[int, int] | None = None) -> None:
        """D = C = alpha·op(A)·op(B) + beta·C on ``stream_ptr``; alpha/beta are host float32 pointers. ``work``:
        (pointer, bytes) of the caller's workspace for this call (the split paths take it from the call's scratch,
        so that nothing stays held after the call); None, or too small for the algorithm: the stream's persistent
        workspace (runtime.workspace.persistent, freed by cupy_attn.release_memory)."""
        lt = _lib()
        algo = self.algos[self.choice if choice is None else choice]
        ws = None
        if work is not None and work[1] >= algo.workspace_size:
            ws_ptr, ws_size = work
        else:
            ws = _workspace_array(self.key.device_id, stream_ptr, algo.workspace_size)  # held until enqueued
            ws_ptr, ws_size = (0, 0) if ws is None else (workspace.pointer(ws), ws.nbytes)
        try:
            lt.matmul(_handle(self.key.device_id), self.desc, alpha_ptr, b_ptr, self.layout_a, a_ptr, self.layout_b,
                      beta_ptr, c_ptr, self.layout_c, c_ptr, self.layout_c, algo.ptr, ws_ptr, ws_size, stream_ptr)
        except lt.cuBLASLtError as e:
            raise CublasLtError(f"cublasLtMatmul failed ({e}) for {self.key}") from e

    def bind(self, alpha_ptr: int, beta_ptr: int, stream_ptr: int):
        """``run`` with the chosen algorithm, scalars and stream fixed: returns ``matmul(c_ptr, a_ptr, b_ptr)``, whose
        call is one binding call on Python ints (handle, descriptors, workspace and algorithm resolved here; ~0.6 µs
        of host work per call against ~3 µs for the ctypes closure before, see the module docstring)."""
        lt = _lib()
        algo = self.algos[self.choice]
        ws_array = _workspace_array(self.key.device_id, stream_ptr, algo.workspace_size)
        ws_ptr, ws_size = (0, 0) if ws_array is None else (workspace.pointer(ws_array), ws_array.nbytes)
        handle, desc, la, lb, lc, algo_ptr = (_handle(self.key.device_id), self.desc, self.layout_a, self.layout_b,
                                              self.layout_c, algo.ptr)
        fn, error, key = lt.matmul, lt.cuBLASLtError, self.key

        def matmul(c_ptr: int, a_ptr: int, b_ptr: int) -> None:
            try:
                fn(handle, desc, alpha_ptr, b_ptr, la, a_ptr, lb, beta_ptr, c_ptr, lc, c_ptr, lc, algo_ptr, ws_ptr,
                   ws_size, stream_ptr)
            except error as e:
                raise CublasLtError(f"cublasLtMatmul failed ({e}) for {key}") from e
        matmul.keep = (self, ws_array)  # what the closure's pointers refer to: descriptors and algorithm, workspace
        return matmul

    def tune(self, c_ptr: int, a_ptr: int, b_ptr: int, alpha_ptr: int, beta_ptr: int, stream,
             work: tuple[int, int] | None = None) -> list[float]:
        """Time every candidate (median of TUNE_REPEATS after one warm-up, CUDA events on ``stream``; ``work`` as in
        :meth:`run`), keep the fastest, and return the times in ms. C is overwritten, so beta must be 0."""
        import cupy
        times = []
        for i in range(len(self.algos)):
            self.run(c_ptr, a_ptr, b_ptr, alpha_ptr, beta_ptr, stream.ptr, choice=i, work=work)
            runs = []
            for _ in range(TUNE_REPEATS):
                start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                self.run(c_ptr, a_ptr, b_ptr, alpha_ptr, beta_ptr, stream.ptr, choice=i, work=work)
                stop.record(stream)
                runs.append((start, stop))
            stream.synchronize()
            times.append(float(np.median([cupy.cuda.get_elapsed_time(a, b) for a, b in runs])))
        self.choice = int(np.argmin(times))
        self.times = times
        return times


_PLANS: dict = {}

# Problems of at least this many FLOPs are timed once over the heuristic's first TUNE_CANDIDATES algorithms, and the
# fastest is kept. On an H200 the heuristic's first choice was 8–11% slower than its third on the SDPA seed GEMMs
# (QKᵀ fp32-out 1.068 vs 0.992 ms, PV 0.957 vs 0.864 ms; bench/experiments/gemm/probe_gemm.py, 2026-11-21); one tuning costs
# ~TUNE_CANDIDATES × (TUNE_REPEATS + 1) GEMMs and a stream synchronization, once per shape and process.
TUNE_MIN_FLOPS = 2e9
TUNE_CANDIDATES = 8
TUNE_REPEATS = 3
TUNE = env.get("CUPY_ATTN_GEMM_TUNE", "1") != "0"


def matmul(key: GemmKey, c_ptr: int, a_ptr: int, b_ptr: int, alpha_ptr: int, beta: float, beta_ptr: int,
           stream, work: tuple[int, int] | None = None) -> Plan:
    """D = C = alpha·op(A)·op(B) + beta·C for ``key`` on CuPy stream ``stream``, with the plan cached per key;
    returns the plan, so that a caller that keeps it can call ``Plan.run`` next time without the key lookup.
    ``work``: the caller's workspace for this call (:meth:`Plan.run`).

    The first call of a large problem (≥ TUNE_MIN_FLOPS) with beta = 0 times the candidate algorithms on the real
    operands (C is overwritten, then written once more) and synchronizes ``stream``; not while the stream is being
    captured into a CUDA graph, and not when CUPY_ATTN_GEMM_TUNE=0 (then cuBLASLt's first choice runs).
    """
    p = _PLANS.get(key)
    if p is None:
        flops = 2.0 * key.m * key.n * key.k * key.batch
        tune = TUNE and beta == 0 and flops >= TUNE_MIN_FLOPS and not _capturing(stream)
        p = Plan(key, TUNE_CANDIDATES if tune else 1)
        if tune:
            p.tune(c_ptr, a_ptr, b_ptr, alpha_ptr, beta_ptr, stream, work)
        _PLANS[key] = p
    p.run(c_ptr, a_ptr, b_ptr, alpha_ptr, beta_ptr, stream.ptr, work=work)
    return p


def _capturing(stream) -> bool:
    from cupy.cuda import runtime
    return stream.ptr != 0 and runtime.streamIsCapturing(stream.ptr) != 0


def _workspace(device_id: int, stream_ptr: int, size: int) -> tuple[int, int]:
    """(pointer, bytes) of a workspace of at least ``size`` bytes, one per (device, stream): calls on one stream are
    ordered, so they may share it."""
    ws = _workspace_array(device_id, stream_ptr, size)
    return (0, 0) if ws is None else (workspace.pointer(ws), ws.nbytes)


def _workspace_array(device_id: int, stream_ptr: int, size: int):
    """The buffer behind ``_workspace`` (None for size 0): the stream's persistent "cublaslt" buffer from the stream
    owner's allocator (runtime.workspace), bound (Plan.bind bakes its address into the calls it returns: only
    release_memory(graphs=True) frees it); a holder keeps it alive after a larger one replaces it."""
    if size == 0:
        return None
    return workspace.persistent(device_id, stream_ptr, "cublaslt", max(size, WORKSPACE_BYTES), bound=True)
