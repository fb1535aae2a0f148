"""The Hopper scores kernel (cupy_attn.attention.kernels.scores_sm90, cuda_src/attention/scores_sm90.cu): P = softmax(
scale · Q Kᵀ) in the input dtype and lse, whole rows on chip, S ≤ 512, in its three variants (one CTA per 64-row
block; scores_softmax_sm90_cluster2: CTA pairs sharing K by TMA multicast; scores_softmax_sm90_persistent); and the
split path's schedule that runs it before the cuBLAS P·V GEMM (CUPY_ATTN_SPLIT_FUSED unset or 3: persistent; 1 one
CTA per row block; 2 the cluster variant; 0 off).

CPU: every instantiation compiles for sm_90a without spills or ptxas performance warnings; its SASS holds HGMMA of the
tile's width, TMA loads, mbarrier operations, setmaxnreg and no local memory, and the cluster kernel multicast loads,
remote arrivals and cluster barriers (skipped without cuobjdump); the tile table fits shared memory; a lane-level
NumPy transcription of the kernel's epilogue (the wgmma accumulator layout, the −inf mask past S, the quad shuffles and
the shared-memory exchange between the two warpgroups, the stores) reproduces the float64 softmax and writes every
element of P[:L, :S] exactly once and nothing else; a step-by-step transcription of the TMA/mbarrier protocol (one
CTA, and a cluster of two) runs hazard-free under random interleavings, and catches deliberately broken protocols.
GPU (``gpu`` marker), both variants: the kernel alone on NaN-poisoned P (padding columns past S's 16-byte chunk and
rows past the last one must stay NaN) and lse against the float64 reference with tests/_helpers/_tolerance.py's rule (torch's
same-precision softmax(Q Kᵀ) as the comparison); and through cupy_attn.scaled_dot_product_attention with the switch
set (explain() names the kernel; a second call replays); causal in the kernel alone (pair tiles included) with every
element of P checked; large logits (|scale·q·k| up to ~100) through the public call.

    PYTHONPATH=. timeout 300 python3 -m pytest -m gpu tests/test_scores_sm90.py -x -k "smoke and cluster1"  # first
    PYTHONPATH=. timeout 300 python3 -m pytest -m gpu tests/test_scores_sm90.py -x -k "smoke and cluster2"
    PYTHONPATH=. timeout 1500 python3 -m pytest -m gpu tests/test_scores_sm90.py -x
"""
import numpy as np
import pytest

from cupy_attn.attention import checks
from cupy_attn.attention.kernels import scores_sm90 as _scores
from cupy_attn.runtime import compile_check

from _tolerance import as_f64, assert_close
from test_flash_fwd_sm90 import _bhsd, _cuobjdump, sass_summary, sass_text
from _compile_checks import assert_clean
from _launch_fake import FakeKernel, LaunchRecorder, assert_same_struct, blob

FAMILY = _scores.SCORES_SOFTMAX_SM90
DTYPES = ("float16", "bfloat16")

# ---------------------------------------------------------------------------------------------------------------------
# CPU


def test_every_instantiation_compiles_without_spills():
    reports = compile_check.compile_family(FAMILY, "sm_90a")
    masked_tiles = len(_scores.TILES) - len(_scores.MASKED_NOT_BUILT)
    assert len(reports) == (len(_scores.KERNELS) * len(_scores.TILES) + masked_tiles) * len(DTYPES)
    assert_clean(reports, max_registers=168)


def test_sass_has_wgmma_of_the_tile_width_tma_and_no_local_memory():
    """Every kernel: HGMMA of the tile's width, TMA loads, mbarriers, setmaxnreg, no local memory; P by TMA stores in
    the one-tile kernels, by 16-byte global stores (STG.E.128) in the persistent one.
    The cluster kernel (…_cluster2) also: K loads multicast (UTMALDG…MULTICAST), remote arrivals
    (SYNCS.ARRIVE…RED) and the cluster barrier (UCGABAR_ARV/UCGABAR_WAIT), with no MEMBAR in its mainloop (before
    the exit barrier's release arrives, where the remote arrivals must be performed, and in the proxy fence
    before P's TMA stores only); the one-CTA kernel none of them."""
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    cubin = compile_check.family_cubin(FAMILY, "sm_90a")
    kernels = sass_summary(cubin)
    listings = sass_text(cubin)
    assert len(kernels) == len(listings) == len(FAMILY.name_expressions())
    assert sum("_cluster2" in name for name in kernels) == len(DTYPES) * len(_scores.TILES)
    for name, ops in kernels.items():
        half_n = int(name.split("ELi")[0].split("Li")[-1])  # ..._sm90I6__halfLi256ELi3EE...: the first int argument
        text = listings[name]
        assert f"HGMMA.64x{half_n}x16.F32" in text, f"{name}: no HGMMA.64x{half_n}x16"
        persistent = "_persistent" in name
        for op in ("HGMMA", "UTMALDG", "SYNCS", "USETMAXREG") + (() if persistent else ("UTMASTG",)):
            assert ops.get(op, 0) > 0, f"{name}: no {op} in the SASS"
        if persistent:  # P from registers by 16-byte stores, no staging, no TMA store
            assert "STG.E.128" in text and "UTMASTG" not in ops, f"{name}: P not stored by 16-byte STG"
        for op in ("LDL", "STL"):
            assert op not in ops, f"{name}: local memory ({op}: {ops[op]})"
        cluster = "_cluster2" in name
        assert ("UTMALDG.4D.MULTICAST" in text) == cluster, f"{name}: multicast K loads iff the cluster kernel"
        assert ("SYNCS.ARRIVE.TRANS64.RED" in text) == cluster, f"{name}: remote arrivals iff the cluster kernel"
        assert (ops.get("UCGABAR_ARV", 0) == 3 and ops.get("UCGABAR_WAIT", 0) == 3) == cluster, \
            f"{name}: cluster barriers (init, consumers' exit, producers' exit) iff the cluster kernel"
        if cluster:
            assert ops.get("MEMBAR", 0) == 5, \
                f"{name}: MEMBAR.CTA+GPU before each exit arrive, MEMBAR.CTA in the proxy fence before P's TMA stores"


def test_launch_writes_the_struct_the_kernel_reads_cpu(monkeypatch):
    """build_launch's replay (one cuLaunchKernel on the launch's own parameter bytes): the kernel gets exactly the
    struct that filling a copy of ``params`` field by field gives (the three maps of the call's q, k, P and the lse
    pointer), the prepared grid, 384 threads, the tile's shared memory and the caller's stream; maps are encoded again
    and rewritten only when a base moves, and the lse word follows every call."""
    rec = LaunchRecorder(monkeypatch, _scores._PARAMS)
    tile = _scores.TILES[256]
    params = np.zeros((), dtype=_scores._PARAMS)
    params["seqlen_q"], params["seqlen_k"], params["head_dim"], params["scale_log2"] = 512, 512, 1024, 0.0451
    kernel = FakeKernel(1234)
    launch_obj = _scores.build_launch(kernel, params, (rec.spec(1), rec.spec(2), rec.spec(3)), (132, 1, 1), tile, 3)
    assert kernel.max_dynamic_shared_size_bytes == tile.smem_bytes()  # raised past the 48 KB default
    for q, k, p, lse, stream in ((16, 32, 48, 64, 7), (16, 32, 48, 0, 7), (16, 96, 48, 80, 9)):
        launch_obj.launch_on(stream, q, k, p, lse)
        want = params.copy()
        want["tma_q"], want["tma_k"], want["tma_p"] = blob(1, q), blob(2, k), blob(3, p)
        want["lse"], want["p"] = lse, p  # the persistent kernel's 16-byte P stores read the base too
        fn_ptr, dims, got_stream, got, extra = rec.calls[-1]
        assert (fn_ptr, dims, got_stream, extra) == (1234, (132, 1, 1, 384, 1, 1, tile.smem_bytes()), stream, 0)
        assert_same_struct(got, want)
    # encoded on the first call and again when k moved, not for the second call (same bases)
    assert rec.encoded == [(1, 16), (2, 32), (3, 48), (1, 16), (2, 96), (3, 48)]


