"""Argument checking, the CPU (reference) path and dispatch decisions: no GPU needed."""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference
from cupy_attn.attention import checks as _checks, dispatch as _dispatch
from cupy_attn.runtime import interop as _interop

SDPA = cupy_attn.scaled_dot_product_attention


def _qkv(B=2, H=4, L=5, S=7, E=8, Ev=8, Hkv=None, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    Hkv = H if Hkv is None else Hkv
    return (rng.standard_normal((B, H, L, E)).astype(dtype), rng.standard_normal((B, Hkv, S, E)).astype(dtype),
            rng.standard_normal((B, Hkv, S, Ev)).astype(dtype))


# --- argument errors: each names the argument (and axis) -----------------------------------------------------------

@pytest.mark.parametrize("change,exc,match", [
    (lambda q, k, v: (q[0, 0], k, v), ValueError, "query must have shape"),
    (lambda q, k, v: (q, k[None], v), ValueError, "same number of axes"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "key batch axis 0"),
    (lambda q, k, v: (q, k[:, :2], v[:, :2]), ValueError, "key heads .axis -3."),
    (lambda q, k, v: (q, k[..., :4], v), ValueError, "key head_dim .axis -1."),
    (lambda q, k, v: (q, k, v[:, :, :3]), ValueError, "value seqlen .axis -2."),
    (lambda q, k, v: (q, k, v[:, :2]), ValueError, "value heads .axis -3."),
    (lambda q, k, v: (q, k.astype(np.float16), v), TypeError, "key dtype"),
    (lambda q, k, v: (q.astype(np.int32), k, v), TypeError, "query must be float16, bfloat16 or float32"),
    (lambda q, k, v: (q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)), TypeError, "query must be"),
    (lambda q, k, v: (q.tolist(), k, v), TypeError, "query must be a torch.Tensor"),
    (lambda q, k, v: (q, "key", v), TypeError, "key must be a torch.Tensor"),
    (lambda q, k, v: (q[..., :0], k[..., :0], v), ValueError, "head_dim .axis -1. must be at least 1"),
])
def test_shape_and_dtype_errors(change, exc, match):
    with pytest.raises(exc, match=match):
        SDPA(*change(*_qkv()))


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"attn_mask": np.ones((5, 6), bool)}, ValueError, "attn_mask axis -1 has size 6"),
    ({"attn_mask": np.ones((3, 5, 7), bool)}, ValueError, "attn_mask axis -3 has size 3"),
    ({"attn_mask": np.ones((1, 1, 1, 1, 5, 7), bool)}, ValueError, "attn_mask has 6 axes"),
    ({"attn_mask": np.ones((5, 7), np.int64)}, TypeError, "attn_mask must be bool"),
    ({"attn_mask": np.ones((5, 7), bool), "is_causal": True}, ValueError, "attn_mask and is_causal"),
    ({"is_causal": "diagonal"}, ValueError, "is_causal must be"),
    ({"dropout_p": 0.1, "generator": "seed"}, TypeError, "generator must be a numpy.random.Generator"),
    ({"dropout_p": True}, TypeError, "dropout_p must be a float"),
    ({"dropout_p": 1.5}, ValueError, "dropout_p must be in"),
    ({"dropout_p": -0.1}, ValueError, "dropout_p must be in"),
    ({"scale": "0.1"}, TypeError, "scale must be a float"),
    ({"backend": "magic"}, ValueError, "backend must be one of"),
])
def test_flag_and_mask_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SDPA(*_qkv(), **kwargs)


def test_float64_error_points_to_the_reference():
    """float64 inputs are refused with the way to compute in float64: the NumPy reference."""
    q = np.zeros((1, 2, 3, 4))
    with pytest.raises(TypeError, match=r"got float64 \(for float64: cupy_attn\.reference\.scaled_dot_product_"):
        SDPA(q, q, q)


def test_gqa_errors():
    q, k, v = _qkv(H=6, Hkv=4)
    with pytest.raises(ValueError, match="query heads .axis -3. = 6 must be a multiple of key/value heads = 4"):
        SDPA(q, k, v, enable_gqa=True)
    q, k, v = _qkv(H=8, Hkv=4)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        SDPA(q, k, v)


def test_device_mismatch_cpu_gpu_is_named():
    torch = pytest.importorskip("torch")
    q, k, v = _qkv()

    class FakeCuda:  # a CUDA __dlpack__ object, without needing a GPU (the check runs before any conversion)
        shape = k.shape

        def __dlpack__(self, stream=None):
            raise AssertionError("must not be converted")

        def __dlpack_device__(self):
            return (2, 0)

    with pytest.raises(ValueError, match="key is on a CUDA device but query is not"):
        SDPA(torch.from_numpy(q), FakeCuda(), torch.from_numpy(v))


