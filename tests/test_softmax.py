"""The split path's mask + softmax pass (cupy_attn.attention.kernels.softmax, cuda_src/attention/softmax.cu): its tile
table covers every row length with a declared instantiation, and a chunk's launch carries the struct the plan's choice
asks for (CPU). The kernel runs on the GPU inside the split path's tests (tests/test_sdpa.py, test_dropout.py)."""
import types

import numpy as np

from cupy_attn.attention.kernels import softmax as _softmax


def test_softmax_tile_covers_row():
    for masked in (False, True):
        for S in (1, 77, 128, 129, 512, 1000, 1024, 1025, 8192, 16384, 16385, 100000):
            threads, vecs = _softmax.tile_for(S, masked)
            assert vecs == 0 or threads * vecs * 4 >= S
            assert vecs == 0 or threads * vecs * 4 < 4 * S + 4 * 128  # the smallest entry that covers S (within 4x)
            for dropout in ("false", "true") if masked else ("false",):  # dropout calls take the masked tiles
                assert _softmax.SOFTMAX.name_expression(out_t="__half", tile=(threads, vecs),
                                                        masked=str(masked).lower(), dropout=dropout) \
                    in _softmax.SOFTMAX.name_expressions()


def test_masked_calls_take_the_masked_tiles():
    """An attn_mask, a causal mask or dropout: the masked list (its S ≤ 512 entry differs), else the unmasked one."""
    def call(mask=None, causal=None, dropout_p=0.0):
        return types.SimpleNamespace(mask=mask, causal=causal, dropout_p=dropout_p)
    assert not _softmax.masked(call())
    assert all(_softmax.masked(c) for c in (call(mask=np.ones(1, bool)), call(causal="top_left"), call(dropout_p=0.1)))
    assert _softmax.tile_for(512, masked=True) == (32, 4) and _softmax.tile_for(512, masked=False) == (64, 2)


def test_base_params_encode_no_causal_mask_as_every_key_visible():
    """The kernel has no is_causal flag: without a causal mask the limit is S (key j < S ≤ i + S), with one the
    problem's offset (checks.SDPAProblem.visible_offset)."""
    from cupy_attn.attention import checks
    from cupy_attn.runtime import interop

    def call(causal):
        return checks.SDPAProblem(ctx=interop.CallContext(interop.CUPY, 0), query=None, key=None, value=None,
                                  batch_shape=(2, 4), batch=2, num_heads=4, num_kv_heads=4, seqlen_q=100,
                                  seqlen_k=300, head_dim=64, head_dim_v=64, dtype=np.dtype("float16"), scale=0.1,
                                  causal=causal)
    axes = [(1, 0, 0, 0), (2, 0, 100, 1), (3, 0, 200, 2)]
    for causal, offset in ((None, 300), ("top_left", 0), ("bottom_right", 200)):
        base = _softmax.base_params(call(causal), 304, axes)
        assert int(base["causal_offset"]) == offset and int(base["ld"]) == 304
        got = (int(base["n1"]), int(base["n2"]), int(base["lse_stride_b2"]), int(base["bh_stride_b1"]))
        assert got == (2, 3, 200, 1)
