"""Fused Linear → BatchNorm1d → scale → softmax (issue 4): reference, argument errors, module, kernels.

CPU tests pin the float64 reference to torch's own float64 CPU module (both modes, running stats over several steps)
and check errors and the module's state_dict. GPU tests compare the fused op with the reference and with torch's
module in the same precision: our error may be at most 2× torch's max error plus rounding noise: one output ulp, and
the error that the GEMM's fp32 accumulation alone may cause in each element (``_gemm_rounding_noise``), which
dominates where large logits nearly tie.
"""
from __future__ import annotations

import copy
import ctypes
import zlib

import numpy as np
import pytest

from cupy_attn import reference
from cupy_attn.linear_bn_softmax import api as lbs_api, backward as lbs_bwd, checks as lbs_checks, launch as lbs
from cupy_attn.linear_bn_softmax import linear_batchnorm_softmax
from cupy_attn.runtime import callcache as _callcache, compile as _compile, compile_check, interop
from cupy_attn.runtime.kernel_abi import C_TYPE

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from cupy_attn.torch import LinearBatchNormSoftmax  # noqa: E402


class Model(nn.Module):
    """The plain model of the workload (issue 4)."""

    def __init__(self, in_features, out_features, bias=True, **bn_kw):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features, bias=bias)
        self.bn = nn.BatchNorm1d(out_features, **bn_kw)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return torch.softmax(self.scale * self.bn(self.gemm(x)), dim=1)


def _randomize(model, gen, scale_value=None):
    """Non-trivial parameters and running stats (never zeros / ones), deterministic from ``gen``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * 0.5
                    + (1.0 if name in ("bn.weight", "scale") else 0.0))
        if scale_value is not None:
            model.scale.fill_(scale_value)
        bn = model.bn
        if bn.running_mean is not None:
            bn.running_mean.copy_(torch.randn(bn.running_mean.shape, generator=gen, dtype=torch.float64) * 0.3)
            bn.running_var.copy_(torch.rand(bn.running_var.shape, generator=gen, dtype=torch.float64) * 2 + 0.5)
    return model


def _state(model):
    """Everything the functional op takes, from a (plain or fused) model."""
    bn = model.bn
    return dict(weight=model.gemm.weight, bias=model.gemm.bias, running_mean=bn.running_mean,
                running_var=bn.running_var, bn_weight=bn.weight, bn_bias=bn.bias, scale=model.scale)


def _np(t):
    return None if t is None else t.detach().cpu().double().numpy()


def _reference_step(model, x):
    """The float64 reference on the model's current values (nothing modified)."""
    s = _state(model)
    bn = model.bn
    nbt = int(bn.num_batches_tracked) if bn.num_batches_tracked is not None else None
    return reference.linear_batchnorm_softmax(
        _np(x), _np(s["weight"]), _np(s["bias"]), _np(s["running_mean"]), _np(s["running_var"]),
        _np(s["bn_weight"]), _np(s["bn_bias"]), _np(s["scale"]), training=bn.training, momentum=bn.momentum,
        eps=bn.eps, num_batches_tracked=nbt)


# ---------------------------------------------------------------------------------------------------------------------
# CPU: reference vs torch float64

BN_CONFIGS = [
    dict(),
    dict(momentum=None),
    dict(affine=False),
    dict(track_running_stats=False),
    dict(momentum=0.3, eps=1e-3),
]


@pytest.mark.parametrize("bn_kw", BN_CONFIGS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
@pytest.mark.parametrize("shape", [(2, 5, 3), (7, 33, 10), (64, 16, 100)])
def test_reference_matches_torch_float64_over_steps(shape, bn_kw):
    n, k, f = shape
    gen = torch.Generator().manual_seed(n * 1000 + f)
    model = _randomize(Model(k, f, **bn_kw).double(), gen)
    for step in range(5):
        x = torch.randn(n, k, generator=gen, dtype=torch.float64) * 2
        model.train(step != 3)  # one eval step in the middle
        out, rm, rv, nbt = _reference_step(model, x)
        with torch.no_grad():
            expect = model(x)
        np.testing.assert_allclose(out, expect.numpy(), rtol=1e-12, atol=1e-15)
        if model.bn.running_mean is not None:
            np.testing.assert_allclose(rm, model.bn.running_mean.numpy(), rtol=1e-12, atol=1e-15)
            np.testing.assert_allclose(rv, model.bn.running_var.numpy(), rtol=1e-12, atol=1e-15)
            assert nbt == int(model.bn.num_batches_tracked)


def test_reference_scale_per_feature_and_large_logits():
    gen = torch.Generator().manual_seed(7)
    model = _randomize(Model(16, 40).double(), gen)
    model.scale = nn.Parameter(torch.rand(40, generator=gen, dtype=torch.float64) * 2000 - 1000)  # |logit| ~ 1e3
    x = torch.randn(9, 16, generator=gen, dtype=torch.float64)
    out, *_ = _reference_step(model, x)
    with torch.no_grad():
        expect = model(x)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expect.numpy(), rtol=1e-10, atol=1e-300)


# Gradient configurations: (name, Model keyword arguments, scale shape "1" or "F").
GRAD_CONFIGS = [
    ("default", dict(), "1"),
    ("no_bias", dict(bias=False), "1"),
    ("affine=False", dict(affine=False), "1"),
    ("scale_F", dict(), "F"),
    ("no_running_stats", dict(track_running_stats=False), "1"),
    ("momentum=None,scale_F,no_bias", dict(momentum=None, bias=False), "F"),
]


def _grad_model(k, f, model_kw, scale_shape, gen):
    """A randomized plain Model of a GRAD_CONFIGS entry (float32, CPU)."""
    model = _randomize(Model(k, f, **model_kw), gen)
    if scale_shape == "F":
        model.scale = nn.Parameter(torch.rand(f, generator=gen) * 3 + 0.2)
    return model


def _model_grads(model, x, grad_out):
    """(out, grads) of ``model`` (plain or fused) at x for the output gradient grad_out, by torch autograd: grads keyed
    like reference.linear_batchnorm_softmax_backward (None for absent parameters)."""
    x = x.detach().requires_grad_(True)
    inputs = {"x": x, "weight": model.gemm.weight, "bias": model.gemm.bias, "bn_weight": model.bn.weight,
              "bn_bias": model.bn.bias, "scale": model.scale}
    for p in model.parameters():
        p.grad = None
    out = model(x)
    out.backward(grad_out)
    return out, {key: None if v is None else v.grad for key, v in inputs.items()}


def _saved_stats(model, x, training):
    """(y, mean, invstd) in float64 as the forward normalizes: y = x·Wᵀ without the bias, and the bias-free mean."""
    s = {key: _np(v) for key, v in _state(model).items()}
    y = _np(x) @ s["weight"].T
    bias = 0.0 if s["bias"] is None else s["bias"]
    if training or s["running_mean"] is None:
        mean, var = y.mean(axis=0), y.var(axis=0)
    else:
        mean, var = s["running_mean"] - bias, s["running_var"]
    return y, mean, 1.0 / np.sqrt(var + model.bn.eps)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name, model_kw, scale_shape", GRAD_CONFIGS, ids=[c[0] for c in GRAD_CONFIGS])
@pytest.mark.parametrize("shape", [(2, 5, 3), (9, 7, 40), (33, 16, 1)])
def test_reference_backward_matches_torch_float64(shape, name, model_kw, scale_shape, training):
    n, k, f = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, name, training)).encode()))
    model = _grad_model(k, f, model_kw, scale_shape, gen).double().train(training)
    x = torch.randn(n, k, generator=gen, dtype=torch.float64) * 2
    grad_out = torch.randn(n, f, generator=gen, dtype=torch.float64)
    y, mean, invstd = _saved_stats(model, x, training)  # before the step updates the running stats
    s = {key: _np(v) for key, v in _state(model).items()}
    out, expect = _model_grads(model, x, grad_out)
    got = reference.linear_batchnorm_softmax_backward(
        _np(grad_out), _np(x), s["weight"], _np(out), y, mean, invstd, s["bn_weight"], s["bn_bias"], s["scale"],
        use_batch_stats=training or s["running_mean"] is None)
    for key, want in expect.items():
        if want is None:
            continue
        assert got[key].shape == tuple(want.shape), key
        np.testing.assert_allclose(got[key], want.numpy(), rtol=1e-9, atol=1e-12, err_msg=key)


@pytest.mark.parametrize("kind", ["numpy", "torch_cpu"])
@pytest.mark.parametrize("training", [True, False])
def test_public_cpu_path_updates_in_place(kind, training):
    gen = torch.Generator().manual_seed(3)
    plain = _randomize(Model(12, 20, momentum=None), gen)
    plain.train(training)
    x = torch.randn(6, 12, generator=gen)
    args = {k: (v.detach().clone() if v is not None else None) for k, v in _state(plain).items()}
    nbt = plain.bn.num_batches_tracked.detach().clone().reshape(1)
    if kind == "numpy":
        args = {k: v.numpy() for k, v in args.items()}
        x_in, nbt = x.numpy(), nbt.numpy()
    else:
        x_in = x
    out = linear_batchnorm_softmax(x_in, training=training, momentum=None, eps=plain.bn.eps, num_batches_tracked=nbt,
                                   **args)
    with torch.no_grad():
        expect = plain(x)
    assert type(out) is type(x_in) and tuple(out.shape) == (6, 20) and out.dtype == x_in.dtype
    np.testing.assert_allclose(np.asarray(out), expect.numpy(), rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(args["running_mean"]), plain.bn.running_mean.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(args["running_var"]), plain.bn.running_var.numpy(), rtol=1e-5, atol=1e-7)
    assert int(np.asarray(nbt).ravel()[0]) == int(plain.bn.num_batches_tracked)


