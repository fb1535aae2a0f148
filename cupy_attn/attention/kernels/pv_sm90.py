"""out = P V on Hopper for the split path's scores kernel, skipping the keys past each row block's causal limit
(cuda_src/attention/pv_sm90.cu).

    out (B, Hq, L, Ev) = P (B, Hq, L, S) · V (B, Hkv, S, Ev)     fp16/bf16, fp32 accumulation

P is the scores kernel's output (scores_sm90.prepare: packed by (batch, query head), rows ``ld`` elements apart, 0
past each row's causal limit); V is read in place through a 4-D tensor map (GQA by head index); out by 16-byte stores.
A persistent wgmma GEMM (TMA producer + two consumer warpgroups, tiles of 128 rows × 256 columns, 64 keys a stage)
whose 64-row blocks each multiply only the 64-key steps holding their visible keys, one launch for all batch·heads.
The split path uses it in place of cuBLAS's P·V (row bands, for causal calls) after the scores kernel where
:func:`reason` allows (``CUPY_ATTN_SPLIT_PV``: :func:`setting`); :func:`build` prepares its launch.
"""
from __future__ import annotations

import numpy as np

from ...runtime import env
from ...runtime.compile import KernelFamily
from ...runtime.interop import device_sms, dtype_name
from ...runtime.kernel_abi import C_TYPE_16, set_strides
from ...runtime.launch import Maps, PreparedLaunch, Step
from ...runtime.tma import I64, MAP, MapSpec, c_struct, out_16b_reason, tma_operand_reason

THREADS = 384         # a producer warpgroup and two consumer warpgroups
BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
STAGES = 4
ENV = "CUPY_ATTN_SPLIT_PV"

# PvSm90Params (cuda_src/attention/pv_sm90.cu), declared once here.
_PARAMS = c_struct([("tma_p", MAP, 64), ("tma_v", MAP, 64)]
                   + [(n, I64, 8) for n in (
                       "out", "out_stride_b", "out_stride_h", "out_stride_l", "seqlen_q", "seqlen_k", "head_dim_v",
                       "groups", "num_heads", "batch", "is_causal", "causal_offset")])

PV_SM90 = KernelFamily(
    name="pv_sm90",
    source="attention/pv_sm90.cu",
    template="cupy_attn::pv_sm90<{dtype}, {stages}>",
    axes={"dtype": tuple(C_TYPE_16.values()), "stages": (STAGES,)},
    archs=("sm_90a",),
    structs=(("cupy_attn::PvSm90Params", _PARAMS),),
    arch="sm_90a",
)


def smem_bytes(stages: int = STAGES) -> int:
    """stages × (P 128 × 64 + V 64 × 256 16-bit tiles = 48 KB), two barriers a stage, 1 KB of alignment slack
    (SharedStorage::kBytes): 197,696 bytes at four stages."""
    return stages * (BLOCK_M * BLOCK_K + BLOCK_K * BLOCK_N) * 2 + 16 * stages + 1024


def setting() -> int:
    """``CUPY_ATTN_SPLIT_PV``: 0 (cuBLAS P·V always), 2 (this kernel for every call on the scores kernel it can
    serve), 1 (the default, unset or any other value: causal calls, and the others where :func:`prefer` says so)."""
    return {"0": 0, "2": 2}.get(env.get(ENV, "1"), 1)


def prefer(rows: int, seqlen_k: int, head_dim_v: int) -> bool:
    """Calls without a causal mask: True where this kernel beats the split path's tuned cuBLAS P·V. rows: B·Hq·L.

    Where it won, measured on whole non-causal calls (bench/experiments/split/pv_sweep.py; bench/notes/split.md):
    - S (the GEMM's K) not a multiple of 8: cuBLAS's K tail is slow (at S = 300 this kernel took 0.54-0.77 of its
      time);
    - small calls (B·Hq·L ≤ 32768) with Ev a multiple of 256 (no partial 256-column tile), e.g. (8, 16, 256, S, 512);
    - elsewhere cuBLAS is as fast or faster (the seed (32, 32, 512, 512, 1024): False).

    >>> prefer(32 * 32 * 512, 512, 1024), prefer(32 * 32 * 512, 300, 1024), prefer(8 * 16 * 256, 512, 1024)
    (False, True, True)
    """
    return seqlen_k % 8 != 0 or (rows <= 32768 and head_dim_v % 256 == 0)


def layout_reason(v, out) -> str | None:
    """None when TMA can read v in place (16-byte aligned base, batch/head/row strides multiples of 16 bytes) and out
    takes 16-byte stores (16-byte aligned base and row/head/batch strides, unit column stride, Ev a multiple of 8).
    Else why not."""
    why = tma_operand_reason("value", v)
    if why is not None:
        return why
    if out.shape[-1] % 8:
        return f"head_dim_v={out.shape[-1]}: the P·V kernel stores 8 columns at a time (a multiple of 8)"
    return out_16b_reason(out, "the P·V kernel")


