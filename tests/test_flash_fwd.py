"""The fused FlashAttention-2 kernel (cupy_attn.attention.kernels.flash_fwd) called through its launcher, against the
float64 reference.

GPU tests poison out and lse with NaN, run the launch dispatch.fused_launch builds (the plan's rules, the FA3-design
kernel off: CUPY_ATTN_FA3=0) on CuPy views of torch tensors (zero-copy, strides kept),
and accept an error of at most twice torch's own SDPA error in the same precision plus output rounding noise
(tests/_helpers/_tolerance.py). CPU tests: every instantiation compiles for sm_80 and sm_90 without spills, the tile table is
consistent with the declared family and with each arch's shared-memory limit, and reason's answers.
Every GPU test runs twice, once per kernel on Hopper (``flash_kernel``: the sm_90a wgmma kernel, then the mma.sync one
forced by CUPY_ATTN_WGMMA=0), so both stay correct for every head-dim bucket they serve.
"""
import numpy as np
import pytest

from cupy_attn import reference
from cupy_attn.attention import dispatch
from cupy_attn.attention.kernels import flash_fwd as _flash
from cupy_attn.runtime import compile_check
from cupy_attn.runtime.kernel_abi import C_TYPE_16

from _compile_checks import wgmma_gen as _wgmma_gen
from _tolerance import as_f64, assert_close


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("gpu"):
        metafunc.parametrize("flash_kernel", ["wgmma", "mma.sync"], indirect=True)


@pytest.fixture(autouse=True)
def flash_kernel(request, monkeypatch):
    """GPU tests: which kernel serves the wgmma buckets (64, 128, 192, 256) on Hopper (the FA3-design kernel off, which
    tests/test_flash_fwd_sm90.py covers); CPU tests: unparametrized."""
    kind = getattr(request, "param", None)
    if kind is not None:
        monkeypatch.setenv("CUPY_ATTN_FA3", "0")
    if kind == "mma.sync":
        monkeypatch.setenv(_flash.ENV_WGMMA, "0")
    elif kind == "wgmma":
        monkeypatch.delenv(_flash.ENV_WGMMA, raising=False)
    return kind

# ---------------------------------------------------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("arch", _flash.FLASH_FWD.archs)
def test_every_instantiation_compiles_without_spills(arch):
    reports = compile_check.compile_family(_flash.FLASH_FWD, arch)
    assert len(reports) == len(list(_flash.FLASH_FWD.variants())) == 52
    assert all(r.registers is not None and r.registers <= 255 for r in reports)
    spilled = [(r.name_expression, r.spill_bytes) for r in reports if r.spill_bytes]
    assert not spilled, f"register spills: {spilled}"


def test_sm90a_instantiations_compile_without_spills():
    reports = compile_check.compile_family(_flash.FLASH_FWD_SM90A, "sm_90a")
    assert len(reports) == len(list(_flash.FLASH_FWD_SM90A.variants())) == 2 * 2 * len(_flash.WGMMA_TILES)
    assert all(r.registers is not None and r.registers <= 255 for r in reports)
    spilled = [(r.name_expression, r.spill_bytes) for r in reports if r.spill_bytes]
    assert not spilled, f"register spills: {spilled}"
    # C7514: ptxas serialized the wgmmas (e.g. a barrier or an accumulator read between a wgmma and its wait),
    # which silently removes the overlap the kernel is built around.
    serialized = [(r.name_expression, r.perf_warnings) for r in reports if r.perf_warnings]
    assert not serialized, f"ptxas performance warnings: {serialized}"


def test_wgmma_header_is_generated():
    gen = _wgmma_gen()
    assert gen.header_path().read_text() == gen.generate(), \
        "cuda_src/common/wgmma.cuh is stale: run python tools/wgmma_gen.py"


