"""The P·V kernel (cupy_attn.attention.kernels.pv_sm90, cuda_src/attention/pv_sm90.cu): out = P V after the split path's
scores kernel, each 64-row block stopping at its visible keys (causal calls at head dims above 256 and S ≤ 512).

CPU: every instantiation compiles for sm_90a without spills or ptxas performance warnings; its SASS holds HGMMA
64x256x16, TMA loads, 16-byte stores and no local memory; key_steps against a brute force over the rows of each block;
the launch writes the struct the kernel reads; reason's answers.
GPU (``gpu`` marker): the kernel alone on P whose keys past each block's last step are NaN (the kernel must not read
them) and whose out is NaN-poisoned with a poisoned tail (every row below L written, nothing past it), against
float64 P·V with torch's same-precision matmul as the error bound; the public call goes through it (explain names it)
in tests/test_scores_sm90.py's causal cases.

    PYTHONPATH=. timeout 600 python3 -m pytest -m gpu tests/test_pv_sm90.py -x
"""
import numpy as np
import pytest

from cupy_attn.attention import checks
from cupy_attn.attention.kernels import pv_sm90 as _pv
from cupy_attn.runtime import compile_check

from _tolerance import as_f64, assert_close
from test_flash_fwd_sm90 import _FakeArray, _bhsd, _cuobjdump, sass_summary, sass_text
from _compile_checks import assert_clean
from _launch_fake import FakeKernel, LaunchRecorder, assert_same_struct, blob

FAMILY = _pv.PV_SM90
DTYPES = ("float16", "bfloat16")

# ---------------------------------------------------------------------------------------------------------------------
# CPU


def test_every_instantiation_compiles_without_spills():
    reports = compile_check.compile_family(FAMILY, "sm_90a")
    assert len(reports) == len(DTYPES)
    assert_clean(reports, max_registers=168)


def test_sass_has_wgmma_tma_16_byte_stores_and_no_local_memory():
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    cubin = compile_check.family_cubin(FAMILY, "sm_90a")
    kernels, listings = sass_summary(cubin), sass_text(cubin)
    assert len(kernels) == len(DTYPES)
    for name, ops in kernels.items():
        text = listings[name]
        assert "HGMMA.64x256x16.F32" in text, name
        assert "STG.E.128" in text, f"{name}: out not stored by 16-byte STG"
        for op in ("UTMALDG", "SYNCS", "USETMAXREG"):
            assert ops.get(op, 0) > 0, f"{name}: no {op}"
        for op in ("LDL", "STL"):
            assert op not in ops, f"{name}: local memory ({op}: {ops[op]})"


@pytest.mark.parametrize("L,S,offset", [(512, 512, 0), (130, 200, 0), (200, 300, 100), (300, 100, -200),
                                         (1, 1, 0), (77, 40, 0), (1000, 512, -488), (100, 450, None)])
def test_key_steps_cover_every_visible_key_of_the_block(L, S, offset):
    """key_steps(m0) · 64 ≥ the visible keys of every row of the block (none missed), and < them + 64 (no step
    wholly past them), 0 when no row of the block sees a key."""
    for m0 in range(0, L + 64, 64):
        rows = np.arange(m0, min(m0 + 64, L))
        vis = 0 if rows.size == 0 else (S if offset is None else int(np.clip(rows + offset + 1, 0, S).max()))
        steps = _pv.key_steps(L, S, m0, offset)
        assert steps * 64 >= vis and (steps == 0 or (steps - 1) * 64 < vis), (m0, vis, steps)


