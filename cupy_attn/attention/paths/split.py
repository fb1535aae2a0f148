"""The split attention path's schedule: GEMM → fused mask + softmax kernel → GEMM, or the Hopper scores kernel → P·V.

    scores = (scale·log2 e) · Q Kᵀ      cuBLAS (fp16/bf16 in, fp32 compute) or, for fp32, gemm_3xtf32; fp32 out
    P      = softmax2(scores + mask)     kernels/softmax.py, in place over the scores buffer (P in the input dtype)
    out    = P V                          the same GEMM kind, fp32 compute, out in the input dtype

or, where the plan chose the Hopper scores kernel (kernels/scores_sm90.py: Q·Kᵀ with the softmax in its epilogue, P
written in the input dtype) and its P·V kernel (kernels/pv_sm90.py) or cuBLAS's P·V.

The plan (dispatch.split_choice) makes every choice once, into a :class:`SplitChoice`: which kernels, the fp32 GEMM's
kind, the workspace budget, the batch chunks of the scores kernel, the causal row bands and the streams they run on.
This module turns a choice into a :class:`_Schedule` for the call's layout (the GEMMs' batch folding, the chunks of
batch·heads and query rows that keep the L×S score buffer under the budget, their offsets and launches) and replays
it (:func:`run`). The heuristics the plan takes the chunking, bands and streams from are here too
(:func:`scores_batch_chunk`, :func:`causal_row_bands`, :func:`cublas_causal_bands`, :func:`band_streams`).

Any head dims (E, Ev), any L and S, every mask kind, GQA and strided (BSHD) layouts without copies.

Memory: one scratch buffer per call (per batch chunk under the scores kernel) from the caller's allocator, returned
when the call ends: the scores or P, then, where cuBLASLt runs a GEMM, its 32 MiB workspace, one per stream
(:meth:`_Schedule.scratch_layout`). Nothing is kept between calls.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np

from ...runtime import blas, workspace
from ...runtime.kernel_abi import LOG2E
from ...runtime.launch import PreparedLaunch
from ..kernels import gemm_3xtf32, pv_sm90, scores_sm90, softmax


@dataclasses.dataclass(frozen=True)
class SplitChoice:
    """Everything the plan chose for a call on the split path (dispatch.split_choice), read by the schedule.

    budget:      bytes of the score (or P) buffer: workspace_bytes, CUPY_ATTN_WORKSPACE_BYTES or 1 GiB.
    gemm:        the fp32 GEMM's kind (gemm_3xtf32.fp32_gemm: None for fp16/bf16, "3xtf32", "sgemm", "tf32");
                 ``allow_tf32`` the caller's flag, passed to cuBLAS.
    scores:      the Hopper scores kernel's choice (scores_sm90.Choice), or None: cuBLAS Q·Kᵀ and the softmax pass;
                 ``scores_why_not`` says why not.
    pv:          ((batches, why not), ...): for a scores-kernel launch of that many batches, None where pv_sm90 runs
                 its P·V, else why cuBLAS does (one entry per chunk size: pv_sm90.prefer depends on the rows).
    batch_chunk: batches per scores-kernel launch (scores_batch_chunk; the batch when P of all of them fits).
    bands:       row bands of a causal call (causal_row_bands on the scores kernel, cublas_causal_bands on cuBLAS;
                 1 when not causal); ``streams``: the streams the cuBLAS path's bands run on (band_streams).
    """
    budget: int
    gemm: str | None = None
    allow_tf32: bool = False
    scores: scores_sm90.Choice | None = None
    scores_why_not: str | None = None
    pv: tuple = ()
    batch_chunk: int = 1
    bands: int = 1
    streams: int = 1

    def pv_reason(self, batches: int) -> str | None:
        """None when a scores-kernel launch of ``batches`` batches runs its P·V on pv_sm90, else why cuBLAS does."""
        return dict(self.pv).get(batches, "no scores kernel")


@dataclasses.dataclass
class _Axis:
    """One batch axis of the GEMMs: its size and element strides in each operand (0 = broadcast)."""
    size: int
    q: int
    k: int
    v: int
    o: int
    mask: int
    lse: int
    bh: int = 0  # step of the flat (batch, query head) index: dropout's Philox counter


def _batch_axes(p, out, lse) -> list[_Axis]:
    """(batch, kv head, group) axes; query head h = kv_head · groups + group reads kv head h // groups (GQA)."""
    g = p.groups
    st = lambda a, i: a.strides[i] // a.itemsize if a is not None else 0  # noqa: E731
    q, k, v, m = p.query, p.key, p.value, p.mask
    return [
        _Axis(p.batch, st(q, 0), st(k, 0), st(v, 0), st(out, 0), st(m, 0), st(lse, 0), p.num_heads),
        _Axis(p.num_kv_heads, g * st(q, 1), st(k, 1), st(v, 1), g * st(out, 1), g * st(m, 1), g * st(lse, 1), g),
        _Axis(g, st(q, 1), 0, 0, st(out, 1), st(m, 1), st(lse, 1), 1),
    ]


