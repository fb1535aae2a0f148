"""The fused attention path: FlashAttention-2 forward on tensor cores (cuda_src/attention/flash_fwd.cu).

One kernel family, ``FLASH_FWD``, instantiated over element type × head-dim bucket × tile × has-mask. Head dims E
and Ev are served by the smallest instantiated bucket ≥ max(E, Ev); the kernel zero-pads the missing columns in
shared memory, so the inputs are read in place. Causal alignment, mask element type and layout (strides, alignment)
are run-time arguments, which keeps the table at 52 instantiations (2 dtypes × 13 (head dim, tile) pairs × mask).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .. import philox
from ..runtime import env
from ..runtime.compile import KernelFamily
from ..runtime.interop import dtype_name
from ..runtime.kernel_abi import C_TYPE_16, LOG2E, MASK_KIND, element_strides
from ..runtime.launch import PreparedLaunch, Step

HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256)   # instantiated head-dim buckets (multiples of 16: mma k steps)


@dataclasses.dataclass(frozen=True)
class Tile:
    """Launch shape of one instantiation: query rows per block, key rows per step, warps, K/V pipeline stages
    (1: one K and one V buffer, loads interleaved with the two GEMMs; 2: double-buffered, tile j+1 loads during j)."""
    block_m: int
    block_n: int
    warps: int
    stages: int = 2
    wgmma: bool = False  # sm_90a: each warpgroup computes its 64 rows with wgmma (else mma.sync per warp)

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Q tile + stages × (K tile + V tile); mma.sync rows padded by 8 elements, wgmma tiles packed in swizzle
        atoms plus 1 KB of slack for their 1024-byte alignment (see the kernel header)."""
        if self.wgmma:
            return (self.block_m + 2 * self.stages * self.block_n) * head_dim * itemsize + 1024
        return (self.block_m + 2 * self.stages * self.block_n) * (head_dim + 8) * itemsize

    def accumulators(self, head_dim: int) -> int:
        """fp32 accumulator registers per thread: S (16·kBlockN/32 per m tile) + O (16·kHeadDim/32 per m tile)."""
        m_tiles = self.block_m // (16 * self.warps)
        return m_tiles * (self.block_n + head_dim) // 2


# The tile table: (dtype, head-dim bucket, arch major) -> Tile. Arch 9 is Hopper (H100/H200: 227 KB shared memory
# per block, 228 KB per SM, 64 K registers per SM); arch 8 must fit every sm_8x part, whose smallest (sm_86/sm_89)
# allow 99 KB (101376 B) per block, so arch 8 keeps one K/V stage (untimed: no sm_8x device was measured). Both
# dtypes use the same tiles (same width, same mma rate). Registers: Tile.accumulators() fp32 values per thread plus
# ~50 of addresses and fragments must stay <= 255 with no spill (tests/test_flash.py checks every instantiation).
# Measurements: H200, fp16, bench_flash.py --sweep (TFLOP/s); see bench/notes/flash.md.
_BY_HEAD_DIM = {
    # D=32: 128×128, 4 warps: 2 × (64 + 16) = 160 accumulators; 2 stages 51 KB (2+ CTAs/SM). Untimed.
    (32, 9): Tile(128, 128, 4, 2), (32, 8): Tile(128, 128, 4, 1),
    # D=64: 128×128, 4 warps: 2 × (64 + 32) = 192 accumulators, 2 stages 92 KB (2 CTAs/SM); arch 8: one stage, 55 KB.
    # Fastest of the tiles swept at (4,32,4096,64) (bench/notes/flash.md, session 2).
    (64, 9): Tile(128, 128, 4, 2), (64, 8): Tile(128, 128, 4, 1),
    # D=96: 128×64, 4 warps: 2 × (32 + 48) = 160 accumulators; 2 stages 80 KB (2 CTAs/SM). Untimed.
    (96, 9): Tile(128, 64, 4, 2), (96, 8): Tile(128, 64, 4, 1),
    # D=128: 128×64, 4 warps: 2 × (32 + 64) = 192 accumulators (251-255 registers), the limit; 2 stages 104 KB, 2
    # CTAs/SM. Fastest of the tiles swept at (8,16,2048,128) (bench/notes/flash.md, sessions 1-2).
    (128, 9): Tile(128, 64, 4, 2), (128, 8): Tile(128, 64, 4, 1),
    # D=160: 64×64, 4 warps: 32 + 80 = 112 accumulators; 2 stages 108 KB (2 CTAs/SM on Hopper). 128×32 (192
    # accumulators) spills 16-88 B with a mask at either stage count. Arch 8: 64×32 with 2 stages, 65 KB. Untimed.
    (160, 9): Tile(64, 64, 4, 2), (160, 8): Tile(64, 32, 4, 2),
    # D=192: 128×64, 8 warps of 16 rows: 32 + 96 = 128 accumulators; 2 stages 154 KB (1 CTA/SM) on Hopper; arch 8:
    # 64×64 with 4 warps and one stage, 75 KB. Untimed.
    (192, 9): Tile(128, 64, 8, 2), (192, 8): Tile(64, 64, 4, 1),
    # D=256: 64×64, 4 warps: 16 + 128 = 144 accumulators; one stage is 101376 B, exactly sm_86's limit, and 2 CTAs/SM
    # on Hopper. Fastest of the tiles swept at (8,16,1024,256) (bench/notes/flash.md, sessions 1-2).
    (256, 9): Tile(64, 64, 4, 1), (256, 8): Tile(64, 64, 4, 1),
}
TILES = {(dtype, d, arch): tile for (d, arch), tile in _BY_HEAD_DIM.items() for dtype in C_TYPE_16}

