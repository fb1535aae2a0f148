"""The Hopper scores kernel (cupy_attn.attention.scores_sm90, cuda_src/attention/scores_softmax_sm90.cu): P = softmax(
scale · Q Kᵀ) in the input dtype and lse, whole rows on chip, S ≤ 512, in its variants (CUPY_ATTN_SPLIT_FUSED unset
or 1: one CTA per 64-row block; 2: scores_softmax_sm90_cluster2, CTA pairs sharing K by TMA multicast; 3: v3,
scores_softmax_sm90_m128 with 128 rows × ≤ 256 keys per CTA and, for S > 256, _m128_cluster2: the keys over a
cluster of two CTAs that share Q by multicast and merge their row statistics through distributed shared memory; 4:
v3 whose key cluster loads Q in each CTA, no multicast; 0 off); and the split path's schedule that runs it before
the cuBLAS P·V GEMM.

CPU: every instantiation compiles for sm_90a without spills or ptxas performance warnings; its SASS holds HGMMA of the
tile's width, TMA loads, mbarrier operations, setmaxnreg and no local memory, and the cluster kernels multicast loads,
remote arrivals and cluster barriers (and v3's key cluster its two remote statistics stores, no fence in the
mainloop) (skipped without cuobjdump); the tile tables fit shared memory; lane-level NumPy transcriptions of the
epilogues (the wgmma accumulator layout, the −inf mask past S, the quad shuffles, the exchange between the two
warpgroups (v1) or between the two CTAs of v3's key cluster, the stores) reproduce the float64 softmax and write every
element of P[:L, :S] exactly once and nothing else; step-by-step transcriptions of the TMA/mbarrier protocols (one
CTA, v2's cluster, v3's key cluster) run hazard-free under random interleavings, and catch deliberately broken
protocols.
GPU (``gpu`` marker), every variant: the kernel alone on NaN-poisoned P (padding columns past S, and rows past the
last one, must stay NaN) and lse against the float64 reference with tests/_tolerance.py's rule (torch's
same-precision softmax(Q Kᵀ) as the comparison), large logits included; and through
cupy_attn.scaled_dot_product_attention with the switch set (explain() names the kernel; a second call replays; v3
also with GQA, odd L and S ∈ {1, 64, 200, 256, 300, 512}).

    PYTHONPATH=. timeout 300 python3 -m pytest -m gpu tests/test_scores_sm90.py -x -k "smoke and cluster1"  # first
    PYTHONPATH=. timeout 300 python3 -m pytest -m gpu tests/test_scores_sm90.py -x -k "smoke and cluster2"
    PYTHONPATH=. timeout 300 python3 -m pytest -m gpu tests/test_scores_sm90.py -x -k "smoke and m128"
    PYTHONPATH=. timeout 1500 python3 -m pytest -m gpu tests/test_scores_sm90.py -x -k "m128"
    PYTHONPATH=. timeout 1500 python3 -m pytest -m gpu tests/test_scores_sm90.py -x
"""
import re

import numpy as np
import pytest

from cupy_attn.attention import scores_sm90 as _scores
from cupy_attn.runtime import compile as _compile

from _tolerance import as_f64, assert_close
from test_flash_sm90 import _bhsd, _cuobjdump, sass_summary, sass_text
from _compile_checks import assert_clean

FAMILY = _scores.SCORES_SOFTMAX_SM90
DTYPES = ("float16", "bfloat16")

# ---------------------------------------------------------------------------------------------------------------------
# CPU


def test_every_instantiation_compiles_without_spills():
    reports = _compile.compile_family(FAMILY, "sm_90a")
    assert len(reports) == len(_scores.KERNELS) * len(DTYPES) * len(_scores.SCORES_TILES)
    assert_clean(reports, max_registers=168)


def test_sass_has_wgmma_of_the_tile_width_tma_and_no_local_memory():
    """Both kernels: HGMMA of the tile's width, TMA loads, mbarriers, setmaxnreg, no local memory. The cluster kernel
    (…_cluster2) also: K loads multicast (UTMALDG…MULTICAST), remote arrivals (SYNCS.ARRIVE…RED) and the cluster
    barrier (UCGABAR_ARV/UCGABAR_WAIT), with no MEMBAR in its mainloop (one per thread before the exit barrier's
    release arrive only, where the remote arrivals must be performed); the one-CTA kernel none of them."""
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    cubin = _compile.family_cubin(FAMILY, "sm_90a")
    kernels = sass_summary(cubin)
    listings = sass_text(cubin)
    assert len(kernels) == len(listings) == len(FAMILY.name_expressions())
    assert sum("_cluster2" in name for name in kernels) == len(DTYPES) * len(_scores.SCORES_TILES)
    for name, ops in kernels.items():
        half_n = int(name.split("ELi")[0].split("Li")[-1])  # ..._sm90I6__halfLi256ELi3EE...: the first int argument
        text = listings[name]
        assert f"HGMMA.64x{half_n}x16.F32" in text, f"{name}: no HGMMA.64x{half_n}x16"
        for op in ("HGMMA", "UTMALDG", "SYNCS", "USETMAXREG"):
            assert ops.get(op, 0) > 0, f"{name}: no {op} in the SASS"
        for op in ("LDL", "STL"):
            assert op not in ops, f"{name}: local memory ({op}: {ops[op]})"
        cluster = "_cluster2" in name
        assert ("UTMALDG.4D.MULTICAST" in text) == cluster, f"{name}: multicast K loads iff the cluster kernel"
        assert ("SYNCS.ARRIVE.TRANS64.RED" in text) == cluster, f"{name}: remote arrivals iff the cluster kernel"
        assert (ops.get("UCGABAR_ARV", 0) == 3 and ops.get("UCGABAR_WAIT", 0) == 3) == cluster, \
            f"{name}: cluster barriers (init, consumers' exit, producers' exit) iff the cluster kernel"
        if cluster:
            assert ops.get("MEMBAR", 0) == 4, f"{name}: MEMBAR.CTA+GPU before each of the two exit arrives only"


def test_tiles():
    declared = set(FAMILY.name_expressions())
    for half_n, tile in _scores.SCORES_TILES.items():
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


