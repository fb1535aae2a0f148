"""scaled_dot_product_attention on the GPU (split path unless a test says otherwise) against the float64 reference."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference

from _tolerance import as_f64, assert_close

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
F = torch.nn.functional
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _rand(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * scale).to(DTYPES[dtype])


def _run(q, k, v, dtype, backend="split", what="", **kw):
    """Run cupy_attn (output poisoned first via a warm call pattern) and compare to reference and torch's error."""
    ref, ref_lse = reference.scaled_dot_product_attention(
        as_f64(q), as_f64(k), as_f64(v), None if kw.get("attn_mask") is None else as_f64(kw["attn_mask"]) if
        kw["attn_mask"].dtype != torch.bool else kw["attn_mask"].cpu().numpy(),
        is_causal=kw.get("is_causal", False), scale=kw.get("scale"), enable_gqa=kw.get("enable_gqa", False),
        return_lse=True)
    _poison_next_allocations(q, ref.shape, ref_lse.shape)
    out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, backend=backend, return_lse=True, **kw)
    torch_kw = {k_: v_ for k_, v_ in kw.items() if k_ in ("attn_mask", "is_causal", "scale", "enable_gqa")}
    if torch_kw.get("attn_mask") is not None:  # torch's efficient kernel rejects some broadcast masks: materialize
        torch_kw["attn_mask"] = torch_kw["attn_mask"].expand(ref.shape[:-1] + (k.shape[-2],)).contiguous()
    if isinstance(torch_kw.get("is_causal"), str):
        torch_kw.pop("is_causal")
        L, S = q.shape[-2], k.shape[-2]
        torch_kw["attn_mask"] = torch.ones(L, S, dtype=torch.bool, device="cuda").tril(S - L)
    torch_out = F.scaled_dot_product_attention(q, k, v, **torch_kw) if q.numel() and k.numel() else None
    assert_close(out, ref, dtype, torch_out, what)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(as_f64(lse)[finite], ref_lse[finite], rtol=1e-3, atol=1e-3, err_msg=what)
    assert np.all(as_f64(lse)[~finite & ~np.isnan(ref_lse)] == -np.inf), what
    return out


def _poison_next_allocations(q, out_shape, lse_shape):
    """Free NaN-filled blocks of exactly the outputs' sizes: torch's caching allocator hands them to the next
    allocations of those sizes on this stream, so an element the kernels never write stays NaN and fails."""
    junk = [torch.full(out_shape, float("nan"), device=q.device, dtype=q.dtype),
            torch.full(lse_shape, float("nan"), device=q.device, dtype=torch.float32)]
    del junk