def _functional(model, x, **kw):
    """linear_batchnorm_softmax on a model's parameters and buffers, with the module's train/eval semantics."""
    bn = model.bn
    return linear_batchnorm_softmax(x, **_state(model), training=bn.training, momentum=bn.momentum, eps=bn.eps,
                                    num_batches_tracked=bn.num_batches_tracked if bn.training else None, **kw)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name, model_kw, scale_shape", GRAD_CONFIGS, ids=[c[0] for c in GRAD_CONFIGS])
def test_cpu_tensors_requiring_grad_take_the_differentiable_reference(name, model_kw, scale_shape, training):
    """CPU torch tensors that autograd records: gradients of the reference math (float64 torch ops) reach every
    argument, and the running stats update in place as without autograd."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((name, training)).encode()))
    plain = _grad_model(12, 20, model_kw, scale_shape, gen).train(training)
    ours = _grad_model(12, 20, model_kw, scale_shape, gen)
    ours.load_state_dict(plain.state_dict())
    ours.train(training)
    x = torch.randn(7, 12, generator=gen)
    grad_out = torch.randn(7, 20, generator=gen)
    out_t, expect = _model_grads(plain, x, grad_out)
    xg = x.clone().requires_grad_(True)
    out = _functional(ours, xg)
    assert out.dtype == torch.float32 and out.grad_fn is not None
    out.backward(grad_out)
    got = {"x": xg.grad, "weight": ours.gemm.weight.grad, "bias": getattr(ours.gemm.bias, "grad", None),
           "bn_weight": getattr(ours.bn.weight, "grad", None), "bn_bias": getattr(ours.bn.bias, "grad", None),
           "scale": ours.scale.grad}
    torch.testing.assert_close(out, out_t, rtol=1e-5, atol=1e-7)
    for key, want in expect.items():
        if want is None:
            assert got[key] is None, key
            continue
        torch.testing.assert_close(got[key], want, rtol=1e-4, atol=1e-6, msg=key)
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        if getattr(plain.bn, key) is not None:
            torch.testing.assert_close(getattr(ours.bn, key), getattr(plain.bn, key), msg=key)


def test_needs_grad_only_when_autograd_records():
    from cupy_attn.linear_bn_softmax import autograd as lbs_autograd
    gen = torch.Generator().manual_seed(4)
    model = _randomize(Model(6, 5), gen)
    s = _state(model)
    args = (s["weight"], s["bias"], s["bn_weight"], s["bn_bias"], s["scale"])
    x = torch.randn(3, 6, generator=gen)
    assert lbs_autograd.needs_grad(x, *args)
    with torch.no_grad():
        assert not lbs_autograd.needs_grad(x, *args)
        assert _functional(model, x).grad_fn is None
    with torch.inference_mode():
        assert not lbs_autograd.needs_grad(x, *args)
    frozen = tuple(a.detach() for a in args)
    assert not lbs_autograd.needs_grad(x, *frozen)
    assert lbs_autograd.needs_grad(x.requires_grad_(True), *frozen)
    assert not lbs_autograd.needs_grad(x.detach().numpy(), *(a.detach().numpy() for a in args))


# ---------------------------------------------------------------------------------------------------------------------
# CPU: argument errors, raised before any launch (same checks for GPU inputs)

def _args(n=4, k=6, f=5, dtype=np.float32):
    rng = np.random.default_rng(0)
    return dict(x=rng.standard_normal((n, k)).astype(dtype), weight=rng.standard_normal((f, k)).astype(dtype),
                bias=rng.standard_normal(f).astype(dtype), running_mean=np.zeros(f, np.float32),
                running_var=np.ones(f, np.float32), bn_weight=np.ones(f, np.float32),
                bn_bias=np.zeros(f, np.float32), scale=np.ones(1, np.float32))


@pytest.mark.parametrize("change, exc, match", [
    (dict(x=np.ones((4, 6, 1), np.float32)), ValueError, "x must be 2-D"),
    (dict(weight=np.ones((5, 7), np.float32)), ValueError, "weight axis 1"),
    (dict(weight=np.ones(5, np.float32)), ValueError, "weight must be 2-D"),
    (dict(weight=np.ones((5, 6), np.float64)), TypeError, "weight dtype"),
    (dict(x=np.ones((4, 6), np.float64), weight=np.ones((5, 6), np.float64)), TypeError, "x must be float32"),
    (dict(bias=np.ones(4, np.float32)), ValueError, r"bias must have shape \(5,\)"),
    (dict(bias=np.ones(5, np.float16)), TypeError, "bias dtype"),
    (dict(scale=np.ones(2, np.float32)), ValueError, "scale must have shape"),
    (dict(scale=np.ones((1, 5), np.float32)), ValueError, "scale must have shape"),
    (dict(scale=None), TypeError, "scale"),
    (dict(bn_weight=np.ones(6, np.float32)), ValueError, "bn_weight must have shape"),
    (dict(running_var=None), ValueError, "both be given"),
    (dict(running_mean=np.zeros(5, np.float64)), TypeError, "running_mean must be float32"),
    (dict(running_mean=np.zeros(5, np.float16)), TypeError, "same dtype"),
    (dict(x=[[1.0]]), TypeError, "x must be"),
])
def test_argument_errors(change, exc, match):
    args = _args()
    args.update(change)
    with pytest.raises(exc, match=match):
        linear_batchnorm_softmax(**args, training=True)


def test_batch_of_one_in_training_raises_like_torch():
    args = _args(n=1)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        linear_batchnorm_softmax(**args, training=True)
    linear_batchnorm_softmax(**args, training=False)  # eval with running stats: fine
    args.update(running_mean=None, running_var=None)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        linear_batchnorm_softmax(**args, training=False)  # no running stats: batch stats, as torch


def test_momentum_none_needs_num_batches_tracked():
    with pytest.raises(ValueError, match="num_batches_tracked"):
        linear_batchnorm_softmax(**_args(), training=True, momentum=None)
    with pytest.raises(TypeError, match="int64"):
        linear_batchnorm_softmax(**_args(), training=True, momentum=None,
                                 num_batches_tracked=np.zeros(1, np.float32))


def test_call_cache_key_only_for_device_arrays_of_one_kind():
    """NumPy and CPU torch inputs always take the full path (the reference); flags are keyed with their types."""
    args = _args()
    arrays = (args["x"], args["weight"], args["bias"], args["running_mean"], args["running_var"], args["bn_weight"],
              args["bn_bias"], args["scale"], None)
    assert lbs_api._call_key(arrays, True, 0.1, 1e-5, None) is None
    cpu = tuple(None if a is None else torch.from_numpy(a) for a in arrays)
    assert lbs_api._call_key(cpu, True, 0.1, 1e-5, None) is None
    assert _callcache.typed(True, 0.1) != _callcache.typed(1, 0.1)


# ---------------------------------------------------------------------------------------------------------------------
# CPU: the module

@pytest.mark.parametrize("bn_kw", BN_CONFIGS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
def test_module_state_dict_matches_plain_and_loads_both_ways(bn_kw):
    plain = _randomize(Model(8, 6, **bn_kw), torch.Generator().manual_seed(1))
    fused = LinearBatchNormSoftmax(8, 6, **bn_kw)
    sd_p, sd_f = plain.state_dict(), fused.state_dict()
    assert list(sd_p) == list(sd_f)
    assert all(sd_p[k].shape == sd_f[k].shape and sd_p[k].dtype == sd_f[k].dtype for k in sd_p)
    fused.load_state_dict(sd_p)
    Model(8, 6, **bn_kw).load_state_dict(fused.state_dict())
    copy = LinearBatchNormSoftmax.from_module(plain)
    for k, v in plain.state_dict().items():
        assert torch.equal(copy.state_dict()[k], v)
        assert copy.state_dict()[k].data_ptr() != v.data_ptr()  # copied, not shared
    x = torch.randn(5, 8)
    plain.eval(), copy.eval()
    with torch.no_grad():
        torch.testing.assert_close(copy(x), plain(x))


def test_module_from_module_keeps_mode_and_grad_fallback():
    plain = _randomize(Model(8, 6), torch.Generator().manual_seed(2)).eval()
    fused = LinearBatchNormSoftmax.from_module(plain)
    assert not fused.training and not fused.bn.training
    x = torch.randn(4, 8)
    out = fused(x)  # CPU + grad mode: the torch ops, differentiable
    out[:, 0].sum().backward()
    assert fused.gemm.weight.grad is not None


def test_module_scale_shape_check():
    with pytest.raises(ValueError, match="scale_shape"):
        LinearBatchNormSoftmax(4, 3, scale_shape=(2,))
    with pytest.raises(TypeError, match="has no attribute"):
        LinearBatchNormSoftmax.from_module(nn.Linear(3, 3))


# ---------------------------------------------------------------------------------------------------------------------
# CPU: kernels compile; the launcher only asks for declared variants

FAMILIES = [lbs.COLUMN_STATS, lbs.FOLD_RUNNING_STATS, lbs.SOFTMAX_ROWS, lbs.SOFTMAX_ROWS_STREAMING, lbs_bwd.ROW_DOT,
            lbs_bwd.COLUMNS]


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
@pytest.mark.parametrize("arch", _compile.DEFAULT_ARCHS)
def test_every_variant_compiles(family, arch):
    reports = compile_check.compile_family(family, arch)
    assert len(reports) == len(family.name_expressions()) > 0
    assert not [r.name_expression for r in reports if r.spill_bytes], "register spills"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_plans_are_declared_variants(dtype):
    c = C_TYPE[dtype]
    rows = set(lbs.SOFTMAX_ROWS.name_expressions())
    streams = set(lbs.SOFTMAX_ROWS_STREAMING.name_expressions())
    for f in [1, 2, 3, 7, 8, 31, 32, 100, 1000, 1001, 2048, 2050, 4096, 8192, 8193, 16384, 16392, 20000, 20001]:
        plan = lbs.row_plan(f, np.dtype(dtype) if dtype != "bfloat16" else interop.dtype_of(
            torch.empty(1, dtype=torch.bfloat16), "torch_cpu"))
        if plan.kernel == "softmax_rows":
            assert plan.threads * plan.vec * plan.chunks >= f and f % plan.vec == 0
            expr = lbs.SOFTMAX_ROWS.name_expression(dtype=c, threads=plan.threads, vec=plan.vec, chunks=plan.chunks,
                                                    rows=plan.rows)
            assert expr in rows
        else:
            assert f > lbs.ROW_MAX_REGISTER_ROW and f % plan.vec == 0
            assert lbs.SOFTMAX_ROWS_STREAMING.name_expression(dtype=c, threads=plan.threads, vec=plan.vec) in streams
    assert lbs.row_plan(8192, np.float16) == lbs.RowPlan("softmax_rows", 256, 8, 4, 1)
    assert lbs.row_plan(8192, np.float32) == lbs.RowPlan("softmax_rows", 512, 4, 4, 2)
    assert lbs.row_plan(4096, np.float16) == lbs.RowPlan("softmax_rows", 512, 8, 1, 2)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_backward_plans_are_declared_variants(dtype):
    c = C_TYPE[dtype]
    npdt = np.dtype(dtype) if dtype != "bfloat16" else interop.dtype_of(torch.empty(1, dtype=torch.bfloat16),
                                                                         "torch_cpu")
    for f in [1, 3, 8, 31, 32, 264, 1000, 8192, 8200, 20001]:
        tile = lbs_bwd.column_tile(f, npdt)
        assert f % tile[0] == 0 and tile[0] * tile[1] <= tile[2]
        assert lbs_bwd.COLUMNS.name_expression(dtype=c, tile=tile) in lbs_bwd.COLUMNS.name_expressions()
        expr = lbs_bwd.ROW_DOT.name_expression(dtype=c, threads=lbs_bwd.ROW_DOT_THREADS, vec=lbs_bwd._vec(f, npdt))
        assert expr in lbs_bwd.ROW_DOT.name_expressions()
    assert lbs_bwd.column_tile(8192, np.float16) == (8, 4, 256) and lbs_bwd.column_tile(999, np.float32) == (1, 32, 256)


_NUMPY_OF_CODE = {code: dt for dt, code in lbs_checks.CODE_OF.items()}
_PATTERN_BASE = {"dbias": 100.0, "dgamma": 200.0, "dbeta": 300.0, "dscale": 400.0}
_TYPE_OF_FIELD = {"dgamma": "gamma_t", "dbeta": "beta_t", "dscale": "scale_t"}


def _write_feature_pattern(p, x_dtype=np.float16):
    """What the fake bwd_columns writes: gradient g's element i = _PATTERN_BASE[g] + i, in its argument's dtype (dbias
    in x's, fp16 in these tests), at the pointers in its params (0: not needed)."""
    n_cols = int(p["n_cols"])
    for name, base in _PATTERN_BASE.items():
        ptr = int(p[name])
        if ptr == 0:
            continue
        dtype = x_dtype if name == "dbias" else _NUMPY_OF_CODE[int(p[_TYPE_OF_FIELD[name]])]
        count = 1 if name == "dscale" and int(p["scale_stride"]) == 0 else n_cols
        itemsize = np.dtype(dtype).itemsize
        view = np.frombuffer((ctypes.c_char * (count * itemsize)).from_address(ptr), dtype=dtype)
        view[:] = base + np.arange(count)


class _FakeGemm:
    """Stands for backward._Gemm on CPU: records its calls and binds to the stream like the real one."""

    def __init__(self):
        self.bound, self.calls = {}, []

    def __call__(self, c_ptr, a_ptr, b_ptr, stream_ptr):
        self.calls.append((c_ptr, a_ptr, b_ptr, stream_ptr))
        self.bound[stream_ptr] = True


def _fake_backward_device(monkeypatch, stream_ptr=7):
    """backward._Call on CPU tensors: the plan's kernels and GEMMs, the workspace, the device and the stream replaced
    by recorders. Returns (ctx, record): record["params"] the BwdParams of each launch, ["work"] workspace sizes,
    ["gemms"] (dx, dw) fakes, ["activations"] how often the CuPy context was entered."""
    import contextlib
    import types

    from cupy.cuda import driver
    record = {"params": [], "work": [], "activations": 0, "copies": []}

    kernels = {name: types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=ptr), max_dynamic_shared_size_bytes=0)
               for name, ptr in (("row_dot", 1), ("columns", 2))}

    def plan(device_id, dtype, n, k, f, ldx, ldw, allow_tf32, need_dx, need_dw):
        record["gemms"] = (_FakeGemm() if need_dx else None, _FakeGemm() if need_dw else None)
        return lbs_bwd._Plan(row_dot=(kernels["row_dot"], (1,), (256,)), columns=(kernels["columns"], (1,), (256,)),
                             dx=record["gemms"][0], dw=record["gemms"][1])

    def launch(fn_ptr, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        """cuLaunchKernel of the plan's two kernels: records the BwdParams each gets; "columns" writes a known
        pattern to the per-feature gradients."""
        raw = ctypes.string_at(ctypes.c_uint64.from_address(argv).value, lbs_bwd._BWD_PARAMS.itemsize)
        p = np.frombuffer(raw, lbs_bwd._BWD_PARAMS)[0].copy()
        record["params"].append(p)
        if fn_ptr == 2:
            _write_feature_pattern(p)

    def copy(dst, src, nbytes, kind, stream_ptr):
        record["copies"].append((dst, src, nbytes, kind, stream_ptr))
        ctypes.memmove(dst, src, nbytes)

    def work(device_id, stream, name, nbytes):
        record["work"].append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    class Ctx:
        device_id = 0
        stream = type("Stream", (), {"ptr": stream_ptr})()

        @contextlib.contextmanager
        def activate(self):
            record["activations"] += 1
            yield
    monkeypatch.setattr(lbs_bwd, "_plan", plan)
    monkeypatch.setattr(driver, "launchKernel", launch)
    monkeypatch.setattr(lbs_bwd, "_memcpy_fn", lambda: copy)
    monkeypatch.setattr(lbs_bwd, "stream_workspace", work)
    monkeypatch.setattr(lbs_bwd, "_get_device_fn", lambda: (lambda: 0))
    monkeypatch.setattr(interop, "current_torch_stream", lambda device_id: stream_ptr)
    monkeypatch.setattr(interop, "context_for", lambda x, name="query": Ctx())
    monkeypatch.setattr(lbs_bwd, "_CALLS", {})
    return Ctx(), record


@pytest.mark.parametrize("mixed", [False, True], ids=["one_dtype", "fp32_bn"])
@pytest.mark.parametrize("scale_shape", [(1,), (), (24,)])
def test_backward_call_params_and_gradient_buffers_cpu(monkeypatch, mixed, scale_shape):
    """The prepared backward (CPU tensors, recorders for the device): every BwdParams field (pointers in order, the
    tail), gradients with their arguments' shapes and dtypes (the per-feature ones views of one allocation when they
    share a dtype), dy and the scratch in the workspace, the dW GEMM reading dy and x, the CuPy context entered only
    until the GEMM is bound; grad_inputs' memo skips the checks for a grad_out it takes and not for a strided one."""
    ctx, record = _fake_backward_device(monkeypatch)
    n, k, f = 10, 6, 24
    h = torch.float16
    vec = torch.float32 if mixed else h
    x, weight = torch.randn(n, k).to(h), torch.randn(f, k).to(h)
    y, out, dout = (torch.randn(n, f).to(h) for _ in range(3))
    stats = torch.randn(lbs.AFFINE_ROWS, f)
    gamma, beta, scale = torch.randn(f).to(vec), torch.randn(f).to(vec), torch.randn(scale_shape).to(vec)
    needs = (False, True, True, True, True, True)
    memo: dict = {}
    for step in range(2):
        grads = lbs_bwd.grad_inputs(dout, x, weight, y, out, stats, gamma, beta, scale, use_batch_stats=True,
                                    needs=needs, allow_tf32=False, memo=memo)
        assert list(memo) == [needs] and len(lbs_bwd._CALLS) == 1
        dx, dw, dbias, dgamma, dbeta, dscale = grads
        assert dx is None and dw.shape == (f, k) and dw.dtype == h
        assert dbias.shape == (f,) and dbias.dtype == h
        for g, like in ((dgamma, gamma), (dbeta, beta), (dscale, scale)):
            assert g.shape == like.shape and g.dtype == like.dtype and g.is_contiguous()
        shared = {t.untyped_storage().data_ptr() for t in (dbias, dgamma, dbeta, dscale)}
        assert len(shared) == (2 if mixed else 1)  # one allocation per dtype: dbias has x's, the fp32 vectors share one
        p = record["params"][-1]
        base = p["delta"]
        call = memo[needs]
        assert p["dscale_partial"] == base + 16 * 3 and p["counter"] == base + 4 * (12 + 24)  # N, F rounded up to 4
        assert p["dy"] == base + call.dy_off and call.dy_off % 256 == 0 and call.dy_off >= 4 * (12 + 24 + 4)
        assert record["work"][-1] == call.dy_off + n * f * 2
        # The kernels write the per-feature gradients into the workspace (between the counter and dy); they are copied
        # into their own allocations, one copy per dtype, after the GEMM.
        for name in _PATTERN_BASE:
            assert base + 4 * (12 + 24) + 16 <= int(p[name]) < base + call.dy_off
        assert len(record["copies"]) == 2 * (step + 1) if mixed else len(record["copies"]) == step + 1
        for g, name in ((dbias, "dbias"), (dgamma, "dgamma"), (dbeta, "dbeta"), (dscale, "dscale")):
            expect = _PATTERN_BASE[name] + np.arange(g.numel())
            assert np.array_equal(g.double().numpy().ravel(), expect), name
        assert [int(p[name]) for name in ("dout", "out", "y", "stats", "gamma", "beta", "scale")] == [
            t.data_ptr() for t in (dout, out, y, stats, gamma, beta, scale)]
        assert (int(p["n_rows"]), int(p["n_cols"]), int(p["scale_stride"]), int(p["flags"])) == (
            n, f, 1 if scale_shape == (f,) else 0, 1)
        code = lbs_checks.CODE_OF[interop.torch_to_numpy_dtype(vec)]
        assert int(p["gamma_t"]) == int(p["beta_t"]) == int(p["scale_t"]) == code
        assert record["gemms"][1].calls[-1] == (dw.data_ptr(), int(p["dy"]), x.data_ptr(), 7)
    assert record["activations"] == 1  # the first call binds the GEMM under the context, the second takes the memo
    strided = torch.randn(f, n).to(h).t()  # not contiguous: the checked path copies it, the memo is not used for it
    lbs_bwd.grad_inputs(strided, x, weight, y, out, stats, gamma, beta, scale, use_batch_stats=True, needs=needs,
                        allow_tf32=False, memo=memo)
    assert record["params"][-1]["dout"] != strided.data_ptr() and len(lbs_bwd._CALLS) == 1


def test_backward_call_dy_outside_the_workspace_and_dx_cpu(monkeypatch):
    """dy larger than Y_WORKSPACE_MAX_BYTES gets its own allocation (the workspace holds the scratch only); with x's
    gradient the dx GEMM reads dy and weight; no memo: the call is found by its layout."""
    _, record = _fake_backward_device(monkeypatch)
    monkeypatch.setattr(lbs_bwd, "Y_WORKSPACE_MAX_BYTES", 100)
    n, k, f = 9, 5, 16
    x, weight = torch.randn(n, k), torch.randn(f, k)
    y, out, dout = (torch.randn(n, f) for _ in range(3))
    grads = lbs_bwd.grad_inputs(dout, x, weight, y, out, torch.randn(lbs.AFFINE_ROWS, f), None, None,
                                torch.ones(1), use_batch_stats=False, needs=(True, True, True, False, False, False),
                                allow_tf32=False)
    dx, dw, dbias, dgamma, dbeta, dscale = grads
    assert dx.shape == (n, k) and dw.shape == (f, k) and dbias.shape == (f,) and dgamma is dbeta is dscale is None
    p = record["params"][-1]
    assert record["work"][-1] == lbs_bwd._CALLS[next(iter(lbs_bwd._CALLS))].dy_off  # scratch only
    assert int(p["flags"]) == 0 and int(p["gamma"]) == int(p["beta"]) == 0 and int(p["dscale"]) == 0
    assert record["gemms"][0].calls[-1] == (dx.data_ptr(), int(p["dy"]), weight.data_ptr(), 7)
    assert record["gemms"][1].calls[-1] == (dw.data_ptr(), int(p["dy"]), x.data_ptr(), 7)


# ---------------------------------------------------------------------------------------------------------------------
# GPU

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ULP = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


FP32_UNIT = 2.0 ** -24


def _gemm_rounding_noise(x, weight, bn_weight, var, eps, scale, p):
    """Per-element output error (float64, (N, F)) that the GEMM's fp32 accumulation alone may cause.

    Every dtype accumulates the K products of y = x·Wᵀ in fp32, so y carries an error of about
    u·sqrt(K)·Σ_k |x_ik||w_jk| (u = 2⁻²⁴, rounding errors adding like a random walk). BatchNorm and scale multiply it
    by the slope scale_j·γ_j / sqrt(var_j + eps) into a logit error δz, and softmax turns that into
    dP_ij = P_ij·(δz_ij − Σ_l P_il δz_il), at most P_ij·(|δz_ij| + Σ_l P_il |δz_il|). Where logits are large (slope
    ~1e3) and two of a row nearly tie, this is far above an output ulp, and torch's error and ours are two samples of
    the same rounding noise (two GEMM kernels summing in different orders), not properties of the kernels after the
    GEMM; elsewhere it is far below an ulp and the bound stays as tight as before.
    """
    k = x.shape[1]
    gamma = np.ones(weight.shape[0]) if bn_weight is None else np.abs(bn_weight)
    slope = np.abs(np.broadcast_to(scale, gamma.shape)) * gamma / np.sqrt(var + eps)
    dz = slope[None, :] * (FP32_UNIT * np.sqrt(k)) * (np.abs(x) @ np.abs(weight).T)
    return p * (dz + (p * dz).sum(axis=1, keepdims=True))


def _model_noise(model, x, p, use_batch_stats):
    """_gemm_rounding_noise for ``model`` (plain or fused, any dtype) on input x, with reference output p."""
    s = {key: _np(v) for key, v in _state(model).items()}
    x64 = _np(x)
    var = (x64 @ s["weight"].T).var(axis=0) if use_batch_stats else s["running_var"]
    return _gemm_rounding_noise(x64, s["weight"], s["bn_weight"], var, model.bn.eps, s["scale"], p)


def _check_close(name, ours, torch_out, ref, dtype, noise=None, torch_ref=None):
    """ours must be finite and within 2× torch's max error vs the float64 reference, plus rounding noise: one ulp of
    the largest output (the output dtype) and, per element, ``noise`` (the GEMM's, see _gemm_rounding_noise).
    torch_ref: torch's own float64 reference when torch computed from other values than ours (its own parameters
    after training steps); ``ref`` otherwise."""
    ours = ours.detach().double().cpu().numpy() if hasattr(ours, "detach") else np.asarray(ours, np.float64)
    tor = torch_out.detach().double().cpu().numpy()
    assert not np.isnan(ours).any(), f"{name}: NaN at {np.argwhere(np.isnan(ours))[:5].tolist()}"
    err = np.abs(ours - ref)
    err_t = np.abs(tor - (ref if torch_ref is None else torch_ref)).max()
    bound = 2 * err_t + ULP[dtype] * np.abs(ref).max() + (0.0 if noise is None else noise)
    if (err > bound).any():
        bad = np.argwhere(err > bound)[:5].tolist()
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        pytest.fail(f"{name}: max err {err.max():.3e} (mean {err.mean():.3e}); at {list(i)} err {err[i]:.3e} > bound "
                    f"{np.broadcast_to(bound, err.shape)[i]:.3e} (torch max err {err_t:.3e}); first mismatches {bad}")


def _poison_allocators(shape, dtype):
    """Fill the blocks the next allocations of this size will get with NaN (torch's caching allocator and CuPy's
    pool), so elements a kernel forgets to write show up."""
    import cupy
    t = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del t
    c = cupy.full(shape, np.nan, dtype=np.float32 if dtype == torch.float32 else np.float16)
    del c


GPU_SHAPES = [(2, 5, 3), (7, 64, 1000), (33, 17, 129), (5, 40, 31), (300, 96, 2050), (9, 24, 6000), (64, 128, 8192),
              (3, 24, 8200), (3, 24, 20000), (4, 16, 20001)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("scale_shape", ["1", "F"])
def test_gpu_matches_reference_and_torch(dtype, shape, training, scale_shape):
    n, k, f = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype, training, scale_shape)).encode()))
    plain = _randomize(Model(k, f), gen)
    if scale_shape == "F":
        plain.scale = nn.Parameter(torch.rand(f, generator=gen) * 3 + 0.2)
    plain = plain.to("cuda", DTYPES[dtype]).train(training)
    fused = LinearBatchNormSoftmax.from_module(plain)
    x = (torch.randn(n, k, generator=gen) * 2).to("cuda", DTYPES[dtype])
    ref, rm, rv, nbt = _reference_step(plain, x)
    _poison_allocators((n, f), DTYPES[dtype])
    with torch.no_grad():
        expect = plain(x)
        ours = fused(x)
    assert ours.dtype == x.dtype and ours.shape == (n, f) and ours.is_cuda
    _check_close("out", ours, expect, ref, dtype, _model_noise(plain, x, ref, training))
    if training:
        _check_close("running_mean", fused.bn.running_mean, plain.bn.running_mean, rm, dtype)
        _check_close("running_var", fused.bn.running_var, plain.bn.running_var, rv, dtype)
        assert int(fused.bn.num_batches_tracked) == int(plain.bn.num_batches_tracked) == nbt


