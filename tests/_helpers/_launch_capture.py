"""Every prepared launch of the package run on a CPU machine, its driver calls recorded: the bytes each kernel would
receive, its launch dimensions, stream and launch kind (plain, or programmatic dependent), the tensor maps encoded, the
memsets, copies and GEMM calls around it, in order. tests/test_launch_bytes.py compares a run with the recording in
tests/data/launch_bytes.json, made from the code before the launch layer (runtime/launch.py) replaced the per-family
launch classes: the same bytes reach every kernel.

The cases build each launch as the plan does (dispatch.fused_launch, the kernel modules' ``build`` on the plan's
choices, the backward and GEMM classes, the Linear-BN-softmax prepared calls, the split path's ``schedule`` and ``run``)
on stand-in arrays with fixed addresses; only the device is replaced: kernels (a fake CUfunction per name expression),
cuLaunchKernel and cuLaunchKernelEx (read back through their kernelParams), cuTensorMapEncodeTiled (128 bytes hashed
from its arguments), workspaces, cuBLAS, the device's compute capability and SM count.

    PYTHONPATH=. python tests/_helpers/_launch_capture.py --write   # re-record tests/data/launch_bytes.json
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import pathlib
import sys
import types

import numpy as np

GOLDEN = pathlib.Path(__file__).resolve().parent.parent / "data" / "launch_bytes.json"
STREAM = 0x5700
F16 = np.dtype("float16")
F32 = np.dtype("float32")
BOOL = np.dtype("bool")


def _bf16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def _dtype(d):
    return _bf16() if isinstance(d, str) and d == "bf16" else np.dtype(d)


# ---------------------------------------------------------------------------------------------------------------------
# Stand-ins


class FakeArray:
    """What the launchers read of a CuPy array: shape, byte strides, dtype, base address, device, contiguity."""

    class _Data:
        def __init__(self, ptr):
            self.ptr = ptr

    def __init__(self, shape, dtype, ptr, strides=None):
        dtype = np.dtype(dtype)
        self.shape, self.dtype, self.itemsize = tuple(shape), dtype, dtype.itemsize
        if strides is None:
            strides, step = [], dtype.itemsize
            for n in reversed(self.shape):
                strides.append(step)
                step *= n
            strides = tuple(reversed(strides))
        self.strides = tuple(strides)
        self.data = self._Data(ptr)
        self.device = types.SimpleNamespace(id=0)
        self.size = int(np.prod(self.shape))
        self.ndim = len(self.shape)
        packed, step = [], dtype.itemsize
        for n in reversed(self.shape):
            packed.append(step)
            step *= n
        self.flags = types.SimpleNamespace(c_contiguous=self.strides == tuple(reversed(packed)))

    def __getitem__(self, index):
        """A leading slice ``a[:n]`` (batch chunks): the same strides and base, n along the first axis."""
        if not (isinstance(index, slice) and index.start in (None, 0) and index.step in (None, 1)):
            raise TypeError(f"FakeArray takes only a[:n], got {index!r}")
        n = min(self.shape[0], self.shape[0] if index.stop is None else index.stop)
        return FakeArray((n,) + self.shape[1:], self.dtype, self.data.ptr, self.strides)


def bshd(B, H, S, D, dtype, ptr):
    """A (B, H, S, D) view of a (B, S, H, D) array."""
    isz = np.dtype(dtype).itemsize
    return FakeArray((B, H, S, D), dtype, ptr, (S * H * D * isz, D * isz, H * D * isz, isz))


class FakeStream:
    def __init__(self, ptr):
        self.ptr = ptr

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeCtx:
    kind = "cupy"
    device_id = 0
    on_gpu = True

    def __init__(self, stream=STREAM):
        self.stream = FakeStream(stream)

    @contextlib.contextmanager
    def activate(self):
        yield


class FakeKernel:
    """A loaded kernel: the CUfunction (a number standing for the name expression), the shared-memory attribute, the
    register count (Linear-BN-softmax's occupancy rule). Called as a RawKernel (CuPy's launch on its current stream,
    the struct passed by address: ``struct_arg``, which the recorder makes the identity) it records the launch as
    cuLaunchKernel would see it."""

    def __init__(self, fn_ptr, recorder=None):
        self.kernel = types.SimpleNamespace(ptr=fn_ptr)
        self.max_dynamic_shared_size_bytes = 0
        self.num_regs = 64
        self.recorder = recorder

    def __call__(self, grid, block, args, stream=None, shared_mem=0):
        (params,) = args
        raw = np.ascontiguousarray(params).reshape(1).view(np.uint8).tobytes()
        dims = [*tuple(grid) + (1,) * (3 - len(grid)), *tuple(block) + (1,) * (3 - len(block)), shared_mem]
        self.recorder.log.append(["launch", self.recorder.kernels[self.kernel.ptr][1], dims, STREAM, False, 0,
                                  self.max_dynamic_shared_size_bytes, raw.hex()])


class FakeGemm:
    """Stands for blas.StridedGemm (cuBLAS): its calls are recorded with the tag of its problem. It takes no
    workspace (the classic API's contract; cuBLASLt's per-call workspace: tests/test_memory.py)."""

    workspace_bytes = 0

    def __init__(self, recorder, **kw):
        self.recorder, self.tag = recorder, hashlib.sha256(repr(sorted(kw.items())).encode()).hexdigest()[:12]
        self.kw = kw

    def __call__(self, c, a, b, stream_ptr=None, work=None):
        assert work is None, "a GEMM of no workspace was given one"
        self.recorder.log.append(["gemm", self.tag, c, a, b, stream_ptr])

    def bind(self, stream_ptr):
        return lambda c, a, b: self.recorder.log.append(["gemm", self.tag, c, a, b, stream_ptr])


# ---------------------------------------------------------------------------------------------------------------------
# The recorder


class Recorder:
    """Patches the device away (see the module docstring) for one case; ``log`` holds what the GPU would have got."""

    def __init__(self, monkeypatch, cc: int = 90):
        import cupy
        from cupy.cuda import driver, runtime as cuda_runtime

        from cupy_attn.runtime import blas, compile as _compile, workspace

        # Every launcher imported first: a module importing a patched name while the patch is on would keep it.
        import importlib
        for name in ("attention.kernels.flash_fwd", "attention.kernels.flash_fwd_sm90",
                     "attention.kernels.flash_fwd_d512_sm90", "attention.kernels.scores_sm90",
                     "attention.kernels.pv_sm90", "attention.kernels.flash_decode", "attention.kernels.gemm_3xtf32",
                     "attention.kernels.softmax", "attention.kernels.bwd_rows", "attention.kernels.flash_bwd",
                     "attention.kernels.flash_bwd_sm90", "attention.paths.backward", "attention.paths.split",
                     "attention.dispatch", "linear_bn_softmax.launch", "linear_bn_softmax.backward"):
            importlib.import_module("cupy_attn." + name)
        self.log: list = []
        self.scratches = 0
        self.kernels: dict = {}   # fn_ptr -> (family, expression)
        self._by_expr: dict = {}
        self.cc = cc
        rec = self
        mp = monkeypatch

        def kernel(family, **row):
            expr = family.name_expression(**row)
            assert expr in family.name_expressions(), expr
            fake = rec._by_expr.get(expr)
            if fake is None:
                fn_ptr = 0x1000 + 16 * len(rec._by_expr)
                fake = rec._by_expr[expr] = FakeKernel(fn_ptr, rec)
                rec.kernels[fn_ptr] = (family, expr)
            return fake

        mp.setattr(_compile.KernelFamily, "kernel", kernel)

        class Device:
            def __init__(self, device_id=None):
                self.id = 0
                self.compute_capability = str(rec.cc)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        mp.setattr(cupy.cuda, "Device", Device)
        mp.setattr(cuda_runtime, "deviceGetAttribute", lambda attr, device: 132)
        mp.setattr(cuda_runtime, "getDevice", lambda: 0)
        mp.setattr(cuda_runtime, "memsetAsync", lambda ptr, value, n, stream: rec.log.append(
            ["memset", ptr, value, n, stream]))
        mp.setattr(cuda_runtime, "memcpyAsync", lambda dst, src, n, kind, stream: rec.log.append(
            ["memcpy", dst, src, n, kind, stream]))
        mp.setattr(cuda_runtime, "streamIsCapturing", lambda stream: 0)
        mp.setattr(cupy.cuda, "get_current_stream", lambda *a: FakeStream(STREAM))
        mp.setattr(driver, "launchKernel", functools.partial(self._launch, False))

        # cuLaunchKernelEx (programmatic dependent launches): libcuda's entry point, read back through its config.
        def launch_ex(cfg_addr, fn_ptr, argv, extra):
            cfg = _config_type().from_address(cfg_addr)
            attr = cfg.attrs[0]
            assert cfg.num_attrs == 1 and attr.id == 6 and attr.value.flag == 1
            self._launch(True, fn_ptr, *cfg.grid, *cfg.block, cfg.smem, cfg.stream or 0, argv, extra)
            return 0

        fake_lib = types.SimpleNamespace(cuLaunchKernelEx=launch_ex)
        for mod in _launch_modules():  # the memoized originals are left alone (restored as they were)
            if hasattr(mod, "_libcuda"):
                mp.setattr(mod, "_libcuda", lambda: fake_lib)
            if hasattr(mod, "_cu_launch_kernel_ex"):
                mp.setattr(mod, "_cu_launch_kernel_ex", lambda: launch_ex)

        # cuTensorMapEncodeTiled: 128 bytes hashed from the layout and the address; every module's reference to it.
        def encode(dtype, ptr, dims, strides, box, swizzle=None):
            args = [dtype, int(ptr), [int(d) for d in dims], [int(s) for s in strides], [int(b) for b in box], swizzle]
            rec.log.append(["encode", *args])
            digest = hashlib.sha256(json.dumps(args).encode()).digest()
            return np.frombuffer(digest * 4, np.uint8)

        originals = {getattr(m, "encode_tensor_map") for m in _launch_modules() if hasattr(m, "encode_tensor_map")}
        for name, mod in list(sys.modules.items()):
            if name.startswith("cupy_attn") and getattr(mod, "encode_tensor_map", None) in originals:
                mp.setattr(mod, "encode_tensor_map", encode)

        # Workspaces: one address per request, in order.
        def scratch(ctx, nbytes):
            ptr = 0x7000_0000_0000 + 0x1_0000_0000 * rec.scratches
            rec.scratches += 1
            rec.log.append(["scratch", nbytes])
            return ("holder", ptr), ptr

        def persistent(device_id, stream_ptr, name, nbytes):
            rec.log.append(["persistent", name, nbytes])
            return ("persistent", 0x7800_0000_0000 + 0x1_0000_0000 * (sorted(_PERSISTENT).index(name)
                                                                          if name in _PERSISTENT else 9))

        mp.setattr(workspace, "scratch", scratch)
        mp.setattr(workspace, "persistent", persistent)
        mp.setattr(workspace, "pointer", lambda buf: buf[1])
        mp.setattr(blas, "StridedGemm", functools.partial(FakeGemm, self))
        for name, mod in list(sys.modules.items()):  # CuPy's by-address struct argument, before the launch layer
            if name.startswith("cupy_attn") and hasattr(mod, "struct_arg"):
                mp.setattr(mod, "struct_arg", lambda params: params)

    def _launch(self, pdl, fn_ptr, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        family, expr = self.kernels[fn_ptr]
        size = _struct_size(family, expr)
        addr = ctypes.c_uint64.from_address(argv).value
        raw = ctypes.string_at(addr, size)
        fake = self._by_expr[expr]
        self.log.append(["launch", expr, [gx, gy, gz, bx, by, bz, smem], stream, bool(pdl), extra or 0,
                         fake.max_dynamic_shared_size_bytes, raw.hex()])


_PERSISTENT = ("decode_partials", "lbs_work")


def _struct_size(family, expr: str) -> int:
    """The size of the struct a kernel takes: its family's declared parameter struct (the decode family of three
    kernels: the split kernel's own for flash_decode_sm90, FlashDecodeParams for the combine kernel)."""
    return family.structs[0][1].itemsize


