"""fp32 GEMMs on TF32 tensor cores at fp32 accuracy (cuda_src/attention/gemm_3xtf32.cu): the split path's fp32 GEMMs.

    C[b] = alpha · A[b] · op(B[b])      fp32 in, fp32 out, row-major, b < batch; op(B) = Bᵀ (``trans_b``) or B

Algorithm: 3xTF32, CUTLASS's OpMultiplyAddFastF32 (cutlass/gemm/warp/mma_tensor_op_fast_f32.h), the GEMM that
PyTorch's memory-efficient attention (its default fp32 SDPA kernel on sm80+) runs on. Each operand element is split
into a TF32 ``big`` (x rounded to nearest) and a TF32 ``small`` (x − big, truncated), and an fp32 accumulator takes,
per k-step of 8, the three mma.sync.m16n8k8 TF32 products small·big, big·small, big·big. The split loses < 2^-22
relative per element and the dropped small·small term ≤ 2^-22 of a product; the accumulator is rounded once per
k-step and product instead of after every multiply-add as in cuBLAS's SGEMM (CUBLAS_COMPUTE_32F_PEDANTIC). Unlike
CUTLASS, that accumulator restarts at every 32-deep k-tile and is added to the result by one fp32 add, which keeps the
tensor core's roundings at the scale of a partial sum: CUTLASS's single accumulator measured less accurate than SGEMM
on an H200 (the unit truncates its sums; bench/notes/split.md). On the split path's scores at
|scale·q·k| ~ 100, SGEMM made our fp32 attention 2.6-4× less accurate than torch's (issue 14); the two-level GEMM
keeps it at torch's accuracy and runs at ~60 TFLOP/s on an H200 against SGEMM's ~50.

``CUPY_ATTN_FP32_GEMM`` selects the split path's fp32 GEMM (:func:`setting`): ``3xtf32`` (this module, the default)
or ``sgemm`` (cuBLAS, exact IEEE multiply-adds, the path before), for A/B comparisons. ``allow_tf32=True`` keeps
cuBLAS FAST_TF32 (plain TF32, the caller's opt-in) either way; devices before sm_80 have no TF32 mma and keep SGEMM.
"""
from __future__ import annotations

import dataclasses
import functools
import threading

import numpy as np

from ...runtime import env
from ...runtime.compile import KernelFamily
from ...runtime.launch import PreparedLaunch, Step

ENV_FP32_GEMM = "CUPY_ATTN_FP32_GEMM"
ENV_FP32_GEMM_DEFAULT = "3xtf32"
CHOICES = ("3xtf32", "sgemm")
THREADS = 256  # 8 warps, 2 along m × 4 along n (gemm_3xtf32.cu's kThreads)
BLOCK_K = 32   # k per shared-memory stage (gemm_3xtf32.cu's kBlockK)
_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Tile:
    """A CTA's kBlockM × kBlockN tile of C and the depth of its cp.async ring (the template values of gemm_3xtf32)."""
    block_m: int
    block_n: int
    stages: int

    def smem_bytes(self, trans_b: bool) -> int:
        """stages × (A: block_m rows × 32 fp32 at pitch 36; B: block_n × 32 at pitch 36 (trans_b) or 32 × block_n at
        pitch block_n + 8), the kernel's kTileA + kTileB floats per stage."""
        tile_b = self.block_n * (BLOCK_K + 4) if trans_b else BLOCK_K * (self.block_n + 8)
        return self.stages * (self.block_m * (BLOCK_K + 4) + tile_b) * 4


# A 128×128 CTA of 8 warps (warp tiles 64×32, 64 fp32 accumulators per thread), holding the result plus a k-tile's
# partial sum: 128 accumulators, 215-231 registers, one CTA per SM; 4 stages (144 KB) to keep copies in flight with
# 8 warps per SM. Why two levels: the tensor core rounds its fp32 sum once per mma, 3·k/8 times along k at the
# magnitude of the whole dot product; restarting from zero per k-tile rounds 12 times at the magnitude of a 32-term
# partial sum and then once per k-tile at full magnitude, which keeps attention's output error at large logits near
# torch's (a single accumulator was faster but less accurate than SGEMM; bench/notes/split.md has the model and the
# measurements).
TILE = Tile(block_m=128, block_n=128, stages=4)

