"""The attention variants of today's models, checked once: sliding window, softcap, sinks and ALiBi.

``check_variants`` validates the four keyword arguments of ``scaled_dot_product_attention`` and returns a
:class:`Variants` record that every path reads (the plan, the kernels' parameters, the reference, explain). The math
is cupy_attn.reference.scaled_dot_product_attention's:

    s_ij = scale · q_i·k_j;  s_ij <- c·tanh(s_ij / c) (softcap);  s_ij <- s_ij - slope_h·|i + S - L - j| (ALiBi);
    key j visible to query i iff lo(i) <= j <= hi(i) (causal, window) and the mask allows it;
    out_i = Σ_j e^(s_ij) v_j / (Σ_j e^(s_ij) + e^(sink_h)),  lse_i = log of that denominator.

The window is bottom-right aligned, as FlashAttention's: lo(i) = i + S - L - left, hi(i) = i + S - L + right. A
causal mask bounds hi(i) by i (top-left, torch's ``is_causal=True``) or i + S - L (``"bottom_right"``); with L = S the
two alignments agree and ``window_size=(w, 0)`` with ``is_causal=True`` is Mistral's and Gemma's sliding window.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ..reference import window_bounds

# Sentinel offsets for an unbounded side: far past any sequence length (2^40 keys), small enough that i + offset
# never overflows an int64 in the kernels.
UNBOUNDED = 1 << 40
UNBOUNDED_LO = -UNBOUNDED  # the kernels' kNoLowerBound (common/visibility.cuh)


@dataclasses.dataclass(frozen=True)
class Variants:
    """The checked variant arguments of one call.

    window_left / window_right: keys before / after the (bottom-right aligned) diagonal a query sees; None = no bound.
    softcap: c > 0, or None. sinks: None or the caller's (Hq,) array (fp32 or the inputs' dtype), as the call's kind
    (CuPy on the GPU, NumPy on the CPU). alibi_slopes: None or a float32 array (Hq,) or (B, Hq), likewise.
    """

    window_left: int | None = None
    window_right: int | None = None
    softcap: float | None = None
    sinks: Any = None
    alibi_slopes: Any = None
    mod: Any = None  # attention/mods.BoundMod: a user's score_mod / mask_mod with the call's aux arrays

    @property
    def has_window(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    @property
    def changes_scores(self) -> bool:
        """A window, softcap or ALiBi: what changes the scores the kernels compute (sinks only add lse's term), so
        what needs a kernel's variants instantiation, backward included."""
        return self.has_window or self.softcap is not None or self.alibi_slopes is not None or self.mod is not None

    @property
    def plain(self) -> bool:
        """No variant at all: the call is plain attention (every kernel serves it as before)."""
        return (not self.has_window and self.softcap is None and self.sinks is None and self.alibi_slopes is None
                and self.mod is None)

    def names(self) -> list[str]:
        """The variants present, for explain(): e.g. ['window (1024, 0)', 'softcap 50.0', 'sinks']."""
        out = []
        if self.has_window:
            out.append(f"window ({_side(self.window_left)}, {_side(self.window_right)})")
        if self.softcap is not None:
            out.append(f"softcap {self.softcap:g}")
        if self.alibi_slopes is not None:
            out.append(f"ALiBi slopes {tuple(self.alibi_slopes.shape)}")
        if self.sinks is not None:
            out.append("sinks")
        if self.mod is not None:
            out.append(" and ".join(n for n in ("score_mod", "mask_mod") if getattr(self.mod.mod, n) is not None))
        return out

    @property
    def window_size(self) -> tuple[int, int] | None:
        """(left, right) with -1 for an unbounded side (FlashAttention's form), or None without a window."""
        if not self.has_window:
            return None
        return (-1 if self.window_left is None else self.window_left,
                -1 if self.window_right is None else self.window_right)

    def key_offsets(self, seqlen_q: int, seqlen_k: int, causal: str | None) -> tuple[int, int]:
        """(lo_offset, hi_offset): query i sees keys j with i + lo_offset <= j <= i + hi_offset (and 0 <= j < S),
        from the causal alignment and the window; ±UNBOUNDED for an open side. One rule for every kernel.

        >>> Variants(window_left=3).key_offsets(4, 10, "top_left")
        (3, 0)
        >>> Variants().key_offsets(4, 10, "bottom_right"), Variants(window_right=2).key_offsets(5, 5, None)
        ((-1099511627776, 6), (-1099511627776, 2))
        """
        diag = seqlen_k - seqlen_q
        lo = -UNBOUNDED if self.window_left is None else diag - self.window_left
        hi = UNBOUNDED if self.window_right is None else diag + self.window_right
        if causal is not None:
            hi = min(hi, 0 if causal == "top_left" else diag)
        return lo, hi


def _side(w: int | None) -> str:
    return "∞" if w is None else str(w)


NONE = Variants()


def of(p) -> Variants:
    """The variants of a problem (checks.SDPAProblem), NONE for anything without them (a plan's test stand-in)."""
    return getattr(p, "variants", NONE)


def check_variants(window_size, softcap, sinks, alibi_slopes, *, ctx, batch: int, num_heads: int, dtype,
                   score_mod=None, mask_mod=None, aux=None, block_mask=None, seqlens=(0, 0)) -> Variants:
    """Validate the variant arguments of a call whose query is (batch..., num_heads, L, E) of ``dtype``, on the device
    and kind of ``ctx`` (runtime.interop.CallContext); return them as a :class:`Variants` (:data:`NONE` when all are
    off). Raises, naming the argument and axis: ValueError for a malformed window_size (a pair of ints >= 0, or None /
    -1 for an unbounded side), a softcap < 0 or not finite (0 and None mean off, as in FlashAttention), sinks not of
    shape (Hq,), alibi_slopes not of shape (Hq,) or (B, Hq), or an array on another device; TypeError for a softcap
    that is not a number, arrays of another kind than query, sinks not float32 or the query's dtype, alibi_slopes
    not float32. score_mod / mask_mod / aux: attention/mods.as_mod and bind (their errors), the snippets compiled
    once per aux layout (ValueError with NVRTC's log); block_mask: a mods.BlockMask of the mask_mod for the call's
    (L, S) = ``seqlens`` (BlockMask.check's errors).
    """
    left, right = window_bounds(window_size)
    mod = None
    from . import mods
    user = mods.as_mod(score_mod, mask_mod)
    if user is None and (aux is not None or block_mask is not None):
        raise ValueError(f"{'aux' if aux is not None else 'block_mask'} is given without score_mod or mask_mod")
    if user is not None:
        mod = mods.bind(user, aux, ctx)
        mods.checked(user, mod.spec)
        if block_mask is not None:
            if not isinstance(block_mask, mods.BlockMask):
                raise TypeError(f"block_mask must be a cupy_attn.BlockMask (create_block_mask), got "
                                f"{type(block_mask).__name__}")
            block_mask.check(user, ctx, batch, num_heads, *seqlens)
            mod = dataclasses.replace(mod, block_mask=block_mask)
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)):
            raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__}")
        if not math.isfinite(softcap) or softcap < 0:
            raise ValueError(f"softcap must be a finite number >= 0 (0 or None: off), got {softcap}")
        softcap = float(softcap) or None
    if sinks is not None:
        sinks = _check_array("sinks", sinks, ctx, ((num_heads,),), (np.dtype(np.float32), np.dtype(dtype)),
                             f"(Hq,) = ({num_heads},)")
    if alibi_slopes is not None:
        alibi_slopes = _check_array("alibi_slopes", alibi_slopes, ctx, ((num_heads,), (batch, num_heads)),
                                    (np.dtype(np.float32),), f"(Hq,) = ({num_heads},) or (B, Hq) = ({batch}, "
                                    f"{num_heads})")
    if left is None and right is None and softcap is None and sinks is None and alibi_slopes is None and mod is None:
        return NONE
    return Variants(left, right, softcap, sinks, alibi_slopes, mod)


def _check_array(name: str, x, ctx, shapes: tuple, dtypes: tuple, shape_text: str):
    """``x`` as an array of the call's kind (a contiguous CuPy array on the GPU: a view, or a copy of a strided one;
    NumPy on the CPU), checked for kind, device, shape and dtype."""
    from ..runtime import interop
    kind = interop.check_like_query(name, x, ctx)
    shape = tuple(x.shape)
    if shape not in shapes:
        raise ValueError(f"{name} must have shape {shape_text}, got {shape}")
    dt = interop.dtype_of(x, kind)
    if dt not in dtypes:
        allowed = " or ".join(sorted({str(d) for d in dtypes}))
        raise TypeError(f"{name} must be {allowed}, got {dt}")
    if ctx.on_gpu:
        with ctx.activate():
            a = ctx.as_cupy(x)
            # The kernels index it as contiguous ([h], [b·stride_b + h]): a strided or expanded view is copied.
            return a if a.flags.c_contiguous else ctx.contiguous(a)
    return interop.to_numpy(x, kind)
