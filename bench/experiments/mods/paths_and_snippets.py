"""Two device questions about score_mod / mask_mod, one call:

1. Which path is wrong when tests/test_mods.py::test_fa3_and_split_paths_agree fails: each mod of the test through
   backend="fused" and backend="split" against the float64 math (torch on upcast inputs), at the failing shape and
   at neighbours (B=1, non-causal, L=300: one causal band).
2. What a softcap snippet's spelling costs in the FA3 mod kernel: tanhf with a division, with a multiply, and the
   built-in softcap, (2, 16/8, 4096, 128) bf16 causal forward.

    PYTHONPATH=.:tests:tests/_helpers python3 bench/experiments/mods/paths_and_snippets.py
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "_helpers"), os.path.join(ROOT, "bench")]

import torch  # noqa: E402

import cupy_attn  # noqa: E402
from test_mods import MODS, _aux, _peer  # noqa: E402
from common import rotated_ms  # noqa: E402


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def paths():
    for (B, H, L, causal) in [(2, 4, 700, True), (1, 4, 700, True), (2, 4, 700, False), (2, 4, 300, True),
                              (2, 1, 700, True)]:
        for name in MODS:
            gen = torch.Generator("cuda").manual_seed(11)
            q, k, v = (torch.randn((B, H, L, 128), generator=gen, device="cuda").bfloat16() for _ in range(3))
            aux = _aux(name, B, H, L, L, gen)
            ref = _peer(q.double(), k.double(), v.double(), MODS[name],
                        None if aux is None else {n: (a.double() if a.is_floating_point() else a)
                                                  for n, a in aux.items()}, causal)
            res = {}
            for be in ("fused", "split"):
                out = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal, score_mod=MODS[name], aux=aux,
                                                             backend=be)
                res[be] = rel(out, ref)
            print(f"{(B, H, L)} causal={causal} {name:9s} fused {res['fused']:.2e} split {res['split']:.2e}",
                  flush=True)


def softcap_speed():
    B, Hq, Hkv, L, D = 2, 16, 8, 4096, 128
    q = torch.randn((B, Hq, L, D), device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn((B, Hkv, L, D), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    snippets = {"tanhf(score / 50.f)": "return 50.f * tanhf(score / 50.f);",
                "tanhf(score * 0.02f)": "return 50.f * tanhf(score * 0.02f);",
                "identity": "return score;"}
    fns = {}
    for label, code in snippets.items():
        mod = cupy_attn.AttentionMod(score_mod=code)
        fns[label] = (lambda mod=mod: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                                             score_mod=mod))
    fns["built-in softcap=50"] = lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                 enable_gqa=True, softcap=50.0)
    fns["plain causal"] = lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with torch.no_grad():
        for fn in fns.values():
            fn()
        ms = rotated_ms(fns, rounds=5)
    flops = 4 * B * Hq * (L * (L + 1) / 2) * D
    for label, t in ms.items():
        print(f"softcap spelling {label:24s} {t:.3f} ms {flops / t / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    paths()
    softcap_speed()