@pytest.mark.gpu
def test_gpu_create_graph_backward_then_double_backward_raises():
    """backward(create_graph=True) runs the same backward (once_differentiable's path) and gives the same gradients
    as a plain backward; differentiating those gradients again raises, as documented (the output gradient requires
    grad here: otherwise once_differentiable leaves the gradients without a graph, as for any such Function)."""
    torch.manual_seed(3)
    fused = LinearBatchNormSoftmax(64, 48).cuda().half().train()
    x = torch.randn(32, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    dout = torch.randn(32, 48, device="cuda", dtype=torch.float16, requires_grad=True)
    state = {k: v.clone() for k, v in fused.state_dict().items()}
    plain = torch.autograd.grad(fused(x), (x, fused.gemm.weight), dout)
    fused.load_state_dict(state)
    graph = torch.autograd.grad(fused(x), (x, fused.gemm.weight), dout, create_graph=True)
    for a, b in zip(plain, graph):
        assert torch.equal(a, b)
    assert graph[0].requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        graph[0].float().sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bn_kw", BN_CONFIGS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
def test_gpu_five_training_steps_track_running_stats(dtype, bn_kw):
    n, k, f = 48, 96, 264
    gen = torch.Generator().manual_seed(11)
    plain = _randomize(Model(k, f, **bn_kw), gen).to("cuda", DTYPES[dtype])
    fused = LinearBatchNormSoftmax.from_module(plain)
    ref_model = _randomize(Model(k, f, **bn_kw), gen).double()   # float64 chain on the same starting values
    ref_model.load_state_dict({key: v.double() if v.is_floating_point() else v
                               for key, v in plain.state_dict().items()})
    for step in range(5):
        x = (torch.randn(n, k, generator=gen) + 0.5 * step).to("cuda", DTYPES[dtype])
        with torch.no_grad():
            ref = ref_model(x.double().cpu()).numpy()
            expect = plain(x)
            ours = fused(x)
        _check_close(f"out step {step}", ours, expect, ref, dtype,
                     _model_noise(ref_model, x, ref, use_batch_stats=True))
    if plain.bn.running_mean is not None:
        _check_close("running_mean", fused.bn.running_mean, plain.bn.running_mean,
                     ref_model.bn.running_mean.numpy(), dtype)
        _check_close("running_var", fused.bn.running_var, plain.bn.running_var, ref_model.bn.running_var.numpy(),
                     dtype)
        assert int(fused.bn.num_batches_tracked) == int(plain.bn.num_batches_tracked) == 5
    fused.eval(), plain.eval(), ref_model.eval()
    x = torch.randn(n, k, generator=gen).to("cuda", DTYPES[dtype])
    with torch.no_grad():
        ref = ref_model(x.double().cpu()).numpy()
        _check_close("eval after training", fused(x), plain(x), ref, dtype,
                     _model_noise(ref_model, x, ref, use_batch_stats=ref_model.bn.running_mean is None))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_gpu_seed_shape(dtype, training):
    """(1024, 8192) → 8192, the benchmark shape; float64 ground truth computed by torch on the GPU."""
    n, k, f = 1024, 8192, 8192
    torch.manual_seed(5)
    plain = _randomize(Model(k, f), torch.Generator().manual_seed(5)).cuda().to(DTYPES[dtype]).train(training)
    fused = LinearBatchNormSoftmax.from_module(plain)
    x = torch.randn(n, k, device="cuda").to(DTYPES[dtype])
    ref_model = Model(k, f).cuda().double().train(training)
    ref_model.load_state_dict({key: v.double() if v.is_floating_point() else v
                               for key, v in plain.state_dict().items()})
    _poison_allocators((n, f), DTYPES[dtype])
    with torch.no_grad():
        ref = ref_model(x.double()).cpu().numpy()
        expect = plain(x)
        ours = fused(x)
    _check_close("out", ours, expect, ref, dtype, _model_noise(ref_model, x, ref, training))
    if training:
        _check_close("running_var", fused.bn.running_var, plain.bn.running_var,
                     ref_model.bn.running_var.cpu().numpy(), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_large_logits_and_mixed_parameter_dtypes(dtype):
    """scale ~ 1e3 (logits that overflow a naive exp); fp32 BatchNorm parameters with low-precision x; CuPy inputs."""
    import cupy
    n, k, f = 40, 64, 300
    rng = np.random.default_rng(9)
    host = dict(x=rng.standard_normal((n, k)), weight=rng.standard_normal((f, k)) / 8,
                bias=rng.standard_normal(f), running_mean=rng.standard_normal(f) * 0.1,
                running_var=rng.random(f) + 0.5, bn_weight=rng.random(f) + 0.5, bn_bias=rng.standard_normal(f),
                scale=np.array([1000.0]))
    npdt = interop.dtype_of(torch.empty(1, dtype=DTYPES[dtype]), "torch")
    low = {key: (v.astype(npdt) if key in ("x", "weight", "bias") else v.astype(np.float32)) for key, v in host.items()}
    for training in (True, False):
        ref, rm, rv, _ = reference.linear_batchnorm_softmax(
            **{key: v.astype(np.float64) for key, v in low.items()}, training=training)
        dev = {key: cupy.asarray(v) for key, v in low.items()}
        out = linear_batchnorm_softmax(**dev, training=training)
        assert isinstance(out, cupy.ndarray) and out.dtype == npdt
        # torch in the same precision (fp32 BN parameters, as autocast-style mixed modules hold them)
        # torch.as_tensor has no ml_dtypes.bfloat16: go through float32 (exact) and cast back.
        t = {key: torch.as_tensor(v.astype(np.float32)).to(DTYPES[dtype] if key in ("x", "weight", "bias")
                                                          else torch.float32).cuda() for key, v in low.items()}
        with torch.no_grad():
            y = torch.nn.functional.linear(t["x"], t["weight"], t["bias"])
            rm_t, rv_t = t["running_mean"].clone(), t["running_var"].clone()
            z = torch.nn.functional.batch_norm(y, rm_t, rv_t, t["bn_weight"], t["bn_bias"], training=training)
            expect = torch.softmax(t["scale"] * z, dim=1).to(t["x"].dtype)  # fp32 math, stored like ours
        h64 = {key: v.astype(np.float64) for key, v in low.items()}
        var = (h64["x"] @ h64["weight"].T).var(axis=0) if training else h64["running_var"]
        noise = _gemm_rounding_noise(h64["x"], h64["weight"], h64["bn_weight"], var, 1e-5, h64["scale"], ref)
        _check_close(f"out training={training}", torch.as_tensor(cupy.asnumpy(out).astype(np.float32)), expect,
                     ref, dtype, noise)
        if training:
            _check_close("running_mean", torch.as_tensor(cupy.asnumpy(dev["running_mean"])), rm_t, rm, dtype)
            _check_close("running_var", torch.as_tensor(cupy.asnumpy(dev["running_var"])), rv_t, rv, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_gpu_call_cache_replay_equals_full_path(kind, monkeypatch):
    """A repeated call replays the prepared launches (no checks): output and running stats are bit-identical to the
    full path's on the same values, for new x and parameter buffers, and a call on another stream gets its own
    entry."""
    import cupy
    n, k, f = 48, 96, 1000
    gen = torch.Generator().manual_seed(21)
    plain = _randomize(Model(k, f), gen).cuda().half().train()
    conv = (lambda t: t) if kind == "torch" else (lambda t: None if t is None else cupy.from_dlpack(t.detach()))

    def fresh_state():
        st = {key: conv(None if v is None else v.detach().clone()) for key, v in _state(plain).items()}
        st["num_batches_tracked"] = conv(plain.bn.num_batches_tracked.clone())
        return st

    def call(x, st):
        return linear_batchnorm_softmax(conv(x), **st, training=True, momentum=0.1, eps=1e-5)

    def host(v):
        return v.detach().cpu().numpy() if kind == "torch" else cupy.asnumpy(v)

    _callcache.clear()
    full, replay = fresh_state(), fresh_state()
    for step in range(3):
        x = torch.randn(n, k, generator=gen).half().cuda()
        with monkeypatch.context() as m:
            m.setattr(_callcache, "get", lambda key: None)  # full path: checks, plan, launches
            expect = call(x, full)
        if step == 0:
            call(x.clone(), fresh_state())  # makes the entry
        with monkeypatch.context() as m:
            m.setattr(lbs_api, "check", lambda *a, **kw: pytest.fail("replay must not run the checks"))
            got = call(x, replay)
        np.testing.assert_array_equal(host(got), host(expect))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            np.testing.assert_array_equal(host(replay[name]), host(full[name]))
    side = torch.cuda.Stream() if kind == "torch" else cupy.cuda.Stream()
    torch.cuda.synchronize()
    with (torch.cuda.stream(side) if kind == "torch" else side), monkeypatch.context() as m:
        calls = []
        real = lbs_api.check
        m.setattr(lbs_api, "check", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        got = call(x, fresh_state())
        side.synchronize()
    assert calls, "another stream must not replay the first stream's entry"
    np.testing.assert_array_equal(host(got), host(call(x, fresh_state())))


@pytest.mark.gpu
def test_gpu_errors_before_launch_and_batch_of_one():
    plain = Model(8, 6).cuda()
    fused = LinearBatchNormSoftmax.from_module(plain)
    with torch.no_grad(), pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        fused(torch.randn(1, 8, device="cuda"))
    assert int(fused.bn.num_batches_tracked) == 0
    with torch.no_grad(), pytest.raises(ValueError, match="weight axis 1"):
        linear_batchnorm_softmax(torch.randn(4, 7, device="cuda"), **_state(fused), training=False)


# ---------------------------------------------------------------------------------------------------------------------
# CPU: arrays of one kind; scale as a Python number

def test_numpy_and_torch_mixed_are_refused():
    args = _args()
    with pytest.raises(TypeError, match="weight is a torch.Tensor but x is a numpy.ndarray: pass one kind of array"):
        linear_batchnorm_softmax(**{**args, "weight": torch.from_numpy(args["weight"])}, training=True)
    cpu = {key: torch.from_numpy(v) for key, v in args.items()}
    with pytest.raises(TypeError, match="scale is a numpy.ndarray but x is a torch.Tensor"):
        linear_batchnorm_softmax(**{**cpu, "scale": args["scale"]}, training=False)


@pytest.mark.parametrize("kind", ["numpy", "torch_cpu"])
@pytest.mark.parametrize("value", [2.5, 3, np.float32(0.75)])
def test_scale_as_a_number_equals_a_one_element_array(kind, value):
    args = _args()
    args["running_var"] = np.full(5, 2.0, np.float32)   # not ones: eval must read it
    conv = (lambda a: a) if kind == "numpy" else torch.from_numpy  # noqa: E731
    for training in (True, False):
        arrays = {key: conv(v.copy()) for key, v in args.items() if key != "scale"}
        got = linear_batchnorm_softmax(**arrays, scale=value, training=training)
        arrays = {key: conv(v.copy()) for key, v in args.items() if key != "scale"}
        expect = linear_batchnorm_softmax(**arrays, scale=conv(np.array([value], np.float32)), training=training)
        assert type(got) is type(expect)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expect))
    base = linear_batchnorm_softmax(**{**args, "scale": 1.0}, training=False)
    assert not np.allclose(base, linear_batchnorm_softmax(**{**args, "scale": 4.0}, training=False))


def test_scale_bool_is_refused():
    with pytest.raises(TypeError, match="scale must be"):
        linear_batchnorm_softmax(**{**_args(), "scale": True}, training=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_gpu_scale_as_a_number_and_mixed_kinds(kind):
    """A Python-number scale on the GPU equals the (1,) array, through the call cache too (different values, same
    key, different results); CuPy next to torch is refused before any launch."""
    import cupy
    gen = torch.Generator().manual_seed(31)
    plain = _randomize(Model(32, 48), gen).cuda().eval()
    st = {key: v.detach() for key, v in _state(plain).items()}
    conv = (lambda t: t) if kind == "torch" else (lambda t: cupy.from_dlpack(t))  # noqa: E731
    st = {key: conv(v) for key, v in st.items()}
    x = conv(torch.randn(16, 32, generator=gen).cuda())
    mk = (lambda v: torch.full((1,), v, device="cuda")) if kind == "torch" else \
        (lambda v: cupy.full(1, v, dtype=cupy.float32))  # noqa: E731
    host = (lambda a: a.cpu().numpy()) if kind == "torch" else cupy.asnumpy  # noqa: E731
    _callcache.clear()
    for value in (0.5, 3.0, 0.5, 7):
        got = linear_batchnorm_softmax(x, **{**st, "scale": value}, training=False)
        expect = linear_batchnorm_softmax(x, **{**st, "scale": mk(float(value))}, training=False)
        np.testing.assert_array_equal(host(got), host(expect))
    other = cupy.from_dlpack(st["weight"]) if kind == "torch" else torch.from_dlpack(st["weight"])
    with pytest.raises(TypeError, match="weight is a .* but x is a"):
        linear_batchnorm_softmax(x, **{**st, "weight": other}, training=False)


# ---------------------------------------------------------------------------------------------------------------------
# GPU: gradients (training)

def _grad_noise(model, x, grad_out, out, training):
    """Per-element error (float64, keyed like the gradients) that fp32 accumulation alone may cause in each gradient,
    for the float64 ``model`` (state before its running stats are used: eval reads them, training does not), input x,
    output gradient grad_out and reference output out.

    Every dtype sums in fp32: n terms carry about u·sqrt(n)·Σ|term| (u = 2⁻²⁴, a random walk), so this matters for
    fp32 only, where torch's error and ours are two samples of the same rounding noise: rowsum(dout ∘ out) over F,
    the column sums A and B over N, the GEMMs over F (dx) and N (dW), the scalar dscale over N·F; and upstream, the
    forward GEMM's error in y (over K, as in _gemm_rounding_noise) through ŷ and out.
    """
    u = FP32_UNIT
    s = {key: _np(v) for key, v in _state(model).items()}
    x64, g, o = _np(x), _np(grad_out), np.asarray(out, dtype=np.float64)
    n, f = o.shape
    k = x64.shape[1]
    y, mean, invstd = _saved_stats(model, x, training)
    yh = (y - mean) * invstd
    gamma = np.ones(f) if s["bn_weight"] is None else s["bn_weight"]
    beta = np.zeros(f) if s["bn_bias"] is None else s["bn_bias"]
    sc = np.broadcast_to(s["scale"].reshape(-1), (f,))
    dz = o * (g - (g * o).sum(axis=1, keepdims=True))
    a_sum, b_sum = dz.sum(axis=0), (dz * yh).sum(axis=0)
    c = gamma * sc * invstd
    dy = c * (dz - a_sum / n - yh * b_sum / n) if training or s["running_mean"] is None else c * dz
    y_err = u * np.sqrt(k) * (np.abs(x64) @ np.abs(s["weight"]).T)
    var = 1.0 / invstd ** 2 - model.bn.eps
    o_err = _gemm_rounding_noise(x64, s["weight"], s["bn_weight"], var, model.bn.eps, s["scale"], o)
    yh_err = y_err * invstd
    dz_err = (np.abs(o) * u * np.sqrt(f) * np.abs(g * o).sum(axis=1, keepdims=True) + u * np.abs(dz)
              + o_err * np.abs(g - (g * o).sum(axis=1, keepdims=True)) + np.abs(o) * (np.abs(g) * o_err).sum(
                  axis=1, keepdims=True))
    a_err = u * np.sqrt(n) * np.abs(dz).sum(axis=0) + dz_err.sum(axis=0)
    b_err = (u * np.sqrt(n) * np.abs(dz * yh).sum(axis=0) + (dz_err * np.abs(yh)).sum(axis=0)
             + (np.abs(dz) * yh_err).sum(axis=0))
    dy_err = np.abs(c) * (dz_err + a_err / n + np.abs(yh) * b_err / n + yh_err * np.abs(b_sum) / n) + u * np.abs(dy)
    ds_err = np.abs(gamma) * b_err + np.abs(beta) * a_err
    if s["scale"].size != f or f == 1:
        ds_err = np.full(s["scale"].shape, ds_err.sum() + u * np.sqrt(f) * np.abs(gamma * b_sum + beta * a_sum).sum())
    return {"x": u * np.sqrt(f) * (np.abs(dy) @ np.abs(s["weight"])) + dy_err @ np.abs(s["weight"]),
            "weight": u * np.sqrt(n) * (np.abs(dy).T @ np.abs(x64)) + dy_err.T @ np.abs(x64),
            "bias": u * np.sqrt(n) * np.abs(dy).sum(axis=0) + dy_err.sum(axis=0),
            "bn_weight": np.abs(sc) * b_err, "bn_bias": np.abs(sc) * a_err, "scale": ds_err.reshape(s["scale"].shape)}


# Half an ulp of a 16-bit value v is at most HALF_ULP[dtype]·|v| (fp16: 11 significant bits, bf16: 8).
HALF_ULP = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def _y_rounding_noise(model, x, grad_out, p, dtype, use_batch_stats):
    """16-bit dtypes: the error that rounding the Linear's output y to the dtype alone may cause, for the float64
    ``model`` (state before the step), input x, output gradient grad_out and reference output p. Returns (out noise
    (N, F), gradient noise keyed like _check_grads' gradients: dx's, dW's, the Linear bias's and a one-element
    scale's; None for the BatchNorm parameters' and a per-feature scale's).

    torch's nn.Linear returns y in the dtype and the fused op keeps y (bias-free) in the dtype: each rounds every y to
    within h = HALF_ULP·|y| (taken at the larger of |y| and |y + bias|), so torch's error and ours carry two samples
    of the same rounding noise (as _gemm_rounding_noise's accumulation noise). Where that noise dominates, one
    sample against twice the other fails often: the fused kernels' arithmetic, emulated in float32 on the test's
    inputs, reproduces the failures it caused bit for bit, and float64 arithmetic on the same rounded y and out gives
    the same errors (bench/experiments/linear_bn_softmax/lbs_dscale_accuracy.py). Propagated:
    out, per element and worst case like _gemm_rounding_noise: δz = slope·h, dP = P·(|δz| + Σ P|δz|) (bf16, eval,
    (33, 17, 129), per-feature scale: two logits of a row at P = 0.64 and 0.36 with slope 3.6 and |y| ≈ 9 moved by
    y's rounding alone gave our out a 4.5e-2 error, torch's rounding of y + bias 1.4e-2 at that element).
    A one-element scale's gradient Σ_{n,f} dz·(γ·ŷ + β) sums N·F terms that each move with y: its error is J·δy,
    J = ∂dscale/∂y (float64 double backward), δy independent and uniform in ±h, standard deviation sqrt(Σ J²h²/3);
    three of them. Over 80 random cases per dtype (three shapes, four configurations, train and eval; the kernels'
    float32 arithmetic emulated) our gradient stayed within 2× torch's error plus this noise in all, at most 0.4 of
    that bound, where 2× torch's error alone failed 5% of them (10% before the backward divided delta by Σ out);
    our median error is 0.35× torch's (bf16) and 0.37× (fp16).
    dx, dW and the Linear bias's gradient: 3 standard deviations of J·δy per element, by probes
    (_y_rounding_probe_sd). A row whose softmax is peaked moves its whole dy with one or two of its y: in the five-step
    test (bf16, momentum=None, per-feature scale, no bias) y[2, 89] = 13.8429 of step 1 lies 0.0008 below the midpoint
    of its bf16 neighbours 13.8125 and 13.875, and which way it rounds moved dx[2, 85] by 1.8e-2 (error 4.9e-3 or
    2.2e-2; the H100 measured 2.195e-2 against torch's 7.45e-3, which rounds its own y). Over 80 emulated cases per
    dtype (bench/experiments/linear_bn_softmax/lbs_dx_accuracy.py: both models' GPU arithmetic, one-step and five-step inputs) the bare
    rule failed dx and dW in 1.2% (bf16), the bias in 1.9% (eval, both dtypes), all within it plus this noise (at
    most 0.42 of that bound); our median error is 0.6× torch's for dx and dW; the BatchNorm parameters never failed.
    """
    m = copy.deepcopy(model)  # BatchNorm in training mode updates the copy's running stats
    with torch.no_grad():
        yb = m.gemm(x.detach().double())
    y0 = yb if m.gemm.bias is None else yb - m.gemm.bias.detach()
    h = HALF_ULP[dtype] * torch.maximum(y0.abs(), yb.abs())
    s = {key: _np(v) for key, v in _state(m).items()}
    var = _np(y0).var(axis=0) if use_batch_stats else s["running_var"]
    gamma = 1.0 if s["bn_weight"] is None else np.abs(s["bn_weight"])
    slope = np.abs(s["scale"].reshape(-1)) * gamma / np.sqrt(var + m.bn.eps)
    dz = slope * _np(h)  # h lives where the model does (the GPU in the tests)
    out_noise = p * (dz + (p * dz).sum(axis=1, keepdims=True))
    sd = _y_rounding_probe_sd(model, x, grad_out, dtype, use_batch_stats)
    noise = {"x": 3 * sd["x"], "weight": 3 * sd["weight"], "bias": 3 * sd["bias"], "bn_weight": None,
             "bn_bias": None, "scale": None}
    if m.scale.numel() != 1:
        return out_noise, noise
    yl = yb.clone().requires_grad_(True)
    out = torch.softmax(m.scale * m.bn(yl), dim=1)
    (dscale,) = torch.autograd.grad(out, m.scale, grad_out.detach().double(), create_graph=True)
    (jac,) = torch.autograd.grad(dscale.sum(), yl)
    noise["scale"] = 3 * torch.sqrt((jac ** 2 * h ** 2 / 3).sum()).item()
    return out_noise, noise


def _y_rounding_probe_sd(model, x, grad_out, dtype, use_batch_stats, probes=64):
    """Per-element standard deviation (float64 NumPy, keyed like the gradients) of each gradient's error J·δy caused
    by y's rounding alone, δy independent and uniform in ±h (h as in _y_rounding_noise), for the float64 ``model``
    (state before the step; its running stats in eval), input x and output gradient grad_out.

    The per-element Jacobians of dx (N·K of them) and dW (F·K) are too many to form at the larger test shapes, so
    the variance Σ J²h²/3 of every element is estimated at once from ``probes`` Rademacher probes: δy = ±h/√3 with
    random signs (δy's variance), pushed through the float64 backward (BatchNorm, softmax and their backward in
    closed form, every row coupled through the batch statistics as in the op), the square of each gradient's change
    averaged: E[(J·δy)²] = Σ J²h²/3 exactly. 64 probes: 98% of the elements within 0.81-1.18 of the full
    Jacobian's sd, median 0.99 (three five-step states, dx and dW, bench/experiments/linear_bn_softmax/lbs_dx_accuracy.py --jacobian).
    Deterministic (a fixed seed). Cost: two float64 GEMMs per probe (dx and dW), ~0.4 s at (1024, 8192) -> 8192."""
    dev = x.device

    def f64(t):
        return None if t is None else t.detach().to(dev, torch.float64)

    weight, bias, x64, g = f64(model.gemm.weight), f64(model.gemm.bias), f64(x), f64(grad_out)
    bn = model.bn
    n, f = g.shape
    gamma = torch.ones(f, dtype=torch.float64, device=dev) if bn.weight is None else f64(bn.weight)
    beta = torch.zeros(f, dtype=torch.float64, device=dev) if bn.bias is None else f64(bn.bias)
    scale = f64(model.scale)
    sc = scale.reshape(-1)
    y0 = x64 @ weight.T
    yb = y0 if bias is None else y0 + bias
    h = HALF_ULP[dtype] * torch.maximum(y0.abs(), yb.abs())

    def grads(y):
        """The backward's gradients (those that depend on y) at the Linear output y (with the bias)."""
        if use_batch_stats:
            mean, var = y.mean(0), y.var(0, unbiased=False)
        else:
            mean, var = f64(bn.running_mean), f64(bn.running_var)
        invstd = 1.0 / torch.sqrt(var + bn.eps)
        yh = (y - mean) * invstd
        out = torch.softmax(sc * (gamma * yh + beta), dim=1)
        dz = out * (g - (g * out).sum(1, keepdim=True))
        a_sum, b_sum = dz.sum(0), (dz * yh).sum(0)
        c = gamma * sc * invstd
        dy = c * (dz - a_sum / n - yh * b_sum / n) if use_batch_stats else c * dz
        ds = gamma * b_sum + beta * a_sum
        return {"x": dy @ weight, "weight": dy.T @ x64, "bias": dy.sum(0), "bn_weight": sc * b_sum,
                "bn_bias": sc * a_sum, "scale": ds.sum().reshape(scale.shape) if scale.numel() == 1 else ds}

    base = grads(yb)
    gen = torch.Generator(device=dev).manual_seed(0)
    acc = {key: torch.zeros_like(v) for key, v in base.items()}
    for _ in range(probes):
        sign = torch.randint(0, 2, (n, f), generator=gen, device=dev).to(torch.float64) * 2 - 1
        for key, v in grads(yb + sign * (h / 3 ** 0.5)).items():
            acc[key] += (v - base[key]) ** 2
    return {key: torch.sqrt(v / probes).cpu().numpy() for key, v in acc.items()}


def _check_grads(what, ours, theirs, ref, ref_t, dtype, noise):
    """Every gradient of ``ref`` present: ours within 2× torch's error (against ``ref_t``, torch's own float64
    reference) plus rounding noise (_check_close)."""
    for key, want in ref.items():
        if want is None:
            assert ours[key] is None, f"{what}: {key} has a gradient but the reference has none"
            continue
        assert ours[key] is not None, f"{what}: no gradient for {key}"
        assert ours[key].dtype == theirs[key].dtype and ours[key].shape == theirs[key].shape, key
        _check_close(f"{what} d{key}", ours[key], theirs[key], want.detach().cpu().numpy(), dtype,
                     None if noise is None else noise[key], torch_ref=ref_t[key].detach().cpu().numpy())


def _gpu_grad_models(k, f, model_kw, scale_shape, dtype, gen, training):
    """(plain in dtype, fused copy), on the GPU with the same values and mode."""
    plain = _grad_model(k, f, model_kw, scale_shape, gen).to("cuda", DTYPES[dtype]).train(training)
    return plain, LinearBatchNormSoftmax.from_module(plain)


def _float64_copy(plain, source):
    """A float64 plain model (``plain``'s structure) holding ``source``'s current parameters, buffers and mode."""
    ref = copy.deepcopy(plain).double()
    ref.load_state_dict({key: v.double() if v.is_floating_point() else v for key, v in source.state_dict().items()})
    return ref.train(source.training)


def _gpu_grad_step(plain, fused, x, grad_out, dtype, training, what):
    """One forward + backward of the fused and the plain model, each against a float64 copy of its own state taken
    before the step (after training steps their parameters differ by their rounding so far, which is not this step's
    error): out, every gradient, the running stats."""
    same = all(torch.equal(u, v) for u, v in zip(plain.state_dict().values(), fused.state_dict().values()))
    ref_f = _float64_copy(plain, fused)
    ref_p = ref_f if same else _float64_copy(plain, plain)
    noise_model = copy.deepcopy(ref_f)  # before the step: eval's noise reads the running stats it uses
    _poison_allocators(tuple(grad_out.shape), DTYPES[dtype])
    ref_out, ref = _model_grads(ref_f, x.double(), grad_out.double())
    ref_out_t, ref_t = (ref_out, ref) if same else _model_grads(ref_p, x.double(), grad_out.double())
    out_t, theirs = _model_grads(plain, x, grad_out)
    out, ours = _model_grads(fused, x, grad_out)
    assert out.grad_fn is not None and "LinearBatchNormSoftmax" in type(out.grad_fn).__name__, type(out.grad_fn)
    ref_np = ref_out.detach().cpu().numpy()
    use_batch_stats = training or noise_model.bn.running_mean is None
    if dtype == "float32":  # fp32 accumulation noise; far below the 16-bit dtypes' errors
        out_noise = _model_noise(noise_model, x, ref_np, use_batch_stats)
        noise = _grad_noise(noise_model, x, grad_out, ref_np, training)
    else:  # y's rounding to the dtype, which torch's Linear output has too
        out_noise, noise = _y_rounding_noise(noise_model, x, grad_out, ref_np, dtype, use_batch_stats)
    _check_close(f"{what} out", out, out_t, ref_np, dtype, out_noise, torch_ref=ref_out_t.detach().cpu().numpy())
    _check_grads(what, ours, theirs, ref, ref_t, dtype, noise)
    if training and plain.bn.running_mean is not None:
        for key in ("running_mean", "running_var"):
            _check_close(f"{what} {key}", getattr(fused.bn, key), getattr(plain.bn, key),
                         getattr(ref_f.bn, key).cpu().numpy(), dtype, torch_ref=getattr(ref_p.bn, key).cpu().numpy())
        assert int(fused.bn.num_batches_tracked) == int(plain.bn.num_batches_tracked)


# (shape, GRAD_CONFIGS name): every configuration at two odd shapes (F not a multiple of 8: scalar loads; F = 1000:
# 16-byte loads, N not a multiple of the 64 row groups), the default at more shapes: F > 8192 (streaming forward),
# N > 16 row blocks per SM (row-dot grid-stride), tiny.
_CONFIG_NAMES = [c[0] for c in GRAD_CONFIGS]
GPU_GRAD_CASES = ([((33, 17, 129), name) for name in _CONFIG_NAMES] + [((70, 40, 1000), name) for name in _CONFIG_NAMES]
                  + [((s), "default") for s in [(2, 5, 3), (5, 24, 31), (300, 96, 264), (9, 24, 8200),
                                                (3000, 16, 40)]] + [((64, 128, 8192), "scale_F")])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape, config", GPU_GRAD_CASES, ids=[f"{'x'.join(map(str, s))}-{c}" for s, c in GPU_GRAD_CASES])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_gpu_gradients_match_reference_and_torch(dtype, shape, config, training):
    n, k, f = shape
    _, model_kw, scale_shape = GRAD_CONFIGS[_CONFIG_NAMES.index(config)]
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, config, dtype, training)).encode()))
    plain, fused = _gpu_grad_models(k, f, model_kw, scale_shape, dtype, gen, training)
    x = (torch.randn(n, k, generator=gen) * 2).to("cuda", DTYPES[dtype])
    grad_out = torch.randn(n, f, generator=gen).to("cuda", DTYPES[dtype])
    _gpu_grad_step(plain, fused, x, grad_out, dtype, training, "step")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_seed_shape_gradients(dtype):
    """The benchmark's shape and model: (1024, 8192) → 8192, nn.Linear's initialization (std(y) ≈ 0.6, so dy stays
    in fp16's normal range: with _randomize's weights it would be ~1e-8, zero in fp16 for torch and us alike),
    training; float64 reference on the GPU."""
    gen = torch.Generator().manual_seed(6)
    torch.manual_seed(6)
    plain = Model(8192, 8192)
    with torch.no_grad():
        plain.bn.weight.uniform_(0.5, 1.5, generator=gen)
        plain.bn.bias.normal_(0, 0.5, generator=gen)
        plain.bn.running_mean.normal_(0, 0.2, generator=gen)
        plain.bn.running_var.uniform_(0.5, 2.0, generator=gen)
        plain.scale.fill_(1.7)
    plain = plain.to("cuda", DTYPES[dtype]).train()
    fused = LinearBatchNormSoftmax.from_module(plain)
    x = torch.randn(1024, 8192, generator=gen).to("cuda", DTYPES[dtype])
    grad_out = torch.randn(1024, 8192, generator=gen).to("cuda", DTYPES[dtype])
    _gpu_grad_step(plain, fused, x, grad_out, dtype, True, "seed")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("config", ["default", "affine=False", "momentum=None,scale_F,no_bias"])
