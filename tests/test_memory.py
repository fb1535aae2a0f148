"""Device memory is given back (issue 35): a call's temporaries, the split paths' cuBLASLt workspaces included, come
from the caller's allocator and go back to it when the call returns; the bounded per-stream caches (decode partials,
Linear-BN-softmax's buffers and the cuBLASLt workspace its bound GEMMs hold) are freed by cupy_attn.release_memory().

CPU: the split schedule carves one cuBLASLt workspace per stream from the call's one scratch allocation and hands each
GEMM its stream's region; cuBLASLt takes a given workspace and falls back to the persistent one only without it;
release_memory drops the caches and the MemPool (the bound workspace and the prepared calls holding it with
graphs=True); torch callers' input copies come from torch. GPU (marked ``gpu``): device
memory after a seed-shape call and ``torch.cuda.empty_cache()`` (≤ 64 MiB beyond live tensors, in this process and in
a fresh one), release_memory after decode and Linear-BN-softmax calls, CUDA-graph capture (torch.cuda.graph,
torch.compile mode="reduce-overhead", CuPy stream capture) across release_memory.
"""
import functools
import json
import os
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

import cupy_attn
from cupy_attn.runtime import callcache, cublaslt, workspace

import _launch_capture as capture
from _graphs import capture_sdpa

MiB = 1 << 20
WS = 32 * MiB


# --- CPU: the split path's GEMM workspaces are regions of the call's scratch ------------------------------------------

class _LtGemm(capture.FakeGemm):
    """A cuBLASLt GEMM stand-in: takes a workspace of cublaslt.WORKSPACE_BYTES; its calls record the one given."""

    workspace_bytes = cublaslt.WORKSPACE_BYTES

    def __call__(self, c, a, b, stream_ptr=None, work=None):
        self.recorder.log.append(["gemm", self.tag, c, a, b, stream_ptr, work])


def _split_run(monkeypatch, *, cc, dtype, shape, causal=None, env=None, streams_patch=False):
    """Run one split-path schedule twice on stand-in arrays (tests/_helpers/_launch_capture's device fakes) with
    cuBLASLt-like GEMMs; returns (log, schedule)."""
    from cupy_attn.attention import dispatch
    from cupy_attn.attention.paths import split
    from cupy_attn.runtime import blas
    for key in list(os.environ):
        if key.startswith("CUPY_ATTN_") and key != "CUPY_ATTN_CACHE_DIR":
            monkeypatch.delenv(key)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    rec = capture.Recorder(monkeypatch, cc=cc)
    monkeypatch.setattr(blas, "StridedGemm", functools.partial(_LtGemm, rec))
    monkeypatch.setattr(dispatch, "device_arch", lambda p: cc)
    monkeypatch.setattr(split, "_SCHEDULES", {})
    if streams_patch:  # side streams of causal bands: stand-ins (no CUDA stream without a GPU)
        side = [capture.FakeStream(0x5800 + i) for i in range(4)]
        monkeypatch.setattr(split, "_fork", lambda ctx, n: (side[:n], [None] * n))
        monkeypatch.setattr(split, "_join", lambda main, streams, events: None)
    B, Hq, Hkv, L, S, E, Ev = shape
    p = capture._problem(B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, Ev=Ev, dtype=dtype, causal=causal)
    o = capture.FakeArray((B, Hq, L, Ev), capture._dtype(dtype), capture.O)
    lse = capture.FakeArray((B, Hq, L), capture.F32, capture.LSE)
    sched = split.schedule(p, dispatch.split_choice(p, cc, out=o), o, lse)
    ptrs = capture._ptrs(p.query, p.key, p.value, o, lse, None)
    split.run(sched, p.ctx, *ptrs)
    split.run(sched, p.ctx, *ptrs)
    return rec.log, sched


