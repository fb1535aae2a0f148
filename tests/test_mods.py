"""score_mod / mask_mod on the GPU (the FA3-design kernel's mod instantiation at head dims 33-256, the split path's
softmax kernel beyond, and the split backward's rows kernels) against the float64 reference
running the mods' Python forms, under the suite's error rule (tests/_helpers/_tolerance.py: the peer is the same
math in torch ops at the inputs' precision, the mods applied to its scores): ALiBi from a slope table, a document mask,
prefix-LM, a relative-position bias table; with causal masks, GQA, head dims of every path, torch and CuPy inputs."""
import dataclasses

import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference

from _tolerance import as_f64, assert_close

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

MODS = {
    "alibi": cupy_attn.AttentionMod(
        score_mod="return score - aux.slopes[h] * fabsf(float(q_idx - kv_idx));", score_mod_grad="return 1.f;",
        reference_score_mod=lambda s, b, h, i, j, aux: s - aux.slopes[h] * abs(i - j)),
    "tanh_cap": cupy_attn.AttentionMod(
        score_mod="return 8.f * tanhf(score / 8.f);",
        score_mod_grad="const float t = tanhf(score / 8.f);\nreturn 1.f - t * t;",
        reference_score_mod=lambda s, b, h, i, j, aux: 8.0 * (np.tanh(s / 8.0) if isinstance(s, np.ndarray)
                                                              else torch.tanh(s / 8.0))),
    "document": cupy_attn.AttentionMod(
        mask_mod="return aux.doc[b * aux.doc_shape[1] + q_idx] == aux.doc[b * aux.doc_shape[1] + kv_idx];",
        reference_mask_mod=lambda b, h, i, j, aux: aux.doc[b, i] == aux.doc[b, j]),
    "prefix_lm": cupy_attn.AttentionMod(
        mask_mod="return kv_idx <= q_idx || kv_idx < aux.prefix[b];",
        reference_mask_mod=lambda b, h, i, j, aux: (j <= i) | (j < aux.prefix[b])),
    "rel_bias": cupy_attn.AttentionMod(
        score_mod="const int n = int(aux.table_shape[1]);\n"
                  "return score + aux.table[h * n + min(abs(q_idx - kv_idx), n - 1)];", score_mod_grad="return 1.f;",
        reference_score_mod=lambda s, b, h, i, j, aux: s + aux.table[h, np.minimum(abs(i - j), aux.table.shape[1] - 1)]
        if isinstance(s, np.ndarray) else s + aux.table[h, torch.clamp(abs(i - j), max=aux.table.shape[1] - 1)]),
}


def _aux(name, B, Hq, L, S, gen):
    if name == "alibi":
        return {"slopes": torch.rand(Hq, generator=gen, device="cuda") * 0.5}
    if name == "document":
        n = max(L, S)
        cuts = torch.sort(torch.randint(0, n, (B, 3), generator=gen, device="cuda"), dim=1).values
        doc = (torch.arange(n, device="cuda")[None, :, None] >= cuts[:, None, :]).sum(-1).to(torch.int32)
        return {"doc": doc.contiguous()}
    if name == "prefix_lm":
        return {"prefix": torch.randint(0, S + 1, (B,), generator=gen, device="cuda", dtype=torch.int32)}
    if name == "tanh_cap":
        return None
    return {"table": torch.randn((Hq, 64), generator=gen, device="cuda")}


def _peer(q, k, v, mod, aux, causal):
    """The same math in torch ops at the inputs' precision (scores and mods in the input dtype, softmax in fp32;
    float64 inputs: float64 throughout, the gradients' reference)."""
    Hq, Hkv = q.shape[-3], k.shape[-3]
    if Hq != Hkv:
        k, v = k.repeat_interleave(Hq // Hkv, dim=-3), v.repeat_interleave(Hq // Hkv, dim=-3)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    b, h, i, j = (x.to(q.device) for x in reference.mod_indices(tuple(s.shape), torch))
    ns = type("Aux", (), dict(aux or {}))
    if mod.score_mod is not None:
        s = mod.reference_score_mod(s, b, h, i, j, ns).to(q.dtype)
    keep = torch.ones(s.shape, dtype=torch.bool, device=q.device)
    if mod.mask_mod is not None:
        keep = keep & mod.reference_mask_mod(b, h, i, j, ns)
    if causal:
        keep = keep & torch.from_numpy(reference.visible_keys(s.shape[-2], s.shape[-1], causal, None)).cuda()
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s.float() if s.dtype != torch.float64 else s, dim=-1).nan_to_num(0.0).to(q.dtype)
    return p @ v


