"""Argument checks for scaled_dot_product_attention: every error is raised here, before anything is launched.

``check_sdpa`` validates kinds, devices, dtypes, shapes, the mask and the flags, and returns an :class:`SDPAProblem`:
the call normalized to 4-D views (batch, heads, seqlen, head_dim) with the mask broadcast to (batch, Hq, L, S) by
strides. Every backend reads that one description. :func:`array_problem` makes the same description of 4-D CuPy arrays
as a kernel takes them (kernel-level calls: tests, benchmarks), :func:`causal_offset` the causal limit every kernel
applies.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np

from ..reference import CAUSAL_ALIGNMENTS
from ..runtime import interop
from ..runtime.kernel_abi import MASK_KIND
from .variants import NONE, Variants, check_variants

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
# NumPy dtype objects of FLOAT_DTYPES: a set hit is ~20x cheaper than reading dtype.name on the hot path.
_FLOAT_SET = frozenset((np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)))
BACKENDS = ("auto", "fused", "split", "reference")


@dataclasses.dataclass
class SDPAProblem:
    """One attention call, checked and normalized.

    query/key/value: the caller's arrays as CuPy (GPU) or NumPy (CPU) arrays, viewed as (batch, heads, seqlen, dim);
    batch folds every leading axis before the head axis (size 1 when there is none). mask: None or a view broadcast to
    (batch, num_heads, seqlen_q, seqlen_k), stride 0 along broadcast axes. ``copies`` says which inputs had to be
    copied to reach a layout the kernels read (shown by explain()).
    """

    ctx: interop.CallContext
    query: Any
    key: Any
    value: Any
    batch_shape: tuple[int, ...]   # query.shape[:-2]: the output's leading shape
    batch: int
    num_heads: int
    num_kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    dtype: np.dtype
    scale: float
    causal: str | None             # None, "top_left" (torch's is_causal) or "bottom_right"
    mask: Any = None
    mask_kind: str = "none"        # "none" | "bool" | "float"
    copies: list[str] = dataclasses.field(default_factory=list)
    dropout_p: float = 0.0
    # dropout_p > 0: the call's int64 {seed, offset} pair (attention/dropout.py), a CuPy view on the GPU or a NumPy
    # array on the CPU; set by the caller after the checks (the draw is the call's first enqueued work).
    rng: Any = None
    # The variants (window, softcap, sinks, ALiBi), checked (attention/variants.py); NONE for a plain call.
    variants: Variants = NONE

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 without GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def causal_offset(self) -> int:
        """The causal limit's offset: query row i sees keys j ≤ i + causal_offset (:func:`causal_offset`)."""
        return causal_offset(self.causal, self.seqlen_q, self.seqlen_k)

    @property
    def visible_offset(self) -> int:
        """Row i sees keys j ≤ i + visible_offset: causal_offset under a causal mask (and the window's right side),
        S without either (every key), the convention of the kernels that have no is_causal flag (the softmax pass, the
        backward's row kernels) and of the split path's causal bands."""
        bounded, offset = self.key_upper
        return offset if bounded else self.seqlen_k

    @property
    def key_upper(self) -> tuple[bool, int]:
        """(bounded, offset): row i sees keys j ≤ i + offset when bounded, from the causal mask and a window's right
        side (the smaller); the kernels' (is_causal, causal_offset) fields. Without a window: the causal mask's."""
        if self.variants.window_right is None:
            return self.causal is not None, self.causal_offset
        hi = self.variants.key_offsets(self.seqlen_q, self.seqlen_k, self.causal)[1]
        return True, hi

    @property
    def window_lo(self) -> int:
        """Row i sees keys j ≥ i + window_lo: a window's left side; −2^40 (the kernels' kNoLowerBound) without one."""
        return self.variants.key_offsets(self.seqlen_q, self.seqlen_k, self.causal)[0]

    @property
    def empty(self) -> bool:
        """Nothing for a kernel to do: out has no elements (B, Hq, L or Ev = 0) or no row sees a key (S = 0). Such a
        call keeps the caller's arrays (no CuPy views) and the plan is "empty" on the GPU (dispatch.plan_sdpa)."""
        return self.batch * self.num_heads * self.seqlen_q * self.head_dim_v * self.seqlen_k == 0

    def flops(self) -> float:
        """4·B·H·L·S·(E+Ev)/2: two GEMMs, halved when causal (the masked triangle is skipped by the fused kernel)."""
        f = 2.0 * self.batch * self.num_heads * self.seqlen_q * self.seqlen_k * (self.head_dim + self.head_dim_v)
        return f / 2 if self.causal else f


