"""torch.library custom ops (cupy_attn.torch_ops): fake shapes, opcheck, torch.compile(fullgraph=True) without graph
breaks. CPU tests run the float64 reference through the ops; GPU tests (marked) compile real kernels."""
import copy

import pytest

torch = pytest.importorskip("torch")

import cupy_attn  # noqa: E402
from cupy_attn import torch_ops  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402

SDPA = cupy_attn.scaled_dot_product_attention
LBS = cupy_attn.linear_batchnorm_softmax


# --- fake implementations: shapes, dtypes, devices as the eager functions ------------------------------------------

# (query shape, key shape, value shape, kwargs): leading axes, GQA, Ev != E, L=1, S=1, empty, masks, causal, lse
SDPA_CALLS = [
    ((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8), {}),
    ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6), {"enable_gqa": True}),
    ((1, 1, 1, 40), (1, 1, 1, 40), (1, 1, 1, 200), {"return_lse": True}),
    ((3, 2, 4, 113, 64), (3, 2, 4, 203, 64), (3, 2, 4, 203, 64), {"is_causal": True, "return_lse": True}),
    ((2, 8, 9, 16), (2, 1, 3, 16), (2, 1, 3, 16), {"enable_gqa": True, "is_causal": "bottom_right"}),
    ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8), {"attn_mask": ((5, 7), torch.bool), "scale": 0.3}),
    ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8), {"attn_mask": ((2, 1, 5, 7), None)}),
    ((2, 3, 0, 8), (2, 3, 7, 8), (2, 3, 7, 8), {"return_lse": True}),
    ((2, 3, 5, 8), (2, 3, 0, 8), (2, 3, 0, 4), {"return_lse": True}),
]


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # fake CUDA tensors need no GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qs,ks,vs,kw", SDPA_CALLS)
def test_sdpa_fake_shapes(qs, ks, vs, kw, dtype, device):
    kw = dict(kw)
    with FakeTensorMode():
        q, k, v = (torch.empty(s, dtype=dtype, device=device) for s in (qs, ks, vs))
        if "attn_mask" in kw:
            shape, mdt = kw["attn_mask"]
            kw["attn_mask"] = torch.empty(shape, dtype=mdt or dtype, device=device)
        res = SDPA(q, k, v, **kw)  # FakeTensor inputs route to the op: nothing is computed
    out, lse = res if kw.get("return_lse") else (res, None)
    assert isinstance(out, FakeTensor)
    assert out.shape == qs[:-1] + (vs[-1],) and out.dtype == dtype and out.device.type == device
    assert out.is_contiguous()
    if kw.get("return_lse"):
        assert lse.shape == qs[:-1] and lse.dtype == torch.float32 and lse.device.type == device
    else:
        assert not isinstance(res, tuple)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,K,F", [(8, 16, 32), (1, 3, 1), (0, 4, 5), (130, 64, 4097)])
def test_lbs_fake_shapes(N, K, F, dtype, device):
    with FakeTensorMode():
        x, w = torch.empty(N, K, dtype=dtype, device=device), torch.empty(F, K, dtype=dtype, device=device)
        vec = [torch.empty(F, dtype=torch.float32, device=device) for _ in range(4)]
        nbt = torch.zeros((), dtype=torch.long, device=device)
        out = LBS(x, w, torch.empty(F, dtype=dtype, device=device), vec[0], vec[1], vec[2], vec[3],
                  torch.ones(1, device=device), training=True, num_batches_tracked=nbt)
    assert isinstance(out, FakeTensor)
    assert out.shape == (N, F) and out.dtype == dtype and out.device.type == device


@pytest.mark.parametrize("kw,exc,match", [
    ({"dropout_p": 1.5}, ValueError, "dropout_p must be in"),
    ({"is_causal": "diagonal"}, ValueError, "is_causal must be"),
    ({"is_causal": True, "attn_mask": True}, ValueError, "attn_mask and is_causal"),
])
def test_fake_raises_flag_errors_at_trace_time(kw, exc, match):
    with FakeTensorMode():
        q = torch.empty(1, 2, 3, 4)
        if kw.get("attn_mask") is True:
            kw = dict(kw, attn_mask=torch.ones(3, 3, dtype=torch.bool))
        with pytest.raises(exc, match=match):
            SDPA(q, q, q, **kw)


def test_opcheck_sdpa_cpu():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g), \
        torch.randn(2, 2, 7, 6, generator=g)
    op = torch.ops.cupy_attn.scaled_dot_product_attention.default
    rng = torch.tensor([12345, 678], dtype=torch.int64)
    for args in [(q, k, v, None, 0.0, None, "top_left", None, True, "auto", True, False, None),
                 (q, k, v, None, 0.0, None, "", 0.5, True, "auto", False, False, None),
                 (q, k[:, :1].expand(2, 4, 7, 8), v[:, :1].expand(2, 4, 7, 6), torch.randn(5, 7, generator=g), 0.0,
                  None, "", None, False, "auto", True, False, None),
                 (q, k, v, None, 0.3, rng, "bottom_right", None, True, "auto", True, False, None)]:
        torch.library.opcheck(op, args)


