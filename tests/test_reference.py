"""The float64 NumPy reference against direct, loop-based formulas (CPU)."""
import numpy as np
import pytest

from cupy_attn import reference


def _direct(q, k, v, scale, keep=None, add=None):
    """Row by row, exactly as written on paper: softmax over visible keys, 0 for rows with none."""
    *lead, L, E = q.shape
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for idx in np.ndindex(*lead):
        for i in range(L):
            s = np.array([scale * np.dot(q[idx][i], k[idx][j]) for j in range(k.shape[-2])])
            if add is not None:
                s = s + add[idx][i]
            vis = np.ones_like(s, bool) if keep is None else keep[idx][i]
            if not vis.any():
                continue
            w = np.where(vis, np.exp(s - s[vis].max()), 0.0)
            out[idx][i] = (w / w.sum()) @ v[idx]
    return out


@pytest.mark.parametrize("L,S,E,Ev", [(1, 1, 1, 1), (5, 7, 3, 2), (8, 3, 4, 6)])
def test_plain_and_lse(L, S, E, Ev):
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 3, L, E)), rng.standard_normal((2, 3, S, E)), rng.standard_normal((2, 3, S, Ev))
    out, lse = reference.scaled_dot_product_attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out, _direct(q, k, v, 1 / np.sqrt(E)), rtol=1e-12, atol=1e-12)
    s = (q @ np.swapaxes(k, -1, -2)) / np.sqrt(E)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-12)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L,S", [(3, 5), (5, 3), (4, 4)])
def test_causal_alignments(alignment, L, S):
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((1, 2, L, 4)), rng.standard_normal((1, 2, S, 4)), rng.standard_normal((1, 2, S, 3))
    keep = reference.causal_keep(L, S, alignment)
    offset = 0 if alignment == "top_left" else S - L
    assert all(keep[i, j] == (j <= i + offset) for i in range(L) for j in range(S))
    out = reference.scaled_dot_product_attention(q, k, v, is_causal=alignment)
    np.testing.assert_allclose(out, _direct(q, k, v, 0.5, keep=np.broadcast_to(keep, (1, 2, L, S))), atol=1e-12)


def test_bool_and_float_masks_broadcast_and_fully_masked_rows():
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((2, 2, 4, 3)), rng.standard_normal((2, 2, 6, 3)), rng.standard_normal((2, 2, 6, 5))
    keep = rng.random((2, 1, 1, 6)) > 0.4
    keep[1, 0, 0, :] = False  # batch 1: every key masked
    out, lse = reference.scaled_dot_product_attention(q, k, v, attn_mask=keep, return_lse=True)
    full = np.broadcast_to(keep, (2, 2, 4, 6))
    np.testing.assert_allclose(out, _direct(q, k, v, 1 / np.sqrt(3), keep=full), atol=1e-12)
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)
    add = rng.standard_normal((4, 6))
    out = reference.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=0.7)
    np.testing.assert_allclose(out, _direct(q, k, v, 0.7, add=np.broadcast_to(add, (2, 2, 4, 6))), atol=1e-12)


def test_gqa_repeats_kv_heads_in_order():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 6, 3, 4)), rng.standard_normal((1, 2, 5, 4)), rng.standard_normal((1, 2, 5, 4))
    out = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    expected = _direct(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), 0.5)
    np.testing.assert_allclose(out, expected, atol=1e-12)


def test_nan_propagates_like_torch():
    q, k, v = np.ones((1, 1, 2, 2)), np.ones((1, 1, 3, 2)), np.ones((1, 1, 3, 2))
    k[0, 0, 1, 0] = np.nan
    assert np.isnan(reference.scaled_dot_product_attention(q, k, v)).all()


def test_matches_torch_cpu_float64():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(9, 9, generator=g) > 0.3
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask}, {"scale": 0.3}):
        ref = reference.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(),
                                                     attn_mask=None if "attn_mask" not in kwargs else mask.numpy(),
                                                     is_causal=kwargs.get("is_causal", False),
                                                     scale=kwargs.get("scale"))
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
        np.testing.assert_allclose(ref, expected.numpy(), rtol=1e-10, atol=1e-12)