def test_gpu_five_training_steps_with_backward(dtype, config):
    """Five SGD steps (forward, backward, update) of the fused and the plain model from the same start, then an eval
    step: each step's output, gradients and running stats against float64 from each model's own state (see
    _gpu_grad_step), within 2× torch's error; the batch count."""
    n, k, f = 48, 96, 264
    _, model_kw, scale_shape = GRAD_CONFIGS[_CONFIG_NAMES.index(config)]
    gen = torch.Generator().manual_seed(zlib.crc32(repr((dtype, config)).encode()))
    plain, fused = _gpu_grad_models(k, f, model_kw, scale_shape, dtype, gen, True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, fused)]
    for step in range(5):
        x = (torch.randn(n, k, generator=gen) + 0.5 * step).to("cuda", DTYPES[dtype])
        grad_out = torch.randn(n, f, generator=gen).to("cuda", DTYPES[dtype])
        _gpu_grad_step(plain, fused, x, grad_out, dtype, True, f"step {step}")
        for opt in opts:
            opt.step()
    assert int(fused.bn.num_batches_tracked) == int(plain.bn.num_batches_tracked) == 5
    plain.eval(), fused.eval()
    x = torch.randn(n, k, generator=gen).to("cuda", DTYPES[dtype])
    grad_out = torch.randn(n, f, generator=gen).to("cuda", DTYPES[dtype])
    _gpu_grad_step(plain, fused, x, grad_out, dtype, False, "eval after training")


