"""The split attention path: GEMM → fused mask + softmax kernel → GEMM.

    scores = (scale·log2 e) · Q Kᵀ      cuBLAS (fp16/bf16 in, fp32 compute) or, for fp32, gemm_3xtf32; fp32 out
    P      = softmax2(scores + mask)     cuda_src/attention/softmax.cu, in place over the scores buffer (P in the input dtype)
    out    = P V                          the same GEMM kind, fp32 compute, out in the input dtype

fp32 inputs run their two GEMMs on gemm_3xtf32 (3xTF32 tensor cores at fp32 accuracy, CUTLASS's FastF32 recipe, as
torch's memory-efficient attention does) on sm_80+, or on cuBLAS SGEMM with ``CUPY_ATTN_FP32_GEMM=sgemm``; TF32 with
``allow_tf32`` (gemm_3xtf32.fp32_gemm decides).

Any head dims (E, Ev), any L and S, every mask kind, GQA and strided (BSHD) layouts without copies. The L×S scores
buffer is the only large temporary: batch·heads (and, for very long rows, query rows) are processed in chunks so that
it stays under ``workspace_bytes``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import numpy as np

from .. import philox
from ..runtime import blas, workspace
from ..runtime.compile import KernelFamily, struct_arg
from ..runtime.interop import dtype_name
from . import gemm_3xtf32

_C_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}

# (threads per row, float4 vectors per thread): one row = threads·vecs·4 columns held in registers. Picked as the
# first entry that covers S. 32-thread groups serve short rows (four rows per 128-thread block, so a block still has
# four warps of loads in flight); wider groups keep ≤ 32 fp32 values per thread (8 vectors), well under the register
# budget at full occupancy. (512, 0) loops over rows longer than 16384 columns. The two lists differ at S ≤ 512
# (bench/experiments/probe_softmax.py, seed buffer, H200, same machine): unmasked rows 64 × 2 0.380 ms vs 32 × 4 0.399 (16 × 8
# 0.388, 128 × 1 0.532); rows with a key-padding mask 32 × 4 0.568 vs 64 × 2 0.685, causal rows 0.454 vs 0.461.
SOFTMAX_TILES = {  # masked (attn_mask or causal) -> tiles
    "false": ((32, 1), (32, 2), (64, 2), (128, 2), (128, 4), (256, 4), (256, 8), (512, 8), (512, 0)),
    "true": ((32, 1), (32, 2), (32, 4), (128, 2), (128, 4), (256, 4), (256, 8), (512, 8), (512, 0)),
}

_MASK_KIND = {None: 0, "bool": 1, "float16": 2, "bfloat16": 3, "float32": 4}

# Field order and types of SoftmaxParams in softmax.cu (all 8 bytes wide, so NumPy's layout equals the C struct's).
_PARAMS = np.dtype([(name, np.float64 if name in ("dropout_scale", "softcap_log2") else np.int64) for name in (
    "scores", "lse", "mask", "rows", "rows_per_batch", "row0", "seqlen_k", "ld", "causal_offset", "mask_kind",
    "batch0", "n1", "n2", "mask_stride_b0", "mask_stride_b1", "mask_stride_b2", "mask_stride_q", "mask_stride_k",
    "lse_stride_b0", "lse_stride_b1", "lse_stride_b2",
    "rng", "dropout_threshold", "dropout_scale", "bh0", "bh_stride_b0", "bh_stride_b1", "bh_stride_b2",
    "window_lo", "softcap_log2", "alibi_slopes", "alibi_stride_b0", "alibi_stride_b1", "alibi_stride_b2", "diag",
    "sinks", "sinks_kind", "sink_stride_b0", "sink_stride_b1", "sink_stride_b2")])

# dropout=true only with masked=true: a dropout call takes the masked tiles (the mask test is free next to Philox).
SOFTMAX = KernelFamily(
    name="softmax",
    source="attention/softmax.cu",
    template="cupy_attn::masked_softmax<{out_t}, {tile[0]}, {tile[1]}, {masked}, {dropout}>",
    axes={"out_t": tuple(_C_TYPES.values()), "tile": tuple(sorted(set(sum(SOFTMAX_TILES.values(), ())))),
          "masked": tuple(SOFTMAX_TILES), "dropout": ("false", "true")},
    where=lambda row: row["tile"] in SOFTMAX_TILES[row["masked"]] and (row["dropout"] == "false"
                                                                          or row["masked"] == "true"),
    structs=(("cupy_attn::SoftmaxParams", _PARAMS),),
)

# The variants (window, softcap, ALiBi, sinks) on the masked tiles, with and without dropout.
SOFTMAX_VARIANTS = KernelFamily(
    name="softmax_variants",
    source="attention/softmax.cu",
    template="cupy_attn::masked_softmax_variants<{out_t}, {tile[0]}, {tile[1]}, {dropout}>",
    axes={"out_t": tuple(_C_TYPES.values()), "tile": SOFTMAX_TILES["true"], "dropout": ("false", "true")},
    structs=(("cupy_attn::SoftmaxParams", _PARAMS),),
)


DEFAULT_WORKSPACE_BYTES = 1 << 30


def softmax_tile(seqlen_k: int, masked: bool = True) -> tuple[int, int]:
    """The first SOFTMAX_TILES entry (masked or unmasked list) whose register row covers seqlen_k columns
    (S=1024 → (128, 2); S=512 → (32, 4) masked, (64, 2) unmasked)."""
    for threads, vecs in SOFTMAX_TILES["true" if masked else "false"]:
        if vecs == 0 or threads * vecs * 4 >= seqlen_k:
            return threads, vecs
    raise AssertionError("SOFTMAX_TILES ends with a looping entry")


def workspace_bytes_default() -> int:
    """Scores-buffer budget: ``CUPY_ATTN_WORKSPACE_BYTES`` or 1 GiB."""
    return int(os.environ.get("CUPY_ATTN_WORKSPACE_BYTES", DEFAULT_WORKSPACE_BYTES))


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
    base pointers, the softmax kernel's parameters with every field but the pointers filled, its grid, the GEMMs."""

    q: int
    k: int
    v: int
    o: int
    mask: int
    lse: int
    params: np.ndarray
    grid: int
    gemm_qk: blas.StridedGemm | gemm_3xtf32.Gemm3xTF32
    gemm_pv: blas.StridedGemm | gemm_3xtf32.Gemm3xTF32
    p: int = 0  # byte offset of the chunk's scores (cuBLAS path) or P (scores kernel) in the scratch buffer
    kernel: object = None  # the softmax kernel for the chunk's key count (a causal band's, else the schedule's)
    block: int = 0
    stream: int = 0  # 0: the call's stream; i > 0: side stream i - 1 (causal bands, see causal_streams)