def _gemm_batch_groups(axes: list[_Axis]) -> list[list[_Axis]]:
    """Group adjacent axes that fold into one GEMM batch stride for Q, K, V and out (size-1 axes are dropped).

    Contiguous BHLD with GQA 32/8 over 2 batches: (2, 8, 4) → [[batch, kv head], [group]]: the (batch, kv head) pair
    folds (query stride 8·4·L·E = 8 · (4·L·E)), the group axis does not (its K stride is 0).
    """
    groups: list[list[_Axis]] = []
    for ax in (a for a in axes if a.size != 1):
        if groups:
            last = groups[-1][-1]
            if all(getattr(last, f) == ax.size * getattr(ax, f) for f in ("q", "k", "v", "o")):
                groups[-1].append(ax)
                continue
        groups.append([ax])
    return groups


@dataclasses.dataclass
class _Chunk:
    """One GEMM → softmax → GEMM step over a block of batch·heads (and query rows): byte offsets from the operands'
    base pointers, the GEMMs, the softmax pass's launch (SoftmaxParams with every field but the pointers filled;
    replayed on (scores, mask, lse, rng))."""

    q: int
    k: int
    v: int
    o: int
    mask: int
    lse: int
    gemm_qk: blas.StridedGemm | gemm_3xtf32.Gemm3xTF32
    gemm_pv: blas.StridedGemm | gemm_3xtf32.Gemm3xTF32
    p: int = 0  # byte offset of the chunk's scores (cuBLAS path) or P (scores kernel) in the scratch buffer
    softmax: PreparedLaunch | None = None  # the softmax pass over the chunk's keys (None under the scores kernel)
    stream: int = 0  # 0: the call's stream; i > 0: side stream i - 1 (causal bands, see band_streams)