@pytest.mark.gpu
@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_gpu_recorded_forward_equals_unrecorded_and_params_only(x_requires_grad):
    """The recorded forward gives the unrecorded one's output and running stats bit for bit (same GEMM plan and
    kernels, y kept in a buffer of its own); x that needs no gradient gets none (the dx GEMM is skipped) while the
    parameters get theirs; a second call replays the cached launch with the same results."""
    gen = torch.Generator().manual_seed(8)
    plain = _randomize(Model(64, 1000), gen).cuda().half().train()
    a, b = LinearBatchNormSoftmax.from_module(plain), LinearBatchNormSoftmax.from_module(plain)
    x = torch.randn(40, 64, generator=gen).half().cuda()
    grad_out = torch.randn(40, 1000, generator=gen).half().cuda()
    first = None
    for _ in range(2):
        xg = x.clone().requires_grad_(x_requires_grad)
        out = a(xg)
        with torch.no_grad():
            expect = b(x)
        assert out.grad_fn is not None and expect.grad_fn is None
        assert torch.equal(out, expect)
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            assert torch.equal(getattr(a.bn, key), getattr(b.bn, key)), key
        a.zero_grad(set_to_none=True)
        out.backward(grad_out)
        assert (xg.grad is not None) == x_requires_grad
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in a.parameters())
        grads = [p.grad.clone() for p in a.parameters()] + ([xg.grad] if x_requires_grad else [])
        if first is not None:  # the replayed call: deterministic kernels, the same gradients
            assert all(torch.equal(g, h) for g, h in zip(first, grads))
        first = grads


