"""A/B of split-path softmax kernel variants on the seed's score buffer (1024·512 rows × 512, fp32 in, fp16 P out).

Variants are text edits of cuda_src/softmax.cu compiled next to each other in one process, timed alone (median of
CUDA events), interleaved over rounds; each checks its P against the unedited kernel's on fresh random scores first.

    PYTHONPATH=. python3 bench/experiments/split/probe_softmax.py
"""
import dataclasses

import cupy
import numpy as np
from cupyx.profiler import benchmark

from cupy_attn.attention.kernels import softmax as _split  # the softmax pass: SOFTMAX, PARAMS
from cupy_attn.runtime import compile as _compile
from cupy_attn.runtime.launch import launch_struct

EX2 = """
__device__ __forceinline__ float probe_ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
template <typename T> __device__ __forceinline__ void store4_cs(T* dst, float a, float b, float c, float d) {
  Vec4<T> o; o.v[0] = from_float<T>(a); o.v[1] = from_float<T>(b); o.v[2] = from_float<T>(c); o.v[3] = from_float<T>(d);
  __stcs(reinterpret_cast<uint2*>(dst), *reinterpret_cast<uint2*>(&o));
}
"""
EXP = ("x[v][e] = exp2f(x[v][e] - m_safe);", "x[v][e] = probe_ex2(x[v][e] - m_safe);")
LDCS = ("if (active && c < S) f = *reinterpret_cast<const float4*>(srow + c);",
        "if (active && c < S) f = __ldcs(reinterpret_cast<const float4*>(srow + c));")
STCS = ("if (c < S) store4<OutT>(prow + c,", "if (c < S) store4_cs<OutT>(prow + c,")
# name -> (edits, (threads per row, float4 per thread)). Session 3, first round (before v2): baseline 0.454 ms,
# ex2.approx 0.455, + skipping the mask test on unmasked rows 0.442 (kept as v2: the kMasked = false instances),
# + __ldcs 0.456, + __stcs 0.451.
VARIANTS = {
    "v2 (32 thr x 4 vec)": ([], (32, 4)),
    "16 thr x 8 vec": ([], (16, 8)),
    "64 thr x 2 vec": ([], (64, 2)),
    "128 thr x 1 vec": ([], (128, 1)),
    "v2 + ex2.approx": ([EXP], (32, 4)),
}


def kernel(edits, tile):
    code = _split.SOFTMAX.code().replace("namespace cupy_attn {\n", "namespace cupy_attn {\n" + EX2, 1)
    for old, new in edits:
        assert old in code, old
        code = code.replace(old, new)
    expr = f"cupy_attn::masked_softmax<__half, {tile[0]}, {tile[1]}, false, false>"
    mod = cupy.RawModule(code=code, options=_compile.base_options(), name_expressions=(expr,))
    return mod.get_function(expr)


def masked_tiles(rows, L, S, scores, rounds=3):
    """kMasked = true instances (key-padding bool mask, then causal) for the tiles that cover S = 512."""
    mask = cupy.random.random((rows // L, S)) > 0.1           # one key-padding row per (batch, head)
    for kind, tiles in (("keypad", ((32, 4), (64, 2))), ("causal", ((32, 4), (64, 2)))):
        prm = np.zeros((), dtype=_split.PARAMS)
        prm["scores"], prm["rows"], prm["rows_per_batch"], prm["seqlen_k"], prm["ld"] = scores.data.ptr, rows, L, S, S
        prm["n1"], prm["n2"] = 1, 1
        if kind == "keypad":
            prm["causal_offset"], prm["mask"], prm["mask_kind"] = S, mask.data.ptr, 1
            prm["mask_stride_b0"], prm["mask_stride_q"], prm["mask_stride_k"] = S, 0, 1
        else:
            prm["causal_offset"] = 0
        fams = {t: dataclasses.replace(_split.SOFTMAX, axes=dict(_split.SOFTMAX.axes, tile=(t,)), where=None)
                for t in tiles}
        ks = {t: fams[t].kernel(out_t="__half", tile=t, masked="true", dropout="false") for t in tiles}
        times = {t: [] for t in tiles}
        for _ in range(rounds):
            for t, k in ks.items():
                r = benchmark(lambda: launch_struct(k, (rows // max(1, 128 // t[0]),), (max(128, t[0]),), prm,
                                                    cupy.cuda.get_current_stream().ptr), n_repeat=20, n_warmup=3)
                times[t].append(float(np.median(r.gpu_times[0])) * 1e3)
        for t, ts in times.items():
            print(f"masked ({kind}) {t}: {min(ts):.3f}-{max(ts):.3f} ms")


def main():
    n, L, S = 1024, 512, 512
    rows = n * L
    scores = cupy.empty((rows, S), dtype=cupy.float32)
    prm = np.zeros((), dtype=_split.PARAMS)
    prm["scores"], prm["rows"], prm["rows_per_batch"], prm["seqlen_k"], prm["ld"] = scores.data.ptr, rows, L, S, S
    prm["causal_offset"], prm["n1"], prm["n2"] = S, 1, 1
    kernels = {name: kernel(*v) for name, v in VARIANTS.items()}
    grids = {name: rows // max(1, 128 // v[1][0]) for name, v in VARIANTS.items()}
    blocks = {name: max(128, v[1][0]) for name, v in VARIANTS.items()}
    fill = lambda: scores.__setitem__(slice(None), cupy.random.standard_normal((rows, S), dtype=cupy.float32) * 8)  # noqa
    ref = None
    for name, k in kernels.items():
        cupy.random.seed(0)
        fill()
        launch_struct(k, (grids[name],), (blocks[name],), prm, cupy.cuda.get_current_stream().ptr)
        got = scores.view(cupy.float16)[:, :S].astype(cupy.float32)
        if ref is None:
            ref = got.copy()
        print(f"{name:28s} max |P - P_baseline| = {float(cupy.abs(got - ref).max()):.2e}")
    times = {name: [] for name in kernels}
    for _ in range(3):
        for name, k in kernels.items():
            fill()
            r = benchmark(lambda: launch_struct(k, (grids[name],), (blocks[name],), prm,
                                                cupy.cuda.get_current_stream().ptr), n_repeat=20, n_warmup=3)
            times[name].append(float(np.median(r.gpu_times[0])) * 1e3)
    gb = rows * S * 6 / 1e9
    for name, ts in times.items():
        print(f"{name:28s} {min(ts):.3f}-{max(ts):.3f} ms  {gb / np.median(ts) * 1e3:.0f} GB/s")
    masked_tiles(rows, L, S, scores)


if __name__ == "__main__":
    main()