@dataclasses.dataclass
class _Schedule:
    scores_elems: int
    chunks: list
    # The Hopper scores kernel (scores_sm90.ScoresLaunch) when it replaces every chunk's Q·Kᵀ GEMM and softmax pass:
    # one launch writes P for all batch·heads into a scratch buffer of scores_elems input-dtype elements, and the
    # chunks run only their P·V GEMMs (CUPY_ATTN_SPLIT_FUSED=1 or 2, see fused_reason).
    scores: object = None
    itemsize: int = 4  # bytes per scratch element: fp32 scores, or P in the input dtype under ``scores``
    streams: int = 1  # streams the chunks are spread over (the call's and streams - 1 side streams)
    # The scores kernel over batch chunks (P of all batch·heads over the workspace budget, scores_batch_chunk): one
    # schedule per chunk size, replayed per chunk of batches at byte offsets (q, k, v, out, lse, mask) from the
    # call's pointers. Empty otherwise; when set, scores and chunks are unused.
    batch_chunks: list = dataclasses.field(default_factory=list)
    # The P·V kernel (pv_sm90.PvLaunch) after the scores kernel where pv_reason allows (causal calls, and others where
    # it beats cuBLAS): one launch in place of the chunks' cuBLAS P·V GEMMs; chunks is then empty.
    pv: object = None


