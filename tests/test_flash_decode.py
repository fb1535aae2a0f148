"""The split-KV decode kernel (cupy_attn.attention.kernels.flash_decode): compile checks, the split rule, dispatch,
num_splits validation (CPU); against the float64 reference with torch's error as the yardstick (GPU, tests/_helpers/_tolerance.py).

GPU tests poison out and lse with NaN, run dispatch.decode_launch on CuPy views of torch tensors (strides kept) with every
forced split count and every kernel variant (flash_decode with its 4- and its 8-warp tile, the latter on Hopper at
head dims 64 and 128; flash_decode_sm90 with one and two CTAs per SM, which on an H100/H200 must really run where TMA
can read the layout), and check lse; a few run through scaled_dot_product_attention (auto dispatch, num_splits,
CUPY_ATTN_DECODE=1/2/3, CUPY_ATTN_DECODE_WARPS=4/8).
"""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference
from cupy_attn.attention import checks as _checks, dispatch as _dispatch
from cupy_attn.attention.kernels import flash_decode as _decode
from cupy_attn.runtime import compile as _compile, compile_check, interop as _interop
from cupy_attn.runtime.kernel_abi import C_TYPE_16

from _compile_checks import assert_clean
from _tolerance import as_f64, assert_close

# ---------------------------------------------------------------------------------------------------------------------
# CPU


_FAMILY_ARCHS = [(f, arch) for f in (_decode.FLASH_DECODE, _decode.FLASH_DECODE_SM90, _decode.FLASH_DECODE_COMBINE)
                 for arch in f.archs]


@pytest.mark.parametrize("family,arch", _FAMILY_ARCHS, ids=[f"{f.name}-{a}" for f, a in _FAMILY_ARCHS])
def test_every_instantiation_compiles_without_spills(family, arch):
    reports = compile_check.compile_family(family, arch)
    assert len(reports) == len(list(family.variants())) == len(set(family.name_expressions()))
    assert_clean(reports, max_registers=255)


def test_streaming_variant_sass_has_tma_mbarriers_and_no_local_memory():
    """flash_decode_sm90 in the SASS: TMA loads (UTMALDG) and mbarrier waits/arrivals (SYNCS), ldmatrix + mma.sync
    math, cp.async only for Q (one LDGSTS in the code), and no local memory."""
    from test_flash_fwd_sm90 import _cuobjdump, sass_summary
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    kernels = sass_summary(compile_check.family_cubin(_decode.FLASH_DECODE_SM90, "sm_90a"))
    assert len(kernels) == len(_decode.FLASH_DECODE_SM90.name_expressions())
    for name, ops in kernels.items():
        for op in ("UTMALDG", "SYNCS", "LDSM", "HMMA", "MUFU"):
            assert ops.get(op, 0) > 0, f"{name}: no {op} in the SASS"
        assert ops.get("LDGSTS", 0) <= 1, f"{name}: K/V must not go through cp.async ({ops.get('LDGSTS')} LDGSTS)"
        for op in ("LDL", "STL"):
            assert op not in ops, f"{name}: local memory ({op}: {ops[op]})"