def _scratches(log):
    """[(scratch base, bytes)] in request order: the Recorder's addresses (one 4 GiB slot each)."""
    sizes = [e[1] for e in log if e[0] == "scratch"]
    return [(0x7000_0000_0000 + 0x1_0000_0000 * i, n) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("name,cc,dtype,shape,causal,env,streams", [
    ("cuBLAS Q·Kᵀ + softmax + cuBLAS P·V", 80, capture.F16, (2, 4, 2, 100, 300, 72, 96), None, None, 1),
    ("scores kernel + cuBLAS P·V", 90, capture.F16, (2, 4, 2, 300, 512, 320, 320), None, None, 1),
    ("cuBLAS causal bands on 2 streams", 80, "bf16", (1, 2, 2, 1024, 1024, 64, 64), "top_left", None, 2),
    ("scores kernel in batch chunks", 90, capture.F16, (3, 4, 4, 256, 256, 320, 320), None,
     {"CUPY_ATTN_WORKSPACE_BYTES": str(4 * 256 * 256 * 2 + 1)}, 1),
])
def test_split_gemms_take_their_workspace_from_the_call_scratch(name, cc, dtype, shape, causal, env, streams,
                                                                monkeypatch):
    """One scratch allocation per chunk schedule and call (no extra host work): the scores (or P) first, then one
    256-byte aligned cuBLASLt workspace per stream; every GEMM is given its stream's region, which overlaps neither
    the scores nor another stream's region, and nothing asks for the persistent workspace."""
    log, sched = _split_run(monkeypatch, cc=cc, dtype=dtype, shape=shape, causal=causal, env=env,
                            streams_patch=streams > 1)
    assert not [e for e in log if e[0] == "persistent"], name
    subs = [s for _, s in sched.batch_chunks] or [sched]
    assert all(s.gemm_workspace == WS for s in subs), name
    scratches = _scratches(log)
    assert len(scratches) == 2 * len(subs), name  # one per (sub-)schedule and call
    gemms = [e for e in log if e[0] == "gemm"]
    assert gemms and all(e[6] is not None and e[6][1] == WS for e in gemms), name
    used_streams = set()
    for base, nbytes in scratches:
        mine = [e for e in gemms if base <= e[6][0] < base + nbytes]
        assert mine, name
        for s in subs:
            size, offset = s.scratch_layout()
            if size == nbytes:
                break
        assert offset % 256 == 0 and offset >= s.scores_elems * s.itemsize, name
        for e in mine:
            region = (e[6][0] - base - offset) // WS
            assert (e[6][0] - base - offset) % WS == 0 and 0 <= region < s.streams, name
            assert e[6][0] + WS <= base + nbytes, name
            used_streams.add((e[5], region))
    # a stream's GEMMs share one region, and two streams never share one
    regions = {}
    for stream, region in used_streams:
        regions.setdefault(region, set()).add(stream)
    assert all(len(v) == 1 for v in regions.values()) and len(regions) == streams, (name, used_streams)


@pytest.mark.parametrize("shape,cc,dtype,causal", [
    ((2, 4, 2, 300, 400, 320, 320), 90, capture.F16, "top_left"),   # scores kernel + pv_sm90: no GEMM
    ((2, 4, 4, 100, 300, 40, 40), 80, capture.F32, None),           # fp32: 3xTF32 GEMMs (our kernel, no workspace)
])
def test_split_without_cublaslt_gemms_keeps_its_scratch_size(shape, cc, dtype, causal, monkeypatch):
    log, sched = _split_run(monkeypatch, cc=cc, dtype=dtype, shape=shape, causal=causal)
    assert sched.gemm_workspace == 0
    assert [n for _, n in _scratches(log)] == [sched.scores_elems * sched.itemsize] * 2


def test_split_backward_takes_one_gemm_workspace_per_call(monkeypatch):
    """The split backward's GEMMs all get one workspace from the call's scratch (cuBLASLt available)."""
    from cupy_attn.runtime import blas
    for key in list(os.environ):
        if key.startswith("CUPY_ATTN_") and key != "CUPY_ATTN_CACHE_DIR":
            monkeypatch.delenv(key)
    rec = capture.Recorder(monkeypatch)
    monkeypatch.setattr(blas, "StridedGemm", functools.partial(_LtGemm, rec))
    monkeypatch.setattr(blas, "lt_workspace_bytes", lambda: WS)
    capture._split_backward(rec, monkeypatch, causal="top_left")
    assert not [e for e in rec.log if e[0] == "persistent"]
    ws_requests = [i for i, e in enumerate(rec.log) if e == ["scratch", WS]]
    assert len(ws_requests) == 1
    base = _scratches(rec.log)[[e for e in rec.log if e[0] == "scratch"].index(["scratch", WS])][0]
    works = {tuple(e[6]) for e in rec.log if e[0] == "gemm"}
    assert works == {(base, WS)}


# --- CPU: cuBLASLt takes the given workspace -------------------------------------------------------------------------

def _fake_plan(monkeypatch, algo_workspace):
    calls, persistent = [], []
    binding = types.SimpleNamespace(matmul=lambda *a: calls.append(a), cuBLASLtError=RuntimeError)
    monkeypatch.setattr(cublaslt, "_lib", lambda: binding)
    monkeypatch.setattr(cublaslt, "_handle", lambda device_id: 0x11)

    def persist(device_id, stream_ptr, name, nbytes, bound=False):
        persistent.append((name, nbytes, bound))
        return types.SimpleNamespace(nbytes=nbytes, data=types.SimpleNamespace(ptr=0x9900))
    monkeypatch.setattr(workspace, "persistent", persist)
    plan = cublaslt.Plan.__new__(cublaslt.Plan)
    plan.key = types.SimpleNamespace(device_id=0)
    plan.desc, plan.layout_a, plan.layout_b, plan.layout_c = 1, 2, 3, 4
    plan.algos = [types.SimpleNamespace(workspace_size=algo_workspace, ptr=0x77)]
    plan.choice = 0
    return plan, calls, persistent


def test_cublaslt_run_uses_the_given_workspace(monkeypatch):
    plan, calls, persistent = _fake_plan(monkeypatch, algo_workspace=4 * MiB)
    plan.run(0xC, 0xA, 0xB, 0x1, 0x2, 0x5700, work=(0x4400, WS))
    assert calls[-1][-3:] == (0x4400, WS, 0x5700) and not persistent
    plan.run(0xC, 0xA, 0xB, 0x1, 0x2, 0x5700)  # no workspace given: the stream's persistent one
    assert calls[-1][-3:] == (0x9900, WS, 0x5700) and persistent == [("cublaslt", WS, True)]
    plan.run(0xC, 0xA, 0xB, 0x1, 0x2, 0x5700, work=(0x4400, 1 * MiB))  # too small for the algorithm: persistent
    assert calls[-1][-3:] == (0x9900, WS, 0x5700)


def test_gemm_3xtf32_takes_no_workspace():
    from cupy_attn.attention.kernels import gemm_3xtf32
    assert gemm_3xtf32.Gemm3xTF32.workspace_bytes == 0


# --- CPU: release_memory ---------------------------------------------------------------------------------------------

def test_release_memory_drops_caches_pools_and_prepared_calls(monkeypatch):
    """release_memory(): the per-stream caches go (decode partials, Linear-BN-softmax's buffers) and the MemPools; the
    bound cuBLASLt workspaces (a graph may replay their address), the prepared calls holding them (the call cache,
    Linear-BN-softmax's backward calls and plans) and the CuPy-captured scratch stay. graphs=True: all of it goes."""
    from cupy_attn.linear_bn_softmax import backward as lbs_backward
    monkeypatch.setattr(workspace, "_PERSISTENT", {})
    monkeypatch.setattr(workspace, "_BOUND", set())
    monkeypatch.setattr(workspace, "_MEMPOOLS", {0: object()})
    monkeypatch.setattr(workspace, "_CAPTURED", ["captured scratch"])
    monkeypatch.setattr(workspace, "capturing", lambda stream_ptr: False)
    monkeypatch.setattr(workspace, "_alloc", lambda kind, device_id, nbytes: (np.zeros(nbytes, np.uint8), 0))
    for stream in (0x10, 0x20):
        cublaslt._workspace_array(0, stream, MiB)
        for name, nbytes in (("decode_partials", 3 * MiB), ("lbs_work", 5 * MiB)):
            assert workspace.persistent(0, stream, name, nbytes).nbytes == nbytes
    assert workspace.persistent(0, 0x10, "decode_partials", MiB).nbytes == 3 * MiB  # reused, not shrunk
    assert workspace.persistent(0, 0x10, "cublaslt", MiB).nbytes == WS
    monkeypatch.setattr(callcache, "_CACHE", {"key": "entry holding a bound GEMM"})
    monkeypatch.setattr(lbs_backward, "_CALLS", {"key": "backward call holding a bound GEMM"})
    forgotten = []
    monkeypatch.setattr(workspace, "_ON_RELEASE", list(workspace._ON_RELEASE) + [lambda: forgotten.append(1)])
    assert callcache.clear in workspace._ON_RELEASE
    assert lbs_backward._forget_bound_gemms in workspace._ON_RELEASE

    cupy_attn.release_memory()
    assert sorted(workspace._PERSISTENT) == [(0, 0x10, "cublaslt"), (0, 0x20, "cublaslt")]
    assert workspace._MEMPOOLS == {} and workspace._CAPTURED == ["captured scratch"] and not forgotten
    assert callcache._CACHE and lbs_backward._CALLS
    assert workspace.persistent(0, 0x10, "decode_partials", MiB).nbytes == MiB  # allocated again on the next call
    cupy_attn.release_memory(graphs=True)
    assert workspace._PERSISTENT == {} and workspace._BOUND == set() and workspace._CAPTURED == [] and forgotten
    assert callcache._CACHE == {} and lbs_backward._CALLS == {}


def test_release_memory_is_public_and_documented():
    assert "release_memory" in cupy_attn.__all__ and cupy_attn.release_memory is workspace.release_memory
    doc = cupy_attn.release_memory.__doc__
    for words in ("empty_cache", "free_all_blocks", "graphs=True", "32 MiB", "64 MiB", "reduce-overhead"):
        assert words in doc, words


# --- CPU: copies of inputs for torch callers come from torch ----------------------------------------------------------

def test_sdpa_input_copies_use_the_callers_allocator(monkeypatch):
    """An input the kernels cannot read in place (last axis not unit-stride, leading axes that do not fold) is copied by
    CallContext.contiguous: for torch callers into a tensor of torch's allocator (CallContext.empty), bit for bit
    (bf16 included), never into CuPy's pool."""
    import ml_dtypes
    from cupy_attn.attention import checks
    from cupy_attn.runtime import interop
    made = []

    def empty(self, shape, dtype):
        made.append((shape, np.dtype(dtype)))
        a = np.empty(shape, dtype)
        return "torch tensor", a
    monkeypatch.setattr(interop.CallContext, "empty", empty)
    ctx = interop.CallContext(interop.TORCH, 0)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    x = np.arange(2 * 3 * 4 * 10, dtype=np.float32).astype(bf16).reshape(2, 3, 4, 10)[..., ::2]
    copies = []
    y = checks._unit_last_axis(x, "query", copies, ctx)
    assert made == [((2, 3, 4, 5), bf16)] and y.flags.c_contiguous and copies
    np.testing.assert_array_equal(y.view(np.uint16), x.view(np.uint16))
    m = (np.arange(2 * 3 * 4 * 5 * 7) % 3 == 0).reshape(2, 3, 4, 5, 7).transpose(1, 0, 2, 3, 4)  # no common stride
    folded = checks._fold_leading(m, "attn_mask", copies, ctx)
    assert made[-1] == ((3, 2, 4, 5, 7), np.dtype(np.bool_)) and folded.shape == (6, 4, 5, 7)
    np.testing.assert_array_equal(folded, m.reshape(6, 4, 5, 7))


def test_linear_batchnorm_softmax_copies_torch_operands_with_torch():
    torch = pytest.importorskip("torch")
    from cupy_attn.linear_bn_softmax import checks as lbs_checks, launch as lbs
    from cupy_attn.runtime import interop
    x = torch.randn(8, 12)[:, ::2]
    a = lbs.unit_last_stride(lbs_checks.Arg(x, interop.TORCH, np.dtype(np.float32), (8, 6)))
    assert a.kind == interop.TORCH and a.obj.is_contiguous() and torch.equal(a.obj, x)
    vec = torch.randn(12)[::2]
    keep = []
    ptr = lbs.vector_ptr(lbs_checks.Arg(vec, interop.TORCH, np.dtype(np.float32), (6,)), keep)
    assert isinstance(keep[0], torch.Tensor) and keep[0].data_ptr() == ptr and torch.equal(keep[0], vec)


# --- GPU: memory after a seed-shape call ------------------------------------------------------------------------------

SEED = (32, 32, 512, 1024)  # bench/bench_sdpa.py's (B, H, L=S, D)
LIMIT = 64 * MiB

_SEED_PROBE = r"""
import json, sys
import torch
import cupy_attn
import cupy
B, H, L, D = {seed}
torch.cuda.init()
q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16) for _ in range(3))
torch.cuda.synchronize(); torch.cuda.empty_cache()
free0 = torch.cuda.mem_get_info()[0]
reserved0 = torch.cuda.memory_reserved()
out = cupy_attn.scaled_dot_product_attention(q, k, v)
torch.cuda.synchronize()
plan = cupy_attn.explain(q, k, v)
del out
torch.cuda.synchronize(); torch.cuda.empty_cache()
free1 = torch.cuda.mem_get_info()[0]
reserved1 = torch.cuda.memory_reserved()
pool = cupy.get_default_memory_pool()
cupy_pool = pool.total_bytes()
cupy_attn.release_memory()
torch.cuda.empty_cache()
free2 = torch.cuda.mem_get_info()[0]
print(json.dumps({{"held": free0 - free1, "held_after_release": free0 - free2, "torch_reserved": reserved1 - reserved0,
                   "cupy_pool": cupy_pool, "plan": str(plan)}}))
"""


def _held_report(r: dict) -> str:
    return (f"{r['held'] / MiB:.1f} MiB held after the call and empty_cache ({r['held_after_release'] / MiB:.1f} "
            f"after release_memory): torch's allocator {r['torch_reserved'] / MiB:.1f} MiB, CuPy's pool "
            f"{r['cupy_pool'] / MiB:.1f} MiB, the rest outside both (library handles, loaded modules); plan:\n"
            f"{r['plan']}")


@pytest.mark.gpu
def test_seed_call_gives_memory_back_in_a_fresh_process():
    """The issue's measurement: a fresh process, the seed shape (32, 32, 512, 1024) fp16 torch tensors (the split
    path: scores kernel, cuBLAS P·V), one call, the output dropped, torch.cuda.empty_cache(): at most 64 MiB of
    device memory stays taken (one-time costs of the first call included: CuPy's and cuBLASLt's handles, loaded
    modules; was 610 MiB). Nothing stays in torch's allocator."""
    code = _SEED_PROBE.format(seed=SEED)
    root = str(pathlib.Path(__file__).resolve().parents[1])  # this checkout's cupy_attn
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["torch_reserved"] == 0, _held_report(r)  # no MemPool or cached block of the call
    assert r["held"] <= LIMIT and r["held_after_release"] <= LIMIT, _held_report(r)


@pytest.mark.gpu
def test_seed_call_gives_memory_back():
    """In this process (what earlier tests loaded is already counted in the baseline): after a seed-shape call and
    empty_cache nothing of the call stays in torch's allocator, and device memory is within 64 MiB of before, on the
    default stream and on a side stream; repeated calls allocate nothing new."""
    import cupy
    torch = pytest.importorskip("torch")
    B, H, L, D = SEED
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16) for _ in range(3))
    for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free0, reserved0, pool0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved(), \
                cupy.get_default_memory_pool().total_bytes()
            for _ in range(3):
                out = cupy_attn.scaled_dot_product_attention(q, k, v)
                del out
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            held = free0 - torch.cuda.mem_get_info()[0]
            assert torch.cuda.memory_reserved() == reserved0, "the call left memory in torch's allocator"
            assert cupy.get_default_memory_pool().total_bytes() == pool0, "the call took memory from CuPy's pool"
            assert held <= LIMIT, f"{held / MiB:.1f} MiB held"