_SCHEDULES: dict = {}
_MAX_SCHEDULES = 256


def _schedule_key(p, out, lse, budget: int, allow_tf32: bool) -> tuple:
    """Everything a schedule depends on: shapes, strides, dtypes, mask layout, causal, scale, budget, the GEMM and
    scores-kernel and P·V switches, the operands' 16-byte alignment (TMA); not pointers."""
    m = p.mask
    return (p.ctx.device_id, p.dtype, p.groups, p.causal, p.scale, p.mask_kind, budget, allow_tf32, p.dropout_p,
            _scores_sm90().setting(), _pv_sm90().setting(), gemm_3xtf32.setting() if p.dtype == np.float32 else None,
            *((a.shape, a.strides, _align16(a)) for a in (p.query, p.key, p.value, out)),
            None if m is None else (m.dtype, m.shape, m.strides), None if lse is None else lse.strides)


def _align16(a) -> int:
    """The base address modulo 16 (CuPy arrays: data.ptr; NumPy arrays, as CPU tests pass: the array interface)."""
    ptr = getattr(a.data, "ptr", None)
    return (a.__array_interface__["data"][0] if ptr is None else ptr) % 16


def split_forward(p, out, lse=None, *, workspace_bytes: int | None = None, allow_tf32: bool = False) -> None:
    """Run the split path for a checked problem ``p`` (see _checks.SDPAProblem) on CuPy's current stream.

    out: (batch, Hq, L, Ev) CuPy array, query dtype, non-empty; lse: None or (batch, Hq, L) float32; S ≥ 1. Raises
    MemoryError through CuPy if even one query row of scores exceeds the device's memory. The launch schedule
    (chunks, GEMM plans, kernel parameters) is built once per layout (see _schedule_key) and reused.
    """
    sched = schedule(p, out, lse, workspace_bytes=workspace_bytes, allow_tf32=allow_tf32)
    run(sched, p.ctx, p.query.data.ptr, p.key.data.ptr, p.value.data.ptr, out.data.ptr,
        0 if lse is None else lse.data.ptr, 0 if p.mask is None else p.mask.data.ptr, rng=_rng_ptr(p))


def prepare(p, out, lse=None, *, workspace_bytes: int | None = None, allow_tf32: bool = False):
    """``run(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, mask_ptr)`` for a checked problem: its schedule bound to the
    call's context (what dispatch's plan returns and the call cache replays) and, with dropout, to the call's rng
    pair (p.rng: such calls are never replayed by the call cache)."""
    sched = schedule(p, out, lse, workspace_bytes=workspace_bytes, allow_tf32=allow_tf32)
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


def schedule(p, out, lse=None, *, workspace_bytes: int | None = None, allow_tf32: bool = False) -> "_Schedule":
    """The launch schedule of split_forward for this layout (cached; see _schedule_key). It holds no pointers: run()
    replays it on any arrays of the same layout."""
    if out.size == 0 or p.seqlen_k == 0:
        raise ValueError("split path: empty outputs and S = 0 are handled by the caller")
    budget = workspace_bytes or workspace_bytes_default()
    key = _schedule_key(p, out, lse, budget, allow_tf32)
    sched = _SCHEDULES.get(key)
    if sched is None:
        if len(_SCHEDULES) >= _MAX_SCHEDULES:
            _SCHEDULES.clear()
        sched = _SCHEDULES[key] = _build_schedule(p, out, lse, budget, allow_tf32)
    return sched