def test_tiles():
    declared = set(FAMILY.name_expressions())
    for half_n, tile in _scores.TILES.items():
        assert tile.half_n == half_n and half_n % 64 == 0 and half_n <= 256 and tile.stages >= 2
        assert tile.smem_bytes() <= 232448, tile
        for dtype in ("__half", "__nv_bfloat16"):
            for kernel in _scores.KERNELS.values():
                assert FAMILY.name_expression(kernel=kernel, dtype=dtype, tile=tile) in declared
    for S in range(1, 513):
        half_n = _scores.tile_for(S).half_n
        assert 2 * half_n >= S and (half_n == 64 or 2 * (half_n - 64) < S), S
    for S in (0, 513):
        with pytest.raises(ValueError, match="seqlen_k"):
            _scores.tile_for(S)


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_causal_pairs_cover_every_row_block_once(align):
    """causal_pairs over L, S ≤ 512 and both alignments, walked as the kernel's TileWalk walks a head: every row block
    exactly once, pairs only of blocks that see some but not all keys, with visible keys (rounded up to 64) adding
    up to at most 512, the wide block first; the 256-key tile only. Square masks pair all but the middle block."""
    for S in range(1, 513, 7):
        half_n = _scores.tile_for(S).half_n
        for L in (1, 63, 64, 65, 200, 448, 470, 512, 640, 1024, 1100):
            offset = S - L if align == "bottom_right" else 0
            p0, n, pairs = _scores.causal_pairs(L, S, offset, half_n)
            m_blocks = -(-L // 64)
            vis = [_scores.visible_keys(L, S, offset, 64 * r) for r in range(m_blocks)]
            window = [r for r in range(m_blocks) if 0 < vis[r] < S]
            assert half_n == 256 or pairs == 0
            if pairs:  # the partial blocks' window, or its narrow end (the widest blocks left to tiles of their own)
                assert window[:n] == list(range(p0, p0 + n)) and 2 * pairs <= n
            seen = []
            for i in range(m_blocks - pairs):  # the kernel's TileWalk::take for one head
                if i < pairs:
                    hi, lo = p0 + n - 1 - i, p0 + i
                    w_hi, w_lo = (-(-vis[r] // 64) * 64 for r in (hi, lo))
                    assert 0 < vis[lo] <= vis[hi] < S and w_hi + w_lo <= 512, (L, S, align, hi, lo)
                    assert w_hi - min(256, w_hi) <= 192  # warpgroup 1's keys of the wide block: n1 ≤ 192
                    seen += [hi, lo]
                    continue
                mb = i - pairs
                if mb >= p0:
                    mb += pairs
                if mb >= p0 + n - pairs:
                    mb += pairs
                seen.append(mb)
            assert sorted(seen) == list(range(m_blocks)), (L, S, align, p0, n, pairs)
            if S == L and S % 64 == 0 and S > 384:
                assert pairs == (S // 64 - 1) // 2, (L, S, align, pairs)


def emulate_epilogue(s_block, S, rows, c, half_n, ld, m0=0, causal_offset=None):
    """The kernel's epilogue, lane by lane, in float32: s_block (64, 2·half_n) = one CTA's raw scores (columns past S
    are the products with TMA's zero rows of K: 0); rows = valid query rows of the block; c = scale·log2 e; m0 = the
    block's first query row and causal_offset (None: not causal) the causal limit (key j visible to row i iff
    j <= i + causal_offset). Returns (P (64, ld) float64 with NaN where nothing was written, lse (64,), writes per
    element)."""
    f32 = np.float32
    P = np.full((64, ld), np.nan)
    writes = np.zeros((64, ld), int)
    lse = np.full(64, np.nan)
    n_acc = half_n // 2
    acc = np.zeros((2, 4, 32, n_acc), f32)  # [warpgroup][warp][lane][register]
    n_vis = S if causal_offset is None else max(0, min(S, m0 + rows - 1 + causal_offset + 1))
    # Keys per warpgroup: half_n, or under a causal mask half of n_vis rounded up to 64 (the second K box from key nw).
    nw = half_n if causal_offset is None else min(half_n, max(64, -(-n_vis // 128) * 64))
    for wg in range(2):
        for warp in range(4):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for j in range(half_n // 8):
                    for half in range(2):
                        for e in range(2):
                            key = wg * nw + 8 * j + 2 * t + e  # past nw: the box's further rows (masked)
                            acc[wg, warp, lane, 4 * j + 2 * half + e] = (
                                s_block[warp * 16 + g + 8 * half, key] if 8 * j + 2 * t + e < nw else 0)
    # Mask past S and past each row's causal limit, per warpgroup whose keys reach past them; an inactive warpgroup
    # (no key below n_vis: it issued no wgmma) is all −inf.
    for wg in range(2):
        n0 = wg * nw
        active = n0 < n_vis
        if not (not active or nw < half_n or n0 + half_n > S
                or (causal_offset is not None and n0 + half_n - 1 > m0 + causal_offset)):
            continue
        for warp in range(4):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for h in range(2):
                    limit = min(S, n0 + nw)
                    if causal_offset is not None:
                        limit = min(limit, m0 + warp * 16 + g + 8 * h + causal_offset + 1)
                    lim = max(-1, min(half_n, limit - n0 - 2 * t)) if active else -1
                    for j in range(half_n // 8):
                        for e in range(2):
                            if 8 * j + e >= lim:
                                acc[wg, warp, lane, 4 * j + 2 * h + e] = -np.inf
    lanes = np.arange(32)

    def quad(x, op):  # __shfl_xor_sync with 1, then 2, along the lane axis
        x = op(x, x[:, :, lanes ^ 1])
        return op(x, x[:, :, lanes ^ 2])

    mx = np.stack([np.max(acc[..., [4 * j + 2 * h + e for j in range(half_n // 8) for e in range(2)]], axis=-1)
                   for h in range(2)], axis=-1)  # [wg][warp][lane][half]
    mx = quad(mx, np.maximum)
    m_c = (mx * f32(c)).astype(f32)  # this warpgroup's own row max, −inf where it sees no key of the row
    ref = np.where(m_c == -np.inf, f32(0), m_c)  # the exponent reference: 0 for a row with no key here (P = 0)
    x = acc.copy()
    sums = np.zeros_like(mx)
    for j in range(half_n // 8):
        for h in range(2):
            for e in range(2):
                i = 4 * j + 2 * h + e
                with np.errstate(invalid="ignore"):
                    x[..., i] = np.exp2(x[..., i] * f32(c) - ref[..., h])
                sums[..., h] += x[..., i]
    sums = quad(sums, np.add)
    stats = np.full((2, 64, 2), np.nan, f32)  # [wg][row] = (m_c, sum), written by lanes t == 0
    for wg in range(2):
        for warp in range(4):
            for lane in range(0, 32, 4):
                for h in range(2):
                    stats[wg, warp * 16 + lane // 4 + 8 * h] = m_c[wg, warp, lane, h], sums[wg, warp, lane, h]
    ls = {}  # (wg, row) -> the l each warpgroup computes: both must agree bit for bit
    for wg in range(2):
        n0 = wg * nw
        for warp in range(4):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for h in range(2):
                    r = warp * 16 + g + 8 * h
                    m_own, m_peer, l_peer = m_c[wg, warp, lane, h], stats[wg ^ 1, r, 0], stats[wg ^ 1, r, 1]
                    m = max(m_own, m_peer)
                    l_sum, inv = f32(0), f32(0)
                    if m != -np.inf:
                        e_own, e_peer = np.exp2(f32(m_own - m)), np.exp2(f32(m_peer - m))
                        l_sum = f32(f32(sums[wg, warp, lane, h] * e_own) + f32(l_peer * e_peer))
                        inv = f32(e_own / l_sum) if l_sum > 0 else f32(0)
                    ls.setdefault(r, set()).add(float(l_sum))
                    if wg == 0 and t == 0 and r < rows:
                        lse[r] = (m + np.log2(l_sum)) * np.log(2) if l_sum > 0 else -np.inf
                    if r >= rows:
                        continue
                    col0 = n0 + 2 * t
                    lim = min(S - n0, nw) - 2 * t
                    for j in range(half_n // 8):
                        x0 = x[wg, warp, lane, 4 * j + 2 * h] * inv
                        x1 = x[wg, warp, lane, 4 * j + 2 * h + 1] * inv
                        if 8 * j + 1 < lim:
                            P[r, col0 + 8 * j], P[r, col0 + 8 * j + 1] = x0, x1
                            writes[r, col0 + 8 * j] += 1
                            writes[r, col0 + 8 * j + 1] += 1
                        elif 8 * j < lim:
                            P[r, col0 + 8 * j] = x0
                            writes[r, col0 + 8 * j] += 1
    assert all(len(v) == 1 for v in ls.values()), "both warpgroups compute the same l for a row"
    # Causal: keys 2·nw ... S − 1 of the valid rows are zero-filled.
    P[:rows, 2 * nw:S] = 0
    writes[:rows, 2 * nw:S] += 1
    return P, lse, writes


@pytest.mark.parametrize("S", [1, 7, 64, 100, 129, 256, 300, 385, 511, 512])
@pytest.mark.parametrize("rows", [64, 13])
def test_epilogue_emulation_matches_softmax(S, rows):
    rng = np.random.default_rng(S * 100 + rows)
    half_n = _scores.tile_for(S).half_n
    ld = -(-S // 8) * 8
    scale = 0.37
    s = np.zeros((64, 2 * half_n), np.float32)
    s[:, :S] = rng.standard_normal((64, S)).astype(np.float32) * 6  # large logits: the max matters
    P, lse, writes = emulate_epilogue(s, S, rows, scale * 1.4426950408889634, half_n, ld)
    z = s[:rows, :S].astype(np.float64) * scale
    ref = np.exp(z - z.max(-1, keepdims=True))
    ref_lse = np.log(ref.sum(-1)) + z.max(-1)
    ref /= ref.sum(-1, keepdims=True)
    assert (writes[:rows, :S] == 1).all(), "every element of P[:L, :S] is written once"
    assert (writes[rows:] == 0).all() and (writes[:, S:] == 0).all(), "nothing past L or S is written"
    np.testing.assert_allclose(P[:rows, :S], ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lse[:rows], ref_lse, rtol=1e-5, atol=1e-5)
    assert np.isnan(lse[rows:]).all()


def quad_transpose(words: np.ndarray) -> np.ndarray:
    """scores_sm90.cu's quad_transpose, step by step over a warp: words[lane][u] (32 × 4 uint32); each
    butterfly step (bit 1, then 2) sends the word whose index bit differs from the lane's through shfl.xor(bit) and
    stores what the partner sent at the same index."""
    w = words.copy()
    lanes = np.arange(32)
    for bit in (1, 2):
        hi = (lanes & bit) != 0
        for lo in range(4):
            if lo & bit:
                continue
            send = np.where(hi, w[:, lo], w[:, lo | bit])
            got = send[lanes ^ bit]
            w[:, lo] = np.where(hi, got, w[:, lo])
            w[:, lo | bit] = np.where(hi, w[:, lo | bit], got)
    return w


def test_quad_transpose_gives_each_lane_eight_consecutive_keys():
    """Lane 4g + t holds packed pairs (keys 8j + 2t, + 1) for j = 4i + u in word u; after the transpose its four words
    are keys 32i + 8t ... + 7 in order: the 16-byte chunk the persistent kernel stores."""
    lanes = np.arange(32)
    t = lanes % 4
    pair = np.array([[8 * u + 2 * tt for u in range(4)] for tt in t], dtype=np.uint32)  # first key of each pair
    out = quad_transpose(pair)
    want = np.array([[8 * tt + 2 * u for u in range(4)] for tt in t], dtype=np.uint32)
    np.testing.assert_array_equal(out, want)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, size=(32, 4), dtype=np.uint64).astype(np.uint32)
    y = quad_transpose(x)
    for lane in range(32):
        q0, tt = lane - lane % 4, lane % 4
        assert [int(v) for v in y[lane]] == [int(x[q0 + u, tt]) for u in range(4)]


@pytest.mark.parametrize("S,L,m0,align", [(512, 512, 0, "top_left"), (512, 512, 192, "top_left"),
                                           (512, 512, 448, "top_left"), (300, 300, 256, "top_left"),
                                           (100, 300, 0, "bottom_right"), (100, 300, 192, "bottom_right"),
                                           (100, 300, 256, "bottom_right"), (512, 200, 128, "bottom_right"),
                                           (7, 7, 0, "top_left"), (129, 77, 64, "top_left")])
def test_epilogue_emulation_causal(S, L, m0, align):
    """The causal epilogue: P = the masked softmax of the block's rows (0 past each row's limit, written), lse; rows
    that see no key (bottom-right with L > S) get P = 0 and lse = −inf, no NaN; a warpgroup whose keys all lie past
    the block's last row's limit (inactive: the kernel skips its wgmma, its accumulators hold stale zeros) still
    writes its zeros."""
    rng = np.random.default_rng(S + L + m0)
    half_n = _scores.tile_for(S).half_n
    ld = -(-S // 8) * 8
    rows = min(64, L - m0)
    offset = 0 if align == "top_left" else S - L
    n_vis = max(0, min(S, m0 + rows + offset))
    s = np.zeros((64, 2 * half_n), np.float32)
    s[:, :S] = rng.standard_normal((64, S)).astype(np.float32) * 6
    s[:, n_vis:] = 0  # an inactive warpgroup's accumulators: never written by a wgmma
    scale = 0.37
    P, lse, writes = emulate_epilogue(s, S, rows, scale * 1.4426950408889634, half_n, ld, m0=m0, causal_offset=offset)
    assert (writes[:rows, :S] == 1).all() and (writes[rows:] == 0).all() and (writes[:, S:] == 0).all()
    assert not np.isnan(P[:rows, :S]).any() and not np.isnan(lse[:rows]).any()
    for r in range(rows):
        see = min(S, m0 + r + offset + 1)  # keys 0 ... see − 1
        if see <= 0:
            assert (P[r, :S] == 0).all() and lse[r] == -np.inf, r
            continue
        z = s[r, :see].astype(np.float64) * scale
        ref = np.exp(z - z.max())
        np.testing.assert_allclose(P[r, :see], ref / ref.sum(), rtol=1e-5, atol=1e-7)
        assert (P[r, see:S] == 0).all(), r
        np.testing.assert_allclose(lse[r], np.log(ref.sum()) + z.max(), rtol=1e-5, atol=1e-5)


class ProtocolError(AssertionError):
    """A hazard the pipeline emulation found: a stage overwritten while read, a stage read before its data landed, an
    access to a CTA that has exited, or a deadlock."""


class _MBarrier:
    """An mbarrier as the PTX ISA defines it: a phase completes when its pending arrivals reach 0 and its transaction
    count is 0 (the count may go negative: bytes landing before their expect_tx); try_wait.parity(P) succeeds once
    the phase of parity P has completed, i.e. while the current phase's parity differs from P."""

    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def arrive(self, tx=0):
        if self.pending == 0:
            raise ProtocolError("arrival on a barrier with no pending arrivals")
        self.tx += tx
        self.pending -= 1
        self._complete()

    def complete_tx(self, n):
        self.tx -= n
        self._complete()

    def ready(self, parity):
        return (self.phase & 1) != parity


def _interleave(threads, events, on_event, rng):
    """Run generator threads (each yields a predicate it waits on, None or true when it may go on) and in-flight
    events (on_event(event) handles one) in a random order drawn from rng until all threads end and no event is left;
    ProtocolError on a deadlock (threads waiting, nothing in flight)."""
    blocked = {i: None for i in range(len(threads))}  # thread -> predicate it waits on (None: runnable)
    done = set()
    while len(done) < len(threads) or events:
        runnable = [("t", i) for i in blocked if i not in done and (blocked[i] is None or blocked[i]())]
        runnable += [("e", j) for j in range(len(events))]
        if not runnable:
            raise ProtocolError(f"deadlock: threads {sorted(set(blocked) - done)} wait, nothing in flight")
        kind, i = rng.choice(runnable)
        if kind == "t":
            try:
                blocked[i] = next(threads[i])
            except StopIteration:
                done.add(i)
            continue
        on_event(events.pop(i))


def emulate_pipeline(k_blocks, stages, cluster_m, *, load_hi=True, rows_ok=(True, True), half_n=256, seed=0,
                     mutation=None, tiles=1, p_staged=False):
    """The scores kernel's TMA/mbarrier protocol (scores_sm90.cu: scores_softmax), transcribed step by step
    for cluster_m CTAs of one cluster and run under a random interleaving (``seed``): per CTA the producer thread and
    the 8 consumer warps (lane 0 stands for its warp), with the kernel's barrier counts, parities, expect_tx bytes,
    box assignment (rank r multicasts K box r; rank 1 loads none when S ≤ kHalfN, ``load_hi`` False) and cluster
    barriers. TMA boxes land as separate events in any order, one per destination CTA; remote arrivals too, each
    before its thread's cluster_arrive.release. rows_ok[r]: CTA r has rows below L (False: the padding CTA, no Q).

    Checks: a box never lands in a stage some warp of that CTA has not finished reading (write after read); a warp
    past full[s] finds Q (where loaded) and its K boxes of that very k block (read after write); nothing lands in or
    arrives on an exited CTA; no deadlock. ``mutation`` breaks the protocol on purpose (the tests show each one is
    caught): "local_empty" (empty barriers count 8 local warps, no remote arrivals), "no_exit_barrier",
    "own_bytes_only" (full barriers expect only the bytes this CTA's producer loads), "early_release" (persistent:
    a tile's last stage released before its P stores have read the staging). Raises ProtocolError.

    tiles > 1 (one CTA): the persistent kernel, ring steps counted across tiles (step = tile · k_blocks + kb). Its P
    leaves by 16-byte stores from registers, so each warp releases a tile's last stage once its wgmma have read it
    (wait_group 0), before the epilogue; with ``p_staged`` (the persistent kernel's -DCUPY_ATTN_SCORES_P_TMA build,
    removed after 725cf17: bench/notes/kernels_scores_sm90.md; the one-tile kernels' order) it holds that stage
    through the epilogue (P staged in it, then stored by TMA) and releases it after. Its epilogue exchanges row
    statistics through one shared buffer: each warp writes its rows' slot (tagged with the tile), the named barrier of
    the 8 consumer warps, a read of the peer warpgroup's slot, which must still hold this tile's (else ProtocolError),
    and a second barrier when k_blocks ≤ stages ("one_stats_barrier" drops it)."""
    import random
    rng = random.Random(seed)
    q_bytes, box_bytes = 64 * 128, half_n * 128
    ctas = range(cluster_m)
    remote = cluster_m > 1 and mutation != "local_empty"
    full = [[_MBarrier(1) for _ in range(stages)] for _ in ctas]
    empty = [[_MBarrier(8 * (cluster_m if remote else 1)) for _ in range(stages)] for _ in ctas]
    assert tiles == 1 or cluster_m == 1, "the persistent kernel is one CTA"
    steps = tiles * k_blocks
    tags = [[{} for _ in range(stages)] for _ in ctas]  # [cta][stage][part] = ring step of the data there
    finished = [[0] * steps for _ in ctas]  # warps done with ring step g in CTA c (reading, and any staging in it)
    alive = [9] * cluster_m  # threads (producer + 8 warps) not yet exited, per CTA
    events = []  # in flight: (kind, destination cta, ...)
    unflushed = {}  # thread -> its remote arrivals still in flight
    cluster_bar = [0]  # arrivals at the cluster barrier (two phases: after init, before exit)
    n_threads = 9 * cluster_m
    stats = [[[None] * 4 for _ in range(2)] for _ in ctas]  # [cta][warpgroup][warp]: the tile whose statistics
    stats_bar = [0] * cluster_m  # arrivals at the consumers' named barrier (8 warps, every generation in order)
    stats_gen = {}

    def named_barrier(c, me):
        gen = stats_gen.get(me, 0)
        stats_gen[me] = gen + 1
        stats_bar[c] += 1
        yield lambda: stats_bar[c] >= 8 * (gen + 1)

    def exchange(c, w, tile):  # the persistent epilogue's row statistics
        me = (c, w)
        stats[c][w // 4][w % 4] = tile
        yield from named_barrier(c, me)
        yield lambda: True  # anything may run between the barrier and the read
        if stats[c][1 - w // 4][w % 4] != tile:
            raise ProtocolError(f"CTA {c} warp {w} read the peer's statistics of tile {stats[c][1 - w // 4][w % 4]} "
                                f"for tile {tile}")
        if k_blocks <= stages and mutation != "one_stats_barrier":
            yield from named_barrier(c, me)

    def cluster_sync(phase, me):
        while unflushed.get(me):  # arrive.release: this thread's remote arrivals are performed first
            yield lambda: not unflushed.get(me)
        cluster_bar[0] += 1
        yield lambda: cluster_bar[0] >= phase * n_threads

    boxes = ["lo", "hi"] if load_hi else ["lo"]  # the K boxes a stage holds

    def producer(c):
        me = (c, "producer")
        if cluster_m > 1:
            yield from cluster_sync(1, me)
        q = q_bytes if rows_ok[c] else 0
        expect = q + box_bytes * len(boxes)
        if mutation == "own_bytes_only":
            expect = q + (box_bytes if c == 0 or load_hi else 0)
        for kb in range(steps):
            s = kb % stages
            yield lambda kb=kb, s=s: empty[c][s].ready(((kb // stages) & 1) ^ 1)
            full[c][s].arrive(tx=expect)
            if rows_ok[c]:
                events.append(("box", c, s, "q", kb, q_bytes))
            if cluster_m == 1:
                events.extend(("box", c, s, part, kb, box_bytes) for part in boxes)
            elif c == 0 or load_hi:  # box `rank`, multicast to both CTAs
                events.extend(("box", d, s, ("lo", "hi")[c], kb, box_bytes) for d in ctas)
            yield lambda: True
        if cluster_m > 1 and mutation != "no_exit_barrier":
            yield from cluster_sync(2, me)
        alive[c] -= 1

    def consumer(c, w):
        me = (c, w)
        if cluster_m > 1:
            yield from cluster_sync(1, me)
        inactive = w >= 4 and not load_hi  # warpgroup 1 sees no key: no wgmma, each stage released as it comes
        for tile in range(tiles):
            for kb in range(tile * k_blocks, (tile + 1) * k_blocks):
                s = kb % stages
                last = kb == (tile + 1) * k_blocks - 1
                yield lambda kb=kb, s=s: full[c][s].ready((kb // stages) & 1)
                if inactive:
                    if not last:  # the tile's last stage is held through the epilogue
                        finished[c][kb] += 1
                        empty[c][s].arrive()
                        if remote:
                            events.append(("arrive", c ^ 1, s, me))
                            unflushed[me] = unflushed.get(me, 0) + 1
                    yield lambda: True
                    continue
                need = (["q"] if rows_ok[c] else []) + boxes
                if any(tags[c][s].get(part) != kb for part in need):
                    raise ProtocolError(f"CTA {c} warp {w} read stage {s} for k block {kb}: holds {tags[c][s]}")
                if kb > tile * k_blocks:  # wgmma.wait_group 1: k block kb − 1 is read; release its stage
                    finished[c][kb - 1] += 1
                    empty[c][(kb - 1) % stages].arrive()
                    if remote:
                        events.append(("arrive", c ^ 1, (kb - 1) % stages, me))
                        unflushed[me] = unflushed.get(me, 0) + 1
                yield lambda: True
            # wait_group 0, then the epilogue: P staged in this warp's K box of the tile's last stage, stored by TMA
            # (the stores read it); the persistent kernel then releases the stage. A one-tile CTA never does.
            g = (tile + 1) * k_blocks - 1
            if tiles > 1 and not p_staged:  # read by this warp's wgmma: released before the softmax and stores
                finished[c][g] += 1
                empty[c][g % stages].arrive()
                yield from exchange(c, w, tile)
                yield lambda: True  # the rest of the epilogue, P from registers
                continue
            if tiles > 1:
                yield from exchange(c, w, tile)
            if tiles > 1 and mutation == "early_release":
                empty[c][g % stages].arrive()
            yield lambda: True  # staging and stores in progress
            finished[c][g] += 1
            if tiles > 1 and mutation != "early_release":
                empty[c][g % stages].arrive()
        if cluster_m > 1 and mutation != "no_exit_barrier":
            yield from cluster_sync(2, me)
        alive[c] -= 1

    def on_event(ev):
        c = ev[1]
        if alive[c] == 0:
            raise ProtocolError(f"{ev[0]} reached CTA {c} after it exited")
        if ev[0] == "arrive":
            empty[c][ev[2]].arrive()
            unflushed[ev[3]] -= 1
            return
        _, c, s, part, kb, n = ev
        if kb >= stages and finished[c][kb - stages] < 8:
            raise ProtocolError(f"k block {kb} ({part}) landed in CTA {c} stage {s} while k block {kb - stages} "
                                f"was read by {8 - finished[c][kb - stages]} warps")
        tags[c][s][part] = kb
        full[c][s].complete_tx(n)

    _interleave([producer(c) for c in ctas] + [consumer(c, w) for c in ctas for w in range(8)], events, on_event,
                rng)
    if any(alive):
        raise ProtocolError(f"threads never exited: {alive}")


PIPELINE_CASES = [  # (k_blocks, stages, load_hi, rows_ok)
    (1, 4, True, (True, True)), (2, 3, True, (True, True)), (5, 4, True, (True, True)), (16, 3, True, (True, True)),
    (16, 4, True, (True, False)), (7, 3, False, (True, True)), (3, 4, False, (True, False)), (4, 4, True, (True, True)),
]


@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("k_blocks,stages,load_hi,rows_ok", PIPELINE_CASES)
def test_pipeline_protocol_under_random_interleavings(k_blocks, stages, load_hi, rows_ok, cluster_m):
    """The kernel's barrier protocol, one CTA and a cluster of two (K multicast), with and without the padding CTA
    and the S ≤ 64 case (one K box), over 150 random interleavings each: no hazard, no deadlock, clean exit."""
    for seed in range(150):
        emulate_pipeline(k_blocks, stages, cluster_m, load_hi=load_hi, rows_ok=rows_ok[:cluster_m], seed=seed)


@pytest.mark.parametrize("tiles", [2, 5])
@pytest.mark.parametrize("k_blocks,stages,load_hi", [(1, 3, True), (2, 3, True), (3, 3, False), (16, 3, True),
                                                     (5, 4, True), (4, 2, True)])
@pytest.mark.parametrize("p_staged", [False, True])
def test_persistent_pipeline_protocol_under_random_interleavings(k_blocks, stages, load_hi, tiles, p_staged):
    """The persistent kernel's protocol (one ring across tiles; each tile's last stage released after its wgmma, or
    with P staged in it held through the epilogue): no hazard, no deadlock, clean exit over 150 random interleavings
    each; k_blocks = 1 (every stage is some tile's last), k_blocks a multiple of the ring, the S ≤ 64 case."""
    for seed in range(150):
        emulate_pipeline(k_blocks, stages, 1, load_hi=load_hi, rows_ok=(True,), seed=seed, tiles=tiles,
                         p_staged=p_staged)


def test_persistent_pipeline_emulation_catches_a_missing_second_statistics_barrier():
    """With k_blocks = stages the early release of a tile's last stage is the one the producer needs for the next
    tile's last k block: one warpgroup can then run a whole tile ahead and overwrite its statistics before the peer
    has read them, unless the second barrier holds it (the kernel's k_blocks <= kStages case)."""
    for seed in range(400):
        try:
            emulate_pipeline(3, 3, 1, rows_ok=(True,), seed=seed, tiles=4, mutation="one_stats_barrier")
        except ProtocolError as exc:
            assert "statistics" in str(exc), str(exc)
            return
    pytest.fail("a lost statistics exchange went unnoticed in 400 interleavings")


@pytest.mark.parametrize("k_blocks,stages", [(4, 3), (16, 3), (5, 4)])
def test_persistent_pipeline_one_statistics_barrier_suffices_past_the_ring(k_blocks, stages):
    """With k_blocks > stages the ring alone keeps a warpgroup from reaching the next tile's statistics before its
    peer has read this tile's: the kernel's single barrier there (every head dim above 256)."""
    for seed in range(150):
        emulate_pipeline(k_blocks, stages, 1, rows_ok=(True,), seed=seed, tiles=3, mutation="one_stats_barrier")


def test_persistent_pipeline_emulation_catches_an_early_release():
    for seed in range(300):
        try:
            emulate_pipeline(2, 3, 1, rows_ok=(True,), seed=seed, tiles=4, mutation="early_release", p_staged=True)
        except ProtocolError as exc:
            assert "while k block" in str(exc), str(exc)
            return
    pytest.fail("a release before the P stores went unnoticed in 300 interleavings")


@pytest.mark.parametrize("mutation,words", [("local_empty", "while k block"), ("no_exit_barrier", "after it exited"),
                                            ("own_bytes_only", "read stage")])
def test_pipeline_emulation_catches_a_broken_protocol(mutation, words):
    """Each deliberate break of the cluster protocol is caught within 300 interleavings (so the test above means
    something): without remote releases a producer overwrites a stage the peer still reads; without the exit barrier
    a remote arrival reaches an exited CTA; a full barrier expecting only its own producer's bytes lets the consumers
    read before the peer's box has landed."""
    for seed in range(300):
        try:
            emulate_pipeline(8, 3, 2, seed=seed, mutation=mutation)
        except ProtocolError as exc:
            assert words in str(exc), str(exc)
            return
    pytest.fail(f"mutation {mutation} went unnoticed in 300 interleavings")


def test_grid_pads_row_blocks_to_whole_clusters():
    for L in (1, 63, 64, 65, 128, 129, 130, 512, 513, 4097):
        blocks = -(-L // 64)
        assert _scores.grid_for(3, 5, L, 1) == (blocks, 5, 3)
        assert _scores.grid_for(3, 5, L, 2) == (blocks + blocks % 2, 5, 3), L
        assert _scores.grid_for(3, 5, L, 3, num_sms=132) == (min(blocks * 15, 132), 1, 1), L
    with pytest.raises(ValueError, match="variant"):
        _scores.grid_for(1, 1, 64, 4)


def _problem(**kw):
    import types
    q = _bhsd(2, 4, 100, 1024)
    p = dict(query=q, key=_bhsd(2, 4, 300, 1024), value=_bhsd(2, 4, 300, 1024), mask=None, causal=None,
             dropout_p=0.0, scale=0.03, dtype=np.dtype("float16"), seqlen_q=100, seqlen_k=300)
    return types.SimpleNamespace(**{**p, **kw})


def _key_mask(dtype=bool):
    """A key-padding mask (2, 1, 1, 300) broadcast to (B, Hq, L, S) = (2, 4, 100, 300): stride 0 along the rows."""
    return np.broadcast_to(np.ones((2, 1, 1, 300), dtype), (2, 4, 100, 300))


def test_unsupported_reasons(monkeypatch):
    monkeypatch.delenv(_scores.ENV_SPLIT_FUSED, raising=False)
    if _scores.reason(_problem(), 90, _scores.setting()) is not None:
        pytest.skip(_scores.reason(_problem(), 90, _scores.setting()))  # cuda-bindings missing
    assert _scores.reason(_problem(dtype=np.dtype("bfloat16")), 90, _scores.setting()) is None
    for dt in (bool, np.float16, np.float32):  # key-only masks: the masked persistent kernel
        assert _scores.reason(_problem(mask=_key_mask(dt), seqlen_k=400), 90, _scores.setting()) is None
        assert _scores.reason(_problem(mask=_key_mask(dt)), 90, _scores.setting()) is None  # S = 300: the 512-key tile
    for kw, arch, words in (({}, 80, "sm_80"), ({"dtype": np.dtype("float32")}, 90, "float32"),
                            ({"seqlen_k": 513}, 90, "512"),
                            ({"mask": np.ones((2, 4, 100, 300), bool)}, 90, "query rows"),
                            ({"mask": np.ones((2, 4, 100, 300), np.int32)}, 90, "int32"),

                            ({"dropout_p": 0.1}, 90, "dropout"),
                            ({"scale": -1.0}, 90, "scale"), ({"key": _bhsd(2, 4, 300, 1024, ptr=(1 << 20) + 8)}, 90,
                                                             "16-byte")):
        why = _scores.reason(_problem(**kw), arch, _scores.setting())
        assert why is not None and words in why, (kw, why)
    monkeypatch.setenv(_scores.ENV_SPLIT_FUSED, "1")
    assert "persistent" in _scores.reason(_problem(mask=_key_mask(), seqlen_k=400), 90, _scores.setting())


def test_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv(_scores.ENV_SPLIT_FUSED, raising=False)
    assert _scores.enabled() and _scores.setting() == 3  # on by default, persistent (measured: scores_sm90.setting)
    for value, setting in (("1", 1), ("2", 2), ("0", 0), ("3", 3), ("4", 3), ("yes", 3)):
        monkeypatch.setenv(_scores.ENV_SPLIT_FUSED, value)
        assert _scores.setting() == setting and _scores.enabled() == (setting > 0), value
    from cupy_attn.runtime import callcache
    assert _scores.ENV_SPLIT_FUSED in callcache.ENV_KEYS, "a cached call must not replay the other schedule"


# ---------------------------------------------------------------------------------------------------------------------
# GPU

def _torch():
    return pytest.importorskip("torch")


def _run_kernel(q, k, scale, ld, variant=1, causal=None):
    """The kernel alone (variant: 1 = scores_softmax_sm90, 2 = scores_softmax_sm90_cluster2, 3 =
    scores_softmax_sm90_persistent) on torch CUDA tensors
    (passed as CuPy views): (P (B, Hq, L, ld), lse (B, Hq, L)) as torch tensors, both NaN-poisoned before the launch
    and each followed in memory by a poisoned tail of 64 rows that must stay NaN (the last row block, or a cluster's
    padding CTA, writing past L would land there)."""
    import cupy
    torch = _torch()
    B, Hq, L, _ = q.shape
    n_p, n_lse = B * Hq * L * ld, B * Hq * L
    P_all = torch.full((n_p + 64 * ld,), float("nan"), dtype=q.dtype, device=q.device)
    lse_all = torch.full((n_lse + 64,), float("nan"), dtype=torch.float32, device=q.device)
    P, lse = P_all[:n_p].view(B, Hq, L, ld), lse_all[:n_lse].view(B, Hq, L)
    cq, ck, clse = cupy.from_dlpack(q), cupy.from_dlpack(k), cupy.from_dlpack(lse)
    p = checks.array_problem(cq, ck, ck, None, clse, scale=scale, causal=causal)
    launch = _scores.build(p, _scores.choose(p, variant), clse, ld=ld)
    m = _scores.CLUSTER_M[variant]
    assert launch.grid[0] % m == 0 and (variant == 3 or launch.grid[0] * 64 >= L), launch.grid
    launch(cq.data.ptr, ck.data.ptr, P.data_ptr(), lse.data_ptr())
    torch.cuda.synchronize()
    assert bool(torch.isnan(P_all[n_p:]).all()) and bool(torch.isnan(lse_all[n_lse:]).all()), \
        f"variant={variant}: the kernel wrote past the last row of P or lse"
    return P, lse


def _causal_visible(L, S, offset):
    """(L, S) bool: key j visible to row i iff j <= i + offset."""
    return np.arange(S)[None, :] <= np.arange(L)[:, None] + offset


def _reference(q, k, scale, visible=None):
    """float64 P and lse from the same (rounded) inputs; GQA by head index h // groups; keys where ``visible`` (L, S)
    is False take no part (P = 0; a row that sees no key: P = 0, lse = -inf)."""
    q64, k64 = as_f64(q), as_f64(k)
    groups = q64.shape[1] // k64.shape[1]
    k64 = np.repeat(k64, groups, axis=1)
    z = (q64 @ k64.swapaxes(-1, -2)) * scale
    if visible is not None:
        z = np.where(visible, z, -np.inf)
    m = z.max(-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(z - m_safe)
    total = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(total > 0, e / np.where(total > 0, total, 1), 0.0), np.log(total[..., 0]) + m_safe[..., 0]


def _torch_softmax(q, k, scale, visible=None):
    """torch's same-precision P: softmax(Q Kᵀ · scale) with the GEMM and the softmax in the input dtype."""
    torch = _torch()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if visible is not None:
        s = s.masked_fill(~torch.as_tensor(visible, device=s.device), float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0)


def _check_kernel(B, Hq, Hkv, L, S, D, dtype, layout="bhsd", seed=0, variant=1):
    torch = _torch()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)

    def rand(b, h, n):
        if layout == "bshd":  # read in place through the tensor maps' strides
            return torch.randn(b, n, h, D, generator=gen, device="cuda").to(dt).transpose(1, 2)
        return torch.randn(b, h, n, D, generator=gen, device="cuda").to(dt)

    q, k = rand(B, Hq, L), rand(B, Hkv, S)
    scale = D ** -0.5
    ld = -(-S // 8) * 8
    P, lse = _run_kernel(q, k, scale, ld, variant)
    ref, ref_lse = _reference(q, k, scale)
    what = f"(B,Hq,Hkv,L,S,D)=({B},{Hq},{Hkv},{L},{S},{D}) {dtype} {layout} variant={variant}"
    assert_close(P[..., :S], ref, dtype, _torch_softmax(q, k, scale), what)
    if ld > S:
        # TMA stores clip the boxes to S in whole 16-byte chunks: the chunk holding key S − 1 is written in full, with
        # P = 0 for its keys past S (masked); nothing else of the padding.
        pad = P[..., S:]
        chunk_end = min(ld, -(-S // 8) * 8) - S
        assert bool((pad[..., :chunk_end] == 0).all()) and bool(torch.isnan(pad[..., chunk_end:]).all()), \
            f"{what}: padding columns past S: not 0 in the last 16-byte chunk, or written past it"
    np.testing.assert_allclose(as_f64(lse), ref_lse, rtol=1e-4, atol=2e-3, err_msg=what)


CLUSTERS = pytest.mark.parametrize("variant", sorted(_scores.KERNELS), ids=lambda m: f"variant{m}")

CAUSAL_CASES = [  # (B, Hq, Hkv, L, S, D, align): the persistent kernel's causal pair tiles (causal_pairs) and others
    (1, 4, 4, 512, 512, 1024, "top_left"),      # the seed's causal variant: pairs (0, 6), (1, 5), (2, 4); n1 = 192..64
    (2, 3, 3, 448, 448, 256, "top_left"),       # pairs (0, 5), (1, 4), (2, 3): n1 = 128, 64, 0
    (1, 2, 2, 1024, 512, 320, "bottom_right"),  # rows 0-511 see no key; the window is blocks 8-14
    (1, 2, 2, 500, 500, 128, "top_left"),       # S inside a chunk; k_blocks < stages (second statistics barrier)
    (1, 8, 2, 512, 512, 192, "top_left"),       # GQA; k_blocks = stages
    (2, 2, 2, 470, 490, 512, "bottom_right"),   # L != S, partial last row block
    (2, 2, 2, 256, 512, 256, "bottom_right"),   # a window whose pairs would exceed 512 keys: no pairs
    (1, 40, 40, 512, 512, 64, "top_left"),      # one k block, ~8 tiles per CTA
    (2, 4, 4, 300, 300, 512, "top_left"),       # the 192-key tile: no pairs
    (1, 3, 3, 450, 512, 320, "top_left"),       # the widest block (450 keys, a partial one) left out of the pairs
    (1, 2, 2, 1000, 512, 256, "bottom_right"),  # off the 64-row grid: the window's widest block left out
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [1, 3], ids=lambda m: f"variant{m}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,L,S,D,align", CAUSAL_CASES)
def test_kernel_causal(B, Hq, Hkv, L, S, D, align, dtype, variant):
    """is_causal in the kernel alone: every element of P[:L, :S] (0 past each row's limit, a row that sees no key all
    0) and lse (−inf there) against float64, torch's same-precision masked softmax as the error bound, nothing written
    past S's 16-byte chunk or past L. On the persistent kernel at S > 384 this runs the pair tiles."""
    torch = _torch()
    gen = torch.Generator(device="cuda").manual_seed(L * 7 + S)
    dt = getattr(torch, dtype)
    q = (torch.randn(B, Hq, L, D, generator=gen, device="cuda") * 1.5).to(dt)
    k = (torch.randn(B, Hkv, S, D, generator=gen, device="cuda") * 1.5).to(dt)
    scale = D ** -0.5
    ld = -(-S // 8) * 8
    offset = S - L if align == "bottom_right" else 0
    visible = _causal_visible(L, S, offset)
    P, lse = _run_kernel(q, k, scale, ld, variant, causal=align)
    ref, ref_lse = _reference(q, k, scale, visible)
    what = f"(B,Hq,Hkv,L,S,D)=({B},{Hq},{Hkv},{L},{S},{D}) {align} {dtype} variant={variant}"
    got = P[..., :S]
    assert not bool(torch.isnan(got).any()), f"{what}: P not written everywhere in [:L, :S]"
    assert bool((got.float().cpu().numpy()[..., ~visible] == 0).all()), f"{what}: P != 0 past a row's limit"
    assert_close(got, ref, dtype, _torch_softmax(q, k, scale, visible), what)
    if ld > S:
        pad = P[..., S:]
        assert bool((pad == 0).all()), f"{what}: the last 16-byte chunk's keys past S are not 0"
    got_lse = as_f64(lse)
    assert (np.isneginf(got_lse) == np.isneginf(ref_lse)).all(), f"{what}: lse -inf rows differ"
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(got_lse[fin], ref_lse[fin], rtol=1e-4, atol=2e-3, err_msg=what)


@pytest.mark.gpu
@CLUSTERS
def test_smoke(variant):
    """One small case per kernel: run first (a barrier mistake hangs; run under timeout), the one-CTA kernel
    (-k "smoke and variant1") before the cluster kernel (-k "smoke and variant2"). L = 100: two row blocks, one
    cluster."""
    _check_kernel(1, 2, 2, 100, 100, 320, "float16", variant=variant)


CASES = [  # (B, Hq, Hkv, L, S, D); row blocks ⌈L/64⌉ odd in several (the cluster kernel's padding CTA)
    (2, 3, 3, 100, 1, 320),
    (1, 2, 2, 64, 64, 512),      # one row block: a cluster of it and a padding CTA
    (2, 2, 2, 130, 100, 1000),   # 3 row blocks
    (1, 4, 4, 200, 256, 1024),
    (2, 1, 1, 77, 300, 320),
    (1, 2, 2, 128, 384, 512),
    (1, 2, 2, 129, 512, 1024),   # 3 row blocks, kHalfN = 256 (3 stages)
    (2, 4, 4, 512, 512, 1024),   # the seed (32, 32, 512, 1024) with fewer heads
    (1, 8, 2, 70, 200, 512),     # GQA 8/2
    (1, 1, 1, 1, 512, 64),       # one query row, one k block
    (1, 1, 1, 65, 511, 8),       # E = 8: one zero-filled k block
    (1, 3, 3, 150, 50, 256),     # 3 row blocks with S ≤ 64: one K box per stage (rank 1 loads none)
    (2, 16, 16, 448, 512, 512),  # 7 row blocks × 32 heads: 224-256 CTAs, two waves on 132 SMs
    # Persistent CTAs walking ~5 tiles each with k_blocks = stages (E = 192, the 256-key tile's three stages: the
    # second statistics barrier) and k_blocks < stages (E = 128 with the 192-key tile's four); S ends inside a chunk.
    (4, 40, 40, 200, 500, 192),
    (4, 40, 40, 200, 300, 128),
]


@pytest.mark.gpu
@CLUSTERS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,L,S,D", CASES)
def test_kernel(B, Hq, Hkv, L, S, D, dtype, variant):
    _check_kernel(B, Hq, Hkv, L, S, D, dtype, variant=variant)


@pytest.mark.gpu
@CLUSTERS
def test_kernel_bshd_layout(variant):
    _check_kernel(2, 3, 3, 90, 300, 512, "bfloat16", layout="bshd", variant=variant)


@pytest.mark.gpu
@CLUSTERS
@pytest.mark.parametrize("dtype", DTYPES)
def test_public_api_with_switch(monkeypatch, dtype, variant):
    """scaled_dot_product_attention under CUPY_ATTN_SPLIT_FUSED=1 (the one-CTA kernel) or 2 (the cluster kernel) at a
    head dim no fused kernel serves: the split path's schedule is that kernel → cuBLAS P·V (explain() says so); out
    and lse against float64; a second call on new arrays replays the cached launch (new tensor maps)."""
    import cupy_attn
    from cupy_attn import reference
    torch = _torch()
    monkeypatch.setenv(_scores.ENV_SPLIT_FUSED, str(variant))
    gen = torch.Generator(device="cuda").manual_seed(1)
    dt = getattr(torch, dtype)
    for seed in range(2):
        q, k, v = (torch.randn(*s, generator=gen, device="cuda").to(dt)
                   for s in ((2, 4, 200, 512), (2, 4, 300, 512), (2, 4, 300, 384)))
        plan = cupy_attn.explain(q, k, v)
        assert plan.backend == "split" and plan.details["schedule"].startswith(_scores.KERNELS[variant] + " "), \
            str(plan)
        out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, return_lse=True)
        ref, ref_lse = reference.scaled_dot_product_attention(*(as_f64(x) for x in (q, k, v)), return_lse=True)
        torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        assert_close(out, ref, dtype, torch_out, what=f"public call {seed}")
        np.testing.assert_allclose(as_f64(lse), ref_lse, rtol=1e-4, atol=2e-3)
    monkeypatch.setenv(_scores.ENV_SPLIT_FUSED, "0")
    plan = cupy_attn.explain(q, k, v)
    assert plan.details["scores kernel"].startswith("not used"), str(plan)


def test_unsupported_reason_causal(monkeypatch):
    """is_causal runs on the one-CTA and persistent kernels (CUPY_ATTN_SPLIT_FUSED 1, unset or 3), not on the
    cluster variant (2)."""
    monkeypatch.delenv(_scores.ENV_SPLIT_FUSED, raising=False)
    if _scores.reason(_problem(), 90, _scores.setting()) is not None:
        pytest.skip(_scores.reason(_problem(), 90, _scores.setting()))  # cuda-bindings missing
    for align in ("top_left", "bottom_right"):
        assert _scores.reason(_problem(causal=align), 90, _scores.setting()) is None
    monkeypatch.setenv(_scores.ENV_SPLIT_FUSED, "2")
    assert "is_causal" in _scores.reason(_problem(causal="top_left"), 90, _scores.setting())
    with pytest.raises(ValueError, match="causal"):
        p = _problem(query=_bhsd(1, 1, 64, 64), key=_bhsd(1, 1, 64, 64), seqlen_k=64, causal="top_left")
        _scores.build(p, _scores.choose(p, 2), None, ld=64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,L,S,D,align", [
    (1, 4, 4, 512, 512, 1024, "top_left"),       # the seed's causal variant with fewer heads: 2 P·V bands
    (2, 4, 4, 512, 512, 1024, "bottom_right"),   # L = S: the same mask
    (2, 4, 4, 200, 300, 512, "top_left"),
    (2, 4, 4, 200, 300, 512, "bottom_right"),
    (2, 4, 4, 300, 100, 512, "bottom_right"),    # L > S: the first 200 rows see no key (out 0, lse -inf)
    (1, 8, 2, 257, 257, 320, "top_left"),        # GQA 8/2, odd L: 2 bands of 129 and 128 rows
    (1, 2, 2, 77, 40, 384, "top_left"),          # S ≤ 64: one K box
    (1, 2, 2, 640, 512, 640, "bottom_right"),    # L > S, 2 bands
    (4, 40, 40, 200, 500, 192, "top_left"),      # persistent CTAs over ~5 tiles, k_blocks = stages
])
@pytest.mark.parametrize("variant,pv", [(1, True), (3, True), (3, False)], ids=lambda x: f"{x}")
def test_public_api_causal(B, Hq, Hkv, L, S, D, align, dtype, variant, pv, monkeypatch):
    """is_causal through the scores kernel, one CTA per row block or persistent (row blocks left of the diagonal skip
    the second warpgroup's wgmma, P is 0 past each row's limit), then P·V by the pv_sm90 kernel (each row block to its
    visible keys; the persistent scores kernel then writes no zeros past them) or, with CUPY_ATTN_SPLIT_PV=0, by banded
    cuBLAS GEMMs: out and lse against float64 (torch's same-precision causal error as the bound where torch has the
    alignment), a second call on new arrays replays."""
    import cupy_attn
    from cupy_attn import reference
    from cupy_attn.attention.kernels import pv_sm90
    torch = _torch()
    monkeypatch.setenv(_scores.ENV_SPLIT_FUSED, str(variant))
    monkeypatch.setenv(pv_sm90.ENV, "1" if pv else "0")
    gen = torch.Generator(device="cuda").manual_seed(L + S)
    dt = getattr(torch, dtype)
    causal = True if align == "top_left" else "bottom_right"
    for seed in range(2):
        q, k, v = (torch.randn(*s, generator=gen, device="cuda").to(dt)
                   for s in ((B, Hq, L, D), (B, Hkv, S, D), (B, Hkv, S, D)))
        # backend="split": head dims <= 256 (the D = 192 case) otherwise take the fused kernel
        plan = cupy_attn.explain(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv, backend="split")
        assert plan.backend == "split" and plan.details["schedule"].startswith(_scores.KERNELS[variant] + " "), \
            str(plan)
        assert ("pv_sm90" in plan.details["causal"] and "pv_sm90" in plan.details["schedule"]) == pv, str(plan)
        assert ("row bands" in plan.details["causal"]) != pv, str(plan)
        out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv,
                                                          return_lse=True, backend="split")
        ref, ref_lse = reference.scaled_dot_product_attention(*(as_f64(x) for x in (q, k, v)), is_causal=causal,
                                                              enable_gqa=Hq != Hkv, return_lse=True)
        torch_out = None
        if align == "top_left" or L == S:
            torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                         enable_gqa=Hq != Hkv)
        assert_close(out, ref, dtype, torch_out, what=f"causal {align} call {seed}")
        got = as_f64(lse)
        assert (np.isneginf(got) == np.isneginf(ref_lse)).all(), f"lse -inf rows differ ({align}, call {seed})"
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(got[fin], ref_lse[fin], rtol=1e-4, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,L,S,D,align", [
    (1, 4, 4, 512, 512, 1024, "top_left"),      # the seed's causal variant: pair tiles, 2 P·V bands
    (1, 2, 2, 477, 503, 768, "bottom_right"),   # odd L and S, L != S: pair tiles, rows past a band's keys
    (1, 2, 2, 300, 500, 1024, None),            # not causal, odd L
    (1, 4, 2, 129, 385, 320, "top_left"),       # GQA, the 256-key tile's smallest S
])
def test_large_logits(B, Hq, Hkv, L, S, D, align, dtype, monkeypatch):
    """|scale·q·k| up to ~100 (issue 14) through the scores kernel (persistent; causal pair tiles where S > 384): out
    and lse against float64, torch's same-precision error as the bound (torch with an explicit mask for bottom-right
    alignment, which its is_causal does not have)."""
    import cupy_attn
    from cupy_attn import reference
    torch = _torch()
    monkeypatch.delenv(_scores.ENV_SPLIT_FUSED, raising=False)
    gen = torch.Generator(device="cuda").manual_seed(L + S + D)
    dt = getattr(torch, dtype)
    q = (torch.randn(B, Hq, L, D, generator=gen, device="cuda") * 4.7).to(dt)
    k = (torch.randn(B, Hkv, S, D, generator=gen, device="cuda") * 4.7).to(dt)
    v = torch.randn(B, Hkv, S, D, generator=gen, device="cuda").to(dt)
    logits = (as_f64(q)[0, 0] @ as_f64(k)[0, 0].T) / np.sqrt(D)
    assert 60 < np.abs(logits).max() < 200
    causal = {None: False, "top_left": True, "bottom_right": "bottom_right"}[align]
    gqa = Hq != Hkv
    plan = cupy_attn.explain(q, k, v, is_causal=causal, enable_gqa=gqa, backend="split")
    assert plan.details["schedule"].startswith(_scores.KERNELS[3] + " "), str(plan)
    out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, return_lse=True,
                                                      backend="split")
    ref, ref_lse = reference.scaled_dot_product_attention(*(as_f64(x) for x in (q, k, v)), is_causal=causal,
                                                          enable_gqa=gqa, return_lse=True)
    mask = None
    if align == "bottom_right":
        mask = torch.as_tensor(_causal_visible(L, S, S - L), device="cuda")
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=align == "top_left",
                                                                 enable_gqa=gqa)
    assert_close(out, ref, dtype, torch_out, what=f"large logits {align}")
    got = as_f64(lse)
    fin = np.isfinite(ref_lse)
    assert (np.isneginf(got) == np.isneginf(ref_lse)).all()
    assert np.abs(got[fin] - ref_lse[fin]).max() < 1e-3 * max(1.0, np.abs(ref_lse[fin]).max())


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_batch_chunks_over_the_workspace_budget(causal, monkeypatch):
    """P of all batch·heads over the workspace budget: the scores kernel runs per chunk of batches on one P buffer
    (split.scores_batch_chunk; 5 batches in chunks of 2, 2, 1), explain() says so; out and lse against float64, a
    second call replays the cached schedule on new arrays."""
    import cupy_attn
    from cupy_attn import reference
    from cupy_attn.attention.paths import split
    torch = _torch()
    B, Hq, Hkv, L, S, D = 5, 4, 2, 320, 448, 512
    per_batch = Hq * L * S * 2
    monkeypatch.setenv("CUPY_ATTN_WORKSPACE_BYTES", str(2 * per_batch + 4096))
    monkeypatch.delenv(_scores.ENV_SPLIT_FUSED, raising=False)
    gen = torch.Generator(device="cuda").manual_seed(11)
    for call in range(2):
        q = torch.randn(B, Hq, L, D, generator=gen, device="cuda").half()
        k, v = (torch.randn(B, Hkv, S, D, generator=gen, device="cuda").half() for _ in range(2))
        plan = cupy_attn.explain(q, k, v, is_causal=causal, enable_gqa=True, backend="split")
        assert plan.details["schedule"].startswith(_scores.KERNELS[3] + " "), str(plan)
        assert "chunks of 2 batches" in plan.details["P buffer"], str(plan)
        out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, return_lse=True,
                                                          backend="split")
        ref, ref_lse = reference.scaled_dot_product_attention(*(as_f64(x) for x in (q, k, v)), is_causal=causal,
                                                              enable_gqa=True, return_lse=True)
        torch_out = None
        if causal != "bottom_right":
            torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal),
                                                                         enable_gqa=True)
        assert_close(out, ref, "float16", torch_out, what=f"batch chunks causal={causal} call {call}")
        got = as_f64(lse)
        fin = np.isfinite(ref_lse)
        assert (np.isneginf(got) == np.isneginf(ref_lse)).all()
        np.testing.assert_allclose(got[fin], ref_lse[fin], rtol=1e-4, atol=2e-3)
    sched = next(s for s in split._SCHEDULES.values() if s.batch_chunks and
                 len(s.batch_chunks) == 3)
    assert [c[1] is sched.batch_chunks[0][1] for c in sched.batch_chunks] == [True, True, False]


@pytest.mark.gpu
@pytest.mark.parametrize("mask_dtype", ["bool", "float32", "float16"])
@pytest.mark.parametrize("B,Hq,Hkv,L,S,D,shape", [
    (3, 4, 4, 512, 512, 1024, "b11s"),   # key padding at the seed's shape (fewer heads); batch 1 masks every key
    (2, 8, 2, 200, 400, 512, "bh1s"),    # a per-head key mask, GQA, partial row block
    (2, 4, 4, 77, 100, 320, "11s"),      # one mask for every batch and head, the 64-key tile
    (2, 4, 2, 130, 200, 384, "bh1s"),    # the 128-key tile, GQA, three row blocks
    (2, 4, 4, 100, 300, 320, "b11s"),    # S 257-384: the 256-key tile (no masked 192-key tile), P·V by pv_sm90
])
def test_key_masks(B, Hq, Hkv, L, S, D, shape, mask_dtype):
    """attn_mask that varies only along the keys (key padding) in the masked persistent kernel: explain() names it;
    out and lse against float64 and torch's same-precision error; a row block whose keys are all masked gets out 0
    and lse -inf, as the reference; a second call replays."""
    import cupy_attn
    from cupy_attn import reference
    torch = _torch()
    gen = torch.Generator(device="cuda").manual_seed(B * S + L)
    dt = torch.float16
    mshape = {"b11s": (B, 1, 1, S), "bh1s": (B, Hq, 1, S), "11s": (1, 1, S)}[shape]
    for call in range(2):
        q = torch.randn(B, Hq, L, D, generator=gen, device="cuda").to(dt)
        k, v = (torch.randn(B, Hkv, S, D, generator=gen, device="cuda").to(dt) for _ in range(2))
        keep = torch.rand(mshape, generator=gen, device="cuda") > 0.3
        if shape == "b11s":
            keep[1] = False  # batch 1 sees no key
        if mask_dtype == "bool":
            mask = keep
        else:
            mask = torch.where(keep, torch.randn(mshape, generator=gen, device="cuda"), float("-inf")).to(
                getattr(torch, mask_dtype))
        plan = cupy_attn.explain(q, k, v, attn_mask=mask, enable_gqa=Hq != Hkv, backend="split")
        assert plan.details["schedule"].startswith(_scores.MASKED_KERNEL + " "), str(plan)
        out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=Hq != Hkv,
                                                          return_lse=True, backend="split")
        ref, ref_lse = reference.scaled_dot_product_attention(*(as_f64(x) for x in (q, k, v)),
                                                              attn_mask=as_f64(mask) if mask_dtype != "bool"
                                                              else mask.cpu().numpy(),
                                                              enable_gqa=Hq != Hkv, return_lse=True)
        torch_out = None
        if shape != "b11s":  # torch gives NaN for rows that see no key; the reference and we give 0
            torch_out = torch.nn.functional.scaled_dot_product_attention(  # torch's float masks: q's dtype
                q, k, v, attn_mask=mask if mask_dtype == "bool" else mask.to(dt), enable_gqa=Hq != Hkv)
        assert_close(out, ref, "float16", torch_out, what=f"key mask {shape} {mask_dtype} call {call}")
        got = as_f64(lse)
        assert (np.isneginf(got) == np.isneginf(ref_lse)).all()
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(got[fin], ref_lse[fin], rtol=1e-4, atol=2e-3)
