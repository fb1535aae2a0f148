"""One device call: GPU tests, a smoke check of every path, a tuning sweep, and the benchmark table last.

    PYTHONPATH=. python3 bench/device_check.py [--tests FILES] [--bench quick|full|none] [--sweep]

Logs go to $OUT (the device tool brings them back) or bench/out/.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
OUT = os.environ.get("OUT") or os.path.join(HERE, "out")
os.environ["CUPY_ATTN_BENCH_OUT"] = OUT


def run_tests(files: list[str]) -> None:
    log = os.path.join(OUT, "pytest.log")
    t0 = time.time()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--tb=short", *files]
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    lines = open(log).read().splitlines()
    failed = [ln for ln in lines if ln.startswith("FAILED") or ln.startswith("ERROR")]
    print(f"pytest {' '.join(files)}: rc={rc} in {time.time() - t0:.0f}s; {lines[-1] if lines else ''}")
    for ln in failed[:30]:
        print("  " + ln[:300])


def smoke() -> None:
    """One small call per path/dtype against the reference, so a broken launch shows up before the long steps."""
    import numpy as np
    import torch

    import cupy_attn
    from cupy_attn import reference
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(2, 3, 70, 64, device="cuda", dtype=dt) for _ in range(3))
        out = cupy_attn.scaled_dot_product_attention(q, k, v, backend="split")
        ref = reference.scaled_dot_product_attention(*(x.double().cpu().numpy() for x in (q, k, v)))
        err = np.abs(out.double().cpu().numpy() - ref).max()
        print(f"smoke split {dt}: max err {err:.2e}")


def sweep_workspace() -> None:
    """Seed shape fp16: time the split path for several score-buffer budgets (chunk sizes)."""
    import torch

    import cupy_attn
    from common import median_ms
    q, k, v = (torch.randn(32, 32, 512, 1024, device="cuda", dtype=torch.float16) for _ in range(3))
    for mib in (8, 16, 32, 64, 128, 256, 512, 1024, 2048):
        fn = lambda: cupy_attn.scaled_dot_product_attention(q, k, v, backend="split",  # noqa: E731
                                                            workspace_bytes=mib << 20)
        fn()
        print(f"workspace {mib:5d} MiB: {median_ms(fn, n_repeat=10):.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tests", nargs="*", default=["tests/test_sdpa.py"])
    parser.add_argument("--bench", default="quick", choices=("quick", "full", "none"))
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--skip-smoke", action="store_true")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    from common import environment
    print(environment(), flush=True)
    if not args.skip_smoke:
        smoke()
    if args.tests:
        run_tests(args.tests)
    if args.sweep:
        sweep_workspace()
    if args.bench != "none":
        import bench_sdpa
        bench_sdpa.main(["--quick"] if args.bench == "quick" else [])


if __name__ == "__main__":
    main()