def _check(q, k, v, name, aux, dtype, causal=False, what=""):
    mod = MODS[name]
    gqa = q.shape[-3] != k.shape[-3]
    out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, score_mod=mod,
                                                      aux=aux, return_lse=True)
    host_aux = {n: a.cpu().numpy() if hasattr(a, "cpu") else a.get() for n, a in (aux or {}).items()}
    ns = type("Aux", (), host_aux)
    score = None if mod.score_mod is None else (lambda s, b, h, i, j: mod.reference_score_mod(s, b, h, i, j, ns))
    mask = None if mod.mask_mod is None else (lambda b, h, i, j: mod.reference_mask_mod(b, h, i, j, ns))
    ref, ref_lse = reference.scaled_dot_product_attention(as_f64(q), as_f64(k), as_f64(v), is_causal=causal,
                                                          enable_gqa=gqa, return_lse=True, score_mod=score,
                                                          mask_mod=mask)
    assert_close(out, ref, dtype, _peer(q, k, v, mod, aux, causal), what)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(as_f64(lse)[finite], ref_lse[finite], rtol=2e-3, atol=2e-3, err_msg=what)
    assert np.all(as_f64(lse)[~finite] == -np.inf), what


# (B, Hq, Hkv, L, S, E): head dims 64 to 1000 (the split path serves them all), L != S both ways, GQA.
SHAPES = [(2, 4, 2, 300, 300, 64), (1, 8, 2, 1000, 1000, 128), (2, 4, 4, 129, 700, 256), (1, 4, 2, 383, 383, 512),
          (1, 2, 2, 100, 230, 1000), (1, 2, 1, 17, 20000, 64)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(MODS))
def test_mods_match_the_reference(dtype, shape, name):
    B, Hq, Hkv, L, S, E = shape
    gen = torch.Generator("cuda").manual_seed(sum(shape))
    q, k, v = (torch.randn(s, generator=gen, device="cuda").to(DTYPES[dtype])
               for s in ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, E)))
    aux = _aux(name, B, Hq, L, S, gen)
    _check(q, k, v, name, aux, dtype, causal=False, what=f"{name} {shape}")
    if L <= S:
        _check(q, k, v, name, aux, dtype, causal="bottom_right", what=f"{name} {shape} causal")


@pytest.mark.parametrize("name", list(MODS))
def test_fa3_and_split_paths_agree(name):
    """The FA3-design kernel's mod instantiation and the split path's, on one call: both within the rule, and close to
    each other (different summation orders)."""
    gen = torch.Generator("cuda").manual_seed(11)
    q, k, v = (torch.randn((2, 4, 700, 128), generator=gen, device="cuda").bfloat16() for _ in range(3))
    aux = _aux(name, 2, 4, 700, 700, gen)
    fused = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=MODS[name], aux=aux,
                                                   backend="fused")
    split = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=MODS[name], aux=aux,
                                                   backend="split")
    torch.testing.assert_close(fused.float(), split.float(), rtol=2e-2, atol=2e-2)


def test_mods_with_float32_and_cupy_inputs():
    cupy = pytest.importorskip("cupy")
    gen = torch.Generator("cuda").manual_seed(5)
    q, k, v = (torch.randn((2, 4, 200, 96), generator=gen, device="cuda") for _ in range(3))
    aux = _aux("document", 2, 4, 200, 200, gen)
    _check(q, k, v, "document", aux, "float32", causal=True, what="float32")
    out = cupy_attn.scaled_dot_product_attention(*(cupy.asarray(x.half()) for x in (q, k, v)),
                                                 score_mod=MODS["document"], aux={"doc": cupy.asarray(aux["doc"])})
    want = cupy_attn.scaled_dot_product_attention(q.half(), k.half(), v.half(), score_mod=MODS["document"], aux=aux)
    assert isinstance(out, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(out).astype(np.float32), want.float().cpu().numpy())


