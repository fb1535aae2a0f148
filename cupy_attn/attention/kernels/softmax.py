"""The split path's mask + softmax pass over an fp32 score buffer (cuda_src/attention/softmax.cu).

    P = softmax2(scores + mask)     in place over the scores buffer, P written in the input dtype (P∘Z/(1−p): dropout)

One row of scores per group of threads (its register row: threads · vectors · 4 columns); the log-sum-exp of each row
written to lse. The buffer holds rows of one chunk of the split path's schedule (paths/split.py): ``rows`` rows of
``rows_per_batch`` query rows each, from row ``row0`` of batch ``batch0`` of the chunk's batch axes; the mask, lse and
dropout's Philox counter are addressed through the (up to three) batch axes of the GEMMs. Causal calls: key j is
visible to query row i iff j ≤ i + causal_offset; the kernel has no is_causal flag, so a call without a causal mask
passes S (every key visible). :func:`tile_for` picks the tile, :func:`base_params` fills what every chunk of a call
shares, :func:`build` prepares one chunk's launch.
"""
from __future__ import annotations

import numpy as np

from ... import philox
from ...runtime.compile import KernelFamily
from ...runtime.interop import dtype_name
from ...runtime.kernel_abi import C_TYPE, LOG2E, MASK_KIND, MASK_NONE
from ...runtime.launch import PreparedLaunch, Step
from .. import mods, variants

# (threads per row, float4 vectors per thread): one row = threads·vecs·4 columns held in registers. Picked as the
# first entry that covers S. 32-thread groups serve short rows (four rows per 128-thread block, so a block still has
# four warps of loads in flight); wider groups keep ≤ 32 fp32 values per thread (8 vectors), well under the register
# budget at full occupancy. (512, 0) loops over rows longer than 16384 columns. The two lists differ at S ≤ 512, where
# each was measured the faster (bench/experiments/split/probe_softmax.py; bench/notes/split.md): unmasked rows
# 64 × 2, rows with a key-padding mask or causal 32 × 4.
TILES = {  # masked (attn_mask, causal or dropout) -> tiles
    "false": ((32, 1), (32, 2), (64, 2), (128, 2), (128, 4), (256, 4), (256, 8), (512, 8), (512, 0)),
    "true": ((32, 1), (32, 2), (32, 4), (128, 2), (128, 4), (256, 4), (256, 8), (512, 8), (512, 0)),
}

# Field order and types of SoftmaxParams in softmax.cu (all 8 bytes wide, so NumPy's layout equals the C struct's).
PARAMS = np.dtype([(name, np.float64 if name in ("dropout_scale", "softcap_log2") else np.int64) for name in (
    "scores", "lse", "mask", "rows", "rows_per_batch", "row0", "seqlen_k", "ld", "causal_offset", "mask_kind",
    "batch0", "n1", "n2", "mask_stride_b0", "mask_stride_b1", "mask_stride_b2", "mask_stride_q", "mask_stride_k",
    "lse_stride_b0", "lse_stride_b1", "lse_stride_b2",
    "rng", "dropout_threshold", "dropout_scale", "bh0", "bh_stride_b0", "bh_stride_b1", "bh_stride_b2",
    "window_lo", "softcap_log2", "alibi_slopes", "sinks", "diag")])

# dropout=true only with masked=true: a dropout call takes the masked tiles (the mask test is free next to Philox).
SOFTMAX = KernelFamily(
    name="softmax",
    source="attention/softmax.cu",
    template="cupy_attn::masked_softmax<{out_t}, {tile[0]}, {tile[1]}, {masked}, {dropout}>",
    axes={"out_t": tuple(C_TYPE.values()), "tile": tuple(sorted(set(sum(TILES.values(), ())))),
          "masked": tuple(TILES), "dropout": ("false", "true")},
    where=lambda row: row["tile"] in TILES[row["masked"]] and (row["dropout"] == "false" or row["masked"] == "true"),
    structs=(("cupy_attn::SoftmaxParams", PARAMS),),
)

# The variants (window, softcap, ALiBi, sinks: attention/variants.py) on the masked tiles, dropout or not: its own
# kernel (masked_softmax_variants), declared with one block per SM, where ptxas would otherwise hold the wide tiles to
# 64 registers and spill.
SOFTMAX_VARIANTS = KernelFamily(
    name="softmax_variants",
    source="attention/softmax.cu",
    template="cupy_attn::masked_softmax_variants<{out_t}, {tile[0]}, {tile[1]}, {dropout}>",
    axes={"out_t": tuple(C_TYPE.values()), "tile": TILES["true"], "dropout": ("false", "true")},
    structs=(("cupy_attn::SoftmaxParams", PARAMS),),
)


def tile_for(seqlen_k: int, masked: bool = True) -> tuple[int, int]:
    """The first TILES entry (masked or unmasked list) whose register row covers seqlen_k columns
    (S=1024 → (128, 2); S=512 → (32, 4) masked, (64, 2) unmasked)."""
    for threads, vecs in TILES["true" if masked else "false"]:
        if vecs == 0 or threads * vecs * 4 >= seqlen_k:
            return threads, vecs
    raise AssertionError("TILES ends with a looping entry")


def masked(p) -> bool:
    """Whether a call takes the masked kernels: an attn_mask, a causal mask, dropout or a variant."""
    return p.mask is not None or p.causal is not None or p.dropout_p > 0 or not variants.of(p).plain


