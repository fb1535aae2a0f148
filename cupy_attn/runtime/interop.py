"""Interop: torch tensors, CuPy arrays, NumPy arrays and any ``__dlpack__`` object in; the caller's kind back out.

GPU inputs become CuPy views through DLPack, zero-copy. A call runs on the caller's stream: torch's current stream for
torch tensors (wrapped as a ``cupy.cuda.ExternalStream``, so results are ordered with the caller's torch work and
nothing synchronizes the device), CuPy's current stream otherwise. Outputs for torch callers are allocated by torch's
caching allocator on that same stream, then viewed from CuPy.

CPU inputs (NumPy arrays, CPU torch tensors) are the reference path: they are read as NumPy arrays.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from typing import Any

import numpy as np

from . import workspace

TORCH = "torch"          # torch CUDA tensor
CUPY = "cupy"            # cupy.ndarray
DLPACK = "dlpack"        # any other object with __dlpack__ on a CUDA device; results come back as CuPy arrays
NUMPY = "numpy"          # numpy.ndarray: CPU reference path
TORCH_CPU = "torch_cpu"  # CPU torch tensor: CPU reference path

CPU_KINDS = (NUMPY, TORCH_CPU)

# What a call's results come back as, per input kind. All array arguments of one call must agree, so the result's kind
# is never a guess: NumPy with torch, or CuPy with torch, is refused (DLPack objects come back as CuPy, so they mix with
# CuPy arrays).
_FAMILY = {TORCH: "torch.Tensor", TORCH_CPU: "torch.Tensor", NUMPY: "numpy.ndarray", CUPY: "cupy.ndarray",
           DLPACK: "cupy.ndarray"}
_TYPE_NAME = {TORCH: "torch.Tensor", TORCH_CPU: "torch.Tensor", NUMPY: "numpy.ndarray", CUPY: "cupy.ndarray",
              DLPACK: "CUDA __dlpack__ object"}


def check_same_kind(name: str, kind: str, first_name: str, first_kind: str) -> None:
    """TypeError naming ``name`` when its kind of array differs from the call's first array argument's."""
    if _FAMILY[kind] != _FAMILY[first_kind]:
        raise TypeError(f"{name} is a {_TYPE_NAME[kind]} but {first_name} is a {_TYPE_NAME[first_kind]}: pass one "
                        f"kind of array (the result comes back as {first_name}'s kind)")


def check_like_query(name: str, x, ctx, first: str = "query") -> str:
    """The kind of ``x``, an array argument of the call whose first array (``first``, the query) gave ``ctx`` (a
    CallContext), after checking it is of that array's kind and on its device: ValueError naming ``name`` for CPU
    against CUDA or another device, TypeError for another kind of array."""
    kind = kind_of(x, name)
    if (kind in CPU_KINDS) != (ctx.kind in CPU_KINDS):
        where = "CPU" if kind in CPU_KINDS else "a CUDA device"
        raise ValueError(f"{name} is on {where} but {first} is not: all inputs must be on the same device")
    check_same_kind(name, kind, first, ctx.kind)
    if ctx.on_gpu and device_of(x, kind) != ctx.device_id:
        raise ValueError(f"{name} is on cuda:{device_of(x, kind)} but {first} is on cuda:{ctx.device_id}")
    return kind

_KDL_CUDA = 2  # DLDeviceType for CUDA memory in __dlpack_device__()


def _torch():
    """torch if the caller has imported it (we never import it ourselves: a torch tensor implies it is loaded)."""
    return sys.modules.get("torch")


def is_torch_tensor(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


_IS_COMPILING: list = []  # torch.compiler.is_compiling, once torch is loaded


def torch_compiling() -> bool:
    """True while Dynamo traces the call (torch.compile, torch.export): the entry points then route torch tensors to
    the custom ops of cupy_attn.torch_ops before touching the call cache. ~0.1 µs when torch is loaded. The function
    is looked up once and kept: Dynamo traces this check, and reading sys.modules while it traces was seen to fail
    ("dictionary changed size during iteration") when a module import ran concurrently."""
    if not _IS_COMPILING:
        torch = _torch()
        if torch is None:
            return False
        _IS_COMPILING.append(torch.compiler.is_compiling)
    return _IS_COMPILING[0]()


def is_tracing_tensor(x: Any) -> bool:
    """A torch tensor that stands for data while torch traces (FakeTensor, FunctionalTensor: make_fx, AOTAutograd,
    FakeTensorMode): it has no memory to read, so the call goes to the custom op, whose fake implementation gives the
    output's shape. Only asked on the uncached path (the call cache takes exact torch.Tensor inputs only)."""
    torch = _torch()
    if torch is None or not isinstance(x, torch.Tensor) or type(x) is torch.Tensor or type(x) is torch.nn.Parameter:
        return False
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    return isinstance(x, (FakeTensor, FunctionalTensor))