LS = [(1, 1), (1, 513), (113, 203), (512, 512), (1023, 1024), (2048, 77)]
EEV = [(8, 8), (40, 40), (64, 64), (80, 80), (128, 128), (200, 200), (256, 256), (1000, 1000), (1024, 1024), (64, 200)]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("L,S", LS)
def test_seqlens(dtype, L, S):
    g = torch.Generator("cuda").manual_seed(L * 7 + S)
    q, k, v = _rand((1, 3, L, 64), dtype, g), _rand((1, 3, S, 64), dtype, g), _rand((1, 3, S, 64), dtype, g)
    _run(q, k, v, dtype, what=f"{dtype} L={L} S={S}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("E,Ev", EEV)
def test_head_dims(dtype, E, Ev):
    g = torch.Generator("cuda").manual_seed(E + 3 * Ev)
    q, k, v = _rand((2, 2, 113, E), dtype, g), _rand((2, 2, 203, E), dtype, g), _rand((2, 2, 203, Ev), dtype, g)
    _run(q, k, v, dtype, what=f"{dtype} E={E} Ev={Ev}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_large_magnitude_scores(dtype):
    """|scale·q·k| up to ~50: the fp32 score buffer keeps the softmax accurate."""
    g = torch.Generator("cuda").manual_seed(11)
    q, k, v = _rand((2, 4, 128, 64), dtype, g, 3.0), _rand((2, 4, 256, 64), dtype, g, 3.0), _rand((2, 4, 256, 64),
                                                                                                 dtype, g)
    s = (q.float() @ k.float().transpose(-1, -2)) / 8
    assert s.abs().max() > 30
    _run(q, k, v, dtype, what=f"{dtype} large scores")


MASKS = {
    "bool_key_padding": lambda B, H, L, S, g: torch.rand(B, 1, 1, S, generator=g, device="cuda") > 0.3,
    "bool_full": lambda B, H, L, S, g: torch.rand(B, H, L, S, generator=g, device="cuda") > 0.5,
    "bool_LS": lambda B, H, L, S, g: torch.rand(L, S, generator=g, device="cuda") > 0.5,
    "float_HLS": lambda B, H, L, S, g: torch.randn(H, L, S, generator=g, device="cuda"),
    "float_neg_inf": lambda B, H, L, S, g: torch.where(torch.rand(B, 1, L, S, generator=g, device="cuda") > 0.6,
                                                       0.0, float("-inf")),
    "float_row_broadcast": lambda B, H, L, S, g: torch.randn(B, H, L, 1, generator=g, device="cuda"),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_masks(dtype, mask_name):
    g = torch.Generator("cuda").manual_seed(5)
    B, H, L, S = 2, 3, 67, 131
    q, k, v = _rand((B, H, L, 80), dtype, g), _rand((B, H, S, 80), dtype, g), _rand((B, H, S, 48), dtype, g)
    mask = MASKS[mask_name](B, H, L, S, g)
    if mask.dtype != torch.bool:
        mask = mask.to(DTYPES[dtype])
    _run(q, k, v, dtype, attn_mask=mask, what=f"{dtype} {mask_name}")


def test_fully_masked_rows_give_zero_not_nan():
    g = torch.Generator("cuda").manual_seed(6)
    q, k, v = (_rand((2, 2, 16, 32), "float16", g) for _ in range(3))
    mask = torch.ones(2, 2, 16, 16, dtype=torch.bool, device="cuda")
    mask[0, 1, 3] = False
    mask[1] = False
    out = _run(q, k, v, "float16", attn_mask=mask, what="fully masked")
    assert torch.all(out[1] == 0) and torch.all(out[0, 1, 3] == 0)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("alignment", [True, "bottom_right"])
@pytest.mark.parametrize("L,S", [(100, 300), (256, 256), (300, 100)])
def test_causal(dtype, alignment, L, S):
    g = torch.Generator("cuda").manual_seed(L + S)
    q, k, v = _rand((1, 4, L, 64), dtype, g), _rand((1, 4, S, 64), dtype, g), _rand((1, 4, S, 64), dtype, g)
    _run(q, k, v, dtype, is_causal=alignment, what=f"{dtype} causal={alignment} L={L} S={S}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("alignment", [True, "bottom_right"])
@pytest.mark.parametrize("L,S", [(600, 700), (1030, 1030), (1100, 900), (700, 1500)])
def test_causal_row_bands(dtype, alignment, L, S):
    # L ≥ 512: the cuBLAS split path cuts causal calls into row bands (split.cublas_causal_bands), each band's GEMMs
    # and softmax stopping at its last row's visible key; bottom-right with L > S has rows that see no key.
    g = torch.Generator("cuda").manual_seed(L + 2 * S)
    q, k, v = _rand((1, 3, L, 96), dtype, g), _rand((1, 3, S, 96), dtype, g), _rand((1, 3, S, 80), dtype, g)
    _run(q, k, v, dtype, is_causal=alignment, what=f"{dtype} causal={alignment} L={L} S={S}")


@pytest.mark.parametrize("alignment", [True, "bottom_right"])
def test_causal_row_bands_in_small_workspace_chunks(alignment, monkeypatch):
    # Bands inside budget-limited row chunks (rows_per_chunk = 300 < L: chunks of 300 rows, each cut into 4 bands).
    monkeypatch.setenv("CUPY_ATTN_WORKSPACE_BYTES", str(300 * 1024 * 4))  # 300 fp32 rows of 1024 keys
    g = torch.Generator("cuda").manual_seed(5)
    q, k, v = _rand((2, 2, 1100, 64), "float16", g), *(_rand((2, 2, 1024, 64), "float16", g) for _ in range(2))
    _run(q, k, v, "float16", is_causal=alignment, what=f"causal={alignment} bands in 300-row chunks")


@pytest.mark.parametrize("streams", [2, 3])
@pytest.mark.parametrize("alignment", [True, "bottom_right"])
@pytest.mark.parametrize("dtype,L,S,E,chunked", [("float16", 1030, 1024, 64, True), ("bfloat16", 900, 1100, 96, False),
                                                 ("float16", 512, 512, 320, False), ("bfloat16", 300, 400, 288, True)])
def test_causal_bands_on_streams(streams, alignment, dtype, L, S, E, chunked, monkeypatch):
    # Row bands on several streams at once (split.causal_streams), each band with its own scratch region. ``chunked``:
    # a workspace of two batch·heads of fp32 scores makes three batch chunks whose bands reuse their regions on the
    # same streams. Unchunked E > 256 calls with S <= 512 run the Hopper scores kernel on sm_90 (only P·V banded, on one
    # stream: causal_streams is not asked there).
    from cupy_attn.attention.paths import split
    from cupy_attn.runtime import callcache
    monkeypatch.setattr(split, "causal_streams", lambda L_, bands: streams)
    monkeypatch.setattr(split, "cublas_causal_bands", lambda L_: 4)
    monkeypatch.setattr(split, "causal_row_bands", lambda L_: 4)
    if chunked:
        monkeypatch.setenv("CUPY_ATTN_WORKSPACE_BYTES", str(2 * L * (-(-S // 8) * 8) * 4))
    split._SCHEDULES.clear()
    callcache.clear()
    g = torch.Generator("cuda").manual_seed(L + S + streams)
    q, k, v = _rand((2, 3, L, E), dtype, g), _rand((2, 3, S, E), dtype, g), _rand((2, 3, S, E), dtype, g)
    try:
        for _ in range(2):  # the second call replays the cached schedule
            _run(q, k, v, dtype, is_causal=alignment, what=f"{dtype} causal={alignment} L={L} S={S} {streams} streams")
    finally:
        split._SCHEDULES.clear()
        callcache.clear()


@pytest.mark.parametrize("H,Hkv", [(8, 2), (4, 1), (32, 8)])
def test_gqa(H, Hkv):
    g = torch.Generator("cuda").manual_seed(H)
    q, k, v = _rand((2, H, 70, 64), "float16", g), _rand((2, Hkv, 90, 64), "float16", g), _rand((2, Hkv, 90, 32),
                                                                                                 "float16", g)
    mask = torch.rand(2, 1, 70, 90, generator=g, device="cuda") > 0.2
    _run(q, k, v, "float16", enable_gqa=True, attn_mask=mask, what=f"gqa {H}/{Hkv}")


def test_bshd_views_read_in_place():
    g = torch.Generator("cuda").manual_seed(8)
    B, S, H, D = 2, 96, 4, 64
    q, k, v = (_rand((B, S, H, D), "float16", g).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    assert not cupy_attn.explain(q, k, v, backend="split").copies
    _run(q, k, v, "float16", what="BSHD")


def test_torch_and_cupy_inputs_agree_and_kinds_round_trip():
    import cupy
    g = torch.Generator("cuda").manual_seed(9)
    q, k, v = (_rand((2, 4, 100, 64), "bfloat16", g) for _ in range(3))
    out_t = cupy_attn.scaled_dot_product_attention(q, k, v)
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    out_c = cupy_attn.scaled_dot_product_attention(cq, ck, cv)
    assert isinstance(out_t, torch.Tensor) and out_t.dtype == torch.bfloat16
    assert isinstance(out_c, cupy.ndarray) and out_c.dtype.name == "bfloat16"
    assert torch.equal(out_t, torch.from_dlpack(out_c))


def test_runs_on_callers_torch_stream():
    g = torch.Generator("cuda").manual_seed(10)
    q, k, v = (_rand((4, 8, 256, 128), "float16", g) for _ in range(3))
    expected = cupy_attn.scaled_dot_product_attention(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q2 = q * 1  # produced on the side stream: ordering on it is what the test checks
        out = cupy_attn.scaled_dot_product_attention(q2, k, v)
        out2 = out.clone()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out2, expected)


def test_requires_grad_inputs_accepted():
    """Inputs that require grad are recorded by autograd (tests/test_sdpa_backward.py checks the gradients); under
    no_grad the forward-only path runs."""
    g = torch.Generator("cuda").manual_seed(12)
    q, k, v = (_rand((1, 2, 32, 64), "float32", g).requires_grad_() for _ in range(3))
    out = cupy_attn.scaled_dot_product_attention(q, k, v)
    assert out.requires_grad and out.grad_fn is not None and out.shape == (1, 2, 32, 64)
    with torch.no_grad():
        assert not cupy_attn.scaled_dot_product_attention(q, k, v).requires_grad


@pytest.mark.parametrize("workspace", [1 << 20, 64 << 10])
def test_chunking_by_heads_and_rows_gives_same_result(workspace):
    g = torch.Generator("cuda").manual_seed(13)
    q, k, v = _rand((2, 8, 300, 64), "float16", g), _rand((2, 8, 500, 64), "float16", g), _rand((2, 8, 500, 64),
                                                                                                "float16", g)
    mask = torch.rand(2, 1, 300, 500, generator=g, device="cuda") > 0.3
    whole = cupy_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    chunked = cupy_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, workspace_bytes=workspace)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=0)


def test_long_rows_use_the_looping_softmax():
    g = torch.Generator("cuda").manual_seed(14)
    q, k, v = _rand((1, 2, 5, 32), "float16", g), _rand((1, 2, 20000, 32), "float16", g), _rand((1, 2, 20000, 32),
                                                                                                "float16", g)
    mask = torch.rand(1, 1, 5, 20000, generator=g, device="cuda") > 0.5
    _run(q, k, v, "float16", attn_mask=mask, what="S=20000")


@pytest.mark.parametrize("dtype", ["float32", "float16"])  # float16: the auto path is the fused kernel
def test_nan_propagates_and_empty_shapes(dtype):
    g = torch.Generator("cuda").manual_seed(15)
    q, k, v = (_rand((1, 2, 8, 16), dtype, g) for _ in range(3))
    k[0, 1, 3, 0] = float("nan")
    out = cupy_attn.scaled_dot_product_attention(q, k, v)
    assert torch.isnan(out[0, 1]).all() and not torch.isnan(out[0, 0]).any()
    empty_l = cupy_attn.scaled_dot_product_attention(q[:, :, :0], k, v)
    assert empty_l.shape == (1, 2, 0, 16)
    out, lse = cupy_attn.scaled_dot_product_attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_fp32_is_exact_fp32_by_default():
    """fp32 must not silently use TF32: its error stays near fp32 rounding, far below TF32's ~1e-3 (the default GEMM
    is the 3xTF32 kernel, tests/test_gemm_3xtf32.py; TF32 only with allow_tf32)."""
    g = torch.Generator("cuda").manual_seed(16)
    q, k, v = (_rand((1, 4, 256, 256), "float32", g) for _ in range(3))
    assert "3xTF32" in cupy_attn.explain(q, k, v).details["GEMMs"]
    assert "FAST_TF32" in cupy_attn.explain(q, k, v, allow_tf32=True).details["GEMMs"]
    ref = reference.scaled_dot_product_attention(as_f64(q), as_f64(k), as_f64(v))
    err = np.abs(as_f64(cupy_attn.scaled_dot_product_attention(q, k, v)) - ref).max()
    assert err < 1e-5, err
    err_tf32 = np.abs(as_f64(cupy_attn.scaled_dot_product_attention(q, k, v, allow_tf32=True)) - ref).max()
    assert 1e-5 < err_tf32 < 64 * 2.0 ** -11, err_tf32


def test_fp32_strided_gqa_chunked():
    g = torch.Generator("cuda").manual_seed(18)
    B, S, D = 2, 150, 40
    q = _rand((B, 97, 8, D), "float32", g).transpose(1, 2)
    k, v = (_rand((B, S, 2, D), "float32", g).transpose(1, 2) for _ in range(2))
    mask = torch.rand(B, 1, 97, S, generator=g, device="cuda") > 0.3
    _run(q, k, v, "float32", enable_gqa=True, attn_mask=mask, what="fp32 strided gqa")
    _run(q, k, v, "float32", enable_gqa=True, attn_mask=mask, workspace_bytes=64 << 10, what="fp32 chunked")


def test_reference_backend_on_gpu_inputs():
    g = torch.Generator("cuda").manual_seed(17)
    q, k, v = (_rand((1, 2, 16, 8), "float16", g) for _ in range(3))
    out = cupy_attn.scaled_dot_product_attention(q, k, v, backend="reference")
    assert out.is_cuda and out.dtype == torch.float16
    assert_close(out, reference.scaled_dot_product_attention(as_f64(q), as_f64(k), as_f64(v)), "float16")


def test_generic_dlpack_objects_come_back_as_cupy():
    import cupy

    class Capsule:  # any CUDA array exposing only the DLPack protocol (as JAX or TensorFlow arrays do)
        def __init__(self, t):
            self.t, self.shape = t, tuple(t.shape)

        def __dlpack__(self, stream=None, **kwargs):
            return self.t.__dlpack__(stream=stream, **kwargs)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    g = torch.Generator("cuda").manual_seed(19)
    q, k, v = (_rand((2, 3, 40, 32), "float16", g) for _ in range(3))
    out = cupy_attn.scaled_dot_product_attention(Capsule(q), Capsule(k), Capsule(v))
    assert isinstance(out, cupy.ndarray)
    assert torch.equal(torch.from_dlpack(out), cupy_attn.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("backend,E", [("auto", 64), ("split", 64), ("auto", 1000)])
def test_call_cache_replays_on_new_data(backend, E):
    """A repeated call (same layout, flags, stream) replays the prepared launch; it must equal a full-path call."""
    from cupy_attn.runtime import callcache as _callcache
    g = torch.Generator("cuda").manual_seed(21)
    mask = torch.rand(2, 1, 1, 77, generator=g, device="cuda") > 0.2
    for kw in ({}, {"attn_mask": mask, "return_lse": True}, {"is_causal": True, "scale": 0.3}):
        _callcache.clear()
        q, k, v = _rand((2, 4, 100, E), "float16", g), _rand((2, 4, 77, E), "float16", g), _rand((2, 4, 77, E),
                                                                                                  "float16", g)
        cupy_attn.scaled_dot_product_attention(q, k, v, backend=backend, **kw)  # full path: fills the cache
        assert len(_callcache._CACHE) == 1
        q2, k2, v2 = (x.clone().normal_(generator=g) for x in (q, k, v))
        replayed = cupy_attn.scaled_dot_product_attention(q2, k2, v2, backend=backend, **kw)
        assert len(_callcache._CACHE) == 1
        _callcache.clear()
        fresh = cupy_attn.scaled_dot_product_attention(q2, k2, v2, backend=backend, **kw)
        for a, b in zip(*((r,) if isinstance(r, torch.Tensor) else r for r in (replayed, fresh))):
            assert torch.equal(a, b), kw
        _run(q2, k2, v2, "float16", backend=backend, what=f"replayed {kw}",
             **{k_: v_ for k_, v_ in kw.items() if k_ != "return_lse"})


def test_call_cache_keys_on_layout_stream_and_environment(monkeypatch):
    from cupy_attn.runtime import callcache as _callcache
    _callcache.clear()
    g = torch.Generator("cuda").manual_seed(22)
    q, k, v = (_rand((1, 2, 64, 64), "float16", g) for _ in range(3))
    cupy_attn.scaled_dot_product_attention(q, k, v)
    cupy_attn.scaled_dot_product_attention(q[:, :1], k[:, :1], v[:, :1])   # another shape
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        cupy_attn.scaled_dot_product_attention(q, k, v)                     # another stream
    torch.cuda.synchronize()
    monkeypatch.setenv("CUPY_ATTN_BACKEND", "split")
    assert cupy_attn.explain(q, k, v).backend == "split"
    cupy_attn.scaled_dot_product_attention(q, k, v)                         # another plan
    assert len(_callcache._CACHE) == 4
    # A call that had to copy an input (last axis not unit-stride) is never cached: its launch read the copy.
    _callcache.clear()
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    out = cupy_attn.scaled_dot_product_attention(qt, k, v)
    assert not _callcache._CACHE
    assert torch.equal(out, cupy_attn.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("backend", ["auto", "split"])
def test_call_cache_cupy_inputs(backend):
    """CuPy callers are cached too (CuPy's current stream, outputs from CuPy's pool); replays equal full-path calls."""
    import cupy
    from cupy_attn.runtime import callcache as _callcache
    rng = cupy.random.default_rng(23)
    mask = rng.random((2, 1, 1, 77)) > 0.2
    for kw in ({}, {"attn_mask": mask, "return_lse": True}):
        _callcache.clear()
        shapes = ((2, 4, 100, 64), (2, 4, 77, 64), (2, 4, 77, 64))
        cupy_attn.scaled_dot_product_attention(*(rng.standard_normal(s, dtype=cupy.float32).astype(cupy.float16)
                                                 for s in shapes), backend=backend, **kw)
        assert len(_callcache._CACHE) == 1
        q, k, v = (rng.standard_normal(s, dtype=cupy.float32).astype(cupy.float16) for s in shapes)
        replayed = cupy_attn.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
        assert len(_callcache._CACHE) == 1
        _callcache.clear()
        fresh = cupy_attn.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
        for a, b in zip(*((r,) if isinstance(r, cupy.ndarray) else r for r in (replayed, fresh))):
            assert isinstance(a, cupy.ndarray) and bool(cupy.array_equal(a, b)), kw


def test_cupy_and_torch_mixed_are_refused():
    import cupy
    g = torch.Generator("cuda").manual_seed(23)
    q, k, v = (_rand((1, 2, 16, 32), "float16", g) for _ in range(3))
    with pytest.raises(TypeError, match="key is a cupy.ndarray but query is a torch.Tensor: pass one kind of array"):
        cupy_attn.scaled_dot_product_attention(q, cupy.from_dlpack(k), v)
    with pytest.raises(TypeError, match="query is a torch.Tensor"):
        cupy_attn.scaled_dot_product_attention(q, k, v, attn_mask=cupy.ones((16, 16), dtype=cupy.bool_))
    with pytest.raises(ValueError, match="value is on CPU but query is not"):
        cupy_attn.scaled_dot_product_attention(q, k, v.cpu())