@pytest.mark.gpu
def test_release_memory_frees_the_per_stream_caches():
    """Decode and Linear-BN-softmax calls keep bounded per-stream caches (decode partials; y and the affine; the
    cuBLASLt workspace its GEMM binds): release_memory() + empty_cache gives back all but the bound 32 MiB,
    release_memory(graphs=True) that too, and later calls still give the same results."""
    torch = pytest.importorskip("torch")
    from cupy_attn.torch import LinearBatchNormSoftmax
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(8, 32, 1, 128, generator=g, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(8, 8, 8192, 128, generator=g, device="cuda", dtype=torch.float16) for _ in range(2))
    model = LinearBatchNormSoftmax(1024, 8192).cuda().half().eval()
    x = torch.randn(2048, 1024, generator=g, device="cuda", dtype=torch.float16)  # y: 32 MiB, in the cache

    def calls():
        with torch.no_grad():
            a = cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, num_splits=8)
            b = model(x)
        torch.cuda.synchronize()
        return a, b

    def held(free0):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return free0 - torch.cuda.mem_get_info()[0]

    expect = calls()  # compiles, tunes, loads modules
    cupy_attn.release_memory(graphs=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0]
    got = calls()
    del got
    cached = held(free0)
    assert 64 * MiB <= cached <= 160 * MiB, f"{cached / MiB:.1f} MiB: not the bounded caches (y 32, cuBLASLt 32)"
    cupy_attn.release_memory()
    kept = held(free0)
    assert kept <= WS + 4 * MiB, f"{kept / MiB:.1f} MiB held after release_memory(): only the bound 32 MiB may stay"
    for a, b in zip(calls(), expect):
        torch.testing.assert_close(a, b)
    del a, b  # the loop's last pair: the Linear-BN-softmax output (32 MiB) would count as held
    cupy_attn.release_memory(graphs=True)
    gone = held(free0)
    assert gone <= 4 * MiB, f"{gone / MiB:.1f} MiB held after release_memory(graphs=True) and empty_cache"
    for a, b in zip(calls(), expect):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