@dataclasses.dataclass
class _Schedule:
    scores_elems: int
    chunks: list
    # The Hopper scores kernel (scores_sm90.build's launch) when it replaces every chunk's Q·Kᵀ GEMM and softmax
    # pass: one launch writes P for all batch·heads into a scratch buffer of scores_elems input-dtype elements, and the
    # chunks run only their P·V GEMMs (SplitChoice.scores).
    scores: object = None
    itemsize: int = 4  # bytes per scratch element: fp32 scores, or P in the input dtype under ``scores``
    streams: int = 1  # streams the chunks are spread over (the call's and streams - 1 side streams)
    # The scores kernel over batch chunks (P of all batch·heads over the workspace budget, scores_batch_chunk): one
    # schedule per chunk size, replayed per chunk of batches at byte offsets (q, k, v, out, lse, mask) from the
    # call's pointers. Empty otherwise; when set, scores and chunks are unused.
    batch_chunks: list = dataclasses.field(default_factory=list)
    # The P·V kernel (pv_sm90.build's launch) after the scores kernel where the plan chose it (SplitChoice.pv): one
    # launch in place of the chunks' cuBLAS P·V GEMMs; chunks is then empty.
    pv: object = None
    # Arrays the launches read by address (the variants' expanded slopes and sinks: softmax.expanded_variant_arrays).
    keep: tuple = ()
    # Bytes of cuBLASLt workspace per stream for the chunks' GEMMs (their workspace_bytes; 0: none takes one): carved
    # from the call's scratch after the scores, one region per stream, so no workspace outlives the call.
    gemm_workspace: int = 0

    def scratch_layout(self) -> tuple[int, int]:
        """(bytes of the call's scratch, offset of the first GEMM workspace in it): the scores (or P), then, 256-byte
        aligned, ``streams`` GEMM workspaces of gemm_workspace bytes."""
        scores = self.scores_elems * self.itemsize
        if not self.gemm_workspace:
            return scores, scores
        offset = -(-scores // 256) * 256
        return offset + self.streams * self.gemm_workspace, offset


_SCHEDULES: dict = {}
_MAX_SCHEDULES = 256


def _schedule_key(p, choice: SplitChoice, out, lse) -> tuple:
    """Everything a schedule depends on: the plan's choice, shapes, strides, dtypes, mask layout, causal, scale, the
    operands' 16-byte alignment (TMA); not pointers."""
    m = p.mask
    return (p.ctx.device_id, p.dtype, p.groups, p.causal, p.scale, p.mask_kind, p.dropout_p, choice,
            p.variants.window_size, p.variants.softcap,
            *((a.shape, a.strides, _align16(a)) for a in (p.query, p.key, p.value, out)),
            None if m is None else (m.dtype, m.shape, m.strides), None if lse is None else lse.strides)


def _align16(a) -> int:
    """The base address modulo 16 (CuPy arrays: data.ptr; NumPy arrays, as CPU tests pass: the array interface)."""
    ptr = getattr(a.data, "ptr", None)
    return (a.__array_interface__["data"][0] if ptr is None else ptr) % 16


def split_forward(p, choice: SplitChoice, out, lse=None) -> None:
    """Run the split path for a checked problem ``p`` (checks.SDPAProblem) and the plan's ``choice`` on the call's
    stream. out: (batch, Hq, L, Ev) CuPy array, query dtype, non-empty; lse: None or (batch, Hq, L) float32; S ≥ 1.
    Raises MemoryError through CuPy if even one query row of scores exceeds the device's memory."""
    prepare(p, choice, out, lse)(p.query.data.ptr, p.key.data.ptr, p.value.data.ptr, out.data.ptr,
                                 0 if lse is None else lse.data.ptr, 0 if p.mask is None else p.mask.data.ptr)


def prepare(p, choice: SplitChoice, out, lse=None):
    """``run(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, mask_ptr)`` for a checked problem and the plan's choice: its
    schedule bound to the call's context (what the plan's prepare returns and the call cache replays) and, with
    dropout, to the call's rng pair (p.rng: such calls are never replayed by the call cache)."""
    sched = schedule(p, choice, out, lse)
    if p.dropout_p > 0:
        return functools.partial(run, sched, p.ctx, rng=_rng_ptr(p))
    return functools.partial(run, sched, p.ctx)


def _rng_ptr(p) -> int:
    """Device address of the call's int64 {seed, offset} pair (0 without dropout)."""
    if p.dropout_p > 0:
        if p.rng is None:
            raise ValueError("split path: dropout_p > 0 needs the call's rng pair (checks.SDPAProblem.rng)")
        return p.rng.data.ptr
    return 0


def schedule(p, choice: SplitChoice, out, lse=None) -> "_Schedule":
    """The launch schedule of ``choice`` for this layout (built once per layout: _schedule_key). It holds no
    pointers: run() replays it on any arrays of the same layout."""
    if out.size == 0 or p.seqlen_k == 0:
        raise ValueError("split path: empty outputs and S = 0 are handled by the caller")
    if p.variants.sinks is not None or p.variants.alibi_slopes is not None or p.variants.mod is not None:
        # It holds the call's expanded slopes and sinks, or its mods' kernel and aux pointers: not kept (a mod's
        # schedule kept under the layout's key was replayed for the next mod, or the plain call, of that layout).
        return _build_schedule(p, choice, out, lse)
    key = _schedule_key(p, choice, out, lse)
    sched = _SCHEDULES.get(key)
    if sched is None:
        if len(_SCHEDULES) >= _MAX_SCHEDULES:
            _SCHEDULES.clear()
        sched = _SCHEDULES[key] = _build_schedule(p, choice, out, lse)
    return sched


def run(sched: "_Schedule", ctx, q0: int, k0: int, v0: int, o0: int, l0: int = 0, m0: int = 0, *,
        rng: int = 0) -> None:
    """Enqueue a schedule on the call's device and stream (``ctx``, an interop.CallContext): per chunk, GEMM →
    softmax → GEMM over a scores buffer from the caller's allocator (runtime.workspace.scratch: torch's caching
    allocator for torch callers, graph-capture safe; CuPy's pool otherwise), released, stream-ordered, on return;
    the GEMMs' cuBLASLt workspaces are regions of that same buffer (one per stream: _Schedule.scratch_layout).
    Pointers: q, k, v, out, lse (0: none), mask (0: none). Nothing here allocates outside the caller's allocator or
    synchronizes, so the call can be captured into a CUDA graph (after a first call outside capture has tuned the
    GEMMs: cuBLASLt's tuning times candidates and synchronizes, so under capture the heuristic's first choice runs)."""
    if sched.batch_chunks:
        for (oq, ok, ov, oo, ol, om), sub in sched.batch_chunks:
            run(sub, ctx, q0 + oq, k0 + ok, v0 + ov, o0 + oo, l0 + ol if l0 else 0, m0 + om if m0 else 0, rng=rng)
        return
    with ctx.activate():
        nbytes, w0 = sched.scratch_layout()
        scores, s0 = workspace.scratch(ctx, nbytes)
        ws = sched.gemm_workspace
        main = ctx.stream
        if sched.scores is not None:
            sched.scores.launch_on(main.ptr, q0, k0, s0, l0, m0)
        if sched.pv is not None:
            sched.pv.launch_on(main.ptr, s0, v0, o0)
        # Side streams only outside graph capture: a side stream's first cuBLASLt workspace would be allocated inside
        # the capture. The chunks' scratch regions are disjoint, so one stream runs the same schedule correctly.
        streams = joins = None
        if sched.streams > 1 and not workspace.capturing(main.ptr):
            streams, joins = _fork(ctx, sched.streams - 1)
        for c in sched.chunks:
            stream = main if streams is None or c.stream == 0 else streams[c.stream - 1]
            # A side stream is made CuPy's current one for the softmax launch and a first GEMM call's cuBLASLt tuning;
            # the call's stream already is (ctx.activate), so the common path switches nothing.
            work = (s0 + w0 + c.stream * ws, ws) if ws else None  # this stream's GEMM workspace
            with _NO_SWITCH if stream is main else stream:
                if sched.scores is not None:
                    c.gemm_pv(o0 + c.o, s0 + c.p, v0 + c.v, stream.ptr, work=work)
                    continue
                c.gemm_qk(s0 + c.p, q0 + c.q, k0 + c.k, stream.ptr, work=work)
                c.softmax.launch_on(stream.ptr, s0 + c.p, m0 + c.mask if m0 else 0, l0 + c.lse if l0 else 0, rng)
                c.gemm_pv(o0 + c.o, s0 + c.p, v0 + c.v, stream.ptr, work=work)
        if streams is not None:
            _join(main, streams, joins)
        del scores  # back to its allocator, ordered after the work above on this stream


_NO_SWITCH = contextlib.nullcontext()
_SIDE_STREAMS: dict = {}  # device -> (side streams, events) of causal band schedules, created on first use and kept


def _fork(ctx, n: int) -> tuple[list, list]:
    """``n`` side streams of ``ctx``'s device, each made to start after everything enqueued so far on the call's
    stream, and their join events. Under CUDA-graph capture the waits join the side streams to the capture."""
    import cupy
    side = _SIDE_STREAMS.get(ctx.device_id)
    if side is None or len(side[0]) < n:
        side = _SIDE_STREAMS[ctx.device_id] = ([cupy.cuda.Stream(non_blocking=True) for _ in range(n)],
                                               [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(n + 1)])
    streams, events = side[0][:n], side[1][:n + 1]
    events[0].record(ctx.stream)
    for s in streams:
        s.wait_event(events[0])
    return streams, events[1:]


def _join(main, streams: list, events: list) -> None:
    """The call's stream waits for the side streams' work, so what follows it (the scratch buffer's stream-ordered
    release, the caller's next kernels) is ordered after all of it."""
    for s, e in zip(streams, events):
        e.record(s)
        main.wait_event(e)


def causal_row_bands(seqlen_q: int) -> int:
    """How many row bands the P·V GEMM of a causal call on the scores kernel is cut into, so that band i's GEMM stops
    at its last row's visible key: with n equal bands of a square causal problem P·V does (n + 1) / (2n) of the full
    work, in GEMMs of L / n rows. At the seed's causal variant (32, 32, 512, 512, 1024) 2 bands measured faster than
    one GEMM and than 4 bands, whose 128-row GEMMs run at half the rate (bench/notes/split.md). So 2 bands from
    L = 256 on, else 1: L = 512 → 2 GEMMs of 256 rows, stopping at keys 256 and 512.

    >>> [causal_row_bands(L) for L in (1, 255, 256, 512, 4096)]
    [1, 1, 2, 2, 2]
    """
    return 2 if seqlen_q >= 256 else 1


def cublas_causal_bands(seqlen_q: int) -> int:
    """How many row bands a causal call on the cuBLAS split path is cut into: band i's Q·Kᵀ GEMM, softmax pass and
    P·V GEMM stop at its last row's visible key, so with n equal bands of a square causal problem the path does
    (n + 1) / (2n) of the full work, but more bands mean smaller GEMMs and softmax passes and more launches: 4 bands
    measured fastest at (2, 8, 4096, 4096, 512) and (8, 16, 2048, 2048, 512), 0.76-0.79 of the call without causal
    (bench/experiments/split/causal_bands.py; bench/notes/split.md). So L // 256 bands (≥ 256 rows each), at most 4:
    L = 1024 → 4 bands of 256 rows, 5/8 of the work.

    >>> [cublas_causal_bands(L) for L in (1, 511, 512, 1024, 4096, 65536)]
    [1, 1, 2, 4, 4, 4]
    """
    return max(1, min(4, seqlen_q // 256))


def causal_streams(seqlen_q: int, bands: int) -> int:
    """How many streams the row bands of a causal call on the cuBLAS split path run on at once (1: one after the
    other on the call's stream). One band's softmax pass runs beside another's GEMMs: 2 streams measured 3-4% faster
    than 1 and than 4 at (2, 8, 4096, 4096, 512) and (8, 16, 2048, 2048, 512) (bench/experiments/split/causal_bands.py;
    bench/notes/split.md). So 2 streams whenever there are bands. (Under the scores kernel, whose P·V bands are the
    only banded step, streams changed nothing; it keeps one stream.)

    >>> causal_streams(4096, 4), causal_streams(4096, 1)
    (2, 1)
    """
    return 2 if bands > 1 else 1


def band_streams(seqlen_q: int, seqlen_k: int, bands: int, budget: int) -> int:
    """Streams of a causal schedule on the cuBLAS path: causal_streams when a batch chunk holds all L query rows of
    scores under the workspace budget (so each band gets its own region of the buffer), else 1."""
    one_chunk = seqlen_q * (-(-seqlen_k // 8) * 8) * 4 <= budget
    return causal_streams(seqlen_q, bands) if one_chunk else 1


def _spread(costs: list, streams: int) -> list[int]:
    """Stream index of each band: longest first, each to the least-loaded stream (LPT); stream 0 gets the first.

    >>> _spread([1, 2, 3, 4], 2), _spread([5, 1, 1], 2), _spread([1, 2], 1)
    ([0, 1, 1, 0], [0, 1, 1], [0, 0])
    """
    load = [0] * max(1, streams)
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        s = min(range(len(load)), key=lambda j: load[j])
        out[i], load[s] = s, load[s] + costs[i]
    return out


def _row_bands(L: int, rows_per_chunk: int, bands: int) -> list[tuple[int, int]]:
    """(first row, rows) of each block of query rows: chunks of rows_per_chunk (the workspace budget), each cut into
    ``bands`` near-equal pieces.

    >>> _row_bands(512, 512, 4), _row_bands(130, 130, 2), _row_bands(10, 4, 1)
    ([(0, 128), (128, 128), (256, 128), (384, 128)], [(0, 65), (65, 65)], [(0, 4), (4, 4), (8, 2)])
    """
    blocks = []
    for r0 in range(0, L, rows_per_chunk):
        lc = min(rows_per_chunk, L - r0)
        step = -(-lc // max(1, min(bands, lc)))
        blocks += [(r, min(step, r0 + lc - r)) for r in range(r0, r0 + lc, step)]
    return blocks


def _build_schedule(p, choice: SplitChoice, out, lse) -> _Schedule:
    budget = choice.budget
    fused = choice.scores is not None  # the Hopper scores kernel replaces Q·Kᵀ and the softmax pass
    if fused and choice.batch_chunk < p.batch:
        return _batch_chunked_schedule(p, choice, out, lse)
    L, S, E, Ev = p.seqlen_q, p.seqlen_k, p.head_dim, p.head_dim_v
    dtype = p.dtype
    isz = dtype.itemsize
    ld = -(-S // 8) * 8                      # fp32 pitch: 32-byte aligned rows for cuBLAS and float4 loads
    pitch_p = ld * 4 // isz                  # the same rows read as P in the input dtype
    row_bytes = ld * 4
    rows_per_chunk = L if L * row_bytes <= budget else max(1, budget // row_bytes)

    groups = _gemm_batch_groups(_batch_axes(p, out, lse))
    if not groups:
        groups = [[_Axis(1, 0, 0, 0, 0, 0, 0, 0)]]
    main = max(range(len(groups)), key=lambda i: np.prod([a.size for a in groups[i]]))
    batch_group = groups[main]
    loops = [g for i, g in enumerate(groups) if i != main]
    n_batch = int(np.prod([a.size for a in batch_group]))
    inner = batch_group[-1]
    per_chunk = max(1, min(n_batch, 65535, budget // (rows_per_chunk * row_bytes))) if rows_per_chunk == L else 1
    # Strides of one step of the folded batch axis, and the mask/lse decomposition of its index (≤ 3 axes).
    bq, bk, bv, bo = inner.q, inner.k, inner.v, inner.o
    dec = ([_Axis(1, 0, 0, 0, 0, 0, 0, 0)] * (3 - len(batch_group))) + batch_group

    causal_offset = p.visible_offset  # the visible keys of a band: r0 + lc + offset
    alpha = p.scale * LOG2E  # the kernel works in base 2
    variant_arrays = softmax.expanded_variant_arrays(p)
    softmax_base = softmax.base_params(p, ld, [(ax.size, ax.mask, ax.lse, ax.bh) for ax in dec], variant_arrays)
    mask_isz = p.mask.itemsize if p.mask is not None else 1
    sq, sk, sv, so = (a.strides[2] // a.itemsize for a in (p.query, p.key, p.value, out))
    gemms: dict = {}
    # Under the scores kernel P is packed by (batch, query head): flat index bh = b·Hq + h at bh·L·ld_p elements,
    # rows ld_p apart (16-byte aligned for cuBLAS); a GEMM batch step moves bh by inner.bh.
    # Causal calls skip the keys past the diagonal by row bands: rows r0 ... r0+lc-1 see at most the first
    # sc = r0 + lc + causal_offset keys (at least 1: a band whose rows see no key multiplies zeros). On the scores
    # kernel P is 0 past each row's limit and only the P·V GEMM is banded (causal_row_bands); on the cuBLAS path
    # each band's Q·Kᵀ GEMM, softmax pass (over sc columns) and P·V GEMM stop at sc (cublas_causal_bands).
    banded = p.causal is not None
    row_bands = _row_bands(L, rows_per_chunk, choice.bands)
    scores_launch = pv_launch = None
    if fused:
        ld_p = -(-S // 8) * 8
        # A causal call's first P·V row band reads only its visible keys: P's zeros past them go unwritten. The P·V
        # kernel reads no row past its block's visible keys (rounded up to 64, which the scores kernel writes): no
        # zeros at all.
        p_read = None
        if choice.pv_reason(p.batch) is None:
            pv_launch = pv_sm90.build(p, out, ld=ld_p)
            p_read = (-(-L // 64) * 64, 0) if banded else None
        elif banded and row_bands[0][1] < L:
            r0, lc = row_bands[0]
            p_read = (lc, max(1, min(S, r0 + lc + causal_offset)))
        scores_launch = scores_sm90.build(p, choice.scores, lse, ld=ld_p, p_read=p_read)
        if pv_launch is not None:
            return _Schedule(scores_elems=p.batch * p.num_heads * L * ld_p, chunks=[], scores=scores_launch,
                             itemsize=isz, pv=pv_launch)

    gemm = functools.partial(gemm_3xtf32.strided_gemm, choice.gemm, allow_tf32=choice.allow_tf32)

    def gemm_pair(nb: int, lc: int, sc: int = S):
        """(QKᵀ, PV) for nb batches of lc query rows against the first sc keys (a causal band's; else S); chunks of
        equal size share them. fp32 inputs get gemm_3xtf32's GEMM where gemm_3xtf32.fp32_gemm picks it."""
        if (nb, lc, sc) not in gemms and scores_launch is not None:
            gemms[nb, lc, sc] = (None, gemm(
                c_dtype=dtype, ldc=max(so, Ev), stride_c=bo, a_dtype=dtype, lda=ld_p, stride_a=inner.bh * L * ld_p,
                trans_a=False, b_dtype=dtype, ldb=max(sv, Ev), stride_b=bv, trans_b=False, m=lc, n=Ev, k=sc,
                batch=nb))
        if (nb, lc, sc) not in gemms:
            gemms[nb, lc, sc] = (
                gemm(c_dtype=np.float32, ldc=ld, stride_c=lc * ld, a_dtype=dtype, lda=max(sq, E), stride_a=bq,
                     trans_a=False, b_dtype=dtype, ldb=max(sk, E), stride_b=bk, trans_b=True, m=lc, n=sc, k=E,
                     batch=nb, alpha=alpha),
                gemm(c_dtype=dtype, ldc=max(so, Ev), stride_c=bo, a_dtype=dtype, lda=pitch_p, stride_a=lc * pitch_p,
                     trans_a=False, b_dtype=dtype, ldb=max(sv, Ev), stride_b=bv, trans_b=False, m=lc, n=Ev, k=sc,
                     batch=nb))
        return gemms[nb, lc, sc]

    # Bands are independent: on the cuBLAS path, with their own regions of the scores buffer, they run on several
    # streams at once (the plan's choice.streams: band_streams), longest first.
    streams = choice.streams if banded and scores_launch is None else 1
    band_stream = _spread([(r0 + lc + causal_offset) * lc for r0, lc in row_bands], streams)
    band_offset = np.cumsum([0] + [per_chunk * lc * ld * 4 for _, lc in row_bands])[:-1] if streams > 1 \
        else [0] * len(row_bands)
    # Longest band first: with several streams the GPU starts the critical path first.
    band_order = sorted(range(len(row_bands)), key=lambda b: -row_bands[b][0]) if streams > 1 \
        else range(len(row_bands))
    chunks = []
    for loop_index in np.ndindex(*[int(np.prod([a.size for a in g])) for g in loops]):
        off = {f: 0 for f in ("q", "k", "v", "o", "mask", "lse", "bh")}
        for idx, g in zip(loop_index, loops):
            for ax in reversed(g):  # decompose the folded index over the group's axes, innermost first
                for f in off:
                    off[f] += (idx % ax.size) * getattr(ax, f)
                idx //= ax.size
        for c0 in range(0, n_batch, per_chunk):
            nb = min(per_chunk, n_batch - c0)
            for band in band_order:
                r0, lc = row_bands[band]
                sc = max(1, min(S, r0 + lc + causal_offset)) if banded else S
                gemm_qk, gemm_pv = gemm_pair(nb, lc, sc)
                # Under the scores kernel no softmax pass runs: its kernel is not loaded.
                launch = None
                if scores_launch is None:
                    launch = softmax.build(p, softmax_base, batches=nb, rows=lc, row0=r0, batch0=c0, bh0=off["bh"],
                                           seqlen_k=sc)
                chunks.append(_Chunk(
                    q=(off["q"] + c0 * bq + r0 * sq) * isz, k=(off["k"] + c0 * bk) * isz,
                    v=(off["v"] + c0 * bv) * isz, o=(off["o"] + c0 * bo + r0 * so) * isz,
                    mask=off["mask"] * mask_isz, lse=off["lse"] * 4, gemm_qk=gemm_qk, gemm_pv=gemm_pv,
                    p=((off["bh"] + c0 * inner.bh) * L + r0) * ld_p * isz if scores_launch is not None
                    else int(band_offset[band]),
                    softmax=launch, stream=band_stream[band]))
    streams = max(band_stream) + 1
    work = max((g.workspace_bytes for pair in gemms.values() for g in pair if g is not None), default=0)
    if scores_launch is not None:
        return _Schedule(scores_elems=p.batch * p.num_heads * L * ld_p, chunks=chunks,
                         scores=scores_launch, itemsize=isz, streams=streams, gemm_workspace=work)
    return _Schedule(scores_elems=per_chunk * rows_per_chunk * ld, chunks=chunks, streams=streams,
                     gemm_workspace=work, keep=variant_arrays)


def p_bytes_per_batch(p) -> int:
    """Bytes of the scores kernel's P for one batch: Hq·L rows of ⌈S/8⌉·8 input-dtype elements."""
    return p.num_heads * p.seqlen_q * (-(-p.seqlen_k // 8) * 8) * p.dtype.itemsize


def scores_batch_chunk(p, budget: int) -> int:
    """Batches per scores-kernel launch: all of them when P of all batch·heads fits the workspace budget (one launch,
    one buffer), else as many as fit (at least one: the plan asks that much, dispatch.scores_reason). Each chunk of
    batches then runs the scores kernel and its P·V GEMMs on one P buffer, reused chunk after chunk on the call's
    stream. The seed with batch 128 (P 2 GiB, over the default 1 GiB budget) runs two chunks of 64 batches, measured
    14% faster than the cuBLAS Q·Kᵀ + softmax pass (bench/notes/split.md).

    >>> import types, numpy as np
    >>> seed = types.SimpleNamespace(batch=128, num_heads=32, seqlen_q=512, seqlen_k=512, dtype=np.dtype(np.float16))
    >>> scores_batch_chunk(seed, 1 << 30), scores_batch_chunk(seed, 3 << 30), scores_batch_chunk(seed, 20 << 20)
    (64, 128, 1)
    """
    return max(1, min(p.batch, budget // p_bytes_per_batch(p)))


def batch_slice(p, nb: int):
    """The problem of the first ``nb`` batches of ``p`` (batch slices of its arrays: the same strides), as a chunk of
    batches runs it. Arrays absent (plans made without them, tests) stay None."""
    def first(a):
        return None if a is None else a[:nb]
    return dataclasses.replace(p, query=first(p.query), key=first(p.key), value=first(p.value), batch=nb,
                               batch_shape=(nb,), mask=first(p.mask))


def _batch_chunked_schedule(p, choice: SplitChoice, out, lse) -> _Schedule:
    """The scores-kernel schedule of a call whose P (all batch·heads) exceeds the budget: the schedules of its batch
    chunks (choice.batch_chunk batches, and the remainder), built on batch slices of the arrays (same strides), each
    replayed at its chunk's byte offsets by run()."""
    n = choice.batch_chunk
    subs, chunks = {}, []
    for b0 in range(0, p.batch, n):
        nb = min(n, p.batch - b0)
        if nb not in subs:
            subs[nb] = schedule(batch_slice(p, nb), choice, out[:nb], None if lse is None else lse[:nb])
        offsets = tuple(b0 * a.strides[0] if a is not None else 0 for a in (p.query, p.key, p.value, out, lse, p.mask))
        chunks.append((offsets, subs[nb]))
    return _Schedule(scores_elems=0, chunks=[], batch_chunks=chunks)
