"""The fused forward for head dims 257-512 on Hopper (cupy_attn/attention/kernels/flash_fwd_d512_sm90.py,
cuda_src/attention/flash_fwd_d512_sm90.cu).

CPU: every instantiation compiles for sm_90a without spills or ptxas performance warnings, its SASS has the wgmma
widths, TMA loads and no local memory; the dispatch rule (auto when the grid fills the device, CUPY_ATTN_D512). GPU: out and lse
against float64 through the public API (CUPY_ATTN_D512=1), with torch's same-precision error as the bound where torch
runs the call: head dims 257-512 (E ≠ Ev too), odd L and S, causal in both alignments, GQA, large logits, a call on
new arrays replaying the cached launch, and BSHD views.
"""
import numpy as np
import pytest

from cupy_attn.attention.kernels import flash_fwd_d512_sm90 as _d512
from cupy_attn.runtime import compile_check

from _tolerance import as_f64, assert_close
from test_flash_fwd_sm90 import _cuobjdump, sass_summary, sass_text
from _compile_checks import assert_clean

FAMILY = _d512.FLASH_FWD_D512_SM90


def _kind(dtype, E, Ev, mask_kind, scale):
    """What reason() reads of a problem."""
    import types
    return types.SimpleNamespace(dtype=dtype, head_dim=E, head_dim_v=Ev, mask_kind=mask_kind, scale=scale)
DTYPES = ("float16", "bfloat16")


def test_every_instantiation_compiles_without_spills():
    reports = compile_check.compile_family(FAMILY, "sm_90a")
    assert len(reports) == 3 * len(DTYPES)  # persistent, one tile per CTA, and the variants (one tile per CTA)
    assert_clean(reports, max_registers=168)


def test_sass_has_both_wgmma_widths_tma_and_no_local_memory():
    """S by HGMMA 64x128 (each warpgroup's 128 keys), O by HGMMA 64x256 (its 256 columns), TMA loads, mbarriers,
    setmaxnreg, 16-byte stores of out, no local memory."""
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    cubin = compile_check.family_cubin(FAMILY, "sm_90a")
    kernels, listings = sass_summary(cubin), sass_text(cubin)
    assert len(kernels) == 3 * len(DTYPES)  # persistent, one tile per CTA, the variants
    for name, ops in kernels.items():
        text = listings[name]
        for width in ("64x128x16", "64x256x16"):
            assert f"HGMMA.{width}.F32" in text, f"{name}: no HGMMA.{width}"
        for op in ("UTMALDG", "SYNCS", "USETMAXREG"):
            assert ops.get(op, 0) > 0, f"{name}: no {op}"
        assert "STG.E.128" in text, f"{name}: out not stored by 16-byte stores"
        for op in ("LDL", "STL"):
            assert op not in ops, f"{name}: local memory ({op}: {ops[op]})"


def test_shared_memory_fits_and_matches_the_kernel():
    assert _d512.smem_bytes() == 232016 <= 232448


def test_support_rule():
    f16 = np.dtype("float16")
    assert _d512.reason(_kind(f16, 512, 512, "none", 0.04), 90) is None
    assert _d512.reason(_kind(f16, 320, 264, "none", 0.04), 90) is None
    assert "257-512" in _d512.reason(_kind(f16, 256, 256, "none", 0.04), 90)   # the FA3 kernel's
    assert "257-512" in _d512.reason(_kind(f16, 1024, 1024, "none", 0.04), 90)
    assert "257-512" in _d512.reason(_kind(f16, 512, 300, "none", 0.04), 90)   # Ev not a multiple of 8
    assert "sm_90a" in _d512.reason(_kind(f16, 512, 512, "none", 0.04), 80)
    assert "fp16 and bf16" in _d512.reason(_kind(np.dtype("float32"), 512, 512, "none", 0.04), 90)
    assert "mask" in _d512.reason(_kind(f16, 512, 512, "bool", 0.04), 90)


def test_env_is_part_of_the_call_cache_key():
    from cupy_attn.runtime import callcache
    assert _d512.ENV in callcache.ENV_KEYS, "a cached call must not replay the other path after CUPY_ATTN_D512 changes"


def test_env_setting(monkeypatch):
    monkeypatch.delenv(_d512.ENV, raising=False)
    assert _d512.enabled() is None
    monkeypatch.setenv(_d512.ENV, "1")
    assert _d512.enabled() == "1"
    monkeypatch.setenv(_d512.ENV, "yes")
    with pytest.raises(ValueError, match=_d512.ENV):
        _d512.enabled()


# ---------------------------------------------------------------------------------------------------------------------
# GPU

def _torch():
    return pytest.importorskip("torch")


