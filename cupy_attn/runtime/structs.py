"""Kernel parameter structs: the Python side is a NumPy structured dtype (field order, types, offsets), and the C++
side is checked against it when compiled.

``layout_asserts(ctype, dtype)`` returns ``static_assert`` lines on ``sizeof`` and on each field's size, which a
KernelFamily appends to its source (``KernelFamily.structs``): a field added, dropped or resized on one side only fails
to compile, on every machine (the CPU compile check in CI included), instead of launching a kernel that reads shifted
fields. NVRTC has no ``offsetof``/``__builtin_offsetof``, so field order is not checked here; the structs keep every
field 8 bytes wide (or group narrower fields at the end) so that a size check covers what a reorder could break.
"""
from __future__ import annotations

import numpy as np


def layout_asserts(ctype: str, dtype: np.dtype) -> str:
    """C++ static_asserts that ``ctype`` (a fully qualified struct name) has ``dtype``'s size and field sizes.

    >>> print(layout_asserts("P", np.dtype([("a", np.int64), ("b", np.float32)])))  # doctest: +NORMALIZE_WHITESPACE
    static_assert(sizeof(P) == 12, "P: size differs from its NumPy declaration (12 bytes)");
    static_assert(sizeof(P::a) == 8, "P::a: size differs from its NumPy declaration (8 bytes)");
    static_assert(sizeof(P::b) == 4, "P::b: size differs from its NumPy declaration (4 bytes)");
    """
    # Exact size: the launch hands cuLaunchKernel a pointer to the NumPy bytes and the driver copies sizeof(struct)
    # from it, so a C struct longer than its declaration (tail padding included) would read past the buffer.
    lines = [f'static_assert(sizeof({ctype}) == {dtype.itemsize}, "{ctype}: size differs from its NumPy declaration '
             f'({dtype.itemsize} bytes)");']
    for name in dtype.names:
        size = dtype.fields[name][0].itemsize
        lines.append(f'static_assert(sizeof({ctype}::{name}) == {size}, "{ctype}::{name}: size differs from its NumPy '
                     f'declaration ({size} bytes)");')
    return "\n".join(lines)
