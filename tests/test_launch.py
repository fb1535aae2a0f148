"""runtime/launch.py's PreparedLaunch on CPU, cuLaunchKernel replaced by a recorder that reads the struct back through
kernelParams: pointer slots (plain and at offsets), steps sharing the struct (at an offset), tensor-map slots (encoded
when a base moves, skipped for a misaligned base), alignment flags, the scratch slot (held through the launches),
refused arguments, the replay function written for the slots, and a bound replay outliving its launch object.
tests/test_launch_bytes.py checks every family's launches against the bytes recorded before the launch layer."""
import ctypes
import gc
import types
import weakref

import numpy as np
import pytest

from cupy_attn.runtime import launch as _launch


def _kernel(ptr: int, smem: int = 0):
    return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=ptr), max_dynamic_shared_size_bytes=smem)


@pytest.fixture
def calls(monkeypatch):
    """cuLaunchKernel's calls as (fn, dims, stream, the struct's first 48 bytes, extra)."""
    from cupy.cuda import driver
    got = []

    def launch(fn_ptr, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        struct_addr = ctypes.c_uint64.from_address(argv).value
        got.append((fn_ptr, (gx, gy, gz, bx, by, bz, smem), stream, ctypes.string_at(struct_addr, 48), extra))

    monkeypatch.setattr(driver, "launchKernel", launch)
    return got


def _words(raw: bytes) -> list:
    return list(np.frombuffer(raw, np.uint64))


WORDS = np.dtype([(name, np.int64) for name in ("a", "b", "c", "flag", "s0", "s1")]
                 + [("tma", np.uint8, (128,))])


def test_steps_share_the_struct(calls):
    """Each kernel gets its own function, dims and the stream, and as kernelParams the address of the launch's own
    copy of the struct (or of the struct at the step's offset), written with the replay's pointers; the prepared
    struct is not written; trailing arguments left out are 0."""
    kernels = [_kernel(11), _kernel(22)]
    params = np.zeros((), dtype=WORDS)
    params["c"] = 5
    prepared = _launch.PreparedLaunch(params, [_launch.Step(kernels[0], (4,), (256,)),
                                               _launch.Step(kernels[1], (8, 2), (128,), 1024, offset=8)],
                                      args=("x", "y"), pointers={"a": "x", "b": ("y", 16)})
    assert kernels[1].max_dynamic_shared_size_bytes == 1024
    prepared.launch_on(7, 100, 200)
    assert [c[:3] for c in calls] == [(11, (4, 1, 1, 256, 1, 1, 0), 7), (22, (8, 2, 1, 128, 1, 1, 1024), 7)]
    assert _words(calls[0][3])[:3] == [100, 216, 5] and _words(calls[1][3])[:2] == [216, 5]
    assert int(params["a"]) == 0 and int(params["b"]) == 0, "the prepared struct is not written"
    prepared.launch_on(9, 300)
    assert calls[-2][2] == 9 and _words(calls[-2][3])[:2] == [300, 16]
    with pytest.raises(TypeError):
        prepared.launch_on(9, 1, 2, 3)


def test_maps_flags_scratch_and_refusals(calls):
    encoded, held = [], []

    def encode(tag):
        def enc(ptr):
            encoded.append((tag, ptr))
            return np.full(128, (ptr + tag) % 251, np.uint8)
        return enc

    class Holder:
        pass

    def alloc():
        h = Holder()
        held.append(weakref.ref(h))
        return h, 4096

    prepared = _launch.PreparedLaunch(
        np.zeros((), dtype=WORDS), [_launch.Step(_kernel(1), (1,), (32,))], args=("x", "out", "mask"),
        pointers={"a": "out"}, maps=[_launch.Maps(("tma",), (("x", 64),), (encode(1),), align=16)],
        flags=[_launch.AlignFlag("flag", "out", 16, 4)], scratch=_launch.Scratch(alloc, {"s0": 0, "s1": 256}),
        refuse={"mask": "no mask here"})
    prepared.launch_on(3, 160, 32)
    raw = calls[-1][3]
    assert _words(raw) == [32, 0, 0, 4, 4096, 4352] and encoded == [(1, 224)]
    assert held[-1]() is None, "the scratch holder is released after the launch"
    prepared.launch_on(3, 160, 40)  # same base: no encode; out off 16 bytes: flag 0
    assert encoded == [(1, 224)] and _words(calls[-1][3])[3] == 0
    prepared.launch_on(3, 168, 40)  # x + 64 off 16 bytes: the maps are left as they are
    assert encoded == [(1, 224)]
    prepared.launch_on(3, 176, 40)
    assert encoded == [(1, 224), (1, 240)]
    with pytest.raises(ValueError, match="no mask here"):
        prepared.launch_on(3, 176, 40, 1)
    source = prepared.replay_source
    assert "_maps0.write(x + _c" in source and "_held, _base = _alloc()" in source and "raise ValueError" in source
    other = _launch.PreparedLaunch(  # another layout of the same shape: the same replay source (compiled once)
        np.zeros((), dtype=WORDS), [_launch.Step(_kernel(2), (2,), (64,))], args=("x", "out", "mask"),
        pointers={"a": "out"}, maps=[_launch.Maps(("tma",), (("x", 128),), (encode(2),), align=16)],
        flags=[_launch.AlignFlag("flag", "out", 8, 2)], scratch=_launch.Scratch(alloc, {"s0": 0, "s1": 512}),
        refuse={"mask": "no mask here"})
    assert other.replay_source == source


def test_replay_writes_only_the_declared_slots():
    prepared = _launch.PreparedLaunch(np.zeros((), dtype=WORDS), [_launch.Step(_kernel(1), (1,), (32,))],
                                      args=("x",), pointers={"c": "x"})
    body = prepared.replay_source.splitlines()
    assert body[0] == "def launch_on(_stream, x=0):" and body[2] == "        _words[2] = x" and len(body) == 4
    for bad in (("_x",), ("x", "x"), ("class",)):
        with pytest.raises(ValueError):
            _launch.PreparedLaunch(np.zeros((), dtype=WORDS), [], args=bad)
    with pytest.raises(ValueError, match="8-byte word"):
        _launch.PreparedLaunch(np.zeros((), dtype=WORDS), [], args=("x",), pointers={"tma": "x"})


def test_a_bound_replay_keeps_its_launch_alive(calls):
    """The call cache keeps only bind()'s callable: the struct and kernelParams arrays it points at must live on."""
    params = np.zeros((), dtype=WORDS)
    params["c"] = 77
    prepared = _launch.PreparedLaunch(params, [_launch.Step(_kernel(1), (1,), (32,))], args=("x",),
                                      pointers={"a": "x"})
    run = prepared.bind(types.SimpleNamespace(ptr=5))
    alive = weakref.ref(prepared)
    del prepared
    gc.collect()
    assert alive() is not None
    for _ in range(3):
        np.zeros(1 << 16, np.uint8).fill(1)  # reuse freed memory, if any was freed
        run(123)
    assert calls[-1][2] == 5 and _words(calls[-1][3])[:3] == [123, 0, 77]
