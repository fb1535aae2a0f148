"""Kernel parameter structs are declared once in Python (NumPy structured dtypes) and checked against the C++ structs
at compile time: every family carries its structs, and a drifted declaration fails to compile (CPU, NVRTC)."""
import dataclasses

import numpy as np
import pytest

from cupy_attn.linear_bn_softmax import launch
from cupy_attn.runtime import compile as _compile
from cupy_attn.runtime.structs import layout_asserts


def test_every_family_declares_its_structs():
    for family in _compile.all_families():
        assert family.structs, f"{family.name} declares no parameter struct"
        for ctype, dtype in family.structs:
            assert layout_asserts(ctype, dtype) in family.code()


def test_drifted_declaration_fails_to_compile():
    ctype, dtype = launch.FOLD_RUNNING_STATS.structs[0]
    short = np.dtype(dtype.descr[:-1])  # one field dropped on the Python side
    bad = dataclasses.replace(launch.FOLD_RUNNING_STATS, structs=((ctype, short),))
    with pytest.raises(_compile.KernelCompileError, match="size differs from its NumPy declaration"):
        _compile.compile_family(bad, "sm_80")
