"""The variants (window, softcap, sinks, ALiBi) on a machine without a GPU: argument checks, the CPU reference path
through the public API, the CPU autograd path (the sinks' gradient), the plan's routing and explain's lines."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference
from cupy_attn.attention import checks as _checks
from cupy_attn.attention import dispatch as _dispatch
from cupy_attn.attention import variants as _variants
from cupy_attn.runtime import interop as _interop


def _qkv(B=2, Hq=4, Hkv=2, L=9, S=13, E=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, L, E)).astype(np.float32), rng.standard_normal((B, Hkv, S, E)).astype(np.float32),
            rng.standard_normal((B, Hkv, S, E)).astype(np.float32))


@pytest.mark.parametrize("kw,exc,match", [
    (dict(window_size=(1,)), ValueError, "window_size must be a pair"),
    (dict(window_size=(1.5, 0)), ValueError, "window_size left"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number"),
    (dict(softcap="50"), TypeError, "softcap must be a float"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(sinks=np.zeros(3, np.float32)), ValueError, r"sinks must have shape \(Hq,\) = \(4,\)"),
    (dict(sinks=np.zeros(4, np.int32)), TypeError, "sinks must be float32"),
    (dict(alibi_slopes=np.zeros((3, 4), np.float32)), ValueError, r"alibi_slopes must have shape"),
    (dict(alibi_slopes=np.zeros(4, np.float16)), TypeError, "alibi_slopes must be float32"),
])
def test_bad_variant_arguments_name_the_argument(kw, exc, match):
    with pytest.raises(exc, match=match):
        cupy_attn.scaled_dot_product_attention(*_qkv(), enable_gqa=True, **kw)


def test_numpy_calls_run_the_reference_with_every_variant():
    q, k, v = _qkv()
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    slopes = np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]], np.float32)
    out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal="bottom_right", enable_gqa=True,
                                                      window_size=(3, 1), softcap=2.0, sinks=sinks,
                                                      alibi_slopes=slopes, return_lse=True)
    ref, ref_lse = reference.scaled_dot_product_attention(q, k, v, is_causal="bottom_right", enable_gqa=True,
                                                          window_size=(3, 1), softcap=2.0, sinks=sinks,
                                                          alibi_slopes=slopes, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-6)


def test_softcap_zero_and_infinite_window_are_plain():
    q, k, v = _qkv(Hkv=4)
    p = _checks.check_sdpa(q, k, v, None, 0.0, False, None, False, "auto", None, None, 0.0, None, None)
    assert p.variants.plain
    p = _checks.check_sdpa(q, k, v, None, 0.0, False, None, False, "auto", None, (-1, -1))
    assert p.variants.plain and p.window_lo == _variants.UNBOUNDED_LO and p.key_upper == (False, 0)


def test_key_bounds_combine_causal_and_window():
    q, k, v = _qkv(L=5, S=8, Hkv=4)
    # window (2, 1) bottom-right aligned: i + 3 - 2 <= j <= i + 3 + 1; top-left causal: j <= i.
    p = _checks.check_sdpa(q, k, v, None, 0.0, True, None, False, "auto", None, (2, 1))
    assert p.key_upper == (True, 0) and p.window_lo == 1 and p.visible_offset == 0
    p = _checks.check_sdpa(q, k, v, None, 0.0, False, None, False, "auto", None, (2, 1))
    assert p.key_upper == (True, 4) and p.window_lo == 1
    keep = reference.visible_keys(5, 8, False, (2, 1))
    lo, hi = p.window_lo, p.key_upper[1]
    assert all(keep[i, j] == (i + lo <= j <= i + hi) for i in range(5) for j in range(8))


def test_cpu_autograd_gives_the_sinks_gradient():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in _qkv(Hkv=4))  # float32: the CPU path computes in float64
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float32, requires_grad=True)
    out = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=(4, 0), sinks=sinks)
    out.pow(2).sum().backward()
    # The same function written out in torch ops: the sink column in the softmax.
    q2, k2, v2, s2 = (x.detach().double().requires_grad_() for x in (q, k, v, sinks))
    keep = torch.from_numpy(reference.visible_keys(9, 13, True, (4, 0)))
    s = (q2 @ k2.transpose(-1, -2)) / 8 ** 0.5
    s = s.masked_fill(~keep, float("-inf"))
    s = torch.cat([s, s2.reshape(1, 4, 1, 1).expand(2, 4, 9, 1)], dim=-1)
    ref = torch.softmax(s, dim=-1)[..., :-1] @ v2
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad), (sinks.grad, s2.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_sinks_grad_formula():
    """autograd.sinks_grad: −Σ e^(sink − lse)·rowsum(dO∘O) against torch's own derivative of the softmax."""
    torch = pytest.importorskip("torch")
    from cupy_attn.attention import autograd
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64)
    sinks = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    logits = torch.cat([s, sinks.reshape(1, 3, 1, 1).expand(2, 3, 5, 1)], dim=-1)
    out = torch.softmax(logits, -1)[..., :-1] @ v
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * dout).sum().backward()
    lse = torch.logsumexp(logits, -1)
    torch.testing.assert_close(autograd.sinks_grad(sinks.detach(), out.detach(), lse, dout), sinks.grad)


