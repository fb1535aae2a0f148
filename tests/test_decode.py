"""The split-KV decode kernel (cupy_attn.attention.decode): compile checks, the split rule, dispatch, num_splits
validation (CPU); against the float64 reference with torch's error as the yardstick (GPU, tests/_tolerance.py).

GPU tests poison out and lse with NaN, run decode_forward on CuPy views of torch tensors (strides kept) with every
forced split count, and check lse; a few run through scaled_dot_product_attention (auto dispatch, num_splits).
"""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference
from cupy_attn.attention import checks as _checks, decode as _decode, dispatch as _dispatch
from cupy_attn.runtime import compile as _compile, interop as _interop

from _tolerance import as_f64, assert_close

# ---------------------------------------------------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("arch", _decode.FLASH_DECODE.archs)
@pytest.mark.parametrize("family", [_decode.FLASH_DECODE, _decode.FLASH_DECODE_COMBINE], ids=lambda f: f.name)
def test_every_instantiation_compiles_without_spills(family, arch):
    reports = _compile.compile_family(family, arch)
    assert len(reports) == len(list(family.variants())) == len(set(family.name_expressions()))
    assert all(r.registers is not None and r.registers <= 255 for r in reports)
    spilled = [(r.name_expression, r.spill_bytes) for r in reports if r.spill_bytes]
    assert not spilled, f"register spills: {spilled}"


def test_params_dtype_is_parsed_from_the_kernel_source():
    names = _decode._PARAMS.names
    assert names[:8] == ("out", "lse", "q", "k", "v", "mask", "o_part", "lse_part")
    assert names[-1] == "mask_stride_s" and _decode._PARAMS.itemsize == 8 * len(names)
    assert _decode._PARAMS["scale_log2"] == np.float64
    assert _decode.FLASH_DECODE.structs == (("cupy_attn::FlashDecodeParams", _decode._PARAMS),)


def test_family_module_is_in_the_compile_check():
    assert _decode.FLASH_DECODE in _compile.all_families()


# Largest dynamic shared memory per block: sm_86/sm_89 (the smallest sm_8x) and sm_90.
_SMEM_LIMIT = {8: 101376, 9: 232448}


