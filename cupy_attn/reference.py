"""Float64 NumPy references: the ground truth every kernel is tested against, and the CPU path of the public API.

Slow by design (the full score matrix in float64); use them for checking, not for work.
"""
from __future__ import annotations

import numpy as np

from . import philox

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


def window_bounds(window_size) -> tuple[int | None, int | None]:
    """``window_size`` as (left, right) with None for an unbounded side: None, or a pair whose entries are None or
    negative (FlashAttention's -1), mean unbounded. ValueError for anything else."""
    if window_size is None:
        return None, None
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    out = []
    for name, w in (("left", left), ("right", right)):
        if w is None:
            out.append(None)
        elif isinstance(w, (int, np.integer)) and not isinstance(w, bool):
            out.append(None if w < 0 else int(w))
        else:
            raise ValueError(f"window_size {name} must be an int >= 0, or None / -1 for unbounded, got {w!r}")
    return out[0], out[1]


def visible_keys(seqlen_q: int, seqlen_k: int, is_causal=False, window_size=None) -> np.ndarray:
    """(seqlen_q, seqlen_k) bool: True where query i sees key j under the causal mask and the sliding window.

    is_causal: False; True / "top_left" (torch's): j <= i; "bottom_right" (FlashAttention's): j <= i + S - L.
    window_size (left, right), bottom-right aligned as FlashAttention's: i + S - L - left <= j <= i + S - L + right,
    None or -1 leaving a side unbounded. Both apply when both are given (their intersection).
    """
    keep = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if is_causal:
        keep &= causal_keep(seqlen_q, seqlen_k, "top_left" if is_causal is True else is_causal)
    left, right = window_bounds(window_size)
    if left is not None or right is not None:
        diag = np.arange(seqlen_k)[None, :] - np.arange(seqlen_q)[:, None] - (seqlen_k - seqlen_q)  # j - (i + S - L)
        if left is not None:
            keep &= diag >= -left
        if right is not None:
            keep &= diag <= right
    return keep


def alibi_bias(slopes, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """ALiBi (Press et al. 2022) with FlashAttention's convention: bias[..., h, i, j] = -slopes[..., h] ·
    |i + S - L - j|, added to the scaled (and soft-capped) scores. slopes (..., Hq) -> bias (..., Hq, L, S) float64."""
    slopes = np.asarray(slopes, dtype=np.float64)
    dist = np.abs(np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q) - np.arange(seqlen_k)[None, :])
    return -slopes[..., None, None] * dist


