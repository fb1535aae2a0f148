"""FlashAttention-2 forward on tensor cores (cuda_src/attention/flash_fwd.cu): the fused path's kernel for sm_80+.

Three kernel families from one source: ``FLASH_FWD`` (mma.sync), ``FLASH_FWD_DROPOUT`` (its dropout variant, every
arch) and ``FLASH_FWD_SM90A`` (warpgroup MMAs, compute capability 9.0 only), each instantiated over element type ×
head-dim bucket × tile × has-mask. Head dims E and Ev are served by the smallest instantiated bucket ≥ max(E, Ev); the
kernel zero-pads the missing columns in shared memory, so the inputs are read in place. Causal alignment, mask element
type and layout (strides, alignment) are run-time arguments, which keeps FLASH_FWD at 52 instantiations (2 dtypes ×
13 (head dim, tile) pairs × mask).

:func:`select` is this kernel's choice of family and tile (the plan calls it once); :func:`reason` says whether the
kernel serves a call; :func:`build` prepares the launch of a choice.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from ... import philox
from ...runtime import env
from ...runtime.compile import KernelFamily
from ...runtime.interop import dtype_name
from ...runtime.kernel_abi import C_TYPE_16, LOG2E, MASK_KIND, element_strides, head_dim_bucket as _bucket, rows16, \
    set_strides, tile_arch
from ...runtime.launch import PreparedLaunch, Step
from .. import variants

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
# ~50 of addresses and fragments must stay <= 255 with no spill (tests/test_flash_fwd.py checks every instantiation).
# The tile sweeps behind the timed entries: bench/notes/flash.md (bench_flash_fwd.py --sweep).
_BY_HEAD_DIM = {
    # D=32: 128×128, 4 warps: 2 × (64 + 16) = 160 accumulators; 2 stages 51 KB (2+ CTAs/SM). Untimed.
    (32, 9): Tile(128, 128, 4, 2), (32, 8): Tile(128, 128, 4, 1),
    # D=64: 128×128, 4 warps: 2 × (64 + 32) = 192 accumulators, 2 stages 92 KB (2 CTAs/SM); arch 8: one stage, 55 KB.
    # The fastest of the tiles swept at (4,32,4096,64).
    (64, 9): Tile(128, 128, 4, 2), (64, 8): Tile(128, 128, 4, 1),
    # D=96: 128×64, 4 warps: 2 × (32 + 48) = 160 accumulators; 2 stages 80 KB (2 CTAs/SM). Untimed.
    (96, 9): Tile(128, 64, 4, 2), (96, 8): Tile(128, 64, 4, 1),
    # D=128: 128×64, 4 warps: 2 × (32 + 64) = 192 accumulators (251-255 registers), the limit; 2 stages 104 KB, 2
    # CTAs/SM. The fastest of the tiles swept at (8,16,2048,128).
    (128, 9): Tile(128, 64, 4, 2), (128, 8): Tile(128, 64, 4, 1),
    # D=160: 64×64, 4 warps: 32 + 80 = 112 accumulators; 2 stages 108 KB (2 CTAs/SM on Hopper). 128×32 (192
    # accumulators) spills 16-88 B with a mask at either stage count. Arch 8: 64×32 with 2 stages, 65 KB. Untimed.
    (160, 9): Tile(64, 64, 4, 2), (160, 8): Tile(64, 32, 4, 2),
    # D=192: 128×64, 8 warps of 16 rows: 32 + 96 = 128 accumulators; 2 stages 154 KB (1 CTA/SM) on Hopper; arch 8:
    # 64×64 with 4 warps and one stage, 75 KB. Untimed.
    (192, 9): Tile(128, 64, 8, 2), (192, 8): Tile(64, 64, 4, 1),
    # D=256: 64×64, 4 warps: 16 + 128 = 144 accumulators; one stage is 101376 B, exactly sm_86's limit, and 2 CTAs/SM
    # on Hopper. The fastest of the tiles swept at (8,16,1024,256).
    (256, 9): Tile(64, 64, 4, 1), (256, 8): Tile(64, 64, 4, 1),
}
TILES = {(dtype, d, arch): tile for (d, arch), tile in _BY_HEAD_DIM.items() for dtype in C_TYPE_16}

# sm_90a (H100/H200) wgmma tiles, by head-dim bucket. 128-byte swizzle atoms hold 64 columns, so only multiples of 64
# (other buckets keep mma.sync). block_m = 64 rows per warpgroup. Registers per thread: S (block_n/2) + O
# (head_dim/2) fp32 accumulators + P (block_n/4 packed) must stay under 255 at 2 warpgroups (1 CTA/SM, 256 threads);
# shared memory (block_m + 4·block_n)·head_dim·2 bytes + 1 KB of the 227 KB per block. The rates measured against the
# other tiles: bench/notes/flash.md.
WGMMA_TILES = {
    # D=64: one warpgroup, 75 KB and 166 registers: 3 CTAs/SM, whose softmax and GEMMs interleave (faster at
    # (4,32,4096,64) than 128x128 with 8 warps, 1 CTA/SM by registers, and than 128x64).
    64: Tile(64, 128, 4, 2, True),
    # D=128: 161 KB, 167 registers, 1 CTA/SM, the two warpgroups ping-pong (faster at (8,16,2048,128) than 128x64 at
    # 2 CTAs/SM and 64x128 at 1 CTA of 4 warps).
    128: Tile(128, 128, 8, 2, True),
    # D=192: 145 KB, 168 registers (faster at (8,16,1024,192) than the mma.sync 128x64/8-warp tile and a
    # one-warpgroup 64x64).
    192: Tile(128, 64, 8, 2, True),
    # D=256: 193 KB, 198 registers.
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


def _mma_family(name: str, by_head_dim: dict, dropout: str) -> KernelFamily:
    """The mma.sync kernel (kWgmma = false) over a (head dim, arch major) -> Tile table, kDropout = ``dropout``."""
    return KernelFamily(
        name=name,
        source="attention/flash_fwd.cu",
        template=("cupy_attn::flash_fwd<{dtype}, {head_dim}, {tile.block_m}, {tile.block_n}, {tile.warps}, "
                  "{tile.stages}, {has_mask}, false, " + dropout + ">"),
        axes={
            "dtype": tuple(C_TYPE_16.values()),
            "head_dim": HEAD_DIMS,
            "tile": tuple(sorted(set(by_head_dim.values()), key=dataclasses.astuple)),
            "has_mask": ("false", "true"),
        },
        where=lambda row: any(t == row["tile"] for (d, _), t in by_head_dim.items() if d == row["head_dim"]),
        structs=(("cupy_attn::FlashFwdParams", _PARAMS),),
    )


FLASH_FWD = _mma_family("flash_fwd", _BY_HEAD_DIM, "false")

# Dropout tiles (the mma.sync kernel with kDropout = true; Hopper runs it too: the wgmma and FA3-design kernels have no
# dropout). The Philox draws of a row half (common/philox.cuh, ~60 integer instructions and ~8 live registers per
# block) sit next to the S and O accumulators: the 128-row tiles above, at 2 m tiles per warp, spilled 88-816 B with
# dropout at head dims 32-128 (sm_80 and sm_90), so those buckets take 64-row tiles (one m tile per warp: half the
# accumulators); 160-256 already run one m tile per warp and keep their tiles. Untimed.
_DROPOUT_BY_HEAD_DIM = {
    **_BY_HEAD_DIM,
    (32, 9): Tile(64, 128, 4, 2), (32, 8): Tile(64, 128, 4, 1),
    (64, 9): Tile(64, 128, 4, 2), (64, 8): Tile(64, 128, 4, 1),
    (96, 9): Tile(64, 64, 4, 2), (96, 8): Tile(64, 64, 4, 1),
    (128, 9): Tile(64, 64, 4, 2), (128, 8): Tile(64, 64, 4, 1),
}
DROPOUT_TILES = {(dtype, d, arch): tile for (d, arch), tile in _DROPOUT_BY_HEAD_DIM.items() for dtype in C_TYPE_16}

FLASH_FWD_DROPOUT = _mma_family("flash_fwd_dropout", _DROPOUT_BY_HEAD_DIM, "true")

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
    return _bucket(head_dim, head_dim_v, HEAD_DIMS)


ENV_WGMMA = "CUPY_ATTN_WGMMA"


# Hopper: buckets served faster by the wgmma kernel at a larger (zero-padded) head dim: 160 → 192 (measured faster at
# (8,16,1024,160)). 96 → 128 measured a tie and 32 → 64 slower (bench/notes/flash.md): not taken.
WGMMA_PADDED = {160: 192}


class Choice(NamedTuple):
    """The instantiation a call runs: its kernel family, tile and instantiated head dim."""
    family: KernelFamily
    tile: Tile
    head_dim: int


def select(dtype, head_dim: int, arch: int, dropout: bool = False) -> Choice:
    """This kernel's choice for a head-dim bucket (the plan's, made once): the sm_90a wgmma kernel on compute
    capability 9.0 when the bucket has a WGMMA_TILES entry (64, 128, 192, 256) or pads to one (WGMMA_PADDED: 160 →
    192) and ``CUPY_ATTN_WGMMA`` is not ``0``; else mma.sync at the bucket itself. ``dropout``: the mma.sync kernel's
    dropout variant (FLASH_FWD_DROPOUT, DROPOUT_TILES) on every arch.

    >>> select(np.dtype("float16"), 128, 80)[1:]
    (Tile(block_m=128, block_n=64, warps=4, stages=1, wgmma=False), 128)
    >>> select(np.dtype("float16"), 128, 90, dropout=True).family.name
    'flash_fwd_dropout'
    """
    if dropout:
        return Choice(FLASH_FWD_DROPOUT, DROPOUT_TILES[(dtype_name(dtype), head_dim, tile_arch(arch))], head_dim)
    if arch == 90 and env.get(ENV_WGMMA, "1") != "0":
        padded = WGMMA_PADDED.get(head_dim, head_dim)
        if padded in WGMMA_TILES:
            return Choice(FLASH_FWD_SM90A, WGMMA_TILES[padded], padded)
    return Choice(FLASH_FWD, TILES[(dtype_name(dtype), head_dim, tile_arch(arch))], head_dim)


def reason(p, arch: int) -> str | None:
    """None when this kernel runs a call of this kind (``p``: an SDPAProblem, or anything with its dtype, head_dim,
    head_dim_v and mask_kind) on compute capability ``arch``, else a short reason for explain().

    >>> import types
    >>> reason(types.SimpleNamespace(dtype=np.dtype("float32"), head_dim=64, head_dim_v=64, mask_kind="none"), 90)
    'fp32 is served by the split path'
    """
    name = dtype_name(p.dtype)
    if name == "float32":
        return "fp32 is served by the split path"
    if name not in C_TYPE_16:
        return f"dtype {name} has no fused kernel (fp16 and bf16 only)"
    if arch < 80:
        return f"sm_{arch} lacks the sm_80 tensor-core instructions (mma.sync m16n8k16 bf16, cp.async)"
    if p.head_dim < 1 or p.head_dim_v < 1:
        return "head dims must be at least 1"
    if head_dim_bucket(p.head_dim, p.head_dim_v) is None:
        return f"head dims E={p.head_dim}, Ev={p.head_dim_v}: the fused kernel is instantiated up to 256"
    if p.mask_kind not in ("none", "bool", "float"):
        return f"mask kind {p.mask_kind!r} is not one of none/bool/float"
    var = variants.of(p)
    if not var.plain:
        return (f"{', '.join(var.names())}: not in this kernel (the FA3-design kernel serves them on Hopper, the split "
                "path elsewhere)")
    return None


# A replay's arguments, the pointer fields of FlashFwdParams (which lists them first, in another order).
ARGS = ("q", "k", "v", "out", "lse", "mask")


def build(p, choice: Choice, out, lse) -> PreparedLaunch:
    """The launch of ``choice`` (:func:`select`'s, or a one-row family of another tile: bench_flash_fwd.py --sweep)
    for a problem this kernel serves (:func:`reason`), replayed as ``launch_on(stream, q, k, v, out, lse, mask)``.

    p: the checked problem (checks.SDPAProblem): q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) fp16 or bf16,
    last-dim stride 1, other strides free (read in place), GQA by head index (query head h reads kv head
    h // (Hq // Hkv)); mask None or a view broadcast to (B, Hq, L, S) (bool: True = attend; fp16/bf16/fp32: added to
    the scaled scores); dropout_p > 0: P dropped with the keep mask of p.rng (the call's int64 {seed, offset} device
    array, read by the kernel; cupy_attn/philox.py defines the mask), kept values scaled by 1/(1 − dropout_p), lse that
    of the undropped scores. out (B, Hq, L, Ev) in q's dtype, last-dim stride 1; lse None or (B, Hq, L) float32
    (natural log). FlashFwdParams comes from the shapes, strides and alignment (16 bytes for q/k/v rows, 4 for out
    pairs), not the addresses: the launch may be replayed on other arrays of the same layout (the call cache does),
    and with dropout on the same rng array. ValueError for a grid over the limit."""
    q, k, v, mask = p.query, p.key, p.value, p.mask
    B, Hq, L, E = q.shape
    _, Hkv, S, Ev = v.shape
    if Hq > 65535 or B > 65535:
        raise ValueError(f"fused attention: grid limit: heads {Hq} and batch {B} must each be <= 65535")
    family, tile, head_dim = choice
    kernel = family.kernel(dtype=C_TYPE_16[dtype_name(q.dtype)], head_dim=head_dim, tile=tile,
                           has_mask="false" if mask is None else "true")
    prm = np.zeros((), dtype=_PARAMS)
    prm["seqlen_q"], prm["seqlen_k"], prm["head_dim"], prm["head_dim_v"], prm["groups"] = L, S, E, Ev, Hq // Hkv
    prm["is_causal"] = p.causal is not None
    prm["causal_offset"] = p.causal_offset
    prm["mask_kind"] = 0 if mask is None else MASK_KIND[dtype_name(mask.dtype)]
    out_pairs = out.data.ptr % 4 == 0 and all(s % 2 == 0 for s in element_strides(out)[:-1])
    prm["vec_flags"] = rows16(q) | rows16(k) << 1 | rows16(v) << 2 | out_pairs << 3
    prm["scale_log2"] = float(p.scale) * LOG2E
    set_strides(prm, ("q", q, "bhl"), ("k", k, "bhs"), ("v", v, "bhs"), ("out", out, "bhl"), ("lse", lse, "bhl"),
                ("mask", mask, "bhls"))
    if p.dropout_p > 0:
        prm["rng"] = p.rng.data.ptr
        prm["dropout_threshold"] = philox.dropout_threshold(p.dropout_p)
        prm["dropout_scale"] = philox.dropout_scale(p.dropout_p)
    smem = tile.smem_bytes(head_dim)
    return PreparedLaunch(prm, [Step(kernel, (math.ceil(L / tile.block_m), Hq, B), (tile.warps * 32,), smem)],
                          args=ARGS, pointers={name: name for name in ARGS})
