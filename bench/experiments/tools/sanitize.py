"""Small calls of the kernels added in sessions 5-10, for compute-sanitizer (memcheck / racecheck / synccheck):

    export PYTHONPATH=.   # from the repository root
    compute-sanitizer --tool memcheck  python3 bench/experiments/tools/sanitize.py
    compute-sanitizer --tool racecheck python3 bench/experiments/tools/sanitize.py
    compute-sanitizer --tool synccheck python3 bench/experiments/tools/sanitize.py --forward   # the forward kernels only
    compute-sanitizer --tool synccheck python3 bench/experiments/tools/sanitize.py --decode    # ... and the decode kernels
    compute-sanitizer --tool racecheck python3 bench/experiments/tools/sanitize.py --d512      # the head-dim-512 kernel only
    compute-sanitizer --tool racecheck python3 bench/experiments/tools/sanitize.py --pdl       # the PDL launches only
    compute-sanitizer --tool racecheck python3 bench/experiments/tools/sanitize.py --pairs     # pair tiles, key masks, P·V
    compute-sanitizer --tool racecheck python3 bench/experiments/tools/sanitize.py --pv        # the P·V kernel only

The FA3-design forward (forced, each mode: ping-pong, overlap, persistent; head dims 128, 96, 80), the fused and
split backward (autograd, so the prepared backward's replay path runs from the second call of a layout), the Hopper backward (CUPY_ATTN_BWD=sm90, on sm_90:
head dims 64, 128, 256 and 160 (bucket 256), causal both alignments, GQA), the decode kernel (v1 and the Hopper streaming v2) with several splits and a padding mask, each
once on odd sizes; the Linear-BN-softmax backward kernels.
"""
import os
import sys

import torch

import cupy_attn


def decode_calls(f16):
    """The decode kernel v1 (its 4- and 8-warp tiles: auto and forced) and the Hopper streaming variant v2 (1 and 2
    CTAs/SM), several splits, a padding mask with one batch fully masked; GQA 4/1 at L = 1 and 2."""
    q = torch.randn(2, 8, 1, 128, device="cuda", dtype=f16)
    k, v = (torch.randn(2, 2, 3000, 128, device="cuda", dtype=f16) for _ in range(2))
    mask = torch.rand(2, 1, 1, 3000, device="cuda") > 0.2
    mask[1] = False
    for variant in ("1", "2", "3"):
        os.environ["CUPY_ATTN_DECODE"] = variant
        for splits in (1, 3, 7):
            cupy_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, num_splits=splits)
    os.environ["CUPY_ATTN_DECODE"] = "1"
    for warps in ("4", "8"):
        os.environ["CUPY_ATTN_DECODE_WARPS"] = warps
        for L in (1, 2):
            q = torch.randn(2, 8, L, 128, device="cuda", dtype=f16)
            for splits in (None, 2):
                cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, num_splits=splits)
        del os.environ["CUPY_ATTN_DECODE_WARPS"]
    del os.environ["CUPY_ATTN_DECODE"]


def d512_calls(f16):
    """The head-dim-512 fused kernel (sessions 14-15), forced: a partial row block and a partial key block, causal in
    both alignments (L > S: rows that see no key), GQA, E ≠ Ev, persistent walks (causal ones over m-block pairs)."""
    os.environ["CUPY_ATTN_D512"] = "1"
    q = torch.randn(1, 4, 200, 512, device="cuda", dtype=f16)
    k, v = (torch.randn(1, 2, 300, 512, device="cuda", dtype=f16) for _ in range(2))
    for causal in (False, True, "bottom_right"):
        cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, return_lse=True)
    q = torch.randn(1, 2, 150, 264, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 70, 264, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, 70, 504, device="cuda", dtype=torch.bfloat16)
    cupy_attn.scaled_dot_product_attention(q, k, v, is_causal="bottom_right", return_lse=True)
    # More tiles than SMs: persistent CTAs walk several, some of them without a key block (bottom-right, L > S);
    # causal ones in m-block pairs (M-1-k, k), M = 5 and 11 (the middle m-block alone).
    q = torch.randn(1, 40, 300, 512, device="cuda", dtype=f16)
    k, v = (torch.randn(1, 40, 100, 512, device="cuda", dtype=f16) for _ in range(2))
    for causal in (False, "bottom_right"):
        cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True)
    q, k, v = (torch.randn(1, 14, 704, 320, device="cuda", dtype=f16) for _ in range(3))
    cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    del os.environ["CUPY_ATTN_D512"]


