"""Issue 14 A/B: the split path without the Hopper scores kernel, with it (scores_softmax_sm90: Q·Kᵀ with the
softmax in its epilogue, then cuBLAS P·V), with its cluster variant (scores_softmax_sm90_cluster2: CTA pairs
sharing K by TMA multicast) and its persistent variant (scores_softmax_sm90_persistent), same process, interleaved
rounds; and the kernels alone, interleaved.

Rows per (shape, dtype): whole call ms (median from an idle GPU, bench/common.median_ms) and device ms
(common.device_ms) for CUPY_ATTN_SPLIT_FUSED=0-3, each round all of them; each kernel alone (ms, TFLOP/s
counting 2·B·H·L·S·D; best of the rounds, which alternate the two kernels); max |out − ref| against torch's fp32
attention on the same inputs (TF32 off). A hang (mbarrier/TMA) ends the run after 60 s (common.wait_or_die).

    PYTHONPATH=. timeout 600 python3 bench/experiments/split/scores_sm90.py            # three shapes, fp16 + bf16
    PYTHONPATH=. timeout 600 python3 bench/experiments/split/scores_sm90.py --quick    # seed (32,32,512,1024) fp16, 1 round
    ... --causal: is_causal (top-left) everywhere; the cluster variant (no causal) is left out
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import cupy  # noqa: E402
import torch  # noqa: E402

import cupy_attn  # noqa: E402
from cupy_attn.attention import checks  # noqa: E402
from cupy_attn.attention.kernels import scores_sm90  # noqa: E402
from common import device_ms, median_ms, tflops, wait_or_die  # noqa: E402

SHAPES = ((32, 32, 512, 512, 1024), (16, 32, 512, 300, 1024), (8, 16, 1024, 512, 512))


def _reference(q, k, v):
    torch.backends.cuda.matmul.allow_tf32 = False
    s = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if CAUSAL:
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool, device=s.device).tril().logical_not(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v.float()


def _max_active_clusters(launch) -> str:
    """cuOccupancyMaxActiveClusters for a prepared launch: how many clusters of its kernel the GPU holds at once (one
    CTA per SM; a GPC with an odd number of free SMs leaves one idle under clusters of 2), as "N clusters = 2N SMs",
    or why not."""
    try:
        from cuda.bindings import driver
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = launch.grid
        config.blockDimX, config.blockDimY, config.blockDimZ = scores_sm90.THREADS, 1, 1
        config.sharedMemBytes = launch.smem
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        cluster_m = scores_sm90.CLUSTER_M[launch.info["variant"]]
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster_m, 1, 1
        config.attrs, config.numAttrs = [attr], 1
        err, n = driver.cuOccupancyMaxActiveClusters(driver.CUfunction(int(launch.kernel.kernel.ptr)), config)
        if err != driver.CUresult.CUDA_SUCCESS:
            return f"n/a ({err})"
        return f"{n} clusters = {n * cluster_m} SMs"
    except Exception as exc:  # a probe for the notes: never stops the benchmark
        return f"n/a ({type(exc).__name__}: {exc})"


MODES = {"0": "cuBLAS + softmax pass", "1": "scores kernel + P·V", "2": "cluster scores kernel + P·V",
         "3": "persistent scores kernel + P·V"}
CAUSAL = "--causal" in sys.argv
if CAUSAL:
    MODES.pop("2")


def run_shape(shape, dt, rounds):
    B, H, L, S, D = shape
    q = torch.randn(B, H, L, D, device="cuda", dtype=dt)
    k = torch.randn(B, H, S, D, device="cuda", dtype=dt)
    v = torch.randn(B, H, S, D, device="cuda", dtype=dt)
    call = lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=CAUSAL)  # noqa: E731
    ref = _reference(q, k, v)
    errs, whole, dev = {}, {m: [] for m in MODES}, {m: [] for m in MODES}
    for mode in MODES:
        os.environ[scores_sm90.ENV_SPLIT_FUSED] = mode
        plan = cupy_attn.explain(q, k, v, is_causal=CAUSAL)
        print(f"  CUPY_ATTN_SPLIT_FUSED={mode}: {plan.details.get('schedule')}", flush=True)
        out = call()
        wait_or_die(f"split path, CUPY_ATTN_SPLIT_FUSED={mode}")
        errs[mode] = float((out.float() - ref).abs().max())
    del ref
    for _ in range(rounds):
        for mode in MODES:
            os.environ[scores_sm90.ENV_SPLIT_FUSED] = mode
            whole[mode].append(median_ms(call))
            dev[mode].append(device_ms(call))
    os.environ.pop(scores_sm90.ENV_SPLIT_FUSED)

    # The kernels alone, P into a buffer of the split path's layout; their outputs must agree bit for bit (same
    # wgmma sequence per row block, the same epilogue).
    cq, ck = cupy.from_dlpack(q), cupy.from_dlpack(k)
    ld = -(-S // 8) * 8
    launches, kernels, outs = {}, {}, {}
    for m in sorted(int(x) for x in MODES if x != "0"):
        P = cupy.empty((B, H, L, ld), dtype=cq.dtype)
        lse = cupy.empty((B, H, L), dtype=cupy.float32)
        prob = checks.array_problem(cq, ck, ck, None, lse, scale=D ** -0.5, causal="top_left" if CAUSAL else None)
        launch = scores_sm90.build(prob, scores_sm90.choose(prob, m), lse, ld=ld)
        launches[m] = launch
        kernels[m] = lambda launch=launch, P=P, lse=lse: launch(cq.data.ptr, ck.data.ptr, P.data.ptr, lse.data.ptr)
        kernels[m]()
        wait_or_die(f"{scores_sm90.KERNELS[m]} alone")
        outs[m] = (P, lse)
    same = all(bool((outs[1][i][..., :S] == outs[m][i][..., :S]).all()) for m in outs for i in (0, 1))
    k_ms = {m: [] for m in kernels}
    for _ in range(max(rounds, 3)):
        for m in kernels:
            k_ms[m].append(median_ms(kernels[m]))

    fl = 4.0 * B * H * L * S * D
    name = f"{shape} {str(dt)[6:]}"
    for mode, label in MODES.items():
        w, d = min(whole[mode]), min(dev[mode])
        print(f"{name} {label}: whole {w:.3f} ms ({tflops(fl, w):.0f} TFLOP/s), device {d:.3f} ms, rounds "
              f"{[round(x, 3) for x in whole[mode]]}, max err {errs[mode]:.2e}", flush=True)
    for m, launch in launches.items():
        t = min(k_ms[m])
        print(f"{name} kernel alone: {t:.3f} ms ({tflops(fl / 2, t):.0f} TFLOP/s), rounds "
              f"{[round(x, 3) for x in k_ms[m]]}, {scores_sm90.describe(launch)}; resident at once: "
              f"{_max_active_clusters(launch)}", flush=True)
    speeds = ", ".join(f"{scores_sm90.KERNELS[m]} {min(k_ms[1]) / min(k_ms[m]):.3f}x" for m in k_ms if m != 1)
    print(f"{name} kernels alone against the one-CTA kernel: {speeds}; outputs "
          f"{'identical' if same else 'DIFFER'}", flush=True)
    for mode in (m for m in MODES if m != "0"):
        print(f"{name} speedup over cuBLAS + softmax ({MODES[mode]}): whole {min(whole['0']) / min(whole[mode]):.3f}x, "
              f"device {min(dev['0']) / min(dev[mode]):.3f}x", flush=True)


def main():
    quick = "--quick" in sys.argv
    for shape in SHAPES[:1] if quick else SHAPES:
        for dt in (torch.float16,) if quick else (torch.float16, torch.bfloat16):
            run_shape(shape, dt, 1 if quick else 3)


if __name__ == "__main__":
    main()
