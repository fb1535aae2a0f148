"""The FA3-design kernel (cupy_attn.attention.kernels.flash_fwd_sm90, cuda_src/attention/flash_fwd_sm90.cu).

CPU: every instantiation compiles for sm_90a without spills or ptxas performance warnings; its SASS holds HGMMA, TMA
loads (UTMALDG), mbarrier operations (SYNCS), setmaxnreg (USETMAXREG) and no local memory (skipped without
cuobjdump: ``pip install nvidia-cuda-cuobjdump``); the params dtype matches the C struct's declaration; tile table,
the persistent variant's grid and tile order, and eligibility rules. GPU (``gpu`` marker; every test under
CUPY_ATTN_FA3=1, 2 and 3: ping-pong, overlap, persistent): outputs and lse against the float64 reference with the
tolerance rule of tests/_helpers/_tolerance.py (NaN-poisoned outputs; tests/test_flash_fwd.py's _check), after asserting that
dispatch.fused_launch really chose this kernel and variant (and, persistent, its grid).

    PYTHONPATH=. timeout 3000 python3 -m pytest -m gpu tests/test_flash_fwd_sm90.py
    PYTHONPATH=. timeout 1200 python3 -m pytest -m gpu tests/test_flash_fwd_sm90.py -k persistent   # the variant alone

A hang (a barrier protocol mistake) is ended by ``timeout``; the persistent variant's barrier invariants are in
cuda_src/attention/sm90/mainloop.cuh.
"""
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from cupy_attn.attention import dispatch
from cupy_attn.attention.kernels import flash_fwd_sm90 as _sm90
from cupy_attn.runtime import compile as _compile
from cupy_attn.runtime import compile_check
from cupy_attn.runtime import tma
from cupy_attn.runtime.kernel_abi import C_TYPE_16
from _compile_checks import assert_clean

FAMILY = _sm90.FLASH_FWD_SM90_TMA

# ---------------------------------------------------------------------------------------------------------------------
# CPU


def test_every_instantiation_compiles_without_spills():
    reports = compile_check.compile_family(FAMILY, "sm_90a")
    # dtypes × (modes (ping-pong, overlap, persistent) × (bucket, qk_dim) pairs + the 192-row tiles), and the
    # window/softcap/ALiBi/sinks instantiations: the persistent tiles at each bucket's own S GEMM width, and the packed
    # batches' (varlen_attention): the variants' code in VARLEN_TILES
    qk_dims = len(_sm90.TILES) + sum(len(d) for d in _sm90.QK_DIMS.values())
    m192 = sum(len(table) for table in _sm90.M192_MODE_TILES.values())
    persistent = len(_sm90.PERSISTENT_TILES) + len(_sm90.M192_MODE_TILES["3"])
    varlen = 2 * len(_sm90.VARLEN_TILES)  # plain and variants
    assert len(reports) == len(list(FAMILY.variants())) == 2 * (len(_sm90.MODE_TILES) * qk_dims + m192 + persistent
                                                                + varlen)
    assert_clean(reports, max_registers=168)
    # 512 threads at one block per SM: 128 registers per thread at launch (the consumers' 160 come from setmaxnreg).
    assert all(r.registers <= 128 for r in reports if " 192," in r.name_expression), reports


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in sys.path:
        for hit in glob.glob(os.path.join(root, "nvidia", "*", "bin", "cuobjdump")):
            return hit
    return None


def sass_summary(cubin: bytes) -> dict:
    """{kernel name: {opcode: count}} from ``cuobjdump -sass`` of a cubin."""
    tool = _cuobjdump()
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], check=True, capture_output=True, text=True).stdout
    out = {}
    for block in re.split(r"\n\s*Function : ", text)[1:]:
        name = block.split("\n", 1)[0].strip()
        ops = {}
        for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", block):
            ops[m.group(1)] = ops.get(m.group(1), 0) + 1
        out[name] = ops
    return out


