"""varlen_attention on the GPU: the packed kernel (one launch for every sequence) and the per-sequence path against the
float64 reference, under the suite's error rule (tests/_helpers/_tolerance.py: the peer is the same math in torch
ops at the inputs' precision, sequence by sequence); gradients; paged caches; CUDA graphs; CuPy inputs."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference

from _attention_ref import torch_variant_attention
from _tolerance import as_f64, assert_close

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _packed(lens_q, lens_k, Hq, Hkv, E, dtype, seed=0, extra_q=0, Ev=None):
    g = torch.Generator("cuda").manual_seed(seed)
    cq = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    ck = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    t = DTYPES[dtype]
    q = torch.randn((int(cq[-1]) + extra_q, Hq, E), generator=g, device="cuda").to(t)
    k = torch.randn((int(ck[-1]), Hkv, E), generator=g, device="cuda").to(t)
    v = torch.randn((int(ck[-1]), Hkv, Ev or E), generator=g, device="cuda").to(t)
    return q, k, v, cq, ck


def _peer(q, k, v, cq, ck, *, causal, window=None, softcap=None, sinks=None):
    """The torch peer at the inputs' precision, sequence by sequence (rows no sequence covers: 0)."""
    out = torch.zeros(q.shape[:2] + (v.shape[-1],), dtype=q.dtype, device="cuda")
    for b in range(len(cq) - 1):
        rows, keys = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        if rows.stop == rows.start:
            continue
        o = torch_variant_attention(q[rows].transpose(0, 1), k[keys].transpose(0, 1), v[keys].transpose(0, 1),
                                    causal="bottom_right" if causal else False, window=window, softcap=softcap,
                                    sinks=sinks)
        out[rows] = o.transpose(0, 1)
    return out


def _check(q, k, v, cq, ck, dtype, *, backend="fused", causal=False, window=None, softcap=None, sinks=None, what=""):
    lq, lk = np.diff(cq.cpu().numpy()), np.diff(ck.cpu().numpy())
    out, lse = cupy_attn.varlen_attention(q, k, v, cq, ck, int(lq.max()), int(lk.max()), is_causal=causal,
                                          window_size=window, softcap=softcap, sinks=sinks, backend=backend,
                                          return_lse=True)
    ref, ref_lse = reference.varlen_attention(as_f64(q), as_f64(k), as_f64(v), cq.cpu().numpy(), ck.cpu().numpy(),
                                              is_causal=causal, window_size=window, softcap=softcap,
                                              sinks=None if sinks is None else as_f64(sinks), return_lse=True)
    covered = int(cq[-1])
    peer = _peer(q, k, v, cq, ck, causal=causal, window=window, softcap=softcap, sinks=sinks)
    assert_close(out[:covered], ref[:covered], dtype, peer[:covered], what)
    got = as_f64(lse)[:, :covered]
    finite = np.isfinite(ref_lse[:, :covered])
    np.testing.assert_allclose(got[finite], ref_lse[:, :covered][finite], rtol=2e-3, atol=2e-3, err_msg=what)
    assert np.all(got[~finite] == ref_lse[:, :covered][~finite]), what
    return out