def run(sched: "_Schedule", ctx, q0: int, k0: int, v0: int, o0: int, l0: int = 0, m0: int = 0, *,
        rng: int = 0) -> None:
    """Enqueue a schedule on the call's device and stream (``ctx``, an interop.CallContext): per chunk, GEMM →
    softmax → GEMM over a scores buffer from the caller's allocator (runtime.workspace.scratch: torch's caching
    allocator for torch callers, graph-capture safe; CuPy's pool otherwise), released, stream-ordered, on return.
    Pointers: q, k, v, out, lse (0: none), mask (0: none). Nothing here allocates outside the caller's allocator or
    synchronizes, so the call can be captured into a CUDA graph (after a first call outside capture has tuned the
    GEMMs: cuBLASLt's tuning times candidates and synchronizes, so under capture the heuristic's first choice runs)."""
    if sched.batch_chunks:
        for (oq, ok, ov, oo, ol, om), sub in sched.batch_chunks:
            run(sub, ctx, q0 + oq, k0 + ok, v0 + ov, o0 + oo, l0 + ol if l0 else 0, m0 + om if m0 else 0, rng=rng)
        return
    with ctx.activate():
        scores, s0 = workspace.scratch(ctx, sched.scores_elems * sched.itemsize)
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
            with _NO_SWITCH if stream is main else stream:
                if sched.scores is not None:
                    c.gemm_pv(o0 + c.o, s0 + c.p, v0 + c.v, stream.ptr)
                    continue
                c.gemm_qk(s0 + c.p, q0 + c.q, k0 + c.k, stream.ptr)
                params = c.params.copy()
                params["scores"] = s0 + c.p
                params["mask"] = m0 + c.mask if m0 else 0
                params["lse"] = l0 + c.lse if l0 else 0
                params["rng"] = rng
                c.kernel((c.grid,), (c.block,), (struct_arg(params),))
                c.gemm_pv(o0 + c.o, s0 + c.p, v0 + c.v, stream.ptr)
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
    work, in GEMMs of L / n rows. Measured at the seed's causal variant (32, 32, 512, 512, 1024) fp16 on an H200
    (session 9, bench/experiments/kernel_times.py, cuBLAS's device time): one GEMM 0.89-0.95 ms, 2 bands 0.78 ms,
    4 bands 0.99-1.04 ms (its 128-row GEMMs run at half the rate). So 2 bands from L = 256 on, else 1.

    >>> [causal_row_bands(L) for L in (1, 255, 256, 512, 4096)]
    [1, 1, 2, 2, 2]
    """
    return 2 if seqlen_q >= 256 else 1


def cublas_causal_bands(seqlen_q: int) -> int:
    """How many row bands a causal call on the cuBLAS split path is cut into: band i's Q·Kᵀ GEMM, softmax pass and
    P·V GEMM stop at its last row's visible key, so with n equal bands of a square causal problem the path does
    (n + 1) / (2n) of the full work. Measured on an H200 (bench/experiments/causal_bands.py, session 10), causal
    time over the same call without causal: (2, 8, 4096, 4096, 512) bf16 1 band 1.06, 4 bands 0.76, 8 bands 0.80,
    16 bands 0.93; (8, 16, 2048, 2048, 512) fp16 1.05 / 0.79 / 0.87 / 1.12 (more bands: smaller GEMMs and softmax
    passes, more launches). So L // 256 bands (≥ 256 rows each), at most 4.

    >>> [cublas_causal_bands(L) for L in (1, 511, 512, 1024, 4096, 65536)]
    [1, 1, 2, 4, 4, 4]
    """
    return max(1, min(4, seqlen_q // 256))


def causal_streams(seqlen_q: int, bands: int) -> int:
    """How many streams the row bands of a causal call on the cuBLAS split path run on at once (1: one after the
    other on the call's stream). Measured on an H200 (bench/experiments/causal_bands.py, session 12), causal time
    over the same call without causal, 1 / 2 / 4 streams: (2, 8, 4096, 4096, 512) bf16 4 bands 0.769 / 0.738 / 0.759,
    8 bands 0.804 / 0.743 / 0.757; (8, 16, 2048, 2048, 512) fp16 4 bands 0.763 / 0.737 / 0.760, 8 bands 0.830 /
    0.760 / 0.772. One band's softmax pass runs beside the other's GEMMs. So 2 streams whenever there are bands.
    (Under the scores kernel, whose P·V bands are the only banded step, streams changed nothing: seed causal 4 bands
    1.042 / 1.044 / 1.044; it keeps one stream.)

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


def _build_schedule(p, out, lse, budget: int, allow_tf32: bool) -> _Schedule:
    fused = fused_reason(p, budget) is None  # the Hopper scores kernel replaces Q·Kᵀ and the softmax pass
    if fused and scores_batch_chunk(p, budget) < p.batch:
        return _batch_chunked_schedule(p, out, lse, budget, allow_tf32)
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

    dropout = p.dropout_p > 0
    masked = "true" if p.mask is not None or p.causal is not None or dropout else "false"
    mask = p.mask
    mask_kind = _MASK_KIND["bool" if p.mask_kind == "bool" else (dtype_name(mask.dtype) if mask is not None else None)]
    mask_isz = mask.itemsize if mask is not None else 1
    causal_offset = {None: S, "top_left": 0, "bottom_right": S - L}[p.causal]
    alpha = p.scale * 1.4426950408889634  # log2(e): the kernel works in base 2
    base = np.zeros((), dtype=_PARAMS)
    base["seqlen_k"], base["ld"], base["causal_offset"], base["mask_kind"] = S, ld, causal_offset, mask_kind
    base["n1"], base["n2"] = dec[1].size, dec[2].size
    for i, ax in enumerate(dec):
        base[f"mask_stride_b{i}"], base[f"lse_stride_b{i}"], base[f"bh_stride_b{i}"] = ax.mask, ax.lse, ax.bh
    if dropout:
        base["dropout_threshold"] = philox.dropout_threshold(p.dropout_p)
        base["dropout_scale"] = philox.dropout_scale(p.dropout_p)
    if mask is not None:
        base["mask_stride_q"], base["mask_stride_k"] = mask.strides[2] // mask_isz, mask.strides[3] // mask_isz

    sq, sk, sv, so = (a.strides[2] // a.itemsize for a in (p.query, p.key, p.value, out))
    gemms: dict = {}
    # Under the scores kernel P is packed by (batch, query head): flat index bh = b·Hq + h at bh·L·ld_p elements,
    # rows ld_p apart (16-byte aligned for cuBLAS); a GEMM batch step moves bh by inner.bh.
    # Causal calls skip the keys past the diagonal by row bands: rows r0 ... r0+lc-1 see at most the first
    # sc = r0 + lc + causal_offset keys (at least 1: a band whose rows see no key multiplies zeros). On the scores
    # kernel P is 0 past each row's limit and only the P·V GEMM is banded (causal_row_bands); on the cuBLAS path
    # each band's Q·Kᵀ GEMM, softmax pass (over sc columns) and P·V GEMM stop at sc (cublas_causal_bands).
    banded = p.causal is not None
    bands = (causal_row_bands(L) if fused else cublas_causal_bands(L)) if banded else 1
    row_bands = _row_bands(L, rows_per_chunk, bands)
    scores_launch = pv_launch = None
    if fused:
        ld_p = -(-S // 8) * 8
        scores = _scores_sm90()
        # A causal call's first P·V row band reads only its visible keys: P's zeros past them go unwritten. The P·V
        # kernel reads no row past its block's visible keys (rounded up to 64, which the scores kernel writes): no
        # zeros at all.
        p_read = None
        if pv_reason(p, out) is None:
            pv_launch = _pv_sm90().prepare(p.value, out, seqlen_q=L, ld=ld_p, causal=p.causal)
            p_read = (-(-L // 64) * 64, 0) if banded else None
        elif banded and row_bands[0][1] < L:
            r0, lc = row_bands[0]
            p_read = (lc, max(1, min(S, r0 + lc + causal_offset)))
        scores_launch = scores.prepare(p.query, p.key, lse, scale=p.scale, ld=ld_p, variant=scores.setting(),
                                       causal=p.causal, p_read=p_read, mask=p.mask)
        if pv_launch is not None:
            return _Schedule(scores_elems=p.batch * p.num_heads * L * ld_p, chunks=[], scores=scores_launch,
                             itemsize=isz, pv=pv_launch)

    from .dispatch import device_arch
    gemm = functools.partial(gemm_3xtf32.strided_gemm, allow_tf32=allow_tf32, arch=device_arch(p))

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
    # streams at once (causal_streams), longest first.
    streams = band_streams(L, S, len(row_bands), budget) if banded and scores_launch is None else 1
    band_stream = _spread([(r0 + lc + causal_offset) * lc for r0, lc in row_bands], streams)
    band_offset = np.cumsum([0] + [per_chunk * lc * ld * 4 for _, lc in row_bands])[:-1] if streams > 1 \
        else [0] * len(row_bands)
    # Longest band first: with several streams the GPU starts the critical path first.
    band_order = sorted(range(len(row_bands)), key=lambda b: -row_bands[b][0]) if streams > 1 \
        else range(len(row_bands))
    softmax = {}

    def softmax_for(sc: int):
        """(kernel, block, rows per block) of the softmax pass over sc columns."""
        if sc not in softmax:
            t = softmax_tile(sc, masked == "true")
            softmax[sc] = (SOFTMAX.kernel(out_t=_C_TYPES[dtype_name(dtype)], tile=t, masked=masked,
                                          dropout="true" if dropout else "false"), max(t[0], 128), max(1, 128 // t[0]))
        return softmax[sc]
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
                params = base.copy()
                params["rows"], params["rows_per_batch"], params["row0"], params["batch0"] = nb * lc, lc, r0, c0
                params["bh0"], params["seqlen_k"] = off["bh"], sc
                gemm_qk, gemm_pv = gemm_pair(nb, lc, sc)
                # Under the scores kernel no softmax pass runs: its kernel is not loaded.
                sm_kernel, sm_block, sm_rows = softmax_for(sc) if scores_launch is None else (None, 0, 1)
                chunks.append(_Chunk(
                    q=(off["q"] + c0 * bq + r0 * sq) * isz, k=(off["k"] + c0 * bk) * isz,
                    v=(off["v"] + c0 * bv) * isz, o=(off["o"] + c0 * bo + r0 * so) * isz,
                    mask=off["mask"] * mask_isz, lse=off["lse"] * 4, params=params,
                    grid=-(-nb * lc // sm_rows), gemm_qk=gemm_qk, gemm_pv=gemm_pv,
                    p=((off["bh"] + c0 * inner.bh) * L + r0) * ld_p * isz if scores_launch is not None
                    else int(band_offset[band]),
                    kernel=sm_kernel, block=sm_block, stream=band_stream[band]))
    streams = max(band_stream) + 1
    if scores_launch is not None:
        return _Schedule(scores_elems=p.batch * p.num_heads * L * ld_p, chunks=chunks,
                         scores=scores_launch, itemsize=isz, streams=streams)
    return _Schedule(scores_elems=per_chunk * rows_per_chunk * ld, chunks=chunks, streams=streams)


def _scores_sm90():
    from . import scores_sm90
    return scores_sm90


def _pv_sm90():
    from . import pv_sm90
    return pv_sm90


def pv_reason(p, out=None) -> str | None:
    """None when a call on the scores kernel (fused_reason None) runs its P·V in pv_sm90's one launch instead of
    cuBLAS (row bands under a causal mask), else why not: CUPY_ATTN_SPLIT_PV must not be 0; causal calls (each row
    block then stops at its visible keys), and the others only where pv_sm90.prefer says the kernel is faster (or
    with CUPY_ATTN_SPLIT_PV=2); value and out (None: not checked) must take its TMA loads and 16-byte stores
    (pv_sm90.layout_reason)."""
    pv = _pv_sm90()
    mode = pv.setting()
    if mode == 0:
        return f"{pv.ENV}=0"
    if p.causal is None and mode == 1 and not pv.prefer(p.batch * p.num_heads * p.seqlen_q, p.seqlen_k,
                                                          p.head_dim_v):
        return "not causal: cuBLAS's GEMM is as fast at this shape (pv_sm90.prefer)"
    return pv.layout_reason(p.value, out if out is not None else p.value)


def fused_reason(p, budget: int, arch: int | None = None) -> str | None:
    """None when the split path runs the Hopper scores kernel (scores_sm90: Q·Kᵀ with the softmax in its epilogue,
    P written in the input dtype) followed by the P·V GEMM, else why not: CUPY_ATTN_SPLIT_FUSED must not be 0
    (scores_sm90.setting: unset = 3), the kernel must take the call (scores_sm90.unsupported_reason) and P
    for all batch·heads (B·Hq·L·⌈S/8⌉·8 elements) must fit the workspace budget (the kernel writes it in one launch;
    seed (32, 32, 512, 1024) fp16: 512 MiB). ``arch``: the compute capability as an int (None: the call's device's)."""
    scores = _scores_sm90()
    if not scores.enabled():
        return f"{scores.ENV_SPLIT_FUSED}=0"
    if arch is None:
        from .dispatch import device_arch
        arch = device_arch(p)
    why = scores.unsupported_reason(p, arch)
    if why is not None:
        return why
    need = p_bytes_per_batch(p)
    if need > budget:
        return f"P of one batch's heads needs {need / 2**20:.0f} MiB, over the {budget / 2**20:.0f} MiB workspace budget"
    return None


def p_bytes_per_batch(p) -> int:
    """Bytes of the scores kernel's P for one batch: Hq·L rows of ⌈S/8⌉·8 input-dtype elements."""
    return p.num_heads * p.seqlen_q * (-(-p.seqlen_k // 8) * 8) * p.dtype.itemsize


def scores_batch_chunk(p, budget: int) -> int:
    """Batches per scores-kernel launch: all of them when P of all batch·heads fits the workspace budget (one launch,
    one buffer), else as many as fit (at least one: fused_reason asks that much). Each chunk of batches then runs the
    scores kernel and its P·V GEMMs on one P buffer, reused chunk after chunk on the call's stream. Measured on an
    H200 (session 17, same process), the seed with batch 128 (P 2 GiB, over the default 1 GiB budget) in two chunks
    of 64 batches: 9.11 ms against 10.53 on the cuBLAS Q·Kᵀ + softmax pass it used to fall back to (causal 8.04
    against 9.04; torch 32.8 and 19.4); one launch with a 3 GiB budget 9.47 (causal 7.69).

    >>> import types, numpy as np
    >>> seed = types.SimpleNamespace(batch=128, num_heads=32, seqlen_q=512, seqlen_k=512, dtype=np.dtype(np.float16))
    >>> scores_batch_chunk(seed, 1 << 30), scores_batch_chunk(seed, 3 << 30), scores_batch_chunk(seed, 20 << 20)
    (64, 128, 1)
    """
    return max(1, min(p.batch, budget // p_bytes_per_batch(p)))


def _batch_chunked_schedule(p, out, lse, budget: int, allow_tf32: bool) -> _Schedule:
    """The scores-kernel schedule of a call whose P (all batch·heads) exceeds the budget: the schedules of its batch
    chunks (scores_batch_chunk batches, and the remainder), built on batch slices of the arrays (same strides), each
    replayed at its chunk's byte offsets by run()."""
    n = scores_batch_chunk(p, budget)
    subs, chunks = {}, []
    for b0 in range(0, p.batch, n):
        nb = min(n, p.batch - b0)
        if nb not in subs:
            sub_p = dataclasses.replace(p, query=p.query[:nb], key=p.key[:nb], value=p.value[:nb], batch=nb,
                                        batch_shape=(nb,), mask=None if p.mask is None else p.mask[:nb])
            subs[nb] = schedule(sub_p, out[:nb], None if lse is None else lse[:nb], workspace_bytes=budget,
                                allow_tf32=allow_tf32)
        offsets = tuple(b0 * a.strides[0] if a is not None else 0 for a in (p.query, p.key, p.value, out, lse, p.mask))
        chunks.append((offsets, subs[nb]))
    return _Schedule(scores_elems=0, chunks=[], batch_chunks=chunks)
