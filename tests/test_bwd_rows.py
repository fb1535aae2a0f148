"""The backward's row kernels (cupy_attn.attention.kernels.bwd_rows, cuda_src/attention/bwd_rows.cu): the delta pre-pass's
threads per row, the group sum's choice of its 4-wide kernel, and the split backward's shared BwdParams (CPU). They
run on the GPU inside every backward test (tests/test_sdpa_backward.py, tests/test_flash_bwd_sm90.py)."""
import numpy as np
import pytest

from cupy_attn.attention import checks
from cupy_attn.attention.kernels import bwd_rows


@pytest.mark.parametrize("E,Ev,threads", [(64, 64, 8), (128, 128, 16), (256, 256, 32), (512, 512, 32), (96, 96, 16),
                                          (40, 40, 8), (100, 100, 32), (256, 8, 16)])
def test_delta_row_threads(E, Ev, threads):
    got = bwd_rows.delta_row_threads(E, Ev)
    assert got == threads and got & (got - 1) == 0
    if Ev % 8 == 0:  # every thread loads at most one 16-byte chunk of dO and zeroes at most four of dQ's fp32 row
        assert got * 8 >= Ev or got == 32
        assert got * 16 >= E or got == 32


def test_base_params_encode_no_causal_mask_as_every_key_visible():
    """The row kernels have no is_causal flag: without a causal mask the limit is S; with one the problem's offset."""
    from cupy_attn.runtime import interop

    def problem(causal):
        return checks.SDPAProblem(ctx=interop.CallContext(interop.CUPY, 0), query=None, key=None, value=None,
                                  batch_shape=(2, 4), batch=2, num_heads=4, num_kv_heads=4, seqlen_q=100,
                                  seqlen_k=300, head_dim=64, head_dim_v=64, dtype=np.dtype("float16"), scale=0.1,
                                  causal=causal)
    for causal, offset in ((None, 300), ("top_left", 0), ("bottom_right", 200)):
        base = bwd_rows.base_params(problem(causal), 0x1000, 0x2000, 304)
        assert int(base["causal_offset"]) == offset
        assert (int(base["lse"]), int(base["delta"]), int(base["ld"]), int(base["num_heads"])) == (0x1000, 0x2000, 304, 4)
    assert bwd_rows.BWD_PARAMS.itemsize == 8 * len(bwd_rows.BWD_PARAMS.names)
    assert bwd_rows.BWD_PARAMS["dropout_scale"] == np.float64