def test_stream_tile_table():
    declared = set(_decode.FLASH_DECODE_SM90.name_expressions())
    assert set(_decode.STREAM_TILES) == {(v, d) for v in ("stream", "stream2") for d in _decode.HEAD_DIMS}
    for (variant, d), tile in _decode.STREAM_TILES.items():
        assert tile.smem_bytes(d) <= 232448, (variant, d, tile)                      # 227 KB per block
        assert tile.ctas_per_sm * (tile.smem_bytes(d) + 1024) <= 233472, (variant, d, tile)  # 228 KB per SM
        assert (tile.block_n // tile.warps) % 16 == 0 and tile.block_n % 8 == 0 and tile.block_n <= 256
        assert tile.stages >= 2 and tile.ctas_per_sm == (1 if variant == "stream" else 2)
        assert tile.warps * 16 * (d + 2) * 4 <= 2 * tile.stages * tile.block_n * d * 2  # merge scratch in the ring
        assert tile.in_flight_bytes(d) * tile.ctas_per_sm >= 128 * 1024  # per SM, see bench/notes/decode.md
        for dtype in C_TYPE_16.values():
            for has_mask in ("false", "true"):
                assert _decode.FLASH_DECODE_SM90.name_expression(dtype=dtype, head_dim=d, tile=tile,
                                                                 has_mask=has_mask) in declared


def test_sm90_params_declaration():
    dt = _decode._SM90_PARAMS
    assert dt.names == ("tma_k", "tma_v", "p") and dt.fields["p"][1] == 256 and dt.fields["p"][0] == _decode._PARAMS
    assert dt.itemsize % 64 == 0 and dt.itemsize >= 256 + _decode._PARAMS.itemsize
    assert _decode.FLASH_DECODE_SM90.structs == (("cupy_attn::FlashDecodeSm90Params", dt),)


@pytest.mark.parametrize("value,variant", [(None, _decode.DEFAULT_VARIANT), ("0", _decode.DEFAULT_VARIANT),
                                           ("1", "v1"), ("2", "stream"), ("3", "stream2")])
def test_requested_variant(value, variant, monkeypatch):
    if value is None:
        monkeypatch.delenv(_decode.ENV_DECODE, raising=False)
    else:
        monkeypatch.setenv(_decode.ENV_DECODE, value)
    assert _decode.requested_variant() == variant


def test_requested_variant_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(_decode.ENV_DECODE, "4")
    with pytest.raises(ValueError, match="CUPY_ATTN_DECODE must be 0, 1, 2 or 3"):
        _decode.requested_variant()
    with pytest.raises(ValueError, match="decode variant"):
        _decode.choose_kernel(128, 90, variant="fast")


class _FakeArray:
    """What stream_layout_reason reads of a CuPy array: data.ptr, shape, strides (bytes)."""

    def __init__(self, ptr, shape, strides):
        self.data = type("Mem", (), {"ptr": ptr})()
        self.shape, self.strides = shape, strides


@pytest.mark.parametrize("ptr,shape,strides,why", [
    (4096, (2, 8, 100, 128), (8 * 100 * 256, 100 * 256, 256, 2), None),            # BHSD
    (4096, (2, 8, 100, 128), (100 * 8 * 256, 256, 8 * 256, 2), None),              # BSHD
    (4096, (2, 8, 100, 40), (8 * 100 * 80, 100 * 80, 80, 2), None),                # E = 40: 80-byte rows
    (4098, (2, 8, 100, 128), (8 * 100 * 256, 100 * 256, 256, 2), "16-byte aligned"),
    (4096, (2, 8, 100, 36), (8 * 100 * 72, 100 * 72, 72, 2), "along s is 72 bytes"),
    (4096, (2, 8, 100, 128), (0, 100 * 256, 256, 2), "along b is 0 bytes"),        # broadcast batch
    (4096, (1, 1, 1, 36), (72, 72, 72, 2), None),                                  # size-1 axes are not checked
])
def test_stream_layout_reason(ptr, shape, strides, why):
    a = _FakeArray(ptr, shape, strides)
    good = _FakeArray(4096, (2, 8, 100, 128), (8 * 100 * 256, 100 * 256, 256, 2))
    for k, v in ((a, good), (good, a)):
        got = _decode.stream_layout_reason(k, v)
        assert (got is None) if why is None else (why in got), got


def test_choose_kernel(monkeypatch):
    pytest.importorskip("cuda.bindings")
    monkeypatch.delenv(_decode.ENV_WARPS, raising=False)
    for variant, ctas in (("stream", 1), ("stream2", 2)):
        for d in _decode.HEAD_DIMS:
            c = _decode.choose_kernel(d, 90, variant=variant)
            assert c.family is _decode.FLASH_DECODE_SM90 and c.fallback is None and c.tile.ctas_per_sm == ctas
            assert c.tile == _decode.STREAM_TILES[(variant, d)]
        c = _decode.choose_kernel(128, 86, variant=variant)
        assert c.family is _decode.FLASH_DECODE and "needs sm_90a" in c.fallback and "sm_86" in c.describe()
        bad = _FakeArray(4098, (2, 8, 100, 128), (8 * 100 * 256, 100 * 256, 256, 2))
        c = _decode.choose_kernel(128, 90, bad, bad, variant=variant)
        assert c.family is _decode.FLASH_DECODE and "16-byte aligned" in c.fallback
    c = _decode.choose_kernel(128, 90, variant="v1")
    assert c.family is _decode.FLASH_DECODE and c.fallback is None and c.tile == _decode.tile_for(128, 90)


def test_wide_tile_table():
    """flash_decode's 8-warp tiles: Hopper only, D = 64 and 128, 16 keys per warp, one CTA per SM by shared memory,
    the merge scratch (8 warps × 16 rows × (D + 2) fp32) in the K/V ring, declared in the family's table."""
    declared = set(_decode.FLASH_DECODE.name_expressions())
    assert set(_decode.WIDE_TILES) == {(64, 9), (128, 9)}
    for (d, arch), tile in _decode.WIDE_TILES.items():
        assert tile.warps == 8 and tile.block_n // tile.warps == 16 and tile.ctas_per_sm == 1
        assert _SMEM_LIMIT[arch] >= tile.smem_bytes(d) > _SMEM_LIMIT[arch] // 2, (d, tile)  # 1 CTA/SM
        assert 8 * 16 * (d + 2) * 4 <= 2 * tile.stages * tile.block_n * (d + 8) * 2
        assert tile == _decode.tile_for(d, arch * 10, 8)
        for dtype in C_TYPE_16.values():
            for has_mask in ("false", "true"):
                assert _decode.FLASH_DECODE.name_expression(dtype=dtype, head_dim=d, tile=tile,
                                                            has_mask=has_mask) in declared
    assert _decode.tile_for(256, 90, 8) is None and _decode.tile_for(128, 86, 8) is None


@pytest.mark.parametrize("value,warps", [(None, None), ("", None), ("4", 4), ("8", 8)])
def test_requested_warps(value, warps, monkeypatch):
    if value is None:
        monkeypatch.delenv(_decode.ENV_WARPS, raising=False)
    else:
        monkeypatch.setenv(_decode.ENV_WARPS, value)
    assert _decode.requested_warps() == warps


def test_requested_warps_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(_decode.ENV_WARPS, "16")
    with pytest.raises(ValueError, match="CUPY_ATTN_DECODE_WARPS must be 4 or 8"):
        _decode.requested_warps()
    monkeypatch.delenv(_decode.ENV_WARPS)
    with pytest.raises(ValueError, match="decode warps"):
        _decode.v1_tile(128, 90, warps=2)


@pytest.mark.parametrize("B,Hq,Hkv,S,splits,ctas,warps", [
    (64, 32, 32, 4096, None, 2048, 4), (8, 32, 32, 32768, None, 256, 4),   # MHA decode: many CTAs per SM
    (8, 32, 8, 32768, None, 128, 8), (16, 64, 8, 8192, None, 128, 8),      # the GQA rows: one CTA per SM
    (8, 32, 8, 32768, 3, 192, 8), (8, 32, 8, 32768, 4, 256, 4),            # forced splits: up to 1.5 x 132 SMs
    (1, 8, 8, 4096, None, 56, 8)])                                         # 8 CTAs x 7 splits
def test_warps_rule(B, Hq, Hkv, S, splits, ctas, warps, monkeypatch):
    monkeypatch.delenv(_decode.ENV_WARPS, raising=False)
    assert _decode.launch_ctas(B, Hkv, 1, Hq // Hkv, S, 132, splits) == ctas
    tile, note = _decode.v1_tile(128, 90, ctas, 132)
    assert tile.warps == warps and (note is None) == (warps == 4), note
    assert _decode.v1_tile(256, 90, ctas, 132)[0].warps == 4       # no 8-warp tile at D = 256
    assert _decode.v1_tile(128, 86, ctas, 84)[0].warps == 4        # nor on sm_8x
    for env in ("4", "8"):                                          # the override wins over the rule
        monkeypatch.setenv(_decode.ENV_WARPS, env)
        assert _decode.v1_tile(128, 90, ctas, 132)[0].warps == int(env)
        assert _decode.choose_kernel(128, 90, variant="v1", grid_ctas=ctas, num_sms=132).tile.warps == int(env)
        c = _decode.choose_kernel(256, 90, variant="v1", grid_ctas=ctas, num_sms=132)
        assert c.tile.warps == 4 and (env == "4" or "no 8-warp tile" in c.describe()), c.describe()
        monkeypatch.delenv(_decode.ENV_WARPS)
    assert _decode.v1_tile(128, 90, ctas, 132, warps=8)[0].warps == 8
    assert _decode.v1_tile(128, 90, ctas, 132, warps=4)[0].warps == 4


def test_params_dtype_is_parsed_from_the_kernel_source():
    names = _decode._PARAMS.names
    assert names[:8] == ("out", "lse", "q", "k", "v", "mask", "o_part", "lse_part")
    assert names[-5:] == ("mask_stride_s", "seqused_k", "block_table", "max_blocks", "page_size")  # paged: last
    assert _decode._PARAMS.itemsize == 8 * len(names)
    assert _decode._PARAMS["scale_log2"] == np.float64
    assert _decode.FLASH_DECODE.structs == (("cupy_attn::FlashDecodeParams", _decode._PARAMS),)


def test_family_module_is_in_the_compile_check():
    assert _decode.FLASH_DECODE in _compile.all_families()


# Largest dynamic shared memory per block: sm_86/sm_89 (the smallest sm_8x) and sm_90.
_SMEM_LIMIT = {8: 101376, 9: 232448}


def test_tile_table():
    declared = set(_decode.FLASH_DECODE.name_expressions())
    assert {d for d, _ in _decode.TILES} == set(_decode.HEAD_DIMS)
    for (d, arch), tile in _decode.TILES.items():
        assert tile.smem_bytes(d) <= _SMEM_LIMIT[arch], (d, arch, tile)
        assert tile.ctas_per_sm * tile.smem_bytes(d) <= {8: 167936, 9: 233472}[arch], (d, arch, tile)
        assert (tile.block_n // tile.warps) % 16 == 0 and tile.stages >= 2
        for dtype in C_TYPE_16.values():
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
    (64, 32, 32, 4096, 1), (8, 32, 32, 32768, 1), (8, 32, 8, 32768, 1), (16, 64, 8, 8192, 1),
    (4, 32, 8, 32768, 4), (1, 32, 8, 32768, 15)])
def test_auto_splits_count_waves_per_sm(B, Hq, Hkv, S, splits):
    # The decode shapes on an H200 (132 SMs), D = 128, L = 1: the measured best split counts (session 10:
    # 64 CTAs, half the SMs, stream as fast with one split as with two). Below ONE_SPLIT_FILL of the SMs the wave
    # rule splits: 32 CTAs → 4 splits (128 of 132 SMs), 8 CTAs → 15 (120 SMs, the first within 0.85 of a full wave).
    assert _decode.split_plan(B, Hkv, 1, Hq // Hkv, S, 128, 90, 132)[0] == splits


@pytest.mark.parametrize("S,requested,splits,chunk", [
    (100, 16, 2, 64), (100, 1, 1, 128), (4096, 7, 7, 640), (4096, 3, 3, 1408), (1, 16, 1, 64), (65536, 16, 16, 4096),
    (65, 2, 2, 64), (64, 2, 1, 64)])
def test_split_plan_honours_requests_up_to_one_tile(S, requested, splits, chunk):
    # head dim 128 on Hopper: 64-key tiles (flash_decode and flash_decode_sm90 alike)
    assert _decode.split_plan(2, 8, 1, 4, S, 128, 90, 132, requested) == (splits, chunk)
    assert _decode.split_plan(2, 8, 1, 4, S, 128, 90, 132, requested,
                              _decode.STREAM_TILES[("stream", 128)].block_n) == (splits, chunk)


@pytest.mark.parametrize("S,requested,splits,chunk", [(100, 16, 1, 128), (4096, 7, 7, 640), (4096, 3, 3, 1408),
                                                      (65536, 16, 16, 4096), (300, 2, 2, 256)])
def test_split_plan_rounds_to_the_streaming_tile(S, requested, splits, chunk):
    # head dim 64 of flash_decode_sm90: 128-key stages; a split is a whole number of them
    block_n = _decode.STREAM_TILES[("stream", 64)].block_n
    assert _decode.split_plan(2, 8, 1, 4, S, 64, 90, 132, requested, block_n) == (splits, chunk)


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
    assert "CUPY_ATTN_DECODE" in _callcache.ENV_KEYS and _decode.ENV_WARPS in _callcache.ENV_KEYS
    import inspect
    assert "num_splits" in list(inspect.signature(_callcache.key).parameters)


def _problem(dtype="float16", E=128, Ev=128, mask_kind="none", B=8, H=32, Hkv=8, L=1, S=32768, causal=None):
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    ctx = _interop.CallContext(_interop.CUPY, 0)
    return _checks.SDPAProblem(ctx=ctx, query=None, key=None, value=None, batch_shape=(B, H), batch=B, num_heads=H,
                               num_kv_heads=Hkv, seqlen_q=L, seqlen_k=S, head_dim=E, head_dim_v=Ev, dtype=dt,
                               scale=0.1, causal=causal, mask_kind=mask_kind)


@pytest.mark.parametrize("kw,expected,splits", [
    (dict(), "decode", 1),                                   # GQA decode, 64 CTAs ≥ 0.45 of the SMs → 1, 8 warps
    (dict(B=64, H=32, Hkv=32, S=4096), "decode", 1),         # 2048 CTAs: one split, 4 warps
    (dict(B=16, H=64, Hkv=8, S=8192), "decode", 1),          # 128 CTAs: 0.97 of the SMs, 8 warps
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
    monkeypatch.delenv(_decode.ENV_DECODE, raising=False)
    monkeypatch.delenv(_decode.ENV_WARPS, raising=False)
    p = _problem(**kw)
    plan = _dispatch.plan_sdpa(p, "auto", arch=90, num_sms=132)
    assert plan.backend == expected, str(plan)
    if expected == "decode":
        assert plan.reason.startswith(f"decode (split-KV, {plan.num_splits} splits)"), plan.reason
        assert "splits" in plan.details and plan.details["kernel"] == "flash_decode"
        if splits is not None:
            assert plan.num_splits == splits, str(plan)
            wide = p.batch * p.num_kv_heads * splits <= 1.5 * 132  # L = 1: one row block per kv head
            assert (", 8 warps," in plan.details["tile"]) == wide, plan.details["tile"]


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


@pytest.mark.parametrize("value,kernel", [("1", "flash_decode"), ("2", "flash_decode_sm90"),
                                          ("3", "flash_decode_sm90")])
def test_decode_dispatch_variant_env(value, kernel, monkeypatch):
    pytest.importorskip("cuda.bindings")
    monkeypatch.setenv("CUPY_ATTN_FA3", "0")
    monkeypatch.setenv(_decode.ENV_DECODE, value)
    monkeypatch.delenv(_decode.ENV_WARPS, raising=False)
    plan = _dispatch.plan_sdpa(_problem(E=64, Ev=64), "auto", arch=90, num_sms=132, num_splits=3)
    assert plan.backend == "decode" and plan.details["kernel"] == kernel, str(plan)
    # D = 64: the streaming tiles take 128 keys per stage, and so does flash_decode's 8-warp tile, which the rule
    # takes for this grid (64 CTAs x 3 splits = 192 <= 1.5 x 132 SMs)
    block_n = 128
    assert plan.details["splits"] == f"3 of {block_n * -(-32768 // (3 * block_n))} keys (3 requested)"
    if value != "1":
        assert "mbarrier ring" in plan.details["tile"]
    # no Hopper: flash_decode, and the plan says why
    plan = _dispatch.plan_sdpa(_problem(E=64, Ev=64), "auto", arch=86, num_sms=84)
    assert plan.details["kernel"] == "flash_decode"
    if value != "1":
        assert "needs sm_90a" in plan.details["tile"]


@pytest.mark.parametrize("L,S,groups,take", [(1, 4096, 1, True), (16, 256, 4, True), (1, 255, 8, False),
                                              (17, 4096, 1, False), (8, 4096, 16, False), (4, 65536, 16, True)])
def test_prefer_decode(L, S, groups, take):
    assert _decode.prefer_decode(L, S, groups)[0] is take


# ---------------------------------------------------------------------------------------------------------------------
# GPU

DTYPES = ("float16", "bfloat16")
SPLITS = (None, 1, 2, 3, 7, 16)
# (variant, warps) of choose_kernel: flash_decode with 4 and 8 warps (the 8-warp tile forced, as by
# CUPY_ATTN_DECODE_WARPS=8, wherever it exists), flash_decode_sm90 with 1 and 2 CTAs per SM
VARIANTS = (("v1", 4), ("v1", 8), ("stream", None), ("stream2", None))


from test_flash_fwd import _cp, _rand, _torch, assert_out_lse  # noqa: E402  (the fused kernel's GPU test helpers)


def _check(q, k, v, dtype, *, causal=None, mask=None, scale=None, splits=SPLITS, what="", torch_flip=False):
    """decode_forward on NaN-poisoned out/lse for every split count in ``splits`` and every variant in VARIANTS; out
    and lse vs the reference. On compute capability 9.0 the streaming variants must run flash_decode_sm90 wherever
    TMA can read k and v (stream_layout_reason), and fall back to flash_decode elsewhere; flash_decode with warps=8
    must run its 8-warp tile at head-dim buckets 64 and 128 (and 4 warps elsewhere). torch_flip: torch (the
    error yardstick) gets -q and -scale, the same scores (negation is exact), so that no torch kernel sees a negative
    scale."""
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
    torch_out = F.scaled_dot_product_attention(-q if torch_flip else q, k, v, attn_mask=tmask,
                                               scale=-scale if torch_flip else scale, enable_gqa=Hq != k.shape[1],
                                               is_causal=causal == "top_left" and mask is None)
    cmask = None if mask is None else cupy.broadcast_to(_cp(mask), (B, Hq, L, S))
    hopper = int(cupy.cuda.Device().compute_capability) // 10 == 9
    tma_ok = _decode.stream_layout_reason(_cp(k), _cp(v)) is None
    wide_ok = hopper and _decode.head_dim_bucket(E, Ev) in (64, 128)
    for variant, warps in VARIANTS:
        for n in splits:
            out = cupy.full((B, Hq, L, Ev), np.nan, dtype=_cp(q).dtype)
            lse = cupy.full((B, Hq, L), np.nan, dtype=cupy.float32)
            launch = _dispatch.decode_launch(_cp(q), _cp(k), _cp(v), out, lse, scale=scale, causal=causal,
                                             mask=cmask, num_splits=n, variant=variant, warps=warps)
            launch(_cp(q).data.ptr, _cp(k).data.ptr, _cp(v).data.ptr, out.data.ptr, lse.data.ptr,
                   0 if cmask is None else cmask.data.ptr)
            streaming = variant != "v1" and hopper and tma_ok
            choice = launch.info["choice"]
            assert (choice.family is _decode.FLASH_DECODE_SM90) == streaming, choice.describe()
            if warps is not None:
                assert choice.tile.warps == (8 if warps == 8 and wide_ok else 4), choice.describe()
            assert_out_lse(out, lse, ref, ref_lse, dtype, torch_out,
                           f"{what} {variant} warps={choice.tile.warps} splits={n}")
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
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("scale", [None, -0.2, 0.0])
def test_growing_scores_and_scale_sign(dtype, L, scale):
    """Scores whose spread grows along the keys (K rows scaled by 0.2 .. 8): the fast path's running max must move
    again many tiles after the first (its lazy rescale, > 8 log2 units), for g·L = 4 (rows 8..15 skipped) and 12
    packed rows; a negative scale (no fast path: the max of the raw scores is not the max of the scaled ones) and a
    zero one (every key weighted alike)."""
    torch = _torch()
    g = torch.Generator("cuda").manual_seed(77 + L)
    S = 4096
    ramp = torch.linspace(0.2, 8.0, S, device="cuda")[:, None]
    q = _rand((2, 32, L, 128), dtype, g)
    k = (torch.randn((2, 8, S, 128), generator=g, device="cuda") * ramp).to(getattr(torch, dtype))
    v = _rand((2, 8, S, 128), dtype, g)
    _check(q, k, v, dtype, scale=scale, splits=(None, 1, 3), what=f"{dtype} growing scores L={L} scale={scale}",
           torch_flip=scale is not None and scale < 0)


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
@pytest.mark.parametrize("env,warps_env", [("1", None), ("1", "4"), ("1", "8"), ("2", None), ("3", None)])
@pytest.mark.parametrize("num_splits", [None, 5])
def test_through_sdpa_with_call_cache(num_splits, env, warps_env, monkeypatch):
    """The public entry point takes the decode kernel CUPY_ATTN_DECODE names, and flash_decode's tile
    CUPY_ATTN_DECODE_WARPS names (unset: the rule, 8 warps for these 32 CTAs × 4 or 5 splits on an H100/H200); a
    repeated call replays it (call cache) on new data: new q each time, and on the last call new k and v
    (flash_decode_sm90 encodes its tensor maps again)."""
    import cupy
    torch = _torch()
    F = torch.nn.functional
    monkeypatch.setenv(_decode.ENV_DECODE, env)
    if warps_env is None:
        monkeypatch.delenv(_decode.ENV_WARPS, raising=False)
    else:
        monkeypatch.setenv(_decode.ENV_WARPS, warps_env)
    g = torch.Generator("cuda").manual_seed(40)
    q, k, v = _rand((4, 32, 1, 128), "bfloat16", g), _rand((4, 8, 4096, 128), "bfloat16", g), _rand(
        (4, 8, 4096, 128), "bfloat16", g)
    plan = cupy_attn.explain(q, k, v, enable_gqa=True, num_splits=num_splits)
    assert plan.backend == "decode", str(plan)
    hopper = int(cupy.cuda.Device().compute_capability) // 10 == 9
    assert plan.details["kernel"] == ("flash_decode_sm90" if env != "1" and hopper else "flash_decode"), str(plan)
    if env == "1":
        warps = 4 if warps_env == "4" or not hopper else 8  # D = 128: the 8-warp tile exists on Hopper
        assert f", {warps} warps," in plan.details["tile"], str(plan)
    for step in range(3):
        out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True,
                                                          num_splits=num_splits)
        ref, ref_lse = reference.scaled_dot_product_attention(as_f64(q), as_f64(k), as_f64(v), enable_gqa=True,
                                                              return_lse=True)
        assert_close(out, ref, "bfloat16", F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                     f"sdpa decode CUPY_ATTN_DECODE={env} call {step}")
        np.testing.assert_allclose(as_f64(lse), ref_lse, rtol=1e-4, atol=2e-3)
        q = _rand(q.shape, "bfloat16", g)
        if step == 1:
            k, v = _rand(k.shape, "bfloat16", g), _rand(v.shape, "bfloat16", g)
