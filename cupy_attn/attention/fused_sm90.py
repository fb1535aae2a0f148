"""The FlashAttention-3-design forward kernel for Hopper (cuda_src/attention/flash_fwd_sm90.cu).

TMA loads into an mbarrier K/V ring, a producer warpgroup and two ping-ponging consumer warpgroups. It serves fp16 and
bf16, head dims 33-256 (run at 64, 96, 128 or 256), no attn_mask, causal or not, GQA, on compute capability 9.0.
Variants, by ``CUPY_ATTN_FA3`` (dispatch.fa3_mode; unset, for calls of at least dispatch.FA3_MIN_FLOPS on Hopper:
"3"):

* ``1``: one 128-row tile per CTA, ping-pong consumers (SM90_TILES);
* ``2``: the same with FA3's intra-warpgroup overlap (SM90_OVERLAP_TILES);
* ``3``: ``2`` as a persistent kernel (SM90_PERSISTENT_TILES): min(#SMs, #work units) CTAs, each looping over its
  tiles in the static order of cuda_src/attention/sm90/tile_scheduler.cuh, the producer loading the next tile's Q and
  K/V during the current tile's epilogue (:func:`grid_for`). Measured 1.02-1.16x ``2`` on an H200, except 0.95x at
  (4,32,4096,64) (bench/NOTES_flash.md).

Non-causal calls at head dim 64 in modes ``2`` and ``3`` run FlashAttention-3's own hdim-64 tile, 192 rows with
three consumer warpgroups (M192_MODE_TILES, :func:`tile_for`); ``CUPY_ATTN_FA3_M192=1`` forces it for causal calls
too, ``0`` turns it off.

Everything else keeps flash_fwd.cu (``fused.prepare`` asks :func:`unsupported_reason` and :func:`layout_reason` first).

Tensor maps (cuTensorMapEncodeTiled, through ``cuda.bindings.driver``, imported lazily) embed the arrays' base
addresses, so a launch re-encodes them when the pointers change (the last three are remembered: replaying a call on
the same arrays encodes nothing). Each map is 4-D, (E, seqlen, heads, batch) with the arrays' own strides, so BHSD and
BSHD views are read in place; TMA requires a 16-byte aligned base and strides that are multiples of 16 bytes. The box
is one swizzle atom wide (:func:`swizzle_bytes`): 64 columns in the 128-byte swizzle, 32 in the 64-byte one (D = 96).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np

from ..runtime.compile import KernelFamily, OwnParams, launch_dims
from ..runtime.interop import device_sms, dtype_name

_C_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
_LOG2E = 1.4426950408889634
# CUPY_ATTN_FA3_M192: unset, head dim 64 in modes "2" and "3" runs the 192-row tile (three consumer warpgroups,
# M192_MODE_TILES) for non-causal calls; 1 forces it for causal calls too; 0 keeps the 128-row tile. Part of the call
# cache's key (bench/experiments/m192_ab.py is the A/B).
ENV_M192 = "CUPY_ATTN_FA3_M192"


@dataclasses.dataclass(frozen=True)
class Sm90Tile:
    """Query rows per block (block_m / 64 consumer warpgroups of 64 rows: two or three), key rows per K/V stage, stages
    in the ring."""
    block_m: int
    block_n: int
    stages: int = 2
    overlap: bool = False  # FA3's intra-warpgroup overlap (softmax of S_i during P_{i-1} V_{i-1}; mainloop.cuh)
    persistent: bool = False  # one CTA per SM looping over tiles (tile_scheduler.cuh); only with overlap

    @property
    def threads(self) -> int:
        """Threads per block: the producer warpgroup and block_m / 64 consumer warpgroups (384 or 512)."""
        return 128 * (self.block_m // 64 + 1)

    @property
    def overlap_flag(self) -> str:
        return "true" if self.overlap else "false"

    @property
    def persistent_flag(self) -> str:
        return "true" if self.persistent else "false"

    def smem_bytes(self, head_dim: int) -> int:
        """Q + stages × (K + V) tiles, the epilogue's O staging (per consumer warpgroup 64 rows × min(head_dim, 128)
        columns), 8 bytes per mbarrier (2 + 4·stages: q_full, q_empty and four per stage), with three consumer
        warpgroups 8 bytes per consumer thread (the row-sum anchor of the overlap mainloop), 1 KB of slack for the
        1024-byte alignment of the swizzle atoms: SharedStorage::kBytes in cuda_src/attention/sm90/mainloop.cuh."""
        sink = (self.threads - 128) * 8 if self.block_m == 192 else 0
        o_stage = (self.block_m // 64) * 64 * min(head_dim, 128) * 2
        return ((self.block_m + 2 * self.stages * self.block_n) * head_dim * 2 + o_stage + 8 * (2 + 4 * self.stages)
                + sink + 1024)


# (head dim) -> tile; both dtypes alike. Registers per consumer thread: S block_n/2 + O head_dim/2 fp32 + P block_n/4,
# under setmaxnreg's 240. Shared memory: Sm90Tile.smem_bytes of the 227 KB (232448 B) per block.
SM90_TILES = {
    # 128×128: 64 S + 32 O + 32 P registers; 81 KB.
    64: Sm90Tile(128, 128, 2),
    # 128×128: 64 S + 48 O + 32 P; 169 KB with 3 stages (121 KB with 2). 64-byte swizzle, P·V at N = 96
    # (FlashAttention-3's hdim-96 layout). A K/V stage is 3/4 of D = 128's GEMM work, so two stages give the loads
    # a quarter less time ahead of use; the third costs no occupancy (one CTA per SM either way: 384 threads at 168
    # registers fill the register file) and a `% 3` per ring index. Ev = 80 runs N = 96 too: a 64-byte-swizzled
    # MN-major B operand spans whole 32-column atoms (CUTLASS's canonical ((8,4,m),(8,k)) layout), N = 80 would be
    # 2.5; it would take V in the 32-byte swizzle and an 80 bucket of its own for 1/6 of the P·V work (unmeasured).
    96: Sm90Tile(128, 128, 3),
    # 128×128: 64 S + 64 O + 32 P; 161 KB.
    128: Sm90Tile(128, 128, 2),
    # 128×64: 32 S + 128 O + 16 P; 193 KB (kBlockN = 128 would need 321 KB for two stages).
    256: Sm90Tile(128, 64, 2),
}
# The same tiles with the intra-warpgroup overlap (CUPY_ATTN_FA3=2): the same registers (S stays fp32 while the
# previous P·V runs, P is packed after it) and shared memory.
SM90_OVERLAP_TILES = {d: dataclasses.replace(tile, overlap=True) for d, tile in SM90_TILES.items()}
# The overlap tiles as a persistent kernel (CUPY_ATTN_FA3=3): the same shared memory (q_empty is in every variant's
# barrier block), a few consumer registers for the tile loop.
SM90_PERSISTENT_TILES = {d: dataclasses.replace(tile, persistent=True) for d, tile in SM90_OVERLAP_TILES.items()}
# CUPY_ATTN_FA3 mode (dispatch.fa3_mode) -> its tile table.
MODE_TILES = {"1": SM90_TILES, "2": SM90_OVERLAP_TILES, "3": SM90_PERSISTENT_TILES}
# FlashAttention-3's head-dim-64 tile for causal calls (hopper/tile_size.h: 192 × 128, three consumer warpgroups + the
# producer, 512 threads; FA3 runs 192 × 192 with P through shared memory when not causal), the default for
# non-causal calls in modes "2" and "3" (:func:`tile_for`). Registers: setmaxnreg 32 for the producer, 160 for
# the consumers (128·32 + 384·160 = 65536; S 64 + O 32 + P 32 registers as in the 128-row tile, 80 fewer of headroom;
# no spills). Shared memory 116 KB: Q 24 KB + 2 stages × (K + V) 64 KB + 24 KB of O staging (epilogue.cuh) +
# barriers + the 3 KB row-sum anchor (mainloop.cuh) + 1 KB. At D = 64 the per-block softmax is large against the two
# GEMMs; a third warpgroup keeps the tensor cores fed while two others run theirs (bench/NOTES_flash.md, sessions 8-9:
# 1.09-1.15× the 128-row tile on non-causal calls, 0.82-1.06× on causal ones).
M192_MODE_TILES = {"2": {64: Sm90Tile(192, 128, 2, overlap=True)},
                   "3": {64: Sm90Tile(192, 128, 2, overlap=True, persistent=True)}}


def tile_for(mode: str, head_dim: int, causal: bool = False) -> Sm90Tile:
    """The tile a call of this mode ("1", "2", "3"), head-dim bucket and causality runs: the 192-row tile of
    M192_MODE_TILES (head dim 64, modes "2" and "3") for non-causal calls, else MODE_TILES[mode][head_dim].
    CUPY_ATTN_FA3_M192=1 forces the 192-row tile where there is one (causal calls too), 0 turns it off.

    Measured on an H200 (session 9, bench/experiments/m192_ab.py, same process, rounds rotated; × the 128-row tile in
    its mode, fp16): non-causal (4,32,4096,64) 1.09-1.10×, (8,16,2048,64) 1.12-1.15×, (16,16,1024,64) 1.05-1.11×;
    causal 0.82-1.06× (a 192-row tile masks more on the diagonal blocks), so causal calls keep 128 rows.

    >>> tile_for("2", 64).block_m, tile_for("3", 64, causal=True).block_m, tile_for("3", 128).block_m
    (192, 128, 128)
    """
    env = os.environ.get(ENV_M192)
    if env == "1" or (env != "0" and not causal):
        tile = M192_MODE_TILES.get(mode, {}).get(head_dim)
        if tile is not None:
            return tile
    return MODE_TILES[mode][head_dim]


def _all_tables() -> tuple:
    return (*MODE_TILES.values(), *M192_MODE_TILES.values())


def _c_struct(fields) -> np.dtype:
    """A NumPy dtype laid out as the C struct with these (name, dtype, alignment) members, in order."""
    offsets, off, align = [], 0, 1
    for _, dt, a in fields:
        off = -(-off // a) * a
        offsets.append(off)
        off += dt.itemsize
        align = max(align, a)
    return np.dtype({"names": [f[0] for f in fields], "formats": [f[1] for f in fields], "offsets": offsets,
                     "itemsize": -(-off // align) * align})


_MAP = np.dtype((np.uint8, 128))
_I64, _F64 = np.dtype(np.int64), np.dtype(np.float64)
# FlashFwdSm90Params (cuda_src/attention/sm90/params.cuh), declared once here: its size and field sizes are asserted
# at compile time (KernelFamily.structs), its field order by tests/test_structs.py.
_PARAMS = _c_struct([("tma_q", _MAP, 64), ("tma_k", _MAP, 64), ("tma_v", _MAP, 64), ("tma_o", _MAP, 64)]
                    + [(n, _F64 if n in ("scale_log2", "softcap_in", "alibi_scale") else _I64, 8) for n in (
                        "out", "lse", "seqlen_q", "seqlen_k", "head_dim_v", "groups", "is_causal", "causal_offset",
                        "scale_log2", "out_stride_b", "out_stride_h", "out_stride_l",
                        "lse_stride_b", "lse_stride_h", "lse_stride_l", "batch", "num_heads", "tile_pairs",
                        "o_tma", "window_lo", "sinks", "sinks_kind", "softcap_in", "alibi_slopes", "alibi_stride_b",
                        "alibi_scale")])
# Columns of Q and K the S GEMM reads (qk_dim) besides the bucket itself: E = 65-80 in the 96 bucket skips the zero-
# filled k step (5 of 6); E = 65-80 and 81-96 with Ev = 97-128 in the 128 bucket skip 3 or 2 of 8 (P·V keeps
# N = 128). Other E run every k step of their bucket.
SM90_QK_DIMS = {96: (80,), 128: (80, 96)}
FLASH_FWD_SM90_TMA = KernelFamily(
    name="flash_fwd_sm90_tma",
    source="attention/flash_fwd_sm90.cu",
    template=("cupy_attn::flash_fwd_sm90<{dtype}, {head_dim}, {tile.block_m}, {tile.block_n}, {tile.stages}, "
              "{tile.overlap_flag}, {tile.persistent_flag}, {qk_dim}, {variants}>"),
    axes={
        "dtype": tuple(_C_TYPES.values()),
        "head_dim": tuple(SM90_TILES),
        "tile": tuple(sorted({t for table in _all_tables() for t in table.values()}, key=dataclasses.astuple)),
        "qk_dim": tuple(sorted(set(SM90_TILES) | {d for dims in SM90_QK_DIMS.values() for d in dims})),
        "variants": ("false", "true"),
    },
    where=lambda row: (any(row["tile"] == table.get(row["head_dim"]) for table in _all_tables())
                       and (row["qk_dim"] == row["head_dim"] or row["qk_dim"] in SM90_QK_DIMS.get(row["head_dim"], ()))
                       and (row["variants"] == "false" or (row["tile"].persistent and row["qk_dim"] == row["head_dim"]))),
    archs=("sm_90a",),
    structs=(("cupy_attn::FlashFwdSm90Params", _PARAMS),),
    arch="sm_90a",
)


def head_bucket(head_dim: int, head_dim_v: int) -> int | None:
    """The instantiated head dim (64, 96, 128 or 256) a call runs at: the smallest ≥ max(E, Ev), for 33 ≤ E, Ev ≤ 256;
    None otherwise. Q, K and V are padded by TMA itself: the tensor maps keep the real E (Ev), and a box past it is
    zero-filled, so E = 80 runs the D = 96 kernel on zeros beyond column 80 (no copy); the epilogue stores Ev columns.
    The S GEMM skips the zero k steps (:func:`qk_dim`); P·V pays the padding (Ev 80 → 96: 1.2×, against 1.6× in the
    128 bucket that served E = 80 before the 96 one). Head dims ≤ 32 stay on flash_fwd.cu (2× padding).

    >>> head_bucket(80, 80), head_bucket(96, 64), head_bucket(72, 128), head_bucket(160, 160), head_bucket(32, 32)
    (96, 96, 128, 256, None)
    """
    need = max(head_dim, head_dim_v)
    if min(head_dim, head_dim_v) < 1 or need <= 32:
        return None
    return next((d for d in sorted(SM90_TILES) if d >= need), None)


def qk_dim(head_dim: int, bucket: int) -> int:
    """The S GEMM's columns for query/key head dim E in this bucket: the smallest of SM90_QK_DIMS[bucket] ≥ E, else
    the bucket.

    >>> qk_dim(80, 96), qk_dim(72, 96), qk_dim(96, 96), qk_dim(72, 128), qk_dim(100, 128), qk_dim(160, 256)
    (80, 80, 96, 80, 128, 256)
    """
    return next((d for d in SM90_QK_DIMS.get(bucket, ()) if d >= head_dim), bucket)


def swizzle_bytes(head_dim: int) -> int:
    """The shared-memory swizzle of a bucket's tiles, in bytes: 128 when a row (head_dim · 2 bytes) is a multiple of
    128 bytes, else 64 (CuTe's smem selector, as FlashAttention-3 picks it); TMA boxes are one atom wide
    (swizzle_bytes / 2 columns). The kernel's rule: SharedStorage::kSwizzleBytes in
    cuda_src/attention/sm90/mainloop.cuh.

    >>> [swizzle_bytes(d) for d in (64, 96, 128, 256)]
    [128, 64, 128, 128]
    """
    return 128 if head_dim * 2 % 128 == 0 else 64


def unsupported_reason(dtype, head_dim: int, head_dim_v: int, mask_kind: str, arch: int, scale: float) -> str | None:
    """None when this kernel can serve a call of this kind (layout still to check: :func:`layout_reason`).

    >>> unsupported_reason(np.dtype("float16"), 32, 32, "none", 90, 0.1)
    'head dims E=32, Ev=32: the FA3 kernel serves head dims 33-256 (padded to (64, 96, 128, 256))'
    """
    if arch != 90:
        return f"sm_{arch}: the FA3 kernel needs sm_90a (H100/H200)"
    if dtype_name(dtype) not in _C_TYPES:
        return f"dtype {dtype_name(dtype)}: the FA3 kernel serves fp16 and bf16"
    if head_bucket(head_dim, head_dim_v) is None:
        return (f"head dims E={head_dim}, Ev={head_dim_v}: the FA3 kernel serves head dims 33-256 (padded to "
                f"{tuple(SM90_TILES)})")
    if mask_kind != "none":
        return "attn_mask: the FA3 kernel has no mask input (causal only)"
    if not scale > 0:
        return f"scale {scale}: the FA3 kernel folds the scale into exp2 and needs scale > 0"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return "cuda-bindings is not installed (cuTensorMapEncodeTiled)"
    return None


def _estrides(a) -> list[int]:
    return [s // a.itemsize for s in a.strides]


def tma_operand_reason(name: str, a) -> str | None:
    """None when TMA can read the (B, H, S, D) array ``a`` in place (16-byte aligned base; batch / head / row strides
    positive multiples of 16 bytes below 2^40, axes of size 1 aside), else why not, naming it ``name``."""
    if a.data.ptr % 16:
        return f"{name} is not 16-byte aligned (TMA)"
    for axis, (n, s) in zip("bhs", zip(a.shape[:-1], a.strides[:-1])):
        if n > 1 and (s % 16 or s <= 0 or s >= 2 ** 40):
            return f"{name} stride along {axis} is {s} bytes: TMA needs a positive multiple of 16 below 2^40"
    return None


def out_16b_reason(out, kernel: str = "the kernel") -> str | None:
    """None when ``kernel`` can store out's rows by 16-byte stores (16-byte aligned base, row / head / batch strides
    multiples of 8 elements, unit column stride), else why not."""
    if out.data.ptr % 16 or any(s % 8 for s in _estrides(out)[:-1]) or out.strides[-1] != out.itemsize:
        return f"out rows are not 16-byte aligned ({kernel} stores 16 bytes at a time)"
    return None


def layout_reason(q, k, v, out) -> str | None:
    """None when TMA can read q, k, v in place and the epilogue can store out: 16-byte aligned bases, batch / head /
    row strides multiples of 16 bytes (any order: BHSD and BSHD), element pairs of out 4-byte aligned (out=None:
    not checked)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        why = tma_operand_reason(name, a)
        if why is not None:
            return why
    if out is not None and (out.data.ptr % 4 or any(s % 2 for s in _estrides(out)[:-1])):
        return "out element pairs are not 4-byte aligned"
    if q.shape[1] > 65535 or q.shape[0] > 65535:
        return "grid limit: heads and batch must each be <= 65535"
    return None


