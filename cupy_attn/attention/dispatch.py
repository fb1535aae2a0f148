"""The plan of a call: every choice of path, kernel, tile, variant and schedule, made once, here.

A :class:`Plan` is a pure function of the checked problem, the device's compute capability (and SM count) and the
environment knobs, so it can be printed (``cupy_attn.explain`` prints the plan that runs) and tested on a machine
without a GPU. The plan holds the chosen kernel module (kernels/<family>.py) and that module's choice, or the split
path's :class:`~cupy_attn.attention.paths.split.SplitChoice`; ``Plan.prepare(out, lse)`` builds the launch from them
without deciding anything again. ``CUPY_ATTN_BACKEND`` (fused | split | reference) overrides ``backend="auto"`` for
debugging, on GPU calls only: CPU inputs always run the reference. :func:`plan_backward` is the backward's plan.

Kernel-level calls on CuPy arrays (tests, benchmarks) go through :func:`fused_launch` and :func:`decode_launch`, which
apply the same rules.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Callable

from ..runtime import env
import numpy as np

from ..runtime.interop import device_sms, dtype_name
from ..runtime.kernel_abi import Layout
from . import checks, mods, variants
from .kernels import flash_bwd, flash_bwd_sm90, flash_decode, flash_fwd, flash_fwd_d512_sm90 as d512, \
    flash_fwd_sm90, gemm_3xtf32, pv_sm90, scores_sm90, softmax
from .paths import split

ENV_BACKEND = "CUPY_ATTN_BACKEND"
ENV_FA3 = "CUPY_ATTN_FA3"
ENV_WORKSPACE_BYTES = "CUPY_ATTN_WORKSPACE_BYTES"
DEFAULT_WORKSPACE_BYTES = 1 << 30
_CPU_NAMES = {"numpy": "NumPy", "torch_cpu": "CPU torch"}


@dataclasses.dataclass
class Plan:
    """What one call will run, and why. ``kernel`` (the module of kernels/ that builds the launch; None on the split
    and reference paths) and ``choice`` (that module's choice, or the split path's SplitChoice) are what
    :meth:`prepare` builds; ``details`` describes them (computed when read, by explain(), not on every call)."""

    backend: str                       # "fused" | "decode" | "split" | "reference" | "empty"
    reason: str
    num_splits: int | None = None      # decode: the key splits it launches
    describe: Callable[[], dict] | None = dataclasses.field(default=None, repr=False)
    copies: list = dataclasses.field(default_factory=list)
    problem: Any = dataclasses.field(default=None, repr=False)
    kernel: Any = dataclasses.field(default=None, repr=False)
    choice: Any = None

    @property
    def details(self) -> dict:
        return self.describe() if self.describe is not None else {}

    def build(self, out, lse):
        """The PreparedLaunch of a fused or decode plan for these outputs (the kernel module's build)."""
        return self.kernel.build(self.problem, self.choice, out, lse)

    def prepare(self, out, lse) -> Callable:
        """``run(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, mask_ptr)``: the plan's launch for the call's outputs, built
        without checking or deciding anything again, bound to the call's stream (what the call cache replays)."""
        if self.backend == "split":
            return split.prepare(self.problem, self.choice, out, lse)
        if self.kernel is None:
            raise ValueError("the reference path has no launch")
        return self.build(out, lse).bind(self.problem.ctx.stream)

    def __str__(self) -> str:
        lines = [f"backend: {self.backend}", f"why: {self.reason}"]
        lines += [f"{k}: {v}" for k, v in self.details.items()]
        lines += [f"copy: {c}" for c in self.copies]
        return "\n".join(lines)


def device_arch(p) -> int:
    """Compute capability of the call's device as an int (90 for an H200); 0 on the CPU path."""
    if not p.ctx.on_gpu:
        return 0
    import cupy
    return int(cupy.cuda.Device(p.ctx.device_id).compute_capability)


def prefer_fused(p) -> tuple[bool, str]:
    """Auto rule between the two GPU paths for a call both can run.

    The split path's cost is its two GEMMs plus one pass over an L×S fp32 score buffer (12 bytes per score: write fp32,
    read fp32, write P, read P); the fused kernel moves no scores but runs its GEMMs below cuBLAS's rate. At B=4, H=16,
    L=S=2048 the fused kernel measured 1.5x (D=256) to 3.4x (D=64) faster than the split path, in fp16 and bf16 (and
    the mma.sync kernel alone, the sm_8x path, still 8% ahead at D=256; bench/notes/flash.md), so auto takes it
    whenever it supports the call; the split path serves fp32 and head dims above 256.
    """
    return True, "fused kernel supports this call (no L×S score buffer; faster than split at every measured head dim)"


def plan_sdpa(p, backend: str, arch: int | None = None, num_splits: int | None = None,
              num_sms: int | None = None, *, workspace_bytes: int | None = None, allow_tf32: bool = False) -> Plan:
    """Choose the path for a checked problem (see checks.SDPAProblem).

    CPU inputs (NumPy, CPU torch) always run the reference: backend="fused" or "split" with them is a ValueError, and
    CUPY_ATTN_BACKEND is ignored for them (it overrides ``backend="auto"`` on GPU calls only). On the GPU, ValueError
    when a forced path cannot run the call. num_splits: the caller's split count for the decode kernel (None: auto);
    num_sms: the device's SM count (looked up when None; tests pass it with a fake arch). ``workspace_bytes`` and
    ``allow_tf32`` configure the split path (:func:`split_choice`). GPU calls with nothing to compute
    (checks.SDPAProblem.empty) plan "empty" under any backend but "reference" (:func:`empty_reason`).
    """
    copies = list(p.copies)
    if not p.ctx.on_gpu:  # CUPY_ATTN_BACKEND is not read here: it overrides GPU calls only
        if backend in ("fused", "split"):
            raise ValueError(f"backend={backend!r} needs CUDA inputs: {_CPU_NAMES.get(p.ctx.kind, p.ctx.kind)} inputs "
                             f"run only the float64 reference (pass backend='auto' or 'reference')")
        return Plan("reference", f"{p.ctx.kind} inputs run the float64 NumPy reference on the CPU", copies=copies)
    arch = device_arch(p) if arch is None else arch
    requested = backend
    if backend == "auto" and env.get(ENV_BACKEND):
        backend = env.get(ENV_BACKEND)
        if backend not in ("fused", "split", "reference"):
            raise ValueError(f"{ENV_BACKEND} must be fused, split or reference, got {backend!r}")
    forced = f"forced by {ENV_BACKEND}" if requested == "auto" and backend != "auto" else "requested"
    if backend == "reference":
        return Plan("reference", f"reference {forced}: float64 NumPy on the host (slow, for checking)", copies=copies)
    if p.dropout_p > 0 and num_splits is not None:
        raise ValueError(f"num_splits={num_splits} asks for the decode kernel, which has no dropout (dropout_p="
                         f"{p.dropout_p}): pass num_splits=None")
    if p.empty:  # whatever the backend: nothing is launched (sdpa's _run_empty gives torch's results)
        return Plan("empty", empty_reason(p), copies=copies, problem=p)
    if p.variants.mod is not None:  # score_mod / mask_mod: the FA3-design kernel's mod instantiation, else split
        return _mod_plan(p, backend, arch, forced, copies, workspace_bytes, allow_tf32)
    if p.mask is not None and backend in ("auto", "fused") and num_splits is None \
            and mask_fa3_reason(p, arch) is None:
        return _mask_fa3_plan(p, backend, arch, forced, copies)
    if not p.variants.plain and backend in ("auto", "fused"):  # backend "split": the split path serves every variant
        plan = _variants_plan(p, backend, arch, forced, copies)
        if plan is not None:
            return plan
    fused_why_not = flash_fwd.reason(p, arch)
    if backend in ("auto", "fused") and fused_why_not is None and p.dropout_p == 0:
        plan = _decode_plan(p, backend, arch, num_splits, num_sms, copies)
        if plan is not None:
            return plan
    if backend in ("auto", "fused") and fused_why_not is not None and p.dropout_p == 0:
        plan = _d512_plan(p, backend, arch, forced, copies, num_sms)
        if plan is not None:
            return plan
    if backend == "fused":
        if fused_why_not:
            raise ValueError(f"backend='fused' cannot run this call: {fused_why_not}")
        return plan_fused(p, arch, f"fused {forced}", copies)
    if backend == "auto" and fused_why_not is None:
        use_fused, why = prefer_fused(p)
        if use_fused:
            return plan_fused(p, arch, why, copies)
    reason = f"split {forced}" if backend == "split" else f"split path: {fused_why_not}"
    if p.dropout_p > 0:
        reason += f"; dropout_p={p.dropout_p} applied by the softmax kernel (P written dropped and scaled)"
    choice = split_choice(p, arch, workspace_bytes=workspace_bytes, allow_tf32=allow_tf32)
    return Plan("split", reason, describe=functools.partial(split_details, p, choice), copies=copies, problem=p,
                choice=choice)


# Masked calls below this many (batch·head, query, key) triples keep the masked kernels they ran on before the mask
# could be a mod (the wgmma kernel, the scores kernel): not yet measured against the FA3 mask path at small sizes.
MASK_FA3_MIN_PAIRS = 1 << 24


def mask_fa3_reason(p, arch: int) -> str | None:
    """None when a masked call runs a fused Hopper kernel with its attn_mask as a mod (mods.mask_as_mod): the
    FA3-design kernel (head dims 33-256) or the head-dim-512 kernel (257-512), fp16/bf16, no dropout, no other
    variant, at least MASK_FA3_MIN_PAIRS triples; else why not."""
    if p.dropout_p > 0:
        return "dropout"
    if not variants.of(p).plain:
        return "variants with a mask"
    if p.batch * p.num_heads * p.seqlen_q * p.seqlen_k < MASK_FA3_MIN_PAIRS:
        return "small"
    if p.seqlen_q * p.groups <= 64:  # a few query rows per KV head: the decode kernel's (split-KV, it takes masks)
        return "decode-sized"
    unmasked = _without_mask(p)
    why = f"{ENV_FA3}=0" if env.get(ENV_FA3) == "0" else flash_fwd_sm90.reason(unmasked, arch)
    if why is not None and d512.reason(unmasked, arch) is None and d512.enabled() != "0":
        return None  # the head-dim-512 kernel (its own switch: CUPY_ATTN_D512)
    return why


def _mask_fa3_plan(p, backend: str, arch: int, forced: str, copies) -> Plan:
    """The call with its attn_mask as a mod (mods.mask_as_mod) in the FA3-design kernel's mod instantiation, the key
    range of each 128-row block found by the mods' pre-pass (mods.create_block_mask's kernel), so the blocks the mask
    hides whole (a causal mask's upper triangle, left padding) are skipped. The plan's problem is the masked call's
    without the mask and with the mod."""
    bound = mods.mask_as_mod(p.mask, p.mask_kind)  # its arrays and key ranges come at launch (mods.materialize)
    q = dataclasses.replace(p, mask=None, mask_kind="none", variants=dataclasses.replace(p.variants, mod=bound))
    skipped = "key blocks outside each row block's visible range skipped"
    if env.get(ENV_FA3) != "0" and flash_fwd_sm90.reason(q, arch) is None:
        choice = flash_fwd_sm90.choose(q, "3")
        return Plan("fused", f"fused {forced}" if backend == "fused" else f"attn_mask as a mod in the FA3-design "
                    f"kernel (flash_fwd_sm90_mod; {skipped})", describe=functools.partial(fa3_details, choice, q),
                    copies=copies, problem=q, kernel=flash_fwd_sm90, choice=choice)
    choice = d512.choose(q)
    return Plan("fused", f"fused {forced}" if backend == "fused" else f"attn_mask as a mod in the head-dim-512 kernel "
                f"(flash_fwd_d512_sm90_mod; {skipped})", describe=functools.partial(_d512_details, choice, q),
                copies=copies, problem=q, kernel=d512, choice=choice)


def _mod_plan(p, backend: str, arch: int, forced: str, copies, workspace_bytes, allow_tf32) -> Plan:
    """A score_mod / mask_mod call (attention/mods.py): the FA3-design kernel's mod instantiation (flash_fwd_sm90_mod,
    the persistent tile with the variants' code) where that kernel runs the call without dropout, the head-dim-512
    kernel's (flash_fwd_d512_sm90_mod, one tile per CTA) at head dims 257-512, else the split path's softmax kernel
    (masked_softmax_mod: any head dim, dtype, mask, dropout). backend="fused" where neither fused kernel can:
    ValueError."""
    names = p.variants.names()[-1]
    fa3_why = "dropout_p > 0: the FA3 kernel has no dropout" if p.dropout_p > 0 else flash_fwd_sm90.reason(p, arch)
    if fa3_why is None and env.get(ENV_FA3) == "0":
        fa3_why = f"{ENV_FA3}=0"
    if backend in ("auto", "fused") and fa3_why is None:
        choice = flash_fwd_sm90.choose(p, "3")
        return Plan("fused", f"fused {forced}" if backend == "fused" else f"the FA3-design kernel's mod "
                    f"instantiation (flash_fwd_sm90_mod: {names})", describe=functools.partial(fa3_details, choice, p),
                    copies=copies, problem=p, kernel=flash_fwd_sm90, choice=choice)
    d512_why = "dropout_p > 0" if p.dropout_p > 0 else d512.reason(p, arch)
    if backend in ("auto", "fused") and d512_why is None and d512.enabled() != "0":
        choice = d512.choose(p)
        return Plan("fused", f"fused {forced}" if backend == "fused" else f"the head-dim-512 kernel's mod "
                    f"instantiation (flash_fwd_d512_sm90_mod: {names})",
                    describe=functools.partial(_d512_details, choice, p), copies=copies, problem=p, kernel=d512,
                    choice=choice)
    if backend == "fused":
        raise ValueError(f"backend='fused' cannot run score_mod / mask_mod here: FA3 kernel: {fa3_why}; head-dim-512 "
                         f"kernel: {d512_why} (the split path's softmax kernel applies them; pass backend='auto' or "
                         f"'split')")
    choice = split_choice(p, arch, workspace_bytes=workspace_bytes, allow_tf32=allow_tf32)
    why = "" if backend == "split" else f" (FA3 kernel: {fa3_why}; head-dim-512 kernel: {d512_why})"
    return Plan("split", f"split path: {names} applied by the softmax kernel's mod instantiation "
                f"(masked_softmax_mod){why}", describe=functools.partial(split_details, p, choice), copies=copies,
                problem=p, choice=choice)


def _variants_plan(p, backend: str, arch: int, forced: str, copies) -> Plan | None:
    """The fused plan of a call with variants (window, softcap, sinks, ALiBi: attention/variants.py), or None for the
    split path, which serves every variant (its softmax kernel's variants instantiation). The FA3-design kernel
    (head dims 33-256) and the head-dim-512 kernel (257-512; no softcap) have variant instantiations; neither has
    dropout or attn_mask. backend="fused" with neither able to run the call is a ValueError."""
    why = []
    if p.dropout_p > 0:
        why.append("dropout_p > 0: the fused kernels with variants have no dropout")
    else:
        fa3_why = flash_fwd_sm90.reason(p, arch)
        if fa3_why is None:
            choice = flash_fwd_sm90.choose(p, "3")
            return Plan("fused", f"fused {forced}" if backend == "fused" else "the FA3-design kernel's variants "
                        f"({', '.join(p.variants.names())})", describe=functools.partial(fa3_details, choice, p),
                        copies=copies, problem=p, kernel=flash_fwd_sm90, choice=choice)
        why.append(f"FA3 kernel: {fa3_why}")
        d512_why = d512.reason(p, arch)
        if d512_why is None and d512.enabled() != "0":
            choice = d512.choose(p)
            return Plan("fused", f"the head-dim-512 kernel's variants ({', '.join(p.variants.names())})",
                        describe=functools.partial(_d512_details, choice, p), copies=copies, problem=p, kernel=d512,
                        choice=choice)
        why.append(f"head-dim-512 kernel: {d512_why}")
    if backend == "fused":
        raise ValueError(f"backend='fused' cannot run this call: {'; '.join(why)}")
    return None


def _d512_details(choice, p) -> dict:
    return {**d512.describe(choice, p), **variant_details(p, 64, d512.BLOCK_N)}


def variant_details(p, block_m: int, block_n: int) -> dict:
    """explain()'s lines for a call's variants: which, and the fraction of (row block, key block) tiles of a
    block_m × block_n tiling that no row sees (skipped: neither loaded nor computed)."""
    if p.variants.plain:
        return {}
    total, seen = tile_visibility(p, block_m, block_n)
    lines = {"variants": ", ".join(p.variants.names()),
             "skipped tiles": f"{total - seen} of {total} ({100 * (total - seen) / max(total, 1):.0f}%) have no "
                              "visible key: neither loaded nor computed"}
    bound = p.variants.mod
    if bound is not None:
        ranges = bound.block_mask is not None or bound.mask_source is not None
        lines["skipped tiles"] += (" by the causal and window bounds; more by the mask's key ranges (found on the "
                                   "device)" if ranges else " by the causal and window bounds (no BlockMask: the mod's "
                                   "own holes are computed and masked)")
        parts = [n for n in ("score_mod", "mask_mod", "score_mod_grad", "score_mod_aux_grad")
                 if getattr(bound.mod, n) is not None]
        aux = [f"{n} ({dt}, {nd}-d)" for n, (_, dt, nd) in zip(bound.names, bound.spec)]
        lines["mod"] = ", ".join(parts) + (f"; aux {', '.join(aux)}" if aux else "") + (
            "; the call's attn_mask" if bound.mask_source is not None else "")
    return lines


def tile_visibility(p, block_m: int, block_n: int) -> tuple[int, int]:
    """(tiles, tiles with a visible key) of one (batch, head)'s L × S scores in block_m × block_n tiles, from the
    key bounds alone (checks.SDPAProblem.key_upper, window_lo): row block [m0, m1) sees keys from m0 + window_lo to
    m1 − 1 + upper offset."""
    L, S = p.seqlen_q, p.seqlen_k
    bounded, upper = p.key_upper
    lo = p.window_lo
    n_blocks = -(-S // block_n)
    seen = 0
    for m0 in range(0, L, block_m):
        m1 = min(L, m0 + block_m)
        first = max(0, m0 + lo)
        last = min(S - 1, m1 - 1 + upper) if bounded else S - 1
        if last >= first:
            seen += last // block_n - first // block_n + 1
    return -(-L // block_m) * n_blocks, seen


def empty_reason(p) -> str:
    """What a call with nothing to compute (checks.SDPAProblem.empty) returns, launching nothing, as torch does: out
    empty when B, Hq, L or Ev is 0, zeros when S = 0 (no row sees a key); lse -inf where a row sees no key (with Ev = 0
    and keys, lse is still each row's: the float64 reference computes it on the host)."""
    out = p.batch_shape + (p.seqlen_q, p.head_dim_v)
    if p.batch * p.num_heads * p.seqlen_q == 0:
        return f"nothing to compute: out {out} and lse are empty"
    if p.seqlen_k == 0:
        return f"S = 0: no row sees a key, out {out} is zeros and lse -inf"
    return f"head_dim_v = 0: out {out} is empty; lse (if asked for) from the float64 reference on the host"


def _d512_plan(p, backend: str, arch: int, forced: str, copies, num_sms: int | None) -> Plan | None:
    """The head-dim 257-512 fused kernel's plan (kernels/flash_fwd_d512_sm90) when it can run the call and is chosen:
    by backend="fused", by CUPY_ATTN_D512=1, or under auto by d512.prefer_grid; never with CUPY_ATTN_D512=0."""
    setting = d512.enabled()
    if setting == "0" or d512.reason(p, arch):
        return None
    if backend == "fused":
        why = f"fused {forced}: the head-dim-512 kernel"
    elif setting == "1":
        why = f"{d512.ENV}=1: the head-dim-512 kernel"
    else:
        if num_sms is None:
            num_sms = device_sms(p.ctx.device_id)
        take, why = d512.prefer_grid(p.batch, p.num_heads, p.seqlen_q, p.seqlen_k, num_sms)
        if not take:
            return None
    choice = d512.choose(p)
    return Plan("fused", why, describe=functools.partial(d512.describe, choice, p), copies=copies, problem=p,
                kernel=d512, choice=choice)


def _decode_plan(p, backend: str, arch: int, num_splits: int | None, num_sms: int | None, copies) -> Plan | None:
    """The decode plan when the split-KV kernel takes this fused-eligible call, else None: under backend="auto" by
    flash_decode.prefer_decode, or whenever the caller passed num_splits (auto or fused); never with
    CUPY_ATTN_DECODE=0."""
    if not flash_decode.enabled() or (backend == "fused" and num_splits is None):
        return None
    if flash_decode.reason(p, arch) is not None:
        return None
    if num_splits is None:
        take, why = flash_decode.prefer_decode(p.seqlen_q, p.seqlen_k, p.groups)
        if not take:
            return None
    else:
        why = f"num_splits={num_splits} requested"
    if num_sms is None:
        num_sms = device_sms(p.ctx.device_id)
    choice = flash_decode.choose(p, arch, num_sms, num_splits)
    n = choice.num_splits
    details = {"kernel": choice.family.name, "head-dim bucket": flash_decode.head_dim_bucket(p.head_dim, p.head_dim_v),
               "tile": choice.describe(),
               "packed rows": f"{p.seqlen_q} query rows x {p.groups} heads per K/V head",
               "splits": f"{n} of {choice.split_keys} keys" + (" (auto)" if num_splits is None
                                                                 else f" ({num_splits} requested)")}
    return Plan("decode", f"decode (split-KV, {n} splits): {why}", describe=lambda: details, copies=copies,
                num_splits=n, problem=p, kernel=flash_decode, choice=choice)


def plan_fused(p, arch: int, why: str = "fused kernel", copies=(), out=None) -> Plan:
    """The fused plan of a call flash_fwd serves (flash_fwd.reason), its kernel choice made once, here: the
    FA3-design kernel (flash_fwd_sm90, in :func:`fa3_mode`'s mode) where it can take the call with output ``out``
    (None: the call's own, contiguous), else flash_fwd's family and tile (flash_fwd.select), its dropout variant for
    dropout calls."""
    copies = list(copies)
    bucket = flash_fwd.head_dim_bucket(p.head_dim, p.head_dim_v)
    if p.dropout_p > 0:  # only the mma.sync kernel has a dropout variant (it runs on Hopper too)
        choice = flash_fwd.select(p.dtype, bucket, arch, dropout=True)
        extra = {"dropout": f"p={p.dropout_p}: the mma.sync kernel's dropout variant (the FA3-design, wgmma and "
                            "decode kernels have no dropout)"}
        return Plan("fused", why, describe=functools.partial(fused_details, choice, extra), copies=copies,
                    problem=p, kernel=flash_fwd, choice=choice)
    mode = fa3_mode(p, arch)
    if mode is not None and p.mask is None:
        why_not = flash_fwd_sm90.reason(p, arch, out)
        if why_not is None:
            choice = flash_fwd_sm90.choose(p, mode)
            return Plan("fused", why, describe=functools.partial(fa3_details, choice), copies=copies, problem=p,
                        kernel=flash_fwd_sm90, choice=choice)
        fa3 = {"FA3 kernel": f"not used: {why_not}"}
    else:
        fa3 = {}
    choice = flash_fwd.select(p.dtype, bucket, arch)
    return Plan("fused", why, describe=functools.partial(fused_details, choice, fa3), copies=copies, problem=p,
                kernel=flash_fwd, choice=choice)


# Below this many FLOPs (4·B·H·L·S·D) auto keeps the wgmma kernel for Hopper calls the FA3-design kernel could take:
# the FA3 launch encodes three TMA tensor maps per call (~12 µs of host time through cuda.bindings), which a small call
# would pay in full; at 2^34 FLOPs (~30 µs of kernel time) it hides behind the queue.
FA3_MIN_FLOPS = 2 ** 34


def fa3_mode(p, arch: int) -> str | None:
    """"1" (FA3 kernel), "2" (FA3 with intra-warpgroup overlap), "3" ("2" as a persistent kernel) or None
    (flash_fwd.cu) for a call on ``arch``.

    CUPY_ATTN_FA3=0 turns it off, 1, 2 or 3 force it for every call it can take; unset (auto), on Hopper for calls of
    at least FA3_MIN_FLOPS: "3", which measured 1.02-1.16x "2" at most shapes (0.95x at (4,32,4096,64), where
    non-causal calls now run the 192-row tile instead: flash_fwd_sm90.tile_for), and "2" 1.2-1.9x the wgmma kernel
    (bench/experiments/flash_fwd/fa3_fwd.py; bench/notes/flash.md). E.g. (8, 16, 2048, 128) fp16: 2^36 FLOPs → "3";
    (1, 8, 512, 64): 2^29 → the wgmma kernel.
    """
    mode = env.get(ENV_FA3)
    if mode in ("1", "2", "3"):
        return mode
    if mode == "0" or arch != 90:
        return None
    flops = 4.0 * p.batch * p.num_heads * p.seqlen_q * p.seqlen_k * max(p.head_dim, p.head_dim_v)
    if flops < FA3_MIN_FLOPS:
        return None
    return "3"


def fa3_details(choice: flash_fwd_sm90.Choice, p=None) -> dict:
    """The FA3-design kernel's configuration (flash_fwd_sm90.choose's choice), with a call's variants."""
    tile = choice.tile
    return {"head-dim bucket": choice.head_dim,
            "kernel": ("flash_fwd_sm90_mod (" if p is not None and p.variants.mod is not None else "flash_fwd_sm90_tma (")
                      + choice.variant + (", variants)" if choice.variants else ")"),
            "tile": f"{tile.block_m}x{tile.block_n}, producer + {tile.block_m // 64} consumer warpgroups, "
                    f"{tile.stages} K/V stages, TMA + wgmma" + (", intra-warpgroup overlap" if tile.overlap else "")
                    + (", persistent (one CTA per SM)" if tile.persistent else ""),
            "epilogue": "out through shared memory by TMA stores (4-byte stores where head_dim_v is not a multiple "
                        "of 8 or out's strides or base are not 16-byte aligned)",
            **(variant_details(p, tile.block_m, tile.block_n) if p is not None else {})}


def fused_details(choice: flash_fwd.Choice, extra: dict | None = None) -> dict:
    """The instantiation the fused kernel will use: (family, tile, head dim) from flash_fwd.select."""
    family, tile, head_dim = choice
    return {**(extra or {}), "head-dim bucket": head_dim, "kernel": family.name,
            "tile": f"{tile.block_m}x{tile.block_n}, {tile.warps} warps, {tile.stages} K/V stage(s)"
                    + (", wgmma" if tile.wgmma else ", mma.sync")}


def fused_launch(q, k, v, out, lse=None, *, scale: float, causal: str | None = None, mask=None,
                 dropout_p: float = 0.0, rng=None, ctx=None):
    """The fused kernel's PreparedLaunch for 4-D CuPy arrays (kernel-level calls: tests, benchmarks), the kernel
    chosen by :func:`plan_fused`'s rules for this out (checks.array_problem's arguments and checks); ValueError when
    flash_fwd cannot run the call."""
    p = checks.array_problem(q, k, v, out, lse, scale=scale, causal=causal, mask=mask, dropout_p=dropout_p, rng=rng,
                             ctx=ctx, what="fused attention")
    arch = device_arch(p)
    why_not = flash_fwd.reason(p, arch)
    if why_not:
        raise ValueError(f"fused attention: {why_not}")
    return plan_fused(p, arch, "kernel-level call", out=out).build(out, lse)


def decode_launch(q, k, v, out, lse=None, *, scale: float, causal: str | None = None, mask=None,
                  num_splits: int | None = None, variant: str | None = None, warps: int | None = None, ctx=None):
    """The decode kernel's PreparedLaunch for 4-D CuPy arrays (kernel-level calls), chosen by flash_decode.choose
    (variant and warps None: the environment's, as the plan's); ``info["choice"]`` says which kernel and tile run.
    ValueError when the decode kernel cannot run the call."""
    checks.check_num_splits(num_splits)
    p = checks.array_problem(q, k, v, out, lse, scale=scale, causal=causal, mask=mask, ctx=ctx,
                             what="decode attention")
    arch = device_arch(p)
    why_not = flash_decode.reason(p, arch)
    if why_not:
        raise ValueError(f"decode attention: {why_not}")
    choice = flash_decode.choose(p, arch, device_sms(p.ctx.device_id), num_splits, variant=variant, warps=warps)
    return flash_decode.build(p, choice, out, lse)


# ---------------------------------------------------------------------------------------------------------------------
# The split path's choice.

def workspace_bytes_default() -> int:
    """Scores-buffer budget: ``CUPY_ATTN_WORKSPACE_BYTES`` or 1 GiB."""
    return int(env.get(ENV_WORKSPACE_BYTES, DEFAULT_WORKSPACE_BYTES))


def scores_reason(p, arch: int, variant: int, budget: int) -> str | None:
    """None when the split path runs the Hopper scores kernel (scores_sm90: Q·Kᵀ with the softmax in its epilogue,
    P written in the input dtype) followed by the P·V GEMM, else why not: ``variant`` (CUPY_ATTN_SPLIT_FUSED,
    scores_sm90.setting) must not be 0, the kernel must take the call (scores_sm90.reason) and P of one batch's heads
    (Hq·L·⌈S/8⌉·8 elements) must fit the workspace budget (batches beyond it run in chunks:
    split.scores_batch_chunk)."""
    if variant == 0:
        return f"{scores_sm90.ENV_SPLIT_FUSED}=0"
    why = scores_sm90.reason(p, arch, variant)
    if why is not None:
        return why
    need = split.p_bytes_per_batch(p)
    if need > budget:
        return (f"P of one batch's heads needs {need / 2**20:.0f} MiB, over the {budget / 2**20:.0f} MiB workspace "
                "budget")
    return None


def split_choice(p, arch: int, *, workspace_bytes: int | None = None, allow_tf32: bool = False,
                 out=None) -> split.SplitChoice:
    """Every choice of the split path for a checked problem on compute capability ``arch``, with output ``out`` (None:
    the call's own, contiguous): the budget, the fp32 GEMM (gemm_3xtf32.fp32_gemm), the scores kernel
    (:func:`scores_reason`) in CUPY_ATTN_SPLIT_FUSED's variant, its P·V kernel per chunk of batches
    (pv_sm90.reason in CUPY_ATTN_SPLIT_PV's mode), the chunks of batches (split.scores_batch_chunk), the causal row
    bands and their streams (split.causal_row_bands, split.cublas_causal_bands, split.band_streams)."""
    budget = workspace_bytes or workspace_bytes_default()
    gemm = gemm_3xtf32.fp32_gemm(p.dtype, allow_tf32, arch)
    variant = scores_sm90.setting()
    why_not = scores_reason(p, arch, variant, budget)
    L, banded = p.seqlen_q, p.causal is not None
    if why_not is not None:
        bands = split.cublas_causal_bands(L) if banded else 1
        return split.SplitChoice(budget, gemm, allow_tf32, scores_why_not=why_not, batch_chunk=p.batch, bands=bands,
                                 streams=split.band_streams(L, p.seqlen_k, bands, budget) if banded else 1)
    chunk = split.scores_batch_chunk(p, budget)
    mode = pv_sm90.setting()
    pv = []
    for nb in dict.fromkeys((chunk, p.batch % chunk or chunk)):  # the chunk sizes launched: one, or two
        sub, sub_out = (p, out) if nb == p.batch else (split.batch_slice(p, nb), None if out is None else out[:nb])
        if sub_out is None:
            sub_out = Layout.contiguous((nb, p.num_heads, L, p.head_dim_v), p.dtype)
        pv.append((nb, pv_sm90.reason(sub, sub_out, mode)))
    return split.SplitChoice(budget, gemm, allow_tf32, scores=scores_sm90.choose(p, variant), pv=tuple(pv),
                             batch_chunk=chunk, bands=split.causal_row_bands(L) if banded else 1)


def split_details(p, choice: split.SplitChoice) -> dict:
    """The split path's schedule as the plan's choice runs it: the scores kernel and its P buffer, or the chunking of
    the fp32 score buffer, and the GEMMs (for fp32: gemm_3xtf32.fp32_gemm's kind)."""
    budget = choice.budget
    if choice.scores is not None:
        tile, variant = choice.scores.tile, choice.scores.variant
        ld_p = -(-p.seqlen_k // 8) * 8
        pv_why = choice.pv_reason(min(choice.batch_chunk, p.batch))
        pv = "cuBLAS P·V" if pv_why is not None else "pv_sm90 P·V (TMA + wgmma, each row block to its visible keys)"
        last = dict(choice.pv).get(p.batch % choice.batch_chunk, pv_why)
        return {
            "schedule": f"{choice.scores.kernel} (Q·Kᵀ + softmax in the epilogue, TMA + wgmma) → {pv} "
                        f"({scores_sm90.ENV_SPLIT_FUSED}={variant})",
            "scores kernel": f"64 rows x {2 * tile.half_n} keys per CTA, {tile.stages} TMA stages"
                             + {2: ", clusters of 2 CTAs sharing K by TMA multicast",
                                3: ", persistent: one CTA per SM walks its row blocks"}.get(variant, ""),
            "P buffer": _p_buffer_detail(p, choice, ld_p),
            **({"last chunk's P·V": "cuBLAS P·V" if last is not None else "pv_sm90 P·V"}
               if (last is None) != (pv_why is None) else {}),
            **({"attn_mask": f"{p.mask_kind}, varies only along the keys: added in the scores kernel's epilogue "
                             f"({scores_sm90.MASKED_KERNEL})"} if p.mask is not None else {}),
            **({"causal": f"{p.causal}: row blocks past the diagonal skip their wgmma; " + (
                "P·V by pv_sm90, each 64-row block stopping at its last visible key (rounded up to 64)"
                if pv_why is None else f"P·V in {choice.bands} cuBLAS row bands, each "
                f"stopping at its last visible key ({pv_why})")} if p.causal is not None else {}),
        }
    gemm_name = {None: "cuBLAS", "tf32": "cuBLAS TF32", "sgemm": "cuBLAS SGEMM",
                 "3xtf32": "3xTF32 (gemm_3xtf32)"}[choice.gemm]
    ld = -(-p.seqlen_k // 8) * 8
    per_item = p.seqlen_q * ld * 4
    return {
        "schedule": f"{gemm_name} Q·Kᵀ (fp32 scores) → softmax kernel → {gemm_name} P·V",
        "GEMMs": gemm_3xtf32.DESCRIPTIONS[choice.gemm],
        "scores kernel": f"not used: {choice.scores_why_not}",
        "scores buffer": f"fp32, {p.seqlen_q}x{p.seqlen_k} (pitch {ld}) per head, {per_item / 2**20:.1f} MiB each",
        "workspace budget": f"{budget / 2**20:.0f} MiB (CUPY_ATTN_WORKSPACE_BYTES)",
        "softmax tile": "threads/row, vec4 per thread = %s" % (softmax.tile_for(p.seqlen_k, softmax.masked(p)),),
    } | ({"dropout": f"p={p.dropout_p}: P written as P∘Z/(1−p) by the softmax kernel"} if p.dropout_p > 0 else {}) \
      | ({"variants": f"{', '.join(p.variants.names())}: applied by the softmax kernel (softmax_variants) to every "
                      "score (no key block skipped)"} if not p.variants.plain else {}) \
      | ({"causal": (f"{p.causal}: {choice.bands} row band(s), each band's Q·Kᵀ, softmax and P·V stopping at its "
                     "last visible key" + (f", on {choice.streams} streams at once" if choice.streams > 1 else ""))}
         if p.causal is not None else {})


def _p_buffer_detail(p, choice: split.SplitChoice, ld_p: int) -> str:
    """The scores kernel's P buffer: all batch·heads in one, or one batch chunk at a time (choice.batch_chunk)."""
    per_head = f"{p.dtype.name}, {p.seqlen_q}x{p.seqlen_k} (pitch {ld_p}) per head"
    mib = split.p_bytes_per_batch(p) / 2**20  # one batch's heads
    n = choice.batch_chunk
    if n >= p.batch:
        return f"{per_head}, all heads in one buffer of {p.batch * mib:.0f} MiB"
    return (f"{per_head}; all heads would take {p.batch * mib:.0f} MiB, over the {choice.budget / 2**20:.0f} MiB "
            f"workspace budget: chunks of {n} batches ({n * mib:.0f} MiB), each one scores launch and its P·V GEMMs")


# ---------------------------------------------------------------------------------------------------------------------
# The backward's plan.

# Which backward runs (tests, comparisons): "split" the split backward, "mma" the mma.sync kernel (flash_bwd.cu) where
# it applies, "sm90" the Hopper wgmma kernel (flash_bwd_sm90.cu) wherever it applies; unset or "auto": plan_backward.
ENV_BWD = "CUPY_ATTN_BWD"
_ENV_BWD_VALUES = ("", "auto", "split", "mma", "sm90")


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """Which backward a call runs: ``kernel`` "sm90" (flash_bwd_sm90.cu), "mma" (flash_bwd.cu) or "split"; ``bucket``
    the fused kernels' head-dim bucket (None for split); ``reason`` why, for explain-style printing; ``gemm`` the
    split backward's scores GEMM kind (gemm_3xtf32.fp32_gemm: the forward's, None for fp16/bf16)."""
    kernel: str
    bucket: int | None
    reason: str
    gemm: str | None = None
    mask_as_mod: bool = False  # an attn_mask run as a mod in the Hopper kernel (masked_backward makes the problem)

    def __str__(self) -> str:
        bucket = f", head-dim bucket {self.bucket}" if self.bucket else ""
        return f"backward: {self.kernel}{bucket} ({self.reason})"


def plan_backward(p, arch: int | None = None, allow_tf32: bool = False) -> BackwardPlan:
    """Choose the backward of a checked problem (checks.SDPAProblem on the GPU; ``arch``: compute capability as an int,
    read from the call's device when None, so that tests can pass one).

    The split backward serves everything; the mma.sync fused kernel (flash_bwd.cu) fp16/bf16 without attn_mask at head
    dims ≤ 128 on compute capability ≥ 8.0; the Hopper kernel (flash_bwd_sm90.cu) fp16/bf16 without attn_mask or
    dropout at head dims ≤ 256 on 9.0 for layouts TMA reads in place (flash_bwd_sm90.reason). ``CUPY_ATTN_BWD``:
    "split", "mma" (never sm90), "sm90" (sm90 wherever it applies); unset or "auto": sm90 wherever it applies, at any
    size (it measured as fast as the mma.sync kernel or faster down to (1, 8, 256, 64); bench/notes/backward.md), else
    mma at head dims ≤ 128 and split above. ValueError for another value of the variable. The split backward's scores
    GEMM is the forward's kind (gemm_3xtf32.fp32_gemm under ``allow_tf32``).
    Example: (8, 16, 1024, 256) fp16 on an H100 plans sm90 with bucket 256; under CUPY_ATTN_BWD=mma it plans split;
    E = 160 plans sm90 with bucket 256 (TMA zero-fills columns 160-255).
    """
    plan = _backward_kernel(p, arch)
    if plan.kernel == "split" and p.mask is not None and \
            masked_backward_reason(p, device_arch(p) if arch is None else arch) is None:
        plan = BackwardPlan("sm90", flash_bwd_sm90.head_bucket(p.head_dim, p.head_dim_v),
                            "attn_mask as a mod in the Hopper kernel (flash_bwd_sm90_mod; the split backward where "
                            "the mask needs a gradient)", mask_as_mod=True)
    if plan.kernel == "split" and p.dtype == np.float32:  # the scores GEMM's kind (None for fp16/bf16: cuBLAS)
        arch = device_arch(p) if arch is None else arch
        plan = dataclasses.replace(plan, gemm=gemm_3xtf32.fp32_gemm(p.dtype, allow_tf32, arch))
    return plan


def _without_mask(p):
    """A shallow copy of the problem ``p`` without its attn_mask (checks.SDPAProblem, or a test's stand-in)."""
    q = copy.copy(p)
    q.mask, q.mask_kind = None, "none"
    return q


def masked_backward_reason(p, arch: int) -> str | None:
    """None when a masked call's backward runs the Hopper kernel with its attn_mask as a mod (flash_bwd_sm90_mod):
    no dropout or variants, at least MASK_FA3_MIN_PAIRS triples, CUPY_ATTN_BWD not split / mma, and the kernel takes
    the unmasked call; else why not. (A mask that needs a gradient keeps the split backward: the caller's to know.)"""
    if p.dropout_p > 0 or not variants.of(p).plain:
        return "dropout or variants with a mask"
    if env.get(ENV_BWD, "") in ("split", "mma"):
        return f"{ENV_BWD}={env.get(ENV_BWD)}"
    if p.batch * p.num_heads * p.seqlen_q * p.seqlen_k < MASK_FA3_MIN_PAIRS:
        return "small"
    return _sm90_backward_reason(_without_mask(p), arch)


def masked_backward(p):
    """The problem of a mask_as_mod backward plan (plan_backward's, ``mask_as_mod``): ``p`` without its mask and with
    it as a mod (mods.mask_as_mod), materialized now: the mask's compact copy (where it is not one already) and, for a
    bool mask, its query rows per 64-key block (the mods' pre-pass, transposed), which limit each key block's query
    blocks so that a causal mask's upper triangle and left padding are skipped; enqueued on the call's stream. (The
    forward's compact copy is not reused: the backward runs later, from the saved tensors.)"""
    bound = mods.materialize(mods.mask_as_mod(p.mask, p.mask_kind), p, ranges="backward")
    return dataclasses.replace(p, mask=None, mask_kind="none", variants=dataclasses.replace(p.variants, mod=bound))


def _mod_backward(p, var, arch: int | None) -> BackwardPlan:
    """score_mod / mask_mod: the Hopper backward kernel's mod instantiation (flash_bwd_sm90_mod: P and dS per element
    with the mod) where it takes the call, else the split backward's rows kernels with the mod (attn_bwd_rows_mod),
    the score's chain factor from score_mod_grad either way. NotImplementedError when the call also has a window,
    softcap or ALiBi (beside a mod, neither backward has them) or a score_mod without score_mod_grad."""
    other = [n for n in var.names() if not n.startswith(("score_mod", "mask_mod", "sinks"))]
    if other:
        raise NotImplementedError(f"the backward of score_mod / mask_mod has no "
                                  f"{', '.join(other)}: spell them in the mod, or call under torch.no_grad()")
    if var.mod.mod.score_mod is not None and var.mod.mod.score_mod_grad is None:
        raise NotImplementedError("the backward of a score_mod needs its derivative: pass AttentionMod("
                                  "score_mod_grad=...), the body of d score_mod / d score")
    arch = device_arch(p) if arch is None else arch
    why_not = "dropout" if p.dropout_p > 0 else _sm90_backward_reason(p, arch)
    if why_not is None and env.get(ENV_BWD, "") not in ("split", "mma"):
        return BackwardPlan("sm90", flash_bwd_sm90.head_bucket(p.head_dim, p.head_dim_v),
                            f"Hopper wgmma kernel, mod instantiation ({var.names()[-1]}: flash_bwd_sm90_mod)")
    return BackwardPlan("split", None, f"{var.names()[-1]}: the split backward's rows kernels with the mod "
                                       f"(Hopper kernel: {why_not or ENV_BWD})")


def _sm90_backward_reason(p, arch: int) -> str | None:
    """None when the Hopper backward kernel can take the call on compute capability ``arch``, else why not."""
    return f"sm_{arch}: the Hopper kernel needs sm_90a" if arch != 90 else flash_bwd_sm90.reason(p, arch)


def _backward_kernel(p, arch: int | None) -> BackwardPlan:
    setting = env.get(ENV_BWD, "")
    if setting not in _ENV_BWD_VALUES:
        raise ValueError(f"{ENV_BWD} must be one of split, mma, sm90 or auto, got {setting!r}")
    var = variants.of(p)
    if var.mod is not None:
        return _mod_backward(p, var, arch)
    if var.changes_scores:
        # Sinks alone need nothing of the kernels (lse holds the sink's term; its own gradient is autograd's). The
        # others: the Hopper kernel's variants instantiation, or nothing yet.
        arch = device_arch(p) if arch is None else arch
        why_not = _sm90_backward_reason(p, arch)
        if p.dropout_p > 0:
            why_not = "dropout (the Hopper kernel has no dropout variant)"
        if why_not is not None or setting in ("split", "mma"):
            raise NotImplementedError(
                f"the backward of {', '.join(var.names())} runs on the Hopper backward kernel only, which cannot "
                f"take this call ({why_not or f'{ENV_BWD}={setting}'}); the forward runs: pass tensors that do not "
                "require grad, or call under torch.no_grad()")
        return BackwardPlan("sm90", flash_bwd_sm90.head_bucket(p.head_dim, p.head_dim_v),
                            f"Hopper wgmma kernel, variants instantiation ({', '.join(var.names())})")
    if setting == "split":
        return BackwardPlan("split", None, f"forced by {ENV_BWD}=split")
    if p.mask is not None:
        return BackwardPlan("split", None, "attn_mask: the fused backward kernels have no mask input")
    if dtype_name(p.dtype) not in ("float16", "bfloat16"):
        return BackwardPlan("split", None, f"dtype {dtype_name(p.dtype)}: the fused backward serves fp16 and bf16")
    bucket = flash_bwd.head_dim_bucket(p.head_dim, p.head_dim_v)  # the mma.sync kernel's, None above 128
    top = max(flash_bwd_sm90.TILES)
    if max(p.head_dim, p.head_dim_v) > top:
        return BackwardPlan("split", None, f"head dims E={p.head_dim}, Ev={p.head_dim_v}: the fused backward kernels "
                                           f"serve head dims up to {top}")
    if arch is None:
        arch = device_arch(p)
    if arch < 80:
        return BackwardPlan("split", None, f"sm_{arch}: the fused backward needs sm_80 (mma.sync, cp.async)")
    no_mma = f"head dims E={p.head_dim}, Ev={p.head_dim_v}: the mma.sync kernel serves head dims up to " \
             f"{max(flash_bwd.TILES)}"
    if setting == "mma":
        return (BackwardPlan("mma", bucket, f"mma.sync kernel forced by {ENV_BWD}=mma") if bucket else
                BackwardPlan("split", None, f"{ENV_BWD}=mma and {no_mma}"))
    if p.dropout_p > 0:
        return (BackwardPlan("mma", bucket, "mma.sync kernel: dropout (the Hopper kernel has no dropout variant)")
                if bucket else BackwardPlan("split", None, f"dropout (the Hopper kernel has none) and {no_mma}"))
    why_not = _sm90_backward_reason(p, arch)
    if why_not is None:
        sm90_bucket = flash_bwd_sm90.head_bucket(p.head_dim, p.head_dim_v)
        if setting == "sm90":
            return BackwardPlan("sm90", sm90_bucket, f"Hopper wgmma kernel forced by {ENV_BWD}=sm90")
        return BackwardPlan("sm90", sm90_bucket, "Hopper wgmma kernel (TMA, warp-specialized, FlashAttention-3 design)")
    if bucket is None:
        return BackwardPlan("split", None, f"{no_mma}; Hopper kernel not used: {why_not}")
    return BackwardPlan("mma", bucket, f"mma.sync kernel; Hopper kernel not used: {why_not}")
