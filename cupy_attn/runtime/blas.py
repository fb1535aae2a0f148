"""cuBLAS GEMMs, row-major in, fp32 compute: cuBLASLt (runtime.cublaslt, through nvmath-python) when it loads, else
``cupy.cuda.cublas``.

``cupy.matmul`` on batched fp16 upcasts to fp32 (~30 TFLOP/s on an H200); calling ``gemmStridedBatchedEx`` directly
with fp16/bf16 storage and fp32 compute reaches the tensor-core rate (~620–660 TFLOP/s measured on the SDPA seed
shape). cuBLASLt with a per-shape cached algorithm and a 32 MiB workspace is what torch calls; ``CUPY_ATTN_CUBLASLT=0``
forces the classic API (for comparison and as a fallback).

All matrices here are row-major with unit stride along the last axis. cuBLAS is column-major, so C = A·B (row-major) is
issued as Cᵀ = Bᵀ·Aᵀ: the operands swap places and each row-major matrix is read as its column-major transpose.
"""
from __future__ import annotations

import numpy as np

from . import cublaslt, env, workspace
from .interop import dtype_name

USE_CUBLASLT = env.get("CUPY_ATTN_CUBLASLT", "1") != "0"

_OP_N, _OP_T = 0, 1
_ALGO_DEFAULT = -1  # CUBLAS_GEMM_DEFAULT


def cuda_dtype(dtype) -> int:
    """cudaDataType_t of a GEMM operand (CuPy's constants: CUDA_R_16F, CUDA_R_16BF, CUDA_R_32F)."""
    from cupy.cuda import runtime
    return {"float16": runtime.CUDA_R_16F, "bfloat16": runtime.CUDA_R_16BF, "float32": runtime.CUDA_R_32F}[
        dtype_name(dtype)]


def compute_type(dtype, allow_tf32: bool = False) -> int:
    """fp32 accumulation always. fp32 inputs stay exact fp32 unless the caller opts into TF32 tensor cores."""
    from cupy.cuda import cublas
    if dtype == np.float32:
        return cublas.CUBLAS_COMPUTE_32F_FAST_TF32 if allow_tf32 else cublas.CUBLAS_COMPUTE_32F_PEDANTIC
    return cublas.CUBLAS_COMPUTE_32F


