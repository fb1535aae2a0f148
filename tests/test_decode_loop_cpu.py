"""The decode loop's retargeted launches (attention/decode_loop.py) on a CPU machine: a launch built for one key
length and rewritten for another carries the bytes a launch built for that length carries (the same kernel, grid and
struct), so a replay on the GPU runs the call the full path would; the family key leaves out exactly S."""
import numpy as np
import pytest

from cupy_attn.attention import checks, decode_loop
from cupy_attn.attention.kernels import flash_decode

import _launch_capture as capture


def _problem(S, B=8, Hq=32, Hkv=8, L=1, E=128, mask=False, causal=None):
    q, k, v, o = capture._qkvo(B, Hq, Hkv, L, S, E, E, capture.F16)
    lse = capture.FakeArray((B, Hq, L), capture.F32, capture.LSE)
    # A (B, 1, L, S) bool padding mask as the checks broadcast it to (B, Hq, L, S): stride 0 along the heads.
    m = capture.FakeArray((B, Hq, L, S), capture.BOOL, capture.MASK, (L * S, 0, S, 1)) if mask else None
    p = checks.SDPAProblem(ctx=capture.FakeCtx(), query=q, key=k, value=v, batch_shape=(B, Hq), batch=B,
                           num_heads=Hq, num_kv_heads=Hkv, seqlen_q=L, seqlen_k=S, head_dim=E, head_dim_v=E,
                           dtype=capture.F16, scale=0.088, causal=causal, mask=m,
                           mask_kind="bool" if mask else "none")
    return p, o, lse


def _mask_strides(p):
    return None if p.mask is None else tuple(s // p.mask.itemsize for s in p.mask.strides)


@pytest.mark.parametrize("shape,lengths", [
    (dict(), (4096, 4097, 5000)),                                  # GQA decode, one split
    (dict(B=1, Hq=8, Hkv=8), (4096, 4160, 6000)),                 # few CTAs: several splits
    (dict(B=2, Hq=16, Hkv=2, L=4), (300, 301, 1023)),             # 4 query rows x 8 heads
    (dict(E=64), (257, 2048)),
    (dict(mask=True), (4096, 4097, 4500)),                         # Hugging Face's padding mask, growing with S
    (dict(B=2, Hq=16, Hkv=2, L=4, mask=True), (300, 333)),
    (dict(B=2, Hq=16, Hkv=2, L=4, causal="bottom_right"), (300, 301, 333)),  # the causal offset follows S
    (dict(L=2, causal="top_left"), (4096, 4099))])
def test_a_retargeted_launch_carries_a_fresh_launchs_bytes(shape, lengths, monkeypatch):
    for key in ("CUPY_ATTN_DECODE", "CUPY_ATTN_DECODE_WARPS"):
        monkeypatch.delenv(key, raising=False)
    rec = capture.Recorder(monkeypatch)
    rec.cc = 90
    first, o, lse = _problem(lengths[0], **shape)
    c1 = flash_decode.choose(first, 90, 132)
    template = flash_decode.build(first, c1, o, lse)
    compared = 0
    for S in lengths[1:]:
        p, _, _ = _problem(S, **shape)
        c = flash_decode.choose(p, 90, 132)
        if (c.tile, c.num_splits) != (c1.tile, c1.num_splits):
            continue  # another template's (decode_loop keys templates by tile and split count)
        fresh = flash_decode.build(p, c, o, lse)
        template.write_fields(decode_loop.fields(p, c, _mask_strides(p), p.causal))
        assert template.struct_bytes() == fresh.struct_bytes(), S
        assert (template.grid, template.block, template.smem) == (fresh.grid, fresh.block, fresh.smem)
        compared += 1
    assert compared, "no length of the case shares the first one's template"


def test_write_fields_refuses_what_is_not_an_8_byte_word(monkeypatch):
    rec = capture.Recorder(monkeypatch)
    rec.cc = 90
    p, o, lse = _problem(1024)
    launch = flash_decode.build(p, flash_decode.choose(p, 90, 132), o, lse)
    with pytest.raises(KeyError):
        launch.write_fields({"no_such_field": 1})
    before = launch.struct_bytes()
    launch.write_fields({"seqlen_k": 1024})
    assert launch.struct_bytes() == before
