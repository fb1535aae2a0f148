"""Repeat the Hopper backward on the same inputs and compare dK and dV bit for bit (they are deterministic: no
atomics), to catch a shared-memory race between the consumers' lse/D reads and the producer's refills, which
compute-sanitizer racecheck reports (bench/notes/backward.md). dQ is left out (fp32 atomics in any order).

    PYTHONPATH=. python3 bench/experiments/backward/bwd_sm90_stress.py [repeats]
"""
import os
import sys

import torch

import cupy_attn


def main(repeats: int = 200) -> None:
    os.environ["CUPY_ATTN_BWD"] = "sm90"
    for (B, H, L, D, causal) in ((2, 8, 1000, 64, False), (2, 8, 1000, 128, True), (1, 16, 2048, 128, False)):
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
        dout = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
        out = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal)
        first = torch.autograd.grad(out, (k, v), dout, retain_graph=True)
        bad = 0
        for _ in range(repeats):
            again = torch.autograd.grad(out, (k, v), dout, retain_graph=True)
            bad += sum(int(not torch.equal(a, b)) for a, b in zip(first, again))
        print(f"({B},{H},{L},{D}) causal={causal}: {repeats} repeats, dK/dV differing from the first: {bad}",
              flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
