"""The Hopper fused backward (flash_bwd_sm90.cu, "sm90") against the mma.sync fused backward (flash_bwd.cu, "mma"; at
head dims above 128, where it does not exist, the split backward, "split") and torch's FLASH_ATTENTION backend's
backward ("fa2"), each timed alone, same process, same inputs; plus the forward of each side, so that forward +
backward can be read off (issue 11's target: ≥ 1.0× torch FA2 for forward + backward).

    PYTHONPATH=. python3 bench/experiments/backward/bwd_sm90.py            # the four shapes, fp16
    PYTHONPATH=. python3 bench/experiments/backward/bwd_sm90.py --bf16     # and bf16
    PYTHONPATH=. python3 bench/experiments/backward/bwd_sm90.py --quick    # fewer repeats
    PYTHONPATH=. python3 bench/experiments/backward/bwd_sm90.py --head-dim 256 --bf16   # issue 11's (8,16,1024,256) row only

Ours: backward.sdpa_backward on the forward's out and lse (D pre-pass, dQ accumulator memset, kernel, dQ rounding:
everything torch's backward also does), CUPY_ATTN_BWD=sm90, mma or split. torch: torch.autograd.grad of one
recorded forward (retain_graph) under sdpa_kernel(SDPBackend.FLASH_ATTENTION). Medians of CUDA-event timings
(cupyx.profiler.benchmark); backward FLOPs = 2.5 × the forward's 4·B·H·L·S·D (halved for causal), FlashAttention's
convention. Per case also max |sm90 − mma| (or − split) of dq, dk, dv and NaN counts. The first sm90 launch of each
case is waited for at most 60 s: a wrong mbarrier phase or byte count hangs the kernel, and the script then exits
(status 3).
"""
import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import cupy  # noqa: E402

from common import median_ms, wait_or_die  # noqa: E402

CASES = (((8, 16, 2048, 128), False), ((4, 32, 4096, 64), False), ((2, 16, 8192, 128), True),
         ((8, 16, 1024, 256), False))




def run_case(shape, causal, dtype_name, n_repeat):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cupy_attn
    from cupy_attn.attention import checks, dispatch
    from cupy_attn.attention.paths import backward

    B, H, L, D = shape
    tdt = getattr(torch, dtype_name)
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v, dout = (torch.randn((B, H, L, D), generator=g, device="cuda", dtype=torch.float32).to(tdt)
                     for _ in range(4))
    fwd_flops = 4.0 * B * H * L * L * D / (2 if causal else 1)

    out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True)
    p = checks.check_sdpa(q, k, v, None, 0.0, causal, None, False, "auto")
    base = "mma" if D <= 128 else "split"  # the mma.sync kernel serves head dims up to 128
    grads = {}
    ms = {}
    for mode in ("sm90", base):
        os.environ[dispatch.ENV_BWD] = mode
        plan = dispatch.plan_backward(p)
        if plan.kernel != mode:
            raise RuntimeError(f"CUPY_ATTN_BWD={mode} planned {plan}")
        gq, gk, gv = (torch.full_like(x, float("nan")) for x in (q, k, v))
        views = [p.ctx.as_cupy(t) for t in (out, lse, dout, gq, gk, gv)]
        run = lambda: backward.sdpa_backward(p, plan, *views)  # noqa: E731
        run()
        wait_or_die(f"first {mode} backward {dtype_name} {shape} causal={causal}")
        grads[mode] = (gq, gk, gv)
        ms[mode] = median_ms(run, n_repeat)
    del os.environ[dispatch.ENV_BWD]
    ms["ours fwd"] = median_ms(lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal), n_repeat)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
        tout = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        ms["fa2"] = median_ms(lambda: torch.autograd.grad(tout, (qs, ks, vs), dout, retain_graph=True), n_repeat)
        ms["fa2 fwd"] = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                  n_repeat)

    diff = [float((a.float() - b.float()).abs().max()) for a, b in zip(grads["sm90"], grads[base])]
    nan = sum(int(torch.isnan(x).sum()) for x in grads["sm90"] + grads[base])
    tf = {m: 2.5 * fwd_flops / ms[m] / 1e9 for m in ("sm90", base, "fa2")}
    total_ours, total_fa2 = ms["ours fwd"] + ms["sm90"], ms["fa2 fwd"] + ms["fa2"]
    print(f"{dtype_name:9s} {str(shape):20s} causal={str(causal):5s} bwd: "
          + "  ".join(f"{m} {ms[m]:.3f} ms {tf[m]:4.0f} TF/s" for m in ("sm90", base, "fa2"))
          + f"  sm90/{base} {ms[base] / ms['sm90']:.2f}x  sm90/fa2 {ms['fa2'] / ms['sm90']:.2f}x"
          + f" | fwd ours {ms['ours fwd']:.3f} fa2 {ms['fa2 fwd']:.3f} ms | fwd+bwd ours(sm90) {total_ours:.3f} "
          + f"fa2 {total_fa2:.3f} ms ({total_fa2 / total_ours:.2f}x)"
          + f" | max|sm90-{base}| dq {diff[0]:.2e} dk {diff[1]:.2e} dv {diff[2]:.2e}  NaN {nan}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--head-dim", type=int, default=None, help="only the shapes of this head dim (e.g. 256)")
    args = ap.parse_args()
    print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), flush=True)
    for dtype_name in ("float16", "bfloat16") if args.bf16 else ("float16",):
        for shape, causal in CASES:
            if args.head_dim is not None and shape[3] != args.head_dim:
                continue
            try:
                run_case(shape, causal, dtype_name, 5 if args.quick else 20)
            except Exception:  # one failing case must not hide the others
                print(f"{dtype_name} {shape} causal={causal}: FAILED", flush=True)
                traceback.print_exc()


if __name__ == "__main__":
    main()