def test_wgmma_tiles():
    declared = set(_flash.FLASH_FWD_SM90A.name_expressions())
    for d, tile in _flash.WGMMA_TILES.items():
        assert tile.wgmma and d % 64 == 0 and d in _flash.HEAD_DIMS
        assert tile.block_m == 16 * tile.warps and tile.warps % 4 == 0 and tile.stages == 2
        assert d in _wgmma_n("RS_N") and tile.block_n in _wgmma_n("SS_N")
        assert tile.smem_bytes(d) <= _SMEM_LIMIT[9], (d, tile)
        for dtype in C_TYPE_16.values():
            for has_mask in ("false", "true"):
                assert _flash.FLASH_FWD_SM90A.name_expression(dtype=dtype, head_dim=d, tile=tile,
                                                              has_mask=has_mask) in declared


def _wgmma_n(name):
    return getattr(_wgmma_gen(), name)


@pytest.mark.parametrize("arch,bucket,family,head_dim", [
    (90, 128, "flash_fwd_sm90a", 128), (90, 96, "flash_fwd", 96), (90, 160, "flash_fwd_sm90a", 192),
    (90, 32, "flash_fwd", 32), (80, 128, "flash_fwd", 128), (80, 160, "flash_fwd", 160), (100, 64, "flash_fwd", 64)])
def test_select(arch, bucket, family, head_dim):
    got = _flash.select(F16, bucket, arch)
    assert (got[0].name, got[2]) == (family, head_dim)


def test_select_env_off(monkeypatch):
    monkeypatch.setenv(_flash.ENV_WGMMA, "0")
    assert _flash.select(F16, 128, 90)[0].name == "flash_fwd"


# Largest dynamic shared memory per block: sm_86/sm_89 (the smallest sm_8x) and sm_90.
_SMEM_LIMIT = {8: 101376, 9: 232448}


def test_tile_table_is_the_declared_table():
    declared = set(_flash.FLASH_FWD.name_expressions())
    for (dtype, d, arch), tile in _flash.TILES.items():
        assert tile.smem_bytes(d) <= _SMEM_LIMIT[arch], (dtype, d, arch, tile)
        assert tile.block_m % (16 * tile.warps) == 0
        for has_mask in ("false", "true"):
            expr = _flash.FLASH_FWD.name_expression(dtype=C_TYPE_16[dtype], head_dim=d, tile=tile,
                                                    has_mask=has_mask)
            assert expr in declared
    assert {d for _, d, _ in _flash.TILES} == set(_flash.HEAD_DIMS)


F16, F32 = np.dtype("float16"), np.dtype("float32")


def _bf16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("args,expect", [
    ((F16, 128, 128, "none", 90), None),
    ((F16, 64, 64, "bool", 80), None),
    ((F16, 1, 1, "float", 86), None),
    ((F16, 192, 128, "none", 89), None),
    ((F16, 256, 256, "float", 90), None),
    ((F32, 64, 64, "none", 90), "fp32 is served by the split path"),
    ((F16, 257, 64, "none", 90), "up to 256"),
    ((F16, 64, 300, "none", 90), "up to 256"),
    ((F16, 64, 64, "none", 75), "sm_75"),
    ((np.dtype("float64"), 64, 64, "none", 90), "fp16 and bf16 only"),
])
def test_unsupported_reason(args, expect):
    got = _flash.reason(_kind(*args[:4]), args[4])
    assert got is None if expect is None else expect in got


def _kind(dtype, E, Ev, mask_kind="none"):
    """What reason() reads of a problem."""
    import types
    return types.SimpleNamespace(dtype=dtype, head_dim=E, head_dim_v=Ev, mask_kind=mask_kind)


def test_unsupported_reason_bf16():
    assert _flash.reason(_kind(_bf16(), 128, 128, "bool"), 90) is None


@pytest.mark.parametrize("E,Ev,bucket", [(1, 1, 32), (32, 32, 32), (40, 40, 64), (64, 128, 128), (192, 128, 192),
                                         (200, 8, 256), (256, 256, 256), (257, 1, None)])
def test_head_dim_bucket(E, Ev, bucket):
    assert _flash.head_dim_bucket(E, Ev) == bucket


# ---------------------------------------------------------------------------------------------------------------------
# GPU

DTYPES = ("float16", "bfloat16")


def _torch():
    return pytest.importorskip("torch")