def test_launch_writes_the_struct_the_kernel_reads_cpu(monkeypatch):
    """build_launch's replay: the kernel gets the struct with the maps of the call's P and V and out's base, the grid,
    384 threads and its shared memory on the caller's stream; maps are encoded again only when a base moves."""
    rec = LaunchRecorder(monkeypatch, _pv._PARAMS)
    params = np.zeros((), dtype=_pv._PARAMS)
    params["seqlen_q"], params["seqlen_k"], params["head_dim_v"], params["is_causal"] = 512, 512, 1024, 1
    kernel = FakeKernel(99)
    obj = _pv.build_launch(kernel, params, (rec.spec(1), rec.spec(2)), (132, 1, 1))
    assert kernel.max_dynamic_shared_size_bytes == _pv.smem_bytes() <= 232448
    for p_ptr, v_ptr, o_ptr, stream in ((16, 32, 48, 7), (16, 32, 64, 7), (80, 32, 64, 9)):
        obj.launch_on(stream, p_ptr, v_ptr, o_ptr)
        want = params.copy()
        want["tma_p"], want["tma_v"], want["out"] = blob(1, p_ptr), blob(2, v_ptr), o_ptr
        fn_ptr, dims, got_stream, got, extra = rec.calls[-1]
        assert (fn_ptr, dims, got_stream, extra) == (99, (132, 1, 1, 384, 1, 1, _pv.smem_bytes()), stream, 0)
        assert_same_struct(got, want)
    assert rec.encoded == [(1, 16), (2, 32), (1, 80), (2, 32)]


def _problem(**kw):
    import types
    p = dict(query=_bhsd(32, 32, 512, 1024), value=_bhsd(32, 32, 512, 1024), causal="top_left", seqlen_k=512,
             batch=32, num_heads=32, seqlen_q=512, head_dim_v=1024)
    return types.SimpleNamespace(**{**p, **kw})


def _reason(p, out=None):
    """pv_sm90.reason in CUPY_ATTN_SPLIT_PV's mode; out None: an out of the value's layout."""
    return _pv.reason(p, out if out is not None else p.value, _pv.setting())


def _pv_problem(v, L, causal):
    """What build() reads of a problem: the value, L and the causal limit."""
    import types
    return types.SimpleNamespace(value=v, seqlen_q=L, causal=causal,
                                 causal_offset=checks.causal_offset(causal, L, v.shape[2]))


def test_pv_reasons(monkeypatch):
    monkeypatch.delenv(_pv.ENV, raising=False)
    assert _reason(_problem()) is None
    assert _reason(_problem(causal="bottom_right"), _bhsd(2, 4, 512, 1024)) is None
    padded = _FakeArray((2, 4, 512, 1020), (4 * 512 * 2048, 512 * 2048, 2048, 2))  # Ev = 1020 in rows of 1024
    assert _reason(_problem(causal=None, seqlen_k=300)) is None  # cuBLAS is slow at K % 8 != 0
    assert _reason(_problem(causal=None, batch=1, num_heads=8)) is None  # a small call
    for kw, out, words in (({"causal": None, "seqlen_k": 512}, None, "not causal"), ({}, padded, "multiple of 8"),
                           ({"value": _bhsd(2, 4, 512, 1020)}, None, "stride along s"),
                           ({"value": _bhsd(2, 4, 512, 1024, ptr=(1 << 20) + 8)}, None, "16-byte"),
                           ({}, _bhsd(2, 4, 512, 1024, ptr=(1 << 20) + 4), "16-byte")):
        why = _reason(_problem(**kw), out)
        assert why is not None and words in why, (kw, why)
    monkeypatch.setenv(_pv.ENV, "0")
    assert _pv.ENV in _reason(_problem())
    monkeypatch.setenv(_pv.ENV, "2")  # every call it can serve
    assert _reason(_problem(causal=None)) is None


def test_switch_is_part_of_the_call_cache_key():
    from cupy_attn.runtime import callcache
    assert _pv.ENV in callcache.ENV_KEYS, "a cached call must not replay the other P·V after CUPY_ATTN_SPLIT_PV changes"


# ---------------------------------------------------------------------------------------------------------------------
# GPU


def _torch():
    return pytest.importorskip("torch")


