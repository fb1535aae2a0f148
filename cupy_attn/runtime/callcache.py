"""Call cache of the public entry points (SDPA here; Linear-BN-softmax keys through :func:`signatures` too) for torch
CUDA tensors and CuPy arrays: a repeated call skips the checks and the plan.

A call's checks, path choice, kernel choice and launch parameters depend on the inputs' shapes, strides, dtypes,
devices and pointer alignment, on the flags, on the current stream and on the environment overrides, but not on the
data or the addresses. ``key`` reads exactly those (about 20 attribute reads, ~5 µs, against ~120 µs for the full
checks, plan and parameter set-up of a small fused call), and a hit replays the prepared launch on the new pointers:
allocate the output (torch's allocator on torch's current stream, or CuPy's pool on CuPy's current stream), enter the
stream, launch. Entries are made only for calls that ran without copying an input, so every pointer the launch reads
is the caller's own array's.

Only exact ``torch.Tensor`` inputs on a CUDA device, or exact ``cupy.ndarray`` inputs, all of one kind, are cached;
everything else (NumPy, CPU tensors, other DLPack objects, subclasses, mixed kinds) takes the full path every time.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

from . import interop

# Environment variables that change a call's plan (read per call by the full path, so part of the key).
ENV_KEYS = ("CUPY_ATTN_BACKEND", "CUPY_ATTN_WGMMA", "CUPY_ATTN_WORKSPACE_BYTES", "CUPY_ATTN_DECODE")
MAX_ENTRIES = 512

_CACHE: dict = {}


def _sig_torch(t) -> tuple:
    return t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15


def _sig_cupy(a) -> tuple:
    return a.shape, a.strides, a.dtype, a.device.id, a.data.ptr & 15


def signatures(arrays: tuple) -> tuple | None:
    """(kind, per-array signatures, stream handle) when every array that is not None is an exact torch CUDA tensor (or
    nn.Parameter, a module's weights) or an exact cupy.ndarray, all of the first array's kind; None otherwise (the
    call is not cacheable). A None array signs as None. The stream is torch's current stream on the first array's
    device, or CuPy's current stream."""
    first = arrays[0]
    kind = type(first)
    torch = sys.modules.get("torch")
    if torch is not None and kind is torch.Tensor:
        if any(a is not None and type(a) is not kind and type(a) is not torch.nn.Parameter for a in arrays):
            return None
        device = first.get_device()
        if device < 0:
            return None
        return ("torch", tuple(None if a is None else _sig_torch(a) for a in arrays),
                interop.current_torch_stream(device))
    if any(a is not None and type(a) is not kind for a in arrays):
        return None
    cupy = sys.modules.get("cupy")
    if cupy is not None and kind is cupy.ndarray:
        with first.device:
            stream = cupy.cuda.get_current_stream().ptr
        return "cupy", tuple(None if a is None else _sig_cupy(a) for a in arrays), stream
    return None


def typed(*values) -> tuple:
    """Scalars with their types: True == 1 == 1.0 hash alike, but the checks accept some of these and refuse others."""
    return tuple((type(x), x) for x in values)


def key(query, key_, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, return_lse, allow_tf32,
        workspace_bytes, num_splits=None) -> tuple | None:
    """The cache key of a call, or None when the call is not cacheable (see the module docstring)."""
    arrays = signatures((query, key_, value, attn_mask))
    if arrays is None:
        return None
    env = os.environ
    flags = typed(dropout_p, is_causal, scale, enable_gqa, backend, return_lse, allow_tf32, workspace_bytes, num_splits)
    return (*arrays, flags, *(env.get(k) for k in ENV_KEYS))


@dataclasses.dataclass
class Entry:
    """A prepared call: its context (device, stream), output shapes and the launch, replayed on new pointers.

    run(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, mask_ptr) enqueues the work on CuPy's current stream.
    """

    ctx: Any
    out_shape: tuple
    lse_shape: tuple | None
    run: Callable[..., None]

    def __call__(self, query, key_, value, attn_mask):
        if self.ctx.kind == interop.TORCH:
            torch = sys.modules["torch"]
            out = query.new_empty(self.out_shape)  # query's dtype and device, torch's allocator on the current stream
            lse = None if self.lse_shape is None else query.new_empty(self.lse_shape, dtype=torch.float32)
            with self.ctx.activate():
                self.run(query.data_ptr(), key_.data_ptr(), value.data_ptr(), out.data_ptr(),
                         0 if lse is None else lse.data_ptr(), 0 if attn_mask is None else attn_mask.data_ptr())
        else:
            import cupy
            with self.ctx.activate():
                out = cupy.empty(self.out_shape, dtype=query.dtype)
                lse = None if self.lse_shape is None else cupy.empty(self.lse_shape, dtype=cupy.float32)
                self.run(query.data.ptr, key_.data.ptr, value.data.ptr, out.data.ptr,
                         0 if lse is None else lse.data.ptr, 0 if attn_mask is None else attn_mask.data.ptr)
        return out if lse is None else (out, lse)


def get(call_key: tuple) -> Entry | None:
    return _CACHE.get(call_key)


def put(call_key: tuple, entry: Entry) -> None:
    if len(_CACHE) >= MAX_ENTRIES:
        _CACHE.clear()
    _CACHE[call_key] = entry


def clear() -> None:
    _CACHE.clear()
