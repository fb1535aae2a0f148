"""attention_with_kvcache without a GPU: argument checks, the float64 reference path (paged and dense caches, causal
bottom-right per sequence) against the dense reference per sequence, the decode kernel's eligibility, and the paged
decode instantiations' compile (NVRTC, no spills)."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference
from cupy_attn.attention import kvcache
from cupy_attn.attention.kernels import flash_decode
from cupy_attn.runtime import compile as _compile
from cupy_attn.runtime import interop


def _cache(B=3, L=2, Hq=4, Hkv=2, E=16, ps=8, used=(0, 5, 19), seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, L, Hq, E)).astype(np.float32)
    used = np.array(used, np.int32)
    pages = [-(-int(s) // ps) for s in used]
    n = sum(pages) + 2
    kc, vc = (rng.standard_normal((n, ps, Hkv, E)).astype(np.float32) for _ in range(2))
    table = np.full((B, max(pages) + 1), n - 1, np.int32)
    perm = rng.permutation(n - 2).astype(np.int32)
    at = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[at:at + p]
        at += p
    return q, kc, vc, used, table


@pytest.mark.parametrize("causal", [False, True])
def test_reference_path_equals_the_dense_call_per_sequence(causal):
    q, kc, vc, used, table = _cache()
    out, lse = cupy_attn.attention_with_kvcache(q, kc, vc, used, table, causal=causal, return_lse=True)
    assert out.shape == (3, 2, 4, 16) and lse.shape == (3, 4, 2)
    for b in range(3):
        S = int(used[b])
        if S == 0:
            assert np.all(out[b] == 0) and np.all(lse[b] == -np.inf)
            continue
        kb, vb = (reference.paged_keys(c, table[b], S) for c in (kc, vc))
        want, want_lse = reference.scaled_dot_product_attention(
            q[b].swapaxes(0, 1), kb.swapaxes(0, 1), vb.swapaxes(0, 1), is_causal="bottom_right" if causal else False,
            enable_gqa=True, return_lse=True)
        np.testing.assert_allclose(out[b].swapaxes(0, 1), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[b], want_lse, rtol=1e-5, atol=1e-6)
    dense_k, dense_v = (np.zeros((3, 24, 2, 16), np.float32) for _ in range(2))
    for b in range(3):
        S = int(used[b])
        dense_k[b, :S], dense_v[b, :S] = reference.paged_keys(kc, table[b], S), reference.paged_keys(vc, table[b], S)
    got = cupy_attn.attention_with_kvcache(q, dense_k, dense_v, used, causal=causal, softmax_scale=0.25)
    want = cupy_attn.attention_with_kvcache(q, kc, vc, used, table, causal=causal, scale=0.25)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("change,exc,match", [
    (dict(q=np.zeros((3, 2, 4), np.float32)), ValueError, r"q must be \(B, L, Hq, E\)"),
    (dict(cache_seqlens=np.zeros(2, np.int32)), ValueError, r"cache_seqlens must have shape \(B,\) = \(3,\)"),
    (dict(cache_seqlens=np.zeros(3, np.int64)), TypeError, "cache_seqlens must be int32"),
    (dict(block_table=np.zeros((2, 3), np.int32)), ValueError, r"block_table must have shape \(B, max_blocks\)"),
    (dict(v_cache=np.zeros((5, 8, 3, 16), np.float32)), ValueError, "must agree on every axis but the last"),
    (dict(block_table=None), ValueError, "must be q's batch B=3 without block_table"),
])
def test_argument_errors(change, exc, match):
    q, kc, vc, used, table = _cache()
    args = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=used, block_table=table)
    args.update(change)
    with pytest.raises(exc, match=match):
        cupy_attn.attention_with_kvcache(**args)
    with pytest.raises(ValueError, match="not both"):
        cupy_attn.attention_with_kvcache(q, kc, vc, used, table, scale=1.0, softmax_scale=1.0)


def test_decode_kernel_eligibility():
    ctx = interop.CallContext(interop.CUPY, 0)

    class A:
        def __init__(self, shape, dtype=np.float16):
            self.shape, self.dtype = shape, np.dtype(dtype)

    ok = kvcache.decode_reason(ctx, A((64, 1, 32, 128)), A((9000, 64, 8, 128)), A((9000, 64, 8, 128)), A((64, 150)))
    assert ok is None
    assert "multiple of 64" in kvcache.decode_reason(ctx, A((64, 1, 32, 128)), A((9000, 16, 8, 128)),
                                                     A((9000, 16, 8, 128)), A((64, 150)))
    assert "fp16 and bf16" in kvcache.decode_reason(ctx, A((64, 1, 32, 128), np.float32), A((9000, 64, 8, 128)),
                                                    A((9000, 64, 8, 128)), None)
    assert "more than" in kvcache.decode_reason(ctx, A((64, 32, 32, 128)), A((9000, 64, 8, 128)),
                                                A((9000, 64, 8, 128)), None)


def test_paged_decode_instantiations_compile_without_spills():
    fam = flash_decode.FLASH_DECODE_PAGED
    for arch in ("sm_80", "sm_90"):
        for expr in fam.name_expressions()[:4]:
            report = _compile.compile_variant(fam, expr, arch).report
            assert report.registers and not report.spill_bytes, (arch, expr, report)
