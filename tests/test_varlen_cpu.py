"""varlen_attention without a GPU: the float64 reference of packed and paged batches, the argument checks, the CPU
path (NumPy and torch, gradients included) and the packed kernel's instantiations."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference
from cupy_attn.attention import varlen
from cupy_attn.attention.kernels import flash_fwd_sm90 as fa3


def _packed(lens_q, lens_k, Hq=4, Hkv=2, E=16, Ev=8, extra_q=0, seed=0):
    rng = np.random.default_rng(seed)
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((int(cq[-1]) + extra_q, Hq, E))
    k = rng.standard_normal((int(ck[-1]), Hkv, E))
    v = rng.standard_normal((int(ck[-1]), Hkv, Ev))
    return q, k, v, cq, ck


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (3, 0), (2, 1)])
def test_reference_is_the_dense_reference_per_sequence(causal, window):
    lens_q, lens_k = [3, 0, 5, 1, 4], [4, 2, 5, 0, 9]
    q, k, v, cq, ck = _packed(lens_q, lens_k, extra_q=2)
    out, lse = reference.varlen_attention(q, k, v, cq, ck, is_causal=causal, window_size=window, return_lse=True)
    for b in range(len(lens_q)):
        rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o, l = reference.scaled_dot_product_attention(
            q[rows].swapaxes(0, 1), k[keys].swapaxes(0, 1), v[keys].swapaxes(0, 1),
            is_causal="bottom_right" if causal else False, enable_gqa=True, window_size=window, return_lse=True)
        np.testing.assert_allclose(out[rows], o.swapaxes(0, 1), rtol=0, atol=1e-15)
        np.testing.assert_array_equal(lse[:, rows], l)
    assert (out[cq[-1]:] == 0).all() and (lse[:, cq[-1]:] == -np.inf).all()


def test_reference_paged_equals_gathered():
    rng = np.random.default_rng(1)
    bs, Hkv, E = 4, 2, 8
    used = np.array([5, 0, 1, 12], np.int32)
    pages = rng.permutation(16).astype(np.int32)
    table = np.full((4, 5), 15, np.int32)  # wider than needed; unused entries point anywhere
    table[0, :2], table[2, :1], table[3, :3] = pages[:2], pages[2:3], pages[3:6]
    kc, vc = rng.standard_normal((16, bs, Hkv, E)), rng.standard_normal((16, bs, Hkv, E))
    q = rng.standard_normal((4, 4, E))
    cq = np.arange(5, dtype=np.int32)
    out = reference.varlen_attention(q, kc, vc, cq, None, seqused_k=used, block_table=table)
    for b in range(4):
        keys = reference.paged_keys(kc, table[b], int(used[b]))
        vals = reference.paged_keys(vc, table[b], int(used[b]))
        want = reference.scaled_dot_product_attention(q[b:b + 1].swapaxes(0, 1), keys.swapaxes(0, 1),
                                                      vals.swapaxes(0, 1), enable_gqa=True)
        np.testing.assert_allclose(out[b], want[:, 0], atol=1e-15)


def test_numpy_path_and_paged_call_match_the_reference():
    q, k, v, cq, ck = _packed([7, 1, 0, 3], [7, 9, 2, 3], extra_q=1)
    out, lse = cupy_attn.varlen_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), cq, ck,
                                          7, 9, is_causal=True, softcap=2.0, return_lse=True)
    ref, ref_lse = reference.varlen_attention(q, k, v, cq, ck, is_causal=True, softcap=2.0, return_lse=True)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5)
    # the same keys paged: block size 2, pages shuffled
    bs, n = 2, 16
    perm = np.random.default_rng(2).permutation(n)
    kc, vc = np.zeros((n, bs, 2, 16), np.float32), np.zeros((n, bs, 2, 8), np.float32)
    table = np.zeros((4, 5), np.int32)
    used = np.diff(ck).astype(np.int32)
    nxt = 0
    for b in range(4):
        for j in range(-(-int(used[b]) // bs)):
            page = perm[nxt]
            nxt += 1
            table[b, j] = page
            rows = slice(ck[b] + j * bs, min(ck[b] + (j + 1) * bs, ck[b + 1]))
            kc[page, :rows.stop - rows.start], vc[page, :rows.stop - rows.start] = k[rows], v[rows]
    paged = cupy_attn.varlen_attention(q.astype(np.float32), kc, vc, cq, None, 7, 9, seqused_k=used,
                                       block_table=table, causal=True, softcap=2.0)
    np.testing.assert_allclose(paged, ref, atol=1e-5)


def test_torch_cpu_gradients_match_float64():
    torch = pytest.importorskip("torch")
    from _attention_ref import torch_variant_attention
    q, k, v, cq, ck = _packed([4, 2, 6], [5, 2, 6], Hq=2, Hkv=1)
    sinks = np.array([0.3, -1.0])
    tq, tk, tv, ts = (torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in (q, k, v, sinks))
    out = cupy_attn.varlen_attention(tq, tk, tv, torch.tensor(cq), torch.tensor(ck), 6, 6, causal=True, sinks=ts)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    grads = torch.autograd.grad(out, (tq, tk, tv, ts), g)
    # float64: per sequence, torch ops (bottom-right causal; the sink as a softmax column)
    rq, rk, rv, rs = (torch.tensor(x, requires_grad=True) for x in (q, k, v, sinks))
    pieces = []
    for b in range(3):
        rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o = torch_variant_attention(rq[rows].transpose(0, 1), rk[keys].transpose(0, 1), rv[keys].transpose(0, 1),
                                    causal="bottom_right", sinks=rs)
        pieces.append(o.transpose(0, 1))
    want = torch.autograd.grad(torch.cat(pieces), (rq, rk, rv, rs), g.double())
    for got, ref, name in zip(grads, want, ("dq", "dk", "dv", "dsinks")):
        np.testing.assert_allclose(got.numpy(), ref.numpy(), atol=2e-5, err_msg=name)


def _call(**kw):
    q, k, v, cq, ck = _packed([3, 2], [3, 2])
    args = dict(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32), cu_seqlens_q=cq,
                cu_seqlens_k=ck, max_seqlen_q=3, max_seqlen_k=3)
    args.update(kw)
    return cupy_attn.varlen_attention(**args)


@pytest.mark.parametrize("kw, err, text", [
    (dict(q=np.zeros((5, 4), np.float32)), ValueError, "q must be (total_q, Hq, E)"),
    (dict(k=np.zeros((5, 3, 16), np.float32), v=np.zeros((5, 3, 8), np.float32)), ValueError,
     "multiple of k's head axis"),
    (dict(v=np.zeros((4, 2, 8), np.float32)), ValueError, "must agree on every axis but the last"),
    (dict(k=np.zeros((5, 2, 16), np.float16)), TypeError, "must have q's dtype"),
    (dict(cu_seqlens_q=np.array([0, 3, 5], np.int64)), TypeError, "cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=np.array([0, 5], np.int32)), ValueError, "cu_seqlens_k must have shape (B + 1,) = (3,)"),
    (dict(cu_seqlens_k=None), ValueError, "cu_seqlens_k is required"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be an int >= 0"),
    (dict(max_seqlen_q=2), ValueError, "max_seqlen_q (2) is below sequence 0's length 3"),
    (dict(cu_seqlens_q=np.array([0, 3, 9], np.int32), max_seqlen_q=6), ValueError, "lie within q's axis 0"),
    (dict(is_causal="top_left"), ValueError, "bottom-right aligned"),
    (dict(block_table=np.zeros((2, 1), np.int32)), ValueError, "with block_table"),
    (dict(dropout_p=2.0), ValueError, "dropout_p must be in [0, 1]"),
    (dict(backend="fast"), ValueError, "backend must be one of"),
    (dict(sinks=np.zeros(3, np.float32)), ValueError, "sinks must have shape (Hq,) = (4,)"),
    (dict(window_size=(1, 2, 3)), ValueError, "window_size"),
    (dict(causal=True, is_causal=True), ValueError, "not both"),
    (dict(backend="fused"), ValueError, "backend='fused'"),
    (dict(cu_seqlens_q=[0, 3, 5]), TypeError, "cu_seqlens_q"),
    (dict(max_seqlen_k=3.0), TypeError, "max_seqlen_k must be an int"),
])
def test_argument_errors(kw, err, text):
    with pytest.raises(err, match=None) as info:
        _call(**kw)
    assert text in str(info.value), str(info.value)


def test_fused_reason_on_cpu_and_bounds():
    vp = varlen.check_varlen(*(x.astype(np.float32) for x in _packed([2], [2])[:3]), np.array([0, 2], np.int32), np.array([0, 2], np.int32), 2, 2,
                             seqused_k=None, block_table=None, is_causal=True, scale=None, dropout_p=0.0,
                             backend="auto", window_size=(5, 0), softcap=None, sinks=None, alibi_slopes=None)
    assert "CPU" in varlen.fused_reason(vp, "auto")
    b = varlen._bounds(vp)  # relative to each sequence's diagonal: causal 0, window left 5
    assert b.key_upper == (True, 0) and b.window_lo == -5


def test_packed_instantiations_exist_for_every_bucket():
    exprs = {fa3.FLASH_FWD_SM90_TMA.name_expression(dtype=d, head_dim=h, tile=fa3.VARLEN_TILES[h], qk_dim=h,
                                                    variants=var, varlen="true")
             for d in ("__half", "__nv_bfloat16") for h in fa3.TILES for var in ("false", "true")}
    assert exprs <= set(fa3.FLASH_FWD_SM90_TMA.name_expressions())


def test_torch_compile_one_op_forward_and_backward():
    """Under torch.compile(fullgraph=True) the call is one custom op (no graph break) and its backward the second one;
    results and gradients equal eager's (CPU tensors: the float64 reference)."""
    torch = pytest.importorskip("torch")
    from cupy_attn import torch_ops  # noqa: F401  (registers the ops)
    q, k, v, cq, ck = _packed([5, 0, 7], [6, 2, 7], Hq=4, Hkv=2)
    sinks = np.array([0.1, -0.2, 0.3, 0.0])
    tcq, tck = torch.tensor(cq), torch.tensor(ck)

    def f(q_, k_, v_, s_):
        return cupy_attn.varlen_attention(q_, k_, v_, tcq, tck, 7, 7, is_causal=True, window_size=(3, 0), sinks=s_)

    def leaves():
        return [torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in (q, k, v, sinks)]
    eager_in, comp_in = leaves(), leaves()
    eager = f(*eager_in)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*comp_in)
    torch.testing.assert_close(compiled, eager)
    g = torch.randn(eager.shape, generator=torch.Generator().manual_seed(1))
    for a, b in zip(torch.autograd.grad(eager, eager_in, g), torch.autograd.grad(compiled, comp_in, g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_torch_ops_fake_shapes():
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from cupy_attn import torch_ops  # noqa: F401
    with FakeTensorMode():
        q, k, v = torch.empty(10, 8, 64), torch.empty(12, 2, 64), torch.empty(12, 2, 32)
        cu = torch.empty(3, dtype=torch.int32)
        out, lse = torch.ops.cupy_attn.varlen_attention(q, k, v, cu, cu, 5, 6, None, None, True, None, -1, -1, 0.0,
                                                        None, None, "auto")
    assert tuple(out.shape) == (10, 8, 32) and tuple(lse.shape) == (8, 10) and lse.dtype == torch.float32


def test_block_table_pages_out_of_range():
    q, k, v, cq, _ = _packed([2, 2], [4, 4])
    kc, vc = np.zeros((3, 4, 2, 16), np.float32), np.zeros((3, 4, 2, 8), np.float32)
    for bad in (-1, 3):
        table = np.array([[0], [bad]], np.int32)
        with pytest.raises(ValueError, match="block_table: sequence 1's pages"):
            cupy_attn.varlen_attention(q.astype(np.float32), kc, vc, cq, None, 2, 4,
                                       seqused_k=np.array([4, 4], np.int32), block_table=table)


def test_compiled_backward_with_sequences_without_keys():
    """A sequence of no keys (GQA) in the custom op's CPU backward: its rows get no gradient (and no crash)."""
    torch = pytest.importorskip("torch")
    from cupy_attn import torch_ops
    q, k, v, cq, ck = _packed([5, 3, 4], [5, 0, 6], Hq=4, Hkv=2)
    leaves = [torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in (q, k, v)]
    out = torch_ops.varlen_attention(*leaves, torch.tensor(cq), torch.tensor(ck), 5, 6, is_causal=True)
    dq, dk, dv = torch.autograd.grad(out.sum(), leaves)
    assert (dq[5:8] == 0).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all()
    eager = [torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in (q, k, v)]
    want = torch.autograd.grad(cupy_attn.varlen_attention(*eager, torch.tensor(cq), torch.tensor(ck), 5, 6,
                                                          is_causal=True).sum(), eager)
    for a, b in zip((dq, dk, dv), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(), dict(window_size=(9, 0), softcap=3.0),
                                dict(sinks=np.array([0.2, -0.5, 1.0, 0.0]),
                                     alibi_slopes=np.linspace(0.1, 0.4, 12).reshape(3, 4))])
def test_bucketed_backward_equals_per_sequence(kw):
    """Causal self-attention sequences: the backward on padded dense buckets (varlen.backward_buckets) gives the
    per-sequence gradients (float64 reference paths; through the custom op, whose backward is backward_sequences)."""
    torch = pytest.importorskip("torch")
    from cupy_attn import torch_ops
    from cupy_attn.attention import varlen as vl
    lens = [5, 0, 140]
    q, k, v, cq, ck = _packed(lens, lens, Hq=4, Hkv=2, extra_q=2)
    assert vl.buckets([(int(cq[b]), n, int(ck[b]), n) for b, n in enumerate(lens)]) == [[2], [0]]
    extra = {name: torch.tensor(x, dtype=torch.float32) for name, x in kw.items() if isinstance(x, np.ndarray)}
    flags = {name: x for name, x in kw.items() if not isinstance(x, np.ndarray)}

    def grads(fn):
        leaves = [torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in (q, k, v)]
        sinks = extra.get("sinks")
        sinks = None if sinks is None else sinks.clone().requires_grad_()
        out = fn(*leaves, torch.tensor(cq), torch.tensor(ck), 140, 140, is_causal=True, sinks=sinks,
                 alibi_slopes=extra.get("alibi_slopes"), **flags)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        return torch.autograd.grad(out, leaves + ([sinks] if sinks is not None else []), g)
    for a, b in zip(grads(torch_ops.varlen_attention), grads(cupy_attn.varlen_attention)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_explain_varlen(monkeypatch):
    q, k, v, cq, ck = (x.astype(np.float32) if x.dtype == np.float64 else x
                       for x in _packed([3, 2], [3, 2], E=64, Ev=64))
    plan = cupy_attn.explain_varlen(q, k, v, cq, ck, 3, 3, is_causal=True)
    assert plan.backend == "per-sequence" and "CPU inputs" in plan.reason and "2, each a dense" in str(plan)
    monkeypatch.setattr(varlen, "fused_reason", lambda vp, backend: None)  # as on an H200 with fp16 inputs
    plan = cupy_attn.explain_varlen(q, k, v, cq, ck, 3, 3, is_causal=True, window_size=(8, 0))
    text = str(plan)
    assert plan.backend == "packed" and "head-dim bucket: 64" in text and "window (8, 0)" in text, text
    with pytest.raises(ValueError, match="cu_seqlens_k must have shape"):
        cupy_attn.explain_varlen(q, k, v, cq, ck[:2], 3, 3)


def test_mods_on_the_cpu_index_sequences():
    """score_mod / mask_mod in varlen_attention: b is the sequence, q_idx and kv_idx count within it (the reference
    with the mods' Python forms); a document-style mask by sequence index and a bias by position."""
    import cupy_attn
    rng = np.random.default_rng(4)
    lens = [5, 9, 3]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v = (rng.standard_normal((sum(lens), 4, 8)).astype(np.float32) for _ in range(3))
    bias = np.array([0.5, -1.0, 2.0], np.float32)
    mod = cupy_attn.AttentionMod(
        score_mod="return score + aux.bias[b] * float(q_idx - kv_idx);", mask_mod="return kv_idx != 1;",
        reference_score_mod=lambda s, b, h, i, j, aux: s + aux.bias[b] * (i - j),
        reference_mask_mod=lambda b, h, i, j, aux: j != 1)
    out = cupy_attn.varlen_attention(q, k, v, cu, cu, 9, 9, is_causal=True, score_mod=mod, aux={"bias": bias})
    for b, (q0, n) in enumerate(zip(cu[:-1], lens)):
        s = slice(q0, q0 + n)
        want = reference.scaled_dot_product_attention(
            q[s].swapaxes(0, 1), k[s].swapaxes(0, 1), v[s].swapaxes(0, 1), is_causal=True,
            score_mod=lambda x, bb, h, i, j, b=b: x + bias[b] * (i - j), mask_mod=lambda bb, h, i, j: j != 1)
        np.testing.assert_allclose(out[s], want.swapaxes(0, 1), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="Python form"):
        cupy_attn.varlen_attention(q, k, v, cu, cu, 9, 9, mask_mod="return true;")


def test_packed_backward_kernel_is_the_default_without_window_softcap_or_alibi(monkeypatch):
    """CUPY_ATTN_VARLEN_BWD unset: the packed Hopper backward for calls without a window, softcap or ALiBi (sinks and
    GQA allowed); =kernel always; =dense never."""
    import types
    from cupy_attn.attention import variants as _v
    from cupy_attn.attention import varlen as vl
    monkeypatch.delenv("CUPY_ATTN_VARLEN_BWD", raising=False)
    plain, sinks = (types.SimpleNamespace(variants=_v.Variants(sinks=s)) for s in (None, np.zeros(4, np.float32)))
    window = types.SimpleNamespace(variants=_v.Variants(window_left=8, window_right=0))
    capped = types.SimpleNamespace(variants=_v.Variants(softcap=5.0))
    assert vl.kernel_backward_default(plain) and vl.kernel_backward_default(sinks)
    assert not vl.kernel_backward_default(window) and not vl.kernel_backward_default(capped)
    monkeypatch.setenv("CUPY_ATTN_VARLEN_BWD", "kernel")
    assert vl.kernel_backward_default(window)
    monkeypatch.setenv("CUPY_ATTN_VARLEN_BWD", "dense")
    assert not vl.kernel_backward_default(plain)