@pytest.mark.gpu
def test_gpu_strided_output_gradient_and_mixed_parameter_dtypes():
    """A broadcast output gradient (stride 0 along the batch, from (out · w).sum()) is read correctly, and fp32
    BatchNorm parameters and scale next to fp16 activations get fp32 gradients as accurate as an all-fp16 torch's."""
    n, k, f = 37, 48, 264
    gen = torch.Generator().manual_seed(12)
    plain = _randomize(Model(k, f), gen).cuda().half().train()
    ref_model = copy.deepcopy(plain).double()
    mixed = LinearBatchNormSoftmax.from_module(plain)
    mixed.bn.float()
    mixed.scale.data = mixed.scale.data.float()
    x = torch.randn(n, k, generator=gen).half().cuda()
    w = torch.randn(f, generator=gen).half().cuda()

    def grads(model, xx, ww):
        for p in model.parameters():
            p.grad = None
        xx = xx.clone().requires_grad_(True)
        (model(xx).sum(0) * ww).sum().backward()  # out's gradient: ww expanded over the batch, strides (0, 1)
        return {"x": xx.grad, "weight": model.gemm.weight.grad, "bias": model.gemm.bias.grad,
                "bn_weight": model.bn.weight.grad, "bn_bias": model.bn.bias.grad, "scale": model.scale.grad}
    ref = grads(ref_model, x.double(), w.double())
    theirs = grads(plain, x, w)
    ours = grads(mixed, x, w)
    for key in ("bn_weight", "bn_bias", "scale"):
        assert ours[key].dtype == torch.float32, key
    for key, want in ref.items():
        _check_close(f"d{key}", ours[key], theirs[key], want.cpu().numpy(), "float16")
