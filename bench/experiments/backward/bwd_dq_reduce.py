"""The Hopper backward's dQ reduction, A/B in one process: red.global.add from the consumer warpgroups
(-DCUPY_ATTN_BWD_DQ_TMA=0, the reduction before session 19; at head dim 256 it now shares the TMA build's
single-staged dO) against TMA reduces issued by the dQ writer warp (the default), against torch's default SDPA
backward (cuDNN on Hopper). The prepared backward alone (pre-pass, which zeroes the dQ accumulator, kernel, dQ
rounding), 5 rotated rounds of CUDA-event medians; backward FLOPs = 2.5 × the forward's 4·B·H·L·S·D (halved for
causal). Also prints max |Δ| of dq, dk, dv between the two builds (dk, dv must match bit for bit) and against torch.

Runs against commit 725cf17's library: its kernels still read -DCUPY_ATTN_BWD_DQ_TMA, which the library kernels no
longer carry (an ablation passes its -D options to a KernelFamily variant, see bench/experiments/README.md). cupy_attn
comes from PYTHONPATH (no experiment script puts a repository root on sys.path), so, from the repository root:

    git worktree add /tmp/old 725cf17
    PYTHONPATH=/tmp/old python3 bench/experiments/backward/bwd_dq_reduce.py
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import torch  # noqa: E402

import cupy_attn  # noqa: E402
from common import rotated_ms  # noqa: E402
from cupy_attn.attention import backward, backward_sm90 as bs, checks  # noqa: E402

BASE = bs.FLASH_BWD_SM90
BUILDS = {"red.global.add": dataclasses.replace(BASE, options=("-DCUPY_ATTN_BWD_DQ_TMA=0",)), "TMA writer": BASE}
CASES = [((8, 16, 2048, 128), False, 1), ((4, 32, 4096, 64), False, 1), ((2, 16, 8192, 128), True, 1),
         ((8, 16, 1024, 256), False, 1), ((2, 16, 1000, 128), True, 4), ((3, 8, 333, 64), False, 2)]


def main():
    os.environ[backward.ENV_BWD] = "sm90"
    for (B, H, L, D), causal, groups in CASES:
        for dt in (torch.float16, torch.bfloat16):
            g = torch.Generator("cuda").manual_seed(0)
            q, dout = (torch.randn((B, H, L, D), generator=g, device="cuda").to(dt) for _ in range(2))
            k, v = (torch.randn((B, H // groups, L, D), generator=g, device="cuda").to(dt) for _ in range(2))
            out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True,
                                                              enable_gqa=groups > 1)
            p = checks.check_sdpa(q, k, v, None, 0.0, causal, None, groups > 1, "auto")
            fns, grads = {}, {}
            for name, family in BUILDS.items():
                bs.FLASH_BWD_SM90 = family  # Sm90Backward compiles from the module's family
                gq, gk, gv = (torch.full_like(x, float("nan")) for x in (q, k, v))
                prepared = bs.Sm90Backward(p, bs.head_bucket(D, D))
                ptrs = [t.data_ptr() for t in (q, k, v, out, lse, dout, gq, gk, gv)]
                prepared(*ptrs)
                grads[name] = (gq, gk, gv)
                fns[name] = (lambda pr=prepared, ptrs=ptrs: pr(*ptrs))
            bs.FLASH_BWD_SM90 = BASE
            torch.cuda.synchronize()
            diff = [(a.float() - b.float()).abs().max().item() for a, b in zip(*grads.values())]
            nan = sum(int(torch.isnan(x).sum()) for x in grads["TMA writer"])
            qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
            tout = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=groups > 1)
            fns["torch default"] = lambda: torch.autograd.grad(tout, (qs, ks, vs), dout, retain_graph=True)
            tg = fns["torch default"]()
            terr = [(a.float() - b.float()).abs().max().item() for a, b in zip(grads["TMA writer"], tg)]
            ms = rotated_ms(fns, 5)
            flops = 2.5 * 4.0 * B * H * L * L * D / (2 if causal else 1)
            print(f"({B},{H},{L},{D}) causal={causal} gqa={groups} {str(dt)[6:]}: |TMA - red| dq {diff[0]:.1e} "
                  f"dk {diff[1]:.1e} dv {diff[2]:.1e}, NaN {nan}; |TMA - torch| {terr[0]:.1e} {terr[1]:.1e} "
                  f"{terr[2]:.1e}", flush=True)
            print("    " + "  ".join(f"{n} {t:.3f} ms ({flops / t / 1e9:.0f} TFLOP/s)" for n, t in ms.items()),
                  flush=True)


if __name__ == "__main__":
    main()