def test_opcheck_lbs_cpu_declares_its_mutations():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(6, 5, generator=g), torch.randn(3, 5, generator=g), torch.randn(3, generator=g)
    rm, rv, nbt = torch.zeros(3), torch.ones(3), torch.zeros((), dtype=torch.long)
    op = torch.ops.cupy_attn.linear_batchnorm_softmax.default
    torch.library.opcheck(op, (x, w, b, rm, rv, None, None, torch.full((1,), 1.5), True, None, 1e-5, nbt, None))
    torch.library.opcheck(op, (x, w, b, rm, rv, torch.rand(3, generator=g), None, torch.ones(3), False, 0.1, 1e-5,
                               None, None))


def test_causal_to_str():
    assert [torch_ops.causal_to_str(c) for c in (False, None, True, "top_left", "bottom_right")] == \
        ["", "", "top_left", "top_left", "bottom_right"]
    with pytest.raises(ValueError, match="is_causal must be"):
        torch_ops.causal_to_str(1)


# --- eager calls keep the direct path --------------------------------------------------------------------------------

def test_eager_calls_do_not_go_through_the_op(monkeypatch):
    """The op's dispatch costs ~10 µs (SDPA) / ~50 µs (Linear-BN-softmax) of host time: eager calls must skip it."""
    def boom(*a, **k):
        raise AssertionError("eager call went through the custom op")
    monkeypatch.setattr(torch_ops, "scaled_dot_product_attention", boom)
    monkeypatch.setattr(torch_ops, "linear_batchnorm_softmax", boom)
    q = torch.randn(1, 2, 3, 4)
    SDPA(q, q, q)
    LBS(torch.randn(4, 3), torch.randn(2, 3), None, None, None, None, None, torch.ones(1), training=True)


# --- torch.compile(fullgraph=True): no graph break, same results -----------------------------------------------------

class _Attention(torch.nn.Module):
    """A GQA self-attention block calling cupy_attn (heads 4 over 2 KV heads), then Linear-BN-softmax on the rows."""

    def __init__(self, d=32, heads=4, kv_heads=2, is_causal=True, features=16):
        super().__init__()
        self.h, self.hkv, self.dh, self.is_causal = heads, kv_heads, d // heads, is_causal
        self.q = torch.nn.Linear(d, d)
        self.kv = torch.nn.Linear(d, 2 * kv_heads * self.dh)
        self.o = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, features)
        self.bn = torch.nn.BatchNorm1d(features)

    def forward(self, x, mask=None):
        B, L, _ = x.shape
        q = self.q(x).view(B, L, self.h, self.dh).transpose(1, 2)
        k, v = self.kv(x).view(B, L, 2, self.hkv, self.dh).unbind(2)
        y = SDPA(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=self.is_causal and mask is None,
                 enable_gqa=True)
        y = self.o(y.transpose(1, 2).reshape(B, L, -1)).reshape(B * L, -1)
        bn = self.bn
        return LBS(y, self.head.weight, self.head.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                   torch.ones(1, device=x.device, dtype=x.dtype), training=bn.training, momentum=bn.momentum,
                   eps=bn.eps, num_batches_tracked=bn.num_batches_tracked if bn.training else None)


def _clone_model(m):
    return copy.deepcopy(m)  # same weights, buffers, dtypes (fp32 BatchNorm under 16-bit layers) and mode


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("training", [False, True])
def test_compile_fullgraph_cpu_matches_eager(backend, training):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Attention().train(training)
    ref_model = _clone_model(model)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(2, 6, 32)
    mask = torch.rand(2, 1, 6, 6) > 0.3
    with torch.no_grad():
        for m in (None, mask):
            got, want = compiled(x, m), ref_model(x, m)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name in ("running_mean", "running_var", "num_batches_tracked"):  # in-place updates survive compilation
        torch.testing.assert_close(getattr(model.bn, name), getattr(ref_model.bn, name))


class _Head(torch.nn.Module):
    """A Linear, then Linear-BN-softmax with every parameter trainable (per-feature scale): x's gradient flows back
    through the fused op into the first Linear."""

    def __init__(self, d=32, features=16):
        super().__init__()
        self.pre = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, features)
        self.bn = torch.nn.BatchNorm1d(features)
        self.scale = torch.nn.Parameter(torch.rand(features) + 0.5)

    def forward(self, x):
        bn = self.bn
        return LBS(self.pre(x), self.head.weight, self.head.bias, bn.running_mean, bn.running_var, bn.weight,
                   bn.bias, self.scale, training=bn.training, momentum=bn.momentum, eps=bn.eps,
                   num_batches_tracked=bn.num_batches_tracked if bn.training else None)


