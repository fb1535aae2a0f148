"""The fused forward for head dims 257-512 on Hopper (cuda_src/attention/flash_fwd_d512_sm90.cu): issue 14's route (b).

FlashAttention's online softmax with FlashAttention-3's TMA producer and two wgmma consumers that split the work of one
64-row block: each computes S for half of a 256-key block over the whole head dim and owns half of O's 512 columns;
P passes through shared memory. No L × S score buffer, and causal calls skip the key blocks above the diagonal (the
split path computes them).

It takes the same parameter struct and launch as the head-dim ≤ 256 kernel (flash_fwd_sm90.PARAMS,
flash_fwd_sm90.build_launch), with its own boxes: Q (64 columns, 64 rows), K (64, 256), V (64, 32).

The plan (dispatch.plan_sdpa): ``CUPY_ATTN_D512=1`` takes it for every call it can serve, ``0`` never; unset, auto
takes it where :func:`prefer_grid` says so (S > 512 and a grid that fills the device).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...runtime import env
from ...runtime.compile import KernelFamily
from ...runtime.interop import device_sms, dtype_name
from ...runtime.kernel_abi import C_TYPE_16, set_strides
from ...runtime.launch import PreparedLaunch
from ...runtime.tma import MapSpec, exp2_tma_reason, out_16b_reason
from .. import mods, variants
from . import flash_fwd_sm90 as _sm90

ENV = "CUPY_ATTN_D512"
BLOCK_M, BLOCK_N, HEAD_DIM, V_KEYS, STAGES = 64, 256, 512, 32, 4
THREADS = 384


def smem_bytes(stages: int = STAGES) -> int:
    """Q (64 × 512) + P (64 × 256) 16-bit tiles, stages × 32 KB, 2·stages + 2 barriers, row statistics (3 × 2 × 64
    floats), 1 KB of alignment slack: 232,016 bytes at four stages (SharedStorage::kBytes)."""
    return BLOCK_M * HEAD_DIM * 2 + BLOCK_M * BLOCK_N * 2 + stages * 32768 + 8 * (2 * stages + 2) + 4 * 6 * BLOCK_M + 1024


FLASH_FWD_D512_SM90 = KernelFamily(
    name="flash_fwd_d512_sm90",
    source="attention/flash_fwd_d512_sm90.cu",
    template="cupy_attn::flash_fwd_d512_sm90<{dtype}, {stages}, {persistent}, {variants}>",
    axes={"dtype": tuple(C_TYPE_16.values()), "stages": (STAGES,), "persistent": ("false", "true"),
          "variants": ("false", "true")},
    # The variants run one tile per CTA: the persistent kernel, at its 240-register limit, spilled with them.
    where=lambda row: row["variants"] == "false" or row["persistent"] == "false",
    archs=("sm_90a",),
    structs=(("cupy_attn::FlashFwdSm90Params", _sm90.PARAMS),),
    arch="sm_90a",
)


def reason(p, arch: int) -> str | None:
    """None when this kernel can serve the call ``p`` (an SDPAProblem, or anything with its dtype, head dims,
    mask_kind and scale): its kind, and the layout of its arrays where it has them (:func:`layout_reason`).

    >>> import types
    >>> kind = lambda E, scale: types.SimpleNamespace(dtype=np.dtype("float16"), head_dim=E, head_dim_v=E,
    ...                                                mask_kind="none", scale=scale)
    >>> reason(kind(320, 0.05), 90) is None, reason(kind(1024, 0.03), 90)
    (True, 'head dims E=1024, Ev=1024: the head-dim-512 kernel serves 257-512 (Ev a multiple of 8)')
    """
    head_dim, head_dim_v = p.head_dim, p.head_dim_v
    if arch != 90:
        return f"sm_{arch}: the head-dim-512 kernel needs sm_90a (H100/H200)"
    if dtype_name(p.dtype) not in C_TYPE_16:
        return f"dtype {dtype_name(p.dtype)}: the head-dim-512 kernel serves fp16 and bf16"
    if not (256 < max(head_dim, head_dim_v) and head_dim <= HEAD_DIM and head_dim_v <= HEAD_DIM
            and head_dim_v % 8 == 0):
        return f"head dims E={head_dim}, Ev={head_dim_v}: the head-dim-512 kernel serves 257-512 (Ev a multiple of 8)"
    if p.mask_kind != "none":
        return "attn_mask: the head-dim-512 kernel has no mask input (causal only)"
    if variants.of(p).softcap is not None:
        return "softcap: not in the head-dim-512 kernel (its two SFU operations per score made it spill)"
    why = exp2_tma_reason("the head-dim-512 kernel", p.scale)
    if why is not None or getattr(p, "query", None) is None:  # a plan made without arrays: the layout is not known
        return why
    return layout_reason(p.query, p.key, p.value, None)


def layout_reason(q, k, v, out) -> str | None:
    """flash_fwd_sm90.layout_reason (TMA reads q, k, v in place), and out's rows 16-byte aligned (16-byte stores;
    out=None: allocated by the call, contiguous)."""
    why = _sm90.layout_reason(q, k, v, None)
    if why is not None or out is None:
        return why
    return out_16b_reason(out)


def enabled() -> str | None:
    """CUPY_ATTN_D512: "1" (every call it can serve), "0" (never), None (auto)."""
    value = env.get(ENV)
    if value not in (None, "0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value


def prefer_grid(B: int, Hq: int, L: int, S: int, num_sms: int) -> tuple[bool, str]:
    """Auto rule between this kernel and the split path for a call both can run: this kernel when L ≥ 128, S > 512 and
    its grid (⌈L / 64⌉ · Hq · B CTAs, one per SM) fills the device at least once. At S ≤ 512 the split path runs the
    scores kernel (whole score rows on chip, cuBLAS P·V), which measured faster; below one wave of CTAs the split
    path's GEMMs spread the call wider (not measured). Example, 132 SMs: (4, 16, 2048, 2048, 512) has 32 · 16 · 4 =
    2048 CTAs and S > 512: this kernel (measured 1.4-1.5x the split path there, 1.7x causal; bench/notes/split.md);
    (128, 16, 256, 256, 512) has S = 256: the split path (its scores kernel measured faster there).

    >>> prefer_grid(4, 16, 2048, 2048, 132)[0], prefer_grid(1, 2, 300, 700, 132)[0], prefer_grid(128, 16, 256, 256, 132)[0]
    (True, False, False)
    """
    ctas = -(-L // BLOCK_M) * Hq * B
    if L < 2 * BLOCK_M:
        return False, (f"L = {L} < {2 * BLOCK_M}: the head-dim-512 kernel's 64-row blocks would be mostly padding "
                       "(decode-like calls stay on the split path; not measured)")
    if S <= 512:
        return False, f"S = {S} <= 512: the split path's scores kernel holds whole rows (faster there, measured)"
    if ctas >= num_sms:
        return True, (f"head-dim-512 fused kernel: {ctas} CTAs fill the {num_sms} SMs (1.17-1.84x the split path at "
                      "head dims 320-512, measured)")
    return False, f"{ctas} CTAs of the head-dim-512 kernel would not fill the {num_sms} SMs"


def grid_for(B: int, Hq: int, L: int, causal: bool, persistent: bool, num_sms: int) -> tuple[tuple, bool]:
    """(grid, tile_pairs): one tile per CTA, or min(SMs, units) persistent CTAs over sm90/tile_scheduler.cuh's units
    (causal calls with more tiles than SMs pair the m-blocks (M−1−k, k) of a head).

    >>> grid_for(4, 16, 2048, False, True, 132), grid_for(2, 8, 4096, True, True, 132)
    (((132, 1, 1), False), ((132, 1, 1), True))
    >>> grid_for(1, 1, 300, True, True, 132)
    ((5, 1, 1), False)
    >>> grid_for(2, 8, 4096, True, False, 132)
    ((64, 8, 2), False)
    """
    m_blocks = -(-L // BLOCK_M)
    if not persistent:
        return (m_blocks, Hq, B), False
    pairs = causal and m_blocks * Hq * B > num_sms
    units = Hq * B * (-(-m_blocks // 2) if pairs else m_blocks)
    return (min(num_sms, units), 1, 1), pairs


class Choice(NamedTuple):
    """What a call runs: the family (FLASH_FWD_D512_SM90, or a copy with other NVRTC options: A/B runs), whether its
    CTAs are persistent (the default; False: one tile per CTA, the baseline row of bench/experiments/d512), and
    whether it is the variants' instantiation (window, ALiBi, sinks; one tile per CTA: :func:`choose`)."""
    family: KernelFamily = FLASH_FWD_D512_SM90
    persistent: bool = True
    variants: bool = False


