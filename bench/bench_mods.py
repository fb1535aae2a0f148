"""score_mod / mask_mod snippets against the built-in variants they spell and against FlexAttention, same process.

    PYTHONPATH=. python bench/bench_mods.py [--rounds 5] [--no-backward] [--no-flex] [--quick]

Rows follow issue 36's targets (bf16, causal, (B, H, L, D) tensors): softcap 50 and a sliding window of 1024 at head
dims 128 and 256, ALiBi, a document mask over 8 packed documents, and a window at head dim 512. Each row times the
snippet (``ours``; a mask_mod with its BlockMask, made once outside the timing as FlexAttention's), the built-in variant where one exists (``builtin``: softcap=, window_size=, alibi_slopes=; a bool
attn_mask for the document mask) and FlexAttention (torch.compile'd flex_attention with its BlockMask, when torch has
it), alternating in rotated rounds on the same fresh random inputs (bench/common.rotated_ms); forward, and forward +
backward unless --no-backward. TFLOP/s count the visible (query, key) pairs: 4·B·H·visible·D (3.5× that for forward
+ backward). The last table is the cold compile time of a new mod (a fresh snippet text: NVRTC for the forward
kernel, then the backward's rows kernels).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from common import print_table, rotated_ms  # noqa: E402

SOFTCAP = ("return 50.f * tanhf(score / 50.f);", "const float t = tanhf(score / 50.f);\nreturn 1.f - t * t;")
WINDOW = "return q_idx - kv_idx <= 1024;"  # with is_causal: the built-in window_size=(1024, 0)
ALIBI = ("return score - aux.slopes[h] * fabsf(float(q_idx - kv_idx));", "return 1.f;")
DOC = "return aux.doc[b * aux.doc_shape[1] + q_idx] == aux.doc[b * aux.doc_shape[1] + kv_idx];"
# (name, B, Hq, Hkv, L, D, kind)
CASES = [
    ("softcap 50 hd128", 2, 16, 8, 4096, 128, "softcap"),
    ("softcap 50 hd256", 2, 16, 8, 4096, 256, "softcap"),
    ("window 1024 hd128", 4, 32, 8, 8192, 128, "window"),
    ("window 1024 hd256", 2, 16, 8, 8192, 256, "window"),
    ("ALiBi hd128", 2, 32, 8, 4096, 128, "alibi"),
    ("document mask (8 docs) hd128", 2, 16, 8, 8192, 128, "doc"),
    ("document mask (8 docs) hd256", 2, 16, 8, 8192, 256, "doc"),
    ("window 1024 hd512", 1, 16, 8, 8192, 512, "window"),
]
COLUMNS = [("name", "case", ""), ("pass", "pass", ""), ("ms", "ms", ".3f"), ("tflops", "TFLOP/s", ".0f"),
           ("builtin_ms", "built-in ms", ".3f"), ("x_builtin", "× built-in", ".2f"), ("flex_ms", "Flex ms", ".3f"),
           ("x_flex", "× Flex", ".2f"), ("max_diff", "max |ours − built-in|", ".2e")]


def _docs(B, L, gen):
    import torch
    cuts = torch.sort(torch.randint(1, L, (B, 7), generator=gen, device="cuda"), dim=1).values
    return (torch.arange(L, device="cuda")[None, :, None] >= cuts[:, None, :]).sum(-1).to(torch.int32).contiguous()


def _visible(kind, L, doc=None) -> float:
    """Visible (query, key) pairs per (batch, head), causal (averaged over the batch for the document mask)."""
    if kind == "window":
        return sum(min(i, 1024) + 1 for i in range(L))
    if kind == "doc":
        counts = [np.bincount(row) for row in doc.cpu().numpy()]
        return float(np.mean([sum(n * (n + 1) // 2 for n in c) for c in counts]))
    return L * (L + 1) / 2


def _fns(kind, q, k, v, aux, backward, flex):
    """{"ours", "builtin", "flex"}: callables giving out (forward + backward: the gradients' call)."""
    import torch
    import cupy_attn
    gqa = q.shape[1] != k.shape[1]
    mod = {"softcap": cupy_attn.AttentionMod(score_mod=SOFTCAP[0], score_mod_grad=SOFTCAP[1]),
           "window": cupy_attn.AttentionMod(mask_mod=WINDOW),
           "alibi": cupy_attn.AttentionMod(score_mod=ALIBI[0], score_mod_grad=ALIBI[1]),
           "doc": cupy_attn.AttentionMod(mask_mod=DOC)}[kind]
    block_mask = None
    if mod.mask_mod is not None:  # made once, outside the timing (as Flex's BlockMask)
        block_mask = cupy_attn.create_block_mask(mod, q.shape[0] if kind == "doc" else None, None, q.shape[2],
                                                 k.shape[2], aux=aux, like=q, backward=backward)
    fns = {"ours": lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa,
                                                                   score_mod=mod, aux=aux, block_mask=block_mask)}
    builtin = {"softcap": dict(softcap=50.0), "window": dict(window_size=(1024, 0)),
               "alibi": dict(alibi_slopes=aux and aux.get("slopes"))}.get(kind)
    if builtin is not None:
        fns["builtin"] = lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa,
                                                                        **builtin)
    elif kind == "doc":
        doc = aux["doc"]
        mask = (doc[:, None, :, None] == doc[:, None, None, :]) & torch.ones(
            q.shape[2], q.shape[2], dtype=torch.bool, device="cuda").tril()
        fns["builtin"] = lambda: cupy_attn.scaled_dot_product_attention(q, k, v, mask, enable_gqa=gqa)
    if flex is not None:
        fns["flex"] = flex(kind, q, k, v, aux, gqa)
    if backward:
        dout = torch.randn_like(q[..., :v.shape[-1]])
        fwd = dict(fns)
        for name, fn in fwd.items():
            fns[name] = (lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), dout))
    return fns