def test_document_mask_equals_the_bool_mask_call():
    gen = torch.Generator("cuda").manual_seed(7)
    q, k, v = (torch.randn((2, 4, 500, 128), generator=gen, device="cuda").half() for _ in range(3))
    aux = _aux("document", 2, 4, 500, 500, gen)
    mask = (aux["doc"][:, None, :, None] == aux["doc"][:, None, None, :])
    accurate = dataclasses.replace(MODS["document"], fast_math=False)  # the plain kernels' IEEE arithmetic
    out = cupy_attn.scaled_dot_product_attention(q, k, v, score_mod=accurate, aux=aux, backend="split")
    want = cupy_attn.scaled_dot_product_attention(q, k, v, mask, backend="split")
    torch.testing.assert_close(out, want, rtol=0, atol=0)  # the same softmax arithmetic, the mask from the mod


def test_rows_the_mask_hides_entirely_give_zero_and_minus_inf():
    gen = torch.Generator("cuda").manual_seed(9)
    q, k, v = (torch.randn((1, 2, 64, 64), generator=gen, device="cuda").half() for _ in range(3))
    mod = cupy_attn.AttentionMod(mask_mod="return q_idx >= 32 && kv_idx < q_idx;")
    out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, mask_mod=mod.mask_mod, return_lse=True)
    assert torch.all(out[:, :, :32] == 0) and torch.all(lse[:, :, :32] == float("-inf"))  # rows 0-31 see no key
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 32:]).all()


def test_mod_calls_route_and_refuse_clearly():
    gen = torch.Generator("cuda").manual_seed(1)
    q, k, v = (torch.randn((1, 2, 128, 128), generator=gen, device="cuda").half() for _ in range(3))
    aux = {"slopes": torch.rand(2, device="cuda")}
    plan = cupy_attn.explain(q, k, v, score_mod=MODS["alibi"], aux=aux)
    assert plan.backend == "fused" and "flash_fwd_sm90_mod" in plan.reason
    q512, k512, v512 = (torch.randn((1, 2, 128, 512), generator=gen, device="cuda").half() for _ in range(3))
    assert "flash_fwd_d512_sm90_mod" in cupy_attn.explain(q512, k512, v512, score_mod=MODS["alibi"], aux=aux).reason
    wide = [torch.randn((1, 2, 128, 640), generator=gen, device="cuda").half() for _ in range(3)]
    assert "masked_softmax_mod" in cupy_attn.explain(*wide, score_mod=MODS["alibi"], aux=aux).reason
    with pytest.raises(ValueError, match="backend='fused' cannot run score_mod"):
        cupy_attn.scaled_dot_product_attention(*wide, score_mod=MODS["alibi"], aux=aux, backend="fused")
    q.requires_grad_(True)
    no_grad = cupy_attn.AttentionMod(score_mod=MODS["alibi"].score_mod)
    with pytest.raises(NotImplementedError, match="needs its derivative"):  # before the forward runs
        cupy_attn.scaled_dot_product_attention(q, k, v, score_mod=no_grad, aux=aux)
    with pytest.raises(NotImplementedError, match="backward of score_mod / mask_mod has no softcap"):
        cupy_attn.scaled_dot_product_attention(q, k, v, score_mod=MODS["alibi"], aux=aux, softcap=30.0)
    with pytest.raises(NotImplementedError, match="an aux array requires grad"):
        cupy_attn.scaled_dot_product_attention(q, k, v, score_mod=MODS["alibi"],
                                               aux={"slopes": aux["slopes"].requires_grad_(True)})
    with pytest.raises(ValueError, match="aux\\['slopes'\\] is on CPU"):  # aux on another device than the query
        cupy_attn.scaled_dot_product_attention(q.detach(), k, v, score_mod=MODS["alibi"],
                                               aux={"slopes": np.zeros(2, np.float32)})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(MODS))
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 300, 64), (1, 2, 2, 129, 700, 256)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bwd", ["auto", "split"])
def test_mod_gradients(dtype, name, shape, bwd, monkeypatch):
    """dQ, dK, dV of a mod call, on the Hopper backward kernel's mod instantiation (auto) and on the split backward's
    rows kernels (CUPY_ATTN_BWD=split) — P from score_mod's scores, dS times score_mod_grad — against float64 autograd
    of the same math in torch ops, under the error rule (the peer: that math at the inputs' precision)."""
    if bwd == "split":
        monkeypatch.setenv("CUPY_ATTN_BWD", "split")
    B, Hq, Hkv, L, S, E = shape
    gen = torch.Generator("cuda").manual_seed(sum(shape) + len(name))
    q, k, v = (torch.randn(s, generator=gen, device="cuda").to(DTYPES[dtype]).requires_grad_(True)
               for s in ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, E)))
    dout = torch.randn((B, Hq, L, E), generator=gen, device="cuda").to(DTYPES[dtype])
    aux = _aux(name, B, Hq, L, S, gen)
    causal = "bottom_right" if L <= S else False
    out = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv,
                                                 score_mod=MODS[name], aux=aux)
    got = torch.autograd.grad(out, (q, k, v), dout)
    grads = {}
    for key, cast in (("ref", torch.float64), ("peer", None)):
        xs = [x.detach().to(cast or x.dtype).requires_grad_(True) for x in (q, k, v)]
        aux_c = None if aux is None else {n: a.double() if cast and a.is_floating_point() else a
                                          for n, a in aux.items()}
        o = _peer(*xs, MODS[name], aux_c, causal)
        grads[key] = torch.autograd.grad(o, xs, dout.to(o.dtype))
    for i, what in enumerate("qkv"):
        assert_close(got[i], grads["ref"][i].cpu().numpy(), dtype, grads["peer"][i], f"{name} d{what}")