_FIELDS = ("c", "a", "b", "m", "n", "k", "batch", "lda", "ldb", "ldc", "stride_a", "stride_b", "stride_c", "tiles_m",
           "tiles_n", "alpha")
# Gemm3xTf32Params (gemm_3xtf32.cu), every field 8 bytes; the three pointers are the first three words.
_PARAMS = np.dtype([(name, np.float64 if name == "alpha" else np.int64) for name in _FIELDS])

_BOOL = ("false", "true")
GEMM_3XTF32 = KernelFamily(
    name="gemm_3xtf32",
    source="attention/gemm_3xtf32.cu",
    template="cupy_attn::gemm_3xtf32<{tile.block_m}, {tile.block_n}, {tile.stages}, {trans_b}, {align_a}, {align_b}>",
    axes={"tile": (TILE,), "trans_b": _BOOL, "align_a": _BOOL, "align_b": _BOOL},
    structs=(("cupy_attn::Gemm3xTf32Params", _PARAMS),),
)


def setting() -> str:
    """``CUPY_ATTN_FP32_GEMM``: ``3xtf32`` (unset: the default, this module) or ``sgemm`` (cuBLAS). Raises ValueError
    for any other value (a misspelt A/B switch must not silently measure the default)."""
    raw = env.get(ENV_FP32_GEMM, ENV_FP32_GEMM_DEFAULT)
    value = raw.strip().lower() or ENV_FP32_GEMM_DEFAULT
    if value not in CHOICES:
        raise ValueError(f"{ENV_FP32_GEMM} must be one of {', '.join(CHOICES)}, got {raw!r}")
    return value


def fp32_gemm(dtype, allow_tf32: bool, arch: int) -> str | None:
    """The GEMM the split path runs for inputs of ``dtype`` on a device of compute capability ``arch`` (90 for an
    H200): None for fp16/bf16 (cuBLAS on tensor cores, fp32 accumulation), and for float32 ``"tf32"`` (cuBLAS
    FAST_TF32: allow_tf32=True), ``"3xtf32"`` (this module: the default, arch ≥ 80) or ``"sgemm"`` (cuBLAS PEDANTIC
    fp32: ``CUPY_ATTN_FP32_GEMM=sgemm``, or a device before sm_80).

    >>> fp32_gemm(np.float16, False, 90), fp32_gemm(np.float32, True, 90), fp32_gemm(np.float32, False, 75)
    (None, 'tf32', 'sgemm')
    """
    if np.dtype(dtype) != np.float32:
        return None
    if allow_tf32:
        return "tf32"
    choice = setting()
    return choice if arch >= 80 else "sgemm"


DESCRIPTIONS = {
    None: "cuBLAS, tensor cores, fp32 accumulation",
    "tf32": "cuBLAS FAST_TF32 (allow_tf32=True: TF32 operands, ~1e-3 relative)",
    "3xtf32": f"3xTF32 tensor-core GEMM (gemm_3xtf32: CUTLASS FastF32 split, a fresh accumulator per 32-deep k-tile; "
              f"{ENV_FP32_GEMM}=sgemm for cuBLAS SGEMM)",
    "sgemm": f"cuBLAS SGEMM (IEEE fp32 FFMA; {ENV_FP32_GEMM}=3xtf32 on sm_80+ for the 3xTF32 tensor-core GEMM)",
}