CASES = [
    # (B, Hq, Hkv, L, S, E, Ev, causal)
    (2, 4, 4, 256, 512, 512, 512, None),
    (1, 3, 3, 200, 300, 512, 512, None),             # partial row block, partial key block
    (2, 4, 4, 333, 333, 512, 512, "top_left"),
    (1, 2, 2, 300, 700, 384, 384, "top_left"),       # L < S, top-left: key blocks past the rows' limit skipped
    (1, 2, 2, 300, 700, 512, 512, "bottom_right"),
    (1, 2, 2, 500, 200, 320, 320, "bottom_right"),   # L > S: the first 300 rows see no key (out 0, lse -inf)
    (1, 8, 2, 257, 513, 512, 512, None),             # GQA 8/2
    (1, 2, 2, 129, 64, 264, 504, None),              # E ≠ Ev, S < one key block
    (1, 40, 40, 200, 600, 512, 512, "top_left"),     # 160 tiles: persistent CTAs walk two
    (1, 40, 40, 300, 100, 320, 320, "bottom_right"), # 200 tiles, some with no key block between others
    (2, 12, 12, 704, 704, 384, 384, "top_left"),     # 264 tiles: m-block pairs (M-1-k, k), M = 11 (one alone)
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,L,S,E,Ev,causal", CASES)
def test_public_api(B, Hq, Hkv, L, S, E, Ev, causal, dtype, monkeypatch):
    import cupy_attn
    from cupy_attn import reference
    torch = _torch()
    monkeypatch.setenv(_d512.ENV, "1")
    gen = torch.Generator(device="cuda").manual_seed(L * 7 + S)
    dt = getattr(torch, dtype)
    for call in range(2):  # the second call on new arrays replays the cached launch
        q = torch.randn(B, Hq, L, E, generator=gen, device="cuda").to(dt)
        k = torch.randn(B, Hkv, S, E, generator=gen, device="cuda").to(dt)
        v = torch.randn(B, Hkv, S, Ev, generator=gen, device="cuda").to(dt)
        is_causal = {None: False, "top_left": True, "bottom_right": "bottom_right"}[causal]
        plan = cupy_attn.explain(q, k, v, is_causal=is_causal, enable_gqa=Hq != Hkv)
        assert plan.backend == "fused" and plan.details["kernel"] == FAMILY.name, str(plan)
        out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=Hq != Hkv,
                                                          return_lse=True)
        ref, ref_lse = reference.scaled_dot_product_attention(*(as_f64(x) for x in (q, k, v)), is_causal=is_causal,
                                                              enable_gqa=Hq != Hkv, return_lse=True)
        torch_out = None
        if causal != "bottom_right" or L == S:
            torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal),
                                                                         enable_gqa=Hq != Hkv)
        assert_close(out, ref, dtype, torch_out, what=f"call {call}")
        got = as_f64(lse)
        assert (np.isneginf(got) == np.isneginf(ref_lse)).all(), f"lse -inf rows differ (call {call})"
        fin = np.isfinite(ref_lse)
        assert np.abs(got[fin] - ref_lse[fin]).max() < 1e-3 * max(1.0, np.abs(ref_lse[fin]).max())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_large_logits(dtype, causal, monkeypatch):
    """|scale·q·k| up to ~100 (issue 14): q, k scaled so that scale·q·k spans about ±100."""
    import cupy_attn
    from cupy_attn import reference
    torch = _torch()
    monkeypatch.setenv(_d512.ENV, "1")
    gen = torch.Generator(device="cuda").manual_seed(5)
    dt = getattr(torch, dtype)
    E = 512
    q = (torch.randn(1, 2, 190, E, generator=gen, device="cuda") * 4.7).to(dt)
    k = (torch.randn(1, 2, 600, E, generator=gen, device="cuda") * 4.7).to(dt)
    v = torch.randn(1, 2, 600, E, generator=gen, device="cuda").to(dt)
    logits = (as_f64(q)[0, 0] @ as_f64(k)[0, 0].T) / np.sqrt(E)
    assert 60 < np.abs(logits).max() < 160
    out = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ref = reference.scaled_dot_product_attention(*(as_f64(x) for x in (q, k, v)), is_causal=causal)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert_close(out, ref, dtype, torch_out, what="large logits")


@pytest.mark.gpu
def test_bshd_views(monkeypatch):
    """q, k, v as (B, S, H, E) tensors transposed to (B, H, S, E) views: read in place by TMA."""
    import cupy_attn
    from cupy_attn import reference
    torch = _torch()
    monkeypatch.setenv(_d512.ENV, "1")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, n, 4, 512, generator=gen, device="cuda").half().transpose(1, 2) for n in (100, 300, 300))
    assert cupy_attn.explain(q, k, v).details["kernel"] == FAMILY.name
    out = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = reference.scaled_dot_product_attention(*(as_f64(x) for x in (q, k, v)), is_causal=True)
    assert_close(out, ref, "float16", torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_auto_rule():
    assert _d512.prefer_grid(4, 16, 2048, 2048, 132)[0]
    assert _d512.prefer_grid(1, 66, 128, 1000, 132)[0]
    assert not _d512.prefer_grid(1, 65, 128, 1000, 132)[0]   # under one wave
    assert not _d512.prefer_grid(8, 32, 1, 32768, 132)[0]    # decode: L < 128
    assert not _d512.prefer_grid(128, 16, 256, 256, 132)[0]  # S <= 512: the scores kernel
    assert not _d512.prefer_grid(1, 2, 300, 700, 132)[0]


@pytest.mark.gpu
def test_auto_takes_it_when_the_grid_fills_the_device(monkeypatch):
    """Unset CUPY_ATTN_D512: auto takes the kernel for a call with S > 512 of at least one CTA per SM, keeps the split
    path for a smaller one (backend="fused" takes the kernel there); CUPY_ATTN_D512=0 turns it off."""
    import cupy_attn
    torch = _torch()
    monkeypatch.delenv(_d512.ENV, raising=False)
    big = torch.randn(2, 8, 2048, 512, device="cuda", dtype=torch.float16)
    assert cupy_attn.explain(big, big, big).details.get("kernel") == FAMILY.name
    q = torch.randn(1, 2, 64, 512, device="cuda", dtype=torch.float16)
    assert cupy_attn.explain(q, q, q).backend == "split"
    assert cupy_attn.explain(q, q, q, backend="fused").details["kernel"] == FAMILY.name
    monkeypatch.setenv(_d512.ENV, "0")
    assert cupy_attn.explain(big, big, big).backend == "split"
    with pytest.raises(ValueError, match="backend='fused'"):
        cupy_attn.explain(q, q, q, backend="fused")
