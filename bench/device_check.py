"""One device call: GPU tests, a smoke check of every path, a tuning sweep, and the benchmark table last.

    PYTHONPATH=. python3 bench/device_check.py [--tests FILES] [--shard K/N] [--bench quick|full|none] [--sweep]

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


def shard_ids(files: list[str], shard: str) -> list[str]:
    """The GPU tests of ``files`` in shard ``K/N`` (1-based): every N-th collected test from the K-th on, so that the
    whole suite (over 3,000 tests, ~10 minutes on an H200) runs in N device calls of one suite's mix each."""
    k, n = (int(x) for x in shard.split("/"))
    if not 1 <= k <= n:
        raise ValueError(f"--shard {shard}: K/N with 1 <= K <= N")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "--collect-only", "-p",
                          "no:cacheprovider", *files], cwd=ROOT, capture_output=True, text=True).stdout
    ids = [ln for ln in out.splitlines() if "::" in ln and not ln.startswith(" ")]
    return ids[k - 1::n]


def run_tests(files: list[str], shard: str | None = None) -> None:
    log = os.path.join(OUT, "pytest.log" if shard is None else f"pytest_{shard.replace('/', 'of')}.log")
    t0 = time.time()
    selected = files if shard is None else shard_ids(files, shard)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--tb=short", *selected]
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    lines = open(log).read().splitlines()
    failed = [ln for ln in lines if ln.startswith("FAILED") or ln.startswith("ERROR")]
    what = " ".join(files) + ("" if shard is None else f" (shard {shard}: {len(selected)} tests)")
    print(f"pytest {what}: rc={rc} in {time.time() - t0:.0f}s; {lines[-1] if lines else ''}")
    for ln in failed[:30]:
        print("  " + ln[:300])


def run_script(path: str) -> None:
    """Run one bench script in its own process; its whole output goes to $OUT/<name>.log and is echoed here."""
    log = os.path.join(OUT, os.path.basename(path).replace(".py", ".log"))
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, path], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"})
    print(f"--- {path}: rc={rc} in {time.time() - t0:.0f}s", flush=True)
    print(open(log).read()[-6000:], flush=True)


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
    for mib in (64, 128, 256, 512, 1024, 2048):
        fn = lambda: cupy_attn.scaled_dot_product_attention(q, k, v, backend="split",  # noqa: E731
                                                            workspace_bytes=mib << 20)
        fn()
        print(f"workspace {mib:5d} MiB: {median_ms(fn, n_repeat=20):.3f} ms", flush=True)


def profile_split() -> None:
    """Seed shape fp16: the split path's three steps timed alone, against a GEMM-only floor."""
    import cupy
    import numpy as np
    import torch

    from common import median_ms
    from cupy_attn.attention import checks as _checks, split as _split
    from cupy_attn.runtime import blas as _cublas
    from cupy_attn.runtime.launch import launch_struct
    q, k, v = (torch.randn(32, 32, 512, 1024, device="cuda", dtype=torch.float16) for _ in range(3))
    p = _checks.check_sdpa(q, k, v, None, 0.0, False, None, False, "split")
    n, L, S, E = 1024, 512, 512, 1024
    scores = cupy.empty((n, L, S), dtype=cupy.float32)
    p16 = cupy.empty((n, L, S), dtype=cupy.float16)
    out = cupy.empty((n, L, E), dtype=cupy.float16)
    qc, kc, vc = (p.query.reshape(n, L, E), p.key.reshape(n, S, E), p.value.reshape(n, S, E))

    def g1(c, ct):
        _cublas.gemm_strided_batched(c_ptr=c.data.ptr, c_dtype=ct, ldc=S, stride_c=L * S, a_ptr=qc.data.ptr,
                                     a_dtype=qc.dtype, lda=E, stride_a=L * E, trans_a=False, b_ptr=kc.data.ptr,
                                     b_dtype=kc.dtype, ldb=E, stride_b=S * E, trans_b=True, m=L, n=S, k=E, batch=n)

    def g2(pp, pitch):
        _cublas.gemm_strided_batched(c_ptr=out.data.ptr, c_dtype=out.dtype, ldc=E, stride_c=L * E,
                                     a_ptr=pp.data.ptr, a_dtype=out.dtype, lda=pitch, stride_a=L * pitch,
                                     trans_a=False, b_ptr=vc.data.ptr, b_dtype=vc.dtype, ldb=E, stride_b=S * E,
                                     trans_b=False, m=L, n=E, k=S, batch=n)
    flops = 2.0 * n * L * S * E
    prm = _softmax_params(scores, n * L, L, S)
    with p.ctx.activate():
        for name, fn in (("gemm1 fp32 out", lambda: g1(scores, np.float32)),
                         ("gemm1 fp16 out", lambda: g1(p16, np.float16)),
                         ("gemm2 P fp16 pitch S", lambda: g2(p16, S)),
                         ("gemm2 P in place (pitch 2S)", lambda: g2(scores, 2 * S)),
                         ("softmax kernel", lambda: launch_struct(
                             _split.SOFTMAX.kernel(out_t="__half", tile=_split.softmax_tile(S, masked=False),
                                                   masked="false", dropout="false"),
                             (n * L // 4,), (128,), prm, p.ctx.stream.ptr))):
            fn()
            t = median_ms(fn, n_repeat=10)
            print(f"  {name:30s} {t:.3f} ms  {flops / t / 1e9:.0f} TFLOP/s  {n * L * S * 6 / t / 1e6:.0f} GB/s (6 B/score)")


def _softmax_params(scores, rows, L, S):
    import numpy as np

    from cupy_attn.attention import split as _split
    prm = np.zeros((), dtype=_split._PARAMS)
    prm["scores"], prm["rows"], prm["rows_per_batch"], prm["seqlen_k"], prm["ld"] = scores.data.ptr, rows, L, S, S
    prm["causal_offset"], prm["n1"], prm["n2"] = S, 1, 1
    return prm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tests", nargs="*", default=["tests/test_sdpa.py"])
    parser.add_argument("--shard", default=None, metavar="K/N",
                        help="run only the K-th of N interleaved shares of the collected GPU tests (--tests tests/ "
                             "--shard 1/3, then 2/3, 3/3 in later calls: the whole suite outlasts one call)")
    parser.add_argument("--bench", default="quick", choices=("quick", "full", "none"))
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--skip-smoke", action="store_true")
    parser.add_argument("--scripts", nargs="*", default=[],
                        help="bench scripts run in their own process before the table (e.g. bench/host_time.py)")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    from common import environment
    print(environment(), flush=True)
    if not args.skip_smoke:
        smoke()
    if args.tests:
        run_tests(args.tests, args.shard)
    if args.sweep:
        sweep_workspace()
    if args.profile:
        profile_split()
    for script in args.scripts:
        run_script(script)
    if args.bench != "none":
        import bench_sdpa
        bench_sdpa.main(["--quick"] if args.bench == "quick" else [])


if __name__ == "__main__":
    main()