# sm_90a (H100/H200) wgmma tiles, by head-dim bucket. 128-byte swizzle atoms hold 64 columns, so only multiples of 64
# (other buckets keep mma.sync). block_m = 64 rows per warpgroup. Registers per thread: S (block_n/2) + O
# (head_dim/2) fp32 accumulators + P (block_n/4 packed) must stay under 255 at 2 warpgroups (1 CTA/SM, 256 threads);
# shared memory (block_m + 4·block_n)·head_dim·2 bytes + 1 KB of the 227 KB per block.
WGMMA_TILES = {
    # D=64: one warpgroup, 75 KB and 166 registers: 3 CTAs/SM, whose softmax and GEMMs interleave. (4,32,4096,64)
    # fp16: 343 TFLOP/s (1.15-1.23x torch FA2) vs 301 for 128x128 with 8 warps (1 CTA/SM by registers) and 284 for 128x64.
    64: Tile(64, 128, 4, 2, True),
    # D=128: 161 KB, 167 registers, 1 CTA/SM, the two warpgroups ping-pong. (8,16,2048,128) fp16: 373 TFLOP/s vs 312
    # for 128x64 (2 CTAs/SM) and 252 for 64x128 (148 KB: 1 CTA of 4 warps).
    128: Tile(128, 128, 8, 2, True),
    # D=192: 145 KB, 168 registers. (8,16,1024,192) fp16/bf16: 313-314 TFLOP/s, 1.13x torch FA2, vs 198-209 for the
    # mma.sync 128x64/8-warp tile and 226 for a one-warpgroup 64x64.
    192: Tile(128, 64, 8, 2, True),
    # D=256: 193 KB, 198 registers. (8,16,1024,256) fp16: 345-353 TFLOP/s, 1.19-1.23x torch FA2.
    256: Tile(128, 64, 8, 2, True),
}

# FlashFwdParams in flash_fwd.cu: every field 8 bytes wide, so this dtype's layout is the C struct's.
_PARAM_FIELDS = (
    "out", "lse", "q", "k", "v", "mask", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v", "groups", "is_causal",
    "causal_offset", "mask_kind", "vec_flags", "scale_log2",
    "q_stride_b", "q_stride_h", "q_stride_l", "k_stride_b", "k_stride_h", "k_stride_s",
    "v_stride_b", "v_stride_h", "v_stride_s", "out_stride_b", "out_stride_h", "out_stride_l",
    "lse_stride_b", "lse_stride_h", "lse_stride_l",
    "mask_stride_b", "mask_stride_h", "mask_stride_l", "mask_stride_s", "rng", "dropout_threshold", "dropout_scale")