def _gpu_problem(E=128, Ev=None, dtype="float16", L=4096, S=4096, causal="top_left", window=None, softcap=None,
                 sinks=False, slopes=False, dropout_p=0.0):
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    ctx = _interop.CallContext(_interop.CUPY, 0)
    left, right = reference.window_bounds(window)
    var = _variants.Variants(left, right, softcap, np.zeros(8, np.float32) if sinks else None,
                             np.zeros(8, np.float32) if slopes else None)
    return _checks.SDPAProblem(ctx=ctx, query=None, key=None, value=None, batch_shape=(2, 8), batch=2, num_heads=8,
                               num_kv_heads=8, seqlen_q=L, seqlen_k=S, head_dim=E, head_dim_v=Ev or E, dtype=dt,
                               scale=E ** -0.5, causal=causal, dropout_p=dropout_p, variants=var)


def test_plan_sends_variants_to_the_fa3_kernel_on_hopper():
    plan = _dispatch.plan_sdpa(_gpu_problem(window=(1024, 0), sinks=True), "auto", arch=90, num_sms=132)
    assert plan.backend == "fused" and plan.kernel.__name__.endswith("flash_fwd_sm90")
    assert plan.choice.variants and plan.choice.mode == "3" and plan.choice.tile.persistent
    text = str(plan)
    assert "window (1024, 0)" in text and "sinks" in text and "skipped tiles" in text
    # a small call too (the wgmma kernel, below the FA3 size threshold, has no variants)
    small = _dispatch.plan_sdpa(_gpu_problem(L=256, S=256, softcap=30.0), "auto", arch=90, num_sms=132)
    assert small.kernel.__name__.endswith("flash_fwd_sm90") and small.choice.variants


@pytest.mark.parametrize("kw,arch", [
    (dict(window=(128, 0), dropout_p=0.1), 90),      # no fused kernel has variants with dropout
    (dict(window=(128, 0)), 80),                     # Ampere: the variants are the split path's
    (dict(E=1000, softcap=20.0), 90),                # head dims above 512
    (dict(E=512, softcap=20.0), 90),                 # the head-dim-512 kernel has no softcap
    (dict(E=128, dtype="float32", window=(64, 64)), 90),
])
def test_plan_sends_other_variant_calls_to_the_split_path(kw, arch):
    plan = _dispatch.plan_sdpa(_gpu_problem(**kw), "auto", arch=arch, num_sms=132)
    assert plan.backend == "split", str(plan)
    assert "softmax kernel" in plan.details["variants"] and "scores kernel" in plan.details
    with pytest.raises(ValueError, match="backend='fused' cannot run this call"):
        _dispatch.plan_sdpa(_gpu_problem(**kw), "fused", arch=arch, num_sms=132)


def test_plan_sends_hd512_windows_to_its_variant_instantiation():
    plan = _dispatch.plan_sdpa(_gpu_problem(E=512, L=8192, S=8192, window=(1024, 0)), "auto", arch=90, num_sms=132)
    assert plan.kernel.__name__.endswith("flash_fwd_d512_sm90") and plan.choice.variants
    assert not plan.choice.persistent and "skipped tiles" in str(plan)


def test_tile_visibility_counts_the_window():
    # L = S = 8192, window 1024 causal, 128 × 128 tiles: each row block sees its diagonal block and the 8 before it
    # (its first row's window starts 1024 keys back), fewer at the start.
    p = _gpu_problem(window=(1024, 0), L=8192, S=8192)
    total, seen = _dispatch.tile_visibility(p, 128, 128)
    assert total == 64 * 64 and seen == sum(min(m, 8) + 1 for m in range(64))
    p = _gpu_problem(window=None, L=8192, S=8192)
    assert _dispatch.tile_visibility(p, 128, 128) == (4096, 64 * 65 // 2)


def test_backward_of_window_softcap_alibi_is_refused_clearly():
    with pytest.raises(NotImplementedError, match="backward of window .* Hopper backward kernel only"):
        _dispatch.plan_backward(_gpu_problem(window=(128, 0)), arch=80)
    plan = _dispatch.plan_backward(_gpu_problem(E=200, sinks=True), arch=80)  # sinks need nothing of the kernels
    assert plan.kernel == "split"


def test_backend_split_and_empty_calls_keep_their_paths_with_variants(monkeypatch):
    """backend="split" (or CUPY_ATTN_BACKEND=split) runs a variant call on the split path even where the FA3 kernel
    could take it; an empty variant call plans "empty" under every backend (its arrays are never looked at)."""
    assert _dispatch.plan_sdpa(_gpu_problem(window=(128, 0)), "split", arch=90, num_sms=132).backend == "split"
    monkeypatch.setenv("CUPY_ATTN_BACKEND", "split")
    assert _dispatch.plan_sdpa(_gpu_problem(window=(128, 0)), "auto", arch=90, num_sms=132).backend == "split"
    monkeypatch.delenv("CUPY_ATTN_BACKEND")
    for backend in ("auto", "fused", "split"):
        for shape in (dict(L=0), dict(S=0)):
            p = _gpu_problem(window=(128, 0), sinks=True, **shape)
            p.query = object()  # an empty call keeps the caller's arrays: the plan must not read them
            assert _dispatch.plan_sdpa(p, backend, arch=90, num_sms=132).backend == "empty", (backend, shape)


def test_custom_op_window_is_checked_as_eager():
    torch = pytest.importorskip("torch")
    from cupy_attn import torch_ops
    assert torch_ops.window_to_ints(None) == (-1, -1)
    assert torch_ops.window_to_ints((5, None)) == (5, -1)
    with pytest.raises(ValueError, match="window_size left"):
        torch_ops.window_to_ints((2.5, 0))