@pytest.mark.parametrize("training", [True, False])
def test_compile_training_step_matches_eager_gradients(training):
    """Grad mode on: the compiled graph records Linear-BN-softmax through the functional op and its registered backward
    (CPU: the float64 reference of both), and gives eager's output, every parameter's gradient and running stats."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Head().train(training)
    with torch.no_grad():
        model.bn.weight.uniform_(0.5, 1.5), model.bn.bias.normal_(), model.bn.running_var.uniform_(0.5, 2)
    ref_model = _clone_model(model)
    x = torch.randn(12, 32)
    grad = torch.randn(12, 16)
    got = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    want = ref_model(x)
    assert got.requires_grad and want.requires_grad
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.backward(grad)
    want.backward(grad)
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(model.bn, name), getattr(ref_model.bn, name))


def test_compile_training_graph_holds_the_functional_op_pair():
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def compiler(g, _):
            graphs.append(g)
            return make_boxed_func(g.forward)
        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler, bw_compiler=compiler)

    model = _Head().train()
    torch.compile(model, fullgraph=True, backend=backend)(torch.randn(12, 32)).pow(2).sum().backward()
    targets = [[str(n.target) for n in g.graph.nodes if n.op == "call_function"] for g in graphs]
    assert len(graphs) == 2
    assert sum("cupy_attn.linear_batchnorm_softmax_forward" in t for t in targets[0]) == 1, targets[0]
    assert not any("cupy_attn.linear_batchnorm_softmax.default" in t for t in targets[0]), targets[0]
    assert sum("cupy_attn.linear_batchnorm_softmax_backward" in t for t in targets[1]) == 1, targets[1]


def test_opcheck_lbs_functional_pair_cpu():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(6, 5, generator=g), torch.randn(3, 5, generator=g), torch.randn(3, generator=g)
    rm, rv, nbt = torch.zeros(3), torch.ones(3), torch.zeros((), dtype=torch.long)
    gamma, beta, scale = torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g), torch.full((1,), 1.5)
    fwd = torch.ops.cupy_attn.linear_batchnorm_softmax_forward.default
    for args in [(x, w, b, rm, rv, gamma, beta, scale, True, None, 1e-5, nbt, None),
                 (x, w, None, rm, rv, None, None, torch.rand(3, generator=g) + 0.5, False, 0.1, 1e-5, None, None),
                 (x, w, b, None, None, gamma, beta, scale, True, 0.1, 1e-5, None, None),
                 (x, w, b, rm, rv, gamma, None, torch.tensor(0.7), True, 0.1, 1e-5, nbt, None)]:
        args = tuple(a.clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point()
                     and i in (0, 1, 2, 5, 6, 7) else a for i, a in enumerate(args))
        torch.library.opcheck(fwd, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    out, y, stats = fwd(x, w, b, rm, rv, gamma, beta, scale, True, 0.1, 1e-5, nbt, None)[:3]
    bwd = torch.ops.cupy_attn.linear_batchnorm_softmax_backward.default
    torch.library.opcheck(bwd, (torch.randn(6, 3, generator=g), x, w, y, out, stats, gamma, beta, scale, True,
                                [True, True, True, True, False, True], None))


def test_dynamo_never_traces_the_call_cache(monkeypatch):
    """The call-cache keys read data pointers and the current stream: the route to the op must come before them."""
    from cupy_attn.linear_bn_softmax import api as lbs_api
    from cupy_attn.runtime import callcache

    def guarded(fn):
        def wrapper(*args, **kwargs):
            assert not torch.compiler.is_compiling(), f"Dynamo traced {fn.__name__}"
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(callcache, "key", guarded(callcache.key))
    monkeypatch.setattr(lbs_api, "_call_key", guarded(lbs_api._call_key))
    test_compile_fullgraph_cpu_matches_eager("eager", True)


def test_compile_graph_holds_one_op_per_call():
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = _Attention().eval()
    with torch.no_grad():
        torch.compile(model, fullgraph=True, backend=backend)(torch.randn(2, 6, 32))
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("cupy_attn.scaled_dot_product_attention" in t for t in targets) == 1, targets
    assert sum("cupy_attn.linear_batchnorm_softmax" in t for t in targets) == 1, targets


def test_compile_dropout_matches_eager_for_the_same_seed():
    """Dropout compiles without a graph break: the rng pair's draw (torch.randint) is traced as an ordinary RNG op, so
    a compiled call consumes torch's generator as the eager call does and gives the same output for the same seed."""
    torch._dynamo.reset()
    q = torch.randn(1, 2, 9, 4)
    f = torch.compile(lambda q: SDPA(q, q, q, dropout_p=0.5), fullgraph=True, backend="eager")
    torch.manual_seed(7)
    got = f(q)
    torch.manual_seed(7)
    want = SDPA(q, q, q, dropout_p=0.5)
    torch.testing.assert_close(got, want)
    assert not torch.equal(f(q), got), "a second call draws a new mask"