_PARAMS = np.dtype([(n, np.float64 if n in ("scale_log2", "dropout_scale") else np.int64) for n in _PARAM_FIELDS])

FLASH_FWD = KernelFamily(
    name="flash_fwd",
    source="attention/flash_fwd.cu",
    template=("cupy_attn::flash_fwd<{dtype}, {head_dim}, {tile.block_m}, {tile.block_n}, {tile.warps}, {tile.stages}, "
              "{has_mask}, false, false>"),
    axes={
        "dtype": tuple(C_TYPE_16.values()),
        "head_dim": HEAD_DIMS,
        "tile": tuple(sorted(set(_BY_HEAD_DIM.values()), key=dataclasses.astuple)),
        "has_mask": ("false", "true"),
    },
    where=lambda row: any(t == row["tile"] for (d, _), t in _BY_HEAD_DIM.items() if d == row["head_dim"]),
    structs=(("cupy_attn::FlashFwdParams", _PARAMS),),
)

# Dropout tiles (the mma.sync kernel with kDropout = true; Hopper runs it too: the wgmma and FA3-design kernels have no
# dropout). The Philox draws of a row half (common/philox.cuh, ~60 integer instructions and ~8 live registers per
# block) sit next to the S and O accumulators: the 128-row tiles above, at 2 m tiles per warp, spilled 88-816 B with
# dropout at head dims 32-128 (sm_80 and sm_90), so those buckets take 64-row tiles (one m tile per warp: half the
# accumulators); 160-256 already run one m tile per warp and keep their tiles. Untimed (no device time in the session
# that added them).
_DROPOUT_BY_HEAD_DIM = {
    **_BY_HEAD_DIM,
    (32, 9): Tile(64, 128, 4, 2), (32, 8): Tile(64, 128, 4, 1),
    (64, 9): Tile(64, 128, 4, 2), (64, 8): Tile(64, 128, 4, 1),
    (96, 9): Tile(64, 64, 4, 2), (96, 8): Tile(64, 64, 4, 1),
    (128, 9): Tile(64, 64, 4, 2), (128, 8): Tile(64, 64, 4, 1),
}
DROPOUT_TILES = {(dtype, d, arch): tile for (d, arch), tile in _DROPOUT_BY_HEAD_DIM.items() for dtype in C_TYPE_16}

FLASH_FWD_DROPOUT = KernelFamily(
    name="flash_fwd_dropout",
    source="attention/flash_fwd.cu",
    template=("cupy_attn::flash_fwd<{dtype}, {head_dim}, {tile.block_m}, {tile.block_n}, {tile.warps}, {tile.stages}, "
              "{has_mask}, false, true>"),
    axes={
        "dtype": tuple(C_TYPE_16.values()),
        "head_dim": HEAD_DIMS,
        "tile": tuple(sorted(set(_DROPOUT_BY_HEAD_DIM.values()), key=dataclasses.astuple)),
        "has_mask": ("false", "true"),
    },
    where=lambda row: any(t == row["tile"] for (d, _), t in _DROPOUT_BY_HEAD_DIM.items() if d == row["head_dim"]),
    structs=(("cupy_attn::FlashFwdParams", _PARAMS),),
)

