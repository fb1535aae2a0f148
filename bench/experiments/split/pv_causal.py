"""Causal P·V on the split path's scores kernel: the pv_sm90 kernel (each 64-row block to its visible keys, one
launch) against cuBLAS row bands (CUPY_ATTN_SPLIT_PV=0), whole calls and P·V alone, same process, rotated rounds.

    PYTHONPATH=. python3 bench/experiments/split/pv_causal.py [--rounds 5]

Per shape and dtype: the public call causal with the kernel, causal with cuBLAS bands, non-causal (the kernel is not
used there) and torch causal; then P·V alone: the kernel causal, the kernel over all keys, cuBLAS over all keys
(torch.matmul) and the split path's two cuBLAS bands.
"""
import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

SHAPES = ((32, 32, 512, 512, 1024), (16, 32, 512, 300, 1024), (8, 16, 512, 512, 512), (16, 16, 256, 256, 1024))


def main():
    import cupy
    import torch

    import cupy_attn
    from cupy_attn.attention import checks
    from cupy_attn.attention.kernels import pv_sm90
    from cupy_attn.attention.paths import split
    from common import rotated_ms

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtypes", default="float16,bfloat16")
    args = ap.parse_args()
    stream = cupy.cuda.get_current_stream().ptr
    for B, H, L, S, D in SHAPES:
        for dname in args.dtypes.split(","):
            dt = getattr(torch, dname)
            q = torch.randn(B, H, L, D, device="cuda", dtype=dt)
            k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dt) for _ in range(2))
            sdpa = cupy_attn.scaled_dot_product_attention

            def call(causal, pv):
                os.environ[pv_sm90.ENV] = pv
                return sdpa(q, k, v, is_causal=causal)

            calls = {"causal, pv kernel": functools.partial(call, True, "1"),
                     "causal, cuBLAS bands": functools.partial(call, True, "0"),
                     "non-causal": functools.partial(call, False, "1"),
                     "torch causal": functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v,
                                                       is_causal=True)}
            ms = rotated_ms(calls, args.rounds)
            os.environ[pv_sm90.ENV] = "1"
            flop = 4.0 * B * H * L * S * D
            print(f"({B},{H},{L},{S},{D}) {dname}: " + "  ".join(f"{n} {t:.3f}" for n, t in ms.items())
                  + f"  | causal/non-causal pv {ms['causal, pv kernel'] / ms['non-causal']:.3f}"
                  f" bands {ms['causal, cuBLAS bands'] / ms['non-causal']:.3f}"
                  f" | non-causal {flop / ms['non-causal'] / 1e9:.0f} TFLOP/s", flush=True)
            # P·V alone on a causal P (rows of probabilities, 0 past each row's limit)
            ld = -(-S // 8) * 8
            P = torch.rand(B, H, L, ld, device="cuda").tril(diagonal=0).to(dt)
            out = torch.empty(B, H, L, D, device="cuda", dtype=dt)
            cv, co = cupy.from_dlpack(v), cupy.from_dlpack(out)
            kern, full = (pv_sm90.build(checks.array_problem(cv[:, :, :L], cv, cv, co, scale=1.0, causal=c), co, ld=ld)
                          for c in ("top_left", None))  # the problem's query: only its shape (L rows) is read
            Pv = P[..., :S]
            bands = split._row_bands(L, L, split.causal_row_bands(L))

            def cublas_bands():
                for r0, lc in bands:
                    sc = min(S, r0 + lc)
                    torch.matmul(Pv[:, :, r0:r0 + lc, :sc], v[:, :, :sc], out=out[:, :, r0:r0 + lc])

            alone = {"kernel causal": functools.partial(kern.launch_on, stream, P.data_ptr(), v.data_ptr(),
                                                        out.data_ptr()),
                     "kernel all keys": functools.partial(full.launch_on, stream, P.data_ptr(), v.data_ptr(),
                                                          out.data_ptr()),
                     "cuBLAS all keys": functools.partial(torch.matmul, Pv, v, out=out),
                     f"cuBLAS {len(bands)} bands": cublas_bands}
            ms = rotated_ms(alone, args.rounds)
            pv_flop = 2.0 * B * H * L * S * D
            print("    P·V alone: " + "  ".join(f"{n} {t:.3f}" for n, t in ms.items())
                  + f"  | kernel all keys {pv_flop / ms['kernel all keys'] / 1e9:.0f} TFLOP/s, cuBLAS "
                  f"{pv_flop / ms['cuBLAS all keys'] / 1e9:.0f}", flush=True)


if __name__ == "__main__":
    main()