def test_release_memory_with_cupy_arrays():
    """CuPy callers: the decode partials come from the stream's allocator (CuPy's pool; torch's when torch ran on
    the legacy stream first, as earlier tests of this process may have) and go back to it with release_memory()."""
    import cupy
    q = cupy.random.standard_normal((4, 32, 1, 128), dtype=cupy.float32).astype(cupy.float16)
    k, v = (cupy.random.standard_normal((4, 8, 8192, 128), dtype=cupy.float32).astype(cupy.float16)
            for _ in range(2))
    pool = cupy.get_default_memory_pool()

    def used():  # the legacy stream (CuPy's default) may be torch's too: its buffers then come from torch's allocator
        torch = sys.modules.get("torch")
        return pool.used_bytes() + (torch.cuda.memory_allocated() if torch is not None else 0)

    cupy_attn.release_memory()
    out = cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, num_splits=8)
    cupy.cuda.get_current_stream().synchronize()
    before = used()
    cupy_attn.release_memory()
    partials = 8 * 4 * 32 * (128 + 1) * 4  # splits x query rows x (Ev + lse) fp32
    assert before - used() >= partials, "release_memory left the decode partials in use"
    again = cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, num_splits=8)
    cupy.testing.assert_array_equal(again, out)


@pytest.mark.gpu
def test_copied_inputs_leave_nothing_in_cupys_pool():
    """torch callers whose inputs must be copied (a strided last axis; Linear-BN-softmax's strided x and vectors):
    the copies come from torch's allocator, CuPy's pool is untouched, and the results match the contiguous call."""
    import cupy
    torch = pytest.importorskip("torch")
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    before = (pool.used_bytes(), pool.total_bytes())
    g = torch.Generator("cuda").manual_seed(4)
    base = torch.randn(2, 4, 128, 2 * 320, generator=g, device="cuda").half()
    q, k, v = base[..., ::2], base.flip(2)[..., ::2], base[..., 1::2]
    out = cupy_attn.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, cupy_attn.scaled_dot_product_attention(q.contiguous(), k.contiguous(),
                                                                           v.contiguous()))
    x = torch.randn(64, 2 * 256, generator=g, device="cuda").half()[:, ::2]
    w = torch.randn(512, 256, generator=g, device="cuda").half()
    rm, rv = torch.randn(512, generator=g, device="cuda"), torch.rand(512, generator=g, device="cuda") + 0.5
    gamma, beta = (torch.randn(2 * 512, generator=g, device="cuda")[::2] for _ in range(2))  # strided: copied
    one = torch.ones(1, device="cuda")
    y = cupy_attn.linear_batchnorm_softmax(x, w, None, rm, rv, gamma, beta, one, training=False)
    expect = cupy_attn.linear_batchnorm_softmax(x.contiguous(), w, None, rm, rv, gamma.contiguous(), beta.contiguous(),
                                                one, training=False)
    torch.testing.assert_close(y, expect)
    torch.cuda.synchronize()
    assert (pool.used_bytes(), pool.total_bytes()) == before, "a torch call took memory from CuPy's pool"