def test_block_mask_kernel_matches_the_host_ranges_and_skips_exactly():
    """create_block_mask's pre-pass (mod_key_ranges) gives the ranges the mask_mod's Python form gives on the host,
    and a call with the BlockMask (the FA3 kernel visiting only those key blocks) equals the call without it: the
    blocks it skips are ones the mask hides entirely."""
    gen = torch.Generator("cuda").manual_seed(3)
    B, H, L = 2, 4, 1500
    q, k, v = (torch.randn((B, H, L, 128), generator=gen, device="cuda").half() for _ in range(3))
    aux = _aux("document", B, H, L, L, gen)
    window = cupy_attn.AttentionMod(mask_mod="return q_idx - kv_idx <= 300 && kv_idx <= q_idx;",
                                    reference_mask_mod=lambda b, h, i, j, a: (i - j <= 300) & (j <= i))
    for mod, kw, batch in ((MODS["document"], {"aux": aux}, B), (window, {}, None)):
        bm = cupy_attn.create_block_mask(mod, batch, None, L, L, like=q, **kw)
        host_aux = {n: a.cpu().numpy() for n, a in kw.get("aux", {}).items()}
        host = cupy_attn.create_block_mask(mod, batch, None, L, L, like=np.zeros(1), aux=host_aux or None)
        np.testing.assert_array_equal(bm.ranges.cpu().numpy(), host.ranges)
        np.testing.assert_array_equal(bm.query_ranges.cpu().numpy(), host.query_ranges)
        with_mask = cupy_attn.scaled_dot_product_attention(q, k, v, score_mod=mod, block_mask=bm, **kw)
        without = cupy_attn.scaled_dot_product_attention(q, k, v, score_mod=mod, **kw)
        torch.testing.assert_close(with_mask, without, rtol=0, atol=0)
        _check(q, k, v, "document", aux, "float16", what="block mask") if mod is MODS["document"] else None


