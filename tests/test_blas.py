"""runtime.blas.StridedGemm (cuBLASLt through nvmath-python, and the classic cuBLAS fallback) against cupy.matmul in
float64, and runtime.cublaslt's behaviour without a GPU.

Accuracy rule: every element of C satisfies |C − ref| ≤ tol · (|α|·|op(A)|·|op(B)| + |β|·|C₀|), the standard
rounding bound of a dot product, with tol = 2 · (output rounding + input rounding + K · 2⁻²⁴ of fp32 accumulation).
Input rounding is 0 for fp16/bf16/fp32 storage read exactly and 2⁻⁹ for TF32 (10-bit mantissa on both operands,
allowing truncation): a pedantic-fp32 problem that ran on TF32 tensor cores fails the fp32 bound.
"""
import os
import zlib

import numpy as np
import pytest

from conftest import gpu_available

EPS = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}
TF32_INPUT = 2.0 ** -9


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def test_cublaslt_imports_without_gpu():
    """The module imports anywhere; without a usable GPU it reports itself unavailable and StridedGemm's callers take
    the classic path (nothing is loaded, nothing raises)."""
    from cupy_attn.runtime import cublaslt
    if gpu_available():
        pytest.skip("a GPU is present: test_cublaslt_loads_cupys_major covers this machine")
    assert cublaslt.available() is False
    assert cublaslt.version() is None
    assert cublaslt.library_path() is None