def expanded_variant_arrays(p):
    """(alibi, sinks): the call's ALiBi slopes and sink logits as fp32 CuPy arrays of B·Hq, indexed by the flat
    (batch, query head) index the kernel computes (None where the call has none)."""
    import cupy
    var = variants.of(p)
    out = []
    for a in (var.alibi_slopes, var.sinks):
        out.append(None if a is None else cupy.ascontiguousarray(
            cupy.broadcast_to(a.astype(cupy.float32), (p.batch, p.num_heads))).reshape(-1))
    return tuple(out)


def base_params(p, ld: int, axes, variant_arrays=(None, None)) -> np.ndarray:
    """SoftmaxParams with what every chunk of the call ``p`` (checks.SDPAProblem) shares: S, the buffer's pitch ``ld``
    (elements), the causal limit (checks.SDPAProblem.visible_offset: S without one), the mask's kind and strides, dropout's threshold and scale, and the
    batch axes ``axes``: three (size, mask stride, lse stride, Philox (batch, head) index step) tuples, outermost
    first, the GEMMs' batch index decomposed over them (sizes of the inner two: n1, n2)."""
    S, mask = p.seqlen_k, p.mask
    base = np.zeros((), dtype=PARAMS)
    base["seqlen_k"], base["ld"] = S, ld
    base["causal_offset"] = p.visible_offset
    base["mask_kind"] = MASK_NONE if mask is None else MASK_KIND["bool" if p.mask_kind == "bool" else
                                                                 dtype_name(mask.dtype)]
    base["n1"], base["n2"] = axes[1][0], axes[2][0]
    for i, (_, mask_stride, lse_stride, bh_stride) in enumerate(axes):
        base[f"mask_stride_b{i}"], base[f"lse_stride_b{i}"] = mask_stride, lse_stride
        base[f"bh_stride_b{i}"] = bh_stride
    if p.dropout_p > 0:
        base["dropout_threshold"] = philox.dropout_threshold(p.dropout_p)
        base["dropout_scale"] = philox.dropout_scale(p.dropout_p)
    if mask is not None:
        base["mask_stride_q"] = mask.strides[2] // mask.itemsize
        base["mask_stride_k"] = mask.strides[3] // mask.itemsize
    var = variants.of(p)
    base["window_lo"] = p.window_lo if hasattr(p, "window_lo") else variants.UNBOUNDED_LO
    base["softcap_log2"] = 0.0 if var.softcap is None else var.softcap * LOG2E
    base["diag"] = p.seqlen_k - p.seqlen_q
    alibi, sinks = variant_arrays
    base["alibi_slopes"] = 0 if alibi is None else alibi.data.ptr
    base["sinks"] = 0 if sinks is None else sinks.data.ptr
    return base


def mod_family(bound):
    """The softmax kernel's instantiations with a user's mods appended (attention/mods.py): masked_softmax_mod on the
    masked tiles, dropout or not, its parameters ModParams<SoftmaxParams, Mod>."""
    return mods.mod_family(SOFTMAX_VARIANTS, "cupy_attn::masked_softmax_mod<{out_t}, {tile[0]}, {tile[1]}, {dropout}, "
                           "{mod}>", "cupy_attn::ModParams<cupy_attn::SoftmaxParams, {mod}>",
                           mods.mod_params_dtype(PARAMS, bound.spec), bound.mod, bound.spec,
                           dict(SOFTMAX_VARIANTS.axes), "softmax_mod")


def build(p, base: np.ndarray, *, batches: int, rows: int, row0: int, batch0: int, bh0: int,
          seqlen_k: int) -> PreparedLaunch:
    """The pass over one chunk of the scores buffer: ``batches`` GEMM batches of ``rows`` query rows from row ``row0``
    (batch ``batch0`` of the folded axes, flat (batch, head) index ``bh0`` of the chunk's outer loops), each row's
    first ``seqlen_k`` columns (a causal band's visible keys; else S). ``base``: :func:`base_params`. Replayed as
    ``launch_on(stream, scores, mask, lse, rng)``. A call with mods (``variants.mod``) runs :func:`mod_family`'s
    kernel, the aux pointers and shapes after the fields."""
    params = base.copy()
    params["rows"], params["rows_per_batch"], params["row0"], params["batch0"] = batches * rows, rows, row0, batch0
    params["bh0"], params["seqlen_k"] = bh0, seqlen_k
    tile = tile_for(seqlen_k, masked(p))
    var = variants.of(p)
    dropout = "true" if p.dropout_p > 0 else "false"
    if var.mod is not None:
        fam = mod_family(var.mod)
        kernel = fam.kernel(out_t=C_TYPE[dtype_name(p.dtype)], tile=tile, dropout=dropout)
        with_mod = np.zeros((), fam.structs[0][1])
        for name in PARAMS.names:
            with_mod[name] = params[name]
        mods.fill_aux(with_mod, var.mod, p.num_heads)
        params = with_mod
    elif var.plain:
        kernel = SOFTMAX.kernel(out_t=C_TYPE[dtype_name(p.dtype)], tile=tile, masked="true" if masked(p) else "false",
                                dropout=dropout)
    else:
        kernel = SOFTMAX_VARIANTS.kernel(out_t=C_TYPE[dtype_name(p.dtype)], tile=tile, dropout=dropout)
    rows_per_block = max(1, 128 // tile[0])
    return PreparedLaunch(params, [Step(kernel, (-(-batches * rows // rows_per_block),), (max(tile[0], 128),))],
                          args=("scores", "mask", "lse", "rng"),
                          pointers={name: name for name in ("scores", "mask", "lse", "rng")})