def _padded_causal_mask(B, L, pads):
    """Hugging Face's 4-D prefill mask: causal and left padding, (B, 1, L, L) bool (rows inside the padding see no
    key)."""
    i, j = torch.arange(L, device="cuda")[:, None], torch.arange(L, device="cuda")[None, :]
    keep = (j <= i)[None] & (j[None] >= torch.tensor(pads, device="cuda")[:, None, None])
    return keep[:, None]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("E", [64, 128, 256])
def test_masked_calls_in_the_fa3_kernel(dtype, E):
    """attn_mask run as a mod in the FA3-design kernel (bool: Hugging Face's causal + left padding, and key padding;
    float: an additive bias with -inf entries), key blocks outside each row block's range skipped, against the float64
    reference under the rule (the peer: torch's math at the inputs' precision)."""
    from _attention_ref import torch_variant_attention
    gen = torch.Generator("cuda").manual_seed(E)
    B, H, L = 4, 8, 1100
    q, k, v = (torch.randn((B, H, L, E), generator=gen, device="cuda").to(DTYPES[dtype]) for _ in range(3))
    pads = [0, 5, 300, 1099]
    key_pad = (torch.arange(L, device="cuda")[None] >= torch.tensor(pads, device="cuda")[:, None])[:, None, None]
    bias = torch.randn((B, 1, L, L), generator=gen, device="cuda").to(DTYPES[dtype])
    bias = bias.masked_fill(~_padded_causal_mask(B, L, pads), float("-inf"))
    for name, mask in (("padded causal", _padded_causal_mask(B, L, pads)), ("key padding", key_pad),
                       ("float bias", bias)):
        plan = cupy_attn.explain(q, k, v, attn_mask=mask)
        assert plan.backend == "fused" and "attn_mask as a mod" in plan.reason, (name, str(plan))
        out = cupy_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        ref = reference.scaled_dot_product_attention(as_f64(q), as_f64(k), as_f64(v), mask.cpu().numpy()
                                                     if mask.dtype == torch.bool else as_f64(mask))
        if mask.dtype == torch.bool:
            peer = torch_variant_attention(q, k, v, mask=mask)
        else:
            s = (q @ k.transpose(-1, -2)) * E ** -0.5 + mask
            peer = torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype) @ v
        assert_close(out, ref, dtype, peer, f"{name} E={E}")
        split = cupy_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend="split")
        torch.testing.assert_close(out.float(), split.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_masked_gradients_in_the_hopper_kernel(dtype):
    """A Hugging Face padded causal mask's gradients: the forward in the FA3 kernel and the backward in the Hopper
    kernel, both with the mask as a mod, against float64 autograd under the rule; rows the mask hides entirely get
    zero gradients."""
    from _attention_ref import torch_variant_attention
    gen = torch.Generator("cuda").manual_seed(21)
    B, H, L, E = 4, 8, 1100, 128
    q, k, v = (torch.randn((B, H, L, E), generator=gen, device="cuda").to(DTYPES[dtype]).requires_grad_(True)
               for _ in range(3))
    dout = torch.randn((B, H, L, E), generator=gen, device="cuda").to(DTYPES[dtype])
    mask = _padded_causal_mask(B, L, [0, 5, 300, 1099])
    got = torch.autograd.grad(cupy_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask), (q, k, v), dout)
    grads = {}
    for key, cast in (("ref", torch.float64), ("peer", None)):
        xs = [x.detach().to(cast or x.dtype).requires_grad_(True) for x in (q, k, v)]
        o = torch_variant_attention(*xs, mask=mask)
        # rows that see no key give out 0 whatever q, k, v: gradient 0 (torch's softmax backward gives NaN there)
        grads[key] = [g.nan_to_num(0.0) for g in torch.autograd.grad(o, xs, dout.to(o.dtype))]
    for i, what in enumerate("qkv"):
        assert_close(got[i], grads["ref"][i].cpu().numpy(), dtype, grads["peer"][i], f"padded causal d{what}")
    assert torch.all(got[0][3, :, :1099] == 0)  # batch 3's rows 0-1098 see no key


