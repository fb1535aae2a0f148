"""Per-call choice of the attention path: fused kernel, split path (cuBLAS + softmax kernel), or float64 reference.

The decision is a pure function of the checked problem and the device's compute capability, so it can be printed
(``cupy_attn.explain``) and tested on a machine without a GPU. ``CUPY_ATTN_BACKEND`` (fused | split | reference)
overrides ``backend="auto"`` for debugging, on GPU calls only: CPU inputs always run the reference.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from ..runtime import env
from . import gemm_3xtf32
from . import split as _split

ENV_BACKEND = "CUPY_ATTN_BACKEND"
_CPU_NAMES = {"numpy": "NumPy", "torch_cpu": "CPU torch"}


@dataclasses.dataclass
class Plan:
    """What one call will run, and why. ``details`` is computed when read (explain), not on every call."""

    backend: str                       # "fused" | "decode" | "split" | "reference"
    reason: str
    num_splits: int | None = None      # decode: the key splits it launches
    describe: Callable[[], dict] | None = dataclasses.field(default=None, repr=False)
    copies: list = dataclasses.field(default_factory=list)
    # prepare(out, lse) -> run(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, mask_ptr): the launch this plan chose, built on
    # the checked problem without checking or deciding anything again (None for the reference path).
    prepare: Callable | None = dataclasses.field(default=None, repr=False)

    @property
    def details(self) -> dict:
        return self.describe() if self.describe is not None else {}

    def __str__(self) -> str:
        lines = [f"backend: {self.backend}", f"why: {self.reason}"]
        lines += [f"{k}: {v}" for k, v in self.details.items()]
        lines += [f"copy: {c}" for c in self.copies]
        return "\n".join(lines)


def _flash_module():
    try:
        from . import fused as _flash
    except ImportError:  # the fused family is not part of this build
        return None
    return _flash


def fused_unsupported_reason(p, arch: int) -> str | None:
    """None when the fused kernel can run ``p`` on compute capability ``arch``, else why not."""
    flash = _flash_module()
    if flash is None:
        return "the fused kernel is not available in this build"
    return flash.unsupported_reason(p.dtype, p.head_dim, p.head_dim_v, p.mask_kind, arch)


def device_arch(p) -> int:
    """Compute capability of the call's device as an int (90 for an H200); 0 on the CPU path."""
    if not p.ctx.on_gpu:
        return 0
    import cupy
    return int(cupy.cuda.Device(p.ctx.device_id).compute_capability)


