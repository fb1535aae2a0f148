"""cuBLASLt matmuls through ctypes: the GEMM interface torch's Linear and bmm use, with plans cached per shape.

CuPy binds the classic cuBLAS API only. ``cublasGemmStridedBatchedEx`` picks its kernel by an internal heuristic on
every call and, on an H200, ran our GEMMs 4–10% slower than torch's cuBLASLt calls on the same shapes (see
bench/NOTES_split.md, bench/NOTES_linear_bn_softmax.md). cuBLASLt lets us ask its heuristic once per problem with a
workspace, keep the chosen algorithm, and enqueue later calls with one C call (no per-call descriptor work).

The library is the libcublasLt that CuPy's libcublas already loaded into the process (found in /proc/self/maps), or
``libcublasLt.so.<major>`` of CuPy's CUDA major from the loader path and the nvidia-cublas wheels. Without it,
:func:`available` is False and callers fall back to ``cupy.cuda.cublas``.

Layouts: callers pass row-major operands (unit stride along the last axis, row strides ``ld*`` and batch strides
``stride_*`` in elements). cuBLASLt is column-major, so row-major C = op(A)·op(B) runs as column-major Cᵀ = op(B)ᵀ·
op(A)ᵀ: the operands swap places and each row-major matrix is read as its column-major transpose.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import os
import sys

import numpy as np

from . import workspace

# cublasLt.h enums (stable across CUDA 11–13).
_DESC_TRANSA, _DESC_TRANSB = 3, 4                  # cublasLtMatmulDescAttributes_t
_LAYOUT_BATCH_COUNT, _LAYOUT_BATCH_STRIDE = 5, 6   # cublasLtMatrixLayoutAttribute_t (int32, int64)
_PREF_MAX_WORKSPACE_BYTES = 1                      # cublasLtMatmulPreferenceAttributes_t (uint64)
_CUDA_R_32F = 0
_OP_N, _OP_T = 0, 1

# Workspace offered to the heuristic. torch gives cuBLASLt 32 MiB on Hopper (CUBLASLT_WORKSPACE_SIZE default); split-K
# and stream-K kernels need it for large-K problems such as the Linear-BN-softmax GEMM (K = 8192).
WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


def _library_candidates(major: int) -> list[str]:
    """Paths to try, best first: the copy already mapped into the process (CuPy's libcublas depends on it)."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip().split(" ")[-1]
                if os.path.basename(path).startswith("libcublasLt.so") and path not in found:
                    found.append(path)
    except OSError:  # not Linux
        pass
    for entry in sys.path:  # nvidia-cublas-cu12 (nvidia/cublas/lib) and the CUDA 13 wheels (nvidia/cu13/lib)
        found += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", f"libcublasLt.so.{major}")))
    found.append(f"libcublasLt.so.{major}")  # the loader's search path
    return list(dict.fromkeys(found))


@functools.lru_cache(maxsize=None)
def _lib():
    """The loaded libcublasLt with argument types declared, or None."""
    try:
        import cupy
        from cupy.cuda import device
        device.get_cublas_handle()  # loads CuPy's libcublas (and with it libcublasLt) if not yet loaded
        major = cupy.cuda.runtime.runtimeGetVersion() // 1000
    except Exception:  # no GPU, no CuPy: callers use cupy.cuda.cublas (or nothing)
        return None
    lib = None
    for path in _library_candidates(major):
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError:
            continue
    if lib is None:
        return None
    vp, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    sigs = {
        "cublasLtCreate": (vp,),
        "cublasLtMatmulDescCreate": (vp, i32, i32),
        "cublasLtMatmulDescSetAttribute": (vp, i32, vp, sz),
        "cublasLtMatrixLayoutCreate": (vp, i32, u64, u64, i64),
        "cublasLtMatrixLayoutSetAttribute": (vp, i32, vp, sz),
        "cublasLtMatmulPreferenceCreate": (vp,),
        "cublasLtMatmulPreferenceSetAttribute": (vp, i32, vp, sz),
        "cublasLtMatmulAlgoGetHeuristic": (vp, vp, vp, vp, vp, vp, vp, i32, vp, vp),
        "cublasLtMatmul": (vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp),
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = list(args), ctypes.c_int
    lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], ctypes.c_size_t
    return lib


def available() -> bool:
    """True when libcublasLt loaded (a GPU machine with CuPy); False sends callers to ``cupy.cuda.cublas``."""
    return _lib() is not None


def version() -> int | None:
    lib = _lib()
    return None if lib is None else int(lib.cublasLtGetVersion())


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed with cublasStatus_t {status}")


def _set(fn, obj, attr: int, value) -> None:
    _check(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), fn.__name__)