def _direct_variants(q, k, v, scale, *, causal=False, window=(None, None), softcap=None, sinks=None, slopes=None):
    """The variants row by row as written in the docstring: softcap, then ALiBi, then visibility, then the softmax
    whose denominator holds e^sink. Returns (out, lse)."""
    *lead, L, E = q.shape
    S = k.shape[-2]
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    lse = np.full(q.shape[:-1], -np.inf)
    left, right = window
    for idx in np.ndindex(*lead):
        h = idx[-1]
        for i in range(L):
            logits, vis = [], []
            for j in range(S):
                s = scale * np.dot(q[idx][i], k[idx][j])
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                if slopes is not None:
                    s -= slopes[h] * abs(i + S - L - j)
                ok = True
                if causal == "top_left":
                    ok &= j <= i
                elif causal == "bottom_right":
                    ok &= j <= i + S - L
                if left is not None:
                    ok &= j >= i + S - L - left
                if right is not None:
                    ok &= j <= i + S - L + right
                logits.append(s)
                vis.append(ok)
            terms = [np.exp(s) for s, ok in zip(logits, vis) if ok]
            if sinks is not None:
                terms.append(np.exp(sinks[h]))
            if not terms:
                continue
            denom = sum(terms)
            lse[idx][i] = np.log(denom)
            out[idx][i] = sum(np.exp(s) * v[idx][j] for j, (s, ok) in enumerate(zip(logits, vis)) if ok) / denom
    return out, lse


@pytest.mark.parametrize("L,S", [(6, 6), (4, 9), (9, 4)])
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("window", [(2, 0), (0, 0), (0, 3), (1, None), (None, 1), (100, 100), (-1, 2)])
def test_sliding_window(L, S, causal, window):
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 2, L, 4)), rng.standard_normal((1, 2, S, 4)), rng.standard_normal((1, 2, S, 3))
    out, lse = reference.scaled_dot_product_attention(q, k, v, is_causal=causal, window_size=window, return_lse=True)
    w = tuple(None if x is not None and x < 0 else x for x in window)
    ref_out, ref_lse = _direct_variants(q, k, v, 0.5, causal=causal, window=w)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12)
    assert np.all((lse == -np.inf) == ~reference.visible_keys(L, S, causal, window).any(-1))


def test_visible_keys_window_examples():
    # L = S: the window is centred on the diagonal; left=2, right=0 is causal with the 2 previous keys.
    keep = reference.visible_keys(5, 5, window_size=(2, 0))
    assert keep.sum(-1).tolist() == [1, 2, 3, 3, 3] and keep[4].tolist() == [False, False, True, True, True]
    # L < S, bottom-right: the last query row's window ends at the last key.
    assert reference.visible_keys(2, 6, window_size=(1, 0)).tolist() == [
        [False, False, False, True, True, False], [False, False, False, False, True, True]]
    # A window wider than S sees everything; (None, None) is no window.
    assert reference.visible_keys(3, 4, window_size=(10, 10)).all()
    assert reference.visible_keys(3, 4, window_size=(None, None)).all()
    with pytest.raises(ValueError, match="window_size"):
        reference.visible_keys(3, 4, window_size=(1.5, 0))
    with pytest.raises(ValueError, match="pair"):
        reference.visible_keys(3, 4, window_size=3)


@pytest.mark.parametrize("c", [0.5, 5.0, 50.0])
def test_softcap(c):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 5, 8)) * 4 for _ in range(3))  # |scores| >> c for the small caps
    out, lse = reference.scaled_dot_product_attention(q, k, v, softcap=c, return_lse=True, is_causal=True)
    ref_out, ref_lse = _direct_variants(q, k, v, 8 ** -0.5, causal="top_left", softcap=c)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12)


def test_sinks_with_fully_masked_rows():
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 3, 4, 4)), rng.standard_normal((2, 3, 6, 4)), rng.standard_normal((2, 3, 6, 2))
    sinks = np.array([-1.0, 0.5, 3.0])
    out, lse = reference.scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True)
    ref_out, ref_lse = _direct_variants(q, k, v, 0.5, sinks=sinks)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12)
    # The sink only adds to the denominator: the output is the plain output scaled by (1 - its weight).
    plain, plain_lse = reference.scaled_dot_product_attention(q, k, v, return_lse=True)
    w = np.exp(sinks[:, None] - lse)
    np.testing.assert_allclose(out, plain * (1 - w)[..., None], atol=1e-12)
    # Rows with no visible key: output 0, lse = the sink (its term alone in the denominator).
    keep = np.ones((2, 1, 4, 6), bool)
    keep[1, 0, 2] = False
    out, lse = reference.scaled_dot_product_attention(q, k, v, attn_mask=keep, sinks=sinks, return_lse=True)
    assert np.all(out[1, :, 2] == 0) and np.allclose(lse[1, :, 2], sinks)


