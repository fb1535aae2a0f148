"""Host cost of calls whose sizes change every step (issue 34's target: ≤ 30 µs when only L, S or B differ from a
cached call): a Hugging Face-style decode loop whose KV cache grows by one key a step (torch.cat, so new contiguous
tensors of a new shape each call), ours against torch's SDPA, then a cProfile of ours over the same loop (where the
time goes: checks, plan, launch building, tensor-map encodes, module loads, the call cache's clearing).

    PYTHONPATH=. python3 bench/experiments/host_overhead/size_changing.py [--steps 2000] [--batch 8]

Host µs per call are measured over the loop with the GPU kept busy by the calls themselves (decode calls are short,
so the host is the bound); the first 100 steps are reported apart (kernel variants loaded for the first time).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cupy_attn  # noqa: E402
from common import print_profile  # noqa: E402


def loop(attend, B: int, steps: int, S0: int = 512, Hq: int = 32, Hkv: int = 8, D: int = 128):
    """µs per call over the first 100 steps and over the rest, the cache growing by one key a step."""
    g = torch.Generator("cuda").manual_seed(0)
    k = torch.randn(B, Hkv, S0, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, Hq, 1, D, generator=g, device="cuda", dtype=torch.bfloat16)
    new = torch.randn(B, Hkv, 1, D, generator=g, device="cuda", dtype=torch.bfloat16)
    times = []
    torch.cuda.synchronize()
    for _ in range(steps):
        k, v = torch.cat([k, new], dim=2), torch.cat([v, new], dim=2)  # what DynamicCache.update does
        t = time.perf_counter()
        attend(q, k, v)
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    first, rest = times[:100], times[100:]
    return sum(first) / len(first) * 1e6, sum(rest) / max(1, len(rest)) * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    fns = {"ours": lambda q, k, v: cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True),
           "torch": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
    for name, fn in fns.items():
        first, rest = loop(fn, args.batch, args.steps)
        print(f"{name}: {first:.1f} µs/call over the first 100 steps, {rest:.1f} after", flush=True)
    state = {}

    def one_step():  # the profiled loop: the cache grows inside it
        if not state:
            state["k"] = torch.randn(args.batch, 8, 512, 128, device="cuda", dtype=torch.bfloat16)
            state["v"] = torch.randn_like(state["k"])
            state["q"] = torch.randn(args.batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        state["k"] = torch.cat([state["k"], state["k"][:, :, :1]], dim=2)
        state["v"] = torch.cat([state["v"], state["v"][:, :, :1]], dim=2)
        cupy_attn.scaled_dot_product_attention(state["q"], state["k"], state["v"], enable_gqa=True)
    print_profile(one_step, 500, sort="tottime", top=25)


if __name__ == "__main__":
    main()
