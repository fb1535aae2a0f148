"""Attention dropout (``dropout_p > 0``): the Philox4x32-10 keep mask (cupy_attn/philox.py) and every path that
applies it.

CPU: NumPy Philox against the published known-answer vectors (Random123's kat_vectors) and a scalar re-derivation of
the element -> counter mapping; the float64 reference with a mask; the NumPy and CPU-torch paths (reproducible from
the generator, autograd); argument checks; dispatch of dropout calls (never the FA3, wgmma or decode kernels); the
dropout tile table. The NVRTC compile of every dropout variant is tests/test_compile.py's (it enumerates all families).

GPU (``-m gpu``): the device Philox against the same vectors; the kernels' masks equal the NumPy mask bit for bit
(V = identity makes the mask visible in the output), fused and split; the keep rate; outputs and gradients against a
float64 reference given the same mask, within twice the error of torch's math backend in the same precision with the
same mask (tests/_helpers/_tolerance.py); same seed -> same results, another seed -> another mask; CUDA-graph replays draw new
masks and each still matches the reference for the pair it drew; p = 1 gives zeros; CuPy inputs.
"""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import philox, reference
from cupy_attn.attention import checks as _checks, dispatch as _dispatch, dropout as _dropout
from cupy_attn.attention.kernels import flash_fwd as _flash
from cupy_attn.runtime import interop as _interop
from cupy_attn.runtime.kernel_abi import C_TYPE_16

from _attention_ref import torch_attention
from _tolerance import EPS, as_f64, assert_close

SDPA = cupy_attn.scaled_dot_product_attention
M32 = 0xFFFFFFFF