# The same kernel with kWgmma = true: Hopper only (compute capability 9.0 exactly), compiled to an sm_90a cubin.
FLASH_FWD_SM90A = KernelFamily(
    name="flash_fwd_sm90a",
    source="attention/flash_fwd.cu",
    template=("cupy_attn::flash_fwd<{dtype}, {head_dim}, {tile.block_m}, {tile.block_n}, {tile.warps}, {tile.stages}, "
              "{has_mask}, true, false>"),
    axes={
        "dtype": tuple(C_TYPE_16.values()),
        "head_dim": tuple(WGMMA_TILES),
        "tile": tuple(sorted(set(WGMMA_TILES.values()), key=dataclasses.astuple)),
        "has_mask": ("false", "true"),
    },
    where=lambda row: WGMMA_TILES[row["head_dim"]] == row["tile"],
    archs=("sm_90a",),
    arch="sm_90a",
    structs=(("cupy_attn::FlashFwdParams", _PARAMS),),
)


def head_dim_bucket(head_dim: int, head_dim_v: int) -> int | None:
    """The smallest instantiated head dim ≥ max(E, Ev) (E=40, Ev=40 → 64; E=192, Ev=128 → 192), None past 256."""
    need = max(head_dim, head_dim_v)
    return next((d for d in HEAD_DIMS if d >= need), None)


ENV_WGMMA = "CUPY_ATTN_WGMMA"


# Hopper: buckets served faster by the wgmma kernel at a larger (zero-padded) head dim. (8,16,1024,160) fp16: mma.sync
# at 160 0.419 ms, wgmma at 192 0.318 ms. Not taken: 96 → 128 (0.737 vs 0.731 ms at (8,16,2048,96): a tie) and
# 32 → 64 (1.398 vs 1.565 ms at (4,32,4096,32): slower). bench/notes/flash.md, session 3.
WGMMA_PADDED = {160: 192}


def select(dtype, head_dim: int, arch: int, dropout: bool = False) -> tuple[KernelFamily, Tile, int]:
    """The kernel family, tile and instantiated head dim for a head-dim bucket: the sm_90a wgmma kernel on compute
    capability 9.0 when the bucket has a WGMMA_TILES entry (64, 128, 192, 256) or pads to one (WGMMA_PADDED: 160 →
    192) and ``CUPY_ATTN_WGMMA`` is not ``0``; else mma.sync at the bucket itself. ``dropout``: the mma.sync kernel's
    dropout variant (FLASH_FWD_DROPOUT, DROPOUT_TILES) on every arch.

    >>> select(np.dtype("float16"), 128, 80)[1:]
    (Tile(block_m=128, block_n=64, warps=4, stages=1, wgmma=False), 128)
    >>> select(np.dtype("float16"), 128, 90, dropout=True)[0].name
    'flash_fwd_dropout'
    """
    if dropout:
        return FLASH_FWD_DROPOUT, DROPOUT_TILES[(dtype_name(dtype), head_dim, _arch_major(arch))], head_dim
    if arch == 90 and env.get(ENV_WGMMA, "1") != "0":
        padded = WGMMA_PADDED.get(head_dim, head_dim)
        if padded in WGMMA_TILES:
            return FLASH_FWD_SM90A, WGMMA_TILES[padded], padded
    return FLASH_FWD, TILES[(dtype_name(dtype), head_dim, _arch_major(arch))], head_dim


ENV_FA3 = "CUPY_ATTN_FA3"


def fa3_reason(q, k, v, out, *, scale: float, arch: int, mask_kind: str = "none") -> str | None:
    """None when the opt-in FA3-design kernel (cupy_attn/attention/fused_sm90.py) runs this call under
    ``CUPY_ATTN_FA3=1`` (or ``2``: with intra-warpgroup overlap; ``3``: that as a persistent kernel), else why
    prepare() keeps flash_fwd.cu (explain())."""
    from . import fused_sm90
    return (fused_sm90.unsupported_reason(q.dtype, q.shape[-1], v.shape[-1], mask_kind, arch, scale)
            or fused_sm90.layout_reason(q, k, v, out))


def _arch_major(arch: int) -> int:
    """Tile-table arch key: 9 for Hopper, 8 for sm_8x and anything newer (sm_100/sm_120 run mma.sync too; the
    arch-8 tiles fit the 99 KB shared memory of the smallest of them)."""
    return 9 if arch // 10 == 9 else 8


