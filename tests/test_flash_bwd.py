"""The mma.sync fused backward (cupy_attn.attention.kernels.flash_bwd, cuda_src/attention/flash_bwd.cu): its tile table
against the declared family, the head-dim buckets, and the shared memory of every tile within sm_8x's smallest limit
(CPU; tests/test_compile.py compiles every variant without spills). Gradients against the float64 reference through
autograd, CUPY_ATTN_BWD=mma: tests/test_sdpa_backward.py and tests/test_flash_bwd_sm90.py (GPU)."""
import pytest

from cupy_attn.attention.kernels import flash_bwd as _mma
from cupy_attn.runtime.kernel_abi import C_TYPE_16


def test_tiles_are_the_declared_family():
    declared = set(_mma.FLASH_BWD.name_expressions())
    for d, tile in _mma.TILES.items():
        assert tile in _mma.TILE_CHOICES
        for dtype in C_TYPE_16.values():
            for dropout in ("false", "true"):
                assert _mma.FLASH_BWD.name_expression(dtype=dtype, head_dim=d, tile=tile, dropout=dropout) in declared
    assert len(declared) == 2 * len(_mma.TILES) * len(_mma.TILE_CHOICES) * 2


@pytest.mark.parametrize("E,Ev,bucket", [(1, 1, 64), (64, 64, 64), (40, 72, 128), (128, 100, 128), (129, 64, None),
                                         (0, 64, None)])
def test_head_dim_bucket(E, Ev, bucket):
    assert _mma.head_dim_bucket(E, Ev) == bucket


def test_shared_memory_fits_sm80():
    """K, V, Q, dO (and their staging) rows padded by 8 elements, the score tile and 2·kBlockM fp32 statistics: the
    launch's dynamic shared memory (flash_bwd.FlashBackward), within sm_80's 163 KB per block (head dim 64 also within
    sm_86/sm_89's 99 KB; 128 is not: 158,208 bytes)."""
    sizes = {}
    for d, (warps, block_m) in _mma.TILES.items():
        block_n = 16 * warps
        sizes[d] = ((2 * block_n + 4 * block_m) * (d + 8) + block_n * (block_m + 8)) * 2 + 2 * block_m * 4
    assert max(sizes.values()) <= 166912 and sizes[64] <= 101376, sizes