# Random123 kat_vectors, "philox4x32 10": counter (4 words), key (2 words) -> output (4 words).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _philox_scalar(ctr, key):
    """Philox4x32-10 on Python ints, written from the paper's round function (no NumPy)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ c3 ^ k1) & M32, p0 & M32
    return c0, c1, c2, c3


# ---------------------------------------------------------------------------------------------------------------------
# CPU


def test_philox_known_answers():
    for ctr, key, want in KAT:
        assert tuple(int(x) for x in philox.philox4x32_10(ctr, key)) == want
        assert _philox_scalar(ctr, key) == want


def test_philox_vectorized_matches_scalar():
    rs = np.random.default_rng(0)
    ctr = [rs.integers(0, 2 ** 32, 50, dtype=np.uint64) for _ in range(4)]
    key = (0x89ABCDEF, 0x01234567)
    got = philox.philox4x32_10(ctr, key)
    for n in range(50):
        assert tuple(int(w[n]) for w in got) == _philox_scalar(tuple(int(c[n]) for c in ctr), key)


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (4, 1, 2), (1, 1, 8, 6)])
def test_keep_mask_follows_the_definition(shape):
    """Element (bh, i, j): counter (j >> 1, i >> 1, bh, offset mod 2^32), key (seed lo, seed hi), output word
    2·(i & 1) + (j & 1), kept when below the threshold; odd L and S are cut from whole 2×2 blocks."""
    seed, offset, p = 0x123456789ABCDEF0, 0xABCD0000DEADBEEF, 0.37
    keep = philox.keep_mask(seed, offset, shape, p)
    assert keep.shape == shape and keep.dtype == bool
    threshold = philox.dropout_threshold(p)
    L, S = shape[-2:]
    flat = keep.reshape(-1, L, S)
    for bh in range(flat.shape[0]):
        for i in range(L):
            for j in range(S):
                r = _philox_scalar((j >> 1, i >> 1, bh, offset & M32), (seed & M32, seed >> 32))
                assert flat[bh, i, j] == (r[2 * (i & 1) + (j & 1)] < threshold), (bh, i, j)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p):
    keep = philox.keep_mask(2024, 7, (4, 8, 128, 128), p)
    sigma = (p * (1 - p) / keep.size) ** 0.5
    assert abs(keep.mean() - (1 - p)) < 3 * sigma


def test_threshold_and_scale():
    assert philox.dropout_threshold(0.0) == M32  # clamped: 2^32 does not fit
    assert philox.dropout_threshold(1.0) == 0
    assert philox.dropout_threshold(0.5) == 1 << 31
    assert philox.dropout_threshold(0.25) == 3 << 30
    assert philox.dropout_scale(0.25) == pytest.approx(4 / 3) and philox.dropout_scale(1.0) == 0.0
    assert not philox.keep_mask(1, 2, (3, 4, 5), 1.0).any()


def _softmax_ref(q, k, v, causal=False, scale=None):
    s = q @ np.swapaxes(k, -1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        s = np.where(reference.causal_keep(q.shape[-2], k.shape[-2]), s, -np.inf)
    P = np.exp(s - s.max(-1, keepdims=True))
    return P / P.sum(-1, keepdims=True)


def test_reference_dropout():
    rs = np.random.default_rng(1)
    q, k, v = rs.standard_normal((2, 3, 9, 8)), rs.standard_normal((2, 3, 11, 8)), rs.standard_normal((2, 3, 11, 5))
    keep = philox.keep_mask(5, 6, (2, 3, 9, 11), 0.3)
    out, lse = reference.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True, dropout_p=0.3,
                                                      dropout_mask=keep)
    want = (_softmax_ref(q, k, v, causal=True) * keep / 0.7) @ v
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    _, lse0 = reference.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    np.testing.assert_array_equal(lse, lse0)  # lse is that of the undropped scores
    out1 = reference.scaled_dot_product_attention(q, k, v, dropout_p=1.0, dropout_mask=keep)
    assert np.all(out1 == 0)
    with pytest.raises(ValueError, match="dropout_mask"):
        reference.scaled_dot_product_attention(q, k, v, dropout_p=0.3)


def test_numpy_path_is_the_reference_with_the_drawn_mask():
    rs = np.random.default_rng(2)
    f32 = np.float32
    q, k, v = (rs.standard_normal(s).astype(f32) for s in ((2, 4, 9, 16), (2, 2, 13, 16), (2, 2, 13, 8)))
    out, lse = SDPA(q, k, v, dropout_p=0.4, enable_gqa=True, return_lse=True, generator=np.random.default_rng(5))
    _, rng = _dropout.draw(_interop.CallContext(_interop.NUMPY, None), np.random.default_rng(5))
    keep = _dropout.keep_mask(rng, (2, 4, 9, 13), 0.4)
    ref, ref_lse = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, dropout_p=0.4,
                                                          dropout_mask=keep)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, SDPA(q, k, v, enable_gqa=True, return_lse=True)[1], rtol=1e-6)
    again = SDPA(q, k, v, dropout_p=0.4, enable_gqa=True, generator=np.random.default_rng(5))
    other = SDPA(q, k, v, dropout_p=0.4, enable_gqa=True, generator=np.random.default_rng(6))
    assert np.array_equal(again, out) and not np.array_equal(other, out)
    np.random.seed(3)
    a = SDPA(q, k, v, dropout_p=0.4, enable_gqa=True)
    np.random.seed(3)
    assert np.array_equal(a, SDPA(q, k, v, dropout_p=0.4, enable_gqa=True)), "np.random.seed reproduces a call"
    assert np.all(SDPA(q, k, v, dropout_p=1.0, enable_gqa=True) == 0)


def _torch_reference(q, k, v, mask, causal, groups, keep, p, scale=None):
    """float64 attention with dropout by an explicit keep mask (cupy_attn's conventions), differentiable."""
    pytest.importorskip("torch")
    return torch_attention(q, k, v, mask, causal, scale, groups, keep, p)


def test_cpu_torch_autograd_with_dropout():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64).float().requires_grad_()
               for s in ((2, 4, 7, 8), (2, 2, 10, 8), (2, 2, 10, 6)))
    dout = torch.randn(2, 4, 7, 6, generator=g)
    out = SDPA(q, k, v, dropout_p=0.3, is_causal="bottom_right", enable_gqa=True,
               generator=torch.Generator().manual_seed(11))
    out.backward(dout)
    keep = torch.from_numpy(_dropout.keep_mask(_dropout.torch_draw("cpu", torch.Generator().manual_seed(11)),
                                               (2, 4, 7, 10), 0.3))
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = _torch_reference(*ref_in, None, "bottom_right", 2, keep, 0.3)
    ref.backward(dout.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for x, r in zip((q, k, v), ref_in):
        torch.testing.assert_close(x.grad.double(), r.grad, rtol=1e-4, atol=1e-5)


def test_generator_checks():
    torch = pytest.importorskip("torch")
    q = np.zeros((1, 2, 4, 8), np.float32)
    with pytest.raises(TypeError, match="generator must be a numpy.random.Generator"):
        SDPA(q, q, q, dropout_p=0.1, generator=torch.Generator())
    with pytest.raises(TypeError, match="generator must be a numpy.random.Generator"):
        cupy_attn.explain(q, q, q, dropout_p=0.1, generator=123)
    t = torch.zeros(1, 2, 4, 8)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        SDPA(t, t, t, dropout_p=0.1, generator=np.random.default_rng(0))
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        SDPA(t.requires_grad_(), t, t, dropout_p=0.1, generator=np.random.default_rng(0))
    with pytest.raises(ValueError, match="dropout_p must be in"):
        SDPA(q, q, q, dropout_p=1.01)


def _problem(dtype="float16", E=128, Ev=128, B=2, H=8, Hkv=8, L=512, S=512, dropout_p=0.1, mask_kind="none"):
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    ctx = _interop.CallContext(_interop.CUPY, 0)
    return _checks.SDPAProblem(ctx=ctx, query=None, key=None, value=None, batch_shape=(B, H), batch=B, num_heads=H,
                               num_kv_heads=Hkv, seqlen_q=L, seqlen_k=S, head_dim=E, head_dim_v=Ev, dtype=dt,
                               scale=0.1, causal=None, mask_kind=mask_kind, dropout_p=dropout_p)


@pytest.mark.parametrize("kw,arch,backend,kernel,tile", [
    (dict(), 90, "fused", "flash_fwd_dropout", "64x64, 4 warps, 2 K/V stage(s), mma.sync"),
    (dict(E=64, Ev=64, dtype="bfloat16"), 80, "fused", "flash_fwd_dropout", "64x128, 4 warps, 1 K/V stage(s)"),
    (dict(E=256, Ev=256), 90, "fused", "flash_fwd_dropout", "64x64, 4 warps, 1 K/V stage(s)"),
    (dict(L=1, S=32768, H=32, Hkv=8), 90, "fused", "flash_fwd_dropout", None),  # decode-shaped: no decode kernel
    (dict(dtype="float32"), 90, "split", None, None),
    (dict(E=512, Ev=512), 90, "split", None, None),
])
def test_dispatch_of_dropout_calls(kw, arch, backend, kernel, tile, monkeypatch):
    monkeypatch.setenv("CUPY_ATTN_FA3", "1")  # forced on: dropout calls still never take the FA3-design kernel
    plan = _dispatch.plan_sdpa(_problem(**kw), "auto", arch=arch, num_sms=132)
    assert plan.backend == backend
    details = plan.details
    assert "dropout" in details or "dropout" in plan.reason
    if kernel:
        assert details["kernel"] == kernel
    if tile:
        assert details["tile"].startswith(tile)


def test_dispatch_dropout_refuses_decode_splits():
    with pytest.raises(ValueError, match="decode kernel, which has no dropout"):
        _dispatch.plan_sdpa(_problem(L=1, S=4096), "auto", arch=90, num_splits=4, num_sms=132)
    plan = _dispatch.plan_sdpa(_problem(dropout_p=0.0, L=1, S=32768, H=32, Hkv=8), "auto", arch=90, num_sms=132)
    assert plan.backend == "decode", "the same call without dropout keeps the decode kernel"


_SMEM_LIMIT = {8: 101376, 9: 232448}


def test_dropout_tile_table_is_the_declared_table():
    declared = set(_flash.FLASH_FWD_DROPOUT.name_expressions())
    assert {d for _, d, _ in _flash.DROPOUT_TILES} == set(_flash.HEAD_DIMS)
    for (dtype, d, arch), tile in _flash.DROPOUT_TILES.items():
        assert tile.smem_bytes(d) <= _SMEM_LIMIT[arch] and tile.block_m == 16 * tile.warps, (dtype, d, arch)
        for has_mask in ("false", "true"):
            assert _flash.FLASH_FWD_DROPOUT.name_expression(dtype=C_TYPE_16[dtype], head_dim=d, tile=tile,
                                                            has_mask=has_mask) in declared
    assert len(declared) == 2 * 2 * len(set((d, t) for (_, d, _), t in _flash.DROPOUT_TILES.items()))


def test_every_dropout_family_is_compiled_by_the_compile_check():
    from cupy_attn.runtime import compile as _compile
    names = {f.name: f for f in _compile.all_families()}
    assert "flash_fwd_dropout" in names
    for name in ("softmax", "attn_bwd_rows", "flash_bwd"):
        assert any("true>" in e and ", true>" in e for e in names[name].name_expressions()), name


# ---------------------------------------------------------------------------------------------------------------------
# GPU


def _torch():
    return pytest.importorskip("torch")


def _dtype(name):
    return getattr(_torch(), name)


def _rng_of(seed):
    """The rng pair that a call given ``generator=torch.Generator("cuda").manual_seed(seed)`` draws (its only draw)."""
    torch = _torch()
    return _dropout.torch_draw("cuda", torch.Generator("cuda").manual_seed(seed))


def _gen(seed):
    return _torch().Generator("cuda").manual_seed(seed)


@pytest.mark.gpu
def test_device_philox_known_answers():
    import cupy
    from cupy_attn.runtime import compile as _compile
    code = r'''
#include "common/philox.cuh"
extern "C" __global__ void kat(const unsigned* in, unsigned* out) {
  const int i = threadIdx.x;
  const uint4 r = cupy_attn::philox4x32_10(make_uint4(in[6 * i], in[6 * i + 1], in[6 * i + 2], in[6 * i + 3]),
                                           in[6 * i + 4], in[6 * i + 5]);
  out[4 * i] = r.x; out[4 * i + 1] = r.y; out[4 * i + 2] = r.z; out[4 * i + 3] = r.w;
}
'''
    kernel = cupy.RawKernel(code, "kat", options=(f"-I{_compile.source_dir()}", "-std=c++17"))
    inp = cupy.asarray([list(c) + list(k) for c, k, _ in KAT], dtype=cupy.uint32)
    out = cupy.zeros((len(KAT), 4), dtype=cupy.uint32)
    kernel((1,), (len(KAT),), (inp, out))
    assert out.get().tolist() == [list(w) for _, _, w in KAT]


MASK_SHAPES = [  # (B, Hq, Hkv, L, S, causal)
    (2, 3, 3, 77, 130, None),
    (1, 4, 2, 129, 64, "bottom_right"),
    (1, 2, 2, 1, 255, None),
    (2, 2, 1, 200, 200, "top_left"),
    (1, 1, 1, 300, 97, "bottom_right"),  # L > S: the first rows see no key
]


def _identity_call(backend, dtype, B, Hq, Hkv, L, S, causal, p, seed):
    """Q = K = 0 and V = I (Ev = S): out[b, h, i, j] = Z_ij / (n_i (1 − p)) on row i's n_i visible keys, so the kept
    set of the kernel's mask is where out != 0."""
    torch = _torch()
    dt = _dtype(dtype)
    q = torch.zeros(B, Hq, L, 16, device="cuda", dtype=dt)
    k = torch.zeros(B, Hkv, S, 16, device="cuda", dtype=dt)
    v = torch.eye(S, device="cuda", dtype=dt).expand(B, Hkv, S, S).contiguous()
    out = SDPA(q, k, v, dropout_p=p, is_causal=causal or False, enable_gqa=Hq != Hkv, backend=backend,
               generator=_gen(seed))
    return as_f64(out)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype", [("fused", "float16"), ("fused", "bfloat16"), ("split", "float16"),
                                           ("split", "bfloat16"), ("split", "float32")])
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=[str(s) for s in MASK_SHAPES])
def test_kernel_mask_is_the_philox_mask(backend, dtype, shape):
    B, Hq, Hkv, L, S, causal = shape
    p, seed = 0.3, 1000 + L + S
    got = _identity_call(backend, dtype, B, Hq, Hkv, L, S, causal, p, seed)
    keep = _dropout.keep_mask(_rng_of(seed), (B, Hq, L, S), p)
    visible = np.broadcast_to(reference.causal_keep(L, S, causal) if causal else np.ones((L, S), bool), keep.shape)
    n = visible.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        want = np.where(keep & visible, 1.0 / (n * (1 - p)), 0.0)
    kept = got != 0
    bad = np.argwhere(kept != (keep & visible))
    assert bad.size == 0, f"{len(bad)} elements differ from the Philox mask, first at {bad[:5].tolist()}"
    # The values: out = P·I, one product per element. fp32 on the split path runs P·V on gemm_3xtf32, whose operand
    # split (big rounded to TF32, small = x − big truncated to TF32) carries each product to within 2^-22 relative
    # rather than fp32's rounding: that much more (a wrong kept set is caught exactly above).
    split32 = 2.0 ** -22 if (backend, dtype) == ("split", "float32") else 0.0
    np.testing.assert_allclose(got, want, rtol=2 * EPS[dtype] + split32, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fused", "split"])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_on_the_device(backend, p):
    got = _identity_call(backend, "float16", 4, 8, 8, 256, 256, None, p, 77)
    kept = (got != 0).mean()
    sigma = (p * (1 - p) / got.size) ** 0.5
    assert abs(kept - (1 - p)) < 3 * sigma, (kept, 1 - p, sigma)


CASES = [
    # (name, B, Hq, Hkv, L, S, E, Ev, causal, mask)
    ("basic", 2, 3, 3, 77, 113, 64, 64, None, None),
    ("d128 causal", 1, 2, 2, 128, 160, 128, 128, "top_left", None),
    ("bottom-right", 1, 2, 2, 33, 90, 64, 64, "bottom_right", None),
    ("gqa 4/2", 2, 4, 2, 64, 96, 64, 64, None, None),
    ("ev!=e", 1, 2, 2, 50, 70, 40, 72, None, None),
    ("keypad", 2, 2, 2, 40, 200, 96, 96, None, "bool"),
    ("float mask", 1, 2, 2, 48, 64, 64, 64, None, "float"),
    ("d256", 1, 2, 2, 70, 90, 256, 256, None, None),
]
# (forward backend, backward path): the fused forward with the fused backward where it applies (fp16/bf16, no mask,
# head dims <= 128) and the split one elsewhere; the split forward with the split backward.
PATHS = [("fused", "auto"), ("split", "split")]


def _math_same_precision(q, k, v, mask, causal, groups, keep_t, p, scale=None):
    """torch's math backend in the inputs' precision (fp16/bf16 reductions allowed) with the same keep mask: the
    error scale of the tolerance rule."""
    torch = _torch()
    L, S = q.shape[-2], k.shape[-2]
    tmask = mask
    if causal == "bottom_right":
        tmask = torch.ones(L, S, dtype=torch.bool, device="cuda").tril(S - L)
    allow = getattr(torch.backends.cuda, "allow_fp16_bf16_reduction_math_sdp", None)
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed() if allow else None
    try:
        if allow:
            allow(True)
        out, _ = torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, tmask, p, causal == "top_left", keep_t, scale=scale, enable_gqa=groups > 1)
    finally:
        if allow:
            allow(before)
    return out


