"""Device memory a call needs besides its outputs, always from the caller's allocator.

Two kinds, and nothing else is held between calls:

* ``scratch(ctx, nbytes)``: one call's temporary: the split path's score (or P) buffer, up to ``workspace_bytes``,
  with the cuBLASLt workspace of its GEMMs (32 MiB a stream, paths/split.py); the split backward's buffers and its
  GEMMs' workspace; decode partials over 32 MiB. torch callers get it from torch's caching allocator on their current
  stream: visible to ``torch.cuda.memory_allocated``, reusable by torch afterwards (``torch.cuda.empty_cache()``
  returns it to the driver), and graph-capture aware (inside ``torch.cuda.graph`` it comes from the graph's private
  pool, so a replay never writes memory torch gave to someone else). CuPy callers get it from CuPy's pool on CuPy's
  current stream. The holder frees it, stream-ordered, when the call drops it.
* ``persistent(device_id, stream_ptr, name, nbytes)``: the small per-stream cache, kept where a per-call allocation
  would cost host time on calls of a few µs: the decode kernel's partials (at most 32 MiB), Linear-BN-softmax's y (at
  most 64 MiB) and affine (20·F bytes) buffers, and the cuBLASLt workspace (32 MiB) of the GEMMs that bind it into
  their prepared call (Linear-BN-softmax's, forward and backward; ``bound``). Reused by every call on that stream
  (calls on one stream are ordered, so they may share them). Allocated by the allocator of the kind that owns the stream: a torch
  stream's buffers come from a torch MemPool of cupy_attn's own (never a CUDA graph's private pool, see
  :func:`_alloc_shared_pool`), which ``torch.cuda.empty_cache()`` does not release while the pool lives; a CuPy
  stream's from CuPy's pool. :func:`release_memory` (``cupy_attn.release_memory``) drops them and the pool; the bound
  ones, and the prepared calls that hold their addresses (:func:`on_release`), only with ``graphs=True``.

CuPy stream capture has no private pool: a scratch buffer freed after a captured call could be handed to other work
while the graph still writes it at every replay. Scratch taken while a CuPy stream is capturing is therefore kept alive
until ``release_memory(graphs=True)``, to be called after destroying those graphs.
"""
from __future__ import annotations

import sys

import numpy as np

TORCH = "torch"
CUPY = "cupy"

_OWNER: dict = {}        # (device, stream handle) -> TORCH | CUPY: which allocator serves that stream's buffers
_PERSISTENT: dict = {}   # (device, stream handle, name) -> buffer (torch.Tensor or cupy.ndarray, uint8)
_CAPTURED: list = []     # scratch taken during CuPy stream capture, alive until release_memory(graphs=True)
_BOUND: set = set()      # keys of _PERSISTENT whose address prepared calls hold (persistent's ``bound``)
_ON_RELEASE: list = []   # callables that drop the prepared calls holding bound buffers (on_release)


def own_stream(device_id: int, stream_ptr: int, kind: str) -> None:
    """Record that ``kind``'s allocator serves buffers of this stream (torch streams: torch; others: CuPy)."""
    _OWNER[device_id, stream_ptr] = TORCH if kind == TORCH else CUPY


def _alloc(kind: str, device_id: int, nbytes: int):
    """(buffer, device pointer) of ``nbytes`` uint8 from ``kind``'s allocator on that allocator's current stream."""
    if kind == TORCH:
        torch = sys.modules["torch"]
        t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=torch.device("cuda", device_id))
        return t, t.data_ptr()
    import cupy
    with cupy.cuda.Device(device_id):
        a = cupy.empty(max(nbytes, 1), dtype=np.uint8)
    return a, a.data.ptr


_MEMPOOLS: dict = {}  # device -> torch.cuda.MemPool holding the persistent buffers of torch streams


def _alloc_shared_pool(device_id: int, stream_ptr: int, nbytes: int):
    """A uint8 torch tensor for a persistent buffer, from a torch MemPool of cupy_attn's own: torch's allocator (so
    torch.cuda.memory_allocated sees it), but never a CUDA graph's private pool. torch's CUDA-graph trees route the
    current thread's allocations to their pool during warm-up too (not a capture), where a buffer that outlives the
    call is refused; the innermost use_mem_pool wins, so ours takes this allocation. Allocated on the current stream,
    the call's. torch versions without MemPool allocate plainly."""
    torch = sys.modules["torch"]
    dev = torch.device("cuda", device_id)
    if not hasattr(torch.cuda, "use_mem_pool"):
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=dev)
    pool = _MEMPOOLS.get(device_id)
    if pool is None:
        with torch.cuda.device(dev):
            pool = _MEMPOOLS[device_id] = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool, device=dev):
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=dev)


def capturing(stream_ptr: int) -> bool:
    """True while ``stream_ptr`` is being captured into a CUDA graph (the legacy default stream never is)."""
    if stream_ptr == 0:
        return False
    from cupy.cuda import runtime
    return runtime.streamIsCapturing(stream_ptr) != 0


