"""Device diagnostics for score_mod calls (one call): the split path's mod softmax against the plain split path on
the mods whose result is known without a reference (identity; score·2 equals scale·2), tanh_cap split-first in a
fresh process; and where a mod call's host time goes (cProfile of 50 calls, wall ms per call with and without
synchronisation), against the plain call.

    PYTHONPATH=. python3 bench/experiments/mods/split_diag.py
"""
import cProfile
import io
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path[:0] = [ROOT]

import torch  # noqa: E402

import cupy_attn  # noqa: E402


def maxdiff(a, b):
    return float((a.float() - b.float()).abs().max())


def split_checks():
    gen = torch.Generator("cuda").manual_seed(3)
    for (B, H, L, S) in [(1, 1, 64, 64), (2, 4, 700, 700), (1, 2, 100, 230)]:
        q, k, v = (torch.randn((B, H, n, 128), generator=gen, device="cuda").bfloat16() for n in (L, S, S))
        sdpa = cupy_attn.scaled_dot_product_attention
        tanh = cupy_attn.AttentionMod(score_mod="return 8.f * tanhf(score / 8.f);")
        first = sdpa(q, k, v, score_mod=tanh, backend="split")
        ref_s = (q.double() @ k.double().transpose(-1, -2)) * 128 ** -0.5
        ref = torch.softmax(8 * torch.tanh(ref_s / 8), -1) @ v.double()
        plain = sdpa(q, k, v, backend="split")
        ident = sdpa(q, k, v, score_mod="return score;", backend="split")
        double = sdpa(q, k, v, score_mod="return score * 2.f;", backend="split")
        scaled = sdpa(q, k, v, scale=2 * 128 ** -0.5, backend="split")
        print(f"{(B, H, L, S)} split: identity-plain {maxdiff(ident, plain):.2e}; score*2 - scale*2 "
              f"{maxdiff(double, scaled):.2e}; tanh first vs f64 {maxdiff(first, ref):.2e}; plain vs f64 "
              f"{maxdiff(plain, torch.softmax(ref_s, -1) @ v.double()):.2e}", flush=True)
        fused = sdpa(q, k, v, score_mod=tanh, backend="fused") if L >= 128 else None
        if fused is not None:
            print(f"    fused tanh vs f64 {maxdiff(fused, ref):.2e}; split tanh again vs f64 "
                  f"{maxdiff(sdpa(q, k, v, score_mod=tanh, backend='split'), ref):.2e}", flush=True)


def host_time():
    B, Hq, Hkv, L, D = 2, 16, 8, 4096, 128
    q = torch.randn((B, Hq, L, D), device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn((B, Hkv, L, D), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ident = cupy_attn.AttentionMod(score_mod="return score;")
    calls = {"plain": lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
             "identity mod": lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                                            score_mod=ident)}
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        t_async = (time.perf_counter() - t0) / 50 * 1e3
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for _ in range(50):
            fn()
            torch.cuda.synchronize()
        t_sync = (time.perf_counter() - t1) / 50 * 1e3
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)  # the GPU busy while 20 calls are enqueued: their device time alone
        e0.record()
        for _ in range(20):
            fn()
        e1.record()
        torch.cuda.synchronize()
        print(f"{name}: host (enqueue) {t_async:.3f} ms/call, synchronised {t_sync:.3f} ms/call, device "
              f"{e0.elapsed_time(e1) / 20:.3f} ms/call", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        calls["identity mod"]()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
    print(s.getvalue()[-6000:])


if __name__ == "__main__":
    split_checks()
    host_time()