def unsupported_reason(dtype, head_dim: int, head_dim_v: int, mask_kind: str, arch: int) -> str | None:
    """None when the fused kernel runs this call, else a short reason for explain().

    >>> unsupported_reason(np.dtype("float32"), 64, 64, "none", 90)
    'fp32 is served by the split path'
    """
    name = dtype_name(dtype)
    if name == "float32":
        return "fp32 is served by the split path"
    if name not in C_TYPE_16:
        return f"dtype {name} has no fused kernel (fp16 and bf16 only)"
    if arch < 80:
        return f"sm_{arch} lacks the sm_80 tensor-core instructions (mma.sync m16n8k16 bf16, cp.async)"
    if head_dim < 1 or head_dim_v < 1:
        return "head dims must be at least 1"
    if head_dim_bucket(head_dim, head_dim_v) is None:
        return f"head dims E={head_dim}, Ev={head_dim_v}: the fused kernel is instantiated up to 256"
    if mask_kind not in ("none", "bool", "float"):
        return f"mask kind {mask_kind!r} is not one of none/bool/float"
    return None


def flash_forward(q, k, v, out, lse=None, *, scale: float, causal: str | None = None, mask=None,
                  dropout_p: float = 0.0, rng=None) -> None:
    """out (and lse) = attention(q, k, v) by the fused kernel, on CuPy's current stream and device.

    Arguments as :func:`prepare`'s; this is ``prepare(...)`` launched on the arrays' own pointers.
    """
    prepare(q, k, v, out, lse, scale=scale, causal=causal, mask=mask, dropout_p=dropout_p, rng=rng)(
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, 0 if lse is None else lse.data.ptr,
        0 if mask is None else mask.data.ptr)


def prepare(q, k, v, out, lse=None, *, scale: float, causal: str | None = None, mask=None, dropout_p: float = 0.0,
            rng=None) -> PreparedLaunch:
    """Check a fused-kernel call and build its launch: kernel, grid and parameters, all but the pointers.

    q: (B, Hq, L, E); k: (B, Hkv, S, E); v: (B, Hkv, S, Ev); fp16 or bf16, last-dim stride 1, any other strides
    (read in place). Hq % Hkv == 0 (GQA: query head h reads kv head h // (Hq // Hkv)). out: (B, Hq, L, Ev), q's dtype,
    last-dim stride 1. lse: None or (B, Hq, L) float32 (natural log). mask: None or a view broadcast to (B, Hq, L, S)
    (bool: True = attend; fp16/bf16/fp32: added to the scaled scores). causal: None, "top_left" or "bottom_right".
    L, S >= 1. dropout_p in (0, 1]: P is dropped with the keep mask of ``rng`` (a CuPy int64 array {seed, offset} of
    the call, read by the kernel; cupy_attn/philox.py defines the mask) and kept values scaled by 1/(1 − dropout_p);
    lse is that of the undropped scores. Raises ValueError for calls the kernel cannot run. The launch depends on the
    arrays' shapes, strides, dtypes and pointer alignment (16 bytes for q/k/v rows, 4 for out), not on their
    addresses: it may be replayed on other arrays of the same layout (the public API's call cache does), and with
    dropout on the same rng array.
    """
    import cupy

    arch = int(cupy.cuda.Device().compute_capability)
    check_launch_arrays("fused attention", unsupported_reason, arch, q, k, v, out, lse, causal, mask)
    B, Hq, L, E = q.shape
    _, Hkv, S, Ev = v.shape
    dtype = q.dtype

    if dropout_p > 0 and (rng is None or rng.dtype != np.int64 or rng.size != 2):
        raise ValueError("fused attention: dropout_p > 0 needs rng, the call's int64 {seed, offset} CuPy array")
    mode = env.get(ENV_FA3)
    if mask is None and not dropout_p and mode in ("1", "2", "3"):  # opt-in: FA3-design kernel
        from . import fused_sm90
        if fa3_reason(q, k, v, out, scale=scale, arch=arch) is None:
            return fused_sm90.prepare(q, k, v, out, lse, scale=scale, causal=causal, mode=mode)
    return _build(select(dtype, head_dim_bucket(E, Ev), arch, dropout=dropout_p > 0), q, k, v, out, lse,
                  scale=scale, causal=causal, mask=mask, dropout_p=dropout_p, rng=rng)