def scaled_dot_product_attention(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                                 return_lse=False, dropout_p=0.0, dropout_mask=None, *, window_size=None,
                                 softcap=None, sinks=None, alibi_slopes=None, score_mod=None, mask_mod=None):
    """softmax(scale · Q Kᵀ + mask) V in float64, with torch's semantics (dropout included) and FlashAttention's
    variants (sliding window, softcap, sinks, ALiBi), and FlexAttention-style mods.

    Per row i of a head, with s_j = scale · q_i·k_j:
        s_j <- c · tanh(s_j / c)                   softcap=c (Gemma 2), first
        s_j <- s_j - slope_h · |i + S - L - j|     alibi_slopes (FlashAttention's ALiBi)
        s_j <- score_mod(s_j, b, h, i, j)          score_mod (see mod_indices for b, h, i, j)
        s_j <- -inf where key j is not visible     is_causal, window_size (see visible_keys), bool attn_mask,
                                                   mask_mod(b, h, i, j) false;
        s_j <- s_j + attn_mask[i, j]               float attn_mask
        out_i = Σ_j e^(s_j) v_j / (Σ_j e^(s_j) + e^(sink_h)),  lse_i = log(Σ_j e^(s_j) + e^(sink_h))
    where the sink term is present only with ``sinks`` (one logit per query head, gpt-oss's learned sinks: it takes
    part in the denominator and adds nothing to the output). Rows with no visible key give output 0 and lse -inf
    (lse = sink_h with sinks); NaN/Inf propagate.

    Shapes: query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev); Hkv == Hq unless enable_gqa, where
    query head h reads key/value head h // (Hq // Hkv). attn_mask broadcastable to (..., Hq, L, S): bool (True = take
    part) or float (added to the scaled scores). is_causal: False, True / "top_left", or "bottom_right".
    window_size: None or (left, right), each an int >= 0 or None / -1 (unbounded). softcap: None or c > 0.
    sinks: None or (Hq,) (broadcastable to (..., Hq)), natural-log logits. alibi_slopes: None or broadcastable to
    (..., Hq), e.g. (Hq,) or (B, Hq). scale defaults to 1/sqrt(E).
    Rows with every key masked, and every row when S = 0, give output 0 and lse -inf (lse = the sink with sinks);
    NaN/Inf propagate. Empty axes give empty results (B, H or L = 0), as torch's.
    dropout_p > 0 needs ``dropout_mask``, the keep mask (bool, broadcastable to (..., Hq, L, S); True = kept, e.g.
    philox.keep_mask for a call's rng pair): out = (P ∘ Z / (1 − dropout_p)) V with P the softmax (torch's dropout of
    the attention weights), out = 0 for dropout_p = 1; lse is that of the undropped scores.
    dtypes: anything ``np.asarray`` reads as numbers (bf16 as ml_dtypes.bfloat16 included), computed in float64.

    Returns out (..., Hq, L, Ev) float64, and lse (..., Hq, L) float64 (natural log) when return_lse.
    Raises: ValueError for a malformed window_size, and what NumPy raises for shapes that do not broadcast or multiply;
    the other arguments are not checked here (``cupy_attn.scaled_dot_product_attention`` checks them, naming each).
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
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, seqlen_q, seqlen_k)
    s = apply_mods(s, score_mod, mask_mod, np)
    if is_causal or window_size is not None:
        s = np.where(visible_keys(seqlen_q, seqlen_k, is_causal, window_size), s, -np.inf)
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + mask.astype(np.float64)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)  # S = 0: every row sees no key, max -inf
    sink = None
    if sinks is not None:
        sink = np.broadcast_to(np.asarray(sinks, dtype=np.float64)[..., None, None], m.shape)
        m = np.maximum(m, sink)
    m_safe = np.where(m == -np.inf, 0.0, m)          # a fully masked row has max -inf; exp(-inf - 0) = 0 keeps it 0
    p = np.exp(s - m_safe)
    denom = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + np.exp(sink - m_safe)
    if dropout_p > 0:
        if dropout_mask is None:
            raise ValueError("dropout_p > 0 needs dropout_mask (the keep mask, e.g. philox.keep_mask)")
        p = np.where(np.asarray(dropout_mask, dtype=bool), p * philox.dropout_scale(dropout_p), 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(denom == 0, 0.0, (p @ v) / denom)
        lse = (m_safe + np.log(denom))[..., 0]
    return (out, lse) if return_lse else out


def mod_indices(shape: tuple, xp=np):
    """(b, h, q_idx, kv_idx) index arrays broadcasting against scores of ``shape`` (..., Hq, L, S): b the flat batch
    index over the leading axes (row-major), h the head, q_idx the query row, kv_idx the key (int64, NumPy or
    torch as ``xp``).

    >>> [tuple(x.shape) for x in mod_indices((2, 3, 4, 5, 6))]
    [(2, 3, 1, 1, 1), (1, 1, 4, 1, 1), (1, 1, 1, 5, 1), (1, 1, 1, 1, 6)]
    """
    lead, (H, L, S) = shape[:-3], shape[-3:]
    n = len(lead)
    arange = xp.arange
    b = arange(int(np.prod(lead, dtype=np.int64))).reshape(tuple(lead) + (1, 1, 1))
    h = arange(H).reshape((1,) * n + (H, 1, 1))
    q = arange(L).reshape((1,) * n + (1, L, 1))
    kv = arange(S).reshape((1,) * n + (1, 1, S))
    return b, h, q, kv


def apply_mods(s, score_mod, mask_mod, xp=np):
    """Scores (..., Hq, L, S) through a score_mod(score, b, h, q_idx, kv_idx) and a mask_mod(b, h, q_idx, kv_idx)
    (either None), Python callables on broadcast arrays (:func:`mod_indices`): masked keys become -inf."""
    if score_mod is None and mask_mod is None:
        return s
    b, h, q, kv = mod_indices(tuple(s.shape), xp)
    if score_mod is not None:
        s = score_mod(s, b, h, q, kv)
    if mask_mod is not None:
        s = xp.where(mask_mod(b, h, q, kv), s, -xp.inf)
    return s


def scaled_dot_product_attention_backward(query, key, value, out, lse, grad_out, is_causal=False, scale=None,
                                          enable_gqa=False, *, window_size=None, softcap=None, sinks=None,
                                          alibi_slopes=None, dropout_p=0.0, dropout_mask=None, mask_mod=None):
    """The gradients of :func:`scaled_dot_product_attention` (no mask, no dropout) in float64, from the forward's
    out and lse (FlashAttention-2's backward, Dao 2023, §3.2, in exact arithmetic):

        P = exp(s − lse) over the visible keys (s the scores after softcap and ALiBi), D_i = Σ_d dO_id O_id,
        dV = Pᵀ dO,  dS = P ∘ (dO Vᵀ − D),  dS_raw = dS ∘ (1 − tanh²(scale·q·k / c)) (softcap c),
        with dropout (keep mask Z, dropout_mask): P ∘ Z / (1 − p) in dV and dO Vᵀ ∘ Z / (1 − p) in dS (D from out,
        which carries the dropout),
        dQ = scale · dS_raw K,  dK = scale · dS_rawᵀ Q,  dsink_h = −Σ_i exp(sink_h − lse_i) D_i.

    Shapes as the forward's (out (..., Hq, L, Ev), lse (..., Hq, L), grad_out like out); GQA gradients of K and V
    are summed over each group's query heads. Rows with lse = −inf (no visible key, no sink) contribute nothing.
    mask_mod: a Python mask_mod(b, h, i, j) as the forward's (keys it hides take no part).
    Returns (dq, dk, dv, dsinks) float64, dsinks None without sinks.
    """
    q, k, v, o, do = (np.asarray(x, dtype=np.float64) for x in (query, key, value, out, grad_out))
    lse = np.asarray(lse, dtype=np.float64)
    L, S = q.shape[-2], k.shape[-2]
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    groups = q.shape[-3] // k.shape[-3] if enable_gqa and q.ndim >= 3 else 1
    ke, ve = (np.repeat(x, groups, axis=-3) if groups > 1 else x for x in (k, v))
    raw = (q @ np.swapaxes(ke, -1, -2)) * scale
    s, cap_grad = raw, 1.0
    if softcap is not None:
        t = np.tanh(raw / softcap)
        s, cap_grad = softcap * t, 1.0 - t * t
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, L, S)
    keep = visible_keys(L, S, is_causal, window_size) if (is_causal or window_size is not None) else True
    if mask_mod is not None:  # as the forward's (apply_mods): keys it hides take no part
        keep = keep & np.broadcast_to(np.asarray(mask_mod(*mod_indices(raw.shape)), dtype=bool), raw.shape)
    finite = np.isfinite(lse)[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(keep & finite, np.exp(s - np.where(finite, lse[..., None], 0.0)), 0.0)
    d = (do * o).sum(-1)
    z = 1.0
    if dropout_p > 0:
        if dropout_mask is None:
            raise ValueError("dropout_p > 0 needs dropout_mask (the forward's keep mask)")
        z = np.asarray(dropout_mask, dtype=np.float64) * philox.dropout_scale(dropout_p)
    dv = np.swapaxes(p * z, -1, -2) @ do
    ds = p * ((do @ np.swapaxes(ve, -1, -2)) * z - d[..., None]) * cap_grad
    dq = (ds @ ke) * scale
    dk = (np.swapaxes(ds, -1, -2) @ q) * scale
    if groups > 1:
        hkv = k.shape[-3]
        dk = dk.reshape(dk.shape[:-3] + (hkv, groups) + dk.shape[-2:]).sum(-3)
        dv = dv.reshape(dv.shape[:-3] + (hkv, groups) + dv.shape[-2:]).sum(-3)
    dsinks = None
    if sinks is not None:
        sk = np.asarray(sinks, dtype=np.float64)
        w = np.where(finite[..., 0], np.exp(sk[..., None] - np.where(finite[..., 0], lse, 0.0)), 0.0)
        dsinks = -(w * d).reshape((-1,) + w.shape[-2:]).sum((0, 2))
    return dq, dk, dv, dsinks


def varlen_sequences(cu_seqlens_q, cu_seqlens_k=None, seqused_k=None) -> list[tuple[int, int, int, int]]:
    """(q0, L, k0, S) per sequence of a packed batch: query rows q0 ... q0 + L − 1 and keys k0 ... k0 + S − 1, with
    L = cu_seqlens_q[b+1] − cu_seqlens_q[b], k0 = cu_seqlens_k[b] (0 without cu_seqlens_k: a paged cache), and S =
    seqused_k[b] where given, else cu_seqlens_k[b+1] − cu_seqlens_k[b].

    >>> varlen_sequences([0, 3, 3, 7], [0, 5, 6, 6])
    [(0, 3, 0, 5), (3, 0, 5, 1), (3, 4, 6, 0)]
    >>> varlen_sequences([0, 1, 2], None, [9, 4])
    [(0, 1, 0, 9), (1, 1, 0, 4)]
    """
    cq = [int(x) for x in np.asarray(cu_seqlens_q)]
    ck = None if cu_seqlens_k is None else [int(x) for x in np.asarray(cu_seqlens_k)]
    used = None if seqused_k is None else [int(x) for x in np.asarray(seqused_k)]
    seqs = []
    for b in range(len(cq) - 1):
        k0 = 0 if ck is None else ck[b]
        S = used[b] if used is not None else ck[b + 1] - ck[b]
        seqs.append((cq[b], cq[b + 1] - cq[b], k0, S))
    return seqs


def paged_keys(cache, block_table_row, seqlen: int) -> np.ndarray:
    """The first ``seqlen`` rows of a paged cache (num_blocks, block_size, H, D) in the order of one sequence's block
    table row: rows j = page block_table_row[j // block_size], slot j % block_size.

    >>> c = np.arange(12).reshape(3, 2, 1, 2)        # 3 pages of 2 slots
    >>> paged_keys(c, [2, 0, 1], 3)[:, 0, 0].tolist()  # page 2's slots, then page 0's first
    [8, 10, 0]
    """
    c = np.asarray(cache)
    bs = c.shape[1]
    pages = [int(x) for x in np.asarray(block_table_row)[: -(-seqlen // bs) if seqlen else 0]]
    rows = c[pages].reshape((-1,) + c.shape[2:]) if pages else c[:0].reshape((0,) + c.shape[2:])
    return rows[:seqlen]


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, seqused_k=None, block_table=None, is_causal=False,
                     scale=None, window_size=None, softcap=None, sinks=None, alibi_slopes=None, return_lse=False,
                     score_mod=None, mask_mod=None):
    """Attention over a packed batch of sequences (FlashAttention's varlen layout) in float64: each sequence b attends
    to its own keys only, as :func:`scaled_dot_product_attention` of that sequence with causal masks and windows
    bottom-right aligned (FlashAttention's ``causal=True``).

    Shapes: q (total_q, Hq, E); k, v (total_k, Hkv, E | Ev), or with ``block_table`` paged caches (num_blocks,
    block_size, Hkv, E | Ev); cu_seqlens_q (B + 1,) and cu_seqlens_k (B + 1,) (None with a block table) as
    :func:`varlen_sequences` reads them; seqused_k (B,) or None; block_table (B, max_blocks) (:func:`paged_keys`).
    alibi_slopes (Hq,) or (B, Hq); sinks (Hq,). Hq a multiple of Hkv (GQA). score_mod / mask_mod: as
    :func:`scaled_dot_product_attention`'s, with b the sequence index and q_idx, kv_idx counted within the sequence.

    Returns out (total_q, Hq, Ev) float64, rows no sequence covers 0; and lse (Hq, total_q) (natural log; −inf on
    those rows) when return_lse.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    total_q, Hq, _ = q.shape
    Hkv, Ev = v.shape[-2], v.shape[-1]
    out = np.zeros((total_q, Hq, Ev))
    lse = np.full((Hq, total_q), -np.inf)
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, dtype=np.float64)
    for b, (q0, L, k0, S) in enumerate(varlen_sequences(cu_seqlens_q, cu_seqlens_k, seqused_k)):
        if L == 0:
            continue
        if block_table is None:
            kb, vb = k[k0:k0 + S], v[k0:k0 + S]
        else:
            row = np.asarray(block_table)[b]
            kb, vb = paged_keys(k, row, S), paged_keys(v, row, S)
        sl = None if slopes is None else (slopes[b] if slopes.ndim == 2 else slopes)
        sm = None if score_mod is None else (lambda s_, b_, h, i, j, b=b: score_mod(s_, b_ + b, h, i, j))
        mm = None if mask_mod is None else (lambda b_, h, i, j, b=b: mask_mod(b_ + b, h, i, j))
        o, l = scaled_dot_product_attention(
            np.swapaxes(q[q0:q0 + L], 0, 1), np.swapaxes(kb, 0, 1), np.swapaxes(vb, 0, 1),
            is_causal="bottom_right" if is_causal else False, scale=scale, enable_gqa=Hq != Hkv, return_lse=True,
            window_size=window_size, softcap=softcap, sinks=sinks, alibi_slopes=sl, score_mod=sm, mask_mod=mm)
        out[q0:q0 + L] = np.swapaxes(o, 0, 1)
        lse[:, q0:q0 + L] = l
    return (out, lse) if return_lse else out


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Merge two partial attention results over disjoint key sets of the same query rows, in float64:
    lse = log(e^lse_a + e^lse_b) and out = e^(lse_a − lse)·out_a + e^(lse_b − lse)·out_b, computed against
    m = max(lse_a, lse_b) (0 when both are −inf). A side with lse −inf takes no part; both −inf give out 0 and lse −inf;
    NaN propagates. Shapes: out_a, out_b (..., Ev), lse_a, lse_b (...) (FlashInfer's merge_state). Returns (out, lse)
    float64."""
    oa, ob = np.asarray(out_a, dtype=np.float64), np.asarray(out_b, dtype=np.float64)
    la, lb = np.asarray(lse_a, dtype=np.float64), np.asarray(lse_b, dtype=np.float64)
    m = np.maximum(la, lb)
    ref = np.where(m == -np.inf, 0.0, m)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        wa, wb = np.exp(la - ref), np.exp(lb - ref)
        total = wa + wb
        ca, cb = (np.where(total == 0, 0.0, w / total) for w in (wa, wb))
        return ca[..., None] * oa + cb[..., None] * ob, ref + np.log(total)


def linear_batchnorm_softmax(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, *, training,
                             momentum=0.1, eps=1e-5, num_batches_tracked=None):
    """``softmax(scale · BatchNorm1d(x · weightᵀ + bias), dim=1)`` in float64, with torch's train/eval semantics.

    Shapes: x (N, K), weight (F, K), bias (F,) or None, running_mean/running_var (F,) or both None, bn_weight/bn_bias
    (F,) or None, scale (1,), () or (F,); num_batches_tracked an int or None. Any numeric dtype, computed in float64.
    Batch statistics (mean, biased variance over axis 0) normalize when ``training`` or when there are no running
    stats; otherwise the running stats do. Pure: nothing is modified.

    Returns (out (N, F), running_mean, running_var, num_batches_tracked): the output and the updated running stats
    (unchanged inputs when not updated). In training with running stats: running_mean ← (1−m)·rm + m·mean,
    running_var ← (1−m)·rv + m·var·N/(N−1), num_batches_tracked + 1, m = momentum or 1/(num_batches_tracked + 1) when
    momentum is None. An empty batch only counts (torch leaves the stats alone). Raises ValueError for N == 1 with
    batch statistics, like torch.
    """
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    y = x @ w.T
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float64)
    n, f = y.shape
    rm = None if running_mean is None else np.asarray(running_mean, dtype=np.float64)
    rv = None if running_var is None else np.asarray(running_var, dtype=np.float64)
    nbt = num_batches_tracked
    use_batch = training or rm is None
    if use_batch and n == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {(n, f)}")
    if training and rm is not None:
        if nbt is not None:
            nbt = int(nbt) + 1
    if use_batch:
        if n == 0:
            return np.zeros((0, f)), rm, rv, nbt
        mean = y.mean(axis=0)
        var = y.var(axis=0)
        if training and rm is not None:
            m = momentum if momentum is not None else 1.0 / nbt
            rm = (1 - m) * rm + m * mean
            rv = (1 - m) * rv + m * var * n / (n - 1)
    else:
        mean, var = rm, rv
    z = (y - mean) / np.sqrt(var + eps)
    if bn_weight is not None:
        z = z * np.asarray(bn_weight, dtype=np.float64)
    if bn_bias is not None:
        z = z + np.asarray(bn_bias, dtype=np.float64)
    s = np.asarray(scale, dtype=np.float64).reshape(-1) * z
    s = s - s.max(axis=1, keepdims=True, initial=-np.inf)  # F = 0: an (N, 0) result
    p = np.exp(s)
    return p / p.sum(axis=1, keepdims=True), rm, rv, nbt


def linear_batchnorm_softmax_backward(grad_out, x, weight, out, y, mean, invstd, bn_weight, bn_bias, scale, *,
                                      use_batch_stats):
    """Gradients of :func:`linear_batchnorm_softmax` in float64, from what its forward computed.

    Shapes: grad_out, out (N, F) (out: the forward's result); x (N, K); weight (F, K); y (N, F) = x·weightᵀ without
    the Linear bias; mean, invstd (F,): the bias-free mean and 1/sqrt(var + eps) the forward normalized with (batch
    statistics of y, or running_mean − bias and the running variance); bn_weight, bn_bias (F,) or None; scale (1,),
    () or (F,). use_batch_stats: the forward normalized with batch statistics (training, or no running stats), so the
    gradient also flows through the batch mean and variance. Any numeric dtype, computed in float64.

    Math (ŷ = (y − mean)·invstd, z = scale·(γ·ŷ + β), out = softmax(z, dim=1); the BatchNorm training backward of
    Ioffe & Szegedy 2015, §3):
        dz       = out ∘ (grad_out − rowsum(grad_out ∘ out) / rowsum(out))   softmax (rowsum(out) = 1 up to out's
                                                                     rounding; dividing keeps Σ_f dz = 0)
        A_f      = Σ_n dz[n, f],   B_f = Σ_n dz[n, f]·ŷ[n, f]
        dβ       = scale·A,  dγ = scale·B,  dscale_f = γ_f·B_f + β_f·A_f   (summed over f for a one-element scale)
        dy       = c·(dz − A/N − ŷ·B/N) with batch statistics, c·dz with running ones;  c = γ·scale·invstd
        dx = dy·weight,  dweight = dyᵀ·x,  dbias = Σ_n dy   (0 up to rounding with batch statistics: Σ_n ŷ = 0)

    Returns a dict with keys x, weight, bias, bn_weight, bn_bias, scale: float64 arrays in each argument's shape
    (bias, bn_weight, bn_bias: (F,); scale: scale's shape).
    """
    g, o = (np.asarray(a, dtype=np.float64) for a in (grad_out, out))
    x, w, y = (np.asarray(a, dtype=np.float64) for a in (x, weight, y))
    n, f = o.shape
    mean, invstd = (np.asarray(a, dtype=np.float64).reshape(f) for a in (mean, invstd))
    gamma = np.ones(f) if bn_weight is None else np.asarray(bn_weight, dtype=np.float64)
    beta = np.zeros(f) if bn_bias is None else np.asarray(bn_bias, dtype=np.float64)
    scale_in = np.asarray(scale, dtype=np.float64)
    s = np.broadcast_to(scale_in.reshape(-1), (f,))
    dz = o * (g - (g * o).sum(axis=1, keepdims=True) / o.sum(axis=1, keepdims=True))
    yh = (y - mean) * invstd
    a_sum, b_sum = dz.sum(axis=0), (dz * yh).sum(axis=0)
    c = gamma * s * invstd
    dy = c * (dz - a_sum / n - yh * b_sum / n) if use_batch_stats else c * dz
    dscale = gamma * b_sum + beta * a_sum
    dscale = dscale.reshape(scale_in.shape) if scale_in.size == f and f > 1 else np.full(scale_in.shape, dscale.sum())
    return {"x": dy @ w, "weight": dy.T @ x, "bias": dy.sum(axis=0), "bn_weight": s * b_sum, "bn_bias": s * a_sum,
            "scale": dscale}
