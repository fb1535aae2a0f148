"""Same-machine A/B of two versions of cuda_src/flash_fwd.cu (wgmma family): the tree's and another file in cuda_src/.

Both are compiled side by side and timed interleaved over rounds on the issue's shapes (fp16, kernel launches only,
each version with the tree's WGMMA_TILES and launch parameters), and their outputs compared.

    git show HEAD~3:cuda_src/flash_fwd.cu > cuda_src/_ab_old.cu     # any version; do not commit it
    PYTHONPATH=. python3 bench/experiments/flash_fwd/ab_flash.py [_ab_old.cu]
"""
import dataclasses
import sys

import cupy
import numpy as np
from cupyx.profiler import benchmark

from cupy_attn.attention import checks
from cupy_attn.attention.kernels import flash_fwd as _flash

CASES = (("d128", (8, 16, 2048, 128), None), ("d128 causal", (2, 16, 8192, 128), "top_left"),
         ("d256", (8, 16, 1024, 256), None), ("d64", (4, 32, 4096, 64), None))


def main(rounds: int = 3):
    old_src = sys.argv[1] if len(sys.argv) > 1 else "_ab_old.cu"
    rng = np.random.default_rng(0)
    for name, (B, H, L, D), causal in CASES:
        q, k, v = (cupy.asarray(rng.standard_normal((B, H, L, D), dtype=np.float32)).astype(cupy.float16)
                   for _ in range(3))
        tile = _flash.WGMMA_TILES[D]
        launches, outs = {}, {}
        for label, source in (("new", "flash_fwd.cu"), ("old", old_src)):
            fam = dataclasses.replace(_flash.FLASH_FWD_SM90A, source=source)
            out = cupy.full((B, H, L, D), np.nan, dtype=cupy.float16)
            prob = checks.array_problem(q, k, v, out, scale=D ** -0.5, causal=causal)
            launch = _flash.build(prob, _flash.Choice(fam, tile, D), out, None)
            launches[label] = lambda launch=launch, out=out: launch(q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr)
            outs[label] = out
        times = {label: [] for label in launches}
        for _ in range(rounds):
            for label, fn in launches.items():
                r = benchmark(fn, n_repeat=20, n_warmup=3)
                times[label].append(float(np.median(r.gpu_times[0])) * 1e3)
        diff = float(cupy.abs(outs["new"].astype(cupy.float32) - outs["old"].astype(cupy.float32)).max())
        flops = 4.0 * B * H * L * L * D / (2 if causal else 1)
        print(name, {lb: f"{min(t):.3f}-{max(t):.3f} ms ({flops / np.median(t) / 1e9:.0f} TFLOP/s)"
                     for lb, t in times.items()}, f"max |new - old| = {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