def test_alibi_with_gqa_and_window():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 4, 5, 4))
    k, v = rng.standard_normal((2, 2, 7, 4)), rng.standard_normal((2, 2, 7, 3))
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    out, lse = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True, alibi_slopes=slopes,
                                                      window_size=(3, 1), softcap=2.0, return_lse=True)
    kk, vv = np.repeat(k, 2, axis=-3), np.repeat(v, 2, axis=-3)
    ref_out, ref_lse = _direct_variants(q, kk, vv, 0.5, slopes=slopes, window=(3, 1), softcap=2.0)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12)
    # (B, Hq) slopes: one row of slopes per batch item.
    per_batch = np.stack([slopes, 2 * slopes])
    out2 = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True, alibi_slopes=per_batch)
    np.testing.assert_allclose(out2[0], reference.scaled_dot_product_attention(
        q[:1], k[:1], v[:1], enable_gqa=True, alibi_slopes=slopes)[0], atol=1e-12)
    np.testing.assert_allclose(out2[1], reference.scaled_dot_product_attention(
        q[1:], k[1:], v[1:], enable_gqa=True, alibi_slopes=2 * slopes)[0], atol=1e-12)


@pytest.mark.parametrize("kw", [dict(), dict(is_causal="bottom_right", window_size=(3, 1)),
                                dict(softcap=2.0, sinks=np.array([0.5, -1.0, 0.0, 2.0])),
                                dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]), is_causal=True)])
def test_reference_backward_matches_autograd(kw):
    """scaled_dot_product_attention_backward against torch autograd of the same float64 math (GQA 4/2, L != S)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 4, 5, 8)), rng.standard_normal((2, 2, 7, 8)), rng.standard_normal((2, 2, 7, 6))
    do = rng.standard_normal((2, 4, 5, 6))
    out, lse = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
    dq, dk, dv, ds = reference.scaled_dot_product_attention_backward(q, k, v, out, lse, do, enable_gqa=True, **kw)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    ts = torch.tensor(kw["sinks"], requires_grad=True) if "sinks" in kw else None
    s = (tq @ tk.repeat_interleave(2, 1).transpose(-1, -2)) / np.sqrt(8)
    if "softcap" in kw:
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
    if "alibi_slopes" in kw:
        s = s + torch.from_numpy(reference.alibi_bias(kw["alibi_slopes"], 5, 7))
    keep = reference.visible_keys(5, 7, kw.get("is_causal", False), kw.get("window_size"))
    s = s.masked_fill(~torch.from_numpy(keep), float("-inf"))
    if ts is not None:
        s = torch.cat([s, ts.reshape(1, 4, 1, 1).expand(2, 4, 5, 1)], -1)
    p = torch.softmax(s, -1)
    o = (p[..., :7] if ts is not None else p) @ tv.repeat_interleave(2, 1)
    grads = torch.autograd.grad(o, [tq, tk, tv] + ([ts] if ts is not None else []), torch.from_numpy(do))
    for got, want in zip((dq, dk, dv, ds), grads):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-10)


def test_reference_backward_with_dropout_matches_autograd():
    torch = pytest.importorskip("torch")
    from cupy_attn import philox
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal(s) for s in ((1, 2, 6, 4), (1, 2, 7, 4), (1, 2, 7, 3), (1, 2, 6, 3)))
    keep = philox.keep_mask(123, 7, (1, 2, 6, 7), 0.3)
    out, lse = reference.scaled_dot_product_attention(q, k, v, is_causal="bottom_right", return_lse=True,
                                                      dropout_p=0.3, dropout_mask=keep)
    got = reference.scaled_dot_product_attention_backward(q, k, v, out, lse, do, "bottom_right", dropout_p=0.3,
                                                          dropout_mask=keep)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    s = (tq @ tk.transpose(-1, -2)) / 2.0
    s = s.masked_fill(~torch.from_numpy(reference.visible_keys(6, 7, "bottom_right")), float("-inf"))
    p = torch.softmax(s, -1) * torch.from_numpy(keep) / 0.7
    want = torch.autograd.grad(p @ tv, (tq, tk, tv), torch.from_numpy(do))
    for a, b in zip(got[:3], want):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-10)