def grid_for(tile: Sm90Tile, B: int, Hq: int, L: int, causal: bool, num_sms: int) -> tuple[tuple, bool]:
    """(grid, tile_pairs) of a launch. One tile per CTA: (⌈L / block_m⌉, Hq, B). Persistent: min(num_sms, units) CTAs
    that stride over the work units of sm90/tile_scheduler.cuh; causal calls with more tiles than SMs pair the m-blocks
    (M−1−k, k) of a head into units of equal cost (tile_pairs), others have one m-block per unit.

    Examples on 132 SMs: (2, 16, 8192) causal: 64 m-blocks per head, 2048 tiles → 1024 pairs, 132 CTAs of 7-8 pairs
    (the last round 100 of 132 busy: makespan 8 pairs against 7.76 ideal, 1.03); (1, 8, 1024) causal: 64 tiles, one
    per CTA, no pairs; (8, 16, 2048) not causal: 2048 tiles, 132 CTAs of 15-16.

    >>> t = SM90_PERSISTENT_TILES[128]
    >>> grid_for(t, 2, 16, 8192, True, 132), grid_for(t, 1, 8, 1024, True, 132), grid_for(t, 8, 16, 2048, False, 132)
    (((132, 1, 1), True), ((64, 1, 1), False), ((132, 1, 1), False))
    >>> grid_for(SM90_OVERLAP_TILES[128], 2, 16, 8192, True, 132)
    ((64, 16, 2), False)
    >>> grid_for(M192_MODE_TILES["3"][64], 4, 32, 4096, True, 132), grid_for(M192_MODE_TILES["2"][64], 1, 1, 1000, False, 132)
    (((132, 1, 1), True), ((6, 1, 1), False))
    """
    m_blocks = -(-L // tile.block_m)
    if not tile.persistent:
        return (m_blocks, Hq, B), False
    pairs = causal and m_blocks * Hq * B > num_sms
    units = Hq * B * (-(-m_blocks // 2) if pairs else m_blocks)
    return (min(num_sms, units), 1, 1), pairs


def prepare(q, k, v, out, lse, *, scale: float, causal: str | None, mode: str = "1") -> "Sm90Launch":
    """The launch of this kernel for arrays already checked by fused.prepare and accepted by unsupported_reason and
    layout_reason; mode: the variant, a key of MODE_TILES ("1" ping-pong, "2" intra-warpgroup overlap, "3" overlap
    and persistent)."""
    B, Hq, L, E = q.shape
    _, Hkv, S, Ev = v.shape
    D = head_bucket(E, Ev)
    tile = tile_for(mode, D, causal is not None)
    kernel = FLASH_FWD_SM90_TMA.kernel(dtype=_C_TYPES[dtype_name(q.dtype)], head_dim=D, tile=tile,
                                       qk_dim=qk_dim(E, D), variants="false")
    smem = tile.smem_bytes(D)
    if kernel.max_dynamic_shared_size_bytes < smem:
        kernel.max_dynamic_shared_size_bytes = smem
    p = np.zeros((), dtype=_PARAMS)
    p["seqlen_q"], p["seqlen_k"], p["head_dim_v"], p["groups"] = L, S, Ev, Hq // Hkv
    p["is_causal"] = causal is not None
    p["causal_offset"] = S - L if causal == "bottom_right" else 0
    p["scale_log2"] = float(scale) * _LOG2E
    p["window_lo"] = -(1 << 40)
    num_sms = 0
    if tile.persistent:
        import cupy
        num_sms = device_sms(cupy.cuda.Device().id)
    grid, pairs = grid_for(tile, B, Hq, L, causal is not None, num_sms)
    p["batch"], p["num_heads"], p["tile_pairs"] = B, Hq, pairs
    for axis, stride in zip("bhl", _estrides(out)):
        p[f"out_stride_{axis}"] = stride
    if lse is not None:
        for axis, stride in zip("bhl", _estrides(lse)):
            p[f"lse_stride_{axis}"] = stride
    cols = swizzle_bytes(D) // 2
    maps = tuple(_MapSpec.of(a, rows, cols) for a, rows in ((q, tile.block_m), (k, tile.block_n), (v, tile.block_n)))
    # The epilogue stores out by TMA (through shared memory) where TMA can write it exactly: Ev a multiple of 8 (the
    # 16-byte chunk at the Ev edge stays inside the row) and 16-byte row, head and batch strides; the base's
    # alignment is checked per launch (Sm90Launch.launch_on). Else 4-byte stores from registers.
    o_map = None
    if o_tma_reason(out) is None:
        o_map = _MapSpec.of(out, 64, cols)
    return Sm90Launch(kernel, p, maps, grid, (tile.threads,), smem, o_map)


def o_tma_reason(out) -> str | None:
    """None when the epilogue can store ``out`` (B, Hq, L, Ev) by TMA at a 16-byte aligned base, else why not."""
    if out.shape[-1] % 8:
        return f"head_dim_v {out.shape[-1]} is not a multiple of 8"
    for axis, (n, st) in zip("bhl", zip(out.shape[:-1], out.strides[:-1])):
        if n > 1 and (st % 16 or st <= 0 or st >= 2 ** 40):
            return f"out stride along {axis} is {st} bytes"
    if out.strides[-1] != out.itemsize:
        return "out's last dimension is not contiguous"
    return None


@dataclasses.dataclass(frozen=True)
class _MapSpec:
    """Everything of one tensor map but its base address: element type, dims (E, seqlen, heads, batch), byte strides
    of the last three, box (box_cols, rows, 1, 1): one swizzle atom wide (64 columns: 128-byte swizzle; 32: 64-byte)."""
    dtype: str
    dims: tuple
    strides: tuple
    box_rows: int
    box_cols: int = 64

    @classmethod
    def of(cls, a, rows: int, cols: int = 64) -> "_MapSpec":
        b, h, s, e = a.shape
        # A stride along an axis of size 1 is never used, but the driver checks it (a multiple of 16): give such an
        # axis the packed stride, rounded up to 16 bytes. layout_reason checked the others.
        strides, extent = [], e * a.itemsize
        for n, st in ((s, a.strides[2]), (h, a.strides[1]), (b, a.strides[0])):
            st = st if n > 1 else -(-extent // 16) * 16
            strides.append(st)
            extent = st * n
        return cls(dtype_name(a.dtype), (e, s, h, b), tuple(strides), rows, cols)

    def encode(self, ptr: int) -> np.ndarray:
        """The 128-byte CUtensorMap for this layout at base address ptr."""
        return encode_tensor_map(self.dtype, ptr, self.dims, self.strides, (self.box_cols, self.box_rows, 1, 1))


@functools.lru_cache(maxsize=None)
def _driver_init() -> None:
    """cuInit through cuda.bindings, once (CuPy has initialized the driver already; this is for cuda.bindings' own
    entry points, as the CuTe GEMM example does)."""
    from cuda.bindings import driver as cu
    cu.cuInit(0)


def encode_tensor_map(dtype: str, ptr: int, dims, strides, box, swizzle: int | None = None) -> np.ndarray:
    """cuTensorMapEncodeTiled: a 16-bit tensor in the swizzle as wide as a box row (box inner dim 64 elements = 128
    bytes: SWIZZLE_128B; 32 = 64 bytes: SWIZZLE_64B, the head-dim-96 tiles), or a float32 one unswizzled (rows of
    statistics; box inner dim a multiple of 4 elements) unless ``swizzle=128`` (box inner dim 32 elements, 128 bytes:
    the backward's dQ staging); zero fill out of bounds, L2 promotion of 256 bytes.
    ``strides``: byte strides of dims[1:]. Returns the map's 128 bytes. ValueError for another 16-bit box width.
    The binding's argument objects are built once per layout (``_encode_args``): a call on a new base address only
    converts the address."""
    import ctypes
    from cuda.bindings import driver as cu

    args = _encode_args(dtype, tuple(dims), tuple(strides), tuple(box), swizzle)
    err, tmap = cu.cuTensorMapEncodeTiled(args[0], args[1], ptr, *args[2:])
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}): dims {dims}, byte strides {strides}, box {box}")
    return np.frombuffer(ctypes.string_at(tmap.getPtr(), 128), np.uint8)


@functools.lru_cache(maxsize=1024)
def _encode_args(dtype: str, dims: tuple, strides: tuple, box: tuple, swizzle_bytes: int | None = None) -> tuple:
    """cuTensorMapEncodeTiled's arguments but the base address, as cuda.bindings objects (see encode_tensor_map)."""
    from cuda.bindings import driver as cu

    _driver_init()
    types = cu.CUtensorMapDataType
    data_type = {"float16": types.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, "bfloat16": types.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                 "float32": types.CU_TENSOR_MAP_DATA_TYPE_FLOAT32}[dtype]
    swizzles = {128: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                64: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B}
    if dtype == "float32":
        if swizzle_bytes is None:
            swizzle = cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE
        elif swizzle_bytes == 128 and box[0] * 4 == 128:
            swizzle = swizzles[128]
        else:
            raise ValueError(f"box {box}, swizzle {swizzle_bytes}: a swizzled float32 map's box rows are 32 elements")
    elif box[0] * 2 in swizzles:
        swizzle = swizzles[box[0] * 2]
    else:
        raise ValueError(f"box {box}: a 16-bit tensor map's box rows are 64 or 128 bytes (the swizzle width)")
    return (data_type, len(dims), [cu.cuuint64_t(d) for d in dims], [cu.cuuint64_t(s) for s in strides],
            [cu.cuuint32_t(x) for x in box], [cu.cuuint32_t(1)] * len(dims),
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


class TensorMaps:
    """Tensor maps of fixed layouts at base addresses that change between calls: ``maps(*ptrs)`` returns one encoded
    map per encoder (a callable ptr -> the map's 128 bytes, e.g. _MapSpec.encode), encoding again only when the bases
    differ from the last call's (~4 µs a map through cuda.bindings; a call replayed on the same arrays encodes
    nothing). The last (bases, maps) pair is replaced as one tuple, so a concurrent caller sees the old pair or the
    new one, never a mix."""

    __slots__ = ("encoders", "_last")

    def __init__(self, encoders):
        self.encoders = tuple(encoders)
        self._last = (None, None)

    def __call__(self, *ptrs: int) -> tuple:
        bases, maps = self._last
        if bases != ptrs:
            maps = tuple(encode(ptr) for encode, ptr in zip(self.encoders, ptrs))
            self._last = (ptrs, maps)
        return maps


class ParamMaps:
    """Tensor maps kept in a launch's own parameter bytes (runtime.compile.OwnParams) at fixed byte offsets:
    ``write(*ptrs)`` encodes them again only when a base moved (TensorMaps) and copies the 128 bytes of each into the
    parameter bytes only when they changed. Called under the OwnParams lock."""

    __slots__ = ("_maps", "_bytes", "_offsets", "_written")

    def __init__(self, encoders, own, offsets):
        self._maps = TensorMaps(encoders)
        self._bytes = own.bytes
        self._offsets = tuple(offsets)
        self._written = None

    def write(self, *ptrs: int) -> None:
        maps = self._maps(*ptrs)
        if maps is not self._written:
            for off, m in zip(self._offsets, maps):
                self._bytes[off:off + 128] = m
            self._written = maps


@dataclasses.dataclass
class Sm90Launch:
    """One prepared launch: the parameters but the pointers and tensor maps, the map layouts, grid, block, smem.
    Called like fused.FlashLaunch (mask_ptr must be 0)."""

    kernel: object
    params: np.ndarray
    maps: tuple
    grid: tuple
    block: tuple
    smem: int
    o_map: object = None  # _MapSpec of out when the epilogue may store it by TMA (prepare), else None

    def __post_init__(self):
        # Resolved once, on the device the launch is built for (fused.FlashLaunch's scheme): this launch's own copy of
        # the parameter bytes with its kernelParams array and lock (OwnParams), the CUfunction, the launch dimensions.
        from cupy.cuda import driver
        self._o_maps = TensorMaps((self.o_map.encode,)) if self.o_map is not None else None
        self._launch = driver.launchKernel
        self._own = OwnParams(self.params)
        fields = self.params.dtype.fields
        self._maps = ParamMaps((spec.encode for spec in self.maps), self._own,
                               (fields[name][1] for name in ("tma_q", "tma_k", "tma_v")))
        self._o_map_offset = fields["tma_o"][1]
        self._o_tma_word = fields["o_tma"][1] // 8
        self._o_written = None
        self._out_word = fields["out"][1] // 8
        assert fields["lse"][1] == fields["out"][1] + 8
        self._fn_ptr = int(self.kernel.kernel.ptr)
        self._dims = launch_dims(self.grid, self.block, self.smem)
        if self.kernel.max_dynamic_shared_size_bytes < self.smem:
            self.kernel.max_dynamic_shared_size_bytes = self.smem

    def __call__(self, q_ptr: int, k_ptr: int, v_ptr: int, out_ptr: int, lse_ptr: int = 0, mask_ptr: int = 0) -> None:
        """Launch on CuPy's current stream (see :meth:`launch_on`)."""
        from .fused import _current_stream_ptr
        self.launch_on(_current_stream_ptr(), q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, mask_ptr)

    def launch_on(self, stream_ptr: int, q_ptr: int, k_ptr: int, v_ptr: int, out_ptr: int, lse_ptr: int = 0,
                  mask_ptr: int = 0) -> None:
        """cuLaunchKernel on a raw stream handle, on the device the launch was built for (which must be current):
        the three tensor maps (encoded again only when q, k or v moved, see TensorMaps; written into the parameter
        bytes only when they changed) and the out and lse words go into this launch's own parameter buffer, which the
        driver copies during the call; the lock keeps two threads replaying one launch from interleaving their
        writes. ~1 µs of host time for the launch against ~6 through CuPy's RawKernel call and a per-call copy of the
        704-byte struct."""
        if mask_ptr:
            raise ValueError("the FA3 kernel takes no attn_mask")
        own = self._own
        with own.lock:
            self._maps.write(q_ptr, k_ptr, v_ptr)
            own.words[self._out_word:self._out_word + 2] = (out_ptr, lse_ptr)
            # out by TMA where prepare allowed it and this call's base is 16-byte aligned (its map encoded again only
            # when out moved).
            o_tma = self._o_maps is not None and out_ptr % 16 == 0
            if o_tma:
                (o_map,) = self._o_maps(out_ptr)
                if o_map is not self._o_written:
                    own.bytes[self._o_map_offset:self._o_map_offset + 128] = o_map
                    self._o_written = o_map
            own.words[self._o_tma_word] = int(o_tma)
            self._launch(self._fn_ptr, *self._dims, stream_ptr, own.argv_ptr, 0)
