"""Run by test_blas.test_plan_descriptors_without_gpu in a child process: builds cublaslt.Plan descriptors with the real
libcublasLt and no GPU, and prints them as JSON.

A stub ``libcuda.so.1`` (it only reports a driver version) is loaded first so that nvmath's loader proceeds; descriptor
creation and attribute calls are host-only in cuBLASLt, so they run for real. The handle and the heuristic need a
device: the handle is 0 and the heuristic query is replaced by one that reports two candidates. Usage:
``python _cublaslt_cpu_probe.py STUB_DIR KEY_JSON...`` (each key: GemmKey's fields as a list).
"""
import ctypes
import gc
import json
import os
import subprocess
import sys


def main() -> None:
    stub_dir, keys = sys.argv[1], [json.loads(k) for k in sys.argv[2:]]
    src, so = os.path.join(stub_dir, "cuda.c"), os.path.join(stub_dir, "libcuda.so.1")
    with open(src, "w") as f:
        f.write("int cuDriverGetVersion(int *v) { *v = 12090; return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", so, src], check=True)
    ctypes.CDLL(so, mode=ctypes.RTLD_GLOBAL)

    import numpy as np
    from nvmath.bindings import cublasLt as lt
    from cupy_attn.runtime import cublaslt

    log = []

    class Binding:
        """nvmath's module, with destroy calls logged and a device-free heuristic."""

        def __getattr__(self, name):
            fn = getattr(lt, name)
            if name.endswith("_destroy"):
                return lambda obj: (log.append(name), fn(obj))
            return fn

        @staticmethod
        def matmul_algo_get_heuristic(handle, desc, la, lb, lc, ld, pref, requested, results, count):
            ws, got = np.zeros(1, np.uint64), np.zeros(1, np.uint64)
            lt.matmul_preference_get_attribute(pref, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
                                               ws.ctypes.data, ws.nbytes, got.ctypes.data)
            log.append(["heuristic", requested, int(ws[0]), lc == ld])
            r = lt.MatmulHeuristicResult.from_ptr(results, requested)
            r.state = np.zeros(requested, np.int32)
            r.workspace_size = np.full(requested, 4096, np.uint64)
            ctypes.c_int32.from_address(count).value = min(2, requested)

    cublaslt._lib = lambda: Binding()
    cublaslt._handle = lambda device_id: 0

    def get(getter, dtype_of, obj, attr):
        v, got = np.zeros(1, dtype_of(attr)), np.zeros(1, np.uint64)
        getter(obj, attr, v.ctypes.data, v.nbytes, got.ctypes.data)
        return int(v[0])

    out = []
    for fields in keys:
        log.clear()
        plan = cublaslt.Plan(cublaslt.GemmKey(*fields), candidates=8)
        built = list(log)
        D, L = lt.MatmulDescAttribute, lt.MatrixLayoutAttribute
        desc = {a.name: get(lt.matmul_desc_get_attribute, lt.get_matmul_desc_attribute_dtype, plan.desc, a)
                for a in (D.COMPUTE_TYPE, D.SCALE_TYPE, D.TRANSA, D.TRANSB)}
        layouts = {name: {a.name: get(lt.matrix_layout_get_attribute, lt.get_matrix_layout_attribute_dtype,
                                      getattr(plan, name), a)
                          for a in (L.TYPE, L.ROWS, L.COLS, L.LD, L.BATCH_COUNT, L.STRIDED_BATCH_OFFSET)}
                   for name in ("layout_a", "layout_b", "layout_c")}
        algos = [(a.ptr - plan._results.ptr, int(a.workspace_size)) for a in plan.algos]
        log.clear()
        del plan
        gc.collect()
        out.append({"desc": desc, "layouts": layouts, "algos": algos, "built": built, "destroyed": sorted(log)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