def prefer_fused(p) -> tuple[bool, str]:
    """Auto rule between the two GPU paths for a call both can run.

    The split path's cost is its two GEMMs plus one pass over an L×S fp32 score buffer (12 bytes per score: write fp32,
    read fp32, write P, read P); the fused kernel moves no scores but runs its GEMMs below cuBLAS's rate. Measured on
    an H200 (bench/RESULTS.md, 2026-11-21, session 3: sm_90a wgmma kernel, call cache), B=4, H=16, L=S=2048, whole
    calls fused vs split in ms: fp16 D=64 0.27 vs 0.92, D=128 0.39 vs 0.95, D=256 0.68 vs 1.03; bf16 D=64 0.30 vs
    0.92, D=128 0.39 vs 0.95, D=256 0.68 vs 1.01. The closest case, D=256, is 1.5x in favour of the fused kernel (the
    mma.sync kernel alone, the sm_8x path, measured 1.14 vs 1.24 ms in session 2: still 8% ahead), so auto takes it
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
    ``allow_tf32`` configure the split path's launch (``Plan.prepare``).
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
    fused_why_not = fused_unsupported_reason(p, arch)
    if p.dropout_p > 0 and num_splits is not None:
        raise ValueError(f"num_splits={num_splits} asks for the decode kernel, which has no dropout (dropout_p="
                         f"{p.dropout_p}): pass num_splits=None")
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
        return _fused_plan(p, arch, f"fused {forced}", copies)
    if backend == "auto" and fused_why_not is None:
        use_fused, why = prefer_fused(p)
        if use_fused:
            return _fused_plan(p, arch, why, copies)
    reason = f"split {forced}" if backend == "split" else f"split path: {fused_why_not}"
    if p.dropout_p > 0:
        reason += f"; dropout_p={p.dropout_p} applied by the softmax kernel (P written dropped and scaled)"
    return Plan("split", reason, describe=functools.partial(split_details, p, arch, allow_tf32), copies=copies,
                prepare=functools.partial(_split.prepare, p, workspace_bytes=workspace_bytes, allow_tf32=allow_tf32))


def _d512_plan(p, backend: str, arch: int, forced: str, copies, num_sms: int | None) -> Plan | None:
    """The head-dim 257-512 fused kernel's plan (fused_d512) when it can run the call and is chosen: by
    backend="fused", by CUPY_ATTN_D512=1, or under auto by fused_d512.prefer_grid; never with CUPY_ATTN_D512=0."""
    from . import fused_d512 as _d512
    setting = _d512.enabled()
    if setting == "0" or _d512.unsupported_reason(p.dtype, p.head_dim, p.head_dim_v, p.mask_kind, arch, p.scale):
        return None
    if backend == "fused":
        why = f"fused {forced}: the head-dim-512 kernel"
    elif setting == "1":
        why = f"{_d512.ENV}=1: the head-dim-512 kernel"
    else:
        if num_sms is None:
            from ..runtime.interop import device_sms
            num_sms = device_sms(p.ctx.device_id)
        take, why = _d512.prefer_grid(p.batch, p.num_heads, p.seqlen_q, p.seqlen_k, num_sms)
        if not take:
            return None
    if p.query is not None and _d512.layout_reason(p.query, p.key, p.value, None):
        return None
    return Plan("fused", why, describe=functools.partial(_d512.details, p), copies=copies,
                prepare=functools.partial(_d512.prepare_problem, p))


def _decode_plan(p, backend: str, arch: int, num_splits: int | None, num_sms: int | None, copies) -> Plan | None:
    """The decode plan when the split-KV kernel takes this fused-eligible call, else None: under backend="auto" by
    decode.prefer_decode, or whenever the caller passed num_splits (auto or fused); never with CUPY_ATTN_DECODE=0."""
    from . import decode as _decode
    if not _decode.enabled() or (backend == "fused" and num_splits is None):
        return None
    if _decode.unsupported_reason(p.dtype, p.head_dim, p.head_dim_v, p.mask_kind, arch) is not None:
        return None
    if num_splits is None:
        take, why = _decode.prefer_decode(p.seqlen_q, p.seqlen_k, p.groups)
        if not take:
            return None
    else:
        why = f"num_splits={num_splits} requested"
    if num_sms is None:
        num_sms = _decode.device_sms(p.ctx.device_id)
    head_dim = _decode.head_dim_bucket(p.head_dim, p.head_dim_v)
    S = max(p.seqlen_k, 1)
    choice = _decode.choose_kernel(head_dim, arch, p.key, p.value, num_sms=num_sms, grid_ctas=_decode.launch_ctas(
        p.batch, p.num_kv_heads, p.seqlen_q, p.groups, S, num_sms, num_splits))
    n, chunk = _decode.split_plan(p.batch, p.num_kv_heads, p.seqlen_q, p.groups, S, head_dim, arch, num_sms,
                                  num_splits, choice.tile.block_n)
    details = {"kernel": choice.family.name, "head-dim bucket": head_dim, "tile": choice.describe(),
               "packed rows": f"{p.seqlen_q} query rows x {p.groups} heads per K/V head",
               "splits": f"{n} of {chunk} keys" + (" (auto)" if num_splits is None else f" ({num_splits} requested)")}
    return Plan("decode", f"decode (split-KV, {n} splits): {why}", describe=lambda: details, copies=copies,
                num_splits=n, prepare=functools.partial(_decode.prepare_problem, p, num_splits, choice))


def _fused_plan(p, arch: int, why: str, copies: list) -> Plan:
    """The fused plan with its kernel choice (family, tile, instantiated head dim) made once, here."""
    flash = _flash_module()
    if p.dropout_p > 0:  # only the mma.sync kernel has a dropout variant (it runs on Hopper too)
        choice = flash.select(p.dtype, flash.head_dim_bucket(p.head_dim, p.head_dim_v), arch, dropout=True)
        extra = {"dropout": f"p={p.dropout_p}: the mma.sync kernel's dropout variant (the FA3-design, wgmma and "
                            "decode kernels have no dropout)"}
        return Plan("fused", why, describe=functools.partial(fused_details, choice, extra), copies=copies,
                    prepare=functools.partial(flash.prepare_problem, p, choice))
    mode = fa3_mode(p, arch)
    if mode is not None and p.mask is None:
        # out=None: the call's output comes from the allocator, contiguous and aligned.
        why_not = flash.fa3_reason(p.query, p.key, p.value, None, scale=p.scale, arch=arch)
        if why_not is None:
            bucket = _fa3_bucket(p.head_dim, p.head_dim_v)
            return Plan("fused", why, describe=functools.partial(fa3_details, bucket, mode, p.causal is not None), copies=copies,
                        prepare=functools.partial(flash.prepare_problem, p, ("fa3", mode)))
        fa3 = {"FA3 kernel": f"not used: {why_not}"}
    else:
        fa3 = {}
    choice = flash.select(p.dtype, flash.head_dim_bucket(p.head_dim, p.head_dim_v), arch)
    return Plan("fused", why, describe=functools.partial(fused_details, choice, fa3), copies=copies,
                prepare=functools.partial(flash.prepare_problem, p, choice))


# Below this many FLOPs (4·B·H·L·S·D) auto keeps the wgmma kernel for Hopper calls the FA3-design kernel could take:
# the FA3 launch encodes three TMA tensor maps per call (~12 µs of host time through cuda.bindings, measured on the
# H200 host), which a small call would pay in full; at 2^34 FLOPs (~30 µs of kernel time) it hides behind the queue.
FA3_MIN_FLOPS = 2 ** 34


def fa3_mode(p, arch: int) -> str | None:
    """"1" (FA3 kernel), "2" (FA3 with intra-warpgroup overlap), "3" ("2" as a persistent kernel) or None
    (flash_fwd.cu) for a call on ``arch``.

    CUPY_ATTN_FA3=0 turns it off, 1, 2 or 3 force it for every call it can take; unset (auto), on Hopper for calls of
    at least FA3_MIN_FLOPS: "3". Measured on an H200 (session 7, bench/experiments/flash_fwd/fa3_fwd.py, fp16, rounds back to
    back; "3" against "2", 128-row tiles): (8,16,2048,128) 1.017x, (2,16,8192,128) causal 1.018x, (8,16,1024,256)
    1.019x, (1,16,4096,128) causal 1.163x, (16,16,1024,64) 1.024x, (4,32,4096,64) 0.947x; "2" itself is 1.2-1.9x the
    wgmma kernel. Non-causal head dim 64 runs the 192-row tile (fused_sm90.tile_for), where "3" measured 0.99x "2" at
    (4,32,4096,64) and 1.03-1.06x at (8,16,2048,64) and (16,16,1024,64) (session 9, bench/experiments/flash_fwd/m192_ab.py).
    """
    mode = env.get("CUPY_ATTN_FA3")
    if mode in ("1", "2", "3"):
        return mode
    if mode == "0" or arch != 90:
        return None
    flops = 4.0 * p.batch * p.num_heads * p.seqlen_q * p.seqlen_k * max(p.head_dim, p.head_dim_v)
    if flops < FA3_MIN_FLOPS:
        return None
    return "3"


def fa3_details(head_dim: int, mode: str, causal: bool = False) -> dict:
    """The FA3-design kernel's configuration (mode "1", "2" or "3", see fa3_mode)."""
    tile = _fa3_tile(head_dim, mode, causal)
    variant = "overlap, persistent" if tile.persistent else "overlap" if tile.overlap else "ping-pong"
    return {"head-dim bucket": head_dim,
            "kernel": f"flash_fwd_sm90_tma ({variant})",
            "tile": f"{tile.block_m}x{tile.block_n}, producer + {tile.block_m // 64} consumer warpgroups, "
                    f"{tile.stages} K/V stages, TMA + wgmma" + (", intra-warpgroup overlap" if tile.overlap else "")
                    + (", persistent (one CTA per SM)" if tile.persistent else ""),
            "epilogue": "out through shared memory by TMA stores (4-byte stores where head_dim_v is not a multiple "
                        "of 8 or out's strides or base are not 16-byte aligned)"}


