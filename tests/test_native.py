"""cupy_attn behaves like a native torch op on the GPU: CUDA-graph capture and replay on every path (torch.cuda.graph
and CuPy stream capture), memory from the caller's allocator, nothing left in CuPy's pool for torch callers."""
import zlib

import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference
from cupy_attn.runtime import callcache

from _graphs import capture_sdpa
from _tolerance import as_f64, assert_close

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

# (name, shape (B, H, L, S, E), dtype, kwargs): one call per path the dispatcher takes.
PATHS = [
    ("fused", (2, 4, 200, 300, 64), torch.float16, {}),
    ("fused causal", (2, 4, 256, 256, 128), torch.bfloat16, {"is_causal": True}),
    ("fused bool mask", (2, 4, 100, 130, 64), torch.float16, {"attn_mask": "bool"}),
    ("split fp32", (2, 3, 100, 150, 64), torch.float32, {}),
    ("split hd512", (1, 4, 128, 256, 512), torch.float16, {}),
    ("split causal float mask", (1, 2, 64, 96, 320), torch.bfloat16, {"attn_mask": "float"}),
    ("decode split-KV", (2, 4, 1, 8192, 128), torch.float16, {}),  # split kernel + combine (a PDL launch on sm_90)
]


def _inputs(shape, dtype, kw, gen):
    B, H, L, S, E = shape
    q = torch.randn(B, H, L, E, generator=gen, device="cuda").to(dtype)
    k = torch.randn(B, H, S, E, generator=gen, device="cuda").to(dtype)
    v = torch.randn(B, H, S, E, generator=gen, device="cuda").to(dtype)
    kw = dict(kw)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(B, 1, 1, S, generator=gen, device="cuda") > 0.3
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(B, 1, L, S, generator=gen, device="cuda").to(dtype)
    return q, k, v, kw


def _reference(q, k, v, kw):
    mask = kw.get("attn_mask")
    if mask is not None:
        mask = mask.cpu().numpy() if mask.dtype == torch.bool else as_f64(mask)
    return reference.scaled_dot_product_attention(as_f64(q), as_f64(k), as_f64(v), mask,
                                                  is_causal=kw.get("is_causal", False))


def _check(out, q, k, v, kw, what):
    ref = _reference(q, k, v, kw)
    torch_kw = dict(kw)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), **{
        n: (x.float() if n == "attn_mask" and x.dtype != torch.bool else x) for n, x in torch_kw.items()}).to(q.dtype)
    assert_close(out, ref, {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}[q.dtype],
                 torch_out, what)


@pytest.mark.parametrize("name,shape,dtype,kw", PATHS, ids=[p[0] for p in PATHS])
def test_torch_cuda_graph_capture_and_replay(name, shape, dtype, kw):
    """Warm up on a side stream (as torch's docs prescribe), capture one call, then replay it on new data copied into
    the static inputs: the replay equals the reference on the new data."""
    g = torch.Generator("cuda").manual_seed(zlib.crc32(name.encode()) % 1000)
    q, k, v, kw = _inputs(shape, dtype, kw, g)
    graph, out = capture_sdpa(q, k, v, **kw)
    for step in range(2):
        q2, k2, v2, kw2 = _inputs(shape, dtype, {n: ("bool" if isinstance(x, torch.Tensor) and x.dtype == torch.bool
                                                     else "float" if isinstance(x, torch.Tensor) else x)
                                                 for n, x in kw.items()}, g)
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        if "attn_mask" in kw:
            kw["attn_mask"].copy_(kw2["attn_mask"])
        graph.replay()
        torch.cuda.synchronize()
        _check(out, q, k, v, kw, f"{name} replay {step}")
    torch.randn(4, device="cuda")  # torch's CUDA RNG still works after the capture


