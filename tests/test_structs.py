"""Kernel parameter structs are declared once in Python (NumPy structured dtypes) and checked against the C++ structs
at compile time: every family carries its structs, and a drifted declaration fails to compile (CPU, NVRTC)."""
import dataclasses
import os
import re

import numpy as np
import pytest

from cupy_attn.linear_bn_softmax import launch
from cupy_attn.runtime import compile as _compile, compile_check, launch as _launch
from cupy_attn.runtime.structs import layout_asserts


def test_every_family_declares_its_structs():
    for family in _compile.all_families():
        assert family.structs, f"{family.name} declares no parameter struct"
        for ctype, dtype in family.structs:
            assert layout_asserts(ctype, dtype) in family.code()


def _c_fields(code: str, name: str) -> tuple:
    """Field names of ``struct name { ... };`` in C++ source, in order ("long long a, b;" gives a, b)."""
    body = code[code.index(f"struct {name} {{"):]
    body = body[:body.index("};")]
    names = []
    for line in body.splitlines()[1:]:
        decl = line.split("//")[0].strip().rstrip(";")
        if decl:
            names += [re.findall(r"\w+", part)[-1] for part in decl.split(",")]
    return tuple(names)


def test_field_order_matches_the_c_struct():
    """NVRTC has no compile-time offsetof, so the order is checked here, from the sources."""
    for family in _compile.all_families():
        for ctype, dtype in family.structs:
            code = family.code()
            for inc in re.findall(r'#include "([^"]+)"', code):  # the struct may live in an included header
                path = _compile.source_dir() / inc
                if path.exists():
                    code += path.read_text()
            assert _c_fields(code, ctype.split("::")[-1]) == dtype.names, f"{family.name}: {ctype}"


def test_drifted_declaration_fails_to_compile():
    ctype, dtype = launch.FOLD_RUNNING_STATS.structs[0]
    short = np.dtype(dtype.descr[:-1])  # one field dropped on the Python side
    bad = dataclasses.replace(launch.FOLD_RUNNING_STATS, structs=((ctype, short),))
    with pytest.raises(_compile.KernelCompileError, match="size differs from its NumPy declaration"):
        compile_check.compile_family(bad, "sm_80")


def test_launch_config_mirrors_cuda_h():
    """The ctypes CUlaunchAttribute / CUlaunchConfig that programmatic dependent launches pass to cuLaunchKernelEx
    (runtime.launch._PdlLaunch) have cuda.h's sizes and offsets, and the attribute id is cuda.h's."""
    import ctypes
    Attribute, Config = _launch.launch_config_types()
    assert ctypes.sizeof(Attribute) == 72 and Attribute.value.offset == 8
    assert ctypes.sizeof(Config) == 56
    assert (Config.smem.offset, Config.stream.offset, Config.attrs.offset, Config.num_attrs.offset) == (24, 32, 40, 48)
    headers = [os.path.join(d, "cuda.h") for d in _compile.cuda_include_dirs()]
    headers = [h for h in headers if os.path.isfile(h)]
    if not headers:
        pytest.skip("no cuda.h among the CUDA include dirs")
    text = open(headers[0]).read()
    m = re.search(r"CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION\s*=\s*(\d+)", text)
    assert m and int(m.group(1)) == _launch._PdlLaunch.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def test_pdl_supported_compares_compute_capability_as_a_number(monkeypatch):
    """sm_100 ("100") and sm_120 support PDL as sm_90 does; sm_80 does not (CuPy reports the capability as a string,
    and "100" < "90" as strings)."""
    cupy = pytest.importorskip("cupy")

    class FakeDevice:
        def __init__(self, device_id):
            self.compute_capability = {0: "80", 1: "90", 2: "100", 3: "120"}[device_id]

    monkeypatch.setattr(cupy.cuda, "Device", FakeDevice)
    monkeypatch.setattr(_launch, "_libcuda", lambda: type("Lib", (), {"cuLaunchKernelEx": None})())
    assert [_launch.pdl_supported(i) for i in range(4)] == [False, True, True, True]