def fused_details(choice, extra: dict | None = None) -> dict:
    """The instantiation the fused kernel will use: (family, tile, head dim) from fused.select."""
    family, tile, head_dim = choice
    return {**(extra or {}), "head-dim bucket": head_dim, "kernel": family.name,
            "tile": f"{tile.block_m}x{tile.block_n}, {tile.warps} warps, {tile.stages} K/V stage(s)"
                    + (", wgmma" if tile.wgmma else ", mma.sync")}


def _fa3_bucket(head_dim: int, head_dim_v: int) -> int:
    from . import fused_sm90
    return fused_sm90.head_bucket(head_dim, head_dim_v)


def _fa3_tile(head_dim: int, mode: str, causal: bool):
    from . import fused_sm90
    return fused_sm90.tile_for(mode, head_dim, causal)


def split_details(p, arch: int | None = None, allow_tf32: bool = False) -> dict:
    """The split path's schedule as split.prepare will run it: the scores kernel and its P buffer, or the chunking of
    the fp32 score buffer, and the GEMMs (for fp32: gemm_3xtf32.fp32_gemm's choice under ``allow_tf32``). ``arch``:
    the plan's compute capability; None: the call's device's."""
    if arch is None:
        arch = device_arch(p)
    gemm_kind = gemm_3xtf32.fp32_gemm(p.dtype, allow_tf32, arch)
    gemm_name = {None: "cuBLAS", "tf32": "cuBLAS TF32", "sgemm": "cuBLAS SGEMM",
                 "3xtf32": "3xTF32 (gemm_3xtf32)"}[gemm_kind]
    ld = -(-p.seqlen_k // 8) * 8
    per_item = p.seqlen_q * ld * 4
    budget = _split.workspace_bytes_default()
    why_not = _split.fused_reason(p, budget, arch)
    if why_not is None:
        from . import scores_sm90
        tile = scores_sm90.tile_for(p.seqlen_k, masked=p.mask is not None)
        ld_p = -(-p.seqlen_k // 8) * 8
        variant = scores_sm90.setting()
        kernel = scores_sm90.MASKED_KERNEL if p.mask is not None else scores_sm90.KERNELS[variant]
        pv_why = _split.pv_reason(p)
        pv = "cuBLAS P·V" if pv_why is not None else "pv_sm90 P·V (TMA + wgmma, each row block to its visible keys)"
        return {
            "schedule": f"{kernel} (Q·Kᵀ + softmax in the epilogue, TMA + wgmma) → {pv} "
                        f"({scores_sm90.ENV_SPLIT_FUSED}={variant})",
            "scores kernel": f"64 rows x {2 * tile.half_n} keys per CTA, {tile.stages} TMA stages"
                             + {2: ", clusters of 2 CTAs sharing K by TMA multicast",
                                3: ", persistent: one CTA per SM walks its row blocks"}.get(variant, ""),
            "P buffer": _p_buffer_detail(p, budget, ld_p),
            **({"attn_mask": f"{p.mask_kind}, varies only along the keys: added in the scores kernel's epilogue "
                             f"({scores_sm90.MASKED_KERNEL})"} if p.mask is not None else {}),
            **({"causal": f"{p.causal}: row blocks past the diagonal skip their wgmma; " + (
                "P·V by pv_sm90, each 64-row block stopping at its last visible key (rounded up to 64)"
                if pv_why is None else f"P·V in {_split.causal_row_bands(p.seqlen_q)} cuBLAS row bands, each "
                f"stopping at its last visible key ({pv_why})")} if p.causal is not None else {}),
        }
    return {
        "schedule": f"{gemm_name} Q·Kᵀ (fp32 scores) → softmax kernel → {gemm_name} P·V",
        "GEMMs": gemm_3xtf32.DESCRIPTIONS[gemm_kind],
        "scores kernel": f"not used: {why_not}",
        "scores buffer": f"fp32, {p.seqlen_q}x{p.seqlen_k} (pitch {ld}) per head, {per_item / 2**20:.1f} MiB each",
        "workspace budget": f"{budget / 2**20:.0f} MiB (CUPY_ATTN_WORKSPACE_BYTES)",
        "softmax tile": "threads/row, vec4 per thread = %s" % (_split.softmax_tile(
            p.seqlen_k, p.mask is not None or p.causal is not None or p.dropout_p > 0),),
    } | ({"dropout": f"p={p.dropout_p}: P written as P∘Z/(1−p) by the softmax kernel"} if p.dropout_p > 0 else {}) \
      | ({"causal": _cublas_bands_detail(p, budget)} if p.causal is not None else {})


def _p_buffer_detail(p, budget: int, ld_p: int) -> str:
    """The scores kernel's P buffer: all batch·heads in one, or one batch chunk at a time (split.scores_batch_chunk)."""
    per_head = f"{p.dtype.name}, {p.seqlen_q}x{p.seqlen_k} (pitch {ld_p}) per head"
    mib = _split.p_bytes_per_batch(p) / 2**20  # one batch's heads
    n = _split.scores_batch_chunk(p, budget)
    if n >= p.batch:
        return f"{per_head}, all heads in one buffer of {p.batch * mib:.0f} MiB"
    return (f"{per_head}; all heads would take {p.batch * mib:.0f} MiB, over the {budget / 2**20:.0f} MiB workspace "
            f"budget: chunks of {n} batches ({n * mib:.0f} MiB), each one scores launch and its P·V GEMMs")


def _cublas_bands_detail(p, budget: int) -> str:
    """How a causal call on the cuBLAS split path is banded (split._build_schedule's rule)."""
    bands = _split.cublas_causal_bands(p.seqlen_q)
    streams = _split.band_streams(p.seqlen_q, p.seqlen_k, bands, budget)
    return (f"{p.causal}: {bands} row band(s), each band's Q·Kᵀ, softmax and P·V stopping at its last visible key"
            + (f", on {streams} streams at once" if streams > 1 else ""))