def pair_calls(f16):
    """The persistent scores kernel's causal pair tiles (session 17; scores_sm90.causal_pairs), more tiles than SMs:
    the seed's square mask (pairs with n1 = 192, 128, 64) at E = 320 (5 k blocks: past the 3-stage ring), S = 448
    (n1 = 0 and a k_blocks < stages case at E = 128), bottom-right with L > S (rows that see no key, the window in the
    middle) and GQA at E = 192 (k_blocks = stages)."""
    os.environ["CUPY_ATTN_SPLIT_FUSED"] = "3"
    for (B, Hq, Hkv, L, S, E, causal) in ((2, 40, 40, 512, 512, 320, True), (2, 20, 20, 448, 448, 128, True),
                                         (1, 16, 4, 1024, 512, 192, "bottom_right")):
        q = torch.randn(B, Hq, L, E, device="cuda", dtype=f16)
        k, v = (torch.randn(B, Hkv, S, E, device="cuda", dtype=f16) for _ in range(2))
        cupy_attn.scaled_dot_product_attention(q, k, v, backend="split", is_causal=causal, enable_gqa=Hq != Hkv,
                                               return_lse=True)


def mask_calls(f16):
    """The masked scores kernel (key-only attn_mask, session 17): bool and float masks, per batch and per head, GQA,
    a partial row block, a batch that sees no key, more tiles than SMs."""
    os.environ["CUPY_ATTN_SPLIT_FUSED"] = "3"
    q = torch.randn(3, 16, 200, 320, device="cuda", dtype=f16)
    k, v = (torch.randn(3, 4, 400, 320, device="cuda", dtype=f16) for _ in range(2))
    keep = torch.rand(3, 1, 1, 400, device="cuda") > 0.3
    keep[1] = False
    for mask in (keep, torch.where(keep, 0.5, float("-inf")).to(f16),
                 torch.rand(3, 16, 1, 400, device="cuda") > 0.5):
        cupy_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, return_lse=True)


def pv_calls(f16):
    """The P·V kernel after the scores kernel (session 18, pv_sm90): causal calls (pair_calls also run it), a
    non-causal call at S % 8 ≠ 0 (its default there), and forced (CUPY_ATTN_SPLIT_PV=2) at Ev = 264 (a partial
    256-column tile), GQA, bottom-right with L > S (row blocks that see no key), more tiles than SMs."""
    os.environ["CUPY_ATTN_SPLIT_FUSED"] = "3"
    for (B, Hq, Hkv, L, S, E, Ev, causal, mode) in ((2, 16, 16, 512, 300, 320, 320, None, "1"),
                                                   (2, 8, 2, 200, 450, 512, 264, None, "2"),
                                                   (1, 8, 8, 700, 512, 384, 384, "bottom_right", "1"),
                                                   (4, 20, 20, 256, 256, 640, 640, True, "1")):
        os.environ["CUPY_ATTN_SPLIT_PV"] = mode
        q = torch.randn(B, Hq, L, E, device="cuda", dtype=f16)
        k = torch.randn(B, Hkv, S, E, device="cuda", dtype=f16)
        v = torch.randn(B, Hkv, S, Ev, device="cuda", dtype=f16)
        cupy_attn.scaled_dot_product_attention(q, k, v, backend="split", is_causal=causal, enable_gqa=Hq != Hkv)
    os.environ.pop("CUPY_ATTN_SPLIT_PV")


def lbs_forward_calls():
    """The Linear-BN-softmax forward without autograd (session 16: its two kernels after the GEMM launched as
    programmatic dependents): training and eval, the register row kernel (F ≤ 8192, 16-byte and scalar tiles) and the
    streaming one (F > 8192), two calls each (the second replays the call cache)."""
    from cupy_attn.torch import LinearBatchNormSoftmax
    for dtype, n, f in ((torch.float16, 70, 1000), (torch.bfloat16, 33, 129), (torch.float32, 9, 8200),
                        (torch.float16, 64, 8192)):
        fused = LinearBatchNormSoftmax(40, f, device="cuda", dtype=dtype)
        for training in (True, False):
            fused.train(training)
            x = torch.randn(n, 40, device="cuda", dtype=dtype)
            with torch.no_grad():
                for _ in range(2):
                    fused(x)


