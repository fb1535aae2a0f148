"""Sliding window, softcap, sinks and ALiBi on the GPU, on every path, against the float64 reference.

The error bound is the suite's rule (tests/_tolerance.py): at most about twice the error of the same function computed
by torch in the same precision (scores, softcap and bias in the input dtype, softmax in float32 over the scores and the
sink column, as Hugging Face's eager attention does), plus rounding noise.
"""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference

from _attention_ref import torch_variant_attention
from _tolerance import as_f64, assert_close

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _rand(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * scale).to(DTYPES[dtype])


def _check(q, k, v, dtype, *, backend="auto", causal=False, window=None, softcap=None, sinks=None, slopes=None,
           mask=None, what=""):
    scale = q.shape[-1] ** -0.5
    gqa = q.shape[-3] != k.shape[-3]
    ref, ref_lse = reference.scaled_dot_product_attention(
        as_f64(q), as_f64(k), as_f64(v), None if mask is None else mask.cpu().numpy(), is_causal=causal,
        enable_gqa=gqa, return_lse=True, window_size=window, softcap=softcap,
        sinks=None if sinks is None else as_f64(sinks), alibi_slopes=None if slopes is None else as_f64(slopes))
    junk = [torch.full(ref.shape, float("nan"), device="cuda", dtype=q.dtype),  # poison the next allocations
            torch.full(ref_lse.shape, float("nan"), device="cuda", dtype=torch.float32)]
    del junk
    out, lse = cupy_attn.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa, backend=backend, return_lse=True,
        window_size=window, softcap=softcap, sinks=sinks, alibi_slopes=slopes)
    peer = torch_variant_attention(q, k, v, scale=scale, causal=causal, window=window, softcap=softcap, sinks=sinks,
                                   slopes=slopes, mask=mask)
    assert_close(out, ref, dtype, peer, what)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(as_f64(lse)[finite], ref_lse[finite], rtol=2e-3, atol=2e-3, err_msg=what)
    assert np.all(as_f64(lse)[~finite] == -np.inf), what
    return out


# (B, Hq, Hkv, L, S, E): head dims of every fused kernel (64-256 FA3-design, 512 the d512 kernel, 1000 the split
# path), L != S both ways, tile edges and primes.
SHAPES = [(2, 4, 2, 300, 300, 64), (1, 8, 2, 1000, 1000, 128), (2, 4, 4, 129, 700, 256), (2, 4, 4, 700, 129, 128),
          (1, 4, 2, 383, 383, 512), (1, 2, 2, 100, 230, 1000)]
