"""Where the causal seed's time goes on the split path (fp16 (32,32,512,512,1024), same process, alternating rounds):
the persistent scores kernel alone, causal (with its pair tiles; without them, one tile per row block; and as the
public call launches it, P's zeros that the first P·V band does not read left unwritten) and not; P·V by cuBLAS
(torch.matmul) over all keys, and in row bands that each stop at their last visible key (2 or 4 equal bands: band r
of n is rows r·L/n ... (r+1)·L/n − 1 against keys up to (r+1)·S/n, the work (n + 1)/(2n) of the full product; and
some uneven cuts); the public calls.

    PYTHONPATH=. python3 bench/experiments/split/causal_seed_parts.py

(Commit 2efed26 added causal width classes to the scores kernel and this script's A/B of them; reverted.)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import cupy  # noqa: E402

from common import interleaved_ms  # noqa: E402


def main():
    import torch

    import cupy_attn
    from cupy_attn.attention import checks
    from cupy_attn.attention.kernels import scores_sm90
    B, H, L, D = 32, 32, 512, 1024
    dt = torch.float16
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dt) for _ in range(3))
    cq, ck = cupy.from_dlpack(q), cupy.from_dlpack(k)
    p = torch.empty(B, H, L, L, device="cuda", dtype=dt)
    lse = cupy.empty((B, H, L), cupy.float32)
    scale = D ** -0.5
    def prepare(causal, p_read=None):
        prob = checks.array_problem(cq, ck, ck, None, lse, scale=scale, causal=causal)
        return scores_sm90.build(prob, scores_sm90.choose(prob, 3), lse, ld=L, p_read=p_read)
    launches = {c: prepare(c) for c in (None, "top_left")}

    # The launch the public call makes: P's zeros past the first P·V band's keys (rows < L/2) left unwritten.
    launches["top_left, band reads"] = prepare("top_left", p_read=(L // 2, L // 2))
    # The causal launch without its pair tiles (scores_sm90.causal_pairs): one tile per row block, as before them.
    base = launches["top_left"]
    unpaired = base.params.copy()
    unpaired["pair_count"] = 0
    launches["top_left, no pairs"] = scores_sm90.build_launch(base.kernel, unpaired, base.info["maps"][:3], base.grid,
                                                              base.info["tile"], base.info["variant"])

    def scores(c):
        return lambda: launches[c](cq.data.ptr, ck.data.ptr, p.data_ptr(), lse.data.ptr)

    scores("top_left")()
    torch.cuda.synchronize()

    def bands(n):
        def run():
            for r in range(n):
                r0, r1 = r * L // n, (r + 1) * L // n
                torch.matmul(p[..., r0:r1, :r1], v[..., :r1, :])
        return run

    def uneven(cuts):
        def run():
            for r0, r1 in zip(cuts[:-1], cuts[1:]):
                torch.matmul(p[..., r0:r1, :r1], v[..., :r1, :])
        return run

    fns = {"scores kernel": scores(None), "scores kernel, causal": scores("top_left"),
           "scores kernel, causal, no pairs": scores("top_left, no pairs"),
           "scores kernel, causal, band reads": scores("top_left, band reads"),
           "P·V, all keys": lambda: torch.matmul(p, v), "P·V, 2 bands": bands(2), "P·V, 4 bands": bands(4),
           "P·V, bands 256/128/128": uneven([0, 256, 384, 512]),
           "P·V, bands 192/128/96/96": uneven([0, 192, 320, 416, 512]),
           "P·V, bands 320/192": uneven([0, 320, 512]), "P·V, bands 256/192/64": uneven([0, 256, 448, 512]),
           "public call": lambda: cupy_attn.scaled_dot_product_attention(q, k, v),
           "public call, causal": lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True)}
    ms = dict(zip(fns, interleaved_ms(list(fns.values()), rounds=5)))
    print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
    for name, t in ms.items():
        print(f"  {name:36s} {t:7.3f} ms")
    print(f"  causal / non-causal: scores kernel {ms['scores kernel, causal'] / ms['scores kernel']:.3f}, "
          f"public call {ms['public call, causal'] / ms['public call']:.3f}")


if __name__ == "__main__":
    main()