def _rand(shape, dtype, gen, scale=1.0):
    torch = _torch()
    x = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * scale
    return x.to(getattr(torch, dtype))


def _cp(x):
    import cupy
    if x.dtype == _torch().bool:  # via uint8: DLPack bool support differs between versions
        return cupy.from_dlpack(x.to(_torch().uint8)).view(cupy.bool_)
    return cupy.from_dlpack(x)


def _check(q, k, v, dtype, *, causal=None, mask=None, scale=None, what=""):
    """Run flash_forward (the fused launch) on poisoned outputs; compare out and lse with the float64 reference."""
    import cupy
    torch = _torch()
    F = torch.nn.functional
    B, Hq, L, E = q.shape
    S, Ev = v.shape[-2], v.shape[-1]
    scale = E ** -0.5 if scale is None else scale
    np_mask = None if mask is None else (mask.cpu().numpy() if mask.dtype == torch.bool else as_f64(mask))
    ref, ref_lse = reference.scaled_dot_product_attention(
        as_f64(q), as_f64(k), as_f64(v), np_mask, is_causal=causal or False, scale=scale, enable_gqa=True,
        return_lse=True)
    out = cupy.full((B, Hq, L, Ev), np.nan, dtype=_cp(q).dtype)
    lse = cupy.full((B, Hq, L), np.nan, dtype=cupy.float32)
    cmask = None if mask is None else cupy.broadcast_to(_cp(mask), (B, Hq, L, S))
    flash_forward(_cp(q), _cp(k), _cp(v), out, lse, scale=scale, causal=causal, mask=cmask)

    tmask = mask if mask is None or mask.dtype == torch.bool else mask.to(q.dtype)
    if causal == "bottom_right" or (causal and mask is not None):
        keep = torch.ones(L, S, dtype=torch.bool, device="cuda").tril(S - L if causal == "bottom_right" else 0)
        tmask = keep if tmask is None else (keep & tmask if tmask.dtype == torch.bool
                                            else tmask.masked_fill(~keep, float("-inf")))
    torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=tmask, scale=scale, enable_gqa=Hq != k.shape[1],
                                               is_causal=causal == "top_left" and mask is None)
    assert_out_lse(out, lse, ref, ref_lse, dtype, torch_out, what)
    return out


def flash_forward(q, k, v, out, lse=None, **kw):
    """out (and lse) = attention(q, k, v) by the fused kernel the plan's rules choose (dispatch.fused_launch), launched
    on the arrays' own pointers on CuPy's current stream."""
    mask = kw.get("mask")
    dispatch.fused_launch(q, k, v, out, lse, **kw)(
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, 0 if lse is None else lse.data.ptr,
        0 if mask is None else mask.data.ptr)


def assert_out_lse(out, lse, ref, ref_lse, dtype, torch_out, what):
    """out within the tolerance rule (tests/_helpers/_tolerance.py) of the float64 reference; lse close where the reference is
    finite, and -inf for rows whose keys are all masked."""
    assert_close(out, ref, dtype, torch_out, what)
    got_lse = as_f64(lse)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(got_lse[finite], ref_lse[finite], rtol=1e-4, atol=2e-3, err_msg=what)
    assert np.all(got_lse[~finite] == -np.inf), f"{what}: lse of fully masked rows must be -inf"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", list(_flash.HEAD_DIMS) + [1, 8, 40, 80, 200])
def test_head_dims(dtype, E):
    """Every instantiated bucket, and odd E served by padding (E=1: rows not 16-byte aligned, plain-load path)."""
    g = _torch().Generator("cuda").manual_seed(E)
    q, k, v = _rand((2, 3, 113, E), dtype, g), _rand((2, 3, 203, E), dtype, g), _rand((2, 3, 203, E), dtype, g)
    _check(q, k, v, dtype, what=f"{dtype} E={E}")