def kind_of(x: Any, name: str) -> str:
    """Which kind of array ``x`` is; TypeError naming ``name`` for anything that is not an array."""
    if is_torch_tensor(x):
        return TORCH if x.is_cuda else TORCH_CPU
    if isinstance(x, np.ndarray):
        return NUMPY
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return CUPY
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        dev_type, _ = x.__dlpack_device__()
        if int(dev_type) == _KDL_CUDA:
            return DLPACK
        raise TypeError(f"{name}: DLPack device type {int(dev_type)} is not supported (CUDA memory or NumPy only)")
    raise TypeError(f"{name} must be a torch.Tensor, cupy.ndarray, numpy.ndarray or a CUDA __dlpack__ object, "
                    f"got {type(x).__name__}")


def device_of(x: Any, kind: str) -> int | None:
    """CUDA device ordinal of a GPU array, None for CPU kinds."""
    if kind == TORCH:
        return x.device.index if x.device.index is not None else _torch().cuda.current_device()
    if kind == CUPY:
        return x.device.id
    if kind == DLPACK:
        return int(x.__dlpack_device__()[1])
    return None


@functools.lru_cache(maxsize=None)
def device_sms(device_id: int) -> int:
    """Multiprocessor count of a device (132 on an H100 SXM or H200), looked up once per device."""
    import cupy
    return int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id))


def dtype_of(x: Any, kind: str) -> np.dtype:
    """The element type as a NumPy dtype (bfloat16 as ml_dtypes.bfloat16) for every kind."""
    if kind in (TORCH, TORCH_CPU):
        return torch_to_numpy_dtype(x.dtype)
    if kind == DLPACK:
        return np.dtype(dlpack_view(x).dtype)
    return np.dtype(x.dtype)


_NAMES: dict = {}


def dtype_name(dtype) -> str:
    """``np.dtype(dtype).name`` memoized by dtype object: the property costs ~3 µs, and hot paths ask for it often."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = np.dtype(dtype).name
    return name


_TORCH_DTYPES: dict = {}  # torch.dtype -> NumPy dtype, filled on first use (a dict hit is ~50 ns; a probe ~20 µs)


def torch_to_numpy_dtype(dt) -> np.dtype:
    """torch.dtype -> NumPy dtype (bfloat16 as ml_dtypes.bfloat16), memoized."""
    hit = _TORCH_DTYPES.get(dt)
    if hit is not None:
        return hit
    torch = _torch()
    if dt == torch.bfloat16:
        import ml_dtypes
        _TORCH_DTYPES[dt] = np.dtype(ml_dtypes.bfloat16)
    elif dt == torch.bool:
        _TORCH_DTYPES[dt] = np.dtype(np.bool_)
    else:
        _TORCH_DTYPES[dt] = np.dtype(torch.empty((), dtype=dt).numpy().dtype)
    return _TORCH_DTYPES[dt]


def _numpy_to_torch_dtype(dt: np.dtype):
    dt = np.dtype(dt)
    for t, n in _TORCH_DTYPES.items():
        if n == dt:
            return t
    torch = _torch()
    t = torch.bfloat16 if dt.name == "bfloat16" else torch.from_numpy(np.empty((), dtype=dt)).dtype
    torch_to_numpy_dtype(t)
    return t


def dlpack_view(x: Any):
    import cupy
    return cupy.from_dlpack(x)


def bits_view(x):
    """The same bytes as unsigned integers of the element's size (a view): copies through it run on any dtype, bf16
    included, bit for bit."""
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.itemsize])


@dataclasses.dataclass
class CallContext:
    """Where and how one call runs: the caller's kind, device and stream, and how to allocate outputs for it."""

    kind: str
    device_id: int | None
    stream: Any = None  # cupy.cuda.Stream / ExternalStream for GPU kinds

    @property
    def on_gpu(self) -> bool:
        return self.kind not in CPU_KINDS

    @contextlib.contextmanager
    def activate(self):
        """Make the call's device and stream current for CuPy (allocations, launches, cuBLAS)."""
        import cupy
        with cupy.cuda.Device(self.device_id), self.stream:
            yield

    def as_cupy(self, x: Any):
        """Zero-copy CuPy view of a GPU input.

        torch tensors are viewed through their data pointer and strides, the tensor itself owning the memory: the
        same zero-copy view DLPack gives, at a tenth of the host time (no capsule, no stream hand-shake; the call
        already runs on the tensor's current stream). Other objects go through DLPack.
        """
        import cupy
        if isinstance(x, cupy.ndarray):
            return x
        if is_torch_tensor(x) and x.numel() > 0:
            dtype = torch_to_numpy_dtype(x.dtype)
            extent = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
            mem = cupy.cuda.UnownedMemory(x.data_ptr(), extent * dtype.itemsize, x, self.device_id)
            return cupy.ndarray(tuple(x.shape), dtype, cupy.cuda.MemoryPointer(mem, 0),
                                strides=tuple(st * dtype.itemsize for st in x.stride()))
        if is_torch_tensor(x):
            x = x.detach()
            if x.dtype == _torch().bool:  # DLPack's bool is not accepted everywhere; the bytes are 0/1 either way
                return cupy.from_dlpack(x.view(_torch().uint8)).view(cupy.bool_)
        return cupy.from_dlpack(x)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype):
        """An uninitialised output on the caller's allocator: returns (native object to hand back, CuPy view)."""
        import cupy
        if self.kind == TORCH:
            torch = _torch()
            t = torch.empty(shape, dtype=_numpy_to_torch_dtype(dtype), device=f"cuda:{self.device_id}")
            return t, self.as_cupy(t)
        a = cupy.empty(shape, dtype=dtype)
        return a, a

    def contiguous(self, x):
        """A C-contiguous copy of the CuPy array ``x`` (an input the kernels cannot read in place) from the caller's
        allocator on the call's stream (CuPy's must be current: ``activate``): for torch callers a torch tensor, which
        torch.cuda.empty_cache() can return and a CUDA-graph capture takes from its pool; CuPy's pool otherwise.
        Copied bit for bit, so any dtype (bf16 included)."""
        import cupy
        if self.kind != TORCH:
            return cupy.ascontiguousarray(x)
        _, y = self.empty(tuple(x.shape), x.dtype)
        bits_view(y)[...] = bits_view(x)
        return y

    def full(self, shape: tuple[int, ...], dtype: np.dtype, value: float):
        """A new contiguous array filled with ``value`` from the caller's allocator on the call's stream, returned as
        the caller's kind (torch tensor, or CuPy array) without a CuPy view: empty results are made this way (an empty
        torch tensor has no memory to view)."""
        if self.kind == TORCH:
            return _torch().full(shape, value, dtype=_numpy_to_torch_dtype(dtype), device=f"cuda:{self.device_id}")
        import cupy
        with self.activate():
            return cupy.full(shape, value, dtype=dtype)


