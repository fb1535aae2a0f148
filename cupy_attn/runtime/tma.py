"""Hopper's Tensor Memory Accelerator on the host: tensor maps, the parameter structs that carry them, layout reasons.

Every Hopper launcher (forward, head-dim 512, scores, P·V, decode, backward) builds its struct and its maps here:

- :func:`c_struct` lays a NumPy dtype out as the C struct (128-byte :data:`MAP` members 64-byte aligned, :data:`I64`
  and :data:`F64` fields); KernelFamily.structs asserts its size and field sizes when the family compiles.
- :class:`MapSpec` is one map's layout without its base address: element type, dims (E, seqlen, heads, batch) with the
  array's own byte strides (BHSD and BSHD views read in place), a box one swizzle atom wide. :func:`encode_tensor_map`
  encodes it at an address through cuTensorMapEncodeTiled (``cuda.bindings.driver``, imported lazily).
- :class:`TensorMaps` keeps the maps of the last base addresses, so a launch replayed on the same arrays encodes
  nothing (~4 µs a map otherwise); runtime.launch's tensor-map slots write them into a launch's parameter bytes.
- :func:`tma_operand_reason`, :func:`out_16b_reason`, :func:`o_tma_reason`: whether TMA (or 16-byte stores) can
  read or write an array in place, and if not, why (the launchers' layout checks and explain()); :func:`bindings_reason`
  whether cuda-bindings is there to encode maps at all (:func:`exp2_tma_reason`: and scale > 0).

TMA requires a 16-byte aligned base and strides that are positive multiples of 16 bytes below 2^40.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .interop import dtype_name
from .kernel_abi import element_strides

MAP = np.dtype((np.uint8, 128))  # one CUtensorMap: 128 opaque bytes, 64-byte aligned in a struct
I64, F64 = np.dtype(np.int64), np.dtype(np.float64)


def c_struct(fields) -> np.dtype:
    """A NumPy dtype laid out as the C struct with these (name, dtype, alignment) members, in order.

    >>> c_struct([("tma", MAP, 64), ("n", I64, 8)]).itemsize, c_struct([("n", I64, 8), ("tma", MAP, 64)]).itemsize
    (192, 192)
    """
    offsets, off, align = [], 0, 1
    for _, dt, a in fields:
        off = -(-off // a) * a
        offsets.append(off)
        off += dt.itemsize
        align = max(align, a)
    return np.dtype({"names": [f[0] for f in fields], "formats": [f[1] for f in fields], "offsets": offsets,
                     "itemsize": -(-off // align) * align})


def bindings_reason() -> str | None:
    """None when cuda-bindings imports (cuTensorMapEncodeTiled, which every tensor map needs), else why not."""
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return "cuda-bindings is not installed (cuTensorMapEncodeTiled)"
    return None


def exp2_tma_reason(kernel: str, scale: float) -> str | None:
    """What the Hopper kernels that fold the scale into exp2 and read by TMA ask of every call: scale > 0 and
    cuda-bindings (:func:`bindings_reason`); None, or why not, naming ``kernel``."""
    if not scale > 0:
        return f"scale {scale}: {kernel} folds the scale into exp2 and needs scale > 0"
    return bindings_reason()


def tma_operand_reason(name: str, a) -> str | None:
    """None when TMA can read the (B, H, S, D) array ``a`` in place (16-byte aligned base; batch / head / row strides
    positive multiples of 16 bytes below 2^40, axes of size 1 aside), else why not, naming it ``name``."""
    if a.data.ptr % 16:
        return f"{name} is not 16-byte aligned (TMA)"
    for axis, (n, s) in zip("bhs", zip(a.shape[:-1], a.strides[:-1])):
        if n > 1 and (s % 16 or s <= 0 or s >= 2 ** 40):
            return f"{name} stride along {axis} is {s} bytes: TMA needs a positive multiple of 16 below 2^40"
    return None


def out_16b_reason(out, kernel: str = "the kernel") -> str | None:
    """None when ``kernel`` can store out's rows by 16-byte stores (16-byte aligned base, row / head / batch strides
    multiples of 8 elements, unit column stride), else why not."""
    if out.data.ptr % 16 or any(s % 8 for s in element_strides(out)[:-1]) or out.strides[-1] != out.itemsize:
        return f"out rows are not 16-byte aligned ({kernel} stores 16 bytes at a time)"
    return None


def o_tma_reason(out) -> str | None:
    """None when an epilogue can store ``out`` (B, Hq, L, Ev) by TMA at a 16-byte aligned base, else why not."""
    if out.shape[-1] % 8:
        return f"head_dim_v {out.shape[-1]} is not a multiple of 8"
    for axis, (n, st) in zip("bhl", zip(out.shape[:-1], out.strides[:-1])):
        if n > 1 and (st % 16 or st <= 0 or st >= 2 ** 40):
            return f"out stride along {axis} is {st} bytes"
    if out.strides[-1] != out.itemsize:
        return "out's last dimension is not contiguous"
    return None


@dataclasses.dataclass(frozen=True)
class MapSpec:
    """Everything of one tensor map but its base address: element type, dims (E, seqlen, heads, batch), byte strides
    of the last three, box (box_cols, rows, 1, 1): one swizzle atom wide (64 columns: 128-byte swizzle; 32: 64-byte)."""
    dtype: str
    dims: tuple
    strides: tuple
    box_rows: int
    box_cols: int = 64

    @classmethod
    def of(cls, a, rows: int, cols: int = 64) -> "MapSpec":
        """The map of a (B, H, S, D) array with boxes of ``rows`` rows and ``cols`` columns."""
        b, h, s, e = a.shape
        # A stride along an axis of size 1 is never used, but the driver checks it (a multiple of 16): give such an
        # axis the packed stride, rounded up to 16 bytes. tma_operand_reason checked the others.
        strides, extent = [], e * a.itemsize
        for n, st in ((s, a.strides[2]), (h, a.strides[1]), (b, a.strides[0])):
            st = st if n > 1 else -(-extent // 16) * 16
            strides.append(st)
            extent = st * n
        return cls(dtype_name(a.dtype), (e, s, h, b), tuple(strides), rows, cols)

    def encode(self, ptr: int) -> np.ndarray:
        """The 128-byte CUtensorMap for this layout at base address ptr."""
        return encode_tensor_map(self.dtype, ptr, self.dims, self.strides, (self.box_cols, self.box_rows, 1, 1))


@functools.lru_cache(maxsize=None)
def _driver_init() -> None:
    """cuInit through cuda.bindings, once (CuPy has initialized the driver already; this is for cuda.bindings' own
    entry points, as the CuTe GEMM example does)."""
    from cuda.bindings import driver as cu
    cu.cuInit(0)


def encode_tensor_map(dtype: str, ptr: int, dims, strides, box, swizzle: int | None = None) -> np.ndarray:
    """cuTensorMapEncodeTiled: a 16-bit tensor in the swizzle as wide as a box row (box inner dim 64 elements = 128
    bytes: SWIZZLE_128B; 32 = 64 bytes: SWIZZLE_64B, the head-dim-96 tiles), or a float32 one unswizzled (rows of
    statistics; box inner dim a multiple of 4 elements) unless ``swizzle=128`` (box inner dim 32 elements, 128 bytes:
    the backward's dQ staging); zero fill out of bounds, L2 promotion of 256 bytes.
    ``strides``: byte strides of dims[1:]. Returns the map's 128 bytes. ValueError for another 16-bit box width.
    The binding's argument objects are built once per layout (``_encode_args``): a call on a new base address only
    converts the address."""
    import ctypes
    from cuda.bindings import driver as cu

    args = _encode_args(dtype, tuple(dims), tuple(strides), tuple(box), swizzle)
    err, tmap = cu.cuTensorMapEncodeTiled(args[0], args[1], ptr, *args[2:])
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}): dims {dims}, byte strides {strides}, box {box}")
    return np.frombuffer(ctypes.string_at(tmap.getPtr(), 128), np.uint8)


@functools.lru_cache(maxsize=1024)
def _encode_args(dtype: str, dims: tuple, strides: tuple, box: tuple, swizzle_bytes: int | None = None) -> tuple:
    """cuTensorMapEncodeTiled's arguments but the base address, as cuda.bindings objects (see encode_tensor_map)."""
    from cuda.bindings import driver as cu

    _driver_init()
    types = cu.CUtensorMapDataType
    data_type = {"float16": types.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, "bfloat16": types.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                 "float32": types.CU_TENSOR_MAP_DATA_TYPE_FLOAT32}[dtype]
    swizzles = {128: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                64: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B}
    if dtype == "float32":
        if swizzle_bytes is None:
            swizzle = cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE
        elif swizzle_bytes == 128 and box[0] * 4 == 128:
            swizzle = swizzles[128]
        else:
            raise ValueError(f"box {box}, swizzle {swizzle_bytes}: a swizzled float32 map's box rows are 32 elements")
    elif box[0] * 2 in swizzles:
        swizzle = swizzles[box[0] * 2]
    else:
        raise ValueError(f"box {box}: a 16-bit tensor map's box rows are 64 or 128 bytes (the swizzle width)")
    return (data_type, len(dims), [cu.cuuint64_t(d) for d in dims], [cu.cuuint64_t(s) for s in strides],
            [cu.cuuint32_t(x) for x in box], [cu.cuuint32_t(1)] * len(dims),
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


class TensorMaps:
    """Tensor maps of fixed layouts at base addresses that change between calls: ``maps(*ptrs)`` returns one encoded
    map per encoder (a callable ptr -> the map's 128 bytes, e.g. MapSpec.encode), encoding again only when the bases
    differ from the last call's (~4 µs a map through cuda.bindings; a call replayed on the same arrays encodes
    nothing). The last (bases, maps) pair is replaced as one tuple, so a concurrent caller sees the old pair or the
    new one, never a mix."""

    __slots__ = ("encoders", "_last")

    def __init__(self, encoders):
        self.encoders = tuple(encoders)
        self._last = (None, None)

    def __call__(self, *ptrs: int) -> tuple:
        bases, maps = self._last
        if bases != ptrs:
            maps = tuple(encode(ptr) for encode, ptr in zip(self.encoders, ptrs))
            self._last = (ptrs, maps)
        return maps
