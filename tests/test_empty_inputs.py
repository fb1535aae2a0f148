"""Empty inputs (B, H, L or S = 0, no tokens at all, Ev = 0) give what torch's scaled_dot_product_attention gives,
forward and backward, on every path, and launch nothing (issue 35); Linear-BN-softmax's empty batch, feature and
input axes too.

CPU: the reference path (NumPy; CPU torch, autograd included) against torch's CPU results; the GPU decision with a
fake device: the plan is "empty" under every backend, flag and environment override, a call makes no CuPy view and
prepares no launch, and the backward returns zero gradients. GPU (marked ``gpu``): each path's configuration on CUDA
tensors and CuPy arrays, forward and backward, against torch on the same inputs.
"""
import contextlib

import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference
from cupy_attn.attention import autograd as _autograd, checks as _checks, dispatch as _dispatch, sdpa as _sdpa
from cupy_attn.runtime import interop as _interop

torch = pytest.importorskip("torch")
F = torch.nn.functional
SDPA = cupy_attn.scaled_dot_product_attention

# (name, query shape, key shape, value shape, kwargs); masks as (shape, "bool" | "float").
CASES = [
    ("B=0", (0, 4, 16, 64), (0, 4, 16, 64), (0, 4, 16, 64), {}),
    ("H=0", (2, 0, 16, 64), (2, 0, 16, 64), (2, 0, 16, 64), {}),
    ("H=0 gqa", (2, 0, 16, 64), (2, 0, 16, 64), (2, 0, 16, 64), {"enable_gqa": True}),
    ("L=0", (2, 4, 0, 64), (2, 4, 16, 64), (2, 4, 16, 64), {}),
    ("S=0", (2, 4, 16, 64), (2, 4, 0, 64), (2, 4, 0, 64), {}),
    ("S=0 causal", (2, 4, 16, 64), (2, 4, 0, 64), (2, 4, 0, 64), {"is_causal": True}),
    ("S=0 bottom_right", (2, 4, 16, 64), (2, 4, 0, 64), (2, 4, 0, 64), {"is_causal": "bottom_right"}),
    ("S=0 gqa Ev", (2, 4, 16, 64), (2, 2, 0, 64), (2, 2, 0, 40), {"enable_gqa": True}),
    ("S=0 bool mask", (2, 4, 16, 64), (2, 4, 0, 64), (2, 4, 0, 64), {"attn_mask": ((16, 0), "bool")}),
    ("S=0 float mask", (2, 4, 16, 64), (2, 4, 0, 64), (2, 4, 0, 64), {"attn_mask": ((2, 1, 16, 0), "float")}),
    ("L=0 float mask", (2, 4, 0, 64), (2, 4, 16, 64), (2, 4, 16, 64), {"attn_mask": ((1, 4, 0, 16), "float")}),
    ("B=0 L=0 (no tokens)", (0, 4, 0, 64), (0, 4, 0, 64), (0, 4, 0, 64), {}),
    ("L=S=0", (2, 4, 0, 64), (2, 4, 0, 64), (2, 4, 0, 64), {"is_causal": True}),
    ("B=0 leading axes", (3, 0, 2, 16, 64), (3, 0, 2, 16, 64), (3, 0, 2, 16, 64), {}),
    ("3-D S=0", (4, 16, 64), (4, 0, 64), (4, 0, 64), {}),
    ("head dim 1024 S=0", (1, 2, 8, 1024), (1, 2, 0, 1024), (1, 2, 0, 1024), {}),
    ("Ev=0", (2, 4, 16, 64), (2, 4, 16, 64), (2, 4, 16, 0), {}),
    ("Ev=0 bool mask", (2, 4, 16, 64), (2, 4, 24, 64), (2, 4, 24, 0), {"attn_mask": ((16, 24), "bool")}),
    ("B=0 dropout", (0, 4, 16, 64), (0, 4, 16, 64), (0, 4, 16, 64), {"dropout_p": 0.3}),
    ("S=0 dropout", (2, 4, 16, 64), (2, 4, 0, 64), (2, 4, 0, 64), {"dropout_p": 0.3}),
]
IDS = [c[0] for c in CASES]


def _arrays(qs, ks, vs, kw, make):
    """(q, k, v, kwargs) from ``make(shape, kind)`` ("data" or "bool"); masks built the same way."""
    q, k, v = make(qs, "data"), make(ks, "data"), make(vs, "data")
    kw = dict(kw)
    if "attn_mask" in kw:
        shape, kind = kw["attn_mask"]
        kw["attn_mask"] = make(shape, kind)
    return q, k, v, kw