# --- the CPU path: NumPy and CPU torch inputs run the float64 reference -------------------------------------------

def test_numpy_path_matches_reference_and_keeps_dtype():
    q, k, v = _qkv(L=6, S=9, Ev=5)
    out, lse = SDPA(q, k, v, is_causal=True, return_lse=True)
    ref, ref_lse = reference.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (2, 4, 6, 5)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


def test_torch_cpu_path_bf16_and_gqa():
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(H=8, Hkv=2)
    tq, tk, tv = (torch.from_numpy(x).to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    out = SDPA(tq, tk, tv, enable_gqa=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.device.type == "cpu"
    expected = torch.nn.functional.scaled_dot_product_attention(tq.double(), tk.double(), tv.double(),
                                                                enable_gqa=True)
    assert (out.double() - expected).abs().max().item() < 2e-2


def test_three_axis_inputs_and_many_leading_axes():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((3, 4, 8), (3, 6, 8), (3, 6, 2)))
    np.testing.assert_allclose(SDPA(q, k, v), reference.scaled_dot_product_attention(q, k, v), rtol=1e-6)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 2, 4, 8), (2, 3, 2, 6, 8), (2, 3, 2, 6, 8)))
    np.testing.assert_allclose(SDPA(q, k, v), reference.scaled_dot_product_attention(q, k, v), rtol=1e-6)


# --- dispatch decisions ------------------------------------------------------------------------------------------

def _gpu_problem(dtype="float16", E=64, Ev=64, mask_kind="none", L=512, S=1024):
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    ctx = _interop.CallContext(_interop.CUPY, 0)
    return _checks.SDPAProblem(ctx=ctx, query=None, key=None, value=None, batch_shape=(2, 8), batch=2, num_heads=8,
                               num_kv_heads=8, seqlen_q=L, seqlen_k=S, head_dim=E, head_dim_v=Ev, dtype=dt, scale=0.1,
                               causal=None, mask_kind=mask_kind)


def test_cpu_inputs_plan_reference():
    plan = cupy_attn.explain(*_qkv())
    assert plan.backend == "reference" and "CPU" in plan.reason


@pytest.mark.parametrize("dtype,E,expected", [
    ("float32", 64, "split"),      # fp32 is served by the split path (3xTF32 GEMMs at fp32 accuracy)
    ("float16", 1024, "split"),    # head dim > 256: the seed workload
    ("bfloat16", 512, "split"),
])
def test_auto_plans_split_outside_fused_range(dtype, E, expected):
    plan = _dispatch.plan_sdpa(_gpu_problem(dtype, E, E), "auto", arch=80)
    assert plan.backend == expected, str(plan)
    assert "scores buffer" in plan.details  # sm_80: cuBLAS Q·Kᵀ, the fp32 score buffer, the softmax pass
    if dtype != "float32":  # on Hopper the scores kernel (scores_sm90.unsupported_reason) takes the two steps
        assert "sm_80" in plan.details["scores kernel"], plan.details


@pytest.mark.parametrize("L,S,expected", [(4096, 4096, "4 row band(s), each band's Q·Kᵀ, softmax and P·V stopping at its "
                                                 "last visible key, on 2 streams at once"),
                                           (300, 1024, "1 row band(s)")])
def test_causal_split_plan_names_bands_and_streams(L, S, expected):
    p = _gpu_problem("bfloat16", 512, 512, L=L, S=S)
    p.causal = "top_left"
    details = _dispatch.plan_sdpa(p, "split", arch=80).details
    assert details["causal"].startswith("top_left: " + expected), details
    assert "streams" not in details["causal"] or L == 4096


def test_env_override_and_forced_backends(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_BACKEND, "split")
    assert _dispatch.plan_sdpa(_gpu_problem(), "auto", arch=90).backend == "split"
    monkeypatch.setenv(_dispatch.ENV_BACKEND, "reference")
    plan = _dispatch.plan_sdpa(_gpu_problem(), "auto", arch=90)
    assert plan.backend == "reference" and _dispatch.ENV_BACKEND in plan.reason
    monkeypatch.setenv(_dispatch.ENV_BACKEND, "bogus")
    with pytest.raises(ValueError, match=_dispatch.ENV_BACKEND):
        _dispatch.plan_sdpa(_gpu_problem(), "auto", arch=90)
    monkeypatch.delenv(_dispatch.ENV_BACKEND)
    assert _dispatch.plan_sdpa(_gpu_problem(), "split", arch=90).backend == "split"
    with pytest.raises(ValueError, match="backend='fused' cannot run this call"):
        _dispatch.plan_sdpa(_gpu_problem("float16", 1024, 1024), "fused", arch=90)