CASES = [  # B, Hq, Hkv, L, S, Ev, causal
    (2, 4, 4, 512, 512, 1024, "top_left"),     # the seed's causal variant with fewer heads
    (1, 4, 2, 130, 200, 320, "top_left"),      # GQA, a partial m tile and a partial n tile
    (2, 2, 2, 200, 300, 512, "bottom_right"),
    (1, 2, 2, 300, 100, 264, "bottom_right"),  # L > S: the first 200 rows see no key (out 0); Ev = 256 + 8
    (1, 1, 1, 1, 1, 256, "top_left"),
    (1, 3, 1, 77, 40, 384, "top_left"),        # S < one key step
    (1, 2, 2, 1000, 512, 640, "bottom_right"),
    (2, 2, 2, 100, 450, 512, None),            # every key
    (3, 40, 8, 256, 256, 512, "top_left"),     # more tiles than SMs: CTAs stride over ~4 tiles each
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,L,S,Ev,causal", CASES)
def test_kernel(B, Hq, Hkv, L, S, Ev, causal, dtype):
    import cupy
    torch = _torch()
    dt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(L * 7 + S)
    ld = -(-S // 8) * 8
    offset = None if causal is None else (0 if causal == "top_left" else S - L)
    visible = np.ones((L, S), bool) if offset is None else np.arange(S)[None, :] <= np.arange(L)[:, None] + offset
    # What the kernel may read: keys below each block's last step (past them P is NaN here: must not be read).
    readable = np.zeros((L, ld), bool)
    for m0 in range(0, L, 64):
        readable[m0:m0 + 64, :min(ld, 64 * _pv.key_steps(L, S, m0, offset))] = True
    P = torch.rand(B, Hq, L, ld, generator=gen, device="cuda")
    P = P / P[..., :S].sum(-1, keepdim=True)  # rows of probabilities
    vis_ld = np.zeros((L, ld), bool)
    vis_ld[:, :S] = visible
    P = torch.where(torch.as_tensor(vis_ld, device="cuda"), P, 0.0)
    P = torch.where(torch.as_tensor(readable, device="cuda"), P, float("nan")).to(dt).contiguous()
    v = torch.randn(B, Hkv, S, Ev, generator=gen, device="cuda").to(dt)
    # out with 64 poisoned rows after each head's L (a padded head stride): a write past row L would land there
    out_all = torch.full((B, Hq, L + 64, Ev), float("nan"), dtype=dt, device="cuda")
    out = out_all[:, :, :L]
    launch = _pv.build(_pv_problem(cupy.from_dlpack(v), L, causal), cupy.from_dlpack(out), ld=ld)
    launch.launch_on(cupy.cuda.get_current_stream().ptr, P.data_ptr(), v.data_ptr(), out.data_ptr())
    torch.cuda.synchronize()
    assert bool(torch.isnan(out_all[:, :, L:]).all()), "the kernel wrote past a head's last row"
    assert not bool(torch.isnan(out).any()), "a row of out was not written, or a NaN of P was read"
    p_used = torch.nan_to_num(P[..., :S], nan=0.0)
    v_rep = v.repeat_interleave(Hq // Hkv, dim=1)
    ref = as_f64(p_used) @ as_f64(v_rep)
    torch_out = torch.matmul(p_used, v_rep)
    assert_close(out, ref, dtype, torch_out, what=f"P·V {causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,L,S,E,mask", [
    (2, 4, 4, 512, 512, 1024, False),   # the seed with fewer heads
    (2, 8, 2, 130, 300, 320, False),    # GQA, partial tiles
    (2, 4, 4, 200, 450, 512, True),     # a key-padding mask (the masked scores kernel's 256-key tile)
])
def test_public_api_all_keys(B, Hq, Hkv, L, S, E, mask, dtype, monkeypatch):
    """A non-causal call through the scores kernel and this kernel (CUPY_ATTN_SPLIT_PV=2): explain() names it; out
    against float64 with torch's same-precision error as the bound; a second call replays."""
    import cupy_attn
    from cupy_attn import reference
    torch = _torch()
    monkeypatch.setenv(_pv.ENV, "2")
    gen = torch.Generator(device="cuda").manual_seed(L + S + E)
    dt = getattr(torch, dtype)
    for call in range(2):
        q = torch.randn(B, Hq, L, E, generator=gen, device="cuda").to(dt)
        k, v = (torch.randn(B, Hkv, S, E, generator=gen, device="cuda").to(dt) for _ in range(2))
        m = (torch.rand(B, 1, 1, S, generator=gen, device="cuda") > 0.2) if mask else None
        plan = cupy_attn.explain(q, k, v, attn_mask=m, enable_gqa=Hq != Hkv, backend="split")
        assert "pv_sm90" in plan.details["schedule"], str(plan)
        out = cupy_attn.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=Hq != Hkv, backend="split")
        ref = reference.scaled_dot_product_attention(*(as_f64(x) for x in (q, k, v)),
                                                     attn_mask=None if m is None else m.cpu().numpy(),
                                                     enable_gqa=Hq != Hkv)
        torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=Hq != Hkv)
        assert_close(out, ref, dtype, torch_out, what=f"all keys call {call}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, "bottom_right"])
def test_public_api_bshd_views(causal):
    """query/key/value as (B, S, H, D) buffers viewed as (B, H, S, D) (strided along heads and rows): the scores kernel
    and this kernel read them in place by their strides; out against float64."""
    import cupy_attn
    from cupy_attn import reference
    torch = _torch()
    gen = torch.Generator(device="cuda").manual_seed(7)
    B, Hq, Hkv, L, S, E = 2, 4, 2, 150, 260, 320
    q = torch.randn(B, L, Hq, E, generator=gen, device="cuda").half().transpose(1, 2)
    k, v = (torch.randn(B, S, Hkv, E, generator=gen, device="cuda").half().transpose(1, 2) for _ in range(2))
    plan = cupy_attn.explain(q, k, v, is_causal=causal, enable_gqa=True, backend="split")
    assert "pv_sm90" in plan.details["schedule"], str(plan)
    out = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, backend="split")
    ref = reference.scaled_dot_product_attention(*(as_f64(x) for x in (q, k, v)), is_causal=causal, enable_gqa=True)
    torch_out = None
    if causal is True:
        torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close(out, ref, "float16", torch_out, what=f"BSHD views causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [3, 1], ids=lambda m: f"variant{m}")
@pytest.mark.parametrize("B,Hq,Hkv,L,S,E,causal", [
    (1, 4, 4, 512, 512, 1024, True),            # the seed's causal variant with fewer heads (pair tiles)
    (2, 4, 2, 450, 512, 320, True),             # L off the 64-row grid
    (1, 4, 4, 1000, 512, 384, "bottom_right"),  # L > S: rows that see no key
    (2, 40, 40, 200, 300, 512, True),           # more tiles than SMs
    (2, 4, 4, 200, 300, 512, None),             # S % 8 != 0: P·V on the kernel without a mask
])
def test_public_api_on_poisoned_scratch(B, Hq, Hkv, L, S, E, causal, variant, monkeypatch):
    """Every scratch buffer (P) starts as NaN: the scores kernel must write each key the P·V kernel reads (the
    persistent kernel no longer writes P's zeros past each block's visible keys), whatever its tiles (pair tiles, one
    tile per row block with variant 1)."""
    import cupy_attn
    from cupy_attn import reference
    from cupy_attn.attention.kernels import scores_sm90
    from cupy_attn.runtime import workspace
    torch = _torch()
    real = workspace.scratch

    def poisoned(ctx, nbytes):
        holder, ptr = real(ctx, nbytes)
        torch.cuda.current_stream().synchronize()
        import cupy
        cupy.cuda.runtime.memset(ptr, 0xFF, nbytes)  # all-ones bytes: NaN in fp16 and bf16
        return holder, ptr

    monkeypatch.setattr(workspace, "scratch", poisoned)
    monkeypatch.setenv(scores_sm90.ENV_SPLIT_FUSED, str(variant))
    gen = torch.Generator(device="cuda").manual_seed(L + S + E)
    q = torch.randn(B, Hq, L, E, generator=gen, device="cuda").half()
    k, v = (torch.randn(B, Hkv, S, E, generator=gen, device="cuda").half() for _ in range(2))
    plan = cupy_attn.explain(q, k, v, is_causal=causal or False, enable_gqa=Hq != Hkv, backend="split")
    assert "pv_sm90" in plan.details["schedule"], str(plan)
    out = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal or False, enable_gqa=Hq != Hkv,
                                                 backend="split")
    ref = reference.scaled_dot_product_attention(*(as_f64(x) for x in (q, k, v)), is_causal=causal or False,
                                                 enable_gqa=Hq != Hkv)
    torch_out = None
    if causal != "bottom_right":
        torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal),
                                                                     enable_gqa=Hq != Hkv)
    assert_close(out, ref, "float16", torch_out, what=f"poisoned scratch causal={causal} variant {variant}")