def bwd_sm90_calls(dtype):
    """The Hopper backward (sm_90 only), GQA 2, head dims 64, 128 (dQ by TMA reduces from the writer warp), 256 and
    160 (red.global.add), causal both alignments; L = 150 and 300 give each key block several steps (the writer's
    barriers cycle), the second step of each replays the prepared backward (autograd's call cache)."""
    if torch.cuda.get_device_capability() != (9, 0):
        return
    os.environ["CUPY_ATTN_BWD"] = "sm90"
    for E, causal, L in ((64, "bottom_right", 150), (64, False, 300), (128, True, 150), (128, False, 300),
                         (256, "bottom_right", 150), (160, True, 150)):
        q = torch.randn(1, 4, L, E, device="cuda", dtype=dtype, requires_grad=True)
        k2, v2 = (torch.randn(1, 2, 200, E, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        for _ in range(2):
            out = cupy_attn.scaled_dot_product_attention(q, k2, v2, is_causal=causal, enable_gqa=True)
            out.float().sum().backward()
    del os.environ["CUPY_ATTN_BWD"]


def main():
    torch.manual_seed(0)
    f16 = torch.float16
    # One group of kernels only: flag -> (the calls, what they cover).
    groups = {
        "--pdl": (lambda: (lbs_forward_calls(), decode_calls(f16)),
                  "PDL launches: Linear-BN-softmax forward, decode with splits"),
        "--pairs": (lambda: (pair_calls(f16), mask_calls(f16), pv_calls(f16)),
                    "the scores kernel's causal pair tiles and key masks, the P·V kernel"),
        "--pv": (lambda: pv_calls(f16), "the P·V kernel after the scores kernel"),
        "--bwd": (lambda: bwd_sm90_calls(f16), "the Hopper backward only"),
        "--d512": (lambda: d512_calls(f16), "head-dim-512 kernel only"),
        "--decode": (lambda: decode_calls(f16), "decode kernels only"),
    }
    if len(sys.argv) > 1 and sys.argv[1] in groups:
        calls, what = groups[sys.argv[1]]
        calls()
        torch.cuda.synchronize()
        print(f"sanitize calls done ({what})")
        return
    # The FA3-design forward in its three modes (3: persistent, with more tiles than SMs so CTAs loop, and a
    # bottom-right call with empty tiles), head dims 128, 96 (qk_dim 96) and 80 (qk_dim 80).
    for mode in ("1", "2", "3"):
        os.environ["CUPY_ATTN_FA3"] = mode
        for E in (128, 96, 80):
            q, k, v = (torch.randn(1, 2, 200, E, device="cuda", dtype=f16) for _ in range(3))
            cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    os.environ["CUPY_ATTN_FA3"] = "3"
    q = torch.randn(3, 48, 300, 64, device="cuda", dtype=f16)
    k, v = (torch.randn(3, 12, 200, 64, device="cuda", dtype=f16) for _ in range(2))
    cupy_attn.scaled_dot_product_attention(q, k, v, is_causal="bottom_right", enable_gqa=True, return_lse=True)
    cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True)
    # Session 9: the TMA-store epilogue at head dim 256 (two chunks through the staging buffer), the 192-row tile
    # (non-causal head dim 64, above), and an out whose Ev is not a multiple of 8 (the 4-byte stores).
    q, k, v = (torch.randn(1, 2, 200, 256, device="cuda", dtype=f16) for _ in range(3))
    cupy_attn.scaled_dot_product_attention(q, k, v, return_lse=True)
    q, k = (torch.randn(1, 2, 200, 100, device="cuda", dtype=f16) for _ in range(2))
    cupy_attn.scaled_dot_product_attention(q, k, torch.randn(1, 2, 200, 100, device="cuda", dtype=f16))
    os.environ["CUPY_ATTN_FA3"] = "0"
    # The split path's scores kernel (Q·Kᵀ with the softmax in its epilogue; issue 14): S = 300 (a partial key tile),
    # L = 100 (a partial row block), head dim 512.
    os.environ["CUPY_ATTN_SPLIT_FUSED"] = "1"
    q = torch.randn(1, 4, 100, 512, device="cuda", dtype=f16)
    k, v = (torch.randn(1, 4, 300, 512, device="cuda", dtype=f16) for _ in range(2))
    cupy_attn.scaled_dot_product_attention(q, k, v, backend="split", return_lse=True)
    # Session 9: its TMA stores of P, causal in both alignments (row blocks that skip a warpgroup's wgmma, the zero
    # boxes past 2·nw, rows that see no key).
    for causal in (True, "bottom_right"):
        cupy_attn.scaled_dot_product_attention(q, k, v, backend="split", is_causal=causal, return_lse=True)
    q = torch.randn(1, 2, 300, 512, device="cuda", dtype=f16)
    cupy_attn.scaled_dot_product_attention(q, q[:, :, :100], q[:, :, :100], backend="split", is_causal="bottom_right")
    # Session 10: the persistent scores kernel (the default): 4 row blocks × 40 heads × 2 = 320 tiles, more than the
    # SMs, so CTAs walk 2-3 tiles through one ring (P staged in each tile's last stage), causal in both alignments.
    os.environ["CUPY_ATTN_SPLIT_FUSED"] = "3"
    q = torch.randn(2, 40, 200, 320, device="cuda", dtype=f16)
    k, v = (torch.randn(2, 40, 300, 320, device="cuda", dtype=f16) for _ in range(2))
    for causal in (False, True, "bottom_right"):
        cupy_attn.scaled_dot_product_attention(q, k, v, backend="split", is_causal=causal, return_lse=True)
    # Session 13: the persistent kernel's P by 16-byte stores, the early release of a tile's last stage and the
    # one-buffer statistics exchange, with k_blocks = stages (E = 192, S = 500: the 256-key tile's three stages; the
    # second statistics barrier) and k_blocks < stages (E = 128), more tiles than SMs; S = 500 ends inside a 16-byte
    # chunk (written whole up to the pitch, 504).
    for E in (192, 128):
        q = torch.randn(2, 40, 200, E, device="cuda", dtype=f16)
        k, v = (torch.randn(2, 40, 500, E, device="cuda", dtype=f16) for _ in range(2))
        for causal in (False, True, "bottom_right"):
            cupy_attn.scaled_dot_product_attention(q, k, v, backend="split", is_causal=causal, return_lse=True)
    # The fp32 split path on gemm_3xtf32 (both GEMMs; 16-byte and 4-byte copies: E = 321 rows are not 16-byte
    # aligned), causal in row bands on the cuBLAS-path schedule (L = 600: 2 bands).
    for E, L, causal in ((320, 100, False), (321, 90, True), (64, 600, True)):
        q = torch.randn(1, 2, L, E, device="cuda")
        k, v = (torch.randn(1, 2, 650, E, device="cuda") for _ in range(2))
        cupy_attn.scaled_dot_product_attention(q, k, v, backend="split", is_causal=causal, return_lse=True)
    d512_calls(f16)
    if len(sys.argv) > 1 and sys.argv[1] == "--forward":
        torch.cuda.synchronize()
        print("sanitize calls done (forward kernels only)")
        return
    del os.environ["CUPY_ATTN_SPLIT_FUSED"]
    for E, causal in ((64, True), (128, False), (320, True)):
        q, k, v = (torch.randn(1, 4, 77, E, device="cuda", dtype=f16, requires_grad=True) for _ in range(3))
        k2 = torch.randn(1, 2, 90, E, device="cuda", dtype=f16, requires_grad=True)
        v2 = torch.randn(1, 2, 90, E, device="cuda", dtype=f16, requires_grad=True)
        out = cupy_attn.scaled_dot_product_attention(q, k2, v2, is_causal="bottom_right" if causal else False,
                                                     enable_gqa=True)
        out.float().sum().backward()
    bwd_sm90_calls(f16)
    decode_calls(f16)
    # Linear-BN-softmax backward (issue 11): 16-byte and scalar tiles, a partial strip, one-element and per-feature
    # scale (the last-block sum), train and eval.
    from cupy_attn.torch import LinearBatchNormSoftmax
    for dtype, n, f, scale_shape in ((f16, 70, 1000, (1,)), (torch.bfloat16, 33, 129, (129,)),
                                     (torch.float32, 9, 8200, (1,))):
        fused = LinearBatchNormSoftmax(40, f, scale_shape=scale_shape, device="cuda", dtype=dtype)
        for training in (True, False):
            fused.train(training)
            x = torch.randn(n, 40, device="cuda", dtype=dtype, requires_grad=True)
            fused(x).backward(torch.randn(n, f, device="cuda", dtype=dtype))
    torch.cuda.synchronize()
    print("sanitize calls done")


if __name__ == "__main__":
    main()