@pytest.mark.parametrize("name,shape,dtype,kw", PATHS, ids=[p[0] for p in PATHS])
def test_first_call_inside_capture(name, shape, dtype, kw):
    """A call whose layout was never seen made first inside capture works (call cache, split schedules, cuBLASLt plans
    and loaded kernel modules cleared): nothing on the path allocates outside torch's allocator or synchronizes."""
    from cupy_attn.attention.paths import split
    from cupy_attn.runtime import compile as _compile, cublaslt
    g = torch.Generator("cuda").manual_seed(7)
    q, k, v, kw = _inputs(shape, dtype, kw, g)
    callcache.clear()
    split._SCHEDULES.clear()
    cublaslt._PLANS.clear()
    _compile._load.cache_clear()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cupy_attn.scaled_dot_product_attention(q, k, v, **kw)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, q, k, v, kw, f"{name} first call in capture")


@pytest.mark.parametrize("name,shape,dtype,kw", [PATHS[i] for i in (0, 3, 4, 6)], ids=[PATHS[i][0] for i in (0, 3, 4, 6)])
def test_cupy_stream_capture_and_replay(name, shape, dtype, kw):
    g = torch.Generator("cuda").manual_seed(11)
    tq, tk, tv, kw = _inputs(shape, dtype, kw, g)
    q, k, v = (cupy.from_dlpack(x) for x in (tq, tk, tv))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cupy_attn.scaled_dot_product_attention(q, k, v, **kw)  # warm: compile, tune, cache the plan
        stream.synchronize()
        stream.begin_capture()
        out = cupy_attn.scaled_dot_product_attention(q, k, v, **kw)
        graph = stream.end_capture()
    for step in range(2):
        q2, k2, v2, _ = _inputs(shape, dtype, {}, g)
        tq.copy_(q2), tk.copy_(k2), tv.copy_(v2)
        torch.cuda.synchronize()
        graph.launch(stream)
        stream.synchronize()
        _check(torch.from_dlpack(out), tq, tk, tv, kw, f"{name} CuPy replay {step}")


def test_linear_batchnorm_softmax_graph_capture():
    from cupy_attn.torch import LinearBatchNormSoftmax
    torch.manual_seed(3)
    fused = LinearBatchNormSoftmax(256, 512).cuda().half()
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    for training in (True, False):
        fused.train(training)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            fused(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            out = fused(x)
        x.copy_(torch.randn_like(x))
        state = {n: b.clone() for n, b in fused.bn.named_buffers()}
        graph.replay()
        torch.cuda.synchronize()
        # The same call eagerly, from the state before the replay, on the new data.
        for n, b in fused.bn.named_buffers():
            b.copy_(state[n])
        with torch.no_grad():
            expect = fused(x)
        torch.testing.assert_close(out, expect, rtol=0, atol=2e-3)


def test_memory_comes_from_torch_allocator():
    """A split-path call's score buffer comes from torch's caching allocator (visible in max_memory_allocated, freed
    to torch afterwards) and nothing is taken from CuPy's pool for torch callers. The buffer holds fp32 scores, or,
    where the Hopper scores kernel runs (explain's "scores kernel"), P in the input dtype."""
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    used, total = pool.used_bytes(), pool.total_bytes()  # arrays other tests still hold
    q, k, v = (torch.randn(4, 8, 512, 1024, device="cuda", dtype=torch.float16) for _ in range(3))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = cupy_attn.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
    fused_scores = not cupy_attn.explain(q, k, v).details.get("scores kernel", "not used").startswith("not used")
    scores = 4 * 8 * 512 * 512 * (2 if fused_scores else 4)  # P fp16 or fp32 scores (L = S = 512): one chunk
    assert torch.cuda.max_memory_allocated() - before >= scores + out.numel() * 2
    held = torch.cuda.memory_allocated() - before - out.numel() * 2
    assert held <= 1 << 20, f"{held} bytes held after the call (a GEMM's cuBLASLt workspace is part of the scratch)"
    assert (pool.used_bytes(), pool.total_bytes()) == (used, total), "the call took memory from CuPy's pool"
    np.testing.assert_equal(torch.isfinite(out).all().item(), True)