def emulate_epilogue(s_block, S, rows, c, half_n, ld):
    """The kernel's epilogue, lane by lane, in float32: s_block (64, 2·half_n) = one CTA's raw scores (columns past S
    are the products with TMA's zero rows of K: 0); rows = valid query rows of the block; c = scale·log2 e. Returns
    (P (64, ld) float64 with NaN where nothing was written, lse (64,), writes per element)."""
    f32 = np.float32
    P = np.full((64, ld), np.nan)
    writes = np.zeros((64, ld), int)
    lse = np.full(64, np.nan)
    n_acc = half_n // 2
    acc = np.zeros((2, 4, 32, n_acc), f32)  # [warpgroup][warp][lane][register]
    for wg in range(2):
        for warp in range(4):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for j in range(half_n // 8):
                    for half in range(2):
                        for e in range(2):
                            acc[wg, warp, lane, 4 * j + 2 * half + e] = s_block[warp * 16 + g + 8 * half,
                                                                                 wg * half_n + 8 * j + 2 * t + e]
    # Mask past S, per warpgroup whose keys reach past it.
    for wg in range(2):
        n0 = wg * half_n
        if n0 + half_n > S:
            for lane in range(32):
                lim = S - n0 - 2 * (lane % 4)
                for j in range(half_n // 8):
                    for e in range(2):
                        if 8 * j + e >= lim:
                            acc[wg, :, lane, 4 * j + e] = acc[wg, :, lane, 4 * j + 2 + e] = -np.inf
    lanes = np.arange(32)

    def quad(x, op):  # __shfl_xor_sync with 1, then 2, along the lane axis
        x = op(x, x[:, :, lanes ^ 1])
        return op(x, x[:, :, lanes ^ 2])

    mx = np.stack([np.max(acc[..., [4 * j + 2 * h + e for j in range(half_n // 8) for e in range(2)]], axis=-1)
                   for h in range(2)], axis=-1)  # [wg][warp][lane][half]
    mx = quad(mx, np.maximum)
    row_max = np.full((2, 64), np.nan, f32)
    for wg in range(2):
        for warp in range(4):
            for lane in range(0, 32, 4):  # t == 0
                for h in range(2):
                    row_max[wg, warp * 16 + lane // 4 + 8 * h] = mx[wg, warp, lane, h]
    m_c = np.zeros_like(mx)
    for wg in range(2):
        for warp in range(4):
            for lane in range(32):
                for h in range(2):
                    m_c[wg, warp, lane, h] = f32(max(mx[wg, warp, lane, h],
                                                     row_max[wg ^ 1, warp * 16 + lane // 4 + 8 * h]) * f32(c))
    x = acc.copy()
    sums = np.zeros_like(mx)
    for j in range(half_n // 8):
        for h in range(2):
            for e in range(2):
                i = 4 * j + 2 * h + e
                with np.errstate(invalid="ignore"):
                    x[..., i] = np.exp2(x[..., i] * f32(c) - m_c[..., h])
                sums[..., h] += x[..., i]
    sums = quad(sums, np.add)
    row_sum = np.full((2, 64), np.nan, f32)
    for wg in range(2):
        for warp in range(4):
            for lane in range(0, 32, 4):
                for h in range(2):
                    row_sum[wg, warp * 16 + lane // 4 + 8 * h] = sums[wg, warp, lane, h]
    for wg in range(2):
        n0 = wg * half_n
        for warp in range(4):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for h in range(2):
                    r = warp * 16 + g + 8 * h
                    l_sum = sums[wg, warp, lane, h] + row_sum[wg ^ 1, r]
                    inv = f32(1) / l_sum
                    if wg == 0 and t == 0 and r < rows:
                        lse[r] = (m_c[wg, warp, lane, h] + np.log2(l_sum)) * np.log(2)
                    if r >= rows:
                        continue
                    col0 = n0 + 2 * t
                    lim = S - n0 - 2 * t
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


def emulate_pipeline(k_blocks, stages, cluster_m, *, load_hi=True, rows_ok=(True, True), half_n=256, seed=0,
                     mutation=None):
    """The scores kernel's TMA/mbarrier protocol (scores_softmax_sm90.cu: scores_softmax), transcribed step by step
    for cluster_m CTAs of one cluster and run under a random interleaving (``seed``): per CTA the producer thread and
    the 8 consumer warps (lane 0 stands for its warp), with the kernel's barrier counts, parities, expect_tx bytes,
    box assignment (rank r multicasts K box r; rank 1 loads none when S ≤ kHalfN, ``load_hi`` False) and cluster
    barriers. TMA boxes land as separate events in any order, one per destination CTA; remote arrivals too, each
    before its thread's cluster_arrive.release. rows_ok[r]: CTA r has rows below L (False: the padding CTA, no Q).

    Checks: a box never lands in a stage some warp of that CTA has not finished reading (write after read); a warp
    past full[s] finds Q (where loaded) and its K boxes of that very k block (read after write); nothing lands in or
    arrives on an exited CTA; no deadlock. ``mutation`` breaks the protocol on purpose (the tests show each one is
    caught): "local_empty" (empty barriers count 8 local warps, no remote arrivals), "no_exit_barrier",
    "own_bytes_only" (full barriers expect only the bytes this CTA's producer loads). Raises ProtocolError."""
    import random
    rng = random.Random(seed)
    q_bytes, box_bytes = 64 * 128, half_n * 128
    ctas = range(cluster_m)
    remote = cluster_m > 1 and mutation != "local_empty"
    full = [[_MBarrier(1) for _ in range(stages)] for _ in ctas]
    empty = [[_MBarrier(8 * (cluster_m if remote else 1)) for _ in range(stages)] for _ in ctas]
    tags = [[{} for _ in range(stages)] for _ in ctas]  # [cta][stage][part] = k block of the data there
    finished = [[0] * k_blocks for _ in ctas]  # warps done reading k block kb in CTA c
    alive = [9] * cluster_m  # threads (producer + 8 warps) not yet exited, per CTA
    events = []  # in flight: (kind, destination cta, ...)
    unflushed = {}  # thread -> its remote arrivals still in flight
    cluster_bar = [0]  # arrivals at the cluster barrier (two phases: after init, before exit)
    n_threads = 9 * cluster_m

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
        for kb in range(k_blocks):
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
        for kb in range(k_blocks):
            s = kb % stages
            yield lambda kb=kb, s=s: full[c][s].ready((kb // stages) & 1)
            need = (["q"] if rows_ok[c] else []) + boxes
            if any(tags[c][s].get(part) != kb for part in need):
                raise ProtocolError(f"CTA {c} warp {w} read stage {s} for k block {kb}: holds {tags[c][s]}")
            if kb > 0:  # wgmma.wait_group 1: k block kb − 1 is read; release its stage
                finished[c][kb - 1] += 1
                empty[c][(kb - 1) % stages].arrive()
                if remote:
                    events.append(("arrive", c ^ 1, (kb - 1) % stages, me))
                    unflushed[me] = unflushed.get(me, 0) + 1
            yield lambda: True
        finished[c][k_blocks - 1] += 1  # wait_group 0
        if cluster_m > 1 and mutation != "no_exit_barrier":
            yield from cluster_sync(2, me)
        alive[c] -= 1

    threads = [producer(c) for c in ctas] + [consumer(c, w) for c in ctas for w in range(8)]
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
        ev = events.pop(i)
        c = ev[1]
        if alive[c] == 0:
            raise ProtocolError(f"{ev[0]} reached CTA {c} after it exited")
        if ev[0] == "arrive":
            empty[c][ev[2]].arrive()
            unflushed[ev[3]] -= 1
            continue
        _, c, s, part, kb, n = ev
        if kb >= stages and finished[c][kb - stages] < 8:
            raise ProtocolError(f"k block {kb} ({part}) landed in CTA {c} stage {s} while k block {kb - stages} "
                                f"was read by {8 - finished[c][kb - stages]} warps")
        tags[c][s][part] = kb
        full[c][s].complete_tx(n)
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
    with pytest.raises(ValueError, match="cluster_m"):
        _scores.grid_for(1, 1, 64, 4)


# ---------------------------------------------------------------------------------------------------------------------
# CPU: v3 (scores_softmax_sm90_m128 / _m128_cluster2, CUPY_ATTN_SPLIT_FUSED=3)

M128_FAMILY = _scores.SCORES_SOFTMAX_SM90_M128


def test_m128_every_instantiation_compiles_without_spills():
    """The one-CTA kernel at the four tiles and the two key clusters (Q multicast or not) at n = 192 and 256, both
    dtypes: 16 variants, clean."""
    reports = _compile.compile_family(M128_FAMILY, "sm_90a")
    assert len(reports) == (len(_scores.M128_TILES) + 2 + 2) * len(DTYPES)
    assert_clean(reports, max_registers=168)


def test_m128_sass():
    """v3: HGMMA.64xNx16 with N the CTA's keys, not serialized (DEPBAR.LE gsb0 0x1), TMA loads, setmaxnreg, no local
    memory. The key clusters also: the two remote statistics stores (ST.E.64 through the cluster window) and their
    two shared-memory reads, three cluster barriers (init; the exchange, in the consumers' and the producer's code),
    MEMBAR (CTA + GPU before each release arrive) and CCTL.IVALL (after each acquire wait) outside the mainloop; with
    the Q multicast (…_cluster2) multicast loads and remote arrivals, without it (…_localq) neither; the one-CTA
    kernel none of these."""
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    cubin = _compile.family_cubin(M128_FAMILY, "sm_90a")
    kernels = sass_summary(cubin)
    listings = sass_text(cubin)
    assert len(kernels) == len(listings) == len(M128_FAMILY.name_expressions())
    assert sum("_cluster2" in name for name in kernels) == 2 * 2 * len(DTYPES)
    for name, ops in kernels.items():
        n = int(name.split("ELi")[0].split("Li")[-1])
        text = listings[name]
        assert f"HGMMA.64x{n}x16.F32" in text, f"{name}: no HGMMA.64x{n}x16"
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in text, f"{name}: wgmma not kept in flight"
        for op in ("HGMMA", "UTMALDG", "SYNCS", "USETMAXREG"):
            assert ops.get(op, 0) > 0, f"{name}: no {op} in the SASS"
        for op in ("LDL", "STL"):
            assert op not in ops, f"{name}: local memory ({op}: {ops[op]})"
        cluster = "_cluster2" in name
        multicast = cluster and "_localq" not in name
        assert ("UTMALDG.4D.MULTICAST" in text) == multicast, f"{name}: multicast Q loads iff the multicast cluster"
        assert ("SYNCS.ARRIVE.TRANS64.RED" in text) == multicast, f"{name}: remote arrivals iff the multicast cluster"
        barriers = (ops.get("UCGABAR_ARV", 0), ops.get("UCGABAR_WAIT", 0))
        assert barriers == ((3, 3) if cluster else (0, 0)), f"{name}: cluster barriers {barriers}"
        if not cluster:
            assert not {"MEMBAR", "CCTL", "ST", "LDS"} & set(ops), f"{name}: {ops}"
            continue
        assert ops.get("ST") == 2 and ops.get("LDS") == 2, f"{name}: the statistics exchange: {ops}"
        lines = [line for line in text.split("\n") if re.search(r"/\*[0-9a-f]{4}\*/", line)]
        for op, count in (("MEMBAR", 4), ("CCTL.IVALL", 3)):
            assert sum(op in line for line in lines) == count, f"{name}: {op} count"
        mma = [i for i, line in enumerate(lines) if "HGMMA" in line]
        mainloop = lines[mma[0]:mma[-1]]
        assert not any("MEMBAR" in line or "CCTL" in line for line in mainloop), f"{name}: a fence in the mainloop"


def test_m128_tiles():
    declared = set(M128_FAMILY.name_expressions())
    for n, tile in _scores.M128_TILES.items():
        assert tile.n == n and n % 64 == 0 and n <= 256 and tile.stages >= 2
        assert tile.smem_bytes() <= 232448, tile
    for S in range(1, 513):
        cluster, tile = _scores.m128_tile_for(S)
        assert cluster == (1 if S <= 256 else 2), S
        assert cluster * tile.n >= S and tile.n - 64 < -(-S // cluster), (S, tile)
        assert (cluster - 1) * tile.n < S, f"S={S}: the last CTA of the cluster holds no key"
        for dtype in ("__half", "__nv_bfloat16"):
            assert M128_FAMILY.name_expression(kernel=_scores.kernel_name(3, S), dtype=dtype, tile=tile) in declared
            assert M128_FAMILY.name_expression(kernel=_scores.kernel_name(4, S), dtype=dtype, tile=tile) in declared
        assert _scores.kernel_name(3, S) == _scores.M128_KERNELS[cluster]
        assert _scores.kernel_name(4, S) == (_scores.M128_LOCAL_Q_KERNEL if cluster == 2 else _scores.M128_KERNELS[1])
    for S in (0, 513):
        with pytest.raises(ValueError, match="seqlen_k"):
            _scores.m128_tile_for(S)
    with pytest.raises(ValueError, match="variant"):
        _scores.kernel_name(5, 100)
    for L in (1, 64, 127, 128, 129, 513):
        for S, cluster in ((200, 1), (300, 2)):
            assert _scores.m128_grid_for(3, 5, L, S) == (cluster * -(-L // 128), 5, 3)


def emulate_epilogue_m128(s_rows, S, rows, c, n, cluster):
    """v3's epilogue, lane by lane, in float32, for one row block: s_rows (128, cluster·n) = the raw scores of its
    128 rows × the cluster's keys (columns past S: products with TMA's zero rows of K, 0; rows past L where the
    second Q box was not loaded: whatever the stale shared memory gave, any value); rows = valid query rows of the
    block; c = scale·log2 e. Per CTA of the cluster (rank r: keys r·n ...) and warpgroup (rows 64·wg ...): the
    accumulator layout, −inf past S, quad shuffles, and with a cluster the statistics store into the peer's shared
    memory (each slot written once), the merge, the stores. Returns (P (128, ld) float64 with NaN where nothing was
    written, lse (128,), P writes per element, lse writes per row, {(rank, row): (m, l)} after the merge)."""
    with np.errstate(all="ignore"):  # garbage rows past L: NaN and inf on purpose
        return _emulate_epilogue_m128(s_rows, S, rows, c, n, cluster)


def _emulate_epilogue_m128(s_rows, S, rows, c, n, cluster):
    f32 = np.float32
    c = f32(c)
    ld = -(-S // 8) * 8
    P = np.full((128, ld), np.nan)
    writes = np.zeros((128, ld), int)
    lse = np.full(128, np.nan)
    lse_writes = np.zeros(128, int)
    lanes = np.arange(32)
    g, t = lanes // 4, lanes % 4
    js = np.arange(n // 8)
    # acc[rank][wg][warp][lane][j][half][e] = row 64·wg + 16·warp + g + 8·half, key rank·n + 8j + 2t + e
    row = (64 * np.arange(2)[:, None, None, None, None, None] + 16 * np.arange(4)[None, :, None, None, None, None]
           + g[None, None, :, None, None, None] + 8 * np.arange(2)[None, None, None, None, :, None])
    col = 8 * js[None, None, None, :, None, None] + 2 * t[None, None, :, None, None, None] + np.arange(2)
    row, col = np.broadcast_arrays(row, col)
    stats = {}
    merged = {}
    partial = []
    for rank in range(cluster):
        n0 = rank * n
        acc = s_rows[row, n0 + col].astype(f32)
        if n0 + n > S:  # the kernel's test: 8j + e >= S − n0 − 2t
            acc = np.where(col >= S - n0, f32(-np.inf), acc)
        mx = acc.max(axis=(3, 5))  # [wg][warp][lane][half]: this lane's columns
        for x in (1, 2):  # __shfl_xor_sync
            mx = np.maximum(mx, mx[:, :, lanes ^ x])
        m_c = (mx * c).astype(f32)
        x = np.exp2((acc.astype(np.float64) * c - m_c[:, :, :, None, :, None]).astype(f32)).astype(f32)
        sums = np.zeros_like(m_c)
        for j in range(n // 8):
            for half in range(2):
                for e in range(2):
                    sums[..., half] += x[:, :, :, j, half, e]
        for sh in (1, 2):
            sums = (sums + sums[:, :, lanes ^ sh]).astype(f32)
        partial.append((m_c, sums, x))
        if cluster > 1:  # lanes t == 0 store (m·c, l) of their two rows into the peer's peer_stats[row]
            for wg in range(2):
                for warp in range(4):
                    for lane in range(0, 32, 4):
                        for half in range(2):
                            r = 64 * wg + 16 * warp + lane // 4 + 8 * half
                            key = (rank ^ 1, r)
                            assert key not in stats, f"peer_stats[{r}] of CTA {rank ^ 1} written twice"
                            stats[key] = (m_c[wg, warp, lane, half], sums[wg, warp, lane, half])
    if cluster > 1:
        assert len(stats) == 2 * 128, "every row's statistics reach the peer"
    for rank in range(cluster):
        n0 = rank * n
        m_c, sums, x = partial[rank]
        for wg in range(2):
            for warp in range(4):
                for lane in range(32):
                    gg, tt = lane // 4, lane % 4
                    for half in range(2):
                        r = 64 * wg + 16 * warp + gg + 8 * half
                        if cluster > 1:
                            peer_m, peer_l = stats[(rank, r)]
                            m = max(m_c[wg, warp, lane, half], peer_m)
                            alpha = f32(np.exp2(f32(m_c[wg, warp, lane, half] - m)))
                            own = f32(sums[wg, warp, lane, half] * alpha)
                            other = f32(peer_l * f32(np.exp2(f32(peer_m - m))))
                            l_sum = f32(own + other)
                            f = f32(alpha / l_sum)
                            lse_c = f32(m + f32(np.log2(l_sum)))
                        else:
                            m, l_sum = m_c[wg, warp, lane, half], sums[wg, warp, lane, half]
                            f = f32(f32(1) / l_sum)
                            lse_c = f32(m + f32(np.log2(l_sum)))
                        merged[(rank, r)] = (m, l_sum)
                        if r >= rows:
                            continue
                        if rank == 0 and tt == 0:
                            lse[r] = lse_c * np.log(2)
                            lse_writes[r] += 1
                        lim = S - n0 - 2 * tt
                        full_tile = n0 + n <= S
                        for j in range(n // 8):
                            v0, v1 = f32(x[wg, warp, lane, j, half, 0] * f), f32(x[wg, warp, lane, j, half, 1] * f)
                            c0 = n0 + 8 * j + 2 * tt
                            if full_tile or 8 * j + 1 < lim:
                                P[r, c0], P[r, c0 + 1] = v0, v1
                                writes[r, c0] += 1
                                writes[r, c0 + 1] += 1
                            elif 8 * j < lim:
                                P[r, c0] = v0
                                writes[r, c0] += 1
    return P, lse, writes, lse_writes, merged


@pytest.mark.parametrize("S", [1, 7, 64, 100, 129, 200, 256, 257, 300, 384, 385, 511, 512])
@pytest.mark.parametrize("rows", [128, 77, 13])
def test_m128_epilogue_emulation_matches_softmax(S, rows):
    """v3's epilogue (one CTA for S ≤ 256, the key cluster's exchange and merge above) gives the float64 softmax and
    lse, writes every element of P[:L, :S] once (and lse once per row, by rank 0), nothing past L or S; both CTAs of
    a cluster merge to the same (m, l) bit for bit; rows past L whose scores are garbage (a second Q box not loaded:
    rows < 64, stale shared memory, here NaN and ±inf) leave nothing behind."""
    rng = np.random.default_rng(S * 1000 + rows)
    cluster, tile = _scores.m128_tile_for(S)
    n = tile.n
    scale = 0.37
    s = np.zeros((128, cluster * n), np.float32)
    s[:, :S] = rng.standard_normal((128, S)).astype(np.float32) * 6  # large logits: the max matters
    if cluster > 1:  # a row whose max lies in rank 1's keys only, and one in rank 0's only
        s[0, n:S] += 40
        s[1, :n] += 40
    if rows <= 64:
        s[64:] = rng.choice(np.array([np.nan, np.inf, -np.inf, 1e30], np.float32), size=(64, cluster * n))
    P, lse, writes, lse_writes, merged = emulate_epilogue_m128(s, S, rows, scale * 1.4426950408889634, n, cluster)
    z = s[:rows, :S].astype(np.float64) * scale
    ref = np.exp(z - z.max(-1, keepdims=True))
    ref_lse = np.log(ref.sum(-1)) + z.max(-1)
    ref /= ref.sum(-1, keepdims=True)
    assert (writes[:rows, :S] == 1).all(), "every element of P[:L, :S] is written once"
    assert (writes[rows:] == 0).all() and (writes[:, S:] == 0).all(), "nothing past L or S is written"
    assert (lse_writes[:rows] == 1).all() and (lse_writes[rows:] == 0).all()
    np.testing.assert_allclose(P[:rows, :S], ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lse[:rows], ref_lse, rtol=1e-5, atol=1e-5)
    if cluster > 1:
        for r in range(rows):
            assert merged[(0, r)] == merged[(1, r)], f"row {r}: the two CTAs merged to different (m, l)"


def emulate_pipeline_m128(k_blocks, stages, cluster, *, q_hi=True, multicast=True, n=256, seed=0, mutation=None):
    """v3's TMA/mbarrier protocol (scores_softmax_sm90.cu: scores_softmax_m128), step by step for the CTAs of one
    cluster (``cluster`` 1 or 2) under a random interleaving (``seed``): per CTA the producer thread (thread 0, which
    also initializes the barriers) and the 8 consumer warps. With a key cluster rank r multicasts Q box r (rows
    64r ...; rank 1 none when ``q_hi`` is False: rows m0 + 64 ... all past L) into both CTAs and loads its K box
    locally; full[s] expects both Q boxes (one without q_hi) and the K box; empty[s] takes 16 arrivals (each warp
    arrives locally and on the peer); after the mainloop each warp stores its rows' statistics into the peer and
    every thread meets at the cluster barrier (remote arrivals and stores performed first: arrive.release), then
    reads the statistics the peer stored and exits. ``multicast`` False (…_localq): each CTA loads both its Q boxes,
    empty[s] takes the 8 local arrivals. TMA boxes, remote arrivals and stores land as separate events in any order.

    Checks as emulate_pipeline's (write after read, read before land, access to an exited CTA, deadlock), and: no
    box or remote arrival reaches barriers not yet initialized; a warp reads its rows' statistics only after the
    peer's store has landed. ``mutation``: "local_empty", "own_bytes_only", "no_init_barrier", "no_exchange_barrier"
    (the consumers skip the exchange barrier). Raises ProtocolError."""
    import random
    rng = random.Random(seed)
    q_box, k_box = 64 * 128, n * 128
    ctas = range(cluster)
    multicast = multicast and cluster > 1
    remote = multicast and mutation != "local_empty"
    full = [[_MBarrier(1) for _ in range(stages)] for _ in ctas]
    empty = [[_MBarrier(8 * (cluster if remote else 1)) for _ in range(stages)] for _ in ctas]
    ready = [False] * cluster  # barriers initialized (thread 0, before the first cluster barrier)
    tags = [[{} for _ in range(stages)] for _ in ctas]
    finished = [[0] * k_blocks for _ in ctas]
    stats = [[False] * 8 for _ in ctas]  # [cta][warp]: the peer warp's statistics have landed here
    alive = [9] * cluster
    events = []
    unflushed = {}
    bar = [0]
    n_threads = 9 * cluster

    def sync(phase, me):
        while unflushed.get(me):  # arrive.release
            yield lambda: not unflushed.get(me)
        bar[0] += 1
        yield lambda: bar[0] >= phase * n_threads

    def send(kind, dest, *rest, me):
        events.append((kind, dest, *rest, me))
        unflushed[me] = unflushed.get(me, 0) + 1

    q_parts = ["q0", "q1"] if q_hi else ["q0"]
    exchange = 1 if mutation == "no_init_barrier" else 2  # the exchange barrier's phase (1-based)

    def producer(c):
        me = (c, "producer")
        ready[c] = True
        if mutation != "no_init_barrier":
            yield from sync(1, me)
        expect = q_box * len(q_parts) + k_box
        if mutation == "own_bytes_only" and multicast:
            expect = (q_box if c == 0 or q_hi else 0) + k_box
        for kb in range(k_blocks):
            s = kb % stages
            yield lambda kb=kb, s=s: empty[c][s].ready(((kb // stages) & 1) ^ 1)
            full[c][s].arrive(tx=expect)
            if not multicast:
                events.extend(("box", c, s, part, kb, q_box, None) for part in q_parts)
            elif c == 0 or q_hi:  # Q box `rank`, multicast to both CTAs
                events.extend(("box", d, s, f"q{c}", kb, q_box, None) for d in ctas)
            events.append(("box", c, s, "k", kb, k_box, None))
            yield lambda: True
        if cluster > 1:
            yield from sync(exchange, me)
        alive[c] -= 1

    def consumer(c, w):
        me = (c, w)
        if mutation != "no_init_barrier":
            yield from sync(1, me)
        wg = w // 4
        need = ([f"q{wg}"] if f"q{wg}" in q_parts else []) + ["k"]
        for kb in range(k_blocks):
            s = kb % stages
            yield lambda kb=kb, s=s: full[c][s].ready((kb // stages) & 1)
            if any(tags[c][s].get(part) != kb for part in need):
                raise ProtocolError(f"CTA {c} warp {w} read stage {s} for k block {kb}: holds {tags[c][s]}")
            if kb > 0:
                finished[c][kb - 1] += 1
                empty[c][(kb - 1) % stages].arrive()
                if remote:
                    send("arrive", c ^ 1, (kb - 1) % stages, me=me)
            yield lambda: True
        finished[c][k_blocks - 1] += 1
        if cluster > 1:
            send("stats", c ^ 1, w, me=me)
            if mutation != "no_exchange_barrier":
                yield from sync(exchange, me)
            else:
                bar[0] += 1  # the producers' barrier still completes
            if not stats[c][w]:
                raise ProtocolError(f"CTA {c} warp {w} read the peer's statistics before they landed")
        alive[c] -= 1

    threads = [producer(c) for c in ctas] + [consumer(c, w) for c in ctas for w in range(8)]
    blocked = {i: None for i in range(len(threads))}
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
        ev = events.pop(i)
        c, me = ev[1], ev[-1]
        if alive[c] == 0:
            raise ProtocolError(f"{ev[0]} reached CTA {c} after it exited")
        if ev[0] in ("arrive", "box") and not ready[c]:
            raise ProtocolError(f"{ev[0]} reached CTA {c} before its barriers were initialized")
        if ev[0] == "arrive":
            empty[c][ev[2]].arrive()
        elif ev[0] == "stats":
            stats[c][ev[2]] = True
        else:
            _, c, s, part, kb, nbytes, _ = ev
            if kb >= stages and finished[c][kb - stages] < 8:
                raise ProtocolError(f"k block {kb} ({part}) landed in CTA {c} stage {s} while k block {kb - stages} "
                                    f"was read by {8 - finished[c][kb - stages]} warps")
            tags[c][s][part] = kb
            full[c][s].complete_tx(nbytes)
            continue
        unflushed[me] -= 1
    if any(alive):
        raise ProtocolError(f"threads never exited: {alive}")


M128_PIPELINE_CASES = [  # (k_blocks, stages, q_hi)
    (1, 4, True), (2, 4, True), (5, 4, True), (16, 4, True), (16, 5, False), (3, 8, True), (9, 6, False),
    (4, 4, False),
]


@pytest.mark.parametrize("cluster,multicast", [(1, False), (2, True), (2, False)],
                         ids=["one_cta", "key_cluster", "key_cluster_localq"])
@pytest.mark.parametrize("k_blocks,stages,q_hi", M128_PIPELINE_CASES)
def test_m128_pipeline_protocol_under_random_interleavings(k_blocks, stages, q_hi, cluster, multicast):
    """v3's barrier protocol, one CTA and the key clusters (Q multicast or loaded by each CTA; statistics exchange),
    with and without the second Q box, over 150 random interleavings each: no hazard, no deadlock, clean exit."""
    for seed in range(150):
        emulate_pipeline_m128(k_blocks, stages, cluster, q_hi=q_hi, multicast=multicast, seed=seed)


@pytest.mark.parametrize("mutation,words,multicast", [
    ("local_empty", ("while k block",), True), ("own_bytes_only", ("read stage",), True),
    ("no_init_barrier", ("before its barriers were initialized",), True),
    ("no_exchange_barrier", ("before they landed", "after it exited"), True),
    ("no_exchange_barrier", ("before they landed", "after it exited"), False)])
def test_m128_pipeline_emulation_catches_a_broken_protocol(mutation, words, multicast):
    """Each deliberate break of v3's cluster protocol is caught within 300 interleavings: without remote releases
    the peer's multicast Q overwrites a stage still read; a full barrier expecting only its own producer's bytes lets
    the consumers read before the peer's Q box landed; without the barrier after the initialization a box or an
    arrival can reach uninitialized barriers; without the exchange barrier a warp reads statistics not yet stored
    (or a store reaches an exited CTA)."""
    for seed in range(300):
        try:
            emulate_pipeline_m128(8, 3, 2, multicast=multicast, seed=seed, mutation=mutation)
        except ProtocolError as exc:
            assert any(w in str(exc) for w in words), str(exc)
            return
    pytest.fail(f"mutation {mutation} went unnoticed in 300 interleavings")


def _problem(**kw):
    import types
    q = _bhsd(2, 4, 100, 1024)
    p = dict(query=q, key=_bhsd(2, 4, 300, 1024), value=_bhsd(2, 4, 300, 1024), mask=None, causal=None,
             dropout_p=0.0, scale=0.03, dtype=np.dtype("float16"), seqlen_k=300)
    return types.SimpleNamespace(**{**p, **kw})


def test_unsupported_reasons():
    if _scores.unsupported_reason(_problem(), 90) is not None:
        pytest.skip(_scores.unsupported_reason(_problem(), 90))  # cuda-bindings missing
    assert _scores.unsupported_reason(_problem(dtype=np.dtype("bfloat16")), 90) is None
    for kw, arch, words in (({}, 80, "sm_80"), ({"dtype": np.dtype("float32")}, 90, "float32"),
                            ({"seqlen_k": 513}, 90, "512"), ({"causal": "top_left"}, 90, "is_causal"),
                            ({"mask": object()}, 90, "attn_mask"), ({"dropout_p": 0.1}, 90, "dropout"),
                            ({"scale": -1.0}, 90, "scale"), ({"key": _bhsd(2, 4, 300, 1024, ptr=(1 << 20) + 8)}, 90,
                                                             "16-byte")):
        why = _scores.unsupported_reason(_problem(**kw), arch)
        assert why is not None and words in why, (kw, why)


def test_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv(_scores.ENV_SPLIT_FUSED, raising=False)
    assert _scores.enabled() and _scores.setting() == 1  # on by default (measured: scores_sm90.setting)
    for value, setting in (("1", 1), ("2", 2), ("3", 3), ("4", 4), ("0", 0), ("5", 1), ("yes", 1)):
        monkeypatch.setenv(_scores.ENV_SPLIT_FUSED, value)
        assert _scores.setting() == setting and _scores.enabled() == (setting > 0), value
    from cupy_attn.runtime import callcache
    assert _scores.ENV_SPLIT_FUSED in callcache.ENV_KEYS, "a cached call must not replay the other schedule"


def test_split_details_name_the_variant(monkeypatch):
    """explain()'s split-path details under CUPY_ATTN_SPLIT_FUSED=1-4: the kernel the switch and S take, its tile."""
    from cupy_attn.attention import dispatch
    for S, v3, v4 in ((300, "scores_softmax_sm90_m128_cluster2", "scores_softmax_sm90_m128_cluster2_localq"),
                      (200, "scores_softmax_sm90_m128", "scores_softmax_sm90_m128")):
        p = _problem(seqlen_k=S, key=_bhsd(2, 4, S, 1024), value=_bhsd(2, 4, S, 1024), batch=2, num_heads=4,
                     seqlen_q=100)
        if _scores.unsupported_reason(p, 90) is not None:
            pytest.skip(_scores.unsupported_reason(p, 90))  # cuda-bindings missing
        for value, name, tile in (("1", "scores_softmax_sm90", "64 rows x"), ("2", "scores_softmax_sm90_cluster2",
                                                                              "64 rows x"), ("3", v3, "128 rows x"),
                                  ("4", v4, "128 rows x")):
            monkeypatch.setenv(_scores.ENV_SPLIT_FUSED, value)
            details = dispatch.split_details(p, 90)
            assert details["schedule"].startswith(name + " ") and f"={value})" in details["schedule"], details
            assert details["scores kernel"].startswith(tile), details
            assert ("along the keys" in details["scores kernel"]) == (S > 256 and value in "34"), details


# ---------------------------------------------------------------------------------------------------------------------
# GPU

def _torch():
    return pytest.importorskip("torch")


def _run_kernel(q, k, scale, ld, variant=1):
    """The kernel alone (variant: 1 = scores_softmax_sm90, 2 = scores_softmax_sm90_cluster2, 3 / 4 = the v3 kernel
    its seqlen_k takes, scores_sm90.kernel_name) on torch CUDA tensors (passed as CuPy views): (P (B, Hq, L, ld),
    lse (B, Hq, L)) as torch tensors, both NaN-poisoned before the launch and each followed in memory by a poisoned
    tail of 64 rows that must stay NaN (the last row block, or a cluster's padding CTA, writing past L would land
    there)."""
    import cupy
    torch = _torch()
    B, Hq, L, _ = q.shape
    n_p, n_lse = B * Hq * L * ld, B * Hq * L
    P_all = torch.full((n_p + 64 * ld,), float("nan"), dtype=q.dtype, device=q.device)
    lse_all = torch.full((n_lse + 64,), float("nan"), dtype=torch.float32, device=q.device)
    P, lse = P_all[:n_p].view(B, Hq, L, ld), lse_all[:n_lse].view(B, Hq, L)
    cq, ck, clse = cupy.from_dlpack(q), cupy.from_dlpack(k), cupy.from_dlpack(lse)
    launch = _scores.prepare(cq, ck, clse, scale=scale, ld=ld, variant=variant)
    assert launch.grid[0] % launch.cluster == 0, launch.grid
    rows = launch.grid[0] // launch.cluster * 128 if variant >= 3 else launch.grid[0] * 64
    assert rows >= L > rows - (128 if variant >= 3 else 64 * launch.cluster), (launch.grid, L)
    launch(cq.data.ptr, ck.data.ptr, P.data_ptr(), lse.data_ptr())
    torch.cuda.synchronize()
    assert bool(torch.isnan(P_all[n_p:]).all()) and bool(torch.isnan(lse_all[n_lse:]).all()), \
        f"variant {variant}: the kernel wrote past the last row of P or lse"
    return P, lse


def _reference(q, k, scale):
    """float64 P and lse from the same (rounded) inputs; GQA by head index h // groups."""
    q64, k64 = as_f64(q), as_f64(k)
    groups = q64.shape[1] // k64.shape[1]
    k64 = np.repeat(k64, groups, axis=1)
    z = (q64 @ k64.swapaxes(-1, -2)) * scale
    m = z.max(-1, keepdims=True)
    e = np.exp(z - m)
    return e / e.sum(-1, keepdims=True), np.log(e.sum(-1)) + m[..., 0]


def _torch_softmax(q, k, scale):
    """torch's same-precision P: softmax(Q Kᵀ · scale) with the GEMM and the softmax in the input dtype."""
    torch = _torch()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1)


def _check_kernel(B, Hq, Hkv, L, S, D, dtype, layout="bhsd", seed=0, variant=1, q_scale=1.0):
    """One launch of the kernel alone against the float64 softmax; q_scale multiplies the queries (large logits: the
    test asserts a scaled score above 20 somewhere)."""
    torch = _torch()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)

    def rand(b, h, n, mult=1.0):
        if layout == "bshd":  # read in place through the tensor maps' strides
            return (torch.randn(b, n, h, D, generator=gen, device="cuda") * mult).to(dt).transpose(1, 2)
        return (torch.randn(b, h, n, D, generator=gen, device="cuda") * mult).to(dt)

    q, k = rand(B, Hq, L, q_scale), rand(B, Hkv, S)
    scale = D ** -0.5
    ld = -(-S // 8) * 8
    P, lse = _run_kernel(q, k, scale, ld, variant)
    ref, ref_lse = _reference(q, k, scale)
    what = f"(B,Hq,Hkv,L,S,D)=({B},{Hq},{Hkv},{L},{S},{D}) {dtype} {layout} variant={variant} q_scale={q_scale}"
    if q_scale > 1:  # a row's max scaled score is lse + log max_j P
        assert (ref_lse + np.log(ref.max(-1))).max() > 20, what
    assert_close(P[..., :S], ref, dtype, _torch_softmax(q, k, scale), what)
    if ld > S:
        assert bool(torch.isnan(P[..., S:]).all()), f"{what}: the kernel wrote padding columns past S"
    np.testing.assert_allclose(as_f64(lse), ref_lse, rtol=1e-4, atol=2e-3, err_msg=what)


VARIANT_IDS = {1: "cluster1", 2: "cluster2", 3: "m128", 4: "m128_localq"}
VARIANTS = pytest.mark.parametrize("variant", _scores.VARIANTS, ids=lambda v: VARIANT_IDS[v])


@pytest.mark.gpu
@VARIANTS
def test_smoke(variant):
    """One small case per kernel: run first (a barrier mistake hangs; run under timeout), the one-CTA kernel
    (-k "smoke and cluster1") before the cluster kernels (-k "smoke and cluster2", -k "smoke and m128"). L = 100:
    two row blocks (one cluster of v2), one v3 row block; S = 100: v3's one-CTA kernel."""
    _check_kernel(1, 2, 2, 100, 100, 320, "float16", variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [3, 4], ids=lambda v: VARIANT_IDS[v])
def test_smoke_m128_key_cluster(variant):
    """v3's key clusters (S = 300 > 256: two CTAs of 192 keys; Q multicast or not) on one row block of 100 rows
    (-k "smoke and m128")."""
    _check_kernel(1, 2, 2, 100, 300, 320, "float16", variant=variant)


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
]


@pytest.mark.gpu
@VARIANTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,L,S,D", CASES)
def test_kernel(B, Hq, Hkv, L, S, D, dtype, variant):
    _check_kernel(B, Hq, Hkv, L, S, D, dtype, variant=variant)


M128_CASES = [  # (B, Hq, Hkv, L, S, D) for v3: odd L, S ∈ {1, 64, 200, 256, 300, 512} and the tiles' edges, GQA
    (2, 4, 2, 77, 1, 320),       # one row block; its second Q box is loaded (77 > 64)
    (1, 3, 3, 129, 64, 512),     # 2 row blocks, the second of one row: no second Q box
    (2, 4, 1, 201, 200, 1024),   # GQA 4/1, n = 256 for 200 keys
    (1, 2, 2, 255, 256, 1000),   # the largest one-CTA tile, full
    (1, 1, 1, 33, 257, 320),     # the smallest key cluster (n = 192: rank 1 holds 65 keys), rows < 64
    (2, 6, 3, 333, 300, 512),    # GQA 2, key cluster n = 192
    (1, 2, 2, 191, 384, 256),    # n = 192, both CTAs full
    (1, 2, 2, 131, 385, 96),     # n = 256 (rank 1: 129 keys); E = 96: a half-filled second k block
    (1, 8, 2, 511, 512, 1024),   # GQA 4, the seed's tile
    (2, 3, 3, 1, 512, 1024),     # one row: a single Q box, both CTAs
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [3, 4], ids=lambda v: VARIANT_IDS[v])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,L,S,D", M128_CASES)
def test_kernel_m128(B, Hq, Hkv, L, S, D, dtype, variant):
    if variant == 4 and S <= 256:
        pytest.skip("S ≤ 256: variant 4 runs variant 3's one-CTA kernel")
    _check_kernel(B, Hq, Hkv, L, S, D, dtype, variant=variant, seed=L + S)


@pytest.mark.gpu
@VARIANTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S", [200, 300, 512])
def test_kernel_large_logits(S, dtype, variant):
    """Queries × 8: scaled scores up to ~35, rows nearly one-hot; with the key cluster, rows whose max lies in either
    CTA's keys (the merge rescales the other CTA's sum by a tiny 2^(m_r·c − m·c))."""
    _check_kernel(2, 4, 2, 97, S, 512, dtype, variant=variant, q_scale=8.0, seed=S)


@pytest.mark.gpu
@VARIANTS
def test_kernel_bshd_layout(variant):
    _check_kernel(2, 3, 3, 90, 300, 512, "bfloat16", layout="bshd", variant=variant)


@pytest.mark.gpu
@VARIANTS
@pytest.mark.parametrize("dtype", DTYPES)
def test_public_api_with_switch(monkeypatch, dtype, variant):
    """scaled_dot_product_attention under CUPY_ATTN_SPLIT_FUSED=1 (the one-CTA kernel), 2 (the cluster kernel), 3
    (v3; S = 300: its key cluster) or 4 (v3's key cluster without multicast) at a head dim no fused kernel serves:
    the split path's schedule is that kernel → cuBLAS P·V (explain() says so); out and lse against float64; a second
    call on new arrays replays the cached launch (new tensor maps)."""
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
        assert plan.backend == "split" and plan.details["schedule"].startswith(
            _scores.kernel_name(variant, 300) + " "), str(plan)
        out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, return_lse=True)
        ref, ref_lse = reference.scaled_dot_product_attention(*(as_f64(x) for x in (q, k, v)), return_lse=True)
        torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        assert_close(out, ref, dtype, torch_out, what=f"public call {seed}")
        np.testing.assert_allclose(as_f64(lse), ref_lse, rtol=1e-4, atol=2e-3)
    monkeypatch.setenv(_scores.ENV_SPLIT_FUSED, "0")
    plan = cupy_attn.explain(q, k, v)
    assert plan.details["scores kernel"].startswith("not used"), str(plan)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [3, 4], ids=lambda v: VARIANT_IDS[v])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S", [1, 64, 200, 256, 300, 512])
@pytest.mark.parametrize("q_scale", [1.0, 8.0], ids=["normal", "large_logits"])
def test_public_api_m128(monkeypatch, dtype, S, q_scale, variant):
    """v3 forced (CUPY_ATTN_SPLIT_FUSED=3, or 4 for S > 256) through scaled_dot_product_attention on the split path:
    GQA (8 query heads on 2), odd L = 133 (two row blocks, the second with 5 rows: one Q box), E = 320, Ev = 200;
    explain() names the kernel its S takes; out and lse against float64 and torch's same-precision error. Outputs
    poisoned first (NaN blocks of their sizes freed into torch's allocator), so an unwritten element fails."""
    import cupy_attn
    from cupy_attn import reference
    if variant == 4 and S <= 256:
        pytest.skip("S ≤ 256: variant 4 runs variant 3's one-CTA kernel")
    torch = _torch()
    monkeypatch.setenv(_scores.ENV_SPLIT_FUSED, str(variant))
    gen = torch.Generator(device="cuda").manual_seed(S)
    dt = getattr(torch, dtype)
    q = (torch.randn(2, 8, 133, 320, generator=gen, device="cuda") * q_scale).to(dt)
    k = torch.randn(2, 2, S, 320, generator=gen, device="cuda").to(dt)
    v = torch.randn(2, 2, S, 200, generator=gen, device="cuda").to(dt)
    plan = cupy_attn.explain(q, k, v, enable_gqa=True, backend="split")
    assert plan.details["schedule"].startswith(_scores.kernel_name(variant, S) + " "), str(plan)
    ref, ref_lse = reference.scaled_dot_product_attention(*(as_f64(x) for x in (q, k, v)), enable_gqa=True,
                                                          return_lse=True)
    if q_scale > 1:
        z = (as_f64(q) @ np.repeat(as_f64(k), 4, axis=1).swapaxes(-1, -2)) * 320 ** -0.5
        assert z.max() > 20, f"large logits: max scaled score {z.max():.1f}"
    junk = [torch.full(ref.shape, float("nan"), device="cuda", dtype=dt),
            torch.full(ref_lse.shape, float("nan"), device="cuda", dtype=torch.float32)]
    del junk
    out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="split", return_lse=True)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert_close(out, ref, dtype, torch_out, what=f"variant {variant} public S={S} q_scale={q_scale} {dtype}")
    np.testing.assert_allclose(as_f64(lse), ref_lse, rtol=1e-4, atol=2e-3)