_STREAMS: dict = {}  # (device, CUDA stream handle) -> CuPy stream object wrapping it; handles are stable


def current_torch_stream(device_id: int) -> int:
    """torch's current CUDA stream handle on ``device_id``: the raw getter inductor uses (~0.3 µs), else the public
    API (which builds a torch Stream object, a few µs)."""
    torch = _torch()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device_id) if raw is not None else torch.cuda.current_stream(device_id).cuda_stream


def _external_stream(torch_stream, device_id: int):
    """A CuPy view of a torch stream: Stream.from_external (CUDA stream protocol) where CuPy has it, else the older
    ExternalStream (deprecated in CuPy 14)."""
    import cupy
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(torch_stream, "__cuda_stream__"):
        return from_external(torch_stream)
    return cupy.cuda.ExternalStream(torch_stream.cuda_stream, device_id)


_CONTEXTS: dict = {}  # (kind, device, stream handle) -> CallContext: one object per caller stream, reused


def context_for(x: Any, name: str = "query") -> CallContext:
    """Context from the first array argument: torch's current stream for torch tensors, CuPy's otherwise. Contexts
    are cached per (kind, device, stream), so a call costs the stream look-up, not the CuPy stream wrapper."""
    kind = kind_of(x, name)
    if kind in CPU_KINDS:
        return CallContext(kind, None)
    import cupy
    device_id = device_of(x, kind)
    if kind == TORCH:
        handle = current_torch_stream(device_id)
        ctx = _CONTEXTS.get((kind, device_id, handle))
        if ctx is None:  # only now the torch Stream object, for the CuPy wrapper
            stream = _STREAMS.get((device_id, handle))
            if stream is None:
                stream = _STREAMS[device_id, handle] = _external_stream(_torch().cuda.current_stream(device_id),
                                                                        device_id)
            workspace.own_stream(device_id, handle, TORCH)  # this stream's cached buffers come from torch
            ctx = _CONTEXTS[kind, device_id, handle] = CallContext(kind, device_id, stream)
        return ctx
    with cupy.cuda.Device(device_id):
        stream = cupy.cuda.get_current_stream()
    ctx = _CONTEXTS.get((kind, device_id, stream.ptr))
    if ctx is None or ctx.stream is not stream:
        ctx = _CONTEXTS[kind, device_id, stream.ptr] = CallContext(kind, device_id, stream)
    return ctx


def to_numpy(x: Any, kind: str) -> np.ndarray:
    """A CPU array as NumPy (bf16 torch tensors widen to float32, exactly; no other conversion)."""
    if kind == TORCH_CPU:
        x = x.detach()
        if x.dtype == _torch().bfloat16:
            return x.float().numpy()
        return x.numpy()
    if kind == NUMPY:
        return x
    import cupy
    return cupy.asnumpy(dlpack_view(x) if kind in (TORCH, DLPACK) else x)


def from_numpy(a: np.ndarray, like_kind: str, dtype: np.dtype, device_id: int | None = None):
    """Return a NumPy result as ``like_kind`` with element type ``dtype``."""
    if like_kind == NUMPY:
        return a.astype(dtype, copy=False)
    if like_kind in (TORCH, TORCH_CPU):
        torch = _torch()
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)).to(_numpy_to_torch_dtype(dtype))
        return t.to(f"cuda:{device_id}") if like_kind == TORCH else t
    import cupy
    with cupy.cuda.Device(device_id):
        return cupy.asarray(a).astype(dtype)
