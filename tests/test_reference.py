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