WINDOWS = [(128, 0), (64, 32), (0, 0), (5000, 5000), (None, 17)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_window(dtype, shape, window, causal):
    B, Hq, Hkv, L, S, E = shape
    g = torch.Generator("cuda").manual_seed(L + S + E)
    q, k, v = _rand((B, Hq, L, E), dtype, g), _rand((B, Hkv, S, E), dtype, g), _rand((B, Hkv, S, E), dtype, g)
    _check(q, k, v, dtype, causal=causal, window=window, what=f"{dtype} {shape} window {window} causal {causal}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_softcap_large_scores(dtype, shape):
    B, Hq, Hkv, L, S, E = shape
    g = torch.Generator("cuda").manual_seed(7 * L + S)
    q, k = _rand((B, Hq, L, E), dtype, g, 3.0), _rand((B, Hkv, S, E), dtype, g, 3.0)
    v = _rand((B, Hkv, S, E), dtype, g)
    _check(q, k, v, dtype, softcap=5.0, causal=True, what=f"{dtype} {shape} softcap 5")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("sink_dtype", ["float32", "input"])
def test_sinks_and_window(dtype, shape, sink_dtype):
    """gpt-oss: a window of 128 and one learned sink logit per query head."""
    B, Hq, Hkv, L, S, E = shape
    g = torch.Generator("cuda").manual_seed(3 * L + S)
    q, k, v = _rand((B, Hq, L, E), dtype, g), _rand((B, Hkv, S, E), dtype, g), _rand((B, Hkv, S, E), dtype, g)
    sinks = torch.randn(Hq, generator=g, device="cuda") * 2
    if sink_dtype == "input":
        sinks = sinks.to(DTYPES[dtype])
    _check(q, k, v, dtype, causal=True, window=(128, 0), sinks=sinks, what=f"{dtype} {shape} sinks + window")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sinks_fully_masked_rows(dtype):
    """Rows that see no key: output 0, lse = the sink (bottom-right causal with L > S leaves the first rows empty)."""
    g = torch.Generator("cuda").manual_seed(5)
    q, k, v = _rand((1, 4, 200, 128), dtype, g), _rand((1, 4, 64, 128), dtype, g), _rand((1, 4, 64, 128), dtype, g)
    sinks = torch.randn(4, generator=g, device="cuda")
    out = _check(q, k, v, dtype, causal="bottom_right", sinks=sinks, what="sinks, empty rows")
    assert torch.all(out[:, :, :136] == 0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi_gqa(dtype, shape, per_batch):
    B, Hq, Hkv, L, S, E = shape
    g = torch.Generator("cuda").manual_seed(11 * L + S)
    q, k, v = _rand((B, Hq, L, E), dtype, g), _rand((B, Hkv, S, E), dtype, g), _rand((B, Hkv, S, E), dtype, g)
    slopes = 2.0 ** (-8.0 * torch.arange(1, Hq + 1, device="cuda") / Hq)
    if per_batch:
        slopes = torch.stack([slopes * (b + 1) for b in range(B)])
    _check(q, k, v, dtype, causal=True, window=(256, 0), slopes=slopes.float(), what=f"{dtype} {shape} ALiBi")


@pytest.mark.parametrize("backend", ["auto", "split"])
def test_strided_sinks_and_slopes(backend):
    """sinks and per-batch slopes as strided views (every other element of a longer tensor): copied, read as the
    values they hold, on the FA3 kernel and on the split path."""
    g = torch.Generator("cuda").manual_seed(17)
    q, k, v = (_rand((2, 4, 300, 128), "bfloat16", g) for _ in range(3))
    sinks = torch.randn(8, generator=g, device="cuda")[::2]
    slopes = torch.rand(2, 8, generator=g, device="cuda")[:, ::2]
    assert not sinks.is_contiguous() and not slopes.is_contiguous()
    _check(q, k, v, "bfloat16", backend=backend, causal=True, window=(100, 0), sinks=sinks, slopes=slopes,
           what=f"strided sinks and slopes, {backend}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_split_path_all_variants(dtype):
    """The split path serves every variant at any head dim and in fp32 (correct, not necessarily fast)."""
    g = torch.Generator("cuda").manual_seed(13)
    q, k, v = _rand((2, 4, 150, 96), dtype, g, 2.0), _rand((2, 2, 260, 96), dtype, g, 2.0), _rand((2, 2, 260, 64),
                                                                                                 dtype, g)
    _check(q, k, v, dtype, backend="split", causal="bottom_right", window=(40, 3), softcap=4.0,
           sinks=torch.randn(4, generator=g, device="cuda"), slopes=torch.rand(2, 4, generator=g, device="cuda"),
           what=f"{dtype} split, every variant")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_window_with_bool_mask(dtype):
    """A window combines with attn_mask (the intersection)."""
    g = torch.Generator("cuda").manual_seed(17)
    q, k, v = _rand((2, 4, 300, 128), dtype, g), _rand((2, 4, 300, 128), dtype, g), _rand((2, 4, 300, 128), dtype, g)
    mask = torch.rand(2, 1, 1, 300, generator=g, device="cuda") > 0.2
    _check(q, k, v, dtype, window=(50, 50), mask=mask, what="window & key padding")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("L", [1, 4])
def test_decode_variants(dtype, L):
    """Few query rows against a long cache (the decode kernel's calls): window + sinks + softcap."""
    g = torch.Generator("cuda").manual_seed(19 + L)
    q, k, v = _rand((4, 32, L, 128), dtype, g), _rand((4, 8, 3000, 128), dtype, g), _rand((4, 8, 3000, 128), dtype, g)
    _check(q, k, v, dtype, causal="bottom_right", window=(1000, 0), sinks=torch.randn(32, generator=g, device="cuda"),
           softcap=30.0, what=f"decode L={L}")


def test_cupy_arrays_in_and_out():
    import cupy
    rng = cupy.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 256, 64), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    sinks = rng.standard_normal(4, dtype=cupy.float32)
    out = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=(32, 0), sinks=sinks,
                                                 softcap=10.0)
    assert isinstance(out, cupy.ndarray)
    ref = reference.scaled_dot_product_attention(*(cupy.asnumpy(x) for x in (q, k, v)), is_causal=True,
                                                 window_size=(32, 0), sinks=cupy.asnumpy(sinks), softcap=10.0)
    assert np.abs(cupy.asnumpy(out).astype(np.float64) - ref).max() < 2e-2


def test_explain_names_the_variant_and_skipped_tiles():
    q = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
    plan = cupy_attn.explain(q, q, q, is_causal=True, window_size=(256, 0), sinks=torch.zeros(8, device="cuda"))
    text = str(plan)
    assert "window (256, 0)" in text and "sinks" in text
    assert "skipped" in text


# ---------------------------------------------------------------------------------------------------------------------
# Gradients: query, key, value and sinks against float64 autograd of the same function (torch ops, the sink as a
# softmax column), within twice the error of that function computed by torch at the inputs' precision.

GRAD_CASES = [
    # (name, B, Hq, Hkv, L, S, E, causal, window, softcap, sinks, alibi)
    ("window causal", 2, 4, 2, 300, 300, 128, True, (64, 0), None, False, False),
    ("window two-sided", 1, 4, 4, 257, 300, 64, False, (40, 17), None, False, False),
    ("window L>S bottom-right", 1, 2, 2, 300, 129, 128, "bottom_right", (50, 0), None, False, False),
    ("softcap", 1, 4, 2, 200, 200, 128, True, None, 5.0, False, False),
    ("alibi gqa", 2, 4, 2, 150, 260, 256, True, (100, 0), None, False, True),
    ("sinks gpt-oss", 1, 8, 2, 256, 256, 64, True, (128, 0), None, True, False),
    ("everything", 1, 4, 2, 193, 193, 96, True, (33, 0), 20.0, True, True),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_gradients(dtype, case):
    name, B, Hq, Hkv, L, S, E, causal, window, softcap, with_sinks, with_alibi = case
    g = torch.Generator("cuda").manual_seed(L + 7 * S + E)
    dt = DTYPES[dtype]
    scale_in = 3.0 if softcap is not None else 1.0
    q = (torch.randn(B, Hq, L, E, generator=g, device="cuda") * scale_in).to(dt).requires_grad_()
    k = (torch.randn(B, Hkv, S, E, generator=g, device="cuda") * scale_in).to(dt).requires_grad_()
    v = torch.randn(B, Hkv, S, E, generator=g, device="cuda").to(dt).requires_grad_()
    sinks = (torch.randn(Hq, generator=g, device="cuda") * 2).requires_grad_() if with_sinks else None
    slopes = (2.0 ** (-8.0 * torch.arange(1, Hq + 1, device="cuda") / Hq)).float() if with_alibi else None
    dout = torch.randn(B, Hq, L, E, generator=g, device="cuda").to(dt)
    kw = dict(causal=causal, window=window, softcap=softcap, slopes=slopes)
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])

    def grads(fn, xs):
        for x in xs:
            x.grad = None
        out = fn(*xs)
        out.backward(dout.to(out.dtype))
        return out, [x.grad.double().cpu() for x in xs]

    out, got = grads(lambda q_, k_, v_, *s: cupy_attn.scaled_dot_product_attention(
        q_, k_, v_, is_causal=causal, enable_gqa=Hq != Hkv, window_size=window, softcap=softcap,
        sinks=s[0] if s else None, alibi_slopes=slopes), inputs)
    ref_in = [x.detach().double().requires_grad_() for x in inputs]
    ref_out, want = grads(lambda q_, k_, v_, *s: torch_variant_attention(q_, k_, v_, sinks=s[0] if s else None, **kw),
                          ref_in)
    peer_in = [x.detach().clone().requires_grad_() for x in inputs]
    _, peer = grads(lambda q_, k_, v_, *s: torch_variant_attention(q_, k_, v_, sinks=s[0] if s else None, **kw), peer_in)
    assert_close(out, ref_out.detach().cpu().numpy(), dtype, None, f"{name} out")
    for label, a, b, c in zip(("dq", "dk", "dv", "dsinks"), got, want, peer):
        assert_close(a.numpy(), b.numpy(), dtype, c.numpy(), f"{dtype} {name} {label}")