def sass_text(cubin: bytes) -> dict:
    """{kernel name: its ``cuobjdump -sass`` listing} of a cubin."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "-sass", f.name], check=True, capture_output=True, text=True).stdout
    return {b.split("\n", 1)[0].strip(): b for b in re.split(r"\n\s*Function : ", text)[1:]}


@pytest.mark.parametrize("table", ["OVERLAP_TILES", "PERSISTENT_TILES"])
def test_overlap_variant_runs_the_softmax_between_its_two_wgmma_waits(table):
    """FlashAttention-3's intra-warpgroup overlap, in the SASS: after ``wait_group 1`` (S_i done) the exponentials of
    the softmax run before ``wait_group 0`` (P_{i-1} V_{i-1} done), for D = 64, 96 and 128 (mainloop.cuh explains the
    scheduling barrier that keeps ptxas from hoisting the second wait; D = 256 is not overlapped yet), in the one-tile
    and in the persistent variant; at D = 96 also with the S GEMM stopping at 80 columns."""
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    for dtype in C_TYPE_16.values():
        for d, qk in ((64, 64), (96, 96), (96, 80), (128, 128)):
            expr = FAMILY.name_expression(dtype=dtype, head_dim=d, tile=getattr(_sm90, table)[d], qk_dim=qk,
                                          variants="false", varlen="false")
            text = next(iter(sass_text(compile_check.whole_cubin(
                _compile.compile_variant(FAMILY, expr, "sm_90a").image.read_bytes())).values()))
            ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*[^;]*);", text)
            first = next(i for i, op in enumerate(ops) if op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1"))
            second = next(i for i, op in enumerate(ops[first:], first) if op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0"))
            between = sum(op.startswith("MUFU.EX2") for op in ops[first:second])
            assert between >= d // 2, f"{expr}: {between} MUFU.EX2 between the waits"


def test_sass_has_tma_mbarriers_wgmma_setmaxnreg_and_no_local_memory():
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    kernels = sass_summary(compile_check.family_cubin(FAMILY, "sm_90a"))
    assert len(kernels) == len(FAMILY.name_expressions())
    for name, ops in kernels.items():
        for op in ("HGMMA", "UTMALDG", "SYNCS", "USETMAXREG"):
            assert ops.get(op, 0) > 0, f"{name}: no {op} in the SASS"
        assert ops["USETMAXREG"] >= 2, f"{name}: producer and consumers both reallocate registers"
        for op in ("LDL", "STL"):
            assert op not in ops, f"{name}: local memory ({op}: {ops[op]})"


@pytest.mark.parametrize("mode", sorted(_sm90.M192_MODE_TILES))
@pytest.mark.parametrize("dtype", list(C_TYPE_16.values()))
def test_m192_sass(dtype, mode):
    """The 192-row tile (three consumer warpgroups) in the SASS: the consumers' setmaxnreg to 160 (0xa0) and the
    producer's to 32 (0x20); S = Q Kᵀ as HGMMA.64x128x16 (4 k steps) and P·V as HGMMA.64x64x16 (8 k steps of 16 keys),
    each once in the loop and once outside it (S_0 before, the last P·V after); all 64 exponentials of a block between
    wait_group 1 and wait_group 0 (the row-sum anchor of mainloop.cuh); ping-pong turns on named barriers of 256
    threads; no local memory."""
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    suffix = ".BF16" if "bfloat16" in dtype else ""
    tile = _sm90.M192_MODE_TILES[mode][64]
    expr = FAMILY.name_expression(dtype=dtype, head_dim=64, tile=tile, qk_dim=64, variants="false", varlen="false")
    text = next(iter(sass_text(compile_check.whole_cubin(
        _compile.compile_variant(FAMILY, expr, "sm_90a").image.read_bytes())).values()))
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*[^;]*);", text)
    ops = [op.strip() for op in ops]
    assert "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa0" in ops and "USETMAXREG.DEALLOC.CTAPOOL 0x20" in ops, expr
    shapes = re.findall(r"HGMMA\.(64x\d+x16)\.F32" + re.escape(suffix) + r"\b", text)
    assert shapes.count("64x128x16") == 4 * 2 and shapes.count("64x64x16") == 8 * 2, (expr, shapes)
    first = next(i for i, op in enumerate(ops) if op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1"))
    second = next(i for i, op in enumerate(ops[first:], first) if op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    between = sum(op.startswith("MUFU.EX2") for op in ops[first:second])
    assert between >= 64, f"{expr}: {between} MUFU.EX2 between the waits"
    assert any(op.startswith("BAR.ARV") and op.endswith(", 0x100") for op in ops), expr
    assert any(op.startswith("BAR.SYNC") and op.endswith(", 0x100") for op in ops), expr
    assert not any(op.startswith(("LDL", "STL")) for op in ops), f"{expr}: local memory"


@pytest.mark.parametrize("dtype", list(C_TYPE_16.values()))
def test_head_dim_96_sass_shapes(dtype):
    """The 96 bucket in the SASS: S = Q Kᵀ as HGMMA.64x128x16 (6 k steps, 5 at qk_dim 80), P·V as HGMMA.64x96x16 (8
    k steps of 16 keys), descriptors in the 64-byte swizzle (high word 0x80000020: mode 2 in bits 62-63, SBO 512 >> 4),
    in every mode; no 64x128 P·V left."""
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    suffix = ".BF16" if "bfloat16" in dtype else ""
    for table in ("TILES", "OVERLAP_TILES", "PERSISTENT_TILES"):
        for qk in (96, 80):
            expr = FAMILY.name_expression(dtype=dtype, head_dim=96, tile=getattr(_sm90, table)[96], qk_dim=qk,
                                          variants="false", varlen="false")
            text = next(iter(sass_text(compile_check.whole_cubin(
                _compile.compile_variant(FAMILY, expr, "sm_90a").image.read_bytes())).values()))
            shapes = re.findall(r"HGMMA\.(64x\d+x16)\.F32" + re.escape(suffix) + r"\b", text)
            turns = 1 if table == "TILES" else 2  # overlap: S_0 before the loop and the last P·V after it
            assert shapes.count("64x96x16") == 8 * turns, (expr, shapes)
            assert shapes.count("64x128x16") == qk // 16 * turns, (expr, shapes)
            assert "0x80000020" in text, f"{expr}: no 64-byte-swizzle descriptor"
            assert "0x40000040" not in text, f"{expr}: a 128-byte-swizzle descriptor (SBO 1024)"


def test_tiles():
    declared = set(FAMILY.name_expressions())
    assert set(_sm90.MODE_TILES) == {"1", "2", "3"}
    for mode, table in _sm90.MODE_TILES.items():
        overlap, persistent = mode in ("2", "3"), mode == "3"
        assert set(table) == {64, 96, 128, 256}
        for d, tile in table.items():
            assert tile.block_m == 128 and tile.block_n % 64 == 0 and tile.stages >= 2
            assert (tile.overlap, tile.persistent) == (overlap, persistent)
            assert dataclasses.replace(tile, overlap=False, persistent=False) == _sm90.TILES[d]
            assert tile.smem_bytes(d) <= 232448, (d, tile)
            for dtype in C_TYPE_16.values():
                for qk in (d, *_sm90.QK_DIMS.get(d, ())):
                    assert FAMILY.name_expression(dtype=dtype, head_dim=d, tile=tile, qk_dim=qk, variants="false",
                                                  varlen="false") in declared
    # The 192-row tiles: the 128-row overlap / persistent tile of head dim 64 with three consumer warpgroups.
    assert set(_sm90.M192_MODE_TILES) == {"2", "3"}
    for mode, table in _sm90.M192_MODE_TILES.items():
        assert set(table) == {64}
        tile = table[64]
        assert dataclasses.replace(tile, block_m=128) == _sm90.MODE_TILES[mode][64]
        assert tile.block_m == 192 and tile.threads == 512 and _sm90.MODE_TILES[mode][64].threads == 384
        # (192 + 2·2·128)·64·2 + 3·64·64·2 O staging + 8·10 barriers + 384·8 anchor + 1024 slack: SharedStorage::kBytes
        assert tile.smem_bytes(64) == 90112 + 24576 + 80 + 3072 + 1024
        for dtype in C_TYPE_16.values():
            assert FAMILY.name_expression(dtype=dtype, head_dim=64, tile=tile, qk_dim=64, variants="false",
                                          varlen="false") in declared


def test_tile_for_m192_override(monkeypatch):
    """Unset, CUPY_ATTN_FA3_M192 gives the 192-row tile to non-causal calls at head dim 64 in modes "2" and "3"; 1
    forces it for causal calls too, 0 turns it off. It is part of the call cache's key (a cached call must not replay
    the other tile) and the tile is named in the plan's details."""
    from cupy_attn.runtime import callcache
    assert _sm90.ENV_M192 in callcache.ENV_KEYS

    def m192(m, d, causal):
        return _sm90.M192_MODE_TILES[m][64] if (m in ("2", "3") and d == 64) else _sm90.MODE_TILES[m][d]

    for env, rule in ((None, lambda causal: not causal), ("0", lambda causal: False), ("1", lambda causal: True)):
        if env is None:
            monkeypatch.delenv(_sm90.ENV_M192, raising=False)
        else:
            monkeypatch.setenv(_sm90.ENV_M192, env)
        for m in _sm90.MODE_TILES:
            for d in _sm90.TILES:
                for causal in (False, True):
                    want = m192(m, d, causal) if rule(causal) else _sm90.MODE_TILES[m][d]
                    assert _sm90.tile_for(m, d, causal) == want, (env, m, d, causal)
    monkeypatch.delenv(_sm90.ENV_M192)

    def details(d):
        kind = _kind(F16, d, d, causal=None)
        return dispatch.fa3_details(_sm90.choose(kind, "3"))
    got = details(64)
    assert got["tile"].startswith("192x128, producer + 3 consumer warpgroups") and "persistent" in got["tile"]
    assert details(128)["tile"].startswith("128x128, producer + 2 consumer warpgroups")


