"""A decode loop whose key length grows each step (Hugging Face's dynamic cache) on the GPU: after the first call of
a family, each step replays a retargeted launch (attention/decode_loop.py) without the checks, the plan or a new
call-cache entry, and gives torch's SDPA result under the suite's error rule."""
import pytest

import cupy_attn
from cupy_attn.attention import decode_loop
from cupy_attn.runtime import callcache

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_growing_cache_replays_retargeted_launches(dtype, masked):
    gen = torch.Generator("cuda").manual_seed(23)
    B, Hq, Hkv, E = 4, 32, 8, 128
    k = torch.randn((B, Hkv, 300, E), generator=gen, device="cuda").to(dtype)
    v = torch.randn((B, Hkv, 300, E), generator=gen, device="cuda").to(dtype)
    callcache.clear()
    replays = []
    real = decode_loop.replay

    def counting(*args):
        out = real(*args)
        replays.append(out is not None)
        return out
    decode_loop.replay = counting
    try:
        for step in range(40):
            q = torch.randn((B, Hq, 1, E), generator=gen, device="cuda").to(dtype)
            S = k.shape[2]
            mask = None
            if masked:  # Hugging Face's left padding: sequence b's first 7·b keys hidden, a new (B, 1, 1, S) mask
                mask = (torch.arange(S, device="cuda")[None, :] >= 7 * torch.arange(B, device="cuda")[:, None])
                mask = mask[:, None, None, :].contiguous()
            out = cupy_attn.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
            want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask,
                                                                    enable_gqa=True)
            torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
            grow = [torch.randn((B, Hkv, 1, E), generator=gen, device="cuda").to(dtype) for _ in range(2)]
            k, v = torch.cat([k, grow[0]], dim=2), torch.cat([v, grow[1]], dim=2)
    finally:
        decode_loop.replay = real
    assert sum(replays) >= 35, replays  # the first call (and any new split count) takes the full path
    assert len(callcache._CACHE) <= 5


def test_family_keys():
    q = torch.randn((2, 8, 1, 64), device="cuda", dtype=torch.float16)
    k1, v1 = (torch.randn((2, 2, 500, 64), device="cuda", dtype=torch.float16) for _ in range(2))
    k2, v2 = (torch.randn((2, 2, 777, 64), device="cuda", dtype=torch.float16) for _ in range(2))
    args = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=True, backend="auto",
                return_lse=False, allow_tf32=False, workspace_bytes=None, num_splits=None,
                variants=(None, None, None, None), generator=None)
    key = decode_loop.family_key(q, k1, v1, **args)
    assert key is not None and key == decode_loop.family_key(q, k2, v2, **args)  # S left out
    assert decode_loop.family_key(q, k1.transpose(1, 2).contiguous().transpose(1, 2), v1, **args) is None
    assert decode_loop.family_key(q, k1, v1, **{**args, "attn_mask": torch.ones(500, dtype=torch.bool,
                                                                                 device="cuda")}) is None
    assert decode_loop.family_key(q, k1, v1, **{**args, "variants": (None, 30.0, None, None)}) is None
    assert decode_loop.family_key(q, k1, v1, **{**args, "is_causal": True}) != key
    assert decode_loop.family_key(q[:1], k1[:1], v1[:1], **args) != key