@functools.lru_cache(maxsize=None)
def _config_type():
    from cupy_attn.runtime import compile as _compile
    mod = next((m for m in _launch_modules() if hasattr(m, "launch_config_types")), _compile)
    return mod.launch_config_types()[1]


def _launch_modules() -> list:
    """The modules that hold the launch primitives (runtime.compile before the launch layer, runtime.launch and
    runtime.tma after it) and the Hopper toolkit's old home."""
    import importlib
    mods = []
    for name in ("cupy_attn.runtime.compile", "cupy_attn.runtime.launch", "cupy_attn.runtime.tma",
                 "cupy_attn.attention.kernels.flash_fwd_sm90"):
        try:
            mods.append(importlib.import_module(name))
        except ImportError:
            pass
    return mods


# ---------------------------------------------------------------------------------------------------------------------
# Cases: name -> function(recorder, monkeypatch) that builds and replays launches. Pointers are fixed per array.

Q, K, V, O, LSE, MASK, RNG, P_BUF = (0x10_0000_0000 * i for i in range(1, 9))
CASES: dict = {}


def case(name):
    def register(fn):
        CASES[name] = fn
        return fn
    return register


def _qkvo(B, Hq, Hkv, L, S, E, Ev, dtype, layout="bhsd", shift=0):
    dtype = _dtype(dtype)
    make = (lambda b, h, s, d, ptr: FakeArray((b, h, s, d), dtype, ptr)) if layout == "bhsd" else \
        (lambda b, h, s, d, ptr: bshd(b, h, s, d, dtype, ptr))
    return (make(B, Hq, L, E, Q + shift), make(B, Hkv, S, E, K + shift), make(B, Hkv, S, Ev, V + shift),
            make(B, Hq, L, Ev, O + shift))