# The lengths (tile edges at 64 and 128, a long one, a zero-length sequence), keys ≠ queries both ways.
LENS_Q = [1, 2, 63, 64, 0, 65, 127, 1000, 4097]
LENS_K = [1, 5, 63, 200, 3, 64, 100, 1000, 4097]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("E", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_kernel_matches_the_reference(dtype, E, causal):
    q, k, v, cq, ck = _packed(LENS_Q, LENS_K, 8, 2, E, dtype, seed=E, extra_q=3)
    _check(q, k, v, cq, ck, dtype, causal=causal, what=f"{dtype} E={E} causal={causal}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_packed_variants(dtype):
    q, k, v, cq, ck = _packed([300, 17, 1000], [310, 40, 900], 8, 2, 128, dtype, seed=5)
    sinks = torch.randn(8, device="cuda")
    for kw in (dict(window=(64, 0), causal=True), dict(window=(100, 20)), dict(softcap=5.0, causal=True),
               dict(sinks=sinks, window=(128, 0), causal=True)):
        _check(q, k, v, cq, ck, dtype, what=f"{dtype} {kw}", **kw)


def test_head_dim_512_runs_per_sequence():
    q, k, v, cq, ck = _packed([100, 0, 300], [200, 7, 300], 4, 2, 512, "bfloat16", seed=9)
    _check(q, k, v, cq, ck, "bfloat16", backend="auto", causal=True, what="E=512")


def test_seqused_k_and_cupy_inputs():
    import cupy
    q, k, v, cq, ck = _packed([50, 70], [120, 90], 4, 4, 64, "float16", seed=3)
    used = torch.tensor([100, 1], dtype=torch.int32, device="cuda")
    out = cupy_attn.varlen_attention(*(cupy.asarray(x) for x in (q, k, v, cq, ck)), 70, 120,
                                     seqused_k=cupy.asarray(used), is_causal=True, backend="fused")
    assert isinstance(out, cupy.ndarray)
    ref = reference.varlen_attention(as_f64(q), as_f64(k), as_f64(v), cq.cpu().numpy(), ck.cpu().numpy(),
                                     seqused_k=used.cpu().numpy(), is_causal=True)
    assert np.abs(as_f64(out) - ref).max() < 4e-3


def test_gradients_of_the_packed_call():
    dtype = "bfloat16"
    q, k, v, cq, ck = _packed([130, 0, 257, 64], [200, 5, 257, 64], 4, 2, 128, dtype, seed=11)
    sinks = torch.randn(4, device="cuda")
    leaves = [x.detach().requires_grad_() for x in (q, k, v, sinks)]
    out = cupy_attn.varlen_attention(*leaves[:3], cq, ck, 257, 257, causal=True, sinks=leaves[3])
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, g)
    refs = [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]
    peers = [x.detach().requires_grad_() for x in (q, k, v, sinks)]
    grads = {}
    for name, ins in (("ref", refs), ("peer", peers)):
        o = _peer(*ins[:3], cq, ck, causal=True, sinks=ins[3])
        grads[name] = torch.autograd.grad(o, ins, g.to(o.dtype))
    for i, name in enumerate(("dq", "dk", "dv", "dsinks")):
        ref = grads["ref"][i].cpu().numpy()
        assert_close(got[i], ref, dtype if i < 3 else "float32", grads["peer"][i], name)


@pytest.mark.parametrize("block_size", [16, 64, 128, 256])
@pytest.mark.parametrize("E", [128, 256])
def test_paged_cache_matches_the_gathered_call(block_size, E):
    """A paged cache read by the packed kernel (pages of 16 ... 256 keys against key blocks of 128 (E = 128) and 64 (E
    = 256)) gives exactly what the same kernel gives on the gathered keys, and passes the error rule against the
    float64 reference; the per-sequence path (backend="split", pages gathered on the host) agrees under the rule.
    Table entries past each sequence's pages hold ids outside the cache, and the slots past its keys, as the pages no
    table names, hold NaN: none is read."""
    g = torch.Generator("cuda").manual_seed(block_size + E)
    Hq, Hkv, B = 8, 2, 5
    used = torch.tensor([0, 1, 700, 1500, 129], dtype=torch.int32, device="cuda")
    lens_q = [3, 1, 64, 200, 129]
    pages = [-(-int(s) // block_size) for s in used]
    n = sum(pages) + 3
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    table = torch.full((B, max(pages) + 2), 1 << 30, dtype=torch.int32)  # wider than needed, unset past the pages
    kc = torch.full((n, block_size, Hkv, E), float("nan"), device="cuda").half()
    vc = torch.full((n, block_size, Hkv, E), float("nan"), device="cuda").half()
    at = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[at:at + p]
        rows = perm[at:at + p].long().cuda()
        S = int(used[b])
        for c in (kc, vc):
            fill = torch.randn((p * block_size, Hkv, E), generator=g, device="cuda").half()
            fill[S:] = float("nan")
            c[rows] = fill.view(p, block_size, Hkv, E)
        at += p
    table = table.cuda()
    q = torch.randn((sum(lens_q), Hq, E), generator=g, device="cuda").half()
    cq = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    args = (cq, None, max(lens_q), 1500)
    out = cupy_attn.varlen_attention(q, kc, vc, *args, seqused_k=used, block_table=table, is_causal=True,
                                     backend="fused")
    host_table = table.cpu().numpy()
    gathered = [torch.cat([torch.from_numpy(reference.paged_keys(c.cpu().numpy(), host_table[b], int(used[b])))
                           for b in range(B)]).cuda() for c in (kc, vc)]
    ck = torch.tensor(np.concatenate([[0], np.cumsum(used.cpu().numpy())]), dtype=torch.int32, device="cuda")
    same = cupy_attn.varlen_attention(q, *gathered, cq, ck, max(lens_q), 1500, is_causal=True, backend="fused")
    torch.testing.assert_close(out, same, rtol=0, atol=0)
    _check(q, *gathered, cq, ck, "float16", causal=True, what=f"paged {block_size}")
    split = cupy_attn.varlen_attention(q, kc, vc, *args, seqused_k=used, block_table=table, is_causal=True,
                                       backend="split")
    ref = reference.varlen_attention(*(as_f64(x) for x in (q, *gathered)), cq.cpu().numpy(), ck.cpu().numpy(),
                                     is_causal=True)
    assert_close(split, ref, "float16", _peer(q, *gathered, cq, ck, causal=True), "per sequence")


def test_cuda_graph_capture_of_the_packed_kernel():
    q, k, v, cq, ck = _packed([100, 300], [100, 300], 4, 4, 128, "float16", seed=2)
    want = cupy_attn.varlen_attention(q, k, v, cq, ck, 300, 300, is_causal=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cupy_attn.varlen_attention(q, k, v, cq, ck, 300, 300, is_causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cupy_attn.varlen_attention(q, k, v, cq, ck, 300, 300, is_causal=True)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_call_cache_replays_with_new_lengths():
    """A call of the same layout replays the cached launch: new cu_seqlens values (same B and totals) must be read."""
    from cupy_attn.runtime import callcache
    q, k, v, cq, ck = _packed([100, 300], [120, 280], 4, 2, 128, "bfloat16", seed=4)
    callcache.clear()
    cupy_attn.varlen_attention(q, k, v, cq, ck, 300, 280, is_causal=True)
    assert any(key[0] == "varlen" for key in callcache._CACHE), "the packed call was not cached"
    cq2 = torch.tensor([0, 250, 400], dtype=torch.int32, device="cuda")
    ck2 = torch.tensor([0, 50, 400], dtype=torch.int32, device="cuda")
    out = cupy_attn.varlen_attention(q, k, v, cq2, ck2, 250, 350, is_causal=True)
    ref = reference.varlen_attention(as_f64(q), as_f64(k), as_f64(v), cq2.cpu().numpy(), ck2.cpu().numpy(),
                                     is_causal=True)
    peer = _peer(q, k, v, cq2, ck2, causal=True)
    assert_close(out, ref, "bfloat16", peer, "replayed call")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_packed_sequences_without_keys_and_more_rows_than_keys(dtype):
    """Sequences whose rows see no key (S_b = 0; bottom-right with L_b > S_b: the first rows see none) write out 0 and
    lse −inf from the packed kernel; ALiBi slopes per sequence (B, Hq)."""
    q, k, v, cq, ck = _packed([70, 300, 5], [0, 100, 5], 4, 2, 64, dtype, seed=21)
    _check(q, k, v, cq, ck, dtype, causal=True, what=f"{dtype} S=0 and L>S")
    slopes = torch.rand((3, 4), device="cuda") * 0.1
    out = cupy_attn.varlen_attention(q, k, v, cq, ck, 300, 100, is_causal=True, alibi_slopes=slopes,
                                     backend="fused")
    ref = reference.varlen_attention(as_f64(q), as_f64(k), as_f64(v), cq.cpu().numpy(), ck.cpu().numpy(),
                                     is_causal=True, alibi_slopes=as_f64(slopes))
    assert np.nanmax(np.abs(as_f64(out) - ref)) < 2e-2


def test_packed_kernel_ignores_nan_past_each_sequences_keys():
    """seqused_k over a KV buffer whose unused slots (and the rows past the last sequence) hold NaN: the packed
    kernel's key blocks reach into them, masked (probability 0) and zeroed in shared memory (0 × NaN would be NaN)."""
    q, k, v, cq, ck = _packed([70, 200], [300, 300], 4, 2, 128, "bfloat16", seed=31)
    used = torch.tensor([150, 257], dtype=torch.int32, device="cuda")
    k, v = torch.cat([k, k[:40]]), torch.cat([v, v[:40]])  # 40 rows past cu_seqlens_k[B]
    for b, (k0, n) in enumerate(((0, 150), (300, 257))):
        k[k0 + n:k0 + 300 + (40 if b == 1 else 0)] = float("nan")
        v[k0 + n:k0 + 300 + (40 if b == 1 else 0)] = float("nan")
    out = cupy_attn.varlen_attention(q, k, v, cq, ck, 200, 300, seqused_k=used, is_causal=True, backend="fused")
    assert torch.isfinite(out).all()
    ref = reference.varlen_attention(as_f64(q), np.nan_to_num(as_f64(k)), np.nan_to_num(as_f64(v)),
                                     cq.cpu().numpy(), ck.cpu().numpy(), seqused_k=used.cpu().numpy(), is_causal=True)
    assert np.abs(as_f64(out) - ref).max() < 2e-2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gradients_of_causal_self_attention_buckets(dtype):
    """Causal self-attention (L_b = S_b): the backward runs on padded dense buckets (varlen.backward_buckets); the
    gradients against float64 under the error rule, sinks and a window included."""
    lens = [130, 0, 257, 64, 1000]
    q, k, v, cq, ck = _packed(lens, lens, 4, 2, 128, dtype, seed=12)
    sinks = torch.randn(4, device="cuda")
    leaves = [x.detach().requires_grad_() for x in (q, k, v, sinks)]
    out = cupy_attn.varlen_attention(*leaves[:3], cq, ck, 1000, 1000, causal=True, sinks=leaves[3],
                                     window_size=(300, 0))
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, g)
    grads = {}
    for name, ins in (("ref", [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]),
                      ("peer", [x.detach().requires_grad_() for x in (q, k, v, sinks)])):
        o = _peer(*ins[:3], cq, ck, causal=True, sinks=ins[3], window=(300, 0))
        grads[name] = torch.autograd.grad(o, ins, g.to(o.dtype))
    for i, name in enumerate(("dq", "dk", "dv", "dsinks")):
        assert_close(got[i], grads["ref"][i].cpu().numpy(), dtype if i < 3 else "float32", grads["peer"][i], name)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("E", [64, 128, 256])
def test_packed_backward_kernel(dtype, E, monkeypatch):
    """CUPY_ATTN_VARLEN_BWD=kernel: the packed Hopper backward (one launch; statistics in padded per-sequence
    columns) against float64 under the error rule: self-attention and cross lengths (L_b != S_b), GQA, sinks."""
    monkeypatch.setenv("CUPY_ATTN_VARLEN_BWD", "kernel")
    q, k, v, cq, ck = _packed([130, 0, 257, 64, 1], [200, 5, 257, 64, 70], 4, 2, E, dtype, seed=E + 1, extra_q=5)
    q[-5:] = float("nan")  # rows no sequence covers: never read (the maps end at the last sequence's last row)
    sinks = torch.randn(4, device="cuda")
    leaves = [x.detach().requires_grad_() for x in (q, k, v, sinks)]
    out = cupy_attn.varlen_attention(*leaves[:3], cq, ck, 257, 257, causal=True, sinks=leaves[3])
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, g)
    grads = {}
    for name, ins in (("ref", [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]),
                      ("peer", [x.detach().requires_grad_() for x in (q, k, v, sinks)])):
        o = _peer(*ins[:3], cq, ck, causal=True, sinks=ins[3])
        grads[name] = torch.autograd.grad(o, ins, g.to(o.dtype))
    for i, name in enumerate(("dq", "dk", "dv", "dsinks")):
        assert_close(got[i], grads["ref"][i].cpu().numpy(), dtype if i < 3 else "float32", grads["peer"][i],
                     f"{dtype} E={E} {name}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_packed_kernel_with_mods(dtype):
    """score_mod / mask_mod in the packed kernel's mod instantiation (b: the sequence, indices within it) against the
    float64 reference with the mods' Python forms; refused (NotImplementedError) where the packed kernel cannot run
    and for calls that record grad."""
    q, k, v, cq, ck = _packed(LENS_Q, LENS_K, 8, 2, 128, dtype, seed=5)
    bias = torch.linspace(-1, 1, len(LENS_Q), device="cuda")
    mod = cupy_attn.AttentionMod(
        score_mod="return score + aux.bias[b] * fminf(float(q_idx - kv_idx), 8.f) * 0.1f;",
        mask_mod="return kv_idx % 7 != 3;",
        reference_score_mod=lambda s, b, h, i, j, aux: s + aux.bias[b] * np.minimum(i - j, 8.0) * 0.1,
        reference_mask_mod=lambda b, h, i, j, aux: j % 7 != 3)
    lq, lk = np.diff(cq.cpu().numpy()), np.diff(ck.cpu().numpy())
    out = cupy_attn.varlen_attention(q, k, v, cq, ck, int(lq.max()), int(lk.max()), is_causal=True, score_mod=mod,
                                     aux={"bias": bias})
    hb = bias.cpu().numpy()
    ref = reference.varlen_attention(as_f64(q), as_f64(k), as_f64(v), cq.cpu().numpy(), ck.cpu().numpy(),
                                     is_causal=True, score_mod=lambda s, b, h, i, j: s + hb[b] * np.minimum(i - j, 8.0)
                                     * 0.1, mask_mod=lambda b, h, i, j: j % 7 != 3)
    covered = int(cq[-1])
    assert_close(out[:covered], ref[:covered], dtype, None, "varlen mods")  # no peer: the rule's dtype bound
    with pytest.raises(NotImplementedError, match="no backward yet"):
        cupy_attn.varlen_attention(q.requires_grad_(True), k, v, cq, ck, int(lq.max()), int(lk.max()), score_mod=mod,
                                   aux={"bias": bias})