def test_block_mask_gradients_equal_the_unskipped_ones():
    """A window mask_mod's gradients with its BlockMask (the Hopper backward visiting only the query blocks the
    backward's table names) equal those without it: the skipped blocks are hidden whole."""
    gen = torch.Generator("cuda").manual_seed(8)
    q, k, v = (torch.randn((2, 4, 1500, 128), generator=gen, device="cuda").half().requires_grad_(True)
               for _ in range(3))
    dout = torch.randn((2, 4, 1500, 128), generator=gen, device="cuda").half()
    window = cupy_attn.AttentionMod(mask_mod="return q_idx - kv_idx <= 300 && kv_idx <= q_idx;")
    bm = cupy_attn.create_block_mask(window, None, None, 1500, 1500, like=q)
    with_mask = torch.autograd.grad(cupy_attn.scaled_dot_product_attention(q, k, v, score_mod=window, block_mask=bm),
                                    (q, k, v), dout)
    without = torch.autograd.grad(cupy_attn.scaled_dot_product_attention(q, k, v, score_mod=window), (q, k, v), dout)
    torch.testing.assert_close(with_mask[0], without[0])  # dQ: fp32 reductions across key blocks, in any order
    for a, b in zip(with_mask[1:], without[1:]):  # dK, dV: each key block's own sums, the skipped terms exact zeros
        torch.testing.assert_close(a, b, rtol=0, atol=0)


TRAINABLE_BIAS = cupy_attn.AttentionMod(
    score_mod="const int n = aux.table_shape[1];\nreturn score + aux.table[h * n + min(abs(q_idx - kv_idx), n - 1)];",
    score_mod_grad="return 1.f;",
    score_mod_aux_grad="const int n = aux.table_shape[1];\n"
                       "atomicAdd(&aux.table_grad[h * n + min(abs(q_idx - kv_idx), n - 1)], grad);",
    reference_score_mod=lambda s, b, h, i, j, aux: s + aux.table[h, torch.clamp(abs(i - j), max=aux.table.shape[1] - 1)])


@pytest.mark.parametrize("bwd", ["auto", "split"])
@pytest.mark.parametrize("E", [64, 128])
def test_trainable_bias_table(bwd, E, monkeypatch):
    """A relative-position bias table that requires grad: its gradient (score_mod_aux_grad's atomics into an fp32
    accumulator, in the Hopper backward (auto) and the split rows kernels) and dQ, dK, dV against float64 autograd
    of the same math, under the rule (the table's peer: that math at the inputs' precision)."""
    if bwd == "split":
        monkeypatch.setenv("CUPY_ATTN_BWD", "split")
    gen = torch.Generator("cuda").manual_seed(E)
    q, k, v = (torch.randn((2, 4, 300, E), generator=gen, device="cuda").half().requires_grad_(True)
               for _ in range(3))
    table = (torch.randn((4, 32), generator=gen, device="cuda") * 0.5).requires_grad_(True)
    dout = torch.randn((2, 4, 300, E), generator=gen, device="cuda").half()
    out = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=TRAINABLE_BIAS,
                                                 aux={"table": table})
    got = torch.autograd.grad(out, (q, k, v, table), dout)
    grads = {}
    for key, cast in (("ref", torch.float64), ("peer", None)):
        xs = [x.detach().to(cast or x.dtype).requires_grad_(True) for x in (q, k, v)]
        t = table.detach().to(cast or torch.float32).requires_grad_(True)
        o = _peer(*xs, TRAINABLE_BIAS, {"table": t}, "bottom_right")
        grads[key] = torch.autograd.grad(o, xs + [t], dout.to(o.dtype))
    for i, what in enumerate(("dq", "dk", "dv", "dtable")):
        assert_close(got[i], grads["ref"][i].cpu().numpy(), "float16" if i < 3 else "float32", grads["peer"][i],
                     what)


