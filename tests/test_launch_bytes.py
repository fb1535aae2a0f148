"""Every kernel family's prepared launches give the kernels the bytes recorded in tests/data/launch_bytes.json (CPU).

tests/_launch_capture.py runs each launcher on stand-in arrays with the device replaced and records, in order, every
launch (kernel, grid, block, shared memory, stream, plain or programmatic dependent, the parameter struct's bytes),
tensor map encoding, memset, copy, workspace request and GEMM call. The recording was made before the launch layer
(cupy_attn/runtime/launch.py) replaced the per-family launch classes; a difference names the case, the first record
that differs and, for a launch, the struct fields whose bytes differ. Re-record (after a deliberate change, said so in
the commit) with ``PYTHONPATH=. python tests/_helpers/_launch_capture.py --write``.
"""
import json

import numpy as np
import pytest

import _launch_capture as capture

GOLDEN = json.loads(capture.GOLDEN.read_text())


def test_every_case_is_recorded():
    assert sorted(GOLDEN) == sorted(capture.CASES)


def _fields(expr: str, offsets: list) -> list:
    """The struct fields holding these byte offsets (the family's declared dtype)."""
    from cupy_attn.runtime import compile as _compile
    for family in _compile.all_families():
        if expr in family.name_expressions():
            dtype = family.structs[0][1]
            names = []
            for off in offsets:
                for name in dtype.names:
                    start = dtype.fields[name][1]
                    if start <= off < start + dtype.fields[name][0].itemsize and name not in names:
                        names.append(name)
            return names
    return []


@pytest.mark.parametrize("name", sorted(capture.CASES))
def test_launch_bytes_unchanged(name, monkeypatch):
    got = capture.run_case(name, monkeypatch)
    want = GOLDEN[name]
    for i, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        if g[0] == w[0] == "launch" and g[1:7] == w[1:7]:
            a, b = np.frombuffer(bytes.fromhex(g[7]), np.uint8), np.frombuffer(bytes.fromhex(w[7]), np.uint8)
            diff = [int(j) for j in np.flatnonzero(a != b)] if a.size == b.size else []
            pytest.fail(f"{name}: record {i} ({w[1]}): parameter bytes differ at {diff[:16]} "
                        f"(fields {_fields(w[1], diff)}; sizes {a.size} vs {b.size})")
        pytest.fail(f"{name}: record {i} differs:\n  got  {str(g)[:300]}\n  want {str(w)[:300]}")
    assert len(got) == len(want), f"{name}: {len(got)} records, recorded {len(want)}"