def _ptrs(q, k, v, o, lse, mask, move=0, out_shift=0):
    return (q.data.ptr + move, k.data.ptr, v.data.ptr, o.data.ptr + out_shift,
            0 if lse is None else lse.data.ptr, 0 if mask is None else mask.data.ptr)


def _flash(rec, mp, *, cc, dtype, shape, causal=None, mask_dtype=None, dropout=0.0, layout="bhsd", lse=True,
           env=None):
    from cupy_attn.attention import dispatch
    rec.cc = cc
    for key, value in (env or {}).items():
        mp.setenv(key, value)
    B, Hq, Hkv, L, S, E, Ev = shape
    q, k, v, o = _qkvo(B, Hq, Hkv, L, S, E, Ev, dtype, layout)
    l = FakeArray((B, Hq, L), F32, LSE) if lse else None
    mask = None
    if mask_dtype is not None:
        mask = FakeArray((B, Hq, L, S), mask_dtype, MASK, (0, 0, S * np.dtype(mask_dtype).itemsize,
                                                           np.dtype(mask_dtype).itemsize))
    rng = FakeArray((2,), np.int64, RNG) if dropout else None
    launch = dispatch.fused_launch(q, k, v, o, l, scale=0.125, causal=causal, mask=mask, dropout_p=dropout, rng=rng)
    launch.launch_on(STREAM, *_ptrs(q, k, v, o, l, mask))
    launch.launch_on(STREAM + 1, *_ptrs(q, k, v, o, l, mask, move=256, out_shift=8))
    launch(*_ptrs(q, k, v, o, l, mask))  # CuPy's current stream


case("flash_mma_sm80")(lambda r, m: _flash(r, m, cc=80, dtype=F16, shape=(2, 4, 4, 100, 130, 64, 64)))
case("flash_wgmma_causal_gqa_bshd_floatmask")(lambda r, m: _flash(
    r, m, cc=90, dtype="bf16", shape=(2, 8, 2, 77, 300, 40, 72), causal="bottom_right", mask_dtype=F32,
    layout="bshd"))
case("flash_dropout_boolmask")(lambda r, m: _flash(r, m, cc=90, dtype=F16, shape=(1, 2, 2, 50, 70, 128, 128),
                                                   mask_dtype=BOOL, dropout=0.25, causal="top_left", lse=False))
case("flash_mma_sm90_d160")(lambda r, m: _flash(r, m, cc=90, dtype=F16, shape=(1, 2, 1, 33, 65, 160, 160),
                                                env={"CUPY_ATTN_WGMMA": "0"}))
case("flash_wgmma_d160_padded")(lambda r, m: _flash(r, m, cc=90, dtype=F16, shape=(1, 2, 1, 33, 65, 160, 160)))
case("flash_sm86_d256")(lambda r, m: _flash(r, m, cc=86, dtype="bf16", shape=(3, 1, 1, 10, 1000, 256, 200),
                                            mask_dtype=F16))


def _fa3(rec, mp, *, mode, dtype, shape, causal=None, layout="bhsd", lse=True, via_fused=False):
    from cupy_attn.attention import checks, dispatch
    from cupy_attn.attention.kernels import flash_fwd_sm90
    rec.cc = 90
    B, Hq, Hkv, L, S, E, Ev = shape
    q, k, v, o = _qkvo(B, Hq, Hkv, L, S, E, Ev, _dtype(dtype), layout)
    l = FakeArray((B, Hq, L), F32, LSE) if lse else None
    if via_fused:
        mp.setenv("CUPY_ATTN_FA3", mode)
        launch = dispatch.fused_launch(q, k, v, o, l, scale=0.09, causal=causal)
    else:
        p = checks.array_problem(q, k, v, o, l, scale=0.09, causal=causal)
        launch = flash_fwd_sm90.build(p, flash_fwd_sm90.choose(p, mode), o, l)
    launch.launch_on(STREAM, *_ptrs(q, k, v, o, l, None))
    launch.launch_on(STREAM, *_ptrs(q, k, v, o, None, None, out_shift=4096))   # out and lse move: no q/k/v encode
    launch.launch_on(STREAM + 1, *_ptrs(q, k, v, o, l, None, move=1024))      # q moves
    launch.launch_on(STREAM, *_ptrs(q, k, v, o, l, None, out_shift=8))        # out off 16 bytes: 4-byte stores
    launch(*_ptrs(q, k, v, o, l, None))