class StridedGemm:
    """C[i] = alpha · op(A[i]) · op(B[i]) + beta · C[i] for i < batch, row-major: one problem, prepared once, called
    with pointers on CuPy's current stream (the split path and Linear-BN-softmax keep these per shape, so a call
    costs the library's own enqueue and not the argument translation).

    Shapes (row-major): op(A) is (m, k), op(B) is (k, n), C is (m, n). ``trans_a`` means A is stored (k, m).
    ``ld*`` are row strides in elements, ``stride_*`` batch strides in elements (0 broadcasts one matrix).
    Inputs may be fp16/bf16/fp32; C may differ in type from A and B (e.g. fp16 in, fp32 scores out).
    """

    def __init__(self, *, c_dtype, ldc: int, stride_c: int, a_dtype, lda: int, stride_a: int, trans_a: bool,
                 b_dtype, ldb: int, stride_b: int, trans_b: bool, m: int, n: int, k: int, batch: int,
                 alpha: float = 1.0, beta: float = 0.0, allow_tf32: bool = False):
        import cupy
        # alpha/beta live in host memory (the handle's default pointer mode); cuBLAS reads them before returning.
        self._alpha = np.array(alpha, dtype=np.float32)
        self._beta = np.array(beta, dtype=np.float32)
        self._alpha_ptr, self._beta_ptr, self._beta_value = self._alpha.ctypes.data, self._beta.ctypes.data, beta
        compute = compute_type(a_dtype, allow_tf32)
        self._lt_key = self._lt_plan = None
        if USE_CUBLASLT and cublaslt.available():
            batched = batch > 1
            self._lt_key = cublaslt.GemmKey(
                cupy.cuda.device.get_device_id(), cuda_dtype(a_dtype), cuda_dtype(b_dtype), cuda_dtype(c_dtype),
                compute, m, n, k, batch, trans_a, trans_b, lda, ldb, ldc, stride_a * batched, stride_b * batched,
                stride_c * batched)
        # Classic API: row-major C = op(A)·op(B)  <=>  column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, with m and n exchanged.
        self._ops = (_OP_T if trans_b else _OP_N, _OP_T if trans_a else _OP_N, n, m, k)
        self._b = (cuda_dtype(b_dtype), ldb, stride_b)
        self._a = (cuda_dtype(a_dtype), lda, stride_a)
        self._c = (cuda_dtype(c_dtype), ldc, stride_c)
        self._tail = (batch, compute, _ALGO_DEFAULT)
        # Bytes of the workspace a call may be given (``work``): cuBLASLt's; the classic API's handle keeps its own.
        self.workspace_bytes = cublaslt.WORKSPACE_BYTES if self._lt_key is not None else 0

    def bind(self, stream_ptr: int):
        """``fn(c_ptr, a_ptr, b_ptr)`` enqueuing this GEMM on ``stream_ptr`` with the least host work (cuBLASLt's
        bound call), or None before the first call has chosen the cuBLASLt algorithm (or without cuBLASLt), and while
        the stream is being captured (a bound call keeps its workspace, which under capture is a per-call buffer)."""
        if self._lt_plan is None or workspace.capturing(stream_ptr):
            return None
        return self._lt_plan.bind(self._alpha_ptr, self._beta_ptr, stream_ptr)

    def __call__(self, c_ptr: int, a_ptr: int, b_ptr: int, stream_ptr: int | None = None,
                 work: tuple[int, int] | None = None) -> None:
        """Enqueue on ``stream_ptr`` (a raw stream handle), or on CuPy's current stream when None. The first call of
        a large problem may tune the cuBLASLt algorithm on the current stream, which must then be ``stream_ptr``'s.
        ``work``: (pointer, bytes ≥ workspace_bytes) of a workspace from the caller's per-call scratch, free for this
        GEMM until it is done (stream order); None: the stream's persistent cuBLASLt workspace."""
        if self._lt_plan is not None:  # hashing the 17-field key on every call costs a few µs of host time
            if stream_ptr is None:
                stream_ptr = _current_stream_ptr()
            self._lt_plan.run(c_ptr, a_ptr, b_ptr, self._alpha_ptr, self._beta_ptr, stream_ptr, work=work)
            return
        import cupy
        stream = cupy.cuda.get_current_stream()
        if self._lt_key is not None:
            self._lt_plan = cublaslt.matmul(self._lt_key, c_ptr, a_ptr, b_ptr, self._alpha_ptr, self._beta_value,
                                             self._beta_ptr, stream, work)
            return
        from cupy.cuda import cublas, device
        stream_ptr = stream.ptr if stream_ptr is None else stream_ptr
        if workspace.capturing(stream_ptr):
            raise RuntimeError("CUDA-graph capture of a cuBLAS GEMM needs cuBLASLt through nvmath-python (a dependency "
                               "of cupy_attn: pip install 'nvmath-python>=1.0,<2'); CuPy's classic cuBLAS handle cannot "
                               "be used while a stream is captured")
        handle = device.get_cublas_handle()
        cublas.setStream(handle, stream_ptr)
        cublas.gemmStridedBatchedEx(handle, *self._ops, self._alpha_ptr, b_ptr, *self._b, a_ptr, *self._a,
                                    self._beta_ptr, c_ptr, *self._c, *self._tail)


def lt_workspace_bytes() -> int:
    """Bytes of the workspace a :class:`StridedGemm` call may be given: cuBLASLt's WORKSPACE_BYTES (32 MiB), 0 where
    the classic API runs (no nvmath, CUPY_ATTN_CUBLASLT=0)."""
    return cublaslt.WORKSPACE_BYTES if USE_CUBLASLT and cublaslt.available() else 0


def _current_stream_ptr() -> int:
    import cupy
    return cupy.cuda.get_current_stream().ptr


def gemm_strided_batched(*, c_ptr: int, a_ptr: int, b_ptr: int, **problem) -> None:
    """One-off :class:`StridedGemm` call: ``problem`` takes StridedGemm's keyword arguments."""
    StridedGemm(**problem)(c_ptr, a_ptr, b_ptr)


def gemm(c, a, b, *, trans_b: bool = False, alpha: float = 1.0, beta: float = 0.0, allow_tf32: bool = False) -> None:
    """c = alpha · a · op(b) + beta · c for 2-D CuPy arrays, row-major with unit last-axis stride (no batch).

    a: (m, k); b: (k, n), or (n, k) with ``trans_b`` (a Linear layer's weight); c: (m, n), preallocated.
    """
    m, k = a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    for name, x in (("a", a), ("b", b), ("c", c)):
        if x.strides[-1] != x.itemsize:
            raise ValueError(f"gemm: {name} needs unit stride along its last axis")
    gemm_strided_batched(c_ptr=c.data.ptr, c_dtype=c.dtype, ldc=c.strides[0] // c.itemsize, stride_c=0,
                         a_ptr=a.data.ptr, a_dtype=a.dtype, lda=a.strides[0] // a.itemsize, stride_a=0, trans_a=False,
                         b_ptr=b.data.ptr, b_dtype=b.dtype, ldb=b.strides[0] // b.itemsize, stride_b=0,
                         trans_b=trans_b, m=m, n=n, k=k, batch=1, alpha=alpha, beta=beta, allow_tf32=allow_tf32)