# --- GPU: CUDA-graph capture after the change -----------------------------------------------------------------------

# (name, shape (B, H, L, S, E), dtype, kwargs, environment): split schedules whose GEMMs now take their workspace
# from the call's scratch, and Linear-BN-softmax's bound GEMM (persistent workspace) in the same graph.
CAPTURED = [
    ("scores kernel + cuBLAS P·V", (8, 16, 512, 512, 1024), "float16", {}, {}),  # B·H·L > 32768: cuBLAS P·V
    ("cuBLAS Q·Kᵀ + softmax + P·V", (2, 4, 256, 320, 320), "bfloat16", {"backend": "split"},
     {"CUPY_ATTN_SPLIT_FUSED": "0"}),
    ("cuBLAS causal bands", (1, 4, 1024, 1024, 512), "float16", {"is_causal": True, "backend": "split"},
     {"CUPY_ATTN_SPLIT_FUSED": "0"}),
    ("fp32 3xTF32", (2, 4, 128, 256, 96), "float32", {}, {}),
]


def _torch_inputs(shape, dtype, seed):
    torch = pytest.importorskip("torch")
    B, H, L, S, E = shape
    g = torch.Generator("cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    return tuple(torch.randn(s, generator=g, device="cuda").to(dt) for s in ((B, H, L, E), (B, H, S, E), (B, H, S, E)))


@pytest.mark.gpu
@pytest.mark.parametrize("name,shape,dtype,kw,env", CAPTURED, ids=[c[0] for c in CAPTURED])
def test_torch_graph_capture_survives_release_memory(name, shape, dtype, kw, env, monkeypatch):
    """torch.cuda.graph capture of a split-path call (GEMM workspaces in the call's scratch, from the graph's pool),
    replayed on new data before and after release_memory + empty_cache: the replays equal eager calls."""
    torch = pytest.importorskip("torch")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    q, k, v = _torch_inputs(shape, dtype, 1)
    graph, out = capture_sdpa(q, k, v, **kw)
    for step in range(3):
        if step == 1:
            cupy_attn.release_memory()
            torch.cuda.empty_cache()
        for dst, src in zip((q, k, v), _torch_inputs(shape, dtype, 10 + step)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        expect = cupy_attn.scaled_dot_product_attention(q, k, v, **kw)
        torch.testing.assert_close(out, expect, msg=f"{name}: replay {step}")


@pytest.mark.gpu
def test_reduce_overhead_graphs_with_split_and_linear_batchnorm_softmax(monkeypatch):
    """torch.compile(mode="reduce-overhead") (CUDA-graph trees: warm-up allocations go to the graph's pool, so the
    persistent buffers must come from cupy_attn's MemPool and the per-call scratch must be freed within the call; the
    capture replays the warm-up's prepared calls, Linear-BN-softmax's GEMM bound to its cuBLASLt workspace) of a
    split-path attention with cuBLAS P·V followed by Linear-BN-softmax: replays match eager, also after
    release_memory() (which keeps that bound workspace)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("CUPY_ATTN_SPLIT_PV", "0")
    from cupy_attn.torch import LinearBatchNormSoftmax
    torch.manual_seed(2)
    lbs = LinearBatchNormSoftmax(512, 1024).cuda().half().eval()

    def step(q, k, v):
        a = cupy_attn.scaled_dot_product_attention(q, k, v, backend="split")  # scores kernel, cuBLAS P·V
        return lbs(a.flatten(0, 2)[:, :512])

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for i in range(6):
            if i == 4:
                cupy_attn.release_memory()
                torch.cuda.empty_cache()
            q, k, v = _torch_inputs((2, 4, 256, 384, 512), "float16", 20 + i)
            got = compiled(q, k, v).clone()
            torch.testing.assert_close(got, step(q, k, v), msg=f"call {i}")


@pytest.mark.gpu
def test_cupy_capture_then_release_memory_with_graphs():
    """CuPy stream capture of a split call with a cuBLAS GEMM: the captured scratch stays until
    release_memory(graphs=True), which is called after the graph is gone."""
    import cupy
    torch = pytest.importorskip("torch")
    tq, tk, tv = _torch_inputs((8, 16, 512, 512, 1024), "float16", 3)  # cuBLAS P·V
    q, k, v = (cupy.from_dlpack(x) for x in (tq, tk, tv))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cupy_attn.scaled_dot_product_attention(q, k, v)
        stream.synchronize()
        stream.begin_capture()
        out = cupy_attn.scaled_dot_product_attention(q, k, v)
        graph = stream.end_capture()
    cupy_attn.release_memory()  # graphs=False: the captured scratch stays
    assert workspace._CAPTURED
    graph.launch(stream)
    stream.synchronize()
    with stream:
        expect = cupy_attn.scaled_dot_product_attention(q, k, v)
    stream.synchronize()
    cupy.testing.assert_allclose(out, expect, rtol=1e-3, atol=1e-5)
    del graph
    cupy_attn.release_memory(graphs=True)
    assert not workspace._CAPTURED
    torch.cuda.synchronize()