_OLD_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


def _torch_sdpa(q, k, v, **kw):
    """torch's scaled_dot_product_attention, except for no heads (H = 0) under torch < 2.13, whose CPU kernel dies of
    SIGFPE there (seen with 2.11's; 2.13's returns the empty result): that empty result is built directly, tied to
    q, k and v for autograd (every tensor involved is empty, so are their gradients)."""
    if _OLD_TORCH and q.shape[-3] == 0:
        return q.new_zeros(q.shape[:-1] + v.shape[-1:]) + 0 * (q.sum() + k.sum() + v.sum())
    return F.scaled_dot_product_attention(q, k, v, **kw)


def _torch_kwargs(kw, seqlen_q, seqlen_k):
    """torch's arguments for ours: bottom_right (which torch's is_causal lacks) as a mask; dropout off (every case
    with dropout has an empty or all-zero output, whatever the mask)."""
    kw = {n: x for n, x in kw.items() if n != "dropout_p"}
    if kw.get("is_causal") == "bottom_right":
        kw.pop("is_causal")
        kw["attn_mask"] = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(seqlen_k - seqlen_q)
    return kw


def _expected_lse(q, k, kw):
    """lse as the float64 reference defines it (q, k, a mask: torch tensors or NumPy arrays): -inf where a row sees
    no key, each row's log-sum-exp otherwise (the Ev = 0 cases)."""
    def f64(x):
        return np.asarray(x.detach().double() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
    mask = kw.get("attn_mask")
    if mask is not None:
        mask = np.asarray(mask) if mask.dtype in (torch.bool, np.bool_) else f64(mask)
    _, lse = reference.scaled_dot_product_attention(f64(q), f64(k), np.zeros(tuple(k.shape[:-1]) + (0,)), mask,
                                                    is_causal=kw.get("is_causal", False),
                                                    enable_gqa=kw.get("enable_gqa", False), return_lse=True)
    return lse


def _lse_case(qs, ks, vs) -> str:
    """Which lse an empty call gives: "empty" (B·H·L = 0), "-inf" (S = 0) or "rows" (Ev = 0 with keys)."""
    if np.prod(qs[:-1]) == 0:
        return "empty"
    return "-inf" if ks[-2] == 0 else "rows"


def _cpu_maker(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def make(shape, kind):
        if kind == "bool":
            return torch.rand(shape, generator=gen) > 0.3
        return torch.randn(shape, generator=gen)
    return make


# --- CPU: the reference path against torch ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("name,qs,ks,vs,kw", CASES, ids=IDS)
def test_numpy_reference_path_matches_torch(name, qs, ks, vs, kw, dtype):
    q, k, v, kw = _arrays(qs, ks, vs, kw, _cpu_maker())
    expect = _torch_sdpa(q, k, v, **_torch_kwargs(kw, qs[-2], ks[-2]))
    np_kw = {n: (x.numpy() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    if "attn_mask" in np_kw and np_kw["attn_mask"].dtype != np.bool_:
        np_kw["attn_mask"] = np_kw["attn_mask"].astype(dtype)
    qn, kn, vn = (x.numpy().astype(dtype) for x in (q, k, v))
    out, lse = SDPA(qn, kn, vn, return_lse=True, **np_kw)
    assert isinstance(out, np.ndarray) and out.dtype == dtype and out.shape == tuple(expect.shape), name
    np.testing.assert_array_equal(out.astype(np.float64), expect.double().numpy(), err_msg=name)
    assert lse.dtype == np.float32 and lse.shape == qs[:-1], name
    np.testing.assert_allclose(lse, _expected_lse(qn, kn, np_kw), rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("name,qs,ks,vs,kw", CASES, ids=IDS)
def test_cpu_torch_autograd_matches_torch(name, qs, ks, vs, kw):
    """CPU tensors that autograd records (the differentiable float64 torch ops): out and every gradient (q, k, v, a
    float mask) as torch's, zeros of the inputs' shapes."""
    q, k, v, kw = _arrays(qs, ks, vs, kw, _cpu_maker(1))
    leaves = [q, k, v] + ([kw["attn_mask"]] if "attn_mask" in kw and kw["attn_mask"].dtype != torch.bool else [])
    ours = [x.clone().requires_grad_() for x in leaves]
    theirs = [x.clone().requires_grad_() for x in leaves]
    ours_kw = dict(kw, **({"attn_mask": ours[3]} if len(ours) == 4 else {}))
    theirs_kw = dict(kw, **({"attn_mask": theirs[3]} if len(theirs) == 4 else {}))
    out = SDPA(*ours[:3], **ours_kw)
    expect = _torch_sdpa(*theirs[:3], **_torch_kwargs(theirs_kw, qs[-2], ks[-2]))
    assert out.shape == expect.shape and out.dtype == expect.dtype, name
    torch.testing.assert_close(out, expect.detach(), rtol=0, atol=0, msg=name)
    weight = torch.randn(out.shape)
    (out * weight).sum().backward()
    (expect * weight).sum().backward()
    for a, b, what in zip(ours, theirs, ("query", "key", "value", "attn_mask")):
        if b.grad is None:  # torch leaves an empty mask's gradient unset (ours: an empty tensor)
            assert a.numel() == 0 and (a.grad is None or a.grad.shape == a.shape), f"{name}: {what}"
            continue
        assert a.grad is not None and a.grad.shape == a.shape, f"{name}: {what}"
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=f"{name}: d{what}")


def test_empty_linear_batchnorm_softmax_matches_torch():
    """Linear-BN-softmax's own empty rules, on the reference path: an empty batch (training counts it in
    num_batches_tracked and leaves the stats alone), K = 0 (y is the bias), F = 0 (an (N, 0) result; torch's
    BatchNorm1d fails on 0 features with running stats or an affine, without them it gives (N, 0), as we do)."""
    for n, k, f, training, running in ((0, 8, 4, True, True), (0, 8, 4, False, True), (5, 0, 4, True, True),
                                       (5, 0, 4, False, True), (0, 0, 4, True, True), (5, 8, 0, True, False),
                                       (0, 8, 0, False, False)):
        torch.manual_seed(n * 100 + k * 10 + f)
        lin, bn = torch.nn.Linear(k, f), torch.nn.BatchNorm1d(f, track_running_stats=running)
        bn.train(training)
        with torch.no_grad():
            bn.weight.normal_(), bn.bias.normal_()
        x = torch.randn(n, k)
        scale = torch.tensor([1.5])
        ours = [t.detach().clone().requires_grad_() for t in (x, lin.weight, lin.bias, bn.weight, bn.bias, scale)]
        theirs = [t.detach().clone().requires_grad_() for t in (x, lin.weight, lin.bias, bn.weight, bn.bias, scale)]
        stats = [None if t is None else t.clone() for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
        out = cupy_attn.linear_batchnorm_softmax(ours[0], ours[1], ours[2], stats[0], stats[1], ours[3], ours[4],
                                                 ours[5], training=training, num_batches_tracked=stats[2])
        y = theirs[0] @ theirs[1].T + theirs[2]
        # The affine outside batch_norm: torch's fails on 0 features with a weight (the same math otherwise).
        z = F.batch_norm(y, bn.running_mean, bn.running_var, training=training or not running) * theirs[3] + theirs[4]
        expect = torch.softmax(theirs[5] * z, dim=1)
        what = f"N={n} K={k} F={f} training={training}"
        assert out.shape == (n, f) and out.dtype == x.dtype, what
        torch.testing.assert_close(out, expect.detach(), msg=what)
        if running:
            torch.testing.assert_close(stats[0], bn.running_mean, msg=what)
            torch.testing.assert_close(stats[1], bn.running_var, msg=what)
            assert stats[2].item() == int(training), what  # an empty batch counts in training
        weight = torch.randn(n, f)
        (out * weight).sum().backward()
        (expect * weight).sum().backward()
        for a, b, arg in zip(ours, theirs, ("x", "weight", "bias", "bn_weight", "bn_bias", "scale")):
            assert a.grad is not None and a.grad.shape == a.shape, f"{what}: {arg}"
            # K = 0 in training: y is the bias, its variance 0, 1/sqrt(eps) scales torch's fp32 rounding to ~3e-5
            torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-5, msg=f"{what}: d{arg}")


# --- CPU: the GPU decision, with a fake device ----------------------------------------------------------------

def _gpu_problem(qs, ks, vs, kw, dtype="float16"):
    """The checked problem of a GPU call of these shapes, without arrays (what an empty call keeps is never read by
    the plan)."""
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    mask = kw.get("attn_mask")
    causal = kw.get("is_causal")
    return _checks.SDPAProblem(
        ctx=_interop.CallContext(_interop.CUPY, 0), query=None, key=None, value=None, batch_shape=qs[:-2],
        batch=int(np.prod(qs[:-3])), num_heads=qs[-3], num_kv_heads=ks[-3], seqlen_q=qs[-2], seqlen_k=ks[-2],
        head_dim=qs[-1], head_dim_v=vs[-1], dtype=dt, scale=0.125,
        causal="top_left" if causal is True else causal or None,
        mask_kind="none" if mask is None else mask[1], dropout_p=kw.get("dropout_p", 0.0))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name,qs,ks,vs,kw", CASES, ids=IDS)
@pytest.mark.parametrize("backend,env,num_splits", [
    ("auto", {}, None), ("fused", {}, None), ("split", {}, None), ("auto", {"CUPY_ATTN_BACKEND": "split"}, None),
    ("auto", {"CUPY_ATTN_BACKEND": "fused"}, None), ("auto", {}, 4), ("fused", {"CUPY_ATTN_FA3": "3"}, None),
    ("auto", {"CUPY_ATTN_D512": "1", "CUPY_ATTN_DECODE": "3"}, None), ("auto", {"CUPY_ATTN_WGMMA": "0"}, None)])
def test_gpu_plan_is_empty_on_every_path(name, qs, ks, vs, kw, dtype, backend, env, num_splits, monkeypatch):
    """Whatever path the call would take (fused: mma.sync, wgmma, FA3-design, head-dim-512; decode; split with the
    scores kernel or cuBLAS; dropout; fp32), an empty GPU call plans "empty": nothing is built or launched. Flag errors
    that do not depend on sizes stay (dropout with num_splits)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    p = _gpu_problem(qs, ks, vs, kw, dtype)
    assert p.empty, name
    if p.dropout_p > 0 and num_splits is not None:
        with pytest.raises(ValueError, match="no dropout"):
            _dispatch.plan_sdpa(p, backend, arch=90, num_splits=num_splits, num_sms=132)
        return
    for arch in (80, 90):
        plan = _dispatch.plan_sdpa(p, backend, arch=arch, num_splits=num_splits, num_sms=132)
        assert plan.backend == "empty" and plan.kernel is None and plan.choice is None, (name, str(plan))
        assert {"empty": "nothing to compute", "-inf": "S = 0", "rows": "head_dim_v = 0"}[_lse_case(qs, ks, vs)] \
            in plan.reason, plan.reason


def test_gpu_reference_backend_keeps_its_plan():
    p = _gpu_problem((0, 4, 16, 64), (0, 4, 16, 64), (0, 4, 16, 64), {})
    assert _dispatch.plan_sdpa(p, "reference", arch=90).backend == "reference"


class _FakeGpuCtx:
    """A GPU call context whose outputs are NumPy arrays: what _run_empty makes, without a device."""
    kind = _interop.NUMPY  # interop.from_numpy keeps NumPy results (the Ev = 0 lse)
    device_id = 0
    on_gpu = True
    stream = None

    def __init__(self):
        self.made = []

    @contextlib.contextmanager
    def activate(self):
        yield

    def full(self, shape, dtype, value):
        a = np.full(shape, value, dtype=dtype)
        self.made.append(a)
        return a

    def as_cupy(self, x):
        return x

    def empty(self, shape, dtype):
        raise AssertionError("an empty call allocates no output for a launch")


def _fake_gpu_problem(qs, ks, vs, kw):
    q, k, v, kw = _arrays(qs, ks, vs, kw, _cpu_maker(2))
    p = _gpu_problem(qs, ks, vs, {n: (x if n != "attn_mask" else (None, "bool" if x.dtype == torch.bool else "float"))
                                  for n, x in kw.items()}, "float32")
    p.ctx = _FakeGpuCtx()
    p.query, p.key, p.value = q.numpy(), k.numpy(), v.numpy()
    p.mask = None if "attn_mask" not in kw else kw["attn_mask"].numpy()
    return p, (q, k, v, kw)


@pytest.mark.parametrize("backend", ["auto", "fused", "split", "reference"])
@pytest.mark.parametrize("name,qs,ks,vs,kw", CASES, ids=IDS)
def test_run_returns_torch_results_and_launches_nothing(name, qs, ks, vs, kw, backend, monkeypatch):
    """sdpa._run on an empty GPU problem: out (zeros or empty) and lse (-inf, empty, or each row's for Ev = 0) from
    the caller's allocator (ctx.full), no launch prepared, nothing cached."""
    monkeypatch.setattr(_dispatch, "device_arch", lambda p: 90)
    monkeypatch.setattr(_dispatch.Plan, "prepare", lambda *a: pytest.fail("an empty call prepared a launch"))
    monkeypatch.setattr(_sdpa.callcache, "put", lambda *a: pytest.fail("an empty call was cached"))
    p, (q, k, v, tkw) = _fake_gpu_problem(qs, ks, vs, kw)
    expect = _torch_sdpa(q, k, v, **_torch_kwargs(tkw, qs[-2], ks[-2]))
    out = _sdpa._run(p, backend, None, None, False, False, ("key",), (None,) * 4)
    assert out.shape == tuple(expect.shape) and out.dtype == np.float32, name
    np.testing.assert_array_equal(out, expect.numpy(), err_msg=name)
    out, lse = _sdpa._run(p, backend, None, None, False, True, ("key",), (None,) * 4)
    assert lse.shape == qs[:-1] and lse.dtype == np.float32, name
    np.testing.assert_allclose(lse, _expected_lse(q, k, tkw), rtol=1e-5, atol=1e-5, err_msg=name)


class _FakeCudaArray:
    """A CUDA DLPack object of a shape and dtype, holding no memory: only its shape may be read."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    def __dlpack__(self, *a, **k):
        raise AssertionError("an empty call reads no array")

    def __dlpack_device__(self):
        return (2, 0)


@pytest.fixture
def fake_cuda(monkeypatch):
    """DLPack inputs on a fake device 0 (compute capability 9.0): the call's context, dtype and arch are read without
    a GPU; views (CallContext.as_cupy) fail the test; results are NumPy arrays (CallContext.full)."""
    import cupy
    from _launch_capture import FakeStream
    stream = FakeStream(0x5700)

    class Device:
        def __init__(self, device_id=None):
            self.id, self.compute_capability = 0, "90"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *a: stream)
    monkeypatch.setattr(_interop, "_CONTEXTS", {})
    monkeypatch.setattr(_interop, "dlpack_view", lambda x: x)
    monkeypatch.setattr(_interop.CallContext, "as_cupy", lambda self, x: pytest.fail("an empty call made a view"))
    monkeypatch.setattr(_interop.CallContext, "full", lambda self, shape, dtype, value: np.full(shape, value, dtype))
    monkeypatch.setattr(_dispatch.Plan, "prepare", lambda *a: pytest.fail("an empty call prepared a launch"))


@pytest.mark.parametrize("name,qs,ks,vs,kw", [c for c in CASES if "dropout" not in c[0] and "Ev=0" not in c[0]],
                         ids=[c[0] for c in CASES if "dropout" not in c[0] and "Ev=0" not in c[0]])
def test_public_call_on_cuda_arrays_makes_no_view(name, qs, ks, vs, kw, fake_cuda):
    """The whole public call on (fake) CUDA inputs: checks without views, the "empty" plan, torch's results. (Today's
    crash of a (0, 4, 16, 64) query came from the views and launches an empty call made.)"""
    def make(shape, kind):
        return _FakeCudaArray(shape, np.bool_ if kind == "bool" else np.float16)
    q, k, v, fkw = _arrays(qs, ks, vs, kw, make)
    tq, tk, tv, tkw = _arrays(qs, ks, vs, kw, _cpu_maker(3))
    expect = _torch_sdpa(tq, tk, tv, **_torch_kwargs(tkw, qs[-2], ks[-2]))
    for backend in ("auto", "fused", "split"):
        out, lse = SDPA(q, k, v, backend=backend, return_lse=True, **fkw)
        assert out.shape == tuple(expect.shape) and out.dtype == np.float16, name
        np.testing.assert_array_equal(out, expect.numpy(), err_msg=name)
        assert lse.shape == qs[:-1] and lse.dtype == np.float32 and np.all(lse == -np.inf), name
    plan = cupy_attn.explain(q, k, v, **fkw)
    assert plan.backend == "empty", str(plan)


@pytest.mark.parametrize("name,qs,ks,vs,kw", CASES, ids=IDS)
def test_backward_of_empty_calls_is_zeros(name, qs, ks, vs, kw):
    """autograd.grad_inputs (the backward of recorded GPU calls) on an empty call: zero gradients of the inputs'
    shapes and dtypes before any plan (a float mask's gradient in its shape), as torch's."""
    q, k, v, kw = _arrays(qs, ks, vs, kw, _cpu_maker(4))
    mask = kw.get("attn_mask")
    out = _torch_sdpa(q, k, v, **_torch_kwargs(kw, qs[-2], ks[-2]))
    lse = torch.full(qs[:-1], float("-inf"))
    grads = _autograd.grad_inputs(q, k, v, mask, out, lse, torch.randn(out.shape),
                                  is_causal=kw.get("is_causal", False), scale=None,
                                  enable_gqa=kw.get("enable_gqa", False),
                                  need_mask_grad=mask is not None and mask.dtype != torch.bool,
                                  dropout_p=kw.get("dropout_p", 0.0), rng=torch.zeros(2, dtype=torch.int64))
    for g, x in zip(grads, (q, k, v, mask)):
        if x is None or (x is mask and mask.dtype == torch.bool):
            assert g is None, name
            continue
        assert g.shape == x.shape and g.dtype == x.dtype and not g.any(), name


# --- GPU: every path's configuration on CUDA tensors ---------------------------------------------------------------

# (name, dtype, head dims (E, Ev), keyword arguments, environment): the configuration that sends a non-empty call of
# these shapes down each path on an H100/H200 (explain() names it); the empty call must not care.
GPU_PATHS = [
    ("fused mma.sync", torch.float16, (64, 64), {"backend": "fused"}, {"CUPY_ATTN_WGMMA": "0"}),
    ("fused wgmma", torch.bfloat16, (128, 128), {"backend": "fused"}, {}),
    ("fused FA3-design", torch.float16, (128, 128), {"backend": "fused"}, {"CUPY_ATTN_FA3": "3"}),
    ("fused head-dim 512", torch.float16, (512, 512), {}, {"CUPY_ATTN_D512": "1"}),
    ("decode split-KV", torch.float16, (128, 128), {"num_splits": 4}, {}),
    ("decode streaming", torch.bfloat16, (64, 64), {"num_splits": 2}, {"CUPY_ATTN_DECODE": "2"}),
    ("split scores kernel", torch.float16, (1024, 1024), {}, {}),
    ("split cuBLAS + softmax", torch.bfloat16, (320, 320), {"backend": "split"}, {"CUPY_ATTN_SPLIT_FUSED": "0"}),
    ("split fp32 3xTF32", torch.float32, (64, 64), {}, {}),
    ("dropout", torch.float16, (64, 64), {"dropout_p": 0.25}, {}),
    ("dropout split", torch.float32, (96, 96), {"dropout_p": 0.25, "backend": "split"}, {}),
    ("reference backend", torch.float16, (64, 64), {"backend": "reference"}, {}),
]
GPU_CASES = [c for c in CASES if "dropout" not in c[0]]


def _gpu_case(case, path):
    """The case's shapes with the path's head dims (Ev = 0 kept) and the path's arguments added."""
    name, qs, ks, vs, kw = case
    _, dtype, (E, Ev), path_kw, _ = path
    qs, ks = qs[:-1] + (E,), ks[:-1] + (E,)
    vs = vs[:-1] + (0 if vs[-1] == 0 else Ev,)
    kw = dict(kw, **path_kw)
    if kw.get("num_splits") is not None and kw.get("dropout_p"):
        kw.pop("num_splits")
    return qs, ks, vs, kw


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
@pytest.mark.parametrize("path", GPU_PATHS, ids=[p[0] for p in GPU_PATHS])
def test_gpu_empty_forward_and_backward_match_torch(path, case, monkeypatch):
    """Forward (out, lse) and backward (dq, dk, dv, a float mask's gradient) of an empty call on CUDA tensors: torch's
    shapes, dtypes, device and values (CPU torch on the same inputs: zeros or empty; lse -inf, or each row's for
    Ev = 0), on each path's configuration, with and without autograd."""
    for key, value in path[4].items():
        monkeypatch.setenv(key, value)
    dtype = path[1]
    qs, ks, vs, kw = _gpu_case(case, path)
    gen = torch.Generator("cuda").manual_seed(5)

    def make(shape, kind):
        if kind == "bool":
            return torch.rand(shape, generator=gen, device="cuda") > 0.3
        return torch.randn(shape, generator=gen, device="cuda").to(dtype)
    q, k, v, kw = _arrays(qs, ks, vs, kw, make)
    cpu_kw = {n: (x.cpu().float() if isinstance(x, torch.Tensor) and x.dtype != torch.bool else
                  x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()
              if n not in ("backend", "num_splits")}
    what = f"{path[0]} / {case[0]}"
    assert cupy_attn.explain(q, k, v, **kw).backend == ("reference" if kw.get("backend") == "reference" else "empty")

    # forward, no autograd
    out, lse = SDPA(q, k, v, return_lse=True, **kw)
    qc, kc, vc = (x.cpu().float() for x in (q, k, v))
    expect = _torch_sdpa(qc, kc, vc, **_torch_kwargs(cpu_kw, qs[-2], ks[-2])).to(dtype)
    assert out.shape == expect.shape and out.dtype == dtype and out.is_cuda and out.is_contiguous(), what
    torch.testing.assert_close(out.cpu(), expect, rtol=0, atol=0, msg=what)
    assert lse.shape == qs[:-1] and lse.dtype == torch.float32 and lse.is_cuda, what
    torch.testing.assert_close(lse.cpu().double(), torch.from_numpy(_expected_lse(qc, kc, cpu_kw)), rtol=1e-5,
                               atol=1e-5, msg=what)

    # autograd: gradients as torch's on the CPU
    float_mask = "attn_mask" in kw and kw["attn_mask"].dtype != torch.bool
    leaves = [q, k, v] + ([kw["attn_mask"]] if float_mask else [])
    ours = [x.detach().clone().requires_grad_() for x in leaves]
    theirs = [x.detach().cpu().float().requires_grad_() for x in leaves]
    out = SDPA(*ours[:3], **dict(kw, **({"attn_mask": ours[3]} if float_mask else {})))
    expect = _torch_sdpa(*theirs[:3], **_torch_kwargs(
        dict(cpu_kw, **({"attn_mask": theirs[3]} if float_mask else {})), qs[-2], ks[-2]))
    weight = torch.randn(out.shape, generator=gen, device="cuda")
    (out.float() * weight).sum().backward()
    (expect * weight.cpu()).sum().backward()
    for a, b, arg in zip(ours, theirs, ("query", "key", "value", "attn_mask")):
        if b.grad is None:  # torch leaves an empty mask's gradient unset
            assert a.numel() == 0, f"{what}: {arg}"
            continue
        assert a.grad is not None and a.grad.shape == a.shape and a.grad.dtype == a.dtype, f"{what}: {arg}"
        torch.testing.assert_close(a.grad.cpu().float(), b.grad, rtol=0, atol=0, msg=f"{what}: d{arg}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in GPU_CASES if "mask" not in c[0]],
                         ids=[c[0] for c in GPU_CASES if "mask" not in c[0]])
def test_gpu_empty_cupy_inputs(case):
    """CuPy arrays (and their stream): CuPy results of torch's shapes and values."""
    import cupy
    _, qs, ks, vs, kw = case
    q, k, v = (cupy.random.standard_normal(s, dtype=cupy.float32).astype(cupy.float16) for s in (qs, ks, vs))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out, lse = SDPA(q, k, v, return_lse=True, **kw)
    stream.synchronize()
    expect = _torch_sdpa(*(torch.from_numpy(cupy.asnumpy(x)).float() for x in (q, k, v)),
                                            **_torch_kwargs(kw, qs[-2], ks[-2]))
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float16 and out.shape == tuple(expect.shape)
    np.testing.assert_array_equal(cupy.asnumpy(out).astype(np.float32), expect.numpy())
    assert isinstance(lse, cupy.ndarray) and lse.shape == qs[:-1] and lse.dtype == cupy.float32
    np.testing.assert_allclose(cupy.asnumpy(lse), _expected_lse(*(cupy.asnumpy(x) for x in (q, k)), kw), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[0] in ("B=0", "S=0", "L=0", "S=0 float mask")],
                         ids=["B=0", "S=0", "L=0", "S=0 float mask"])
def test_gpu_empty_compiled_training_step(case):
    """torch.compile (fullgraph; the custom op and its registered backward) on empty CUDA inputs: torch's out and
    gradients."""
    _, qs, ks, vs, kw = case
    gen = torch.Generator("cuda").manual_seed(6)
    q, k, v, kw = _arrays(qs, ks, vs, kw, lambda s, kind: torch.randn(s, generator=gen, device="cuda"))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    step = torch.compile(lambda q, k, v: SDPA(q, k, v, **kw).sum() * 2, fullgraph=True, backend="aot_eager")
    step(*leaves).backward()
    ref = [x.detach().cpu().requires_grad_() for x in (q, k, v)]
    (_torch_sdpa(*ref, **{n: x.cpu() for n, x in kw.items()}).sum() * 2).backward()
    for a, b in zip(leaves, ref):
        assert a.grad.shape == b.grad.shape
        torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,f", [(0, 64, 32), (16, 0, 32), (0, 0, 32), (16, 64, 0), (0, 64, 0)])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_empty_linear_batchnorm_softmax(n, k, f, training, dtype):
    """Linear-BN-softmax on CUDA tensors with an empty batch, K = 0 or F = 0: out, running stats (an empty batch
    counts in training and leaves the stats alone) and gradients as torch's on the CPU from the same values."""
    torch.manual_seed(n * 100 + k + f)
    lin = torch.nn.Linear(k, f).to(dtype)
    bn = torch.nn.BatchNorm1d(f)
    with torch.no_grad():
        bn.weight.normal_(), bn.bias.normal_(), bn.running_var.uniform_(0.5, 2), lin.bias.normal_()
    args = (torch.randn(n, k).to(dtype), lin.weight, lin.bias, bn.weight, bn.bias, torch.tensor([1.5]))
    ours = [t.detach().cuda().requires_grad_() for t in args]
    theirs = [t.detach().float().requires_grad_() for t in args]
    stats = [t.clone().cuda() for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    out = cupy_attn.linear_batchnorm_softmax(ours[0], ours[1], ours[2], stats[0], stats[1], ours[3], ours[4],
                                             ours[5], training=training, num_batches_tracked=stats[2])
    y = theirs[0] @ theirs[1].T + theirs[2]
    # The affine outside batch_norm: torch's fails on 0 features with a weight (the same math otherwise).
    z = F.batch_norm(y, bn.running_mean, bn.running_var, training=training) * theirs[3] + theirs[4]
    expect = torch.softmax(theirs[5] * z, dim=1)
    what = f"N={n} K={k} F={f} training={training} {dtype}"
    assert out.shape == (n, f) and out.dtype == dtype and out.is_cuda, what
    torch.testing.assert_close(out.cpu().float(), expect.detach(), atol=2e-3, rtol=0, msg=what)
    torch.testing.assert_close(stats[0].cpu(), bn.running_mean, msg=what)
    torch.testing.assert_close(stats[1].cpu(), bn.running_var, msg=what)
    assert stats[2].item() == int(training), what
    weight = torch.randn(n, f)
    (out.float() * weight.cuda()).sum().backward()
    (expect * weight).sum().backward()
    for a, b, arg in zip(ours, theirs, ("x", "weight", "bias", "bn_weight", "bn_bias", "scale")):
        assert a.grad is not None and a.grad.shape == a.shape and a.grad.dtype == a.dtype, f"{what}: {arg}"
        # K = 0 in training: y is the bias, variance 0: 1/sqrt(eps) scales rounding (fp16 y: to ~1e-2)
        torch.testing.assert_close(a.grad.cpu().float(), b.grad, atol=2e-2, rtol=1e-2, msg=f"{what}: d{arg}")


@pytest.mark.parametrize("name,qs,ks,vs,kw", [c for c in CASES if c[0] in ("S=0", "S=0 causal", "S=0 gqa Ev", "Ev=0",
                                                                          "Ev=0 bool mask")])
def test_empty_calls_with_variants_give_the_references_lse(name, qs, ks, vs, kw, monkeypatch):
    """An empty GPU call with sinks and a window: S = 0 rows give lse = their head's sink logit (its term alone in the
    denominator), Ev = 0 rows the float64 reference's lse with every variant; out as without variants."""
    from cupy_attn.attention.variants import Variants
    monkeypatch.setattr(_dispatch, "device_arch", lambda p: 90)
    p, (q, k, v, tkw) = _fake_gpu_problem(qs, ks, vs, kw)
    sinks = np.linspace(-1.0, 2.0, qs[-3]).astype(np.float32)
    p.variants = Variants(3, 0, 5.0, sinks, None)
    out, lse = _sdpa._run(p, "auto", None, None, False, True, None, (None,) * 4)
    assert out.shape == qs[:-1] + vs[-1:] and not out.any(), name
    mask = tkw.get("attn_mask")
    mask = None if mask is None else mask.numpy()
    _, expect = reference.scaled_dot_product_attention(
        q.double().numpy(), k.double().numpy(), np.zeros(ks[:-1] + (0,)), mask, is_causal=kw.get("is_causal", False),
        enable_gqa=kw.get("enable_gqa", False), window_size=(3, 0), softcap=5.0, sinks=sinks, return_lse=True)
    if ks[-2] == 0:
        np.testing.assert_array_equal(expect, np.broadcast_to(sinks[:, None], expect.shape))
    np.testing.assert_allclose(lse, expect, rtol=1e-5, atol=1e-5, err_msg=name)
