"""Where the fused backward's time goes: the kernel as is, without its dQ atomics, and the split backward, timed alone
(cupyx benchmark medians) at (8,16,2048,128) and (4,32,4096,64) fp16.

    PYTHONPATH=. python3 bench/experiments/backward/bwd_probe.py
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import torch  # noqa: E402

import cupy_attn  # noqa: E402
from common import median_ms  # noqa: E402
from cupy_attn.attention import checks, dispatch  # noqa: E402
from cupy_attn.attention.kernels import flash_bwd as backward  # noqa: E402  (FLASH_BWD, TILES, FlashBackward)
from cupy_attn.attention.paths import backward as paths_backward  # noqa: E402


def variant(name, edit):
    """FLASH_BWD with its source edited by ``edit`` (a new family object: its own compile cache entry)."""
    fam = dataclasses.replace(backward.FLASH_BWD, name=f"flash_bwd_{name}")
    code = backward.FLASH_BWD.code()
    object.__setattr__(fam, "code", lambda: edit(code))
    return fam


def main():
    variants = {
        "as is": backward.FLASH_BWD,
        "no dq atomics": variant("noatomic", lambda c: c.replace("atomicAdd(dst", "if (sc == 1234.5f) atomicAdd(dst")),
        "no dq phase": variant("nodq", lambda c: c.replace("for (int c0 = c_first; c0 < c_first + kWarpCols; c0 += 64)",
                                                           "for (int c0 = c_first; c0 < c_first; c0 += 64)")),
    }
    for (B, H, L, D) in ((8, 16, 2048, 128), (4, 32, 4096, 64)):
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16) for _ in range(3))
        out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, return_lse=True)
        dout = torch.randn_like(out)
        fwd = median_ms(lambda: cupy_attn.scaled_dot_product_attention(q, k, v))
        p = checks.check_sdpa(q, k, v, None, 0.0, False, None, False, "auto")
        ctx = p.ctx
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        views = [ctx.as_cupy(t) for t in (out, lse, dout, dq, dk, dv)]
        flops = 2.5 * 4.0 * B * H * L * L * D
        print(f"({B},{H},{L},{D}) fp16: forward {fwd:.3f} ms", flush=True)
        for name, fam in variants.items():
            saved, saved_tile = backward.FLASH_BWD, backward.TILES[D]
            backward.FLASH_BWD = fam
            try:
                for tile in backward.TILE_CHOICES:
                    backward.TILES[D] = tile
                    launch = backward.FlashBackward(p, D)
                    fn = lambda: paths_backward._run_fused(launch, p, *views)  # noqa: E731
                    ms = median_ms(fn, n_repeat=10)
                    print(f"  fused backward {name:14s} {tile} {ms:7.3f} ms  {flops / ms / 1e9:5.0f} TFLOP/s",
                          flush=True)
            except Exception as exc:
                print(f"  {name}: {type(exc).__name__}: {exc}", flush=True)
            finally:
                backward.FLASH_BWD = saved
                backward.TILES[D] = saved_tile
        os.environ["CUPY_ATTN_BWD"] = "split"
        ms = median_ms(lambda: paths_backward.sdpa_backward(p, dispatch.plan_backward(p), *views), n_repeat=5)
        del os.environ["CUPY_ATTN_BWD"]
        print(f"  split backward        {ms:7.3f} ms  {flops / ms / 1e9:5.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