class Gemm3xTF32:
    """C[i] = alpha · A[i] · op(B[i]) for i < batch, fp32, row-major: one problem, prepared once, launched with
    pointers. The constructor takes :class:`cupy_attn.runtime.blas.StridedGemm`'s keywords and ``__call__``/``bind``
    keep its contract, so the split path holds either.

    Shapes (row-major, elements): A is (m, k) with row stride ``lda`` and batch stride ``stride_a``; B is (n, k) with
    ``trans_b`` (C = A·Bᵀ) or (k, n); C is (m, n). Batch strides may be 0 (one matrix for every i). The last axis of
    each must be contiguous. All three dtypes must be float32. The CTA tile is :data:`TILE`.

    Raises TypeError for a non-float32 dtype and ValueError, naming the argument, for trans_a=True, beta ≠ 0,
    allow_tf32=True (that is cuBLAS's FAST_TF32, not this GEMM), sizes < 1 or ≥ 2^31, row strides shorter than a row,
    negative batch strides, or a grid over 2^31 − 1 CTAs. Operands whose rows (base address, lda or ldb, batch stride)
    are 16-byte aligned are copied by 16-byte cp.async, the others by 4-byte copies (any fp32 layout); the choice is
    made per call from the pointers, and each kernel variant is compiled (or read from the compile cache) and loaded
    at its first use.
    """

    workspace_bytes = 0  # StridedGemm's contract: this GEMM takes no workspace (a call's ``work`` is ignored)

    def __init__(self, *, c_dtype, ldc: int, stride_c: int, a_dtype, lda: int, stride_a: int, trans_a: bool,
                 b_dtype, ldb: int, stride_b: int, trans_b: bool, m: int, n: int, k: int, batch: int,
                 alpha: float = 1.0, beta: float = 0.0, allow_tf32: bool = False):
        for name, dt in (("a_dtype", a_dtype), ("b_dtype", b_dtype), ("c_dtype", c_dtype)):
            if np.dtype(dt) != np.float32:
                raise TypeError(f"Gemm3xTF32: {name} must be float32, got {np.dtype(dt)}")
        if trans_a:
            raise ValueError("Gemm3xTF32: trans_a=True is not supported (A must be stored (m, k), row-major)")
        if beta != 0:
            raise ValueError(f"Gemm3xTF32: beta must be 0 (C is overwritten), got {beta}")
        if allow_tf32:
            raise ValueError("Gemm3xTF32: allow_tf32=True asks for plain TF32 (cuBLAS FAST_TF32), not 3xTF32")
        for name, v in (("m", m), ("n", n), ("k", k), ("batch", batch)):
            if not 1 <= v <= _INT32_MAX:
                raise ValueError(f"Gemm3xTF32: {name} must be in [1, 2^31 - 1], got {v}")
        b_row = k if trans_b else n
        for name, ld, row in (("lda", lda, k), ("ldb", ldb, b_row), ("ldc", ldc, n)):
            if ld < row:
                raise ValueError(f"Gemm3xTF32: {name}={ld} is shorter than a row ({row} elements)")
        for name, s in (("stride_a", stride_a), ("stride_b", stride_b), ("stride_c", stride_c)):
            if s < 0:
                raise ValueError(f"Gemm3xTF32: {name} must be >= 0, got {s}")
        tile = TILE
        tiles_m, tiles_n = -(-m // tile.block_m), -(-n // tile.block_n)
        blocks = batch * tiles_m * tiles_n
        if blocks > _INT32_MAX:
            raise ValueError(f"Gemm3xTF32: batch·⌈m/{tile.block_m}⌉·⌈n/{tile.block_n}⌉ = {blocks} CTAs exceeds the "
                             f"grid limit 2^31 - 1")
        self.tile = tile
        self.trans_b = bool(trans_b)
        p = np.zeros((), dtype=_PARAMS)
        for name, v in (("m", m), ("n", n), ("k", k), ("batch", batch), ("lda", lda), ("ldb", ldb), ("ldc", ldc),
                        ("stride_a", stride_a), ("stride_b", stride_b), ("stride_c", stride_c),
                        ("tiles_m", tiles_m), ("tiles_n", tiles_n)):
            p[name] = v
        p["alpha"] = float(np.float32(alpha))  # SGEMM's alpha is an fp32 scalar too
        self.params = p
        # Rows 16-byte aligned apart from the base pointer (checked per call): every row and batch start then is.
        self._rows16_a = lda % 4 == 0 and (stride_a % 4 == 0 or batch == 1)
        self._rows16_b = ldb % 4 == 0 and (stride_b % 4 == 0 or batch == 1)
        self.smem = tile.smem_bytes(self.trans_b)
        self.grid, self.block = (blocks,), (THREADS,)
        self._launches: dict = {}  # (align_a, align_b) -> PreparedLaunch, built at its first use
        self._launches_lock = threading.Lock()

    def _aligned(self, a_ptr: int, b_ptr: int) -> tuple[bool, bool]:
        """Whether each operand's rows are 16-byte aligned at these addresses (16-byte copies), else 4-byte copies."""
        return self._rows16_a and a_ptr % 16 == 0, self._rows16_b and b_ptr % 16 == 0

    def variant(self, a_ptr: int, b_ptr: int) -> dict:
        """The kernel-table row for these operand addresses: 16-byte copies for an operand whose rows are 16-byte
        aligned (align_* "true"), else 4-byte copies."""
        align_a, align_b = self._aligned(a_ptr, b_ptr)
        return {"tile": self.tile, "trans_b": _BOOL[self.trans_b], "align_a": _BOOL[align_a],
                "align_b": _BOOL[align_b]}

    def _launch_for(self, key: tuple) -> PreparedLaunch:
        """The launch of the kernel for one alignment pair on the current device, compiled (or read from the compile
        cache) at its first use."""
        with self._launches_lock:
            launch = self._launches.get(key)
            if launch is None:
                kernel = GEMM_3XTF32.kernel(tile=self.tile, trans_b=_BOOL[self.trans_b], align_a=_BOOL[key[0]],
                                            align_b=_BOOL[key[1]])
                launch = self._launches[key] = PreparedLaunch(
                    self.params, [Step(kernel, self.grid, self.block, self.smem)], args=("c", "a", "b"),
                    pointers={"c": "c", "a": "a", "b": "b"})
        return launch

    def launch_on(self, stream_ptr: int, c_ptr: int, a_ptr: int, b_ptr: int) -> None:
        """cuLaunchKernel on a raw stream handle, on the device this GEMM runs on (which must be current): the kernel
        for these operands' alignment, its three pointers written into its launch's struct (runtime.launch)."""
        key = self._aligned(a_ptr, b_ptr)
        launch = self._launches.get(key) or self._launch_for(key)
        launch.launch_on(stream_ptr, c_ptr, a_ptr, b_ptr)

    def bind(self, stream_ptr: int):
        """``fn(c_ptr, a_ptr, b_ptr)`` enqueuing this GEMM on ``stream_ptr``. Unlike cuBLASLt's bound call it holds
        no workspace, so it is valid under stream capture too (never None)."""
        return functools.partial(self.launch_on, stream_ptr)

    def __call__(self, c_ptr: int, a_ptr: int, b_ptr: int, stream_ptr: int | None = None,
                 work: tuple[int, int] | None = None) -> None:
        """Enqueue on ``stream_ptr`` (a raw stream handle), or on CuPy's current stream when None."""
        if stream_ptr is None:
            import cupy
            stream_ptr = cupy.cuda.get_current_stream().ptr
        self.launch_on(stream_ptr, c_ptr, a_ptr, b_ptr)


def strided_gemm(kind: str | None, *, allow_tf32: bool = False, **problem):
    """The GEMM of one problem (blas.StridedGemm's keywords) of the kind the plan chose (:func:`fp32_gemm`'s):
    :class:`Gemm3xTF32` for ``"3xtf32"``, else cuBLAS's :class:`~cupy_attn.runtime.blas.StridedGemm` (with
    ``allow_tf32``: the caller's flag, FAST_TF32 for float32 operands)."""
    if kind == "3xtf32":
        return Gemm3xTF32(allow_tf32=False, **problem)
    from ...runtime import blas
    return blas.StridedGemm(allow_tf32=allow_tf32, **problem)