def test_compile_dropout_trace_time_error():
    torch._dynamo.reset()
    q = torch.randn(1, 2, 3, 4)
    f = torch.compile(lambda q: SDPA(q, q, q, dropout_p=1.5), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="dropout_p must be in"):
        f(q)


# --- GPU: real kernels, inductor, CUDA graphs ------------------------------------------------------------------------

def _gpu_model(dtype, training):
    torch.manual_seed(0)
    model = _Attention().to("cuda", dtype).train(training)
    model.bn.float()  # fp32 BatchNorm parameters and stats with 16-bit activations, as the eager API allows
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_compile_fullgraph_inductor_matches_eager(dtype, training):
    torch._dynamo.reset()
    model = _gpu_model(dtype, training)
    ref_model = _clone_model(model)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 64, 32, device="cuda", dtype=dtype)
    mask = torch.rand(2, 1, 64, 64, device="cuda") > 0.3
    tol = {"rtol": 2e-2, "atol": 2e-3} if dtype == torch.float16 else {"rtol": 1e-4, "atol": 1e-5}
    with torch.no_grad():
        for m in (None, mask, None):
            got, want = compiled(x, m), ref_model(x, m)
            torch.cuda.synchronize()
            torch.testing.assert_close(got, want, **tol)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(model.bn, name), getattr(ref_model.bn, name), rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("training", [False, True])
def test_gpu_compile_reduce_overhead_runs_and_matches_eager(training):
    torch._dynamo.reset()
    model = _gpu_model(torch.float16, training)
    ref_model = _clone_model(model)
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for i in range(5):  # warm-up runs, then CUDA-graph capture and replays
            x = torch.randn(2, 64, 32, device="cuda", dtype=torch.float16)
            got = compiled(x).clone()
            want = ref_model(x)
            torch.cuda.synchronize()
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3, msg=f"iteration {i}")
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(model.bn, name), getattr(ref_model.bn, name), rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_compile_linear_batchnorm_softmax_module(mode):
    from cupy_attn.torch import LinearBatchNormSoftmax
    torch._dynamo.reset()
    torch.manual_seed(0)
    fused = LinearBatchNormSoftmax(64, 300, device="cuda", dtype=torch.float16).train()
    ref = LinearBatchNormSoftmax(64, 300, device="cuda", dtype=torch.float16).train()
    ref.load_state_dict(fused.state_dict())
    compiled = torch.compile(fused, fullgraph=True, mode=mode)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(128, 64, device="cuda", dtype=torch.float16)
            got, want = compiled(x).clone(), ref(x)
            torch.cuda.synchronize()
            torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(fused.bn.running_mean, ref.bn.running_mean, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(fused.bn.running_var, ref.bn.running_var, rtol=1e-3, atol=1e-4)
    assert int(fused.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_compile_training_step_matches_eager(mode):
    """A compiled training step (fullgraph, inductor; CUDA graphs with reduce-overhead) of the fused module: output,
    every gradient and the running stats as the eager fused module's, step after step."""
    from cupy_attn.torch import LinearBatchNormSoftmax
    torch._dynamo.reset()
    torch.manual_seed(0)
    fused = LinearBatchNormSoftmax(64, 300, scale_shape=(300,), device="cuda", dtype=torch.float16).train()
    ref = LinearBatchNormSoftmax(64, 300, scale_shape=(300,), device="cuda", dtype=torch.float16).train()
    ref.load_state_dict(fused.state_dict())
    compiled = torch.compile(fused, fullgraph=True, mode=mode)
    for step in range(4):
        x = torch.randn(128, 64, device="cuda", dtype=torch.float16)
        grad = torch.randn(128, 300, device="cuda", dtype=torch.float16)
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        got, want = compiled(xs[0]), ref(xs[1])
        params = [list(fused.parameters()), list(ref.parameters())]
        g_got = torch.autograd.grad(got, [xs[0]] + params[0], grad)
        g_want = torch.autograd.grad(want, [xs[1]] + params[1], grad)
        torch.cuda.synchronize()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-4, msg=f"step {step}")
        for name, a, b in zip(["x"] + [n for n, _ in fused.named_parameters()], g_got, g_want):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-4, msg=f"step {step} d{name}")
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(fused.bn, name), getattr(ref.bn, name), rtol=1e-3, atol=1e-4)