case("fa3_mode1_d128_causal")(lambda r, m: _fa3(r, m, mode="1", dtype=F16, shape=(2, 4, 2, 300, 300, 128, 128),
                                                causal="top_left"))
case("fa3_mode2_d64_m192")(lambda r, m: _fa3(r, m, mode="2", dtype="bf16", shape=(1, 4, 4, 500, 400, 64, 64)))
case("fa3_mode3_d96_e80_bshd")(lambda r, m: _fa3(r, m, mode="3", dtype=F16, shape=(2, 8, 8, 1000, 1000, 80, 80),
                                                 causal="bottom_right", layout="bshd"))
case("fa3_mode3_d256_ev_odd")(lambda r, m: _fa3(r, m, mode="3", dtype=F16, shape=(1, 2, 1, 200, 100, 200, 100),
                                                lse=False))
case("fa3_mode3_causal_pairs_via_fused")(lambda r, m: _fa3(r, m, mode="3", dtype=F16,
                                                           shape=(4, 16, 16, 4096, 4096, 128, 128),
                                                           causal="top_left", via_fused=True))


def _fa3_varlen(rec, mp, *, dtype, shape, causal, window=None, softcap=None):
    """The packed-batch launch (varlen_attention's): FlashAttention's varlen layout as batch-1 BSHD views."""
    import types
    from cupy_attn.attention import variants
    from cupy_attn.attention.kernels import flash_fwd_sm90
    rec.cc = 90
    B, Hq, Hkv, total_q, total_k, E, Ev, max_q, max_k = shape
    q, k, v, o = _qkvo(1, Hq, Hkv, total_q, total_k, E, Ev, _dtype(dtype), "bshd")
    l = FakeArray((1, Hq, total_q), F32, LSE)
    var = variants.Variants(*(window or (None, None)), softcap)
    lo, hi = var.key_offsets(0, 0, "bottom_right" if causal else None)
    bounded = causal or var.window_right is not None
    bounds = types.SimpleNamespace(key_upper=(bounded, hi if bounded else 0), window_lo=lo, scale=0.09, variants=var)
    launch = flash_fwd_sm90.build_varlen(q, k, v, o, l, bounds=bounds, batch=B, causal=causal)
    cu_q, cu_k, used = RNG, RNG + 4096, RNG + 8192
    launch.launch_on(STREAM, *_ptrs(q, k, v, o, l, None)[:5], cu_q, cu_k)
    launch.launch_on(STREAM + 1, *_ptrs(q, k, v, o, l, None, move=1024)[:5], cu_q + 64, cu_k, used)


case("fa3_varlen_causal_gqa")(lambda r, m: _fa3_varlen(r, m, dtype="bf16", shape=(12, 32, 8, 25701, 25701, 128, 128,
                                                                                  4096, 4096), causal=True))
case("fa3_varlen_window_softcap_d80")(lambda r, m: _fa3_varlen(r, m, dtype=F16, shape=(3, 4, 4, 300, 900, 80, 80,
                                                                                       200, 500), causal=False,
                                                               window=(64, 8), softcap=30.0))


def _d512(rec, mp, *, persistent, causal, shape=(2, 4, 2, 700, 900, 320, 512)):
    from cupy_attn.attention import checks
    from cupy_attn.attention.kernels import flash_fwd_d512_sm90 as d512
    rec.cc = 90
    B, Hq, Hkv, L, S, E, Ev = shape
    q, k, v, o = _qkvo(B, Hq, Hkv, L, S, E, Ev, F16)
    l = FakeArray((B, Hq, L), F32, LSE)
    p = checks.array_problem(q, k, v, o, l, scale=0.04, causal=causal)
    launch = d512.build(p, d512.Choice(persistent=persistent), o, l)
    launch.launch_on(STREAM, *_ptrs(q, k, v, o, l, None))
    launch.launch_on(STREAM, *_ptrs(q, k, v, o, l, None, move=512, out_shift=16))


case("d512_persistent_causal")(lambda r, m: _d512(r, m, persistent=True, causal="top_left"))
case("d512_tiles")(lambda r, m: _d512(r, m, persistent=False, causal=None))