def test_mod_calls_replay_from_the_call_cache_with_their_aux():
    """A mod call that needs no gradient is cached like a plain one: a repeat replays its launch (no new entry);
    other aux arrays are another key; the replay reads the aux arrays' current contents."""
    from cupy_attn.runtime import callcache
    gen = torch.Generator("cuda").manual_seed(13)
    q, k, v = (torch.randn((1, 4, 256, 128), generator=gen, device="cuda").half() for _ in range(3))
    one, two = (torch.rand(4, generator=gen, device="cuda") * 0.5 for _ in range(2))

    def call(slopes):
        return cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=MODS["alibi"],
                                                      aux={"slopes": slopes})
    callcache.clear()  # a fresh table: the counts below are this test's entries
    first = call(one)
    entries = len(callcache._HOLDING)
    assert torch.equal(call(one), first) and len(callcache._HOLDING) == entries  # a hit
    other = call(two)
    assert not torch.equal(other, first) and len(callcache._HOLDING) == entries + 1
    want = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, alibi_slopes=two)
    torch.testing.assert_close(other, want, rtol=2e-3, atol=2e-3)
    one.copy_(two)  # the cached launch of `one` reads its new contents
    assert torch.equal(call(one), other)


def test_recorded_mod_calls_replay_forward_and_backward():
    """A recorded mod call (no aux gradient) keeps its forward in the call cache and its backward's prepared launch
    under the forward's key: a repeat gives the same gradients without a new entry; a trainable aux array is not
    cached (its accumulators are new each call) and still gets its gradient."""
    from cupy_attn.attention import autograd as _autograd
    gen = torch.Generator("cuda").manual_seed(17)
    q, k, v = (torch.randn((1, 4, 256, 128), generator=gen, device="cuda").bfloat16().requires_grad_(True)
               for _ in range(3))
    dout = torch.randn((1, 4, 256, 128), generator=gen, device="cuda").bfloat16()
    cap = MODS["tanh_cap"]

    def step():
        out = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=cap)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)
    _autograd._MOD_BACKWARD_CACHE.clear()  # a fresh table: the count below is this test's entry
    first = step()
    entries = len(_autograd._MOD_BACKWARD_CACHE)
    again = step()
    assert len(_autograd._MOD_BACKWARD_CACHE) == entries
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    want = [torch.autograd.grad(_peer(q.double(), k.double(), v.double(), cap, None, True), x, dout.double())[0]
            for x in (q, k, v)]
    for g, w in zip(first[1:], want):
        assert (g.double() - w).norm() / w.norm() < 2e-2


def test_masked_calls_replay_until_the_mask_changes():
    """A bool attn_mask run as a mod in the fused kernel: a repeat with the same mask replays (no pre-pass, one
    entry); an in-place edit of the mask (torch bumps its version) runs afresh and sees the edit; an inference
    tensor's mask is never kept."""
    gen = torch.Generator("cuda").manual_seed(19)
    q, k, v = (torch.randn((2, 8, 1024, 128), generator=gen, device="cuda").half() for _ in range(3))
    mask = torch.ones((1024, 1024), dtype=torch.bool, device="cuda").tril().expand(2, 1, 1024, 1024).clone()
    mask[1, :, :, :37] = False  # left padding of sequence 1
    assert "attn_mask as a mod" in cupy_attn.explain(q, k, v, mask).reason
    from cupy_attn.attention import sdpa as _sdpa
    _sdpa._MASK_ENTRIES.clear()
    first = cupy_attn.scaled_dot_product_attention(q, k, v, mask)
    entries = len(_sdpa._MASK_ENTRIES)
    assert entries == 1 and torch.equal(cupy_attn.scaled_dot_product_attention(q, k, v, mask), first)
    assert len(_sdpa._MASK_ENTRIES) == entries
    mask[0, :, :, :200] = False  # in place: the cached ranges no longer hold
    edited = cupy_attn.scaled_dot_product_attention(q, k, v, mask)
    want = cupy_attn.scaled_dot_product_attention(q, k, v, mask, backend="split")
    torch.testing.assert_close(edited, want, rtol=2e-3, atol=2e-3)
    assert not torch.equal(edited, first) and len(_sdpa._MASK_ENTRIES) == entries + 1
    with torch.inference_mode():  # inference tensors keep no version counter: run, never kept
        frozen = mask.clone()
        torch.testing.assert_close(cupy_attn.scaled_dot_product_attention(q, k, v, frozen), edited, rtol=0, atol=0)
    assert len(_sdpa._MASK_ENTRIES) == entries + 1
