"""Cold first-call latency of a new kernel variant vs warm load from the compile cache, on the GPU present.

    PYTHONPATH=. python bench/experiments/compile/compile_latency.py

Points the compile cache at an empty temporary directory, then for one flash_fwd variant (fp16, head dim 128, no mask)
and, on compute capability 9.0, its sm_90a wgmma twin: the first ``timed_load`` compiles with NVRTC (cold), the next
ones read the cubin and load it (warm). Last, ``family.kernel`` twice: the first loads (per-process memo empty), the
second is the memo hit every later launch sees.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ["CUPY_ATTN_CACHE_DIR"] = tempfile.mkdtemp(prefix="cupy_attn_cache_")

import cupy  # noqa: E402

from cupy_attn.attention.kernels import flash_fwd as fused  # noqa: E402
from cupy_attn.runtime import compile as _compile  # noqa: E402
from cupy_attn.runtime import compile_check  # noqa: E402


def main() -> int:
    cc = cupy.cuda.Device().compute_capability
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()} (sm_{cc}), "
          f"NVRTC {_compile.nvrtc_version()}, cache {_compile.cache_dir()}")
    families = [fused.FLASH_FWD] + ([fused.FLASH_FWD_SM90A] if cc == "90" else [])
    for family in families:
        row = next(r for r in family.variants() if r["dtype"] == "__half" and r["head_dim"] == 128
                   and r["has_mask"] == "false")
        print(f"{family.name} {family.name_expression(**row)} for {_compile.target_arch(family)}")
        for _ in range(3):
            seconds, source = compile_check.timed_load(family, row)
            print(f"  timed_load: {1e3 * seconds:8.1f} ms  ({source})")
        for what in ("first family.kernel (load)", "second family.kernel (memo)"):
            t0 = time.perf_counter()
            family.kernel(**row)
            print(f"  {what}: {1e6 * (time.perf_counter() - t0):8.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
