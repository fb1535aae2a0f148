"""Issue 14 A/B: the split path with and without the Hopper scores kernel (scores_softmax_sm90: Q·Kᵀ with the softmax
in its epilogue, then cuBLAS P·V), same process, interleaved rounds; and the kernel alone.

Rows per (shape, dtype): whole call ms (median from an idle GPU, bench/common.median_ms) and device ms
(common.device_ms) for CUPY_ATTN_SPLIT_FUSED=0 and =1, each round both; the kernel alone (ms, TFLOP/s counting
2·B·H·L·S·D); max |out − ref| of both against torch's fp32 attention on the same inputs (TF32 off). A hang
(mbarrier/TMA) ends the run after 60 s (common.wait_or_die).

    PYTHONPATH=. timeout 600 python3 bench/experiments/scores_sm90.py            # seed (32, 32, 512, 1024), fp16 + bf16
    PYTHONPATH=. timeout 600 python3 bench/experiments/scores_sm90.py --quick    # one round, fp16 only
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy  # noqa: E402
import torch  # noqa: E402

import cupy_attn  # noqa: E402
from cupy_attn.attention import scores_sm90  # noqa: E402
from common import device_ms, median_ms, tflops, wait_or_die  # noqa: E402

SHAPES = ((32, 32, 512, 512, 1024), (16, 32, 512, 300, 1024), (8, 16, 1024, 512, 512))


def _reference(q, k, v):
    torch.backends.cuda.matmul.allow_tf32 = False
    s = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s, dim=-1) @ v.float()


def run_shape(shape, dt, rounds):
    B, H, L, S, D = shape
    q = torch.randn(B, H, L, D, device="cuda", dtype=dt)
    k = torch.randn(B, H, S, D, device="cuda", dtype=dt)
    v = torch.randn(B, H, S, D, device="cuda", dtype=dt)
    call = lambda: cupy_attn.scaled_dot_product_attention(q, k, v)  # noqa: E731
    ref = _reference(q, k, v)
    errs, whole, dev = {}, {"0": [], "1": []}, {"0": [], "1": []}
    for mode in ("0", "1"):
        os.environ[scores_sm90.ENV_SPLIT_FUSED] = mode
        plan = cupy_attn.explain(q, k, v)
        print(f"  CUPY_ATTN_SPLIT_FUSED={mode}: {plan.details.get('schedule')}", flush=True)
        out = call()
        wait_or_die(f"split path, CUPY_ATTN_SPLIT_FUSED={mode}")
        errs[mode] = float((out.float() - ref).abs().max())
    del ref
    for _ in range(rounds):
        for mode in ("0", "1"):
            os.environ[scores_sm90.ENV_SPLIT_FUSED] = mode
            whole[mode].append(median_ms(call))
            dev[mode].append(device_ms(call))
    os.environ.pop(scores_sm90.ENV_SPLIT_FUSED)

    # The kernel alone, P into a buffer of the split path's layout.
    cq, ck = cupy.from_dlpack(q), cupy.from_dlpack(k)
    ld = -(-S // 8) * 8
    P = cupy.empty((B, H, L, ld), dtype=cq.dtype)
    lse = cupy.empty((B, H, L), dtype=cupy.float32)
    launch = scores_sm90.prepare(cq, ck, lse, scale=D ** -0.5, ld=ld)
    kernel = lambda: launch(cq.data.ptr, ck.data.ptr, P.data.ptr, lse.data.ptr)  # noqa: E731
    kernel()
    wait_or_die("scores kernel alone")
    k_ms = median_ms(kernel)

    fl = 4.0 * B * H * L * S * D
    name = f"{shape} {str(dt)[6:]}"
    for mode, label in (("0", "cuBLAS + softmax pass"), ("1", "scores kernel + P·V")):
        w, d = min(whole[mode]), min(dev[mode])
        print(f"{name} {label}: whole {w:.3f} ms ({tflops(fl, w):.0f} TFLOP/s), device {d:.3f} ms, rounds "
              f"{[round(x, 3) for x in whole[mode]]}, max err {errs[mode]:.2e}", flush=True)
    print(f"{name} kernel alone: {k_ms:.3f} ms ({tflops(fl / 2, k_ms):.0f} TFLOP/s), {launch.describe()}", flush=True)
    print(f"{name} speedup whole {min(whole['0']) / min(whole['1']):.3f}x, device {min(dev['0']) / min(dev['1']):.3f}x",
          flush=True)


def main():
    quick = "--quick" in sys.argv
    for shape in SHAPES[:1] if quick else SHAPES:
        for dt in (torch.float16,) if quick else (torch.float16, torch.bfloat16):
            run_shape(shape, dt, 1 if quick else 3)


if __name__ == "__main__":
    main()