@pytest.mark.parametrize("dtype,E,Ev,mask,arch,expected,why", [
    ("float16", 64, 64, "none", 90, "fused", "no L×S score buffer"),
    ("bfloat16", 128, 128, "bool", 90, "fused", "no L×S score buffer"),
    ("float16", 40, 200, "float", 80, "fused", "no L×S score buffer"),    # padded to the 256 bucket
    ("float16", 256, 256, "none", 86, "fused", "no L×S score buffer"),
    ("float16", 320, 320, "none", 90, "split", "instantiated up to 256"),
    ("float16", 64, 300, "none", 90, "split", "instantiated up to 256"),
    ("float32", 64, 64, "none", 90, "split", "fp32 is served by the split path"),
    ("float16", 64, 64, "none", 75, "split", "sm_75"),
])
def test_fused_dispatch_table(dtype, E, Ev, mask, arch, expected, why):
    plan = _dispatch.plan_sdpa(_gpu_problem(dtype, E, Ev, mask_kind=mask), "auto", arch=arch, num_sms=132)
    assert plan.backend == expected and why in plan.reason, str(plan)
    if expected == "fused":
        assert "tile" in plan.details


def test_forced_fused_reports_tile_and_refuses_fp32():
    plan = _dispatch.plan_sdpa(_gpu_problem("float16", 128, 128), "fused", arch=90)
    assert plan.backend == "fused" and plan.details["head-dim bucket"] == 128
    with pytest.raises(ValueError, match="fp32 is served by the split path"):
        _dispatch.plan_sdpa(_gpu_problem("float32", 64, 64), "fused", arch=90)


def test_call_cache_takes_only_torch_cuda_tensors():
    from cupy_attn.runtime import callcache as _callcache
    q, k, v = _qkv()
    args = (None, 0.0, False, None, False, "auto", False, False, None)
    assert _callcache.key(q, k, v, *args) is None
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    assert _callcache.key(tq, tk, tv, *args) is None   # CPU tensors: the reference path, never cached


def test_call_cache_refuses_mixed_kinds():
    from cupy_attn.runtime import callcache as _callcache
    torch = pytest.importorskip("torch")
    q, k, v = _qkv()
    args = (None, 0.0, False, None, False, "auto", False, False, None)
    assert _callcache.key(torch.from_numpy(q), k, v, *args) is None


# --- what CPU inputs cannot do, and arrays of different kinds: refused before anything runs --------------------------

@pytest.mark.parametrize("backend", ["fused", "split"])
def test_cpu_inputs_refuse_gpu_backends(backend):
    q, k, v = _qkv()
    kinds = [(q, k, v)]
    try:
        import torch
        kinds.append(tuple(torch.from_numpy(x) for x in (q, k, v)))
    except ImportError:
        pass
    for args in kinds:
        for call in (SDPA, cupy_attn.explain):
            with pytest.raises(ValueError, match=f"backend='{backend}' needs CUDA inputs: .* run only the float64 "
                                                 r"reference \(pass backend='auto' or 'reference'\)"):
                call(*args, backend=backend)


@pytest.mark.parametrize("env", ["fused", "split", "reference"])
def test_env_backend_does_not_apply_to_cpu_inputs(env, monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_BACKEND, env)
    q, k, v = _qkv()
    assert cupy_attn.explain(q, k, v).backend == "reference"
    np.testing.assert_allclose(SDPA(q, k, v), reference.scaled_dot_product_attention(q, k, v), rtol=1e-6)


def test_numpy_and_torch_mixed_are_refused():
    torch = pytest.importorskip("torch")
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="key is a torch.Tensor but query is a numpy.ndarray: pass one kind of array"):
        SDPA(q, torch.from_numpy(k), v)
    with pytest.raises(TypeError, match="value is a numpy.ndarray but query is a torch.Tensor"):
        SDPA(torch.from_numpy(q), torch.from_numpy(k), v)
    with pytest.raises(TypeError, match="attn_mask is a numpy.ndarray but query is a torch.Tensor"):
        SDPA(*(torch.from_numpy(x) for x in (q, k, v)), attn_mask=np.ones((5, 7), bool))


def test_same_kind_rule_for_gpu_kinds():
    """CuPy next to torch CUDA is refused too (GPU arrays cannot be made here: the rule itself is checked)."""
    with pytest.raises(TypeError, match="key is a cupy.ndarray but query is a torch.Tensor"):
        _interop.check_same_kind("key", _interop.CUPY, "query", _interop.TORCH)
    with pytest.raises(TypeError, match="x is a torch.Tensor but query is a cupy.ndarray"):
        _interop.check_same_kind("x", _interop.TORCH, "query", _interop.CUPY)
    _interop.check_same_kind("key", _interop.DLPACK, "query", _interop.CUPY)   # both come back as CuPy
    _interop.check_same_kind("key", _interop.TORCH_CPU, "query", _interop.TORCH)  # device rule, not kind rule
