"""attention_with_kvcache on the GPU: the paged decode kernel (flash_decode's kPaged instantiations) and the varlen
fallback against the float64 reference, under the suite's error rule (the peer: torch's math at the inputs'
precision, sequence by sequence); NaN in the pages no table names and in the slots past each sequence's keys."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference

from _attention_ref import torch_variant_attention
from _tolerance import as_f64, assert_close

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _paged(B, L, Hq, Hkv, E, ps, used, dtype, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    t = DTYPES[dtype]
    pages = [-(-int(s) // ps) for s in used]
    n = sum(pages) + 3
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    table = torch.full((B, max(pages) + 2), 1 << 30, dtype=torch.int32)
    kc = torch.full((n, ps, Hkv, E), float("nan"), device="cuda", dtype=t)
    vc = torch.full((n, ps, Hkv, E), float("nan"), device="cuda", dtype=t)
    at = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[at:at + p]
        for c in (kc, vc):
            fill = torch.randn((p * ps, Hkv, E), generator=g, device="cuda").to(t)
            fill[int(used[b]):] = float("nan")
            c[perm[at:at + p].long().cuda()] = fill.view(p, ps, Hkv, E)
        at += p
    q = torch.randn((B, L, Hq, E), generator=g, device="cuda").to(t)
    return q, kc, vc, torch.tensor(used, dtype=torch.int32, device="cuda"), table.cuda()


def _check(q, kc, vc, used, table, dtype, causal, what):
    out, lse = cupy_attn.attention_with_kvcache(q, kc, vc, used, table, causal=causal, return_lse=True)
    B, L, Hq, E = q.shape
    host_table = table.cpu().numpy()
    for b in range(B):
        S = int(used[b])
        if S == 0:
            assert torch.all(out[b] == 0) and torch.all(lse[b] == float("-inf")), what
            continue
        kb, vb = (torch.from_numpy(reference.paged_keys(c.float().cpu().numpy(), host_table[b], S)).cuda().to(q.dtype)
                  for c in (kc, vc))
        qb, kb, vb = q[b].transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1)
        ref, ref_lse = reference.scaled_dot_product_attention(as_f64(qb), as_f64(kb), as_f64(vb), enable_gqa=True,
                                                              is_causal="bottom_right" if causal else False,
                                                              return_lse=True)
        peer = torch_variant_attention(qb, kb, vb, causal="bottom_right" if causal else False)
        assert_close(out[b].transpose(0, 1), ref, dtype, peer, f"{what} b={b}")
        np.testing.assert_allclose(as_f64(lse[b]), ref_lse, rtol=2e-3, atol=2e-3, err_msg=what)


@pytest.mark.parametrize("variant", ["1", "2"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("E", [64, 128, 256])
@pytest.mark.parametrize("ps", [64, 128, 256])
@pytest.mark.parametrize("L,causal", [(1, False), (4, True)])
def test_paged_decode_kernel(dtype, E, ps, L, causal, variant, monkeypatch):
    """The decode kernel reads each tile from its page (pages in shuffled order, unset table entries, NaN outside
    the sequences' keys), each sequence its own key count and bottom-right causal offset; GQA 8/2. CUPY_ATTN_DECODE
    1: flash_decode's paged instantiation; 2: the TMA streaming kernel's where its key tile divides the pages."""
    monkeypatch.setenv("CUPY_ATTN_DECODE", variant)
    q, kc, vc, used, table = _paged(5, L, 8, 2, E, ps, [0, 1, 700, 3000, 64], dtype, seed=E + ps)
    _check(q, kc, vc, used, table, dtype, causal, f"paged {ps} E={E} L={L}")


def test_dense_cache_and_the_varlen_fallback():
    """A dense cache (one page of S_max keys a sequence: S_max a multiple of 64 runs the decode kernel) and pages of
    16 keys (the varlen fallback) give the reference's result."""
    q, kc, vc, used, table = _paged(3, 2, 8, 2, 128, 16, [5, 300, 1000], "float16", seed=3)
    _check(q, kc, vc, used, table, "float16", True, "pages of 16")
    dense_k = torch.zeros((3, 1024, 2, 128), device="cuda", dtype=torch.float16)
    dense_v = torch.zeros_like(dense_k)
    host_table = table.cpu().numpy()
    for b in range(3):
        S = int(used[b])
        for c, src in ((dense_k, kc), (dense_v, vc)):
            c[b, :S] = torch.from_numpy(reference.paged_keys(src.float().cpu().numpy(), host_table[b], S)).cuda().half()
    got = cupy_attn.attention_with_kvcache(q, dense_k, dense_v, used, causal=True)
    want = cupy_attn.attention_with_kvcache(q, kc, vc, used, table, causal=True)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("variant", ["1", "2"])
def test_decode_loop_replays_with_lengths_updated_in_place(variant, monkeypatch):
    """A second call with the same caches, lengths array (updated in place) and table replays the first's prepared
    launch on the new q: one cache entry, the reference's result for the new lengths."""
    from cupy_attn.runtime import callcache
    monkeypatch.setenv("CUPY_ATTN_DECODE", variant)
    q, kc, vc, used, table = _paged(4, 1, 8, 2, 128, 64, [100, 700, 3000, 64], "bfloat16", seed=5)
    callcache.clear()  # a fresh table: the count below is this test's entry
    _check(q, kc, vc, used, table, "bfloat16", False, "first step")
    entries = len(callcache._HOLDING)
    used -= 7  # in place: the next step's lengths
    q2 = torch.randn_like(q)
    _check(q2, kc, vc, used, table, "bfloat16", False, "second step")
    assert len(callcache._HOLDING) == entries