def _swizzle(addr, swz: int):
    """CuTe's Swizzle<B,4,3> on shared-memory byte addresses (B = 3 for the 128-byte swizzle, 2 for the 64-byte one):
    the 16-byte chunk bits 4..3+B XOR bits 7..6+B. TMA's SWIZZLE_128B / SWIZZLE_64B write a box of swz-byte rows in
    this pattern, and wgmma applies it to the addresses its descriptor generates (swizzle mode 1 / 2; the tiles are
    aligned to the 8-row atom, so the descriptors' base offset is 0)."""
    return addr ^ (((addr >> 7) & (swz // 16 - 1)) << 4)


def _operand_mismatches(D: int, tile, swz: int, atom_cols: int, steps_per_block: int, sbo: int) -> int:
    """Elements that a wgmma of the kernel reads from somewhere else than where TMA wrote them, over every operand read
    of one K/V iteration: S = Q Kᵀ (both K-major) and O += P V (V MN-major), for one stage of the ring at D.

    TMA side (the producer in sm90/mainloop.cuh): column block c of a rows × D tile holds columns c·A ... (A =
    atom_cols, one box), at c·rows·A elements from the tile, row r at r·swz bytes, in the swz-byte swizzle. wgmma side
    (PTX ISA "Shared Memory Matrix Layout", CUTLASS make_gmma_desc): K-major, element (m, k) of a 64 × 16 (or N × 16)
    operand at start + (m / 8)·SBO + (m % 8)·swz + 2k; MN-major, element (k, n) of 16 × N at start + (n / A)·LBO +
    2(n % A) + (k / 8)·SBO + (k % 8)·swz; both then swizzled. The start addresses, SBO and LBO are consume()'s, with
    the kernel's constants passed in (kRowBytes = swz, kStepsPerBlock, kAtomBytes = sbo)."""
    bm, bn = tile.block_m, tile.block_n
    q_base, k_base = 0, bm * D * 2
    v_base = k_base + tile.stages * bn * D * 2
    s = tile.stages - 1  # the last stage: a base that is not the tile start
    k_st, v_st = k_base + s * bn * D * 2, v_base + s * bn * D * 2
    for base in (k_base, v_base, k_st, v_st):
        assert base % 1024 == 0

    def written(tile_base, rows, r, c):
        return _swizzle(tile_base + (c // atom_cols) * rows * atom_cols * 2 + r * swz + (c % atom_cols) * 2, swz)

    def k_major(start, m, k):
        return _swizzle(start + (m // 8) * sbo + (m % 8) * swz + 2 * k, swz)

    bad = 0
    k16 = np.arange(16)[None, :]
    for wg in range(bm // 64):
        q_wg = q_base + wg * 64 * swz
        m = np.arange(64)[:, None]
        for kk in range(D // 16):
            a = q_wg + (kk // steps_per_block) * bm * swz + (kk % steps_per_block) * 32
            bad += np.count_nonzero(k_major(a, m, k16) != written(q_base, bm, wg * 64 + m, kk * 16 + k16))
    n = np.arange(bn)[:, None]
    for kk in range(D // 16):
        bk = k_st + (kk // steps_per_block) * bn * swz + (kk % steps_per_block) * 32
        bad += np.count_nonzero(k_major(bk, n, k16) != written(k_st, bn, n, kk * 16 + k16))
    k, n = np.arange(16)[:, None], np.arange(D)[None, :]
    for kk in range(bn // 16):
        start, lbo = v_st + kk * 16 * swz, bn * swz
        read = _swizzle(start + (n // atom_cols) * lbo + (n % atom_cols) * 2 + (k // 8) * sbo + (k % 8) * swz, swz)
        bad += np.count_nonzero(read != written(v_st, bn, kk * 16 + k, n))
    return bad


@pytest.mark.parametrize("D,block_m", [(d, 128) for d in sorted(_sm90.TILES)] + [(64, 192)])
def test_smem_operand_layout_matches_the_tma_swizzle(D, block_m):
    """A NumPy emulation of the shared-memory addressing of every bucket (and of the 192-row tile: three warpgroups'
    Q rows, K/V stages after 24 KB of Q): TMA's swizzled writes against the addresses the kernel's wgmma descriptors
    read (_operand_mismatches), with the swizzle of flash_fwd_sm90.swizzle_bytes (the
    launcher's tensor maps) and the kernel's constants. The 128-byte buckets run on the GPU already, so they check the
    model; D = 96 is the 64-byte swizzle, where the 128-byte constants must fail (the check has teeth)."""
    swz = _sm90.swizzle_bytes(D)
    tile = _sm90.TILES[D] if block_m == 128 else _sm90.M192_MODE_TILES["2"][D]
    assert tile.block_m == block_m
    # The chunk rule the model must agree with: 16-byte chunk c of row r at c ^ (r % 8) (128 B), c ^ ((r / 2) % 4)
    # (64 B: two rows per 128-byte line), per 8-row atom of 8·swz bytes.
    r, c = np.meshgrid(np.arange(16), np.arange(swz // 16), indexing="ij")
    rule = (c ^ (r % 8)) if swz == 128 else (c ^ ((r // 2) % 4))
    assert (_swizzle(r * swz + c * 16, swz) == r * swz + rule * 16).all()
    assert _operand_mismatches(D, tile, swz, swz // 2, swz // 32, 8 * swz) == 0
    assert D * 2 % swz == 0 and (tile.block_m * swz) % 1024 == 0 and (tile.block_n * swz) % 1024 == 0
    if swz == 64:
        assert _operand_mismatches(D, tile, 64, 32, 4, 1024) > 0  # 128-byte k-step arithmetic on 64-byte tiles
        assert _operand_mismatches(D, tile, 64, 32, 2, 1024) > 0  # SBO of the 128-byte atom
    if block_m == 192:  # three warpgroups' Q rows; also with two column blocks of 192 rows (D = 128's layout)
        assert _operand_mismatches(128, tile, 128, 64, 4, 1024) == 0


@pytest.mark.parametrize("D", sorted(_sm90.TILES))
def test_epilogue_staging_matches_the_tma_store_box(D):
    """A NumPy emulation of store_output_tma (cuda_src/attention/sm90/epilogue.cuh): the st.shared address each lane
    writes O's element (row, column) to, per chunk of min(D, 128) columns of one warpgroup's 64 rows, against the
    address a TMA store of the box (64 rows × swz/2 columns, the bucket's swizzle) reads that element from. Every
    element of the chunk is written once, where the box expects it, and the writes of one 4-byte store instruction
    (fixed half and column block, 32 lanes) hit 32 distinct banks."""
    swz = _sm90.swizzle_bytes(D)
    atom, chunk_cols = swz // 2, min(D, 128)
    box_bytes = 64 * swz
    assert D % chunk_cols == 0 and chunk_cols % atom == 0
    for chunk in range(D // chunk_cols):
        seen = {}
        for warp in range(4):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for half in range(2):
                    r = warp * 16 + g + 8 * half
                    sw = r % 8 if swz == 128 else (r // 2) % 4
                    for dd in range(chunk_cols // 8):
                        col = dd * 8
                        box, c16 = col // atom, (col % atom) // 8
                        addr = box * box_bytes + r * swz + ((c16 ^ sw) * 16) + 4 * t
                        for e in range(2):
                            c = col + 2 * t + e  # the element's column within the chunk
                            want = _swizzle(box * box_bytes + r * swz + (c % atom) * 2, swz)
                            assert addr + 2 * e == want, (D, chunk, r, c)
                            assert (r, c) not in seen
                            seen[r, c] = addr + 2 * e
        assert len(seen) == 64 * chunk_cols
    # Banks of one store instruction: warp 0, half 0, each column block.
    for dd in range(chunk_cols // 8):
        banks = set()
        for lane in range(32):
            g, t = lane // 4, lane % 4
            sw = g % 8 if swz == 128 else (g // 2) % 4
            col = dd * 8
            banks.add(((col // atom) * box_bytes + g * swz + (((col % atom) // 8) ^ sw) * 16 + 4 * t) // 4 % 32)
        assert len(banks) == 32, (D, dd, sorted(banks))
    # The staging buffers (one per consumer warpgroup) in the shared-memory size the launcher requests.
    for tile in (_sm90.TILES[D], _sm90.PERSISTENT_TILES[D]):
        without = (tile.block_m + 2 * tile.stages * tile.block_n) * D * 2 + 8 * (2 + 4 * tile.stages) + 1024
        assert tile.smem_bytes(D) - without == (tile.block_m // 64) * 64 * chunk_cols * 2 <= 32768
        assert tile.smem_bytes(D) <= 232448


F16 = np.dtype("float16")


@pytest.mark.parametrize("args,expect", [
    ((F16, 128, 128, "none", 90, 0.1), None),
    ((F16, 64, 64, "none", 90, 1.0), None),
    ((F16, 256, 256, "none", 90, 0.06), None),
    ((F16, 128, 128, "none", 80, 0.1), "sm_90a"),
    ((F16, 96, 96, "none", 90, 0.1), None),       # the 96 bucket (64-byte swizzle)
    ((F16, 80, 64, "none", 90, 0.1), None),       # the 96 bucket on TMA's zero fill past 80
    ((F16, 128, 64, "none", 90, 0.1), None),
    ((F16, 32, 32, "none", 90, 0.1), "head dims 33-256"),
    ((F16, 320, 320, "none", 90, 0.1), "head dims 33-256"),
    ((F16, 128, 128, "bool", 90, 0.1), "attn_mask"),
    ((F16, 128, 128, "none", 90, 0.0), "scale > 0"),
    ((np.dtype("float32"), 128, 128, "none", 90, 0.1), "fp16 and bf16"),
])
def test_unsupported_reason(args, expect):
    dtype, E, Ev, mask_kind, arch, scale = args
    got = _sm90.reason(_kind(dtype, E, Ev, mask_kind, scale), arch)
    if got is not None and "cuda-bindings" in got:
        pytest.skip(got)
    assert got is None if expect is None else expect in got


def _kind(dtype, E, Ev, mask_kind="none", scale=0.1, causal=None):
    """What reason() and choose() read of a problem made without arrays."""
    import types
    return types.SimpleNamespace(dtype=dtype, head_dim=E, head_dim_v=Ev, mask_kind=mask_kind, scale=scale,
                                 causal=causal, query=None)


class _FakeArray:
    """Shape, byte strides, dtype and base address, as layout_reason and MapSpec read them."""

    class _Data:
        def __init__(self, ptr):
            self.ptr = ptr

    def __init__(self, shape, strides, ptr=1 << 20, dtype=F16):
        self.shape, self.strides, self.dtype, self.itemsize = shape, strides, dtype, dtype.itemsize
        self.data = self._Data(ptr)


def _bhsd(B, H, S, D, ptr=1 << 20):
    return _FakeArray((B, H, S, D), (H * S * D * 2, S * D * 2, D * 2, 2), ptr)


def _bshd(B, H, S, D, ptr=1 << 20):
    return _FakeArray((B, H, S, D), (S * H * D * 2, D * 2, H * D * 2, 2), ptr)


def test_tensor_map_layouts():
    spec = tma.MapSpec.of(_bhsd(2, 3, 100, 128), 128)
    assert spec.dims == (128, 100, 3, 2) and spec.strides == (256, 100 * 256, 300 * 256) and spec.box_rows == 128
    assert spec.box_cols == 64
    spec = tma.MapSpec.of(_bhsd(2, 3, 100, 80), 128, 32)  # E = 80 in the 96 bucket: 32-column boxes
    assert spec.dims == (80, 100, 3, 2) and spec.strides == (160, 100 * 160, 300 * 160) and spec.box_cols == 32
    spec = tma.MapSpec.of(_bshd(2, 3, 100, 64), 128)
    assert spec.dims == (64, 100, 3, 2) and spec.strides == (3 * 128, 128, 300 * 128)
    # Axes of size 1 get a valid stride whatever the view says.
    spec = tma.MapSpec.of(_FakeArray((1, 1, 17, 64), (0, 0, 128, 2)), 128)
    assert spec.strides == (128, 128 * 17, 128 * 17)
    spec = tma.MapSpec.of(_FakeArray((2, 3, 1, 64), (3 * 1000 * 2, 1000 * 2, 3, 2)), 128)  # S = 1: any row stride
    assert spec.strides == (128, 1000 * 2, 3 * 1000 * 2)


def test_layout_reason():
    q = _bhsd(2, 8, 100, 128)
    out = _bhsd(2, 8, 100, 128)
    assert _sm90.layout_reason(q, q, q, out) is None
    assert _sm90.layout_reason(_bshd(2, 8, 100, 128), q, q, out) is None
    assert "16-byte" in _sm90.layout_reason(_bhsd(2, 8, 100, 128, ptr=(1 << 20) + 2), q, q, out)
    odd_rows = _FakeArray((2, 8, 100, 64), (8 * 100 * 72 * 2, 100 * 72 * 2, 72 * 2 + 2, 2))
    assert "multiple of 16" in _sm90.layout_reason(q, odd_rows, q, out)
    assert "4-byte" in _sm90.layout_reason(q, q, q, _bhsd(2, 8, 100, 128, ptr=(1 << 20) + 2))


def test_encode_tensor_map_without_a_driver_raises_cleanly():
    """On a machine without libcuda the encode path is exercised up to the driver call; with a GPU it encodes (the
    driver wants a current context, which every real call has: CuPy makes it)."""
    pytest.importorskip("cuda.bindings.driver")
    if _gpu():
        import cupy
        cupy.empty(1)
    try:
        m = tma.MapSpec.of(_bhsd(2, 3, 100, 128), 128).encode(1 << 20)
    except (RuntimeError, OSError) as exc:
        if _gpu():
            raise
        pytest.skip(f"no driver: {exc}")
    else:
        assert m.shape == (128,) and m.dtype == np.uint8


@pytest.mark.parametrize("D,cols,swizzle", [(64, 64, "SWIZZLE_128B"), (96, 32, "SWIZZLE_64B"),
                                             (128, 64, "SWIZZLE_128B"), (256, 64, "SWIZZLE_128B")])
def test_tensor_maps_take_the_bucket_swizzle(monkeypatch, D, cols, swizzle):
    """What the launcher asks cuTensorMapEncodeTiled for, per bucket (the driver call faked): a box one swizzle atom
    wide (rows of swizzle_bytes(D)) and that swizzle; the backward's stats map stays unswizzled."""
    cu = pytest.importorskip("cuda.bindings.driver")
    calls = []

    def fake_encode(data_type, rank, ptr, dims, strides, box, elem_strides, interleave, swz, l2, oob):
        calls.append(([int(b) for b in box], swz))
        return cu.CUresult.CUDA_ERROR_INVALID_VALUE, None  # a failure code: encode raises after the call

    monkeypatch.setattr(cu, "cuTensorMapEncodeTiled", fake_encode)
    monkeypatch.setattr(tma, "_driver_init", lambda: None)
    assert _sm90.swizzle_bytes(D) // 2 == cols
    with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled failed"):
        tma.MapSpec.of(_bhsd(2, 3, 100, 80 if D == 96 else D), 128, cols).encode(1 << 20)  # E = 80: 96 bucket
    assert calls[-1] == ([cols, 128, 1, 1], getattr(cu.CUtensorMapSwizzle, f"CU_TENSOR_MAP_{swizzle}"))
    with pytest.raises(RuntimeError):
        tma.encode_tensor_map("float32", 1 << 20, (256, 8), (1024,), (128, 1))
    assert calls[-1][1] == cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE
    with pytest.raises(ValueError, match="64 or 128 bytes"):
        tma.encode_tensor_map("float16", 1 << 20, (80, 100), (160,), (16, 128))


def test_head_buckets():
    """E, Ev in 65-96 run the 96 bucket (E <= 80: the S GEMM's 5 k steps), a larger Ev the 128 one."""
    cases = {(72, 72): (96, 80), (80, 80): (96, 80), (88, 96): (96, 96), (96, 96): (96, 96), (80, 64): (96, 80),
             (96, 40): (96, 96), (64, 96): (96, 80), (40, 96): (96, 80), (65, 65): (96, 80), (97, 97): (128, 128),
             (72, 128): (128, 80), (96, 128): (128, 96), (64, 64): (64, 64), (33, 64): (64, 64), (160, 160): (256, 256)}
    for (E, Ev), (bucket, qk) in cases.items():
        D = _sm90.head_bucket(E, Ev)
        assert (D, _sm90.qk_dim(E, D)) == (bucket, qk), (E, Ev)


class _FakeKernel:
    """Stands for a RawKernel on CPU: a CUfunction address and the dynamic shared memory attribute."""
    kernel = type("Function", (), {"ptr": 0xF00})()
    max_dynamic_shared_size_bytes = 0


def test_launch_params(monkeypatch):
    """The bytes the kernel gets, as cuLaunchKernel reads them through kernelParams: three maps (encoded once per
    pointer triple, written again only when they change), pointers, sizes, strides; grid, block, shared memory and
    stream as prepared."""
    import ctypes

    from cupy.cuda import driver
    calls, launched = [], []

    def fake_encode(spec, ptr):
        calls.append(ptr)
        return np.full(128, ptr % 251, np.uint8)

    def fake_launch(fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        struct = ctypes.c_uint64.from_address(argv).value
        launched.append(((fn, gx, gy, gz, bx, by, bz, smem, stream, extra),
                         ctypes.string_at(struct, _sm90.PARAMS.itemsize)))

    monkeypatch.setattr(tma.MapSpec, "encode", fake_encode)
    monkeypatch.setattr(driver, "launchKernel", fake_launch)
    q, k = _bhsd(2, 8, 100, 128), _bhsd(2, 2, 70, 128)
    p = np.zeros((), _sm90.PARAMS)
    p["seqlen_q"], p["groups"] = 100, 4
    maps = tuple(tma.MapSpec.of(a, 128) for a in (q, k, k))
    launch = _sm90.build_launch(_FakeKernel(), p, maps, (1, 8, 2), (384,), 1000)
    launch.launch_on(77, 1000, 2000, 3000, 4000, 5000)
    assert calls == [1000, 2000, 3000]
    dims, raw = launched[-1]
    assert dims == (0xF00, 1, 8, 2, 384, 1, 1, 1000, 77, 0)
    got = np.frombuffer(raw, _sm90.PARAMS)[0]
    assert (got["tma_q"] == 1000 % 251).all() and (got["tma_v"] == 3000 % 251).all()
    assert (got["out"], got["lse"], got["seqlen_q"], got["groups"]) == (4000, 5000, 100, 4)
    assert len(raw) == 768 and raw[128] == 2000 % 251 and int.from_bytes(raw[512:520], "little") == 4000
    assert got["o_tma"] == 0 and not got["tma_o"].any(), "no out map prepared: 4-byte stores"
    launch.launch_on(77, 1000, 2000, 3000, 4001)
    assert len(calls) == 3, "same q/k/v pointers: maps reused"
    got = np.frombuffer(launched[-1][1], _sm90.PARAMS)[0]
    assert (got["out"], got["lse"]) == (4001, 0) and (got["tma_k"] == 2000 % 251).all()
    launch.launch_on(78, 1016, 2000, 3000, 4001)
    assert len(calls) == 6
    got = np.frombuffer(launched[-1][1], _sm90.PARAMS)[0]
    assert (got["tma_q"] == 1016 % 251).all() and launched[-1][0][8] == 78
    assert not p["out"] and not p["tma_q"].any(), "the prepared parameters are not written"
    with pytest.raises(ValueError, match="attn_mask"):
        launch.launch_on(77, 1000, 2000, 3000, 4001, 0, 9)
    # With an out map (prepare: Ev a multiple of 8, 16-byte strides): TMA stores where the call's out is 16-byte
    # aligned, its map encoded once per out pointer; 4-byte stores (o_tma 0) for a base that is not.
    o = _bhsd(2, 8, 100, 128)
    assert _sm90.o_tma_reason(o) is None and "multiple of 8" in _sm90.o_tma_reason(_bhsd(2, 8, 100, 100))
    launch = _sm90.build_launch(_FakeKernel(), p, maps, (1, 8, 2), (384,), 1000, tma.MapSpec.of(o, 64))
    calls.clear()
    launch.launch_on(77, 1000, 2000, 3000, 4096, 0)
    got = np.frombuffer(launched[-1][1], _sm90.PARAMS)[0]
    assert calls == [1000, 2000, 3000, 4096] and got["o_tma"] == 1 and (got["tma_o"] == 4096 % 251).all()
    launch.launch_on(77, 1000, 2000, 3000, 4096, 0)
    assert len(calls) == 4, "same out pointer: its map reused"
    launch.launch_on(77, 1000, 2000, 3000, 4104, 0)
    got = np.frombuffer(launched[-1][1], _sm90.PARAMS)[0]
    assert len(calls) == 4 and got["o_tma"] == 0 and got["out"] == 4104, "an 8-byte aligned out: 4-byte stores"


@pytest.mark.parametrize("page_size,D,box_rows", [(16, 128, 16), (64, 128, 64), (256, 128, 128), (32, 256, 32),
                                                  (128, 256, 64)])
def test_paged_varlen_launch(monkeypatch, page_size, D, box_rows):
    """The packed kernel on a paged cache (faked driver): K and V maps over the caches' num_blocks·page_size rows in
    boxes of min(page_size, block_n) rows, seqlen_k = max_blocks·page_size (what a table row addresses), the page
    size and table width in the struct, the block table's pointer passed at the replay; page sizes the producer cannot
    read (not a multiple of 8, neither a divisor nor a multiple of the key block) are refused before."""
    import ctypes
    import types

    import cupy
    from cupy.cuda import driver
    from cupy_attn.attention import variants
    boxes, launched = [], []

    def fake_encode(spec, ptr):
        boxes.append((ptr, spec.box_rows, spec.dims[1]))
        return np.zeros(128, np.uint8)

    def fake_launch(fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        launched.append(ctypes.string_at(ctypes.c_uint64.from_address(argv).value, _sm90.PARAMS.itemsize))

    monkeypatch.setattr(tma.MapSpec, "encode", fake_encode)
    monkeypatch.setattr(driver, "launchKernel", fake_launch)
    monkeypatch.setattr(_sm90, "FLASH_FWD_SM90_TMA", types.SimpleNamespace(kernel=lambda **kw: _FakeKernel()))
    monkeypatch.setattr(_sm90, "device_sms", lambda device: 132)
    monkeypatch.setattr(cupy.cuda, "Device", lambda: types.SimpleNamespace(id=0))
    blocks, max_blocks, Hkv, total_q = 40, 6, 2, 300
    q4 = _FakeArray((1, 8, total_q, D), (0, D * 2, 8 * D * 2, 2))
    kv4 = _FakeArray((1, Hkv, blocks * page_size, D), (0, D * 2, Hkv * D * 2, 2))
    out4 = _FakeArray((1, 8, total_q, D), (0, D * 2, 8 * D * 2, 2))
    lse3 = _FakeArray((1, 8, total_q), (0, total_q * 4, 4), dtype=np.dtype(np.float32))
    bounds = types.SimpleNamespace(key_upper=(True, 0), window_lo=variants.UNBOUNDED_LO, scale=0.1,
                                   variants=variants.NONE)
    assert _sm90.paged_reason(page_size, D, D) is None
    launch = _sm90.build_varlen(q4, kv4, kv4, out4, lse3, bounds=bounds, batch=5, causal=True, page_size=page_size,
                                max_blocks=max_blocks)
    launch.launch_on(7, 1024, 2048, 4096, 8192, 9000, 100, 0, 200, 300)
    assert [b[1:] for b in boxes[1:3]] == [(box_rows, blocks * page_size)] * 2 and boxes[0][1] == 128
    got = np.frombuffer(launched[-1], _sm90.PARAMS)[0]
    assert (got["seqlen_k"], got["max_blocks"], got["page_size"]) == (max_blocks * page_size, max_blocks, page_size)
    assert (got["cu_seqlens_q"], got["cu_seqlens_k"], got["seqused_k"], got["block_table"]) == (100, 0, 200, 300)
    for bad in (12, 48 if D == 128 else 40, 4):
        assert "page size" in _sm90.paged_reason(bad, D, D)


def _schedule(grid: int, pairs: bool, B: int, Hq: int, L: int, causal: bool, block_m: int = 128) -> list:
    """The (m_block, h, b) tiles each CTA runs, in order: cuda_src/attention/sm90/tile_scheduler.cuh's
    StaticTileScheduler<block_m>, transcribed (a check of the order it documents; the GPU tests run the real one)."""
    M = -(-L // block_m)
    pairs = pairs and causal
    per_head = -(-M // 2) if pairs else M
    ctas = []
    for cta in range(grid):
        tiles = []
        for unit in range(cta, per_head * Hq * B, grid):
            bh, k = divmod(unit, per_head)
            h, b = bh % Hq, bh // Hq
            if pairs:
                tiles.append((M - 1 - k, h, b))
                if k < M - 1 - k:
                    tiles.append((k, h, b))
            else:
                tiles.append((M - 1 - k if causal else k, h, b))
        ctas.append(tiles)
    return ctas


@pytest.mark.parametrize("B,Hq,L", [(1, 1, 1), (1, 2, 1000), (2, 16, 8192), (1, 8, 1024), (3, 5, 700), (2, 48, 333),
                                    (1, 1, 128 * 300 + 5)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_sms", [132, 7])
@pytest.mark.parametrize("block_m", [128, 192])
def test_persistent_grid_and_tile_order(B, Hq, L, causal, num_sms, block_m):
    """The persistent grid covers every tile exactly once; causal calls with more tiles than SMs run equal-cost pairs
    (m-blocks M-1-k and k: M + 1 key blocks at L = S), the longer first; consecutive units are m-blocks of one head.
    Also for the 192-row tile (M = ⌈L / 192⌉ m-blocks; a pair's key blocks ⌈1.5(M-1-k+1)⌉ + ⌈1.5(k+1)⌉ vary by one)."""
    tile = _sm90.PERSISTENT_TILES[128] if block_m == 128 else _sm90.M192_MODE_TILES["3"][64]
    assert tile.block_m == block_m
    grid, pairs = _sm90.grid_for(tile, B, Hq, L, causal, num_sms)
    M = -(-L // block_m)
    assert grid[1:] == (1, 1) and 1 <= grid[0] <= num_sms
    assert pairs == (causal and M * Hq * B > num_sms)
    ctas = _schedule(grid[0], pairs, B, Hq, L, causal, block_m)
    every = [t for tiles in ctas for t in tiles]
    assert sorted(every) == sorted((m, h, b) for m in range(M) for h in range(Hq) for b in range(B))
    assert all(ctas), "every CTA has work"
    if pairs:
        for tiles in ctas:
            firsts = [i for i, (m, _, _) in enumerate(tiles) if m >= M - 1 - m]
            for i in firsts:
                m, h, b = tiles[i]
                if m != M - 1 - m:  # not the middle m-block of an odd M
                    assert tiles[i + 1] == (M - 1 - m, h, b)
        costs = [sum(m + 1 for m, _, _ in tiles) for tiles in ctas]
        units = Hq * B * -(-M // 2)
        assert max(costs) <= -(-units // grid[0]) * (M + 1)
    elif causal:
        assert ctas[0][0][0] == M - 1, "longest first"
    if grid[0] > 1 and (-(-M // 2) if pairs else M) > 1:
        assert ctas[1][0][1:] == ctas[0][0][1:], "adjacent CTAs start on m-blocks of one head"


def test_one_tile_grid():
    assert _sm90.grid_for(_sm90.OVERLAP_TILES[64], 3, 5, 700, True, 132) == ((6, 5, 3), False)
    assert _sm90.grid_for(_sm90.M192_MODE_TILES["2"][64], 3, 5, 700, True, 132) == ((4, 5, 3), False)


def _gpu():
    from conftest import gpu_available
    return gpu_available()


# ---------------------------------------------------------------------------------------------------------------------
# GPU

DTYPES = ("float16", "bfloat16")


@pytest.fixture(params=["1", "2", "3"], ids=["fa3", "fa3-overlap", "fa3-persistent"])
def fa3(request, monkeypatch):
    """CUPY_ATTN_FA3=1 (the kernel), =2 (its intra-warpgroup-overlap variant), =3 (that variant, persistent), with
    the 128-row tiles (CUPY_ATTN_FA3_M192=0; fa3_m192 below forces the 192-row tile, the non-causal default at 64)."""
    monkeypatch.setenv(dispatch.ENV_FA3, request.param)
    monkeypatch.setenv(_sm90.ENV_M192, "0")
    return request.param


def _torch():
    return pytest.importorskip("torch")


def _rand(shape, dtype, gen):
    torch = _torch()
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(getattr(torch, dtype))


def _check_fa3(q, k, v, dtype, *, causal=None, what="", expect_fa3=True):
    """tests/test_flash_fwd.py's _check (NaN-poisoned out and lse, float64 reference, torch's same-precision error),
    after checking which launch dispatch.fused_launch builds for these arrays."""
    import cupy
    from test_flash_fwd import _check, _cp
    B, Hq, L, E = q.shape
    out = cupy.empty((B, Hq, L, v.shape[-1]), dtype=_cp(q).dtype)
    launch = dispatch.fused_launch(_cp(q), _cp(k), _cp(v), out, None, scale=E ** -0.5, causal=causal)
    assert (launch.params.dtype == _sm90.PARAMS) == expect_fa3, f"{what}: launch of {launch.kernel}"
    if expect_fa3:
        D = _sm90.head_bucket(E, v.shape[-1])
        tile = _sm90.tile_for(os.environ[dispatch.ENV_FA3], D, causal is not None)
        assert launch.block == (tile.threads,) and launch.smem == tile.smem_bytes(D), what
        if os.environ.get(_sm90.ENV_M192) == "1" and D == 64:
            assert tile.block_m == 192, f"{what}: the 192-row tile forced"
        assert launch.kernel is FAMILY.kernel(dtype=C_TYPE_16[dtype], head_dim=D, tile=tile,
                                              qk_dim=_sm90.qk_dim(E, D), variants="false",
                                              varlen="false"), f"{what}: variant"
        m_blocks = -(-L // tile.block_m)
        if tile.persistent:
            from cupy_attn.runtime.interop import device_sms
            sms = device_sms(cupy.cuda.Device().id)
            pairs = causal is not None and m_blocks * Hq * B > sms
            units = Hq * B * (-(-m_blocks // 2) if pairs else m_blocks)
            assert launch.grid == (min(sms, units), 1, 1), f"{what}: persistent grid {launch.grid}"
            assert int(launch.params["tile_pairs"]) == pairs, what
        else:
            assert launch.grid == (m_blocks, Hq, B), f"{what}: grid {launch.grid}"
    return _check(q, k, v, dtype, causal=causal, what=what)


LS = [(1, 1), (17, 17), (129, 129), (1000, 1000), (1, 1000), (1000, 17), (17, 129), (129, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", [64, 96, 128, 256])
@pytest.mark.parametrize("layout", ["padded", "bshd", "offset8"])
def test_out_layouts_through_the_tma_epilogue(fa3, dtype, E, layout):
    """out as a strided view into a NaN-poisoned buffer, through flash_forward: rows with a padded pitch
    (buf[..., :Ev], 16-byte row stride: TMA stores, whose 16-byte clipping at Ev must not touch the pad), a BSHD view
    (TMA stores along a head stride of Ev), and a base 8 bytes past a 16-byte boundary (the launch falls back to
    4-byte stores, o_tma = 0). out against the float64 reference; every poisoned element outside the view stays NaN.
    L = 200 (a partial last row block), S = 150."""
    import cupy
    from _tolerance import as_f64
    from cupy_attn import reference
    from test_flash_fwd import _cp, assert_out_lse
    torch = _torch()
    g = torch.Generator("cuda").manual_seed(E + len(layout))
    B, H, L, S = 2, 3, 200, 150
    q, k, v = _rand((B, H, L, E), dtype, g), _rand((B, H, S, E), dtype, g), _rand((B, H, S, E), dtype, g)
    cdt = _cp(q).dtype
    if layout == "padded":
        buf = cupy.full((B, H, L, E + 8), np.nan, dtype=cdt)
        out = buf[..., :E]
    elif layout == "bshd":
        buf = cupy.full((B, L, H, E), np.nan, dtype=cdt)
        out = buf.transpose(0, 2, 1, 3)
    else:
        buf = cupy.full(B * H * L * E + 16, np.nan, dtype=cdt)
        start = (-(buf.data.ptr // 2) % 8) + 4  # 8 bytes past a 16-byte boundary
        out = buf[start:start + B * H * L * E].reshape(B, H, L, E)
        assert out.data.ptr % 16 == 8
    lse = cupy.full((B, H, L), np.nan, dtype=cupy.float32)
    from test_flash_fwd import flash_forward
    flash_forward(_cp(q), _cp(k), _cp(v), out, lse, scale=E ** -0.5, causal=None)
    ref, ref_lse = reference.scaled_dot_product_attention(as_f64(q), as_f64(k), as_f64(v), scale=E ** -0.5,
                                                          return_lse=True)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=E ** -0.5)
    assert_out_lse(out, lse, ref, ref_lse, dtype, torch_out, f"{layout} E={E} {dtype}")
    written = cupy.zeros(buf.shape, dtype=cupy.bool_)
    if layout == "padded":
        written[..., :E] = True
    elif layout == "bshd":
        written[...] = True
    else:
        written[start:start + B * H * L * E] = True
    assert np.isnan(as_f64(buf)[~cupy.asnumpy(written)]).all(), f"{layout} E={E}: an element outside out was written"




@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", sorted(_sm90.TILES))
@pytest.mark.parametrize("L,S", LS)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_shapes(fa3, dtype, E, L, S, causal):
    g = _torch().Generator("cuda").manual_seed(L * 31 + S + E)
    q, k, v = _rand((2, 2, L, E), dtype, g), _rand((2, 2, S, E), dtype, g), _rand((2, 2, S, E), dtype, g)
    _check_fa3(q, k, v, dtype, causal=causal, what=f"{dtype} E={E} L={L} S={S} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", sorted(_sm90.TILES))
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_gqa(fa3, dtype, E, causal):
    """8 query heads on 2 key/value heads: query head h reads kv head h // 4."""
    g = _torch().Generator("cuda").manual_seed(E + 8)
    q, k, v = _rand((2, 8, 300, E), dtype, g), _rand((2, 2, 333, E), dtype, g), _rand((2, 2, 333, E), dtype, g)
    _check_fa3(q, k, v, dtype, causal=causal, what=f"{dtype} GQA 8/2 E={E} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", sorted(_sm90.TILES))
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_bshd_views(fa3, dtype, E, causal):
    """(B, S, H, D) storage viewed as (B, H, S, D): head stride D, row stride H·D, read in place by the 4-D maps."""
    g = _torch().Generator("cuda").manual_seed(E + 1)
    q = _rand((2, 257, 4, E), dtype, g).transpose(1, 2)
    k = _rand((2, 190, 4, E), dtype, g).transpose(1, 2)
    v = _rand((2, 190, 4, E), dtype, g).transpose(1, 2)
    _check_fa3(q, k, v, dtype, causal=causal, what=f"{dtype} BSHD E={E} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E,Ev,bucket", [
    (80, 80, 96), (96, 96, 96), (72, 72, 96), (88, 96, 96), (80, 64, 96), (96, 40, 96), (64, 96, 96), (40, 40, 64),
    (72, 128, 128), (96, 112, 128), (160, 160, 256), (192, 192, 256), (200, 136, 256)])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_padded_head_dims(fa3, dtype, E, Ev, bucket, causal):
    """Head dims between the buckets run the next bucket's kernel on TMA's zero fill past E (and Ev): no copies. The
    96 bucket (64-byte swizzle, 32-column boxes) with E or Ev short of 96: a box partly (E = 80, 72, 88) or wholly
    (Ev = 40, 64: the third V box) past the tensor's columns, and the S GEMM stopping at 80 columns (E <= 80)."""
    assert _sm90.head_bucket(E, Ev) == bucket
    g = _torch().Generator("cuda").manual_seed(E * 3 + Ev)
    q, k, v = _rand((2, 4, 257, E), dtype, g), _rand((2, 4, 190, E), dtype, g), _rand((2, 4, 190, Ev), dtype, g)
    _check_fa3(q, k, v, dtype, causal=causal, what=f"{dtype} E={E} Ev={Ev} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("E", sorted(_sm90.TILES))
@pytest.mark.parametrize("L,S", [(700, 300), (640, 640), (333, 1000), (1000, 333)])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_many_tiles(fa3, E, L, S, causal):
    """More tiles than SMs (2 × 48 query heads, GQA on 12 K/V heads: 288-768 tiles on 132 SMs), so the persistent
    variant's CTAs loop: up to 6 tiles each, K/V ring phases and the Q buffer handed over across tiles, causal
    m-blocks in pairs (odd M = 3 at L = 333: the middle block alone). (700, 300) bottom-right: m-blocks 0-2 see no
    key, so every pair's second tile is an empty one, written without loads or ping-pong turns; L = 640 is a multiple
    of 128."""
    g = _torch().Generator("cuda").manual_seed(L * 7 + S + E)
    q, k, v = _rand((2, 48, L, E), "float16", g), _rand((2, 12, S, E), "float16", g), _rand((2, 12, S, E), "float16", g)
    _check_fa3(q, k, v, "float16", causal=causal, what=f"many tiles E={E} L={L} S={S} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_many_tiles_long_causal(fa3, dtype):
    """(1, 24, 2048, 128) causal: 16 m-blocks × 24 heads = 384 tiles, 192 pairs of (15-k, k): 132 CTAs, some with two
    pairs (17 key blocks each)."""
    g = _torch().Generator("cuda").manual_seed(2048)
    q, k, v = (_rand((1, 24, 2048, 128), dtype, g) for _ in range(3))
    _check_fa3(q, k, v, dtype, causal="top_left", what=f"{dtype} (1,24,2048,128) causal")


@pytest.mark.gpu
def test_long_causal(fa3):
    g = _torch().Generator("cuda").manual_seed(4224)
    q, k, v = (_rand((1, 2, 4224, 128), "float16", g) for _ in range(3))
    _check_fa3(q, k, v, "float16", causal="top_left", what="4224² causal")


@pytest.mark.gpu
def test_falls_back(fa3):
    """Calls the kernel does not take keep flash_fwd.cu: rows not 16-byte aligned (q a slice of wider rows), E=32."""
    g = _torch().Generator("cuda").manual_seed(5)
    wide = _rand((1, 2, 100, 68), "float16", g)
    q = wide[..., :64]  # row stride 136 bytes: not a multiple of 16, which TMA needs
    k, v = _rand((1, 2, 100, 64), "float16", g), _rand((1, 2, 100, 64), "float16", g)
    _check_fa3(q, k, v, "float16", what="row stride 136 B", expect_fa3=False)
    q, k, v = (_rand((1, 2, 100, 32), "float16", g) for _ in range(3))
    _check_fa3(q, k, v, "float16", what="E=32", expect_fa3=False)


@pytest.mark.gpu
def test_off_by_default(monkeypatch):
    import cupy
    monkeypatch.delenv(dispatch.ENV_FA3, raising=False)
    q = cupy.zeros((1, 1, 8, 128), cupy.float16)
    assert dispatch.fused_launch(q, q, q, cupy.empty_like(q), None, scale=0.1).params.dtype != _sm90.PARAMS


@pytest.mark.gpu
def test_public_api_and_replay(fa3):
    """Through cupy_attn.scaled_dot_product_attention twice (the second call replays the cached launch, re-encoding
    the tensor maps for the new arrays)."""
    import cupy
    import cupy_attn
    from cupy_attn import reference
    from _tolerance import assert_close
    rs = cupy.random.RandomState(0)
    for seed in range(2):
        q, k, v = (rs.standard_normal((2, 4, 333, 128), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
        out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
        ref, ref_lse = reference.scaled_dot_product_attention(*(cupy.asnumpy(x).astype(np.float64) for x in (q, k, v)),
                                                              is_causal=True, return_lse=True)
        assert_close(out, ref, "float16", what=f"public call {seed}")
        np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=1e-4, atol=2e-3)


# The opt-in 192-row tile (CUPY_ATTN_FA3_M192=1: three consumer warpgroups at head dim 64, modes "2" and "3").


@pytest.fixture(params=["2", "3"], ids=["m192-overlap", "m192-persistent"])
def fa3_m192(request, monkeypatch):
    """CUPY_ATTN_FA3=2 or 3 with CUPY_ATTN_FA3_M192=1: head dim 64 runs the 192-row tile (_check_fa3 asserts it)."""
    monkeypatch.setenv(dispatch.ENV_FA3, request.param)
    monkeypatch.setenv(_sm90.ENV_M192, "1")
    return request.param


# LS and lengths around the 192-row m-blocks: one row short of a block, exactly one, one past; two and three blocks
# with rows past L in the last (rows >= L computed, not stored); S not a multiple of the 128-key blocks.
LS_M192 = LS + [(191, 191), (192, 192), (193, 193), (385, 1000), (1000, 385), (577, 577), (383, 129)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,S", LS_M192)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_m192_shapes(fa3_m192, dtype, L, S, causal):
    """Out and lse of the 192-row tile against the float64 reference: odd L and S, both causal alignments (bottom-
    right with L > S: the first m-blocks see no key; a causal block's first warpgroup may see none of the key block
    that its last warpgroup needs)."""
    g = _torch().Generator("cuda").manual_seed(L * 31 + S + 192)
    q, k, v = _rand((2, 2, L, 64), dtype, g), _rand((2, 2, S, 64), dtype, g), _rand((2, 2, S, 64), dtype, g)
    _check_fa3(q, k, v, dtype, causal=causal, what=f"m192 {dtype} L={L} S={S} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_m192_gqa_and_padded_head_dims(fa3_m192, dtype, causal):
    """GQA (8 query heads on 2 key/value heads), BSHD views, and head dims 40 and 48/64 in the 64 bucket (TMA's zero
    fill past E and Ev) on the 192-row tile."""
    g = _torch().Generator("cuda").manual_seed(193)
    q, k, v = _rand((2, 8, 300, 64), dtype, g), _rand((2, 2, 333, 64), dtype, g), _rand((2, 2, 333, 64), dtype, g)
    _check_fa3(q, k, v, dtype, causal=causal, what=f"m192 {dtype} GQA 8/2 causal={causal}")
    q = _rand((2, 257, 4, 64), dtype, g).transpose(1, 2)
    k, v = (_rand((2, 190, 4, 64), dtype, g).transpose(1, 2) for _ in range(2))
    _check_fa3(q, k, v, dtype, causal=causal, what=f"m192 {dtype} BSHD causal={causal}")
    for E, Ev in ((40, 40), (48, 64)):
        q, k, v = _rand((2, 4, 257, E), dtype, g), _rand((2, 4, 190, E), dtype, g), _rand((2, 4, 190, Ev), dtype, g)
        _check_fa3(q, k, v, dtype, causal=causal, what=f"m192 {dtype} E={E} Ev={Ev} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("L,S", [(700, 300), (640, 640), (333, 1000), (1000, 333), (1152, 1152)])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_m192_many_tiles(fa3_m192, L, S, causal):
    """More 192-row tiles than SMs (2 × 48 query heads on 12 K/V heads, M = ⌈L / 192⌉ = 4, 4, 2, 6, 6 m-blocks: 192-576
    tiles on 132 SMs): the persistent CTAs loop over tiles and causal pairs. (700, 300) bottom-right: m-blocks 0 and 1
    see no key (every pair's second tile is an empty one); L = 1152 = 6 · 192."""
    g = _torch().Generator("cuda").manual_seed(L * 7 + S + 192)
    q = _rand((2, 48, L, 64), "float16", g)
    k, v = _rand((2, 12, S, 64), "float16", g), _rand((2, 12, S, 64), "float16", g)
    _check_fa3(q, k, v, "float16", causal=causal, what=f"m192 many tiles L={L} S={S} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_m192_long_causal(fa3_m192, dtype):
    """(1, 24, 2048, 64) causal: 11 m-blocks of 192 rows × 24 heads = 264 tiles in pairs (10-k, k), the middle m-block
    5 alone; and one long head pair (1, 2, 4224, 64): 22 m-blocks of up to 33 key blocks."""
    g = _torch().Generator("cuda").manual_seed(2049)
    q, k, v = (_rand((1, 24, 2048, 64), dtype, g) for _ in range(3))
    _check_fa3(q, k, v, dtype, causal="top_left", what=f"m192 {dtype} (1,24,2048,64) causal")
    q, k, v = (_rand((1, 2, 4224, 64), dtype, g) for _ in range(3))
    _check_fa3(q, k, v, dtype, causal="top_left", what=f"m192 {dtype} 4224² causal")


@pytest.mark.gpu
def test_m192_public_sdpa(fa3_m192, monkeypatch):
    """Through cupy_attn.scaled_dot_product_attention on torch tensors: the plan names the 192-row tile, out and lse
    match the reference, and switching CUPY_ATTN_FA3_M192 off for the same call (a call-cache key) gives the 128-row
    tile's result, equal within the same tolerance."""
    import torch
    import cupy_attn
    from cupy_attn import reference
    from _tolerance import assert_close
    g = torch.Generator("cuda").manual_seed(64)
    q, k, v = _rand((2, 8, 1000, 64), "bfloat16", g), _rand((2, 2, 777, 64), "bfloat16", g), \
        _rand((2, 2, 777, 64), "bfloat16", g)
    plan = cupy_attn.explain(q, k, v, is_causal=True, enable_gqa=True)
    assert plan.details["tile"].startswith("192x128, producer + 3 consumer warpgroups"), plan.details
    ref, ref_lse = reference.scaled_dot_product_attention(
        *(x.float().cpu().numpy().astype(np.float64) for x in (q, k, v)), is_causal=True, enable_gqa=True,
        return_lse=True)
    outs = []
    for m192 in ("1", "0", "1"):
        monkeypatch.setenv(_sm90.ENV_M192, m192)
        out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
        assert_close(out, ref, "bfloat16", what=f"public call, CUPY_ATTN_FA3_M192={m192}")
        np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=1e-4, atol=2e-3)
        outs.append(out)
    assert torch.equal(outs[0], outs[2]), "the same tile twice: the same bits"
    monkeypatch.setenv(_sm90.ENV_M192, "0")
    assert cupy_attn.explain(q, k, v, is_causal=True, enable_gqa=True).details["tile"].startswith("128x128")


def test_explain_details(monkeypatch):
    """The fused plan's details (explain()) name the FA3 kernel under CUPY_ATTN_FA3 (and, unset, for calls of at
    least dispatch.FA3_MIN_FLOPS), or say why not."""
    import types
    from cupy_attn.attention import dispatch
    if _sm90.reason(_kind(F16, 128, 128), 90):
        pytest.skip("cuda-bindings missing")
    q = _bhsd(2, 8, 100, 128)
    p = types.SimpleNamespace(query=q, key=q, value=q, mask=None, scale=0.1, dtype=F16, head_dim=128, head_dim_v=128,
                              batch=2, num_heads=8, seqlen_q=100, seqlen_k=100, dropout_p=0.0, causal=None,
                              mask_kind="none")

    def details():
        return dispatch.plan_fused(p, 90, "test").details

    monkeypatch.delenv(dispatch.ENV_FA3, raising=False)
    assert details()["kernel"] == "flash_fwd_sm90a"  # auto: a small call keeps the wgmma kernel
    big = types.SimpleNamespace(**{**vars(p), "seqlen_q": 4096, "seqlen_k": 4096})
    # auto: the persistent variant (dispatch.fa3_mode); at head dim 64 the 192-row tile unless causal (tile_for)
    monkeypatch.delenv(_sm90.ENV_M192, raising=False)
    assert dispatch.plan_fused(big, 90, "test").details["kernel"] == "flash_fwd_sm90_tma (overlap, persistent)"
    q64 = _bhsd(2, 8, 4096, 64)
    big64 = types.SimpleNamespace(**{**vars(big), "query": q64, "key": q64, "value": q64, "head_dim": 64,
                                     "head_dim_v": 64})
    got = dispatch.plan_fused(big64, 90, "test").details
    assert got["kernel"] == "flash_fwd_sm90_tma (overlap, persistent)" and got["tile"].startswith("192x128")
    assert got["epilogue"].startswith("out through shared memory by TMA")
    big64.causal = "top_left"
    got = dispatch.plan_fused(big64, 90, "test").details
    assert got["kernel"] == "flash_fwd_sm90_tma (overlap, persistent)" and got["tile"].startswith("128x128")
    monkeypatch.setenv(dispatch.ENV_FA3, "0")
    assert dispatch.plan_fused(big, 90, "test").details["kernel"] == "flash_fwd_sm90a"
    for mode, overlap in (("1", False), ("2", True), ("3", True)):
        monkeypatch.setenv(dispatch.ENV_FA3, mode)
        got = details()
        assert got["kernel"].startswith("flash_fwd_sm90_tma") and ("overlap" in got["tile"]) == overlap
        assert ("persistent" in got["kernel"]) == ("persistent" in got["tile"]) == (mode == "3")
    p.key = _bhsd(2, 8, 100, 128, ptr=(1 << 20) + 8)
    got = details()
    assert got["kernel"] == "flash_fwd_sm90a" and "16-byte" in got["FA3 kernel"]