def mod_family(bound):
    """This kernel with a user's mods appended (attention/mods.py): flash_fwd_d512_sm90_mod, one tile per CTA with
    the variants' code; ModParams<FlashFwdSm90Params, Mod> (64-byte aligned)."""
    return mods.mod_family(FLASH_FWD_D512_SM90, "cupy_attn::flash_fwd_d512_sm90_mod<{dtype}, {stages}, {mod}>",
                           "cupy_attn::ModParams<cupy_attn::FlashFwdSm90Params, {mod}>",
                           mods.mod_params_dtype(_sm90.PARAMS, bound.spec, align=64), bound.mod, bound.spec,
                           {"dtype": tuple(C_TYPE_16.values()), "stages": (STAGES,)}, "flash_fwd_d512_sm90_mod")


def choose(p) -> Choice:
    """The plan's choice: persistent CTAs, or for a call with variants their one-tile-per-CTA instantiation."""
    return Choice() if variants.of(p).plain else Choice(persistent=False, variants=True)


def build(p, choice: Choice, out, lse) -> PreparedLaunch:
    """The launch for a checked problem accepted by :func:`reason` and :func:`layout_reason` (out as allocated by the
    call), replayed as flash_fwd_sm90.build_launch's. Persistent CTAs walk the tiles of sm90/tile_scheduler.cuh:
    causal calls with more tiles than SMs in m-block pairs (M−1−k, k) of equal cost; one tile per CTA otherwise, causal
    row blocks longest first (bench/notes/split.md has the measurements behind both)."""
    q, k, v = p.query, p.key, p.value
    B, Hq, L, E = q.shape
    _, Hkv, S, Ev = v.shape
    import cupy
    bound = variants.of(p).mod
    if bound is not None:  # a user's mods: their one-tile-per-CTA instantiation, the aux after the fields
        if bound.mask_source is not None:
            bound = mods.materialize(bound, p)
        fam = mod_family(bound)
        kernel = fam.kernel(dtype=C_TYPE_16[dtype_name(q.dtype)], stages=STAGES)
        prm = np.zeros((), dtype=fam.structs[0][1])
        mods.fill_aux(prm, bound, Hq, key_ranges=True)
    else:
        kernel = choice.family.kernel(dtype=C_TYPE_16[dtype_name(q.dtype)], stages=STAGES,
                                      persistent="true" if choice.persistent else "false",
                                      variants="true" if choice.variants else "false")
        prm = np.zeros((), dtype=_sm90.PARAMS)
    prm["seqlen_q"], prm["seqlen_k"], prm["head_dim_v"], prm["groups"] = L, S, Ev, Hq // Hkv
    _sm90.set_variant_params(prm, p)
    prm["batch"], prm["num_heads"] = B, Hq
    set_strides(prm, ("out", out, "bhl"), ("lse", lse, "bhl"))
    maps = (MapSpec.of(q, BLOCK_M), MapSpec.of(k, BLOCK_N), MapSpec.of(v, V_KEYS))
    grid, prm["tile_pairs"] = grid_for(B, Hq, L, bool(prm["is_causal"]), choice.persistent,
                                       device_sms(cupy.cuda.Device().id))
    launch = _sm90.build_launch(kernel, prm, maps, grid, (THREADS,), smem_bytes())
    launch.info["mod"] = bound  # the aux arrays and key ranges it reads, alive as long as the launch
    return launch


def describe(choice: Choice, p) -> dict:
    """The plan's details of a call on this kernel (explain())."""
    return {"kernel": choice.family.name + (" (variants: one tile per CTA)" if choice.variants else ""),
            "tile": f"{BLOCK_M} rows x {BLOCK_N}-key blocks, head dim padded to {HEAD_DIM}; two consumer warpgroups "
                    f"(S split by keys, O by columns, P through shared memory), {STAGES} x 32 KB TMA stages",
            "causal": "key blocks above the diagonal skipped" if p.causal else "none"}
