"""Host cost of one cuBLASLt enqueue through nvmath's binding vs ctypes, measurable without a GPU.

Builds two stub libraries with gcc: ``libcuda.so.1`` (reports a driver version, so nvmath's loader proceeds) and
``libcublasLt.so.12`` whose ``cublasLtMatmul`` returns CUBLAS_STATUS_SUCCESS at once. Both are loaded by path before
nvmath looks, so cuda-pathfinder's already-loaded check hands nvmath the stub (the script prints the path it got; this
is the same mechanism that gives nvmath CuPy's libcublasLt on a GPU machine). What remains is the Python-side cost:
argument conversion, the call, the status check. Run it on a machine without a GPU (it shadows libcuda).

    PYTHONPATH=. python bench/experiments/host_overhead/binding_overhead.py
"""
from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import timeit

STUB_CUDA = r"""
int cuDriverGetVersion(int *v) { *v = 12090; return 0; }
"""
STUB_CUBLASLT = r"""
#include <stddef.h>
size_t cublasLtGetVersion(void) { return 120903; }
size_t cublasLtGetCudartVersion(void) { return 12090; }
int cublasLtMatmul(void *h, void *desc, const void *alpha, const void *a, void *la, const void *b, void *lb,
                   const void *beta, const void *c, void *lc, void *d, void *ld, const void *algo, void *ws,
                   size_t ws_size, void *stream) { return 0; }
"""

NUMBER, REPEAT = 200_000, 7
PTR = 0x7F3A_5C00_0000  # device pointers are 47-bit values: the int conversion takes the multi-digit path


def build(tmp: str) -> tuple[str, str]:
    paths = []
    for name, soname, src in (("cuda", "libcuda.so.1", STUB_CUDA), ("cublaslt", "libcublasLt.so.12", STUB_CUBLASLT)):
        c, so = os.path.join(tmp, f"{name}.c"), os.path.join(tmp, soname)
        with open(c, "w") as f:
            f.write(src)
        subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", so, c], check=True)
        paths.append(so)
    return paths[0], paths[1]


def per_call_us(fn) -> float:
    return statistics.median(timeit.repeat(fn, number=NUMBER, repeat=REPEAT)) / NUMBER * 1e6


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cuda_so, lt_so = build(tmp)
        ctypes.CDLL(cuda_so, mode=ctypes.RTLD_GLOBAL)
        lib = ctypes.CDLL(lt_so, mode=ctypes.RTLD_GLOBAL)
        from cuda import pathfinder
        from nvmath.bindings import cublasLt as lt
        print("nvmath version call", lt.get_version(),
              "library", pathfinder.load_nvidia_dynamic_lib("cublasLt").abs_path)

        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], sz
        fn = lib.cublasLtMatmul
        fn.argtypes, fn.restype = [vp] * 14 + [sz, vp], ctypes.c_int
        p = [PTR + 256 * i for i in range(16)]
        p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15 = p
        rows = {
            "get_version: nvmath": lambda: lt.get_version(),
            "get_version: ctypes": lambda: lib.cublasLtGetVersion(),
            "matmul, 16 ints: nvmath": lambda: lt.matmul(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13,
                                                       1 << 25, p15),
        }

        # The ctypes closure this replaces (cublaslt.py before nvmath): fixed arguments pre-built as c_void_p.
        handle, desc, alpha, beta, ws, size, stream = (vp(p[0]), vp(p[1]), vp(p[2]), vp(p[7]), vp(p[13]), sz(1 << 25),
                                                       vp(p[15]))
        la, lb, lc, algo_ref = vp(p[4]), vp(p[6]), vp(p[9]), ctypes.byref(ctypes.c_uint64(0))

        def ctypes_matmul(c_ptr: int, a_ptr: int, b_ptr: int) -> None:
            status = fn(handle, desc, alpha, b_ptr, la, a_ptr, lb, beta, c_ptr, lc, c_ptr, lc, algo_ref, ws, size,
                        stream)
            if status != 0:
                raise RuntimeError(status)

        # Plan.bind's closure itself, on a plan assembled by hand (no handle or heuristic without a GPU).
        from cupy_attn.runtime import cublaslt
        cublaslt._lib = lambda: lt
        cublaslt._handle = lambda device_id: p[0]
        plan = cublaslt.Plan.__new__(cublaslt.Plan)
        plan.key = cublaslt.GemmKey(0, 2, 2, 2, 68, 1, 1, 1, 1, False, False, 1, 1, 1, 0, 0, 0)
        plan.desc, plan.layout_a, plan.layout_b, plan.layout_c = p[1], p[4], p[6], p[9]
        plan._results = lt.MatmulHeuristicResult(1)
        plan._results.workspace_size = 0
        plan.algos, plan.choice = [plan._results[0]], 0
        bound = plan.bind(p[2], p[7], p[15])
        rows["matmul closure: ctypes (before)"] = lambda: ctypes_matmul(p[8], p[5], p[3])
        rows["matmul closure: Plan.bind (nvmath)"] = lambda: bound(p[8], p[5], p[3])
        rows["empty lambda (timeit floor)"] = lambda: None

        print(f"Python {sys.version.split()[0]}, median of {REPEAT} x {NUMBER} calls, µs per call:")
        for name, f in rows.items():
            print(f"  {name:38s} {per_call_us(f):6.3f}")


if __name__ == "__main__":
    main()
