"""What the launchers and the kernels agree on, declared once: element types, mask-kind codes, log2(e), strides,
head-dim buckets, array layouts.

- ``C_TYPE``: NumPy dtype name -> the C++ element type a kernel template takes (``__half``, ``__nv_bfloat16``,
  ``float``); ``C_TYPE_16``: the 16-bit ones the tensor-core kernels serve; ``DTYPE_OF_C``: the reverse.
- ``MASK_KIND``: attn_mask dtype name -> the code a kernel's ``mask_kind`` field takes (cuda_src/common/mask.cuh's
  MaskKind; ``MASK_NONE`` = 0: no mask).
- ``LOG2E``: the kernels work in base 2 (exp2), so a launcher passes ``scale · LOG2E`` (common/types.cuh's kLog2e).
- :func:`element_strides`: a kernel's strides are in elements, NumPy's and CuPy's in bytes (:func:`set_strides` writes
  them into a parameter struct); :func:`rows16`: whether
  every row start is 16-byte aligned (16-byte copies).
- :func:`head_dim_bucket`: the instantiated head dim a call runs at (every family's buckets, one rule);
  :func:`tile_arch`: the arch key of the tile tables.
- :class:`Layout`: an array's layout without its memory (an operand a kernel will read whose buffer does not exist
  yet: the backward's contiguous dout, the call's own output).
"""
from __future__ import annotations

import dataclasses

import numpy as np

LOG2E = 1.4426950408889634

C_TYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
C_TYPE_16 = {name: C_TYPE[name] for name in ("float16", "bfloat16")}
DTYPE_OF_C = {c: name for name, c in C_TYPE.items()}

MASK_NONE = 0
MASK_KIND = {"bool": 1, "float16": 2, "bfloat16": 3, "float32": 4}


def element_strides(a) -> list[int]:
    """``a``'s strides in elements (its byte strides over its itemsize)."""
    return [s // a.itemsize for s in a.strides]


def set_strides(params, *fields) -> None:
    """For each (name, array, axes): ``params[f"{name}_stride_{axis}"]`` = the array's element stride along each axis
    named in ``axes`` (e.g. "bhl": batch, head, row), in order; arrays that are None are skipped (their fields stay 0).

    >>> import numpy as np
    >>> p = np.zeros((), [("q_stride_b", np.int64), ("q_stride_h", np.int64), ("q_stride_l", np.int64)])
    >>> set_strides(p, ("q", np.zeros((2, 3, 5, 8), np.float16), "bhl"), ("k", None, "bhs")); p.item()
    (120, 40, 8)
    """
    for name, array, axes in fields:
        if array is not None:
            for axis, stride in zip(axes, element_strides(array)):
                params[f"{name}_stride_{axis}"] = stride


def rows16(a) -> bool:
    """Every row start of ``a`` 16-byte aligned (base address and every byte stride but the last): the kernels may copy
    its rows 16 bytes at a time (cp.async)."""
    return a.data.ptr % 16 == 0 and all(s % 16 == 0 for s in a.strides[:-1])


def head_dim_bucket(head_dim: int, head_dim_v: int, buckets, floor: int = 0) -> int | None:
    """The instantiated head dim a call with query/key head dim E and value head dim Ev runs at: the smallest of
    ``buckets`` ≥ max(E, Ev) (the kernel zero-pads the columns past E and Ev); None when E or Ev is below 1, when
    max(E, Ev) ≤ ``floor`` (head dims a family leaves to another kernel) or past the largest bucket.

    >>> head_dim_bucket(40, 40, (32, 64, 128)), head_dim_bucket(192, 128, (64, 128, 256))
    (64, 256)
    >>> head_dim_bucket(300, 8, (256,)), head_dim_bucket(32, 32, (64, 96, 128, 256), floor=32)
    (None, None)
    >>> head_dim_bucket(0, 64, (64,)) is None
    True
    """
    need = max(head_dim, head_dim_v)
    if min(head_dim, head_dim_v) < 1 or need <= floor:
        return None
    return next((d for d in sorted(buckets) if d >= need), None)


def tile_arch(arch: int) -> int:
    """The arch key of the tile tables: 9 for Hopper (compute capability 9.x), 8 for sm_8x and anything newer
    (sm_100/sm_120 run the mma.sync kernels too; the arch-8 tiles fit the 99 KB of shared memory of the smallest)."""
    return 9 if arch // 10 == 9 else 8


@dataclasses.dataclass(frozen=True)
class Layout:
    """Shape, byte strides, dtype and base address of an array, read as the launchers read a CuPy array's: an array a
    kernel will read or write whose memory does not exist yet (the backward's contiguous dout; the output a call
    allocates, contiguous and 256-byte aligned, which the plan's layout checks read)."""
    shape: tuple
    strides: tuple
    dtype: np.dtype
    ptr: int

    @property
    def data(self):
        return self

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @classmethod
    def contiguous(cls, shape, dtype, ptr: int = 0) -> "Layout":
        dtype = np.dtype(dtype)
        strides, step = [], dtype.itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= n
        return cls(tuple(shape), tuple(reversed(strides)), dtype, ptr)