def causal_offset(causal: str | None, seqlen_q: int, seqlen_k: int) -> int:
    """The offset d of a causal mask, in every kernel's convention: query row i sees keys j ≤ i + d. "top_left"
    (torch's is_causal): 0; "bottom_right" (the last query row sees every key): S − L; None: 0 (the kernels read
    is_causal separately).

    >>> causal_offset("top_left", 100, 300), causal_offset("bottom_right", 100, 300), causal_offset(None, 5, 9)
    (0, 200, 0)
    """
    return seqlen_k - seqlen_q if causal == "bottom_right" else 0


def alias(value, alias_value, name: str, alias_name: str):
    """``value``, or ``alias_value`` when that is given (FlashAttention's names beside ours: softmax_scale for scale,
    causal for is_causal, seqused_k for cache_seqlens); ValueError when both are. Not given: None, or False for a
    flag (identity tests: a scale of 0.0 counts as given)."""
    if alias_value is None:
        return value
    if value is not None and value is not False:
        raise ValueError(f"pass {name} or its alias {alias_name}, not both")
    return alias_value


def check_num_splits(num_splits) -> None:
    """num_splits must be None (auto) or a positive int (not a bool); ValueError naming it otherwise."""
    if num_splits is None:
        return
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) or num_splits < 1:
        raise ValueError(f"num_splits must be None (auto) or a positive int, got {num_splits!r}")


def _is_float(dtype: np.dtype) -> bool:
    return dtype in _FLOAT_SET


