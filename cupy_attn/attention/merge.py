"""merge_attention_states: two partial attention results over disjoint key sets combined by their lse."""
from __future__ import annotations

import sys

import numpy as np

from .. import reference
from ..runtime import interop
from .checks import common_stride
from .kernels import merge_states

_FLOATS = ("float16", "bfloat16", "float32")


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Merge two attention results over disjoint key sets A and B of the same query rows into the result over A ∪ B:

        lse = log(e^lse_a + e^lse_b)
        out = e^(lse_a − lse) · out_a + e^(lse_b − lse) · out_b

    computed against m = max(lse_a, lse_b) so that nothing overflows. A row whose lse is −inf on one side (it saw
    no key there) takes the other side; −inf on both gives out 0 and lse −inf, the convention of a row that sees no
    key; NaN propagates. This is how split-KV decoding, cascade inference (a shared prefix attended once, then each
    request's suffix) and context parallelism combine their parts: ``scaled_dot_product_attention(q, k, v,
    return_lse=True)`` over keys [0, n) and over [n, S) merge to the call over all S keys (with ``is_causal``, give
    each part its keys' visibility, e.g. through attn_mask).

    Shapes: out_a, out_b (..., Ev), equal; lse_a, lse_b (...) = out_a.shape[:-1], natural log. So (B, H, L, Ev) with
    lse (B, H, L), as scaled_dot_product_attention returns them, or FlashInfer's (tokens, H, Ev) with (tokens, H).
    dtypes: out_a and out_b float16, bfloat16 or float32, equal; lse_a and lse_b float32 (CUDA inputs).
    Inputs: torch CUDA tensors or CuPy arrays (results as the same kind, on the caller's stream; strided views are
    read in place when their rows have one pitch); NumPy arrays and CPU torch tensors run the float64 reference
    (cupy_attn.reference.merge_attention_states). torch tensors that require grad, and calls traced by torch.compile,
    run the same formula as torch operations (differentiable, in fp32). Note that scaled_dot_product_attention's
    lse carries no gradient (autograd takes it as a constant), so merging two of its calls under autograd passes
    gradients through their outputs only, not the whole call's.

    Returns (out, lse): out (..., Ev) in out_a's dtype, lse (...) float32, contiguous.

    Raises, before anything is launched: TypeError for non-array inputs, arrays of another kind than out_a's, out
    dtypes that differ or are not float16/bfloat16/float32 (float64: the reference), lse not float32 on a GPU;
    ValueError naming the argument for a shape that does not match out_a's (or lse's) or another device.

    Algorithm: FlashInfer's merge_state (Ye et al. 2025) and Flash-Decoding's split-KV combine (Dao et al. 2023), for
    two parts; one warp per row (cuda_src/attention/merge_states.cu), bandwidth-bound.
    """
    ctx = interop.context_for(out_a, "out_a")
    arrays = {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b}
    kinds = {name: interop.check_like_query(name, x, ctx, first="out_a") for name, x in arrays.items()}
    shapes = {name: tuple(x.shape) for name, x in arrays.items()}
    if len(shapes["out_a"]) < 1:
        raise ValueError(f"out_a must have at least one axis (..., Ev), got shape {shapes['out_a']}")
    if shapes["out_b"] != shapes["out_a"]:
        raise ValueError(f"out_b must have out_a's shape {shapes['out_a']}, got {shapes['out_b']}")
    for name in ("lse_a", "lse_b"):
        if shapes[name] != shapes["out_a"][:-1]:
            raise ValueError(f"{name} must have shape out_a.shape[:-1] = {shapes['out_a'][:-1]} (one lse per row), "
                             f"got {shapes[name]}")
    dtypes = {name: interop.dtype_of(x, kinds[name]) for name, x in arrays.items()}
    out_dtype = dtypes["out_a"]
    if interop.dtype_name(out_dtype) not in _FLOATS:
        raise TypeError(f"out_a must be float16, bfloat16 or float32, got {out_dtype} (for float64: "
                        "cupy_attn.reference.merge_attention_states, the NumPy reference)")
    if dtypes["out_b"] != out_dtype:
        raise TypeError(f"out_b must have out_a's dtype {out_dtype}, got {dtypes['out_b']}")
    if ctx.on_gpu:
        for name in ("lse_a", "lse_b"):
            if dtypes[name] != np.float32:
                raise TypeError(f"{name} must be float32 (as scaled_dot_product_attention returns it), got "
                                f"{dtypes[name]}")

    if _via_torch_ops(out_a, lse_a, out_b, lse_b):
        return _merge_torch(out_a, lse_a, out_b, lse_b)
    if not ctx.on_gpu:
        oa, la, ob, lb = (interop.to_numpy(x, kinds[n]) for n, x in arrays.items())
        out, lse = reference.merge_attention_states(oa, la, ob, lb)
        return (interop.from_numpy(out, ctx.kind, out_dtype), interop.from_numpy(lse, ctx.kind, np.dtype(np.float32)))
    ev, rows_shape = shapes["out_a"][-1], shapes["out_a"][:-1]
    rows = int(np.prod(rows_shape))
    if rows == 0:  # nothing to merge: empty results, as torch's elementwise operations give
        return ctx.full(shapes["out_a"], out_dtype, 0), ctx.full(rows_shape, np.dtype(np.float32), -np.inf)
    with ctx.activate():
        oa, ob = (_rows(ctx, ctx.as_cupy(x), rows, ev) for x in (out_a, out_b))
        la, lb = (_flat(ctx, ctx.as_cupy(x)) for x in (lse_a, lse_b))
        lse_native, lse = ctx.empty(rows_shape, np.dtype(np.float32))
        if ev == 0:  # only lse to compute: the kernel's row loop is empty, no out element is read or written
            out_native, out = ctx.full(shapes["out_a"], out_dtype, 0), oa
        else:
            out_native, out = ctx.empty(shapes["out_a"], out_dtype)
            out = out.reshape(rows, ev)
        merge_states.launch(ctx.stream.ptr, oa, la, ob, lb, out, lse.reshape(rows))
    return out_native, lse_native


def _rows(ctx, a, rows: int, ev: int):
    """``a`` (..., Ev) as a (rows, Ev) CuPy view with a unit last stride and one row pitch; a copy from the caller's
    allocator when it has neither."""
    if (ev > 1 and a.strides[-1] != a.itemsize) or common_stride(a.shape[:-1], a.strides[:-1]) is None:
        a = ctx.contiguous(a)
    return a.reshape(rows, ev)  # a view: one pitch


def _flat(ctx, a):
    """A contiguous 1-D CuPy view of an lse array (a copy from the caller's allocator when it is strided)."""
    return (a if a.flags.c_contiguous else ctx.contiguous(a)).reshape(-1)


def _via_torch_ops(*tensors) -> bool:
    """torch tensors that autograd records or that torch.compile traces: the formula as torch operations."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(tensors[0], torch.Tensor):
        return False
    return interop.torch_compiling() or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _merge_torch(out_a, lse_a, out_b, lse_b, lse_dtype=None):
    """The merge in torch operations, in fp32 (float64 for CPU tensors), differentiable: what autograd and
    torch.compile see. lse comes back as ``lse_dtype`` (default float32, the public result's)."""
    torch = sys.modules["torch"]
    work = torch.float32 if out_a.is_cuda else torch.float64
    la, lb = lse_a.to(work), lse_b.to(work)
    m = torch.maximum(la, lb)
    ref = torch.where(m == float("-inf"), torch.zeros_like(m), m).detach()
    wa, wb = torch.exp(la - ref), torch.exp(lb - ref)
    total = wa + wb
    safe = torch.where(total == 0, torch.ones_like(total), total)
    ca = torch.where(total == 0, torch.zeros_like(wa), wa / safe)
    cb = torch.where(total == 0, torch.zeros_like(wb), wb / safe)
    out = ca.unsqueeze(-1) * out_a.to(work) + cb.unsqueeze(-1) * out_b.to(work)
    return out.to(out_a.dtype), (ref + torch.log(total)).to(lse_dtype or torch.float32)
