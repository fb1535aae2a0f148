"""Philox4x32-10 and the attention-dropout keep mask in NumPy: the definition every dropout kernel reproduces bit for
bit.

Philox4x32-10 (Salmon, Moraes, Dror, Shaw 2011, "Parallel random numbers: as easy as 1, 2, 3", the Random123 library)
is a counter-based generator: 4 uint32 outputs are a pure function of a 128-bit counter and a 64-bit key, so any
thread can draw the numbers of any element without a generator state. cuda_src/common/philox.cuh is its device twin.

The keep mask of attention dropout (``scaled_dot_product_attention(dropout_p=p)``), per call, from the call's random
pair rng = (seed, offset) (two int64 drawn per call, see cupy_attn/attention/dropout.py): element (bh, i, j) of the
probabilities, where bh is the flat index of the query's leading axes (b·Hq + h for (B, Hq, L, S)), i the query row
and j the key column, uses

    key      = (seed mod 2^32, (seed >> 32) mod 2^32)
    counter  = (j >> 1, i >> 1, bh, offset mod 2^32)
    r        = philox4x32_10(counter, key)[2·(i & 1) + (j & 1)]        one Philox block covers a 2×2 tile of P
    keep     = r < dropout_threshold(p)

and kept probabilities are scaled by dropout_scale(p) = 1/(1 − p). The 2×2 tile serves both fused kernels at full
use of the four outputs: the forward's lanes hold pairs of adjacent columns of a row, the backward's (Sᵀ) pairs of
adjacent rows of a column, and the other half of each tile sits in the lane four apart (one shuffle).
"""
from __future__ import annotations

import numpy as np

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments (golden ratio, sqrt(3) - 1)
ROUNDS = 10

_U32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Philox4x32 with 10 rounds, vectorized: ``counter`` four uint32 arrays (broadcast together), ``key`` two uint32
    (arrays or scalars). Returns the four output words as uint32 arrays of the broadcast shape.

    Each round: (hi0, lo0) = M0·c0, (hi1, lo1) = M1·c2 (64-bit products); c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);
    the key gains (W0, W1) between rounds (Random123's philox4x32round / bumpkey).
    """
    c0, c1, c2, c3 = np.broadcast_arrays(*(np.asarray(c, dtype=np.uint64) & _U32 for c in counter))
    k0, k1 = (np.uint64(int(k) & 0xFFFFFFFF) if np.isscalar(k) else np.asarray(k, dtype=np.uint64) & _U32
              for k in key)
    m0, m1, w0, w1 = (np.uint64(x) for x in (PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1))
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + w0) & _U32, (k1 + w1) & _U32
        p0, p1 = m0 * c0, m1 * c2  # < 2^64: exact in uint64
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _U32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _U32
    return tuple(x.astype(np.uint32) for x in (c0, c1, c2, c3))


def dropout_threshold(p: float) -> int:
    """The uint32 keep threshold of dropout probability p in [0, 1]: a draw r is kept when r < threshold, so an
    element survives with probability threshold / 2^32 = 1 − p to within 2^-32. round((1 − p)·2^32), clamped to
    2^32 − 1 (p = 0 keeps every draw but 0xFFFFFFFF); p = 1 gives 0 (nothing kept)."""
    return min(int((1.0 - float(p)) * 4294967296.0 + 0.5), 0xFFFFFFFF)


def dropout_scale(p: float) -> float:
    """The factor of kept probabilities, 1/(1 − p); 0 for p = 1, where nothing is kept (no 0·inf NaN)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - float(p))


def keep_mask(seed: int, offset: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """The dropout keep mask (bool, True = kept) of one call: ``shape`` = (..., Hq, L, S), the scores' shape (leading
    axes flattened into bh), ``seed``/``offset`` the call's rng pair (Python ints, int64 values), p = dropout_p.

    Memory: ~40 bytes per element while computing (use it for test-sized shapes).
    """
    *lead, L, S = shape
    bh = int(np.prod(lead, dtype=np.int64))
    seed, offset = int(seed) & 0xFFFFFFFFFFFFFFFF, int(offset) & 0xFFFFFFFF
    key = (seed & 0xFFFFFFFF, seed >> 32)
    L2, S2 = (L + 1) // 2, (S + 1) // 2
    out = np.empty((bh, 2 * L2, 2 * S2), dtype=bool)
    if out.size:
        threshold = np.uint32(dropout_threshold(p))
        r = philox4x32_10((np.arange(S2, dtype=np.uint64)[None, None, :], np.arange(L2, dtype=np.uint64)[None, :, None],
                           np.arange(bh, dtype=np.uint64)[:, None, None], offset), key)
        for idx, word in enumerate(r):  # word 2·(i & 1) + (j & 1)
            out[:, idx >> 1::2, idx & 1::2] = word < threshold
    return out[:, :L, :S].reshape(shape)
