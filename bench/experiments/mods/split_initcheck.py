"""A small split-path mod call for compute-sanitizer (initcheck / memcheck): the plain call, then an identity
score_mod and a tanh cap, (1, 1, 64, 64) and (1, 2, 100, 230) hd128 bf16, with their differences printed.

    PYTHONPATH=. compute-sanitizer --tool initcheck python3 bench/experiments/mods/split_initcheck.py
"""
import torch

import cupy_attn

gen = torch.Generator("cuda").manual_seed(3)
for (B, H, L, S) in [(1, 1, 64, 64), (1, 2, 100, 230)]:
    q, k, v = (torch.randn((B, H, n, 128), generator=gen, device="cuda").bfloat16() for n in (L, S, S))
    plain = cupy_attn.scaled_dot_product_attention(q, k, v, backend="split")
    ident = cupy_attn.scaled_dot_product_attention(q, k, v, score_mod="return score;", backend="split")
    tanh = cupy_attn.scaled_dot_product_attention(q, k, v, score_mod="return 8.f * tanhf(score / 8.f);",
                                                  backend="split")
    torch.cuda.synchronize()
    s = (q.double() @ k.double().transpose(-1, -2)) * 128 ** -0.5
    ref = torch.softmax(s, -1) @ v.double()
    ref_t = torch.softmax(8 * torch.tanh(s / 8), -1) @ v.double()
    print((B, H, L, S), "plain", float((plain - ref).abs().max()), "ident", float((ident - ref).abs().max()),
          "tanh", float((tanh - ref_t).abs().max()), flush=True)