LS = [(1, 1), (1, 4097), (113, 203), (128, 128), (239, 1), (1023, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,S", LS)
@pytest.mark.parametrize("E", [64, 128])
def test_seqlens(dtype, L, S, E):
    g = _torch().Generator("cuda").manual_seed(L * 7 + S)
    q, k, v = _rand((1, 2, L, E), dtype, g), _rand((1, 2, S, E), dtype, g), _rand((1, 2, S, E), dtype, g)
    _check(q, k, v, dtype, what=f"{dtype} L={L} S={S} E={E}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,E,causal", [("float16", 128, None), ("bfloat16", 64, "top_left"),
                                            ("float16", 256, "bottom_right")])
def test_long_sequence(dtype, E, causal):
    g = _torch().Generator("cuda").manual_seed(4224)
    q, k, v = (_rand((1, 1, 4224, E), dtype, g) for _ in range(3))
    _check(q, k, v, dtype, causal=causal, what=f"{dtype} 4224² E={E} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("E,Ev", [(192, 128), (64, 128), (40, 72), (128, 32), (256, 8), (96, 160)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_value_head_dim_differs(dtype, E, Ev):
    g = _torch().Generator("cuda").manual_seed(E * Ev)
    q, k, v = _rand((2, 2, 150, E), dtype, g), _rand((2, 2, 170, E), dtype, g), _rand((2, 2, 170, Ev), dtype, g)
    _check(q, k, v, dtype, what=f"{dtype} E={E} Ev={Ev}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L,S,E", [(100, 300, 64), (257, 257, 128), (300, 100, 64), (1, 200, 128), (200, 1, 32),
                                   (700, 500, 96)])
def test_causal(dtype, causal, L, S, E):
    g = _torch().Generator("cuda").manual_seed(L + S)
    q, k, v = _rand((1, 3, L, E), dtype, g), _rand((1, 3, S, E), dtype, g), _rand((1, 3, S, E), dtype, g)
    _check(q, k, v, dtype, causal=causal, what=f"{dtype} {causal} L={L} S={S}")


def _masks(torch):
    return {
        "bool_key_padding": lambda B, H, L, S, g: torch.rand(B, 1, 1, S, generator=g, device="cuda") > 0.3,
        # The usual padding mask, a prefix of each sequence (the kernel turns it into a shorter S); lengths 0, 1, a
        # tile boundary ± 1 and S.
        "bool_key_padding_prefix": lambda B, H, L, S, g: (
            torch.arange(S, device="cuda") < torch.tensor([65, 0, 1, 64, S, 63, S // 2, 129], device="cuda")[:B, None]
        )[:, None, None, :],
        "bool_full": lambda B, H, L, S, g: torch.rand(B, H, L, S, generator=g, device="cuda") > 0.5,
        "bool_LS_with_empty_rows": lambda B, H, L, S, g: (torch.rand(L, S, generator=g, device="cuda") > 0.5)
        & (torch.arange(L, device="cuda") % 7 != 3)[:, None],
        "float_HLS": lambda B, H, L, S, g: torch.randn(H, L, S, generator=g, device="cuda"),
        "float_neg_inf": lambda B, H, L, S, g: torch.where(torch.rand(B, 1, L, S, generator=g, device="cuda") > 0.6,
                                                           0.0, float("-inf")),
        "float_row_broadcast": lambda B, H, L, S, g: torch.randn(B, H, L, 1, generator=g, device="cuda"),
    }


MASK_NAMES = ["bool_key_padding", "bool_key_padding_prefix", "bool_full", "bool_LS_with_empty_rows", "float_HLS", "float_neg_inf",
              "float_row_broadcast"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASK_NAMES)
@pytest.mark.parametrize("mask_dtype", [None, "float32"])
@pytest.mark.parametrize("E", [80, 128])
def test_masks(dtype, mask_name, mask_dtype, E):
    """Broadcast masks by strides; float masks in the input dtype and in fp32. E=80 (bucket 96): mma.sync only;
    E=128: the wgmma kernel on Hopper."""
    torch = _torch()
    if mask_dtype and mask_name.startswith("bool"):
        pytest.skip("bool masks have one dtype")
    g = torch.Generator("cuda").manual_seed(5)
    B, H, L, S = 2, 3, 167, 131
    q, k, v = _rand((B, H, L, E), dtype, g), _rand((B, H, S, E), dtype, g), _rand((B, H, S, 48), dtype, g)
    mask = _masks(torch)[mask_name](B, H, L, S, g)
    if mask.dtype != torch.bool:
        mask = mask.to(getattr(torch, mask_dtype or dtype))
    _check(q, k, v, dtype, mask=mask, what=f"{dtype} {mask_name} {mask_dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_mask_and_causal(causal):
    torch = _torch()
    g = torch.Generator("cuda").manual_seed(9)
    q, k, v = _rand((2, 2, 190, 128), "float16", g), _rand((2, 2, 260, 128), "float16", g), _rand(
        (2, 2, 260, 128), "float16", g)
    mask = torch.rand(2, 1, 1, 260, generator=g, device="cuda") > 0.3
    _check(q, k, v, "float16", causal=causal, mask=mask, what=f"keypad + {causal}")


@pytest.mark.gpu
def test_fully_masked_rows_give_zero_not_nan():
    torch = _torch()
    g = torch.Generator("cuda").manual_seed(6)
    q, k, v = (_rand((2, 2, 16, 32), "float16", g) for _ in range(3))
    mask = torch.ones(2, 2, 16, 16, dtype=torch.bool, device="cuda")
    mask[0, 1, 3] = False
    mask[1] = False
    out = _check(q, k, v, "float16", mask=mask, what="fully masked")
    assert bool((out[1] == 0).all()) and bool((out[0, 1, 3] == 0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv", [(32, 8), (8, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa(dtype, H, Hkv):
    g = _torch().Generator("cuda").manual_seed(H)
    q, k, v = _rand((2, H, 70, 64), dtype, g), _rand((2, Hkv, 90, 64), dtype, g), _rand((2, Hkv, 90, 64), dtype, g)
    _check(q, k, v, dtype, what=f"gqa {H}/{Hkv}")
    mask = _torch().rand(2, 1, 70, 90, generator=g, device="cuda") > 0.2
    _check(q, k, v, dtype, mask=mask, causal="bottom_right", what=f"gqa {H}/{Hkv} masked causal")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_bshd_views_read_in_place(dtype):
    g = _torch().Generator("cuda").manual_seed(8)
    B, L, S, H, D = 2, 150, 96, 4, 64
    q = _rand((B, L, H, D), dtype, g).transpose(1, 2)
    k, v = (_rand((B, S, H, D), dtype, g).transpose(1, 2) for _ in range(2))
    assert not q.is_contiguous() and _cp(q).strides[1] == D * 2
    _check(q, k, v, dtype, causal="top_left", what="BSHD")


@pytest.mark.gpu
def test_unaligned_strides_use_plain_loads():
    """Row strides that are not multiples of 8 elements (a sliced last axis) cannot use 16-byte cp.async."""
    g = _torch().Generator("cuda").manual_seed(12)
    base = _rand((1, 2, 300, 75), "float16", g)
    q, k, v = base[..., :70], base[:, :, :250, 1:71], base[:, :, 20:270, 2:72]
    _check(q, k, v, "float16", causal="top_left", what="unaligned")


@pytest.mark.gpu
def test_large_magnitude_scores():
    g = _torch().Generator("cuda").manual_seed(11)
    q, k, v = _rand((2, 4, 128, 64), "float16", g, 3.0), _rand((2, 4, 256, 64), "float16", g, 3.0), _rand(
        (2, 4, 256, 64), "float16", g)
    _check(q, k, v, "float16", what="large scores")


@pytest.mark.gpu
def test_rejects_what_it_cannot_run():
    import cupy
    q = cupy.zeros((1, 1, 4, 300), dtype=cupy.float16)
    with pytest.raises(ValueError, match="up to 256"):
        flash_forward(q, q, q, cupy.empty_like(q), scale=1.0)
    q = cupy.zeros((1, 1, 4, 64), dtype=cupy.float32)
    with pytest.raises(ValueError, match="split path"):
        flash_forward(q, q, q, cupy.empty_like(q), scale=1.0)