def _grads(out, inputs, dout):
    for x in inputs:
        x.grad = None
    out.backward(dout)
    return [x.grad for x in inputs]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS, ids=[f"{f}-fwd-{b}-bwd" for f, b in PATHS])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_outputs_and_gradients_match_the_reference(case, dtype, path, monkeypatch):
    torch = _torch()
    name, B, Hq, Hkv, L, S, E, Ev, causal, mask_kind = case
    backend, bwd = path
    if dtype == "float32" and backend == "fused":
        pytest.skip("fp32 runs the split path only")
    if bwd == "split":
        monkeypatch.setenv("CUPY_ATTN_BWD", "split")
    p, seed = 0.25, 31 * L + S
    g = torch.Generator("cuda").manual_seed(sum(map(ord, name)))
    dt = _dtype(dtype)
    q = torch.randn(B, Hq, L, E, generator=g, device="cuda").to(dt).requires_grad_()
    k = torch.randn(B, Hkv, S, E, generator=g, device="cuda").to(dt).requires_grad_()
    v = torch.randn(B, Hkv, S, Ev, generator=g, device="cuda").to(dt).requires_grad_()
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, 1, S, generator=g, device="cuda") > 0.3
        mask[..., 0] = True  # no fully masked row (torch's math backend would give NaN there)
    elif mask_kind == "float":
        mask = torch.randn(B, Hq, L, S, generator=g, device="cuda").to(dt).requires_grad_()
    dout = torch.randn(B, Hq, L, Ev, generator=g, device="cuda").to(dt)
    inputs = [q, k, v] + ([mask] if mask is not None and mask.requires_grad else [])

    out, lse = SDPA(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal or False, enable_gqa=Hq != Hkv,
                    backend=backend, return_lse=True, generator=_gen(seed))
    grads = _grads(out, inputs, dout)

    keep = _dropout.keep_mask(_rng_of(seed), (B, Hq, L, S), p)
    keep_t = torch.from_numpy(keep)
    ref_inputs = [x.detach().double().cpu().requires_grad_() for x in inputs]
    ref_mask = None if mask is None else (mask.cpu() if mask.dtype == torch.bool else ref_inputs[3])
    ref = _torch_reference(*ref_inputs[:3], ref_mask, causal, Hq // Hkv, keep_t, p)
    ref_grads = _grads(ref, ref_inputs, dout.double().cpu())

    t_inputs = [x.detach().clone().requires_grad_() for x in inputs]
    t_mask = mask if mask is None or mask.dtype == torch.bool else t_inputs[3]
    t_out = _math_same_precision(*t_inputs[:3], t_mask, causal, Hq // Hkv, keep_t.cuda(), p)
    t_grads = _grads(t_out, t_inputs, dout)

    what = f"{name} {dtype} {backend}/{bwd}"
    assert_close(out, ref.detach().numpy(), dtype, t_out, f"{what} out")
    for label, got, want, theirs in zip(("dq", "dk", "dv", "dmask"), grads, ref_grads, t_grads):
        assert got is not None and got.shape == want.shape and got.dtype == dt, label
        assert_close(got, want.numpy(), dtype, theirs, f"{what} {label}")
    # lse is that of the undropped scores
    np_mask = None if mask is None else (mask.cpu().numpy() if mask.dtype == torch.bool else as_f64(mask))
    _, ref_lse = reference.scaled_dot_product_attention(as_f64(q), as_f64(k), as_f64(v), np_mask,
                                                        is_causal=causal or False, enable_gqa=Hq != Hkv,
                                                        return_lse=True)
    np.testing.assert_allclose(as_f64(lse), ref_lse, rtol=1e-4, atol=2e-3, err_msg=f"{what} lse")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype", [("fused", "float16"), ("split", "bfloat16"), ("split", "float32")])
def test_same_seed_same_results_other_seed_other_mask(backend, dtype):
    torch = _torch()
    g = torch.Generator("cuda").manual_seed(3)
    dt = _dtype(dtype)
    q, k, v = (torch.randn(2, 4, 96, 64, generator=g, device="cuda").to(dt).requires_grad_() for _ in range(3))
    dout = torch.randn(2, 4, 96, 64, generator=g, device="cuda").to(dt)

    def run(**kw):
        out = SDPA(q, k, v, dropout_p=0.2, is_causal=True, backend=backend, **kw)
        return [out.detach().clone()] + _grads(out, [q, k, v], dout)

    def same(x, y, what):
        # out, dk, dv: bit for bit. dq of the fused backward is summed by fp32 atomics in no fixed order (as in
        # FlashAttention-2), so it may differ in the last bit; the split backward's is bit for bit too.
        torch.testing.assert_close(x[:1] + x[2:], y[:1] + y[2:], rtol=0, atol=0, msg=what)
        tol = dict(rtol=0, atol=0) if backend == "split" else dict(rtol=4 * EPS[dtype], atol=1e-6)
        torch.testing.assert_close(x[1], y[1], **tol, msg=f"{what} dq")

    a, b, c = run(generator=_gen(5)), run(generator=_gen(5)), run(generator=_gen(6))
    same(a, b, "same generator seed: identical outputs and gradients")
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[3], c[3]), "another seed: another mask"
    torch.manual_seed(9)
    d = run()
    torch.manual_seed(9)
    e = run()
    same(d, e, "torch.manual_seed reproduces calls on the default generator")
    assert not torch.equal(run()[0], e[0]), "the default generator advances"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fused", "split"])
def test_cuda_graph_replays_draw_new_masks(backend, monkeypatch):
    """The rng pair is drawn inside the graph (torch.randint on the default generator), so each replay draws a new
    pair and the captured kernels read it: masks differ per replay, and each output is the reference for its pair."""
    torch = _torch()
    drawn = []
    draw = _dropout.draw

    def recording(ctx, generator=None):
        native, array = draw(ctx, generator)
        drawn.append(native)
        return native, array

    monkeypatch.setattr(_dropout, "draw", recording)
    g = torch.Generator("cuda").manual_seed(21)
    q = torch.randn(2, 2, 64, 64, generator=g, device="cuda").half()
    k = torch.randn(2, 2, 80, 64, generator=g, device="cuda").half()
    v = torch.randn(2, 2, 80, 48, generator=g, device="cuda").half()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            SDPA(q, k, v, dropout_p=0.3, backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = SDPA(q, k, v, dropout_p=0.3, backend=backend)
    rng = drawn[-1]
    seen, outs = [], []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        pair = _dropout.values(rng)
        keep = _dropout.keep_mask(pair, (2, 2, 64, 80), 0.3)
        ref = reference.scaled_dot_product_attention(as_f64(q), as_f64(k), as_f64(v), dropout_p=0.3,
                                                     dropout_mask=keep)
        t_out = _math_same_precision(q, k, v, None, None, 1, torch.from_numpy(keep).cuda(), 0.3)
        assert_close(out, ref, "float16", t_out, f"{backend} replay {len(seen)}")
        seen.append(pair)
        outs.append(out.clone())
    assert len(set(seen)) == 3, f"each replay draws a new pair: {seen}"
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype", [("fused", "float16"), ("fused", "bfloat16"), ("split", "float32")])
def test_p_one_gives_zeros(backend, dtype):
    torch = _torch()
    g = torch.Generator("cuda").manual_seed(4)
    dt = _dtype(dtype)
    q, k, v = (torch.randn(1, 2, 50, 64, generator=g, device="cuda").to(dt).requires_grad_() for _ in range(3))
    out, lse = SDPA(q, k, v, dropout_p=1.0, is_causal=True, backend=backend, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isfinite(lse).all()
    out.backward(torch.randn_like(out))
    for x in (q, k, v):
        assert torch.equal(x.grad, torch.zeros_like(x.grad)), "nothing kept: no gradient, no NaN"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fused", "split"])
def test_cupy_inputs(backend):
    import cupy
    rs = cupy.random.RandomState(0)
    q, k, v = (rs.standard_normal((1, 2, 40, 64), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    if backend == "split":
        q, k, v = q.astype(cupy.float32), k.astype(cupy.float32), v.astype(cupy.float32)
    cupy.random.seed(8)
    a = SDPA(q, k, v, dropout_p=0.5, backend=backend)
    cupy.random.seed(8)
    b = SDPA(q, k, v, dropout_p=0.5, backend=backend)
    assert isinstance(a, cupy.ndarray) and bool((a == b).all()), "cupy.random.seed reproduces a call"
    assert not bool((SDPA(q, k, v, dropout_p=0.5, backend=backend) == a).all())
    with pytest.raises(TypeError, match="generator must be None for CuPy"):
        SDPA(q, k, v, dropout_p=0.5, generator=_gen(1))
    plan = cupy_attn.explain(q, k, v, dropout_p=0.5)
    assert plan.backend == ("fused" if q.dtype == cupy.float16 else "split") and "dropout" in str(plan)