def _scores(rec, mp, *, variant, S, causal=None, mask=False, p_read=None, lse=True, E=100):
    from cupy_attn.attention import checks
    from cupy_attn.attention.kernels import scores_sm90
    rec.cc = 90
    B, Hq, Hkv, L = 2, 4, 2, 300
    q, k, v, _ = _qkvo(B, Hq, Hkv, L, S, E, E, F16)
    l = FakeArray((B, Hq, L), F32, LSE) if lse else None
    m = FakeArray((B, Hq, L, S), BOOL, MASK, (S, 0, 0, 1)) if mask else None
    ld = -(-S // 8) * 8
    p = checks.array_problem(q, k, v, None, l, scale=0.1, causal=causal, mask=m)
    launch = scores_sm90.build(p, scores_sm90.choose(p, variant), l, ld=ld, p_read=p_read)
    launch.launch_on(STREAM, Q, K, P_BUF, LSE if lse else 0, MASK if mask else 0)
    launch.launch_on(STREAM, Q, K, P_BUF, 0, MASK if mask else 0)
    launch.launch_on(STREAM + 3, Q, K + 4096, P_BUF + 64, LSE if lse else 0, MASK if mask else 0)


case("scores_v1")(lambda r, m: _scores(r, m, variant=1, S=200))
case("scores_v2")(lambda r, m: _scores(r, m, variant=2, S=120, lse=False))
case("scores_v3_causal_pairs")(lambda r, m: _scores(r, m, variant=3, S=512, causal="top_left", p_read=(320, 0)))
case("scores_v3_masked")(lambda r, m: _scores(r, m, variant=3, S=300, mask=True))


def _pv(rec, mp, *, causal, L=300, S=200, Ev=300):
    from cupy_attn.attention import checks
    from cupy_attn.attention.kernels import pv_sm90
    rec.cc = 90
    v = FakeArray((2, 2, S, Ev), F16, V)
    o = FakeArray((2, 4, L, Ev), F16, O)
    q, k = FakeArray((2, 4, L, 64), F16, Q), FakeArray((2, 2, S, 64), F16, K)
    p = checks.array_problem(q, k, v, o, scale=0.1, causal=causal)
    launch = pv_sm90.build(p, o, ld=-(-S // 8) * 8)
    launch.launch_on(STREAM, P_BUF, V, O)
    launch.launch_on(STREAM, P_BUF, V, O + 4096)
    launch.launch_on(STREAM, P_BUF + 512, V, O)


case("pv_causal")(lambda r, m: _pv(r, m, causal="bottom_right"))
case("pv_full")(lambda r, m: _pv(r, m, causal=None, L=64, S=300, Ev=512))


def _decode(rec, mp, *, cc=90, env=None, shape=(4, 8, 2, 1, 4096, 128, 128), num_splits=None, mask=False,
            causal=None, lse=True):
    from cupy_attn.attention import checks, dispatch
    from cupy_attn.attention.kernels import flash_decode
    from cupy_attn.runtime.interop import device_sms
    rec.cc = cc
    for key, value in (env or {}).items():
        mp.setenv(key, value)
    B, Hq, Hkv, L, S, E, Ev = shape
    q, k, v, o = _qkvo(B, Hq, Hkv, L, S, E, Ev, F16)
    l = FakeArray((B, Hq, L), F32, LSE) if lse else None
    m = FakeArray((B, Hq, L, S), BOOL, MASK, (S, 0, 0, 1)) if mask else None
    ctx = FakeCtx()
    p = checks.SDPAProblem(ctx=ctx, query=q, key=k, value=v, batch_shape=(B, Hq), batch=B, num_heads=Hq,
                           num_kv_heads=Hkv, seqlen_q=L, seqlen_k=S, head_dim=E, head_dim_v=Ev, dtype=F16,
                           scale=0.088, causal=causal, mask=m, mask_kind="bool" if mask else "none")
    choice = flash_decode.choose(p, dispatch.device_arch(p), device_sms(0), num_splits)
    run = flash_decode.build(p, choice, o, l).bind(p.ctx.stream)
    run(*_ptrs(q, k, v, o, l, m))
    run(*_ptrs(q, k, v, o, l, m, out_shift=256))
    run(*_ptrs(q, k, v, o, l, m, move=512))


def _decode_paged(rec, mp, *, stream=False, num_splits=None):
    """attention_with_kvcache's paged launches as kvcache._decode builds them: the caches (num_blocks, page, Hkv, D)
    read through (B, Hkv, S_max, D) views with no batch stride, the table and lengths fields; the streaming kernel's
    maps over all the cache's rows, (1, Hkv, num_blocks · page, D)."""
    import dataclasses
    import types
    from cupy_attn.attention.kernels import flash_decode
    from cupy_attn.runtime.interop import device_sms
    rec.cc = 90
    B, Hq, Hkv, L, E, nb, ps, max_blocks = 4, 8, 2, 1, 128, 40, 64, 12
    S = max_blocks * ps
    q = FakeArray((B, Hq, L, E), F16, Q, (Hq * E * 2, E * 2, Hq * E * 2, 2))  # (B, L, Hq, E) transposed
    k, v = (FakeArray((B, Hkv, S, E), F16, ptr, (0, E * 2, Hkv * E * 2, 2)) for ptr in (K, V))
    o = FakeArray((B, Hq, L, E), F16, O, (Hq * E * 2, E * 2, Hq * E * 2, 2))
    lse = FakeArray((B, Hq, L), F32, LSE)
    p = types.SimpleNamespace(query=q, key=k, value=v, mask=None, dtype=F16, head_dim=E, head_dim_v=E, batch=B,
                              num_heads=Hq, num_kv_heads=Hkv, groups=Hq // Hkv, seqlen_q=L, seqlen_k=S, causal=None,
                              causal_offset=S - L, scale=0.088, ctx=FakeCtx())
    fields = {"seqused_k": RNG, "block_table": P_BUF, "max_blocks": max_blocks, "page_size": ps}
    if stream:
        mp.setenv("CUPY_ATTN_DECODE", "2")
        p.key = p.value = None  # as kvcache._decode: the maps are the cache rows', not these views'
        choice = flash_decode.choose(p, 90, device_sms(0), num_splits)
        p.key, p.value = k, v
        assert choice.family is flash_decode.FLASH_DECODE_SM90, choice
        choice = dataclasses.replace(choice, family=flash_decode.FLASH_DECODE_SM90_PAGED)
        views = tuple(FakeArray((1, Hkv, nb * ps, E), F16, ptr, (nb * ps * Hkv * E * 2, E * 2, Hkv * E * 2, 2))
                      for ptr in (K, V))
        run = flash_decode.build(p, choice, o, lse, fields=fields, map_views=views).bind(p.ctx.stream)
    else:
        choice = flash_decode.choose(p, 90, device_sms(0), num_splits, variant="v1", warps=4)
        choice = dataclasses.replace(choice, family=flash_decode.FLASH_DECODE_PAGED)
        run = flash_decode.build(p, choice, o, lse, fields=fields).bind(p.ctx.stream)
    run(Q, K, V, O, LSE, 0)
    run(Q + 4096, K, V, O + 256, LSE, 0)


case("decode_paged_v1")(lambda r, m: _decode_paged(r, m, num_splits=3))
case("decode_paged_stream")(lambda r, m: _decode_paged(r, m, stream=True))
case("decode_v1_one_split")(lambda r, m: _decode(r, m, env={"CUPY_ATTN_DECODE": "1"},
                                                 shape=(64, 32, 32, 1, 4096, 128, 128)))
case("decode_v1_splits_mask_pdl")(lambda r, m: _decode(r, m, env={"CUPY_ATTN_DECODE": "1"}, mask=True,
                                                       causal="bottom_right", num_splits=4))
case("decode_v1_wide_sm80")(lambda r, m: _decode(r, m, cc=80, shape=(2, 8, 2, 2, 3000, 64, 64), lse=False))
case("decode_v1_warps8")(lambda r, m: _decode(r, m, env={"CUPY_ATTN_DECODE_WARPS": "8"}))
case("decode_stream_splits")(lambda r, m: _decode(r, m, env={"CUPY_ATTN_DECODE": "2"}, num_splits=3))
case("decode_stream2_d256")(lambda r, m: _decode(r, m, env={"CUPY_ATTN_DECODE": "3"},
                                                 shape=(2, 4, 4, 1, 2048, 256, 256), mask=True))


def _gemm(rec, mp, *, trans_b, shifts):
    from cupy_attn.attention.kernels import gemm_3xtf32
    kw = dict(c_dtype=F32, ldc=300, stride_c=100 * 300, a_dtype=F32, lda=64, stride_a=100 * 64, trans_a=False,
              b_dtype=F32, ldb=64 if trans_b else 300, stride_b=300 * 64, trans_b=trans_b, m=100, n=300, k=64,
              batch=3, alpha=0.125)
    g = gemm_3xtf32.Gemm3xTF32(**kw)
    for a_shift, b_shift in shifts:
        g.launch_on(STREAM, O, Q + a_shift, K + b_shift)
    g(O, Q, K)
    g.bind(STREAM + 2)(O, Q + 4, K)


case("gemm_3xtf32_nt")(lambda r, m: _gemm(r, m, trans_b=True, shifts=((0, 0), (4, 0), (0, 8), (4, 4))))
case("gemm_3xtf32_nn")(lambda r, m: _gemm(r, m, trans_b=False, shifts=((0, 0), (0, 4))))


def _problem(*, B, Hq, Hkv, L, S, E, Ev, dtype=F16, causal=None, dropout=0.0, mask=None, layout="bhsd"):
    from cupy_attn.attention import checks
    dtype = _dtype(dtype)
    q, k, v, _ = _qkvo(B, Hq, Hkv, L, S, E, Ev, dtype, layout)
    return checks.SDPAProblem(ctx=FakeCtx(), query=q, key=k, value=v, batch_shape=(B, Hq), batch=B, num_heads=Hq,
                              num_kv_heads=Hkv, seqlen_q=L, seqlen_k=S, head_dim=E, head_dim_v=Ev, dtype=dtype,
                              scale=0.1, causal=causal, dropout_p=dropout, mask=mask,
                              mask_kind="none" if mask is None else ("bool" if mask.dtype == BOOL else "float"),
                              rng=FakeArray((2,), np.int64, RNG) if dropout else None)


def _backward(rec, mp, *, kernel, bucket, **shape):
    from cupy_attn.attention.kernels import flash_bwd, flash_bwd_sm90
    rec.cc = 90
    p = _problem(**shape)
    launch = (flash_bwd_sm90 if kernel == "sm90" else flash_bwd).build(p, bucket)
    dq, dk, dv, dout = 0xA0_0000_0000, 0xB0_0000_0000, 0xC0_0000_0000, 0xD0_0000_0000
    launch(Q, K, V, O, LSE, dout, dq, dk, dv, RNG if shape.get("dropout") else 0)
    launch(Q, K, V, O, LSE, dout + 8, dq + 4, dk, dv, RNG if shape.get("dropout") else 0)
    launch(Q + 4096, K, V, O, LSE, dout, dq, dk, dv, RNG if shape.get("dropout") else 0)


def _backward_varlen(rec, mp, *, dtype, Hq, Hkv, total_q, total_k, E, B, max_k, causal=True):
    """The packed Hopper backward (varlen_attention under CUPY_ATTN_VARLEN_BWD=kernel) on FlashAttention's layout."""
    import types
    from cupy_attn.attention import variants
    from cupy_attn.attention.kernels import flash_bwd_sm90
    rec.cc = 90
    dt = _dtype(dtype)
    q, k, v = (FakeArray((n, h, E), dt, ptr) for n, h, ptr in ((total_q, Hq, Q), (total_k, Hkv, K), (total_k, Hkv, V)))
    lo, hi = variants.NONE.key_offsets(0, 0, "bottom_right" if causal else None)
    bounds = types.SimpleNamespace(key_upper=(causal, hi if causal else 0), window_lo=lo, scale=0.09,
                                   variants=variants.NONE)
    launch = flash_bwd_sm90.Sm90VarlenBackward(FakeCtx(), q, k, v, bounds=bounds, batch=B, max_seqlen_k=max_k,
                                               cu_seqlens_q=RNG, cu_seqlens_k=RNG + 4096)
    dq, dk, dv, dout = 0xA0_0000_0000, 0xB0_0000_0000, 0xC0_0000_0000, 0xD0_0000_0000
    launch(Q, K, V, O, LSE, dout, dq, dk, dv)
    launch(Q + 4096, K, V, O, LSE, dout, dq, dk, dv)


case("bwd_sm90_varlen_causal_gqa")(lambda r, m: _backward_varlen(r, m, dtype="bf16", Hq=8, Hkv=2, total_q=700,
                                                                  total_k=700, E=128, B=3, max_k=400))
case("bwd_mma_causal_gqa")(lambda r, m: _backward(r, m, kernel="mma", bucket=128, B=2, Hq=4, Hkv=2, L=100, S=130,
                                                  E=96, Ev=128, causal="bottom_right"))
case("bwd_mma_dropout")(lambda r, m: _backward(r, m, kernel="mma", bucket=64, B=1, Hq=2, Hkv=2, L=64, S=64, E=64,
                                               Ev=64, dropout=0.1, layout="bshd"))
case("bwd_sm90_d64")(lambda r, m: _backward(r, m, kernel="sm90", bucket=64, B=2, Hq=4, Hkv=1, L=300, S=200, E=64,
                                            Ev=64, causal="top_left"))
case("bwd_sm90_d128_bshd")(lambda r, m: _backward(r, m, kernel="sm90", bucket=128, B=1, Hq=2, Hkv=2, L=129, S=257,
                                                  E=80, Ev=128, layout="bshd"))
case("bwd_sm90_d256")(lambda r, m: _backward(r, m, kernel="sm90", bucket=256, B=1, Hq=2, Hkv=2, L=70, S=65, E=256,
                                             Ev=200, dtype="bf16"))


def _split(rec, mp, *, cc, dtype, causal=None, mask_dtype=None, dropout=0.0, shape=(2, 4, 2, 100, 300, 72, 96),
           budget=None, lse=True):
    from cupy_attn.attention import dispatch
    from cupy_attn.attention.paths import split
    rec.cc = cc
    mp.setattr(dispatch, "device_arch", lambda p: cc)
    mp.setattr(split, "_SCHEDULES", {})
    B, Hq, Hkv, L, S, E, Ev = shape
    dtype = _dtype(dtype)
    mask = None
    if mask_dtype is not None:
        isz = np.dtype(mask_dtype).itemsize
        mask = FakeArray((B, Hq, L, S), mask_dtype, MASK, (S * isz, 0, 0, isz))
    p = _problem(B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, Ev=Ev, dtype=dtype, causal=causal, dropout=dropout, mask=mask)
    o = FakeArray((B, Hq, L, Ev), dtype, O)
    l = FakeArray((B, Hq, L), F32, LSE) if lse else None
    sched = split.schedule(p, dispatch.split_choice(p, cc, workspace_bytes=budget, out=o), o, l)
    ptrs = _ptrs(p.query, p.key, p.value, o, l, mask)
    split.run(sched, p.ctx, *ptrs, rng=RNG if dropout else 0)
    split.run(sched, p.ctx, *ptrs[:3], O + 256, *ptrs[4:], rng=RNG if dropout else 0)


case("split_softmax_floatmask")(lambda r, m: _split(r, m, cc=80, dtype=F16, mask_dtype=F16))
case("split_softmax_fp32_chunks")(lambda r, m: _split(r, m, cc=80, dtype=F32, budget=300 * 304 * 4 * 3,
                                                      shape=(2, 4, 4, 100, 300, 40, 40)))
case("split_softmax_dropout_boolmask")(lambda r, m: _split(r, m, cc=80, dtype="bf16", mask_dtype=BOOL, dropout=0.2,
                                                           lse=False))
case("split_scores_pv_causal")(lambda r, m: _split(r, m, cc=90, dtype=F16, causal="top_left",
                                                   shape=(2, 4, 2, 300, 400, 320, 320)))
case("split_scores_cublas_pv")(lambda r, m: _split(r, m, cc=90, dtype=F16, shape=(2, 4, 2, 300, 512, 320, 320)))


def _split_backward(rec, mp, *, dtype=F16, causal=None, mask_dtype=None, dropout=0.0, budget=None,
                    shape=(2, 3, 3, 100, 130, 72, 40)):
    from cupy_attn.attention import dispatch
    from cupy_attn.attention.paths import backward
    rec.cc = 90
    mp.setenv("CUPY_ATTN_BWD", "split")
    mp.setattr(dispatch, "device_arch", lambda p: 90)

    def scratch(ctx, shape, dt):
        from cupy_attn.runtime import workspace
        holder, ptr = workspace.scratch(ctx, int(np.prod(shape)) * np.dtype(dt).itemsize)
        return holder, FakeArray(shape, dt, ptr)
    mp.setattr(backward, "_scratch", scratch)
    B, Hq, Hkv, L, S, E, Ev = shape
    dtype = _dtype(dtype)
    mask = dmask = None
    if mask_dtype is not None:
        isz = np.dtype(mask_dtype).itemsize
        mask = FakeArray((B, Hq, L, S), mask_dtype, MASK, (S * isz, 0, 0, isz))
        if mask_dtype != BOOL:
            dmask = FakeArray((B, Hq, L, S), F32, 0xE0_0000_0000)
    p = _problem(B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, Ev=Ev, dtype=dtype, causal=causal, dropout=dropout, mask=mask)
    out, dout = FakeArray((B, Hq, L, Ev), dtype, O), FakeArray((B, Hq, L, Ev), dtype, 0xD0_0000_0000)
    lse = FakeArray((B, Hq, L), F32, LSE)
    dq, dk, dv = (FakeArray(a.shape, dtype, ptr) for a, ptr in ((p.query, 0xA0_0000_0000), (p.key, 0xB0_0000_0000),
                                                               (p.value, 0xC0_0000_0000)))
    backward.sdpa_backward(p, dispatch.plan_backward(p), out, lse, dout, dq, dk, dv, dmask, workspace_bytes=budget)


case("bwd_split_causal")(lambda r, m: _split_backward(r, m, causal="top_left"))
case("bwd_split_floatmask_chunks")(lambda r, m: _split_backward(r, m, mask_dtype=F32, budget=60 * 136 * 16,
                                                                shape=(1, 2, 2, 100, 130, 72, 40)))
case("bwd_split_dropout_fp32")(lambda r, m: _split_backward(r, m, dtype=F32, dropout=0.3, mask_dtype=BOOL))


def _lbs_forward(rec, mp, *, dtype, n, f, training, running=True, momentum=0.1):
    from cupy_attn.linear_bn_softmax import checks as lbs_checks, launch as lbs
    rec.cc = 90
    lbs._launch_plan.cache_clear()
    lbs._gemm_xwt_op.cache_clear()
    mp.setattr(lbs.interop, "device_sms", lambda device_id: 132)
    dtype = _dtype(dtype)

    def arg(shape, dt=dtype):
        return types.SimpleNamespace(shape=shape, dtype=np.dtype(dt))
    args = {"bias": arg((f,)), "gamma": arg((f,), F32), "beta": arg((f,), F32), "scale": arg((1,)),
            "running_mean": arg((f,), F32) if running else None, "running_var": arg((f,), F32) if running else None,
            "num_batches_tracked": arg((), np.int64) if running else None}
    call = lbs_checks.Call(ctx=FakeCtx(), dtype=dtype, n=n, k=64, f=f, use_batch_stats=training,
                            update_running=training and running, args=args)
    prepared = lbs.Prepared(call, momentum, 1e-5, False, 64, 64)
    vectors = tuple(0xE0_0000_0000 + 0x1_0000_0000 * i for i in range(7))
    for out in (O, O + 4096):
        prepared.execute(lambda: ("out", out), Q, K, vectors)
    prepared.execute_saving(lambda shape, float32: ("saved", LSE if float32 else V), Q, K, lambda: vectors)
    lbs._launch_plan.cache_clear()
    lbs._gemm_xwt_op.cache_clear()


case("lbs_training_fp16")(lambda r, m: _lbs_forward(r, m, dtype=F16, n=1000, f=1000, training=True))
case("lbs_eval_fp32_streaming")(lambda r, m: _lbs_forward(r, m, dtype=F32, n=30, f=9000, training=False))
case("lbs_training_bf16_cumulative")(lambda r, m: _lbs_forward(r, m, dtype="bf16", n=64, f=8192, training=True,
                                                               momentum=None))


class FakeTensor:
    """What the Linear-BN-softmax backward reads of a torch tensor: data_ptr, new_empty (a fresh address each)."""

    _next = [0]

    def __init__(self, ptr, shape=(), dtype=None):
        self.ptr, self.shape, self.dtype = ptr, tuple(shape), dtype

    def data_ptr(self):
        return self.ptr

    def new_empty(self, shape, dtype=None):
        FakeTensor._next[0] += 1
        return FakeTensor(0xF0_0000_0000 + 0x1_0000_0000 * FakeTensor._next[0], shape, dtype)

    def view(self, shape):
        return self


def _lbs_backward(rec, mp, *, needs, scale_shape, dy_in_work=True):
    import torch

    from cupy_attn.linear_bn_softmax import backward as lbs_bwd
    rec.cc = 90
    lbs_bwd._plan.cache_clear()
    mp.setattr(lbs_bwd.interop, "device_sms", lambda device_id: 132)
    mp.setattr(lbs_bwd, "_get_device_fn", lambda: (lambda: 0))
    mp.setattr(lbs_bwd, "_memcpy_fn", lambda: (lambda dst, src, n, kind, stream: rec.log.append(
        ["memcpy", dst, src, n, kind, stream])))

    def work(device_id, stream_ptr, name, nbytes):
        rec.log.append(["persistent", name, nbytes])
        return ("work", 0x7800_0000_0000)
    mp.setattr(lbs_bwd, "stream_workspace", work)
    mp.setattr(torch, "split_with_sizes", lambda buf, sizes: [buf.new_empty((s,)) for s in sizes])
    if not dy_in_work:
        mp.setattr(lbs_bwd, "Y_WORKSPACE_MAX_BYTES", 100)
    FakeTensor._next[0] = 0
    n, k, f = 40, 24, 96
    h = torch.float16
    call = lbs_bwd._Call(FakeCtx(), 0, STREAM, h, n, k, f, k, k, (torch.float32, torch.float32, h), scale_shape,
                         True, needs, False)
    tensors = [FakeTensor(0x90_0000_0000 + 0x1_0000_0000 * i) for i in range(9)]
    for step in range(2):
        call(*tensors)
    lbs_bwd._plan.cache_clear()


case("lbs_backward_all")(lambda r, m: _lbs_backward(r, m, needs=(True, True, True, True, True, True),
                                                    scale_shape=(96,)))
case("lbs_backward_dw_dy_outside")(lambda r, m: _lbs_backward(r, m, needs=(False, True, True, False, False, True),
                                                              scale_shape=(1,), dy_in_work=False))


def run_case(name: str, monkeypatch) -> list:
    """The log of one case (environment knobs cleared first)."""
    for key in list(os.environ):
        if key.startswith("CUPY_ATTN_") and key != "CUPY_ATTN_CACHE_DIR":
            monkeypatch.delenv(key)
    rec = Recorder(monkeypatch)
    CASES[name](rec, monkeypatch)
    return json.loads(json.dumps(rec.log))  # tuples as lists, as the recording holds them


def record_all() -> dict:
    from _pytest.monkeypatch import MonkeyPatch
    out = {}
    for name in CASES:
        mp = MonkeyPatch()
        try:
            out[name] = run_case(name, mp)
        finally:
            mp.undo()
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    logs = record_all()
    if "--write" in sys.argv:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text("{\n" + ",\n".join(f"{json.dumps(name)}: [\n" + ",\n".join(json.dumps(e) for e in log) + "]"
                                             for name, log in sorted(logs.items())) + "\n}\n")
    for name, log in logs.items():
        kinds = {}
        for e in log:
            kinds[e[0]] = kinds.get(e[0], 0) + 1
        print(f"{name}: {kinds}")
