"""Per-call choice of the attention path: fused kernel, split path (cuBLAS + softmax kernel), or float64 reference.

The decision is a pure function of the checked problem and the device's compute capability, so it can be printed
(``cupy_attn.explain``) and tested on a machine without a GPU. ``CUPY_ATTN_BACKEND`` (fused | split | reference)
overrides ``backend="auto"`` for debugging, on GPU calls only: CPU inputs always run the reference.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

from . import split as _split

ENV_BACKEND = "CUPY_ATTN_BACKEND"
_CPU_NAMES = {"numpy": "NumPy", "torch_cpu": "CPU torch"}


@dataclasses.dataclass
class Plan:
    """What one call will run, and why. ``details`` is computed when read (explain), not on every call."""

    backend: str                       # "fused" | "split" | "reference"
    reason: str
    describe: Callable[[], dict] | None = dataclasses.field(default=None, repr=False)
    copies: list = dataclasses.field(default_factory=list)

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


def plan_sdpa(p, backend: str, arch: int | None = None) -> Plan:
    """Choose the path for a checked problem (see checks.SDPAProblem).

    CPU inputs (NumPy, CPU torch) always run the reference: backend="fused" or "split" with them is a ValueError, and
    CUPY_ATTN_BACKEND is ignored for them (it overrides ``backend="auto"`` on GPU calls only). On the GPU, ValueError
    when a forced path cannot run the call.
    """
    copies = list(p.copies)
    if not p.ctx.on_gpu:  # CUPY_ATTN_BACKEND is not read here: it overrides GPU calls only
        if backend in ("fused", "split"):
            raise ValueError(f"backend={backend!r} needs CUDA inputs: {_CPU_NAMES.get(p.ctx.kind, p.ctx.kind)} inputs "
                             f"run only the float64 reference (pass backend='auto' or 'reference')")
        return Plan("reference", f"{p.ctx.kind} inputs run the float64 NumPy reference on the CPU", copies=copies)
    arch = device_arch(p) if arch is None else arch
    requested = backend
    if backend == "auto" and os.environ.get(ENV_BACKEND):
        backend = os.environ[ENV_BACKEND]
        if backend not in ("fused", "split", "reference"):
            raise ValueError(f"{ENV_BACKEND} must be fused, split or reference, got {backend!r}")
    forced = f"forced by {ENV_BACKEND}" if requested == "auto" and backend != "auto" else "requested"
    if backend == "reference":
        return Plan("reference", f"reference {forced}: float64 NumPy on the host (slow, for checking)", copies=copies)
    fused_why_not = fused_unsupported_reason(p, arch)
    if backend == "fused":
        if fused_why_not:
            raise ValueError(f"backend='fused' cannot run this call: {fused_why_not}")
        return Plan("fused", f"fused {forced}", describe=functools.partial(fused_details, p, arch), copies=copies)
    if backend == "auto" and fused_why_not is None:
        use_fused, why = prefer_fused(p)
        if use_fused:
            return Plan("fused", why, describe=functools.partial(fused_details, p, arch), copies=copies)
    reason = f"split {forced}" if backend == "split" else f"split path: {fused_why_not}"
    return Plan("split", reason, describe=functools.partial(split_details, p), copies=copies)


def fused_details(p, arch: int) -> dict:
    """The instantiation the fused kernel will use."""
    flash = _flash_module()
    family, tile, head_dim = flash.select(p.dtype, flash.head_dim_bucket(p.head_dim, p.head_dim_v), arch)
    return {"head-dim bucket": head_dim, "kernel": family.name,
            "tile": f"{tile.block_m}x{tile.block_n}, {tile.warps} warps, {tile.stages} K/V stage(s)"
                    + (", wgmma" if tile.wgmma else ", mma.sync")}


def split_details(p) -> dict:
    """Chunking of the split path's score buffer, as split_forward will do it."""
    ld = -(-p.seqlen_k // 8) * 8
    per_item = p.seqlen_q * ld * 4
    budget = _split.workspace_bytes_default()
    return {
        "scores buffer": f"fp32, {p.seqlen_q}x{p.seqlen_k} (pitch {ld}) per head, {per_item / 2**20:.1f} MiB each",
        "workspace budget": f"{budget / 2**20:.0f} MiB (CUPY_ATTN_WORKSPACE_BYTES)",
        "softmax tile": "threads/row, vec4 per thread = %s" % (_split.softmax_tile(p.seqlen_k, p.mask is not None or p.causal is not None),),
    }