def _flex_factory():
    """FlexAttention's compiled flex_attention with a BlockMask per case (None when this torch has none)."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    # One compiled flex_attention serves every case (shapes, head dims, mods): past dynamo's default recompile limit
    # (8) it fell back to eager flex_attention, tens of ms a call (seen on the H200, session 23's full run).
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 256)
    compiled = torch.compile(flex_attention)

    def make(kind, q, k, v, aux, gqa):
        B, H, L = q.shape[0], q.shape[1], q.shape[2]
        if kind == "doc":
            doc = aux["doc"]

            def mask_mod(b, h, qi, kv):
                return (qi >= kv) & (doc[b, qi] == doc[b, kv])
            bm = create_block_mask(mask_mod, B, None, L, L)
        elif kind == "window":
            bm = create_block_mask(lambda b, h, qi, kv: (qi >= kv) & (qi - kv <= 1024), None, None, L, L)
        else:
            bm = create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, L, L)
        score_mod = None
        if kind == "softcap":
            def score_mod(s, b, h, qi, kv):
                return 50.0 * torch.tanh(s / 50.0)
        elif kind == "alibi":
            slopes = aux["slopes"]

            def score_mod(s, b, h, qi, kv):
                return s - slopes[h] * (qi - kv).abs()
        return lambda: compiled(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa)
    return make


QUICK = ("softcap 50 hd128", "window 1024 hd128", "document mask (8 docs) hd128", "window 1024 hd512")


def run(rounds: int, backward: bool, use_flex: bool, quick: bool = False) -> list[dict]:
    import torch
    flex = _flex_factory() if use_flex else None
    rows = []
    for name, B, Hq, Hkv, L, D, kind in CASES:
        if quick and name not in QUICK:
            continue
        gen = torch.Generator("cuda").manual_seed(L + D)
        q = torch.randn((B, Hq, L, D), generator=gen, device="cuda").bfloat16()
        k = torch.randn((B, Hkv, L, D), generator=gen, device="cuda").bfloat16()
        v = torch.randn((B, Hkv, L, D), generator=gen, device="cuda").bfloat16()
        aux = {"alibi": lambda: {"slopes": torch.rand(Hq, generator=gen, device="cuda") * 0.1},
               "doc": lambda: {"doc": _docs(B, L, gen)}}.get(kind, lambda: None)()
        visible = _visible(kind, L, aux and aux.get("doc"))
        for passes in ("fwd", "fwd+bwd") if backward else ("fwd",):
            grad = passes == "fwd+bwd"
            for x in (q, k, v):
                x.requires_grad_(grad)
            try:
                fns = _fns(kind, q, k, v, aux, grad, flex if D <= 256 else None)
                with torch.no_grad() if not grad else torch.enable_grad():
                    outs = {n: fn() for n, fn in fns.items()}
                    ms = rotated_ms(fns, rounds=rounds)
            except (NotImplementedError, ValueError, RuntimeError) as exc:  # a path that cannot run this row
                print(f"{name} {passes}: {type(exc).__name__}: {exc}", flush=True)
                continue
            flops = 4.0 * B * Hq * visible * D * (3.5 if grad else 1.0)
            row = {"name": name, "pass": passes, "ms": ms["ours"], "tflops": flops / ms["ours"] / 1e9}
            if "builtin" in ms:
                a, b = outs["ours"], outs["builtin"]
                a, b = (a[0], b[0]) if grad else (a, b)
                row.update(builtin_ms=ms["builtin"], x_builtin=ms["builtin"] / ms["ours"],
                           max_diff=float((a.float() - b.float()).abs().max()))
            if "flex" in ms:
                row.update(flex_ms=ms["flex"], x_flex=ms["flex"] / ms["ours"])
            rows.append(row)
            print(row, flush=True)
    return rows


def cold_compile() -> list[dict]:
    """Seconds for a never-seen mod (its text made unique): the forward (the FA3 mod kernel on a hd128 call) and
    the backward's rows kernels, with the compile cache's directory as it is."""
    import torch
    import cupy_attn
    stamp = f"{time.time_ns()}"
    mod = cupy_attn.AttentionMod(score_mod=f"return score * 1.f; // {stamp}", score_mod_grad="return 1.f;")
    q, k, v = (torch.randn((1, 8, 1024, 128), device="cuda").bfloat16().requires_grad_(True) for _ in range(3))
    t0 = time.perf_counter()
    out = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=mod)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return [{"what": "forward (FA3 mod kernel)", "s": t1 - t0}, {"what": "forward + backward", "s": t2 - t0}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    args = ap.parse_args(argv)
    compile_rows = cold_compile()
    rows = run(args.rounds, not args.no_backward, not args.no_flex, args.quick)
    print_table(rows, COLUMNS, "score_mod / mask_mod snippets against the built-in variants and FlexAttention (bf16)")
    print_table(compile_rows, [("what", "cold compile", ""), ("s", "seconds", ".1f")], "a new mod's first call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