def check_launch_arrays(what: str, reason_fn, arch: int, q, k, v, out, lse, causal, mask) -> None:
    """The checks a kernel launcher's ``prepare`` makes of its CuPy arrays (fused, decode): ValueError naming ``what``
    for a call the kernel cannot run (``reason_fn(dtype, E, Ev, mask_kind, arch)``), shapes that disagree, mixed
    dtypes, a strided last axis, L or S of 0, an unknown causal alignment, a mask not broadcast to (B, Hq, L, S) or of
    another dtype, an lse not float32 (B, Hq, L)."""
    B, Hq, L, E = q.shape
    _, Hkv, S, Ev = v.shape
    dtype = q.dtype
    mask_kind = "none" if mask is None else ("bool" if mask.dtype == np.bool_ else "float")
    reason = reason_fn(dtype, E, Ev, mask_kind, arch)
    if reason:
        raise ValueError(f"{what}: {reason}")
    if k.shape != (B, Hkv, S, E) or out.shape != (B, Hq, L, Ev) or Hq % Hkv:
        raise ValueError(f"{what}: shapes q {q.shape}, k {k.shape}, v {v.shape}, out {out.shape} disagree")
    if any(a.dtype != dtype for a in (k, v, out)):
        raise ValueError(f"{what}: q, k, v and out must share one dtype")
    if any(a.strides[-1] != a.itemsize for a in (q, k, v, out)):
        raise ValueError(f"{what}: the last dimension of q, k, v and out must be contiguous")
    if L < 1 or S < 1:
        raise ValueError(f"{what}: L and S must be at least 1 (the caller handles empty sequences)")
    if causal not in (None, "top_left", "bottom_right"):
        raise ValueError(f"{what}: causal must be None, 'top_left' or 'bottom_right', got {causal!r}")
    if mask is not None:
        if mask.shape != (B, Hq, L, S):
            raise ValueError(f"{what}: mask must be broadcast to {(B, Hq, L, S)}, got {mask.shape}")
        if dtype_name(mask.dtype) not in MASK_KIND:
            raise ValueError(f"{what}: mask dtype {mask.dtype} is not bool/float16/bfloat16/float32")
    if lse is not None and (lse.shape != (B, Hq, L) or lse.dtype != np.float32):
        raise ValueError(f"{what}: lse must be float32 {(B, Hq, L)}, got {lse.dtype} {lse.shape}")


def prepare_problem(p, choice, out, lse):
    """The launch for a checked problem (checks.SDPAProblem) and the choice dispatch made (``select``'s result, or
    ("fa3", mode) for the FA3-design kernel), bound to the call's stream: ``run(q_ptr, k_ptr, v_ptr, out_ptr,
    lse_ptr, mask_ptr)``. Nothing is re-checked."""
    if choice[0] == "fa3":  # ("fa3", mode): dispatch.fa3_mode's "1" (ping-pong), "2" (overlap), "3" (persistent)
        from . import fused_sm90
        return fused_sm90.prepare(p.query, p.key, p.value, out, lse, scale=p.scale, causal=p.causal,
                                  mode=choice[1]).bind(p.ctx.stream)
    return _build(choice, p.query, p.key, p.value, out, lse, scale=p.scale, causal=p.causal,
                  mask=p.mask, dropout_p=p.dropout_p, rng=p.rng).bind(p.ctx.stream)


