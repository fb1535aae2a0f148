"""Split-KV attention for short queries, the decode path's kernels (Flash-Decoding; cuda_src/attention/flash_decode.cu).

Three kernel families from one source: ``FLASH_DECODE`` (dtype × head-dim bucket × tile × has-mask; one CTA per split
× (kv head, 16 packed query rows) × batch, K/V by cp.async), ``FLASH_DECODE_SM90`` (the same work and math, K/V by TMA
into an mbarrier ring fed by a producer warp; sm_90a) and ``FLASH_DECODE_COMBINE`` (dtype; merges the splits' fp32
partials by their lse). The query heads that share a K/V head are packed into the rows of one tile (GQA), so K/V is
read once. The decode kernel's choices, each made once by the plan (dispatch) through :func:`choose`:
``prefer_decode`` says when the plan takes the decode path, ``choose_kernel`` which of the two kernels
(``CUPY_ATTN_DECODE``: 0 off, 1 flash_decode, 2 and 3 flash_decode_sm90 with one or two CTAs per SM; unset:
``DEFAULT_VARIANT``) and, for flash_decode, its 4- or 8-warp tile (``CUPY_ATTN_DECODE_WARPS``: 4 or 8; unset:
``use_wide_tile``, 8 warps where the grid has about one CTA per SM or fewer), ``split_plan`` how many splits of how
many keys. :func:`build` prepares the launch of a :class:`DecodeChoice`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

from ...runtime import env, workspace
from ...runtime.compile import KernelFamily, source_dir
from ...runtime.interop import dtype_name
from ...runtime.kernel_abi import C_TYPE_16, LOG2E, MASK_KIND, head_dim_bucket as _bucket, rows16, set_strides, \
    tile_arch
from ...runtime.launch import Maps, PreparedLaunch, Scratch, Step, field_offset, pdl_supported
from ...runtime.tma import MAP, MapSpec, bindings_reason, c_struct, tma_operand_reason
from . import flash_fwd

HEAD_DIMS = (64, 128, 256)   # buckets; E, Ev are zero-padded up to one (bytes read stay E·2 and Ev·2 per key)
ROWS = 16                    # packed query rows per CTA (one mma m16 tile)
ENV_DECODE = "CUPY_ATTN_DECODE"
ENV_WARPS = "CUPY_ATTN_DECODE_WARPS"  # flash_decode's tile: "4" (TILES), "8" (WIDE_TILES); unset: use_wide_tile
WIDE_MAX_WAVES = 1.5                  # use_wide_tile: 8 warps up to this many CTAs per SM
MAX_SPLITS = 128
ONE_SPLIT_FILL = 0.45                 # split_plan: one split once B·Hkv·row blocks ≥ this fraction of the SMs
PDL = True  # the combine kernel as a programmatic dependent of the split kernel on sm_90+ (bench/notes/decode.md)
ARGS = ("q", "k", "v", "out", "lse", "mask")  # a replay's arguments: FlashDecodeParams' first six pointers


@dataclasses.dataclass(frozen=True)
class DecodeTile:
    """Launch shape: key rows per tile (block_n / warps keys per warp, a multiple of 16), warps, K/V buffers
    (stages - 1 tiles in flight), and the CTAs per SM it allows (for num_splits_for; shared memory is the limit)."""
    block_n: int
    warps: int
    stages: int
    ctas_per_sm: int = dataclasses.field(default=1, compare=False)  # not a template value

    def smem_bytes(self, head_dim: int) -> int:
        """Slack to align the base to a row (head_dim · 2 bytes), stages × (K and V tiles, unpadded swizzled rows), Q
        (16 rows padded by 8 elements): the kernel header."""
        return head_dim * 2 + 2 * self.stages * self.block_n * head_dim * 2 + ROWS * (head_dim + 8) * 2


# (head-dim bucket, arch major) -> DecodeTile. Hopper: 227 KB per block, 228 KB per SM; arch 8 must fit the 99 KB of
# sm_86/sm_89 (and is untimed). Decode is memory-bound, so the entries maximize bytes in flight per SM:
# (stages - 1) · block_n · 2 · D · 2 bytes per CTA × CTAs per SM. (Sizes are DecodeTile.smem_bytes.)
TILES = {
    # D=64: 4 stages, 66 KB: 2 CTAs/SM (3 by shared memory; 2 assumed for the split rule), 2 × 3 × 16 KB in flight.
    (64, 9): DecodeTile(64, 4, 4, 2), (64, 8): DecodeTile(64, 4, 4, 1),
    # D=128: 3 stages, 101 KB: 2 CTAs/SM on Hopper, 2 × 2 × 32 KB in flight (4 stages, 133 KB, would allow 1).
    # Arch 8: 2 stages, 69 KB.
    (128, 9): DecodeTile(64, 4, 3, 2), (128, 8): DecodeTile(64, 4, 2, 1),
    # D=256: 3 stages, 201 KB: 1 CTA/SM, 2 × 64 KB in flight. Arch 8: 32 keys over 2 warps, 2 stages, 73 KB.
    (256, 9): DecodeTile(64, 4, 3, 1), (256, 8): DecodeTile(32, 2, 2, 1),
}

# (head-dim bucket, arch major) -> flash_decode's 8-warp tile, for grids of about one CTA per SM or fewer
# (use_wide_tile): there a 4-warp CTA leaves each of the SM's 4 schedulers one warp, and the loop is issue-bound
# (IPC 1.15 at 4 warps per SM, bench/notes/decode.md). 128 keys per tile, 16 per warp: each warp's work
# per tile is the 4-warp tile's (the same loop), and the SM holds 8 warps, 2 per scheduler. One CTA per SM (shared
# memory), (stages - 1) · 128 keys in flight: D=128 3 stages, 197 KB, 2 × 64 KB in flight (4 stages would be 261 KB);
# D=64 4 stages, 130 KB, 3 × 32 KB. D=256 has none (two 128-key stages alone are 256 KB), nor arch 8 (99 KB on
# sm_86/sm_89: one 128-key stage at D=128 is 64 KB).
WIDE_TILES = {
    (64, 9): DecodeTile(128, 8, 4, 1), (128, 9): DecodeTile(128, 8, 3, 1),
}


@dataclasses.dataclass(frozen=True)
class StreamTile:
    """flash_decode_sm90's launch shape: key rows per ring stage (block_n / warps per consumer warp, a multiple of 16),
    consumer warps (plus one producer warp), ring stages, and the CTAs per SM it is built for (a template value:
    __launch_bounds__' minimum blocks)."""
    block_n: int
    warps: int
    stages: int
    ctas_per_sm: int

    @property
    def threads(self) -> int:
        return (self.warps + 1) * 32

    def smem_bytes(self, head_dim: int) -> int:
        """1 KB of alignment slack (the swizzle's 1024-byte atoms), stages × (K and V tiles, unpadded), Q (16 rows
        padded by 8 elements), two mbarriers per stage: StreamSmem::kBytes in cuda_src/attention/flash_decode.cu."""
        return 1024 + 2 * self.stages * self.block_n * head_dim * 2 + ROWS * (head_dim + 8) * 2 + 16 * self.stages

    def in_flight_bytes(self, head_dim: int) -> int:
        """K+V bytes a CTA keeps in flight while one stage is being consumed: (stages - 1) tiles."""
        return (self.stages - 1) * 2 * self.block_n * head_dim * 2


# (variant, head-dim bucket) -> StreamTile, Hopper only (227 KB per block, 228 KB per SM, 1 KB of it reserved per
# block). "stream" (CUPY_ATTN_DECODE=2): one CTA per SM and the deepest ring that fits, 160-192 KB of K/V in flight
# per SM; "stream2" (=3): two CTAs per SM of half the ring, so that one CTA's start (first TMA latency) and end (merge,
# stores) overlap the other's stream. Registers are no limit (160 threads).
STREAM_TILES = {
    # D=64: 128 keys (32 per warp), 6 × 32 KB stages, 195 KB.    D=128: 64 keys, 6 × 32 KB, 197 KB.
    # D=256: 64 keys, 3 × 64 KB, 201 KB (the merge scratch, 4 × 16 × 258 × 4 bytes, reuses the ring).
    ("stream", 64): StreamTile(128, 4, 6, 1), ("stream", 128): StreamTile(64, 4, 6, 1),
    ("stream", 256): StreamTile(64, 4, 3, 1),
    # Two per SM: D=64 128 keys × 3 stages, 99 KB; D=128 64 keys × 3, 101 KB; D=256 32 keys over 2 warps × 3, 105 KB.
    ("stream2", 64): StreamTile(128, 4, 3, 2), ("stream2", 128): StreamTile(64, 4, 3, 2),
    ("stream2", 256): StreamTile(32, 2, 3, 2),
}
VARIANTS = {"1": "v1", "2": "stream", "3": "stream2"}  # CUPY_ATTN_DECODE value -> variant ("0": decode path off)
DEFAULT_VARIANT = "v1"  # unset CUPY_ATTN_DECODE; the streaming variant is opt-in until measured


def _params_dtype(source: str, struct: str = "FlashDecodeParams") -> np.dtype:
    """The NumPy structured dtype of a C struct in ``source`` whose fields are all 8 bytes wide (pointers, long long,
    double), parsed from its declaration: the struct is declared once, in the .cu file.

    >>> _params_dtype("struct P { float* out;  long long a, b; double s; };", "P").names
    ('out', 'a', 'b', 's')
    """
    body = re.search(r"struct\s+" + struct + r"\s*\{(.*?)\};", source, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        m = re.fullmatch(r"((?:const\s+)?(?:void|float|int)\s*\*|long long|double)\s*(.+)", decl, re.S)
        if m is None:
            raise ValueError(f"{struct}: cannot parse field declaration {decl!r}")
        kind = np.float64 if m.group(1).strip() == "double" else np.int64  # pointers and long long: 8-byte ints
        fields += [(name.strip().lstrip("*"), kind) for name in m.group(2).split(",")]
    return np.dtype(fields)


_SOURCE = "attention/flash_decode.cu"
_PARAMS = _params_dtype((source_dir() / _SOURCE).read_text())
# Its size and field sizes are asserted again when the family compiles (KernelFamily.structs).

FLASH_DECODE = KernelFamily(
    name="flash_decode",
    source=_SOURCE,
    template=("cupy_attn::flash_decode<{dtype}, {head_dim}, {tile.block_n}, {tile.warps}, {tile.stages}, "
              "{has_mask}>"),
    axes={
        "dtype": tuple(C_TYPE_16.values()),
        "head_dim": HEAD_DIMS,
        "tile": tuple(sorted(set(TILES.values()) | set(WIDE_TILES.values()), key=dataclasses.astuple)),
        "has_mask": ("false", "true"),
    },
    where=lambda row: any(t == row["tile"] for (d, _), t in (*TILES.items(), *WIDE_TILES.items())
                          if d == row["head_dim"]),
    structs=(("cupy_attn::FlashDecodeParams", _PARAMS),),
)

# flash_decode over paged caches (its kPaged instantiations: block_table, seqused_k): every tile, no attn_mask.
FLASH_DECODE_PAGED = KernelFamily(
    name="flash_decode_paged",
    source=_SOURCE,
    template="cupy_attn::flash_decode<{dtype}, {head_dim}, {tile.block_n}, {tile.warps}, {tile.stages}, false, true>",
    axes={"dtype": FLASH_DECODE.axes["dtype"], "head_dim": HEAD_DIMS, "tile": FLASH_DECODE.axes["tile"]},
    where=lambda row: any(t == row["tile"] for (d, _), t in (*TILES.items(), *WIDE_TILES.items())
                          if d == row["head_dim"]),
    structs=(("cupy_attn::FlashDecodeParams", _PARAMS),),
)

# FlashDecodeSm90Params: two CUtensorMaps (64-byte aligned) and FlashDecodeParams; the C struct's size is rounded to
# 64 bytes like this one's (asserted when the family compiles).
_SM90_PARAMS = c_struct([("tma_k", MAP, 64), ("tma_v", MAP, 64), ("p", _PARAMS, 8)])

FLASH_DECODE_SM90 = KernelFamily(
    name="flash_decode_sm90",
    source=_SOURCE,
    template=("cupy_attn::flash_decode_sm90<{dtype}, {head_dim}, {tile.block_n}, {tile.warps}, {tile.stages}, "
              "{tile.ctas_per_sm}, {has_mask}>"),
    axes={
        "dtype": tuple(C_TYPE_16.values()),
        "head_dim": HEAD_DIMS,
        "tile": tuple(sorted(set(STREAM_TILES.values()), key=dataclasses.astuple)),
        "has_mask": ("false", "true"),
    },
    where=lambda row: any(t == row["tile"] for (_, d), t in STREAM_TILES.items() if d == row["head_dim"]),
    archs=("sm_90a",),
    arch="sm_90a",
    structs=(("cupy_attn::FlashDecodeSm90Params", _SM90_PARAMS),),
)

# flash_decode_sm90 over paged caches (its kPaged instantiations): the maps span the cache's rows, no attn_mask.
FLASH_DECODE_SM90_PAGED = KernelFamily(
    name="flash_decode_sm90_paged",
    source=_SOURCE,
    template=("cupy_attn::flash_decode_sm90<{dtype}, {head_dim}, {tile.block_n}, {tile.warps}, {tile.stages}, "
              "{tile.ctas_per_sm}, false, true>"),
    axes={"dtype": FLASH_DECODE_SM90.axes["dtype"], "head_dim": HEAD_DIMS, "tile": FLASH_DECODE_SM90.axes["tile"]},
    where=FLASH_DECODE_SM90.where,
    archs=("sm_90a",),
    arch="sm_90a",
    structs=(("cupy_attn::FlashDecodeSm90Params", _SM90_PARAMS),),
)

FLASH_DECODE_COMBINE = KernelFamily(
    name="flash_decode_combine",
    source=_SOURCE,
    template="cupy_attn::flash_decode_combine<{dtype}>",
    axes={"dtype": tuple(C_TYPE_16.values())},
    structs=(("cupy_attn::FlashDecodeParams", _PARAMS),),
)



def head_dim_bucket(head_dim: int, head_dim_v: int) -> int | None:
    """The smallest decode bucket ≥ max(E, Ev) (E=40 → 64, E=96 → 128), None past 256."""
    return _bucket(head_dim, head_dim_v, HEAD_DIMS)


def tile_for(head_dim: int, arch: int, warps: int = 4) -> DecodeTile | None:
    """flash_decode's tile at this head-dim bucket and arch: the 4-warp TILES entry, or with warps=8 the
    WIDE_TILES one (None where there is none: D=256, arch 8)."""
    key = (head_dim, tile_arch(arch))
    return TILES[key] if warps == 4 else WIDE_TILES.get(key)


def requested_warps() -> int | None:
    """flash_decode's warps per CTA that ``CUPY_ATTN_DECODE_WARPS`` asks for: 4, 8, or None (unset or empty: the rule,
    ``use_wide_tile``). ValueError for any other value."""
    value = env.get(ENV_WARPS)
    if value in (None, ""):
        return None
    if value not in ("4", "8"):
        raise ValueError(f"{ENV_WARPS} must be 4 or 8 (or unset: chosen per call), got {value!r}")
    return int(value)


def launch_ctas(B: int, Hkv: int, L: int, groups: int, S: int, num_sms: int, num_splits: int | None = None) -> int:
    """CTAs of a decode launch before split_plan rounds the split length to a tile: B · Hkv · row blocks × the split
    count (the requested one, or num_splits_for's counted in waves per SM, as split_plan does). The rounding only
    lowers the count, so a tile chosen on this number sees at most this many CTAs."""
    ctas = B * Hkv * math.ceil(L * groups / ROWS)
    return ctas * (num_splits_for(ctas, S, num_sms, 1) if num_splits is None else int(num_splits))


def use_wide_tile(grid_ctas: int, num_sms: int) -> bool:
    """Rule for flash_decode's 8-warp tile (WIDE_TILES): take it when the launch has at most WIDE_MAX_WAVES CTAs per
    SM. With about one CTA per SM a 4-warp CTA gives each scheduler one warp and its issue rate is the loop's speed
    (the GQA decode rows, H200: 128 CTAs on 132 SMs at 79-86% of copy bandwidth, IPC 1.15); the 8-warp CTA runs the
    same per-warp loop on 128-key tiles with two warps per scheduler and twice the bytes in flight. Past one wave the
    two tie at first (an SM holding two 4-warp CTAs has 8 warps as well), and with many CTAs per SM (MHA decode:
    2048) the 4-warp tile's two CTAs per SM overlap one's start with the other's stream.
    Examples, H200 (132 SMs, up to 198 CTAs): (8, 32 q / 8 kv, L=1, S=32768) 64 CTAs × 1 auto split → 8 warps;
    (16, 64 q / 8 kv, L=1, S=8192) 128 × 1 → 8 warps; (8, 32 heads, L=1, S=32768) 256 × 1 → 4 warps; the GQA row with
    4 splits forced, 256 → 4 warps. (bench/notes/decode.md.)"""
    return grid_ctas <= WIDE_MAX_WAVES * num_sms


def v1_tile(head_dim: int, arch: int, grid_ctas: int | None = None, num_sms: int | None = None,
            warps: int | None = None) -> tuple[DecodeTile, str | None]:
    """flash_decode's tile and a note on the choice (None for the 4-warp tile by default). warps: 4 or 8, or None for
    ``CUPY_ATTN_DECODE_WARPS`` (``requested_warps``), which, unset, leaves it to ``use_wide_tile`` over the launch's
    CTAs (``launch_ctas``; without them, 4 warps). Asked for 8 where no 8-warp tile exists: 4, and the note says why.

    >>> v1_tile(128, 90, warps=8)[0]
    DecodeTile(block_n=128, warps=8, stages=3, ctas_per_sm=1)
    >>> v1_tile(256, 90, warps=8)[1]
    'CUPY_ATTN_DECODE_WARPS asked for 8 warps: no 8-warp tile at head-dim bucket 256 on sm_90 (4 warps)'
    """
    forced = requested_warps() if warps is None else warps
    if forced not in (None, 4, 8):
        raise ValueError(f"decode warps must be 4 or 8, got {forced!r}")
    wide = tile_for(head_dim, arch, 8)
    if forced is None:
        if wide is not None and grid_ctas is not None and num_sms and use_wide_tile(grid_ctas, num_sms):
            return wide, (f"8 warps: {grid_ctas} CTAs <= {WIDE_MAX_WAVES} x {num_sms} SMs")
        return tile_for(head_dim, arch), None
    if forced == 8:
        if wide is not None:
            return wide, "8 warps (forced)"
        return tile_for(head_dim, arch), (f"{ENV_WARPS} asked for 8 warps: no 8-warp tile at head-dim bucket "
                                          f"{head_dim} on sm_{arch} (4 warps)")
    return tile_for(head_dim, arch), "4 warps (forced)"


def reason(p, arch: int) -> str | None:
    """None when the decode kernel can run a call of this kind, else why not: flash_fwd's limits (fp16/bf16, sm_80+,
    head dims ≤ 256, the same mask kinds)."""
    return flash_fwd.reason(p, arch)


def enabled() -> bool:
    """False when ``CUPY_ATTN_DECODE=0``: the dispatcher never takes the decode kernel."""
    return env.get(ENV_DECODE, "1") != "0"


def requested_variant() -> str:
    """The decode kernel ``CUPY_ATTN_DECODE`` asks for: "v1" (1: flash_decode), "stream" (2: flash_decode_sm90, one
    CTA per SM), "stream2" (3: two CTAs per SM); unset or 0: DEFAULT_VARIANT (0 turns the path off: ``enabled``).
    ValueError for any other value."""
    value = env.get(ENV_DECODE)
    if value in (None, "", "0"):
        return DEFAULT_VARIANT
    if value not in VARIANTS:
        raise ValueError(f"{ENV_DECODE} must be 0, 1, 2 or 3, got {value!r}")
    return VARIANTS[value]


@dataclasses.dataclass(frozen=True)
class DecodeChoice:
    """Which decode kernel runs a call: the family, its tile (DecodeTile or StreamTile), and why the streaming variant
    was asked for but not taken (None otherwise); with :func:`choose`, the splits launched and the keys of each. Made
    once by the plan, used by :func:`build`."""
    family: KernelFamily
    tile: object
    variant: str
    fallback: str | None = None
    warps_note: str | None = None  # flash_decode: why this tile's warps (v1_tile), where not the 4-warp default
    num_splits: int = 1
    split_keys: int = 0

    def describe(self) -> str:
        t = self.tile
        if self.family is FLASH_DECODE_SM90:
            text = (f"{self.family.name}: 16 packed rows x {t.block_n} keys, {t.warps} consumer warps + 1 TMA "
                    f"producer warp, {t.stages}-stage mbarrier ring, {t.ctas_per_sm} CTA(s)/SM")
        else:
            text = f"{self.family.name}: 16 packed rows x {t.block_n} keys, {t.warps} warps, {t.stages} K/V stages"
            text += f" ({self.warps_note})" if self.warps_note else ""
        return text + (f" (CUPY_ATTN_DECODE asked for {self.variant}: {self.fallback})" if self.fallback else "")


def stream_layout_reason(k, v) -> str | None:
    """None when TMA can read k and v (B, Hkv, S, E) in place (runtime.tma.tma_operand_reason: BHSD and BSHD with E·2
    a multiple of 16 qualify), else why not."""
    return tma_operand_reason("key", k) or tma_operand_reason("value", v)


def choose_kernel(head_dim: int, arch: int, key=None, value=None, variant: str | None = None, *,
                  grid_ctas: int | None = None, num_sms: int | None = None, warps: int | None = None) -> DecodeChoice:
    """The decode kernel for a call at this head-dim bucket: ``variant`` ("v1", "stream", "stream2"; None: from
    CUPY_ATTN_DECODE, ``requested_variant``). The streaming variants need sm_90 (sm_90a code), cuda-bindings
    (cuTensorMapEncodeTiled) and a TMA-readable layout (``stream_layout_reason``; not checked when key/value are None,
    as in plans made without arrays); otherwise flash_decode runs and ``fallback`` says why. flash_decode's tile:
    ``v1_tile`` (grid_ctas = launch_ctas of the call, num_sms, warps 4 / 8 / None: CUPY_ATTN_DECODE_WARPS or the rule).

    >>> choose_kernel(128, 80, variant="stream").fallback
    'sm_80: flash_decode_sm90 needs sm_90a (H100/H200)'
    """
    variant = requested_variant() if variant is None else variant
    if variant not in ("v1", "stream", "stream2"):
        raise ValueError(f"decode variant must be 'v1', 'stream' or 'stream2', got {variant!r}")
    tile, note = v1_tile(head_dim, arch, grid_ctas, num_sms, warps)
    v1 = DecodeChoice(FLASH_DECODE, tile, variant, warps_note=note)
    if variant == "v1":
        return v1
    why = None
    if arch // 10 != 9:
        why = f"sm_{arch}: flash_decode_sm90 needs sm_90a (H100/H200)"
    elif key is not None:
        why = stream_layout_reason(key, value)
    if why is None:
        why = bindings_reason()
    if why is not None:
        return dataclasses.replace(v1, fallback=why)
    return DecodeChoice(FLASH_DECODE_SM90, STREAM_TILES[(variant, head_dim)], variant)


def prefer_decode(seqlen_q: int, seqlen_k: int, groups: int) -> tuple[bool, str]:
    """Auto rule: does the decode kernel serve this fused-eligible call better than the fused kernel?

    Both read K and V, and with L ≤ 128 that is nearly all the bytes. The fused kernel reads them once per query head
    (``groups`` times per K/V head under GQA; the repeats may hit L2, but measured GQA decode ran at 0.81 TB/s) with
    B·Hq CTAs, each streaming all S keys; the decode kernel reads them once per ceil(L·groups / 16) packed row blocks
    and splits S over more CTAs. So decode reads no more when ceil(L·g/16) ≤ g, i.e. L ≤ 16, and we also bound the
    row blocks (L·g ≤ 64: at most 4 passes over K/V) since beyond that the 128-row fused tile re-reads less. S ≥ 256:
    shorter calls are launch-bound either way (a few µs) and the fused kernel needs no combine launch.
    Example: (8, 32 q heads, 8 kv heads, L=1, S=32768): L·g = 4 rows, one pass over K/V instead of 4 → decode;
    L=32, g=1 → fused (each K/V head would be read twice by 16-row blocks, once by a 128-row tile).
    """
    if seqlen_q > 16:
        return False, f"L={seqlen_q} > 16 query rows: the fused kernel's 128-row tiles read K/V fewer times"
    if seqlen_q * groups > 4 * ROWS:
        return False, f"L·groups = {seqlen_q * groups} > 64 packed rows: more than 4 passes over K/V"
    if seqlen_k < 256:
        return False, f"S={seqlen_k} < 256 keys: launch-bound, the fused kernel needs no combine pass"
    return True, f"L·groups = {seqlen_q * groups} ≤ 64 packed rows read each K/V tile once; S={seqlen_k} split"


def num_splits_for(ctas: int, seqlen_k: int, num_sms: int, ctas_per_sm: int = 2, min_keys: int = 512,
                   fill: float = 0.8) -> int:
    """Splits of the key axis so that the CTAs fill the GPU, FlashAttention-2's wave-efficiency rule.

    ``ctas`` = B · Hkv · row blocks (the CTAs of one split), slots = num_sms · ctas_per_sm. Enough CTAs already
    (≥ ``fill`` of the slots): 1 split. Otherwise, for n = 1 .. min(128, S // min_keys) (each split keeps ≥ min_keys keys,
    so its set-up and its partial write stay small next to its K/V stream), the wave efficiency
    n·ctas/slots / ceil(n·ctas/slots), and take the smallest n within 0.85 of the best.
    split_plan calls it with ctas_per_sm = 1 (waves per SM; measured, see there). Examples, H200 (132 SMs), D=128,
    with ctas_per_sm = 2 (264 slots):
      (64, 32 heads, L=1, S=4096): 2048 CTAs ≥ 211 → 1 split.
      (8, 32, L=1, S=32768): 256 CTAs (0.97 of a wave) → 1 split.
      (8, 32 q / 8 kv heads, L=1, S=32768): 64 CTAs: n=1 0.24, 2 0.48, 3 0.73, 4 0.97 → 4 splits of 8192 keys.
      (16, 64 q / 8 kv, L=1, S=8192): 128 CTAs: n=1 0.48, 2 0.97 → 2 splits.
      (1, 8 kv, L=1, S=4096): 8 CTAs, at most 8 splits of 512 keys: efficiency n·8/264, best 0.24 at n=8; n=7
      gives 0.21 ≥ 0.85·0.24 → 7 splits (a latency-bound call either way).
    """
    slots = max(1, num_sms * ctas_per_sm)
    if ctas >= fill * slots:
        return 1
    return _best_splits(ctas, slots, max(1, min(MAX_SPLITS, seqlen_k // min_keys)))


@functools.lru_cache(maxsize=1024)
def _best_splits(ctas: int, slots: int, max_splits: int) -> int:
    """num_splits_for's search, which S enters only through max_splits (so a decode loop whose S grows each step
    repeats it rarely)."""
    eff = []
    for n in range(1, max_splits + 1):
        waves = n * ctas / slots
        eff.append(waves / math.ceil(waves))
    best = max(eff)
    return next(n for n, e in enumerate(eff, 1) if e >= 0.85 * best)


@functools.lru_cache(maxsize=4096)  # bounded: a decode loop asks for a new S every step
def split_plan(B: int, Hkv: int, L: int, groups: int, S: int, head_dim: int, arch: int, num_sms: int,
               num_splits: int | None = None, block_n: int | None = None) -> tuple[int, int]:
    """(splits actually launched, keys per split). A requested count is honoured up to one key tile per split: the
    split length is rounded up to a multiple of the tile (block_n keys; None: flash_decode's tile_for), so S=100 with
    16 requested gives 2 splits of 64 keys. The same rule serves flash_decode_sm90 (its CTAs stream one split each,
    like flash_decode's; with one CTA per SM, waves per SM are its waves exactly)."""
    block_n = tile_for(head_dim, arch).block_n if block_n is None else block_n
    ctas = B * Hkv * math.ceil(L * groups / ROWS)
    # Waves are counted per SM, not per CTA slot: one CTA per SM already keeps enough K/V bytes in flight, and a
    # second split only adds a combine; with the swizzled K/V tiles half the SMs suffice (ONE_SPLIT_FILL). E.g.
    # (8, 32/8, 1, 32768): 64 CTAs of 8 warps on 132 SMs run one split (measured no slower than 2 or 4 splits;
    # bench/notes/decode.md).
    n = num_splits_for(ctas, S, num_sms, 1, fill=ONE_SPLIT_FILL) if num_splits is None else int(num_splits)
    chunk = math.ceil(math.ceil(S / n) / block_n) * block_n
    return math.ceil(S / chunk), chunk


# Partials up to this size live in a per-stream buffer kept across calls (runtime.workspace.persistent: one dict
# look-up, where an allocation through torch's caching allocator costs a few µs before the launch, 2% of a 0.25 ms
# GQA decode call); larger ones are per-call scratch, so that a rare huge call does not pin its memory.
PERSISTENT_PARTIALS_MAX = 32 << 20


def _partials(ctx, nbytes: int):
    """(holder, pointer) of the splits' fp32 partials: up to PERSISTENT_PARTIALS_MAX bytes the call stream's kept
    buffer (stream order: the next call's split kernel runs after this call's combine kernel has read it), else from
    the caller's allocator on the call's stream (runtime.workspace.scratch; freed stream-ordered after the combine
    kernel has read them)."""
    if nbytes <= PERSISTENT_PARTIALS_MAX:
        buf = workspace.persistent(ctx.device_id, ctx.stream.ptr, "decode_partials", nbytes)
        return buf, workspace.pointer(buf)
    return workspace.scratch(ctx, nbytes)


def choose(p, arch: int, num_sms: int, num_splits: int | None = None, *, variant: str | None = None,
           warps: int | None = None) -> DecodeChoice:
    """The decode kernel's whole choice for a problem it serves (:func:`reason`), made once by the plan: the kernel
    and tile (:func:`choose_kernel`, on the launch's CTAs: :func:`launch_ctas`; variant and warps None: from
    CUPY_ATTN_DECODE and CUPY_ATTN_DECODE_WARPS), then the splits and keys per split (:func:`split_plan`; num_splits
    None: automatic). ``num_sms``: the device's SM count."""
    head_dim = head_dim_bucket(p.head_dim, p.head_dim_v)
    S = max(p.seqlen_k, 1)
    choice = choose_kernel(head_dim, arch, p.key, p.value, variant, num_sms=num_sms, warps=warps,
                           grid_ctas=launch_ctas(p.batch, p.num_kv_heads, p.seqlen_q, p.groups, S, num_sms,
                                                 num_splits))
    n, chunk = split_plan(p.batch, p.num_kv_heads, p.seqlen_q, p.groups, S, head_dim, arch, num_sms, num_splits,
                          choice.tile.block_n)
    return dataclasses.replace(choice, num_splits=n, split_keys=chunk)


def build(p, choice: DecodeChoice, out, lse, fields: dict | None = None, map_views: tuple | None = None
          ) -> PreparedLaunch:
    """The launch of ``choice`` (:func:`choose`'s) for a checked problem ``p`` (checks.SDPAProblem) on its device and
    stream, partials from the caller's allocator (p.ctx).

    q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev): fp16/bf16, last-dim stride 1, other strides free; out (B,
    Hq, L, Ev) in q's dtype, last-dim stride 1; lse None or (B, Hq, L) fp32; mask None or broadcast to (B, Hq, L, S);
    either causal alignment. Any L works (rows are packed 16 per CTA); the plan sends it small ones. ValueError for a
    grid over the limit.

    The launch is replayed as ``launch_on(stream, q, k, v, out, lse, mask)``: every FlashDecodeParams field is 8 bytes
    wide, the six pointers and the partials' two (o_part, lse_part: allocated per replay, _partials, and held until
    the combine kernel is enqueued) are written into the launch's struct, and the split kernel then the combine kernel
    read it (flash_decode_sm90's struct: the k and v tensor maps, then FlashDecodeParams, the combine kernel's).
    """
    q, k, v, mask = p.query, p.key, p.value, p.mask
    B, Hq, L, E = q.shape
    _, Hkv, S, Ev = v.shape
    head_dim = head_dim_bucket(E, Ev)
    groups = Hq // Hkv
    row_blocks = math.ceil(L * groups / ROWS)
    tile = choice.tile
    splits, chunk = choice.num_splits, choice.split_keys
    if Hkv * row_blocks > 65535 or B > 65535:
        raise ValueError(f"decode attention: grid limit: kv heads × row blocks {Hkv * row_blocks} and batch {B} "
                         "must each be <= 65535")
    c_type = C_TYPE_16[dtype_name(q.dtype)]
    if choice.family in (FLASH_DECODE_PAGED, FLASH_DECODE_SM90_PAGED):
        kernel = choice.family.kernel(dtype=c_type, head_dim=head_dim, tile=tile)
    else:
        kernel = choice.family.kernel(dtype=c_type, head_dim=head_dim, tile=tile,
                                      has_mask="false" if mask is None else "true")
    combine = FLASH_DECODE_COMBINE.kernel(dtype=c_type) if splits > 1 else None
    smem = tile.smem_bytes(head_dim)

    prm = np.zeros((), dtype=_PARAMS)
    prm["batch"], prm["num_heads"], prm["seqlen_q"], prm["seqlen_k"] = B, Hq, L, S
    prm["head_dim"], prm["head_dim_v"], prm["groups"], prm["row_blocks"] = E, Ev, groups, row_blocks
    prm["num_splits"], prm["split_keys"] = splits, chunk
    prm["is_causal"] = p.causal is not None
    prm["causal_offset"] = p.causal_offset
    prm["mask_kind"] = 0 if mask is None else MASK_KIND[dtype_name(mask.dtype)]
    prm["vec_flags"] = rows16(q) | rows16(k) << 1 | rows16(v) << 2
    prm["scale_log2"] = float(p.scale) * LOG2E
    set_strides(prm, ("q", q, "bhl"), ("k", k, "bhs"), ("v", v, "bhs"), ("out", out, "bhl"), ("lse", lse, "bhl"),
                ("mask", mask, "bhls"))
    for name, value in (fields or {}).items():  # a paged call's: seqused_k, block_table, max_blocks, page_size
        prm[name] = value
    rows = B * Hq * L
    o_part_bytes = splits * rows * Ev * 4  # lse_part's offset in the partials
    part_bytes = 0 if splits == 1 else o_part_bytes + splits * rows * 4
    grid = (splits, Hkv * row_blocks, B)
    if choice.family in (FLASH_DECODE_SM90, FLASH_DECODE_SM90_PAGED):
        # FlashDecodeSm90Params: the maps of k and v (encoded again only when k or v moved: a decode loop over one KV
        # cache encodes once; ~10 µs of host time otherwise), then FlashDecodeParams, which the combine kernel reads.
        # map_views: the arrays the maps describe when not k and v (a paged cache: all its rows, (1, Hkv, rows, D)).
        params, nested, block = np.zeros((), dtype=_SM90_PARAMS), "p.", (tile.threads,)
        params["p"] = prm
        mk, mv = map_views if map_views is not None else (k, v)
        maps = (Maps(("tma_k", "tma_v"), ("k", "v"), (MapSpec.of(mk, tile.block_n).encode,
                                                      MapSpec.of(mv, tile.block_n).encode)),)
    else:
        params, nested, block, maps = prm, "", (tile.warps * 32,), ()
    steps = [Step(kernel, grid, block, smem)]
    scratch = None
    if splits > 1:
        # The combine kernel as a programmatic dependent of the split kernel on sm_90+ (PDL: launched while the
        # split kernel drains; it waits inside for the partials). The split kernel is launched plainly: as a
        # dependent of whatever precedes it, it measured no device gain and more host time (bench/notes/decode.md).
        from cupy.cuda import runtime
        offset = field_offset(params.dtype, "p")[0] if nested else 0
        steps.append(Step(combine, (rows,), (128,),
                          pdl=PDL and pdl_supported(runtime.getDevice()), offset=offset))
        scratch = Scratch(functools.partial(_partials, p.ctx, part_bytes),
                          {nested + "o_part": 0, nested + "lse_part": o_part_bytes})
    return PreparedLaunch(params, steps, args=ARGS, pointers={nested + name: name for name in ARGS}, maps=maps,
                          scratch=scratch, info={"choice": choice, "num_splits": splits})