def reason(p, out, mode: int) -> str | None:
    """None when a call on the scores kernel runs its P·V in this kernel's one launch instead of cuBLAS (row bands
    under a causal mask), else why not: ``mode`` (:func:`setting`) must not be 0; causal calls (each row block then
    stops at its visible keys), and the others only where :func:`prefer` says the kernel is faster (or in mode 2);
    value and out (B, Hq, L, Ev) must take its TMA loads and 16-byte stores (:func:`layout_reason`)."""
    if mode == 0:
        return f"{ENV}=0"
    if p.causal is None and mode == 1 and not prefer(p.batch * p.num_heads * p.seqlen_q, p.seqlen_k, p.head_dim_v):
        return "not causal: cuBLAS's GEMM is as fast at this shape (pv_sm90.prefer)"
    if p.value is None:  # a plan made without arrays (tests): the layout is not known
        return None
    return layout_reason(p.value, out)


def grid_for(batch: int, num_heads: int, seqlen_q: int, head_dim_v: int, num_sms: int) -> tuple:
    """(min(tiles, num_sms), 1, 1): one CTA per SM striding over the ⌈L / 128⌉ · ⌈Ev / 256⌉ tiles of each head.

    >>> grid_for(32, 32, 512, 1024, 132), grid_for(1, 2, 100, 320, 132)
    ((132, 1, 1), (4, 1, 1))
    """
    tiles = -(-seqlen_q // BLOCK_M) * -(-head_dim_v // BLOCK_N) * num_heads * batch
    return (min(tiles, num_sms), 1, 1)


def key_steps(seqlen_q: int, seqlen_k: int, m0: int, causal_offset: int | None) -> int:
    """The 64-key steps the 64-row block at m0 multiplies (the kernel's key_steps): its last row's visible keys
    (causal_offset None: all S), rounded up to 64; 0 past L or where its rows see no key.

    >>> [key_steps(512, 512, m0, 0) for m0 in (0, 64, 448)], key_steps(512, 512, 0, None), key_steps(600, 500, 0, -100)
    ([1, 2, 8], 8, 0)
    """
    if m0 >= seqlen_q:
        return 0
    n = seqlen_k
    if causal_offset is not None:
        n = max(0, min(n, min(m0 + BLOCK_M // 2, seqlen_q) + causal_offset))
    return -(-n // BLOCK_K)


def build(p, out, *, ld: int, family: KernelFamily = PV_SM90) -> PreparedLaunch:
    """The launch for P (B, Hq, L, S) as scores_sm90.build writes it (packed by (batch, query head), rows ``ld``
    elements apart), the problem ``p``'s value (B, Hkv, S, Ev) and out (B, Hq, L, Ev), accepted by
    :func:`layout_reason`. Causal (key j visible to row i iff j ≤ i + p.causal_offset): the row blocks skip the key
    steps past their last row's limit, where P must be 0 up to the step's end (the scores kernel writes it so).
    family: PV_SM90 or a copy with other NVRTC options (A/B runs). Raises ValueError for a short ld or one not a
    multiple of 8, or mismatched shapes."""
    v, seqlen_q = p.value, p.seqlen_q
    B, Hkv, S, Ev = v.shape
    Bo, Hq, L, Evo = out.shape
    if (Bo, Evo, L) != (B, Ev, seqlen_q) or Hq % Hkv:
        raise ValueError(f"out {tuple(out.shape)} does not match value {tuple(v.shape)} and seqlen_q={seqlen_q}")
    if ld < S or ld % 8:
        raise ValueError(f"ld={ld}: P rows need a pitch of at least seqlen_k={S} elements, a multiple of 8")
    kernel = family.kernel(dtype=C_TYPE_16[dtype_name(v.dtype)], stages=STAGES)
    prm = np.zeros((), dtype=_PARAMS)
    set_strides(prm, ("out", out, "bhl"))
    prm["seqlen_q"], prm["seqlen_k"], prm["head_dim_v"], prm["groups"] = L, S, Ev, Hq // Hkv
    prm["num_heads"], prm["batch"] = Hq, B
    prm["is_causal"] = p.causal is not None
    prm["causal_offset"] = p.causal_offset
    isz = v.dtype.itemsize
    p_map = MapSpec(dtype_name(v.dtype), (S, L, Hq, B), (ld * isz, L * ld * isz, Hq * L * ld * isz), BLOCK_M)
    maps = (p_map, MapSpec.of(v, BLOCK_K))
    grid = grid_for(B, Hq, L, Ev, device_sms(v.device.id))
    return build_launch(kernel, prm, maps, grid)


def build_launch(kernel, params: np.ndarray, maps: tuple, grid: tuple) -> PreparedLaunch:
    """The launch of a PvSm90Params kernel with ``params`` prepared, replayed as ``launch_on(stream, p, v, out)``:
    tensor maps of P and V (``maps``: their MapSpecs), encoded again only when a base moved, and out's pointer."""
    return PreparedLaunch(params, [Step(kernel, grid, (THREADS,), smem_bytes())], args=("p", "v", "out"),
                          pointers={"out": "out"},
                          maps=(Maps(("tma_p", "tma_v"), ("p", "v"), tuple(m.encode for m in maps)),))


def describe(launch: PreparedLaunch) -> str:
    """What a launch of :func:`prepare` runs, in words."""
    what = "causal: each 64-row block stops at its visible keys" if launch.params["is_causal"] else "all keys"
    return (f"pv_sm90 (128 rows x 256 columns per tile, 64 keys a stage, {STAGES} TMA stages, wgmma m64n256 x 2 "
            f"warpgroups; persistent, grid {launch.grid}; {what})")