def _build(choice, q, k, v, out, lse, *, scale, causal, mask, dropout_p=0.0, rng=None) -> PreparedLaunch:
    family, tile, head_dim = choice
    kernel = family.kernel(dtype=C_TYPE_16[dtype_name(q.dtype)], head_dim=head_dim, tile=tile,
                           has_mask="false" if mask is None else "true")
    return build_launch(kernel, tile, head_dim, q, k, v, out, lse, scale=scale, causal=causal, mask=mask,
                        dropout_p=dropout_p, rng=rng)


def launch(kernel, tile: Tile, head_dim: int, q, k, v, out, lse, *, scale, causal, mask, dropout_p=0.0,
           rng=None) -> None:
    """Launch one instantiation on these arrays (benchmarks call it directly to sweep tiles outside the table).
    Arguments as flash_forward's, already checked."""
    build_launch(kernel, tile, head_dim, q, k, v, out, lse, scale=scale, causal=causal, mask=mask,
                 dropout_p=dropout_p, rng=rng)(
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, 0 if lse is None else lse.data.ptr,
        0 if mask is None else mask.data.ptr)


# A replay's arguments, the pointer fields of FlashFwdParams (which lists them first, in another order).
ARGS = ("q", "k", "v", "out", "lse", "mask")


def build_launch(kernel, tile: Tile, head_dim: int, q, k, v, out, lse, *, scale, causal, mask, dropout_p=0.0,
                 rng=None) -> PreparedLaunch:
    """The launch of one instantiation for these arrays (flash_forward's arguments, already checked), replayed as
    ``launch_on(stream, q, k, v, out, lse, mask)``: FlashFwdParams from the arrays' shapes, strides and alignment, the
    six pointers written per replay (one driver call: CuPy's RawKernel call costs ~6 µs of host time per call on an
    H200 host, this ~1); with dropout, the rng array's address (read by the kernel at run time) and the keep
    threshold.
    """
    B, Hq, L, E = q.shape
    _, Hkv, S, Ev = v.shape
    if Hq > 65535 or B > 65535:
        raise ValueError(f"fused attention: grid limit: heads {Hq} and batch {B} must each be <= 65535")
    smem = tile.smem_bytes(head_dim)

    def rows16(a) -> bool:  # every row start 16-byte aligned: the kernel may copy with 16-byte cp.async
        return a.data.ptr % 16 == 0 and all(s % 8 == 0 for s in element_strides(a)[:-1])

    p = np.zeros((), dtype=_PARAMS)
    p["seqlen_q"], p["seqlen_k"], p["head_dim"], p["head_dim_v"], p["groups"] = L, S, E, Ev, Hq // Hkv
    p["is_causal"] = causal is not None
    p["causal_offset"] = S - L if causal == "bottom_right" else 0
    p["mask_kind"] = 0 if mask is None else MASK_KIND[dtype_name(mask.dtype)]
    out_pairs = out.data.ptr % 4 == 0 and all(s % 2 == 0 for s in element_strides(out)[:-1])
    p["vec_flags"] = rows16(q) | rows16(k) << 1 | rows16(v) << 2 | out_pairs << 3
    p["scale_log2"] = float(scale) * LOG2E
    for name, arr, axes in (("q", q, "bhl"), ("k", k, "bhs"), ("v", v, "bhs"), ("out", out, "bhl")):
        for axis, stride in zip(axes, element_strides(arr)):
            p[f"{name}_stride_{axis}"] = stride
    if lse is not None:
        for axis, stride in zip("bhl", element_strides(lse)):
            p[f"lse_stride_{axis}"] = stride
    if mask is not None:
        for axis, stride in zip("bhls", element_strides(mask)):
            p[f"mask_stride_{axis}"] = stride
    if dropout_p > 0:
        p["rng"] = rng.data.ptr
        p["dropout_threshold"] = philox.dropout_threshold(dropout_p)
        p["dropout_scale"] = philox.dropout_scale(dropout_p)
    return PreparedLaunch(p, [Step(kernel, (math.ceil(L / tile.block_m), Hq, B), (tile.warps * 32,), smem)],
                          args=ARGS, pointers={name: name for name in ARGS})
