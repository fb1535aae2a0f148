"""What the launchers and the kernels agree on, declared once: element types, mask-kind codes, log2(e), strides.

- ``C_TYPE``: NumPy dtype name -> the C++ element type a kernel template takes (``__half``, ``__nv_bfloat16``,
  ``float``); ``C_TYPE_16``: the 16-bit ones the tensor-core kernels serve; ``DTYPE_OF_C``: the reverse.
- ``MASK_KIND``: attn_mask dtype name -> the code a kernel's ``mask_kind`` field takes (cuda_src/common/mask.cuh's
  MaskKind; ``MASK_NONE`` = 0: no mask).
- ``LOG2E``: the kernels work in base 2 (exp2), so a launcher passes ``scale · LOG2E`` (common/types.cuh's kLog2e).
- :func:`element_strides`: a kernel's strides are in elements, NumPy's and CuPy's in bytes.
"""
from __future__ import annotations

LOG2E = 1.4426950408889634

C_TYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
C_TYPE_16 = {name: C_TYPE[name] for name in ("float16", "bfloat16")}
DTYPE_OF_C = {c: name for name, c in C_TYPE.items()}

MASK_NONE = 0
MASK_KIND = {"bool": 1, "float16": 2, "bfloat16": 3, "float32": 4}


def element_strides(a) -> list[int]:
    """``a``'s strides in elements (its byte strides over its itemsize)."""
    return [s // a.itemsize for s in a.strides]