@functools.lru_cache(maxsize=None)
def _handle(device_id: int) -> int:
    h = ctypes.c_void_p()
    _check(_lib().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    return h.value


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
    """Descriptors and candidate algorithms for one GemmKey, built once (heuristic query ~50–200 µs)."""

    def __init__(self, key: GemmKey, candidates: int = 1):
        lib = _lib()
        self.key = key
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), key.compute, _CUDA_R_32F),
               "cublasLtMatmulDescCreate")
        # Column-major Cᵀ (n × m) = op(B)ᵀ (n × k) · op(A)ᵀ (k × m): cuBLASLt's A is our B and its B our A.
        _set(lib.cublasLtMatmulDescSetAttribute, self.desc, _DESC_TRANSA, ctypes.c_int32(int(key.trans_b)))
        _set(lib.cublasLtMatmulDescSetAttribute, self.desc, _DESC_TRANSB, ctypes.c_int32(int(key.trans_a)))
        lt_a = (key.k, key.n) if key.trans_b else (key.n, key.k)
        lt_b = (key.m, key.k) if key.trans_a else (key.k, key.m)
        self.layout_a = self._layout(key.b_type, *lt_a, key.ldb, key.stride_b)
        self.layout_b = self._layout(key.a_type, *lt_b, key.lda, key.stride_a)
        self.layout_c = self._layout(key.c_type, key.n, key.m, key.ldc, key.stride_c)
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE_BYTES,
             ctypes.c_uint64(WORKSPACE_BYTES))
        results = (_HeuristicResult * candidates)()
        count = ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(key.device_id), self.desc, self.layout_a, self.layout_b,
                                                  self.layout_c, self.layout_c, pref, candidates, results,
                                                  ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        self.algos = [r for r in results[:count.value] if r.state == 0]
        if not self.algos:
            raise CublasLtError(f"cuBLASLt has no algorithm for {key}")
        self.choice = 0
        self.times: list[float] = []

    def _layout(self, dtype: int, rows: int, cols: int, ld: int, stride: int) -> ctypes.c_void_p:
        lib = _lib()
        layout = ctypes.c_void_p()
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld),
               "cublasLtMatrixLayoutCreate")
        if self.key.batch > 1:
            _set(lib.cublasLtMatrixLayoutSetAttribute, layout, _LAYOUT_BATCH_COUNT, ctypes.c_int32(self.key.batch))
            _set(lib.cublasLtMatrixLayoutSetAttribute, layout, _LAYOUT_BATCH_STRIDE, ctypes.c_int64(stride))
        return layout

    def run(self, c_ptr: int, a_ptr: int, b_ptr: int, alpha_ptr: int, beta_ptr: int, stream_ptr: int,
            choice: int | None = None) -> None:
        """D = C = alpha·op(A)·op(B) + beta·C on ``stream_ptr``; alpha/beta are host float32 pointers."""
        algo = self.algos[self.choice if choice is None else choice]
        ws_ptr, ws_size = _workspace(self.key.device_id, stream_ptr, algo.workspace_size)
        status = _lib().cublasLtMatmul(_handle(self.key.device_id), self.desc, alpha_ptr, b_ptr, self.layout_a,
                                       a_ptr, self.layout_b, beta_ptr, c_ptr, self.layout_c, c_ptr, self.layout_c,
                                       ctypes.byref(algo.algo), ws_ptr, ws_size, stream_ptr)
        if status != 0:
            raise CublasLtError(f"cublasLtMatmul failed with cublasStatus_t {status} for {self.key}")

    def bind(self, alpha_ptr: int, beta_ptr: int, stream_ptr: int):
        """``run`` with the chosen algorithm, scalars and stream fixed: returns ``matmul(c_ptr, a_ptr, b_ptr)``, whose
        call is the C call alone (handle, descriptors, workspace and algorithm resolved once; ~1 µs of ctypes work
        per call instead of ~2–3 on an H200 host)."""
        algo = self.algos[self.choice]
        ws_array = _workspace_array(self.key.device_id, stream_ptr, algo.workspace_size)
        ws_ptr, ws_size = (0, 0) if ws_array is None else (workspace.pointer(ws_array), ws_array.nbytes)
        vp = ctypes.c_void_p
        fixed = (vp(_handle(self.key.device_id)), self.desc, vp(alpha_ptr), vp(beta_ptr), vp(ws_ptr),
                 ctypes.c_size_t(ws_size), vp(stream_ptr))
        handle, desc, alpha, beta, ws, size, stream = fixed
        la, lb, lc, algo_ref = self.layout_a, self.layout_b, self.layout_c, ctypes.byref(algo.algo)
        fn, key, keep = _lib().cublasLtMatmul, self.key, (algo, fixed, ws_array)

        def matmul(c_ptr: int, a_ptr: int, b_ptr: int) -> None:
            status = fn(handle, desc, alpha, b_ptr, la, a_ptr, lb, beta, c_ptr, lc, c_ptr, lc, algo_ref, ws, size,
                        stream)
            if status != 0:
                raise CublasLtError(f"cublasLtMatmul failed with cublasStatus_t {status} for {key}")
        matmul.keep = keep  # what the closure's pointers refer to: the algorithm, ctypes values, the workspace
        return matmul

    def tune(self, c_ptr: int, a_ptr: int, b_ptr: int, alpha_ptr: int, beta_ptr: int, stream) -> list[float]:
        """Time every candidate (median of TUNE_REPEATS after one warm-up, CUDA events on ``stream``), keep the
        fastest, and return the times in ms. C is overwritten, so beta must be 0."""
        import cupy
        times = []
        for i in range(len(self.algos)):
            self.run(c_ptr, a_ptr, b_ptr, alpha_ptr, beta_ptr, stream.ptr, choice=i)
            runs = []
            for _ in range(TUNE_REPEATS):
                start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                self.run(c_ptr, a_ptr, b_ptr, alpha_ptr, beta_ptr, stream.ptr, choice=i)
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
# (QKᵀ fp32-out 1.068 vs 0.992 ms, PV 0.957 vs 0.864 ms; bench/experiments/probe_gemm.py, 2026-11-21); one tuning costs
# ~TUNE_CANDIDATES × (TUNE_REPEATS + 1) GEMMs and a stream synchronization, once per shape and process.
TUNE_MIN_FLOPS = 2e9
TUNE_CANDIDATES = 8
TUNE_REPEATS = 3
TUNE = os.environ.get("CUPY_ATTN_GEMM_TUNE", "1") != "0"


def matmul(key: GemmKey, c_ptr: int, a_ptr: int, b_ptr: int, alpha_ptr: int, beta: float, beta_ptr: int,
           stream) -> Plan:
    """D = C = alpha·op(A)·op(B) + beta·C for ``key`` on CuPy stream ``stream``, with the plan cached per key;
    returns the plan, so that a caller that keeps it can call ``Plan.run`` next time without the key lookup.

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
            p.tune(c_ptr, a_ptr, b_ptr, alpha_ptr, beta_ptr, stream)
        _PLANS[key] = p
    p.run(c_ptr, a_ptr, b_ptr, alpha_ptr, beta_ptr, stream.ptr)
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
    owner's allocator (runtime.workspace); a holder keeps it alive after a larger one replaces it."""
    if size == 0:
        return None
    return workspace.persistent(device_id, stream_ptr, "cublaslt", max(size, WORKSPACE_BYTES))