def test_tile_table():
    declared = set(_decode.FLASH_DECODE.name_expressions())
    assert {d for d, _ in _decode.DECODE_TILES} == set(_decode.HEAD_DIMS)
    for (d, arch), tile in _decode.DECODE_TILES.items():
        assert tile.smem_bytes(d) <= _SMEM_LIMIT[arch], (d, arch, tile)
        assert tile.ctas_per_sm * tile.smem_bytes(d) <= {8: 167936, 9: 233472}[arch], (d, arch, tile)
        assert (tile.block_n // tile.warps) % 16 == 0 and tile.stages >= 2
        for dtype in _decode._C_TYPES.values():
            for has_mask in ("false", "true"):
                assert _decode.FLASH_DECODE.name_expression(dtype=dtype, head_dim=d, tile=tile,
                                                            has_mask=has_mask) in declared


@pytest.mark.parametrize("ctas,S,sms,per_sm,expected", [
    (2048, 4096, 132, 2, 1),     # (64, 32 heads, L=1): 8 waves already
    (256, 32768, 132, 2, 1),     # (8, 32): 0.97 of a wave
    (64, 32768, 132, 2, 4),      # (8, 32 q / 8 kv): 4 splits of 8192 keys fill 256 of 264 slots
    (128, 8192, 132, 2, 2),      # (16, 64 q / 8 kv)
    (8, 4096, 132, 2, 7),        # at most S // 512 = 8 splits; 7 is within 0.85 of 8's efficiency
    (8, 600, 132, 2, 1),         # S // 512 = 1: one split
    (1, 65536, 132, 2, 109),     # tiny batch, long S: 109 of 128 allowed splits (0.413 ≥ 0.85 · 0.485)
    (64, 100, 132, 2, 1),        # short S: never below 512 keys per split
    (212, 8192, 132, 2, 1),      # ≥ 0.8 of the 264 slots (211.2)
    (100, 8192, 108, 1, 1),      # A100, 1 CTA/SM: 0.93 of a wave
])
def test_num_splits_rule(ctas, S, sms, per_sm, expected):
    assert _decode.num_splits_for(ctas, S, sms, per_sm) == expected


def test_num_splits_rule_bounds():
    for ctas in (1, 3, 8, 33, 64, 100, 131, 263, 1000):
        for S in (1, 255, 512, 4096, 100000, 10 ** 6):
            n = _decode.num_splits_for(ctas, S, 132, 2)
            assert 1 <= n <= max(1, min(_decode.MAX_SPLITS, S // 512)), (ctas, S, n)


@pytest.mark.parametrize("B,Hq,Hkv,S,splits", [
    (64, 32, 32, 4096, 1), (8, 32, 32, 32768, 1), (8, 32, 8, 32768, 2), (16, 64, 8, 8192, 1)])
def test_auto_splits_count_waves_per_sm(B, Hq, Hkv, S, splits):
    # The decode shapes on an H200 (132 SMs), D = 128, L = 1: the measured best split counts.
    assert _decode.split_plan(B, Hkv, 1, Hq // Hkv, S, 128, 90, 132)[0] == splits


@pytest.mark.parametrize("S,requested,splits,chunk", [
    (100, 16, 2, 64), (100, 1, 1, 128), (4096, 7, 7, 640), (4096, 3, 3, 1408), (1, 16, 1, 64), (65536, 16, 16, 4096),
    (65, 2, 2, 64), (64, 2, 1, 64)])
def test_split_plan_honours_requests_up_to_one_tile(S, requested, splits, chunk):
    # head dim 128 on Hopper: 64-key tiles
    assert _decode.split_plan(2, 8, 1, 4, S, 128, 90, 132, requested) == (splits, chunk)


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True, 2.0, [2]])
def test_num_splits_validation(value):
    q = np.zeros((1, 2, 1, 8), np.float32)
    with pytest.raises(ValueError, match="num_splits"):
        cupy_attn.scaled_dot_product_attention(q, q, q, num_splits=value)
    with pytest.raises(ValueError, match="num_splits"):
        cupy_attn.explain(q, q, q, num_splits=value)


def test_num_splits_accepted_on_the_cpu_path():
    q = np.random.default_rng(0).standard_normal((1, 2, 1, 8)).astype(np.float32)
    out = cupy_attn.scaled_dot_product_attention(q, q, q, num_splits=3)
    np.testing.assert_allclose(out, reference.scaled_dot_product_attention(q, q, q), rtol=1e-6)


def test_call_cache_key_includes_num_splits_and_env():
    from cupy_attn.runtime import callcache as _callcache
    assert "CUPY_ATTN_DECODE" in _callcache.ENV_KEYS
    import inspect
    assert list(inspect.signature(_callcache.key).parameters)[-1] == "num_splits"


def _problem(dtype="float16", E=128, Ev=128, mask_kind="none", B=8, H=32, Hkv=8, L=1, S=32768, causal=None):
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    ctx = _interop.CallContext(_interop.CUPY, 0)
    return _checks.SDPAProblem(ctx=ctx, query=None, key=None, value=None, batch_shape=(B, H), batch=B, num_heads=H,
                               num_kv_heads=Hkv, seqlen_q=L, seqlen_k=S, head_dim=E, head_dim_v=Ev, dtype=dt,
                               scale=0.1, causal=causal, mask_kind=mask_kind)


@pytest.mark.parametrize("kw,expected,splits", [
    (dict(), "decode", 2),                                   # GQA decode, 64 CTAs → 2 splits (waves per SM)
    (dict(B=64, H=32, Hkv=32, S=4096), "decode", 1),         # 2048 CTAs: one split
    (dict(B=16, H=64, Hkv=8, S=8192), "decode", 1),          # 128 CTAs: 0.97 of the SMs
    (dict(dtype="bfloat16", L=7, H=32, Hkv=8, mask_kind="bool"), "decode", None),  # 28 packed rows
    (dict(L=2, H=64, Hkv=8, E=64, Ev=64, causal="bottom_right"), "decode", None),
    (dict(L=17, H=8, Hkv=8), "fused", None),                  # L > 16
    (dict(L=16, H=32, Hkv=8), "decode", None),               # 16 · 4 = 64 packed rows: the limit
    (dict(L=9, H=64, Hkv=8), "fused", None),                  # 72 packed rows > 64
    (dict(S=255), "fused", None),                             # short S: launch-bound
    (dict(dtype="float32"), "split", None),                   # fp32: split path
    (dict(E=320, Ev=320), "split", None),                     # head dim > 256
])
def test_decode_dispatch(kw, expected, splits, monkeypatch):
    monkeypatch.setenv("CUPY_ATTN_FA3", "0")  # the problems here have no arrays for the FA3 kernel's layout checks
    p = _problem(**kw)
    plan = _dispatch.plan_sdpa(p, "auto", arch=90, num_sms=132)
    assert plan.backend == expected, str(plan)
    if expected == "decode":
        assert plan.reason.startswith(f"decode (split-KV, {plan.num_splits} splits)"), plan.reason
        assert "splits" in plan.details and plan.details["kernel"] == "flash_decode"
        if splits is not None:
            assert plan.num_splits == splits, str(plan)


def test_decode_dispatch_env_off_and_forced_splits(monkeypatch):
    monkeypatch.setenv("CUPY_ATTN_FA3", "0")  # the problems here have no arrays for the FA3 kernel's layout checks
    p = _problem()
    monkeypatch.setenv(_decode.ENV_DECODE, "0")
    assert _dispatch.plan_sdpa(p, "auto", arch=90, num_sms=132).backend == "fused"
    assert _dispatch.plan_sdpa(p, "auto", arch=90, num_sms=132, num_splits=3).backend == "fused"
    monkeypatch.delenv(_decode.ENV_DECODE)
    # num_splits given: the decode kernel even where the rule would not take it, under auto and fused
    p = _problem(L=100, S=100, H=8, Hkv=8)
    assert _dispatch.plan_sdpa(p, "auto", arch=90, num_sms=132).backend == "fused"
    for backend in ("auto", "fused"):
        plan = _dispatch.plan_sdpa(p, backend, arch=90, num_sms=132, num_splits=16)
        assert plan.backend == "decode" and plan.num_splits == 2 and "16 requested" in plan.details["splits"], str(plan)
    # backend="fused" without num_splits keeps the FlashAttention-2 kernel; split and fp32 never decode
    assert _dispatch.plan_sdpa(_problem(), "fused", arch=90, num_sms=132).backend == "fused"
    assert _dispatch.plan_sdpa(_problem(), "split", arch=90, num_sms=132, num_splits=2).backend == "split"
    assert _dispatch.plan_sdpa(_problem("float32"), "auto", arch=90, num_sms=132, num_splits=2).backend == "split"
    # sm_8x tiles: 32 keys at D=256
    plan = _dispatch.plan_sdpa(_problem(E=256, Ev=256), "auto", arch=86, num_sms=84)
    assert plan.backend == "decode" and "32 keys" in plan.details["tile"]


@pytest.mark.parametrize("L,S,groups,take", [(1, 4096, 1, True), (16, 256, 4, True), (1, 255, 8, False),
                                              (17, 4096, 1, False), (8, 4096, 16, False), (4, 65536, 16, True)])
def test_prefer_decode(L, S, groups, take):
    assert _decode.prefer_decode(L, S, groups)[0] is take


# ---------------------------------------------------------------------------------------------------------------------
# GPU

DTYPES = ("float16", "bfloat16")
SPLITS = (None, 1, 2, 3, 7, 16)


from test_flash import _cp, _rand, _torch, assert_out_lse  # noqa: E402  (the fused kernel's GPU test helpers)


def _check(q, k, v, dtype, *, causal=None, mask=None, scale=None, splits=SPLITS, what=""):
    """decode_forward on NaN-poisoned out/lse for every split count in ``splits``; out and lse vs the reference."""
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
    tmask = mask if mask is None or mask.dtype == torch.bool else mask.to(q.dtype)
    if causal == "bottom_right" or (causal and mask is not None):
        keep = torch.ones(L, S, dtype=torch.bool, device="cuda").tril(S - L if causal == "bottom_right" else 0)
        tmask = keep if tmask is None else (keep & tmask if tmask.dtype == torch.bool
                                            else tmask.masked_fill(~keep, float("-inf")))
    if tmask is not None:  # some torch kernels reject broadcast masks: materialize
        tmask = tmask.expand(B, Hq, L, S).contiguous()
    torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=tmask, scale=scale, enable_gqa=Hq != k.shape[1],
                                               is_causal=causal == "top_left" and mask is None)
    cmask = None if mask is None else cupy.broadcast_to(_cp(mask), (B, Hq, L, S))
    for n in splits:
        out = cupy.full((B, Hq, L, Ev), np.nan, dtype=_cp(q).dtype)
        lse = cupy.full((B, Hq, L), np.nan, dtype=cupy.float32)
        _decode.decode_forward(_cp(q), _cp(k), _cp(v), out, lse, scale=scale, causal=causal, mask=cmask,
                               num_splits=n)
        assert_out_lse(out, lse, ref, ref_lse, dtype, torch_out, f"{what} splits={n}")
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [1, 2, 7])
@pytest.mark.parametrize("S", [1, 100, 4096])
@pytest.mark.parametrize("H,Hkv", [(8, 8), (32, 8), (64, 8)])
def test_shapes(dtype, L, S, H, Hkv):
    g = _torch().Generator("cuda").manual_seed(L * 1000 + S + H)
    q, k, v = _rand((2, H, L, 128), dtype, g), _rand((2, Hkv, S, 128), dtype, g), _rand((2, Hkv, S, 128), dtype, g)
    _check(q, k, v, dtype, what=f"{dtype} L={L} S={S} {H}/{Hkv}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E,Ev", [(64, 64), (128, 128), (256, 256), (40, 40), (96, 96), (200, 136), (1, 1),
                                  (64, 200)])
