"""Float64 NumPy references: the ground truth every kernel is tested against, and the CPU path of the public API.

Slow by design (the full score matrix in float64); use them for checking, not for work.
"""
from __future__ import annotations

import numpy as np

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


def causal_keep(seqlen_q: int, seqlen_k: int, alignment: str = "top_left") -> np.ndarray:
    """(seqlen_q, seqlen_k) bool: True where query i may attend key j.

    top_left (torch's ``is_causal``): j <= i, i.e. ``tril(ones(L, S))``.
    bottom_right (FlashAttention's, for KV caches): j <= i + (S - L), the last query sees every key.
    """
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal alignment must be one of {CAUSAL_ALIGNMENTS}, got {alignment!r}")
    offset = 0 if alignment == "top_left" else seqlen_k - seqlen_q
    return np.tri(seqlen_q, seqlen_k, k=offset, dtype=bool)


def scaled_dot_product_attention(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                                 return_lse=False):
    """softmax(scale · Q Kᵀ + mask) V in float64, with torch's semantics.

    Shapes: query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev); Hkv == Hq unless enable_gqa, where
    query head h reads key/value head h // (Hq // Hkv). attn_mask broadcastable to (..., Hq, L, S): bool (True = take
    part) or float (added to the scaled scores). is_causal: False, True / "top_left", or "bottom_right".
    scale defaults to 1/sqrt(E). Rows with every key masked give output 0 and lse -inf; NaN/Inf propagate.

    Returns out (..., Hq, L, Ev) float64, and lse (..., Hq, L) float64 (natural log) when return_lse.
    """
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    seqlen_q, seqlen_k = q.shape[-2], k.shape[-2]
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    if enable_gqa and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k = np.repeat(k, groups, axis=-3)
        v = np.repeat(v, groups, axis=-3)
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if is_causal:
        alignment = "top_left" if is_causal is True else is_causal
        s = np.where(causal_keep(seqlen_q, seqlen_k, alignment), s, -np.inf)
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + mask.astype(np.float64)
    m = np.max(s, axis=-1, keepdims=True)
    m_safe = np.where(m == -np.inf, 0.0, m)          # a fully masked row has max -inf; exp(-inf - 0) = 0 keeps it 0
    p = np.exp(s - m_safe)
    denom = p.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(denom == 0, 0.0, (p @ v) / denom)
        lse = (m_safe + np.log(denom))[..., 0]
    return (out, lse) if return_lse else out
