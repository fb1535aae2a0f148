"""The main job: benchmark the seed workloads against torch, or, without a GPU, the CPU checks that still mean something.

    python bench/main.py [--quick]

With a CUDA GPU: SDPA on the headline shape (32, 32, 512, 1024) in fp16/bf16/fp32 plus sweeps, the fused attention
benchmark, Linear → BatchNorm1d → scale → softmax on x (1024, 8192), the training step and decode; tables printed, JSON and plots in bench/out/.
Without one: says so, runs the float64 reference on a small problem (checked against torch's CPU float64 SDPA when
torch is installed) and the NVRTC compile check of every kernel variant for sm_80 and sm_90 (and sm_90a for the wgmma
kernel), compiled in parallel into the compile cache that the tests and first kernel calls then read; exits 0 when both
pass. Without CuPy: says how to install it and exits 1.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from common import environment, gpu_available, print_table, save_json  # noqa: E402

from cupy_attn.runtime.compile import NEEDS_CUPY, have_cupy  # noqa: E402


def cpu_job() -> int:
    import numpy as np

    from cupy_attn import compile as compile_cli
    from cupy_attn import reference
    print("No CUDA GPU found: the benchmarks need one and are skipped. Running the CPU reference and the NVRTC "
          "compile check instead.", flush=True)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, 128, 64)) for _ in range(3))
    t0 = time.perf_counter()
    out = reference.scaled_dot_product_attention(q, k, v, is_causal=True)
    print(f"reference SDPA (2, 4, 128, 64) causal, float64: {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
    try:
        import torch
        expected = torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(x) for x in (q, k, v)), is_causal=True).numpy()
        err = float(np.abs(out - expected).max())
        print(f"reference vs torch {torch.__version__} CPU float64: max |diff| = {err:.2e}")
        if err > 1e-10:
            return 1
    except ImportError:
        print("torch not installed: reference not cross-checked")
    t0 = time.perf_counter()
    ok = compile_cli.run(["sm_80", "sm_90", "sm_90a"])
    print(f"NVRTC compile check: {'all variants compile' if ok else 'FAILED'} ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    return 0 if ok else 1


TITLES = {"bench_sdpa": "scaled_dot_product_attention (seed shape (32, 32, 512, 1024) and sweeps)",
          "bench_flash_fwd": "Fused attention kernel (head dims ≤ 256)",
          "bench_linear_bn_softmax": "Linear → BatchNorm1d → scale → softmax, x (1024, 8192), 8192 → 8192 (forward; "
                                     "train step: forward + backward)",
          "bench_backward": "Training: forward + backward of scaled_dot_product_attention",
          "bench_flash_decode": "Decode (one query row against a long KV cache), K+V bandwidth"}


def gpu_job(quick: bool) -> int:
    env = environment()
    print(env, flush=True)
    sections = []
    for name in ("bench_sdpa", "bench_flash_fwd", "bench_linear_bn_softmax", "bench_backward", "bench_flash_decode"):
        try:
            mod = importlib.import_module(name)
        except ImportError as exc:
            print(f"{name}: not available ({exc})")
            continue
        rows = mod.benchmark(quick=quick)
        columns = getattr(mod, "COLUMNS", None) or [(k, k, ".3f" if isinstance(v, float) else "")
                                                     for k, v in rows[0].items()]
        print_table(rows, columns, title=name)
        sections.append({"name": name, "title": TITLES[name], "rows": rows, "columns": columns})
        save_json("main.json", {"env": env, "command": "python bench/main.py" + (" --quick" if quick else ""),
                                "sections": sections})  # after each section: a cut-off run keeps what it measured
        if hasattr(mod, "plot"):
            mod.plot(rows, os.path.join(os.environ.get("CUPY_ATTN_BENCH_OUT", os.path.join(HERE, "out")),
                                        f"{name}.png"))
    command = "python bench/main.py" + (" --quick" if quick else "")
    print("wrote", save_json("main.json", {"env": env, "command": command, "sections": sections}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="seed workloads only, no sweeps")
    args = parser.parse_args(argv)
    if not have_cupy():
        print(NEEDS_CUPY, file=sys.stderr)
        return 1
    return gpu_job(args.quick) if gpu_available() else cpu_job()


if __name__ == "__main__":
    sys.exit(main())