@pytest.mark.parametrize("nvmath_installed", [False, True])
def test_cublaslt_falls_back_without_gpu(monkeypatch, nvmath_installed):
    """With CuPy's cuBLAS reported present: no nvmath → unavailable, silently; nvmath that cannot load libcublasLt
    (here: no driver) → unavailable with a RuntimeWarning naming the cause. Either way nothing raises."""
    import sys
    import warnings
    from cupy.cuda import cublas, device
    from cupy_attn.runtime import cublaslt
    if gpu_available():
        pytest.skip("a GPU is present: test_cublaslt_loads_cupys_major covers this machine")
    if nvmath_installed:
        pytest.importorskip("nvmath.bindings.cublasLt")
    else:
        class Uninstalled:  # what an environment without nvmath-python raises
            @staticmethod
            def find_spec(name, path=None, target=None):
                if name == "nvmath":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        for name in [n for n in sys.modules if n == "nvmath" or n.startswith("nvmath.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setattr(sys, "meta_path", [Uninstalled()] + sys.meta_path)
    monkeypatch.setattr(device, "get_cublas_handle", lambda: 1)
    monkeypatch.setattr(cublas, "getVersion", lambda handle: 120903)
    cublaslt._lib.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cublaslt.available() is False
    finally:
        cublaslt._lib.cache_clear()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if nvmath_installed:
        assert any("cannot load libcublasLt" in m for m in messages), messages
    else:
        assert messages == []


@pytest.mark.gpu
def test_cublaslt_loads_cupys_major():
    """nvmath's binding is in use, on a libcublasLt of CuPy's cuBLAS major, and that library is the mapped one."""
    from cupy.cuda import cublas, device
    from cupy_attn.runtime import cublaslt
    assert cublaslt.available(), "nvmath.bindings.cublasLt did not load (is nvmath-python installed?)"
    assert cublaslt.version() // 10000 == cublas.getVersion(device.get_cublas_handle()) // 10000
    with open("/proc/self/maps") as maps:
        mapped = {os.path.realpath(line.split()[-1]) for line in maps if "libcublasLt.so" in line}
    path = os.path.realpath(cublaslt.library_path())
    assert path in mapped, f"nvmath's library {path} is not mapped; mapped: {sorted(mapped)}"


def _host(rng, shape, dtype: str) -> np.ndarray:
    return rng.standard_normal(shape).astype(_np_dtype(dtype))


def _device(x: np.ndarray):
    """The array's bytes on the device (bf16 travels as its uint16 bits: the GEMM needs only the pointer)."""
    import cupy
    return cupy.asarray(x.view(np.uint16) if x.dtype.itemsize == 2 else x)


CASES = [
    # (m, n, k, batch, broadcast): broadcast names the operand with batch stride 0
    (1, 1, 1, 1, None),
    (113, 203, 37, 1, None),
    (239, 1, 80, 1, None),
    (64, 96, 256, 3, None),
    (37, 50, 64, 4, "b"),     # a Linear weight shared by the batch
    (80, 33, 40, 3, "a"),
    (1024, 1024, 1023, 1, None),  # ≥ TUNE_MIN_FLOPS with beta = 0: the first call times the candidates
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cublaslt", "classic"])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("m,n,k,batch,broadcast", CASES)
@pytest.mark.parametrize("dtype,c_dtype,tf32", [("float16", "float16", False), ("float16", "float32", False),
                                                ("bfloat16", "bfloat16", False), ("bfloat16", "float32", False),
                                                ("float32", "float32", False), ("float32", "float32", True)])
def test_strided_gemm(monkeypatch, backend, trans_a, trans_b, m, n, k, batch, broadcast, dtype, c_dtype, tf32):
    import cupy
    from cupy_attn.runtime import blas, cublaslt
    if backend == "cublaslt" and not cublaslt.available():
        pytest.fail("cuBLASLt unavailable on a GPU machine (nvmath-python missing or on another CUDA major)")
    monkeypatch.setattr(blas, "USE_CUBLASLT", backend == "cublaslt")
    if (m, n, k) == (1024, 1024, 1023) and (trans_a, trans_b) != (False, True):
        pytest.skip("the tuned size runs once per dtype")
    rng = np.random.default_rng(zlib.crc32(repr((m, n, k, batch, trans_a, trans_b, dtype, c_dtype)).encode()))
    # Row-major storage with padded rows (ld > columns) and padded batch strides, so that ld and strides matter.
    a_rows, a_cols = (k, m) if trans_a else (m, k)
    b_rows, b_cols = (n, k) if trans_b else (k, n)
    lda, ldb, ldc = a_cols + 3, b_cols + 5, n + 2
    nb_a = 1 if broadcast == "a" else batch
    nb_b = 1 if broadcast == "b" else batch
    a = _host(rng, (nb_a, a_rows, lda), dtype)
    b = _host(rng, (nb_b, b_rows, ldb), dtype)
    alpha, beta = 0.75, (0.0 if k % 2 else 0.5)  # beta ≠ 0 reads C: checked on the even-K cases
    c0 = _host(rng, (batch, m, ldc), c_dtype) if beta else np.full((batch, m, ldc), np.nan, _np_dtype(c_dtype))

    a64 = a.astype(np.float64)[:, :, :a_cols]
    b64 = b.astype(np.float64)[:, :, :b_cols]
    op_a = a64.transpose(0, 2, 1) if trans_a else a64
    op_b = b64.transpose(0, 2, 1) if trans_b else b64
    c64 = np.nan_to_num(c0.astype(np.float64))[:, :, :n]
    ref = cupy.asnumpy(alpha * cupy.matmul(cupy.asarray(op_a), cupy.asarray(op_b)) + beta * cupy.asarray(c64))
    scale = cupy.asnumpy(abs(alpha) * cupy.matmul(cupy.abs(cupy.asarray(op_a)), cupy.abs(cupy.asarray(op_b)))
                         + abs(beta) * cupy.abs(cupy.asarray(c64)))
    tol = 2 * (EPS[c_dtype] + (TF32_INPUT if tf32 else 0.0) + k * EPS["float32"])

    gemm = blas.StridedGemm(c_dtype=_np_dtype(c_dtype), ldc=ldc, stride_c=m * ldc,
                            a_dtype=_np_dtype(dtype), lda=lda, stride_a=0 if broadcast == "a" else a_rows * lda,
                            trans_a=trans_a,
                            b_dtype=_np_dtype(dtype), ldb=ldb, stride_b=0 if broadcast == "b" else b_rows * ldb,
                            trans_b=trans_b, m=m, n=n, k=k, batch=batch, alpha=alpha, beta=beta, allow_tf32=tf32)
    da, db = _device(a), _device(b)
    stream = cupy.cuda.get_current_stream()
    calls = ["first call (plans, maybe tunes)", "second call (cached plan)"]
    for what in calls + ["bound call"]:
        dc = _device(c0)
        if what == "bound call":
            fn = gemm.bind(stream.ptr)
            if backend == "classic":
                assert fn is None
                continue
            fn(dc.data.ptr, da.data.ptr, db.data.ptr)
        else:
            gemm(dc.data.ptr, da.data.ptr, db.data.ptr)
        out = cupy.asnumpy(dc).view(_np_dtype(c_dtype)).astype(np.float64)
        assert np.isnan(out[:, :, n:]).all() or beta, "C's row padding was written"
        err = np.abs(out[:, :, :n] - ref)
        bound = tol * scale + 1e-30
        if not (err <= bound).all():  # NaN (an unwritten element) fails here too
            bad = np.argwhere(~(err <= bound))[:5].tolist()
            raise AssertionError(f"{what}: max err {np.nanmax(err):.3g} (mean {np.nanmean(err):.3g}), max err/bound "
                                 f"{np.nanmax(err / bound):.3g}; first mismatches (batch, row, col) {bad}")
    if backend == "cublaslt":
        assert gemm._lt_plan is not None
        flops = 2.0 * m * n * k * batch
        tuned = flops >= cublaslt.TUNE_MIN_FLOPS and beta == 0 and cublaslt.TUNE
        assert len(gemm._lt_plan.times) == (len(gemm._lt_plan.algos) if tuned else 0)


@pytest.mark.parametrize("trans_a,trans_b,batch", [(False, False, 1), (False, True, 3), (True, False, 2),
                                                   (True, True, 4)])
def test_plan_descriptors_without_gpu(tmp_path, trans_a, trans_b, batch):
    """Plan's descriptors, built by the real libcublasLt without a GPU (tests/_helpers/_cublaslt_cpu_probe.py: a stub driver,
    handle 0, a stand-in heuristic), read back: the row-major → column-major swap, types, batch count and strides, the
    32 MiB workspace preference; the preference is destroyed after the query and every other descriptor when the
    plan is collected."""
    import json
    import shutil
    import subprocess
    import sys
    if gpu_available():
        pytest.skip("a GPU is present: the stub driver would shadow it (test_strided_gemm covers this machine)")
    pytest.importorskip("nvmath.bindings.cublasLt")
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc for the stub driver")
    from cupy.cuda import cublas, runtime
    from cupy_attn.runtime import cublaslt
    m, n, k, lda, ldb, ldc = 48, 24, 40, 56, 72, 32
    stride_a, stride_b, stride_c = (m * lda, 0, m * ldc) if batch > 1 else (0, 0, 0)
    key = [0, runtime.CUDA_R_16BF, runtime.CUDA_R_16BF, runtime.CUDA_R_32F, cublas.CUBLAS_COMPUTE_32F, m, n, k, batch,
           trans_a, trans_b, lda, ldb, ldc, stride_a, stride_b, stride_c]
    probe = os.path.join(os.path.dirname(__file__), "_helpers", "_cublaslt_cpu_probe.py")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, probe, str(tmp_path), json.dumps(key)], capture_output=True, text=True,
                         env=env, timeout=120)
    if run.returncode != 0 and "Not" in run.stderr and "cublasLt" in run.stderr:
        pytest.skip(f"nvmath found no libcublasLt here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr
    (got,) = json.loads(run.stdout.strip().splitlines()[-1])

    batched = {"BATCH_COUNT": batch} if batch > 1 else {"BATCH_COUNT": 1}
    # Column-major Cᵀ (n × m) = op(B)ᵀ · op(A)ᵀ: cuBLASLt's A is our B, its B our A, each read as its transpose.
    assert got["desc"] == {"COMPUTE_TYPE": cublas.CUBLAS_COMPUTE_32F, "SCALE_TYPE": runtime.CUDA_R_32F,
                           "TRANSA": int(trans_b), "TRANSB": int(trans_a)}
    la, lb, lc = got["layouts"]["layout_a"], got["layouts"]["layout_b"], got["layouts"]["layout_c"]
    assert la == {"TYPE": runtime.CUDA_R_16BF, "ROWS": k if trans_b else n, "COLS": n if trans_b else k, "LD": ldb,
                  **batched, "STRIDED_BATCH_OFFSET": stride_b}
    assert lb == {"TYPE": runtime.CUDA_R_16BF, "ROWS": m if trans_a else k, "COLS": k if trans_a else m, "LD": lda,
                  **batched, "STRIDED_BATCH_OFFSET": stride_a}
    assert lc == {"TYPE": runtime.CUDA_R_32F, "ROWS": n, "COLS": m, "LD": ldc, **batched,
                  "STRIDED_BATCH_OFFSET": stride_c}
    assert got["built"] == [["heuristic", 8, cublaslt.WORKSPACE_BYTES, True], "matmul_preference_destroy"]
    assert got["algos"] == [[0, 4096], [96, 4096]]  # views into the result array, 96-byte structs, algo first
    assert got["destroyed"] == ["matmul_desc_destroy"] + ["matrix_layout_destroy"] * 3