def test_head_dims(dtype, E, Ev):
    """Every bucket, and odd head dims served by padding (E=1: rows not 16-byte aligned, plain-load path)."""
    g = _torch().Generator("cuda").manual_seed(E + Ev)
    q, k, v = _rand((2, 16, 3, E), dtype, g), _rand((2, 4, 777, E), dtype, g), _rand((2, 4, 777, Ev), dtype, g)
    _check(q, k, v, dtype, splits=(None, 1, 3, 16), what=f"{dtype} E={E} Ev={Ev}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_sequence(dtype):
    g = _torch().Generator("cuda").manual_seed(65536)
    q, k, v = _rand((1, 32, 1, 128), dtype, g), _rand((1, 8, 65536, 128), dtype, g), _rand((1, 8, 65536, 128),
                                                                                          dtype, g)
    _check(q, k, v, dtype, splits=(None, 1, 16), what=f"{dtype} S=65536")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L,S", [(1, 4096), (7, 4096), (2, 100), (7, 3), (16, 300)])
def test_causal(dtype, causal, L, S):
    g = _torch().Generator("cuda").manual_seed(L + S)
    q, k, v = _rand((2, 32, L, 128), dtype, g), _rand((2, 8, S, 128), dtype, g), _rand((2, 8, S, 128), dtype, g)
    _check(q, k, v, dtype, causal=causal, what=f"{dtype} {causal} L={L} S={S}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [1, 7])
def test_key_padding_with_fully_masked_batches(dtype, L):
    """Key padding per batch: lengths 0 (every row fully masked), 1, a tile ± 1, S, and a gap-ridden random one."""
    torch = _torch()
    g = torch.Generator("cuda").manual_seed(21 + L)
    B, H, Hkv, S = 6, 32, 8, 4096
    q, k, v = _rand((B, H, L, 128), dtype, g), _rand((B, Hkv, S, 128), dtype, g), _rand((B, Hkv, S, 128), dtype, g)
    lengths = torch.tensor([0, 1, 63, 65, S, 1000], device="cuda")
    mask = (torch.arange(S, device="cuda") < lengths[:, None])[:, None, None, :]
    mask[5] &= torch.rand(S, generator=g, device="cuda") > 0.5
    out = _check(q, k, v, dtype, mask=mask, what=f"{dtype} key padding L={L}")
    assert bool((out[0] == 0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_dtype", [None, "float32"])
def test_float_masks(dtype, mask_dtype):
    torch = _torch()
    g = torch.Generator("cuda").manual_seed(33)
    B, H, Hkv, L, S = 2, 32, 8, 2, 1000
    q, k, v = _rand((B, H, L, 64), dtype, g), _rand((B, Hkv, S, 64), dtype, g), _rand((B, Hkv, S, 64), dtype, g)
    mask = torch.randn(H, L, S, generator=g, device="cuda")
    mask[3, 1] = float("-inf")           # one fully masked row
    mask[5, :, 500:] = float("-inf")     # later splits of head 5 see nothing
    _check(q, k, v, dtype, mask=mask.to(getattr(torch, mask_dtype or dtype)), what=f"{dtype} float mask {mask_dtype}")


@pytest.mark.gpu
def test_bool_mask_per_row():
    torch = _torch()
    g = torch.Generator("cuda").manual_seed(34)
    B, H, Hkv, L, S = 2, 64, 8, 2, 2000
    q, k, v = _rand((B, H, L, 128), "float16", g), _rand((B, Hkv, S, 128), "float16", g), _rand(
        (B, Hkv, S, 128), "float16", g)
    mask = torch.rand(B, H, L, S, generator=g, device="cuda") > 0.5
    mask[1, 7, 0] = False
    _check(q, k, v, "float16", mask=mask, what="bool (B, H, L, S)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_bshd_views_read_in_place(dtype):
    g = _torch().Generator("cuda").manual_seed(8)
    B, L, S, H, Hkv, D = 2, 2, 3000, 32, 8, 128
    q = _rand((B, L, H, D), dtype, g).transpose(1, 2)
    k, v = (_rand((B, S, Hkv, D), dtype, g).transpose(1, 2) for _ in range(2))
    assert not q.is_contiguous() and _cp(k).strides[1] == D * 2
    _check(q, k, v, dtype, causal="bottom_right", what="BSHD")


@pytest.mark.gpu
def test_unaligned_strides_use_plain_loads():
    g = _torch().Generator("cuda").manual_seed(12)
    base = _rand((1, 8, 600, 75), "float16", g)
    q, k, v = base[:, :, :3, :70], base[:, :2, :500, 1:71], base[:, 2:4, 50:550, 2:72]
    _check(q, k, v, "float16", splits=(1, 3), what="unaligned")


@pytest.mark.gpu
def test_large_magnitude_scores():
    g = _torch().Generator("cuda").manual_seed(11)
    q, k, v = _rand((2, 8, 1, 64), "float16", g, 3.0), _rand((2, 8, 5000, 64), "float16", g, 3.0), _rand(
        (2, 8, 5000, 64), "float16", g)
    _check(q, k, v, "float16", what="large scores")


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 5])
def test_through_sdpa_with_call_cache(num_splits):
    """The public entry point takes the decode kernel; a repeated call replays it (call cache) on new data."""
    torch = _torch()
    F = torch.nn.functional
    g = torch.Generator("cuda").manual_seed(40)
    q, k, v = _rand((4, 32, 1, 128), "bfloat16", g), _rand((4, 8, 4096, 128), "bfloat16", g), _rand(
        (4, 8, 4096, 128), "bfloat16", g)
    plan = cupy_attn.explain(q, k, v, enable_gqa=True, num_splits=num_splits)
    assert plan.backend == "decode", str(plan)
    for _ in range(2):
        out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True,
                                                          num_splits=num_splits)
        ref, ref_lse = reference.scaled_dot_product_attention(as_f64(q), as_f64(k), as_f64(v), enable_gqa=True,
                                                              return_lse=True)
        assert_close(out, ref, "bfloat16", F.scaled_dot_product_attention(q, k, v, enable_gqa=True), "sdpa decode")
        np.testing.assert_allclose(as_f64(lse), ref_lse, rtol=1e-4, atol=2e-3)
        q = _rand(q.shape, "bfloat16", g)
