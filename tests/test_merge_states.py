"""merge_attention_states (cupy_attn/attention/merge.py, cuda_src/attention/merge_states.cu): two partial results
over disjoint key sets merge to the result over all keys.

CPU: the float64 reference (two halves of an attention call merge to the whole call; −inf and NaN rows), the public
function on NumPy and CPU torch inputs, its argument errors, and the differentiable torch form (gradcheck). The
kernel compiles for every dtype (tests/test_compile.py covers every family). GPU (marked ``gpu``): the kernel against
the reference for every dtype, strided and BSHD inputs, 16-byte and scalar rows, empty shapes, and torch's autograd
through the torch form.
"""
import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference
from cupy_attn.attention import merge as _merge

MERGE = cupy_attn.merge_attention_states


def _halves(shape_q=(2, 4, 9, 16), S=13, Ev=8, split=5, seed=0, mask=None):
    """(whole out, whole lse, out_a, lse_a, out_b, lse_b): float64 reference calls over keys [0, split) and
    [split, S) of one problem, and over all S."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape_q)
    k = rng.standard_normal(shape_q[:-2] + (S, shape_q[-1]))
    v = rng.standard_normal(shape_q[:-2] + (S, Ev))

    def run(lo, hi):
        m = None if mask is None else mask[..., lo:hi]
        return reference.scaled_dot_product_attention(q, k[..., lo:hi, :], v[..., lo:hi, :], m, return_lse=True)
    return (*run(0, S), *run(0, split), *run(split, S))


@pytest.mark.parametrize("split", [1, 5, 12])
def test_reference_merges_two_halves_into_the_whole_call(split):
    out, lse, oa, la, ob, lb = _halves(split=split)
    got, got_lse = reference.merge_attention_states(oa, la, ob, lb)
    np.testing.assert_allclose(got, out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_lse, lse, rtol=1e-12, atol=1e-12)


def test_reference_rows_that_see_no_key_on_one_side_or_both():
    """A key-padding mask that hides every key of the first half from some rows, and every key from others: those
    rows take the other half (lse −inf on one side), or give 0 and −inf (both sides)."""
    L, S = 9, 13
    mask = np.ones((L, S), dtype=bool)
    mask[2, :5] = False            # row 2 sees nothing in [0, 5)
    mask[3, 5:] = False            # row 3 sees nothing in [5, 13)
    mask[4, :] = False             # row 4 sees nothing at all
    out, lse, oa, la, ob, lb = _halves(S=S, mask=mask)
    assert la[..., 2].max() == -np.inf and lb[..., 3].max() == -np.inf and lse[..., 4].max() == -np.inf
    got, got_lse = reference.merge_attention_states(oa, la, ob, lb)
    np.testing.assert_allclose(got, out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(got_lse[..., 4], -np.inf)
    np.testing.assert_array_equal(got[..., 4, :], 0.0)
    np.testing.assert_allclose(got_lse, lse, rtol=1e-12, atol=1e-12)


def test_reference_propagates_nan():
    oa, ob = np.ones((3, 4)), np.ones((3, 4))
    la = np.array([np.nan, 0.0, -np.inf])
    lb = np.array([0.0, np.nan, 1.0])
    out, lse = reference.merge_attention_states(oa, la, ob, lb)
    assert np.isnan(lse[:2]).all() and np.isnan(out[:2]).all()
    assert lse[2] == 1.0 and (out[2] == 1.0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_numpy_inputs_run_the_reference(dtype):
    out, lse, oa, la, ob, lb = _halves()
    got, got_lse = MERGE(oa.astype(dtype), la.astype(np.float32), ob.astype(dtype), lb.astype(np.float32))
    assert got.dtype == dtype and got_lse.dtype == np.float32 and got.shape == out.shape
    tol = 1e-6 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(got, out, rtol=tol, atol=tol)
    np.testing.assert_allclose(got_lse, lse, rtol=1e-6, atol=1e-6)


def test_cpu_torch_inputs_and_their_gradients():
    torch = pytest.importorskip("torch")
    out, lse, oa, la, ob, lb = _halves()
    t = [torch.from_numpy(x) for x in (oa, la, ob, lb)]
    got, got_lse = MERGE(*(x.float() for x in t))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got_lse.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), out, rtol=1e-6, atol=1e-6)
    leaves = [x.clone().requires_grad_() for x in t]  # float64: the torch form in float64 on the CPU

    assert torch.autograd.gradcheck(lambda *xs: _merge._merge_torch(*xs, lse_dtype=torch.float64), leaves)
    leaves32 = [x.detach().float().requires_grad_() for x in t]
    o, l_ = MERGE(*leaves32)  # the public function takes the torch form when an input requires grad
    (o.sum() + l_.sum()).backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in leaves32)


@pytest.mark.parametrize("args,exc,match", [
    (lambda a, la, b, lb: (a, la, b[..., :3], lb), ValueError, "out_b must have out_a's shape"),
    (lambda a, la, b, lb: (a, la[..., :2], b, lb), ValueError, r"lse_a must have shape out_a.shape\[:-1\]"),
    (lambda a, la, b, lb: (a, la, b, lb[None]), ValueError, "lse_b must have shape"),
    (lambda a, la, b, lb: (a, la, b.astype(np.float16), lb), TypeError, "out_b must have out_a's dtype"),
    (lambda a, la, b, lb: (a.astype(np.float64), la, b.astype(np.float64), lb), TypeError, "reference"),
    (lambda a, la, b, lb: (a, la, b.tolist(), lb), TypeError, "out_b"),
    (lambda a, la, b, lb: (np.array(1.0, np.float32), la, b, lb), ValueError, "at least one axis"),
])
def test_bad_arguments_name_the_argument(args, exc, match):
    _, _, oa, la, ob, lb = _halves()
    a, la, b, lb = (x.astype(np.float32) for x in (oa, la, ob, lb))
    with pytest.raises(exc, match=match):
        MERGE(*args(a, la, b, lb))


def test_kind_mismatch_is_a_type_error():
    torch = pytest.importorskip("torch")
    _, _, oa, la, ob, lb = _halves()
    with pytest.raises(TypeError, match="out_b"):
        MERGE(torch.from_numpy(oa).float(), torch.from_numpy(la).float(), ob.astype(np.float32),
              torch.from_numpy(lb).float())


def test_kernel_params_pick_16_byte_rows_only_when_aligned():
    """The launch struct: row pitches in elements, vec only when every row start is 16-byte aligned and Ev fills
    whole 16-byte vectors (checked on fake arrays: no GPU)."""
    from cupy_attn.attention.kernels import merge_states

    class Fake:
        def __init__(self, ptr, shape, strides, itemsize):
            self.data = type("P", (), {"ptr": ptr})()
            self.shape, self.strides, self.itemsize = shape, strides, itemsize

    def prm(ev, pitch, base=1 << 20):
        a = Fake(base, (4, ev), (pitch * 2, 2), 2)
        lse = Fake(base, (4,), (4,), 4)
        return merge_states.params_for(a, lse, a, lse, a, lse)
    assert int(prm(64, 64)["vec"]) == 1 and int(prm(64, 64)["stride_out"]) == 64
    assert int(prm(64, 72)["vec"]) == 1    # pitch 144 bytes
    assert int(prm(64, 68)["vec"]) == 0    # pitch 136 bytes: odd rows 8-byte aligned
    assert int(prm(12, 12)["vec"]) == 0    # 24-byte rows
    assert int(prm(64, 64, base=(1 << 20) + 8)["vec"]) == 0


# ---------------------------------------------------------------------------------------------------------------------
# GPU

def _torch():
    return pytest.importorskip("torch")


def _gpu_halves(dtype, shape_q=(2, 8, 33, 64), S=300, split=120, Ev=64, seed=0):
    """Two halves and the whole of one call by our own scaled_dot_product_attention on CUDA tensors, with the float64
    reference of the whole."""
    torch = _torch()
    g = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn(shape_q, generator=g, device="cuda").to(dtype)
    k = torch.randn(shape_q[:-2] + (S, shape_q[-1]), generator=g, device="cuda").to(dtype)
    v = torch.randn(shape_q[:-2] + (S, Ev), generator=g, device="cuda").to(dtype)
    oa, la = cupy_attn.scaled_dot_product_attention(q, k[..., :split, :], v[..., :split, :], return_lse=True)
    ob, lb = cupy_attn.scaled_dot_product_attention(q, k[..., split:, :], v[..., split:, :], return_lse=True)
    ref, ref_lse = reference.scaled_dot_product_attention(*(x.double().cpu().numpy() for x in (q, k, v)),
                                                          return_lse=True)
    return (q, k, v), (oa, la, ob, lb), (ref, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("Ev", [64, 40, 7])  # 16-byte rows; 80-byte rows (vec for fp32 and fp16); scalar rows
def test_gpu_merge_of_two_halves_matches_the_whole(dtype, Ev):
    """The kernel's merge of our two half calls against the float64 reference of the whole call: within twice the
    error of our own whole call (same precision) plus rounding noise; lse within fp32 rounding."""
    torch = _torch()
    dt = getattr(torch, dtype)
    (q, k, v), (oa, la, ob, lb), (ref, ref_lse) = _gpu_halves(dt, Ev=Ev)
    out, lse = MERGE(oa, la, ob, lb)
    assert out.dtype == dt and out.is_cuda and lse.dtype == torch.float32 and out.shape == oa.shape
    whole = cupy_attn.scaled_dot_product_attention(q, k, v)
    err = np.abs(out.double().cpu().numpy() - ref).max()
    err_whole = np.abs(whole.double().cpu().numpy() - ref).max()
    assert np.isfinite(err) and err <= 2 * err_whole + {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_rows_with_no_key_nan_and_strided_inputs():
    """−inf on one side takes the other; on both, out 0 and lse −inf; NaN propagates. Inputs as BSHD views and with a
    padded row pitch are read in place; CuPy arrays come back as CuPy arrays."""
    import cupy
    torch = _torch()
    B, H, L, Ev = 2, 3, 5, 64
    g = torch.Generator("cuda").manual_seed(1)
    store_a = torch.randn(B, L, H, Ev + 8, generator=g, device="cuda", dtype=torch.float16)
    store_b = torch.randn(B, L, H, Ev, generator=g, device="cuda", dtype=torch.float16)
    oa = store_a[..., :Ev].transpose(1, 2)          # (B, H, L, Ev): BSHD view with a padded pitch
    ob = store_b.transpose(1, 2)
    la = torch.randn(B, H, L, generator=g, device="cuda")
    lb = torch.randn(B, H, L, generator=g, device="cuda")
    la[0, 0, 0] = float("-inf")
    lb[0, 0, 1] = float("-inf")
    la[0, 0, 2] = lb[0, 0, 2] = float("-inf")
    la[1, 2, 4] = float("nan")
    out, lse = MERGE(oa, la, ob, lb)
    ref, ref_lse = reference.merge_attention_states(*(x.double().cpu().numpy() for x in (oa, la, ob, lb)))
    np.testing.assert_allclose(out.double().cpu().numpy(), ref, rtol=2e-3, atol=2e-3, equal_nan=True)
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert (out[0, 0, 2] == 0).all() and lse[0, 0, 2] == float("-inf") and torch.isnan(out[1, 2, 4]).all()
    c_out, c_lse = MERGE(*(cupy.from_dlpack(x.contiguous()) for x in (oa, la, ob, lb)))
    assert isinstance(c_out, cupy.ndarray) and isinstance(c_lse, cupy.ndarray)
    np.testing.assert_allclose(cupy.asnumpy(c_out).astype(np.float64), ref, rtol=2e-3, atol=2e-3, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(0, 4, 64), (3, 0, 64), (3, 4, 0), (64,)])
def test_gpu_empty_and_one_row_shapes(shape):
    torch = _torch()
    oa, ob = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    la, lb = (torch.randn(shape[:-1], device="cuda") for _ in range(2))
    out, lse = MERGE(oa, la, ob, lb)
    ref, ref_lse = reference.merge_attention_states(*(x.double().cpu().numpy() for x in (oa, la, ob, lb)))
    assert out.shape == shape and lse.shape == shape[:-1]
    np.testing.assert_allclose(out.double().cpu().numpy(), ref, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_gpu_gradients_through_the_torch_form():
    """CUDA inputs that require grad take the torch form (fp32): its gradients for out_a, lse_a, out_b and lse_b
    match the same form's in float64 on the CPU."""
    torch = _torch()
    g = torch.Generator("cuda").manual_seed(2)
    xs = [torch.randn(shape, generator=g, device="cuda") for shape in ((2, 3, 17, 32), (2, 3, 17)) * 2]
    xs[1][0, 0, 0] = float("-inf")
    leaves = [x.clone().requires_grad_() for x in xs]
    out, lse = MERGE(*leaves)
    w = torch.randn(out.shape, generator=g, device="cuda")
    grads = torch.autograd.grad((out * w).sum() + lse.sum(), leaves)
    cpu = [x.detach().cpu().double().requires_grad_() for x in xs]
    o64, l64 = _merge._merge_torch(*cpu, lse_dtype=torch.float64)
    expect = torch.autograd.grad((o64 * w.cpu().double()).sum() + l64.sum(), cpu)
    for got, exp in zip(grads, expect):
        torch.testing.assert_close(got.cpu().double(), exp, rtol=1e-5, atol=1e-5)
