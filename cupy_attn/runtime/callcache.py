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

import os
import sys
from typing import Any, Callable

from . import env, interop, workspace

# Environment variables that change a call's plan (read per call by the full path, so part of the key): env.KNOBS'
# launch=True entries.
ENV_KEYS = env.CALL_KEY
MAX_ENTRIES = 512

_CACHE: dict = {}

# os.environ decodes its keys and values on every lookup (~0.4 µs each); its mapping of encoded keys to encoded values
# is read directly on the hot path (CPython's posix os.environ keeps it as ``_data``; the public API elsewhere).
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEYS_ENCODED = tuple(os.environ.encodekey(k) for k in ENV_KEYS) if _ENV_DATA is not None else ()


def env_values() -> tuple:
    """The current values of ENV_KEYS (encoded or not: compared only with each other)."""
    if _ENV_DATA is not None:
        get = _ENV_DATA.get
        return tuple([get(k) for k in _ENV_KEYS_ENCODED])
    return tuple([os.environ.get(k) for k in ENV_KEYS])


def signatures(arrays: tuple) -> tuple | None:
    """(kind, per-array signatures, stream handle) when every array that is not None is an exact torch CUDA tensor (or
    nn.Parameter, a module's weights) or an exact cupy.ndarray, all of the first array's kind; None otherwise (the
    call is not cacheable). A None array signs as None. A signature is (shape, strides, dtype, device, address mod
    16). The stream is torch's current stream on the first array's device, or CuPy's current stream."""
    first = arrays[0]
    kind = type(first)
    torch = sys.modules.get("torch")
    if torch is not None and kind is torch.Tensor:
        parameter = torch.nn.Parameter
        sigs = []
        for a in arrays:
            if a is None:
                sigs.append(None)
            elif type(a) is kind or type(a) is parameter:
                sigs.append((a.shape, a.stride(), a.dtype, a.get_device(), a.data_ptr() & 15))
            else:
                return None
        device = sigs[0][3]
        if device < 0:
            return None
        return "torch", tuple(sigs), interop.current_torch_stream(device)
    if any(a is not None and type(a) is not kind for a in arrays):
        return None
    cupy = sys.modules.get("cupy")
    if cupy is not None and kind is cupy.ndarray:
        with first.device:
            stream = cupy.cuda.get_current_stream().ptr
        return "cupy", tuple([None if a is None else (a.shape, a.strides, a.dtype, a.device.id, a.data.ptr & 15)
                              for a in arrays]), stream
    return None


def typed(*values) -> tuple:
    """Scalars with their types: True == 1 == 1.0 hash alike, but the checks accept some of these and refuse others."""
    return tuple((type(x), x) for x in values)


def key(query, key_, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, return_lse, allow_tf32,
        workspace_bytes, num_splits=None, window_size=None, softcap=None) -> tuple | None:
    """The cache key of a call, or None when the call is not cacheable (see the module docstring). Every flag is
    keyed with its type (True == 1 == 1.0 hash alike, but the checks accept some of these and refuse others),
    written out rather than through ``typed``: this runs on every call (~1 µs saved)."""
    arrays = signatures((query, key_, value, attn_mask))
    if arrays is None:
        return None
    return (*arrays, type(dropout_p), dropout_p, type(is_causal), is_causal, type(scale), scale, type(enable_gqa),
            enable_gqa, type(backend), backend, type(return_lse), return_lse, type(allow_tf32), allow_tf32,
            type(workspace_bytes), workspace_bytes, type(num_splits), num_splits, type(window_size), window_size,
            type(softcap), softcap, *env_values())


class Entry:
    """A prepared call: its context (device, stream), output shapes and the launch, replayed on new pointers.

    run(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, mask_ptr) enqueues the work on the context's stream by itself (the
    fused launch is bound to the stream; the split path enters it), so a hit only allocates the outputs (torch's
    allocator on torch's current stream, or CuPy's pool on the context's stream) and launches; the context is entered
    only when another device is current.
    """

    __slots__ = ("ctx", "out_shape", "lse_shape", "run", "_get_device")

    def __init__(self, ctx: Any, out_shape: tuple, lse_shape: tuple | None, run: Callable[..., None]):
        from cupy.cuda import runtime
        self.ctx, self.out_shape, self.lse_shape, self.run = ctx, out_shape, lse_shape, run
        self._get_device = runtime.getDevice

    def __call__(self, query, key_, value, attn_mask):
        if self._get_device() != self.ctx.device_id:
            with self.ctx.activate():
                return self._replay(query, key_, value, attn_mask)
        return self._replay(query, key_, value, attn_mask)

    def _replay(self, query, key_, value, attn_mask):
        if self.ctx.kind == interop.TORCH:
            out = query.new_empty(self.out_shape)  # query's dtype and device, torch's allocator on the current stream
            lse = None if self.lse_shape is None else query.new_empty(self.lse_shape, dtype=_torch_float32())
            self.run(query.data_ptr(), key_.data_ptr(), value.data_ptr(), out.data_ptr(),
                     0 if lse is None else lse.data_ptr(), 0 if attn_mask is None else attn_mask.data_ptr())
        else:
            import cupy
            with self.ctx.stream:  # CuPy's pool orders the allocation on the call's stream
                out = cupy.empty(self.out_shape, dtype=query.dtype)
                lse = None if self.lse_shape is None else cupy.empty(self.lse_shape, dtype=cupy.float32)
            self.run(query.data.ptr, key_.data.ptr, value.data.ptr, out.data.ptr,
                     0 if lse is None else lse.data.ptr, 0 if attn_mask is None else attn_mask.data.ptr)
        return out if lse is None else (out, lse)


def _torch_float32():
    return sys.modules["torch"].float32


# Calls whose launches hold the caller's extra arrays (score_mod / mask_mod aux arrays, a BlockMask; a decode loop's
# lengths and table) keep them alive while cached: such entries live in a small table of their own (MAX_HOLDING), so a
# loop that passes new arrays each call holds at most that many, and never evicts the plain calls.
_HOLDING: dict = {}
MAX_HOLDING = 32


def get(call_key: tuple) -> Entry | None:
    return _CACHE.get(call_key)


def put(call_key: tuple, entry: Entry) -> None:
    if len(_CACHE) >= MAX_ENTRIES:
        _CACHE.clear()
    _CACHE[call_key] = entry


def get_holding(call_key: tuple):
    """The entry of a call whose launch holds extra arrays (see _HOLDING), or None."""
    return _HOLDING.get(call_key)


def put_holding(call_key: tuple, entry) -> None:
    if len(_HOLDING) >= MAX_HOLDING:
        _HOLDING.clear()
    _HOLDING[call_key] = entry


def clear() -> None:
    _CACHE.clear()
    _HOLDING.clear()


# Entries hold prepared calls whose bound GEMMs keep a stream's cuBLASLt workspace (Linear-BN-softmax's):
# release_memory(graphs=True) drops them with it.
workspace.on_release(clear)