def check_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
               generator=None, window_size=None, softcap=None, sinks=None, alibi_slopes=None, score_mod=None,
               mask_mod=None, aux=None, block_mask=None) -> SDPAProblem:
    """Validate a scaled_dot_product_attention call; raise TypeError/ValueError naming the argument.

    Every array argument must be of query's kind (torch, NumPy, or CuPy / CUDA DLPack) and on query's device: a CPU
    array next to a CUDA one is a ValueError, NumPy next to torch or CuPy next to torch a TypeError. ``generator``
    must suit the query's kind and device (attention/dropout.check_generator). The variant arguments (window_size,
    softcap, sinks, alibi_slopes) as attention/variants.check_variants checks them.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if is_causal is True:
        causal = "top_left"
    elif is_causal is False or is_causal is None:
        causal = None
    elif is_causal in CAUSAL_ALIGNMENTS:
        causal = is_causal
    else:
        raise ValueError(f"is_causal must be a bool, 'top_left' or 'bottom_right', got {is_causal!r}")
    if causal is not None and attn_mask is not None:
        raise ValueError("attn_mask and is_causal cannot both be set (as in torch): fold the causal mask into attn_mask")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")

    ctx = interop.context_for(query, "query")
    if generator is not None:
        from .dropout import check_generator
        check_generator(generator, ctx)
    arrays = {"query": query, "key": key, "value": value}
    if attn_mask is not None:
        arrays["attn_mask"] = attn_mask
    for name, x in arrays.items():
        interop.check_like_query(name, x, ctx)

    dtypes = {name: interop.dtype_of(x, interop.kind_of(x, name)) for name, x in arrays.items()}
    for name in ("query", "key", "value"):
        if not _is_float(dtypes[name]):
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {dtypes[name]} (for float64: "
                            "cupy_attn.reference.scaled_dot_product_attention, the NumPy reference)")
    for name in ("key", "value"):
        if dtypes[name] != dtypes["query"]:
            raise TypeError(f"{name} dtype {dtypes[name]} differs from query dtype {dtypes['query']}")

    q_shape, k_shape, v_shape = (tuple(x.shape) for x in (query, key, value))
    for name, shape in (("query", q_shape), ("key", k_shape), ("value", v_shape)):
        if len(shape) < 3:
            raise ValueError(f"{name} must have shape (..., heads, seqlen, head_dim) with at least 3 axes, "
                             f"got {len(shape)}-D {shape}")
    if not len(q_shape) == len(k_shape) == len(v_shape):
        raise ValueError(f"query, key and value must have the same number of axes, got {len(q_shape)}, "
                         f"{len(k_shape)} and {len(v_shape)}")
    nd = len(q_shape)
    for axis in range(nd - 3):
        for name, shape in (("key", k_shape), ("value", v_shape)):
            if shape[axis] != q_shape[axis]:
                raise ValueError(f"{name} batch axis {axis} has size {shape[axis]}, query's has {q_shape[axis]}")
    if k_shape[-1] != q_shape[-1]:
        raise ValueError(f"key head_dim (axis -1) is {k_shape[-1]}, query's is {q_shape[-1]}: they must match")
    if v_shape[-2] != k_shape[-2]:
        raise ValueError(f"value seqlen (axis -2) is {v_shape[-2]}, key's is {k_shape[-2]}: they must match")
    if v_shape[-3] != k_shape[-3]:
        raise ValueError(f"value heads (axis -3) is {v_shape[-3]}, key's is {k_shape[-3]}: they must match")
    num_heads, num_kv_heads = q_shape[-3], k_shape[-3]
    if enable_gqa:
        if num_heads and (num_kv_heads == 0 or num_heads % num_kv_heads != 0):  # no query heads: empty
            raise ValueError(f"enable_gqa: query heads (axis -3) = {num_heads} must be a multiple of key/value "
                             f"heads = {num_kv_heads}")
    elif num_heads != num_kv_heads:
        raise ValueError(f"key heads (axis -3) is {num_kv_heads}, query's is {num_heads}: they must match "
                         f"(pass enable_gqa=True for grouped-query attention)")
    if q_shape[-1] == 0:
        raise ValueError("query head_dim (axis -1) must be at least 1")
    seqlen_q, seqlen_k = q_shape[-2], k_shape[-2]

    mask_kind = "none"
    target = q_shape[:-2] + (seqlen_q, seqlen_k)
    if attn_mask is not None:
        if dtypes["attn_mask"] == np.bool_:
            mask_kind = "bool"
        elif _is_float(dtypes["attn_mask"]):
            mask_kind = "float"
        else:
            raise TypeError(f"attn_mask must be bool (True = take part) or float16/bfloat16/float32 (added to the "
                            f"scores), got {dtypes['attn_mask']}")
        m_shape = tuple(attn_mask.shape)
        if len(m_shape) > len(target):
            raise ValueError(f"attn_mask has {len(m_shape)} axes, more than the scores' {len(target)} {target}")
        for off in range(1, len(m_shape) + 1):
            if m_shape[-off] not in (1, target[-off]):
                raise ValueError(f"attn_mask axis {-off} has size {m_shape[-off]}, not broadcastable to "
                                 f"{target[-off]} (scores shape {target})")

    head_dim = q_shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    problem = SDPAProblem(
        ctx=ctx, query=query, key=key, value=value, batch_shape=q_shape[:-2],
        batch=math.prod(q_shape[:-3]), num_heads=num_heads, num_kv_heads=num_kv_heads,
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim, head_dim_v=v_shape[-1],
        dtype=np.dtype(dtypes["query"]), scale=scale, causal=causal, mask=attn_mask, mask_kind=mask_kind,
        dropout_p=float(dropout_p))
    if window_size is not None or softcap is not None or sinks is not None or alibi_slopes is not None or \
            score_mod is not None or mask_mod is not None or aux is not None or block_mask is not None:
        problem.variants = check_variants(window_size, softcap, sinks, alibi_slopes, ctx=ctx, batch=problem.batch,
                                          num_heads=num_heads, dtype=problem.dtype, score_mod=score_mod,
                                          mask_mod=mask_mod, aux=aux, block_mask=block_mask,
                                          seqlens=(seqlen_q, seqlen_k))
    if ctx.on_gpu and not problem.empty:  # an empty call reads no array (the plan is "empty")
        _to_gpu_views(problem)
    return problem


def common_stride(shape: tuple, strides: tuple) -> int | None:
    """The one stride of axes ``shape`` (with ``strides``) folded into one axis, or None when they have none (0 for no
    axis of size > 1)."""
    lead = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if all(lead[i][1] == lead[i + 1][0] * lead[i + 1][1] for i in range(len(lead) - 1)):
        return lead[-1][1] if lead else 0
    return None


def _fold_leading(x, name: str, copies: list[str], ctx):
    """View (..., H, N, D) as (batch, H, N, D), folding the leading axes; copy (ctx.contiguous: the caller's
    allocator) only when they have no common stride."""
    import cupy
    shape = x.shape
    if len(shape) == 4:
        return x
    if len(shape) == 3:
        return x[None]
    batch = math.prod(shape[:-3])
    stride = common_stride(shape[:-3], x.strides[:-3])
    if stride is not None:
        return cupy.lib.stride_tricks.as_strided(x, (batch,) + shape[-3:], (stride,) + x.strides[-3:])
    copies.append(f"{name}: leading axes {shape[:-3]} have no common stride; copied to fold them into one batch axis")
    return ctx.contiguous(x).reshape((batch,) + shape[-3:])


def _unit_last_axis(x, name: str, copies: list[str], ctx):
    """Kernels and cuBLAS read rows with unit element stride and non-overlapping rows; copy otherwise (ctx.contiguous:
    the caller's allocator)."""
    rows_ok = x.shape[-2] <= 1 or x.strides[-2] >= x.shape[-1] * x.itemsize
    if (x.strides[-1] == x.itemsize or x.shape[-1] == 1) and rows_ok:
        return x
    copies.append(f"{name}: strides {x.strides} (bytes) are not unit along the last axis; copied to contiguous")
    return ctx.contiguous(x)


def _to_gpu_views(p: SDPAProblem) -> None:
    import cupy
    ctx = p.ctx
    with ctx.activate():
        for name in ("query", "key", "value"):
            x = _unit_last_axis(ctx.as_cupy(getattr(p, name)), name, p.copies, ctx)
            setattr(p, name, _fold_leading(x, name, p.copies, ctx))
        if p.mask is not None:
            m = ctx.as_cupy(p.mask)
            m = cupy.broadcast_to(m, p.batch_shape + (p.seqlen_q, p.seqlen_k))
            p.mask = _fold_leading(m, "attn_mask", p.copies, ctx)


def array_problem(q, k, v, out=None, lse=None, *, scale: float, causal: str | None = None, mask=None,
                  dropout_p: float = 0.0, rng=None, ctx=None, what: str = "attention") -> SDPAProblem:
    """The problem of a kernel-level call on 4-D CuPy arrays (tests, benchmarks: the public API checks with
    :func:`check_sdpa`): q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) of one dtype, last axes contiguous,
    Hq a multiple of Hkv, L and S ≥ 1; out (B, Hq, L, Ev) in q's dtype with a contiguous last axis and lse (B, Hq, L)
    float32, each None or checked; mask None or a view broadcast to (B, Hq, L, S) (bool, float16, bfloat16,
    float32); causal None, "top_left" or "bottom_right"; dropout_p > 0 with ``rng``, the call's int64 {seed, offset}
    array. ``ctx``: the call's context (None: CuPy arrays on the current device and stream). ValueError naming
    ``what`` otherwise. Which kernel can run it is the plan's question (dispatch)."""
    B, Hq, L, E = q.shape
    _, Hkv, S, Ev = v.shape
    dtype = q.dtype
    if k.shape != (B, Hkv, S, E) or Hq % Hkv or (out is not None and out.shape != (B, Hq, L, Ev)):
        raise ValueError(f"{what}: shapes q {q.shape}, k {k.shape}, v {v.shape}"
                         f"{'' if out is None else f', out {out.shape}'} disagree")
    arrays = (q, k, v) + (() if out is None else (out,))
    if any(a.dtype != dtype for a in arrays):
        raise ValueError(f"{what}: q, k, v and out must share one dtype")
    if any(a.strides[-1] != a.itemsize for a in arrays):
        raise ValueError(f"{what}: the last dimension of q, k, v and out must be contiguous")
    if L < 1 or S < 1:
        raise ValueError(f"{what}: L and S must be at least 1 (the caller handles empty sequences)")
    if causal not in (None, "top_left", "bottom_right"):
        raise ValueError(f"{what}: causal must be None, 'top_left' or 'bottom_right', got {causal!r}")
    mask_kind = "none"
    if mask is not None:
        if mask.shape != (B, Hq, L, S):
            raise ValueError(f"{what}: mask must be broadcast to {(B, Hq, L, S)}, got {mask.shape}")
        if interop.dtype_name(mask.dtype) not in MASK_KIND:
            raise ValueError(f"{what}: mask dtype {mask.dtype} is not bool/float16/bfloat16/float32")
        mask_kind = "bool" if mask.dtype == np.bool_ else "float"
    if lse is not None and (lse.shape != (B, Hq, L) or lse.dtype != np.float32):
        raise ValueError(f"{what}: lse must be float32 {(B, Hq, L)}, got {lse.dtype} {lse.shape}")
    if dropout_p > 0 and (rng is None or rng.dtype != np.int64 or rng.size != 2):
        raise ValueError(f"{what}: dropout_p > 0 needs rng, the call's int64 {{seed, offset}} CuPy array")
    if ctx is None:
        import cupy
        ctx = interop.CallContext(interop.CUPY, cupy.cuda.Device().id, cupy.cuda.get_current_stream())
    return SDPAProblem(ctx=ctx, query=q, key=k, value=v, batch_shape=(B, Hq), batch=B, num_heads=Hq,
                       num_kv_heads=Hkv, seqlen_q=L, seqlen_k=S, head_dim=E, head_dim_v=Ev, dtype=np.dtype(dtype),
                       scale=float(scale), causal=causal, mask=mask, mask_kind=mask_kind, dropout_p=float(dropout_p),
                       rng=rng)