def scratch(ctx, nbytes: int):
    """(holder, pointer) of a per-call temporary of ``nbytes`` on ``ctx``'s device, from the caller's allocator on
    the caller's stream (``ctx`` is an interop.CallContext). Keep the holder until the work is enqueued."""
    kind = TORCH if ctx.kind == TORCH else CUPY
    if kind == TORCH:
        return _alloc(TORCH, ctx.device_id, nbytes)  # torch's current stream is the call's stream
    import cupy
    with cupy.cuda.Device(ctx.device_id), ctx.stream:
        a = cupy.empty(max(nbytes, 1), dtype=np.uint8)
    if capturing(ctx.stream.ptr):
        _CAPTURED.append(a)
    return a, a.data.ptr


def persistent(device_id: int, stream_ptr: int, name: str, nbytes: int, *, bound: bool = False):
    """The per-stream buffer ``name`` of at least ``nbytes`` (grown on demand; a replaced buffer goes back to its
    allocator, stream-ordered). Returns the buffer; ``pointer(buf)`` gives its address; hold it until the work using it
    is enqueued. ``bound``: callers bake its address into prepared calls that outlive the call (cuBLASLt's bound
    GEMMs), which a CUDA graph may capture when it is captured on the stream they were warmed up on (torch's
    CUDA-graph trees, a CuPy capture): release_memory frees it only with graphs=True.

    While the stream is being captured into a CUDA graph the buffer is a new one for this call instead, not cached: a
    cached buffer allocated inside torch's capture would live in the graph's private pool (torch's CUDA-graph trees
    refuse live allocations there that are not graph outputs); from torch it is freed, stream-ordered, when the caller
    drops it, from CuPy it is kept with the captured scratch until release_memory(graphs=True)."""
    owner = _OWNER.get((device_id, stream_ptr), CUPY)
    if capturing(stream_ptr):
        buf = _alloc(owner, device_id, nbytes)[0]
        if owner == CUPY:
            _CAPTURED.append(buf)
        return buf
    key = (device_id, stream_ptr, name)
    buf = _PERSISTENT.get(key)
    if buf is None or _nbytes(buf) < nbytes:
        buf = _PERSISTENT[key] = (_alloc_shared_pool(device_id, stream_ptr, nbytes) if owner == TORCH
                                  else _alloc(owner, device_id, nbytes)[0])
        if bound:
            _BOUND.add(key)
    return buf


def pointer(buf) -> int:
    return buf.data_ptr() if hasattr(buf, "data_ptr") else buf.data.ptr


def _nbytes(buf) -> int:
    return buf.nbytes  # torch.Tensor and cupy.ndarray alike (uint8: one byte an element)


def on_release(forget) -> None:
    """Register ``forget()``, called by ``release_memory(graphs=True)``: it drops a cache of prepared calls that hold
    a bound buffer's address (a GEMM bound to the stream's cuBLASLt workspace), so that the buffer can be freed."""
    _ON_RELEASE.append(forget)


def release_memory(*, graphs: bool = False) -> None:
    """Give back the device memory cupy_attn keeps between calls.

    A call's temporaries (the split path's score buffer and its GEMMs' cuBLASLt workspace, the backward's buffers)
    already go back to the caller's allocator when the call returns. What stays is a bounded per-stream cache, kept
    because allocating it per call would cost host time on short calls: on each stream that ran them, the decode
    kernel's partials (≤ 32 MiB) and Linear-BN-softmax's buffers (≤ 64 MiB + 20 bytes a feature), which this frees at
    any time, and the cuBLASLt workspace Linear-BN-softmax's prepared GEMMs bind (32 MiB), which a CUDA graph captured
    on the stream they were warmed up on replays (torch.compile's mode="reduce-overhead" does so): freed only with
    ``graphs=True``, with the prepared calls that hold it (the call cache: the next call of each layout is planned
    again, ~0.1 ms once), and the scratch kept for calls captured on CuPy streams (CuPy's capture has no private
    pool). Pass ``graphs=True`` only when no CUDA graph that captured a cupy_attn call is alive (torch's or CuPy's):
    such a graph would replay into freed memory. For torch streams the cache's torch MemPool is dropped too.

    The memory returns to the allocator it came from: then ``torch.cuda.empty_cache()`` (torch) or
    ``cupy.get_default_memory_pool().free_all_blocks()`` (CuPy) hands it to the driver. Call it when a long-lived
    process is done with such calls for a while (a server after a burst of decode steps) or before measuring memory;
    the next call allocates again.
    """
    if graphs:
        for forget in _ON_RELEASE:
            forget()
        _PERSISTENT.clear()
        _CAPTURED.clear()
    else:
        for key in [k for k in _PERSISTENT if k not in _BOUND]:
            del _PERSISTENT[key]
    _BOUND.intersection_update(_PERSISTENT)
    # Its freed blocks stay reserved while the pool lives; a dropped pool's go back with the next empty_cache (a bound
    # buffer still held is freed when its last holder drops it). The next buffer comes from a new pool.
    _MEMPOOLS.clear()
