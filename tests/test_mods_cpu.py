"""score_mod / mask_mod (cupy_attn.AttentionMod) without a GPU: the snippets' checks and NVRTC compile (errors with
the snippet's own line numbers), the float64 reference's mods against the built-in variants they spell (ALiBi,
softcap, a document mask as a bool attn_mask), the CPU path through the public call and its gradients, the plan's
routing to the split path, the softmax kernel's mod instantiation (compiled for sm_80 and sm_90 without spills) and
the bytes its launch gets."""
import dataclasses
import types

import numpy as np
import pytest

import cupy_attn
from cupy_attn import reference
from cupy_attn.attention import dispatch as _dispatch
from cupy_attn.attention import mods as _mods
from cupy_attn.attention import variants as _variants
from cupy_attn.runtime import compile as _compile

ALIBI = "return score - aux.slopes[h] * fabsf(float(q_idx - kv_idx));"
DOC = "return aux.doc[b * aux.doc_shape[1] + q_idx] == aux.doc[b * aux.doc_shape[1] + kv_idx];"
PREFIX = "return kv_idx <= q_idx || kv_idx < aux.prefix[b];"
REL_BIAS = ("return score + float(aux.table[h * aux.table_shape[1] + min(abs(q_idx - kv_idx), "
            "int(aux.table_shape[1]) - 1)]);")


def _qkv(B=2, Hq=4, Hkv=2, L=9, S=9, E=8, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(np.float32) for shape in ((B, Hq, L, E), (B, Hkv, S, E),
                                                                             (B, Hkv, S, E)))


def _alibi_mod():
    return cupy_attn.AttentionMod(
        score_mod=ALIBI, reference_score_mod=lambda s, b, h, q, kv, aux: s - aux.slopes[h] * abs(q - kv))


def _doc_mod():
    return cupy_attn.AttentionMod(
        mask_mod=DOC, reference_mask_mod=lambda b, h, q, kv, aux: aux.doc[b, q] == aux.doc[b, kv])


def test_mod_arguments_are_checked():
    with pytest.raises(ValueError, match="needs score_mod, mask_mod or both"):
        cupy_attn.AttentionMod()
    with pytest.raises(ValueError, match="score_mod must be a non-empty string"):
        cupy_attn.AttentionMod(score_mod="  ")
    with pytest.raises(ValueError, match="score_mod_grad without score_mod"):
        cupy_attn.AttentionMod(mask_mod="return true;", score_mod_grad="return 1.f;")
    with pytest.raises(TypeError, match="reference_mask_mod must be callable"):
        cupy_attn.AttentionMod(mask_mod="return true;", reference_mask_mod="no")
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="score_mod must be a CUDA C\\+\\+ snippet"):
        cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, score_mod=lambda s: s)
    with pytest.raises(ValueError, match="put mask_mod into it"):
        cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, score_mod=_alibi_mod(), mask_mod="x")
    with pytest.raises(ValueError, match="aux is given without score_mod or mask_mod"):
        cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, aux={"a": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="aux names must be C\\+\\+ identifiers"):
        cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, mask_mod="return true;",
                                               aux={"not a name": np.zeros(2, np.float32)})
    with pytest.raises(TypeError, match="aux\\['z'\\] must be one of"):
        cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, mask_mod="return true;",
                                               aux={"z": np.zeros(2, np.complex64)})
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="aux\\['t'\\]"):
        cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, mask_mod="return true;",
                                               aux={"t": torch.zeros(2)})


def test_snippet_errors_carry_the_compiler_log_with_snippet_lines():
    bad = cupy_attn.AttentionMod(mask_mod="int x = 1;\nreturn kv_idx <= q_idx + undefined_name;")
    with pytest.raises(ValueError, match=r"do not compile(.|\n)*mask_mod\(2\): error: identifier \"undefined_name\""):
        bad.validate()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="do not compile"):  # before anything runs, CPU inputs too
        cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, mask_mod=bad.mask_mod)
    aux = {"slopes": np.zeros(4, np.float32), "doc": np.zeros((2, 9), np.int32), "table": np.zeros((4, 8), np.int64),
           "flags": np.zeros(3, np.bool_), "scalar": np.zeros((), np.float64), "half": np.zeros(2, np.float16)}
    cupy_attn.AttentionMod(score_mod=ALIBI + "\n// " + REL_BIAS, mask_mod=DOC).validate(aux)
    with pytest.raises(ValueError, match="slopes"):  # a name the aux does not have
        cupy_attn.AttentionMod(score_mod=ALIBI).validate({"other": np.zeros(1, np.float32)})


def test_snippet_strings_are_wrapped_once():
    assert _mods.as_mod("return score;", None) is _mods.as_mod("return score;", None)
    assert _mods.as_mod(None, None) is None


def test_reference_mods_equal_the_builtin_variants():
    q, k, v = _qkv(L=7, S=11)
    slopes = np.array([0.1, 0.3, 0.5, 0.7])
    want = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True, alibi_slopes=slopes, is_causal=True)
    # The mods' ALiBi in the reference's own alignment: |i + S - L - j|.
    got = reference.scaled_dot_product_attention(
        q, k, v, enable_gqa=True, is_causal=True,
        score_mod=lambda s, b, h, i, j: s - slopes[h] * np.abs(i + 4 - j))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    want = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True, softcap=3.0)
    got = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                                 score_mod=lambda s, b, h, i, j: 3.0 * np.tanh(s / 3.0))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    doc = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    mask = doc[:, None, :7, None] == doc[:, None, None, :]
    want = reference.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
    got = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                                 mask_mod=lambda b, h, i, j: doc[b, i] == doc[b, j])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_mod_indices_flatten_the_leading_axes():
    b, h, i, j = reference.mod_indices((2, 3, 4, 5, 6))
    assert b.reshape(-1).tolist() == list(range(6)) and h.reshape(-1).tolist() == [0, 1, 2, 3]
    assert i.shape == (1, 1, 1, 5, 1) and j.shape == (1, 1, 1, 1, 6)


def test_numpy_calls_run_the_mods_python_forms():
    q, k, v = _qkv()
    slopes = np.array([0.1, 0.3, 0.5, 0.7], np.float32)
    doc = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    mod = cupy_attn.AttentionMod(score_mod=ALIBI, mask_mod=DOC, reference_score_mod=_alibi_mod().reference_score_mod,
                                 reference_mask_mod=_doc_mod().reference_mask_mod)
    out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True, score_mod=mod,
                                                      aux={"slopes": slopes, "doc": doc}, return_lse=True)
    mask = (doc[:, None, :, None] == doc[:, None, None, :]) & np.tril(np.ones((9, 9), bool))
    want, want_lse = reference.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, alibi_slopes=slopes,
                                                            return_lse=True)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="runs a mod's Python form: pass an AttentionMod with reference_mask_mod"):
        cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, mask_mod=DOC, aux={"doc": doc})


def test_cpu_torch_gradients_flow_through_the_mods():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in _qkv(seed=3))
    slopes = torch.tensor([0.1, 0.3, 0.5, 0.7])
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.int32)
    mod = cupy_attn.AttentionMod(score_mod=ALIBI, mask_mod=DOC, reference_score_mod=_alibi_mod().reference_score_mod,
                                 reference_mask_mod=_doc_mod().reference_mask_mod)
    out = cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, score_mod=mod,
                                                 aux={"slopes": slopes, "doc": doc})
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    got = torch.autograd.grad(out, (q, k, v), dout)
    mask = doc[:, None, :, None] == doc[:, None, None, :]
    want_out = cupy_attn.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, alibi_slopes=slopes)
    want = torch.autograd.grad(want_out, (q, k, v), dout)
    torch.testing.assert_close(out, want_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def _gpu_problem(mod=None, E=128, dtype="float16", L=1024, S=1024):
    from cupy_attn.attention import checks as _checks
    from cupy_attn.runtime import interop as _interop
    ctx = _interop.CallContext(_interop.CUPY, 0)
    var = _variants.Variants(mod=mod)
    return _checks.SDPAProblem(ctx=ctx, query=None, key=None, value=None, batch_shape=(2, 8), batch=2, num_heads=8,
                               num_kv_heads=8, seqlen_q=L, seqlen_k=S, head_dim=E, head_dim_v=E, dtype=np.dtype(dtype),
                               scale=E ** -0.5, causal=None, dropout_p=0.0, variants=var)


def _bound(mod, aux):
    spec = _mods._spec_of(_mods.named_aux(aux))
    return _mods.BoundMod(mod, tuple(aux), tuple(aux.values()), spec)


def test_plan_sends_mod_calls_to_the_fa3_kernel_on_hopper():
    p = _gpu_problem(_bound(_alibi_mod(), {"slopes": np.zeros(8, np.float32)}), E=128)
    plan = _dispatch.plan_sdpa(p, "auto", arch=90, num_sms=132)
    assert plan.backend == "fused" and "flash_fwd_sm90_mod: score_mod" in plan.reason
    assert plan.choice.variants and plan.choice.tile.persistent and plan.choice.qk_dim == 128
    assert _dispatch.plan_sdpa(p, "split", arch=90, num_sms=132).backend == "split"
    from cupy_attn.attention.kernels import flash_fwd_sm90
    for E in (64, 96, 128, 256):  # non-causal head dim 64 too: the 128-row tile, which the mod family declares
        choice = _dispatch.plan_sdpa(_gpu_problem(p.variants.mod, E=E), "auto", arch=90, num_sms=132).choice
        assert choice.tile == flash_fwd_sm90.PERSISTENT_TILES[choice.head_dim], E


@pytest.mark.parametrize("E,arch,dtype", [(64, 80, "float16"), (1000, 90, "float16"), (128, 90, "float32")])
def test_plan_sends_other_mod_calls_to_the_split_path(E, arch, dtype):
    p = _gpu_problem(_bound(_alibi_mod(), {"slopes": np.zeros(8, np.float32)}), E=E, dtype=dtype)
    plan = _dispatch.plan_sdpa(p, "auto", arch=arch, num_sms=132)
    assert plan.backend == "split" and "score_mod applied by the softmax kernel's mod instantiation" in plan.reason
    with pytest.raises(ValueError, match="backend='fused' cannot run score_mod / mask_mod here"):
        _dispatch.plan_sdpa(p, "fused", arch=arch, num_sms=132)


@pytest.mark.parametrize("name,kw,aux", [
    ("alibi", dict(score_mod=ALIBI), {"slopes": np.zeros(8, np.float32)}),
    ("tanh", dict(score_mod="return 8.f * tanhf(score / 8.f);"), {}),
    ("prefix_lm", dict(mask_mod=PREFIX), {"prefix": np.zeros(2, np.int32)}),
    ("rel_bias", dict(score_mod=REL_BIAS), {"table": np.zeros((8, 64), np.float32)})])
def test_fa3_mod_instantiation_compiles_without_spills(name, kw, aux):
    """The FA3-design forward's mod instantiation (flash_fwd_sm90_mod, dense, every head-dim bucket) for sm_90a:
    these mods fit the consumers' registers. (A document mask's two aux loads per score spill 32 bytes at head dim
    256; the packed instantiations spill 40-130 bytes with several mods: bench/notes/mods.md.)"""
    from cupy_attn.attention.kernels import flash_fwd_sm90
    fam = flash_fwd_sm90.mod_family(_bound(cupy_attn.AttentionMod(**kw), aux))
    for D, tile in flash_fwd_sm90.PERSISTENT_TILES.items():
        expr = fam.name_expression(dtype="__nv_bfloat16", head_dim=D, tile=tile, varlen="false")
        report = _compile.compile_variant(fam, expr, "sm_90a").report
        assert report.registers and not report.spill_bytes and not report.stack_bytes, (name, D, report)


def test_softmax_mod_instantiation_compiles_without_spills():
    """The appended struct and ModParams' layout asserts compile for sm_80 and sm_90 (NVRTC, no GPU), no spills, at the
    narrowest, widest and looping tiles."""
    from cupy_attn.attention.kernels import softmax
    aux = {"slopes": np.zeros(8, np.float32), "doc": np.zeros((2, 9), np.int32)}
    mod = cupy_attn.AttentionMod(score_mod=ALIBI, mask_mod=DOC)
    fam = softmax.mod_family(_bound(mod, aux))
    assert fam is softmax.mod_family(_bound(mod, aux)), "one family per (mod, aux layout)"
    for arch in ("sm_80", "sm_90"):
        for tile in ((32, 1), (512, 8), (512, 0)):
            expr = fam.name_expression(out_t="__nv_bfloat16", tile=tile, dropout="true")
            report = _compile.compile_variant(fam, expr, arch).report
            assert report.registers and not report.spill_bytes, (arch, tile, report)


def test_softmax_mod_launch_bytes(monkeypatch):
    """The chunk's launch gets SoftmaxParams as the variants' kernel would, then mod_num_heads and the aux pointers
    and shapes (ModParams<SoftmaxParams, Mod>)."""
    from cupy_attn.attention.kernels import softmax

    class Arr:
        def __init__(self, ptr, shape):
            self.data, self.shape = types.SimpleNamespace(ptr=ptr), shape

    bound = _bound(cupy_attn.AttentionMod(score_mod=ALIBI, mask_mod=DOC),
                   {"slopes": np.zeros(8, np.float32), "doc": np.zeros((2, 1024), np.int32)})
    bound = dataclasses.replace(bound, arrays=(Arr(4096, (8,)), Arr(8192, (2, 1024))))
    fam = softmax.mod_family(bound)
    asked = []

    def kernel(**row):
        asked.append(row)
        return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xF00), max_dynamic_shared_size_bytes=0)

    monkeypatch.setattr(softmax, "mod_family", lambda b: types.SimpleNamespace(kernel=kernel, structs=fam.structs))
    p = _gpu_problem(bound)
    base = softmax.base_params(p, 1024, [(1, 0, 0, 0), (2, 0, 8 * 1024, 8), (8, 0, 1024, 1)])
    launch = softmax.build(p, base, batches=16, rows=64, row0=128, batch0=0, bh0=0, seqlen_k=1024)
    prm = launch.params
    assert prm.dtype == fam.structs[0][1] and prm.dtype.names[:len(softmax.PARAMS.names)] == softmax.PARAMS.names
    assert (prm["rows"], prm["row0"], prm["seqlen_k"], prm["mod_num_heads"]) == (16 * 64, 128, 1024, 8)
    assert (prm["aux"]["slopes"], prm["aux"]["doc"]) == (4096, 8192)
    assert prm["aux"]["slopes_shape"].tolist() == [8] and prm["aux"]["doc_shape"].tolist() == [2, 1024]
    assert asked == [{"out_t": "__half", "tile": softmax.tile_for(1024, True), "dropout": "false"}]


class _Arr:
    """A contiguous array's layout and a 16-byte aligned address (what the launchers' layout checks read)."""

    def __init__(self, shape, dtype=np.float16, ptr=1 << 20):
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.strides = tuple(int(np.prod(shape[i + 1:])) * self.itemsize for i in range(len(shape)))
        self.data = types.SimpleNamespace(ptr=ptr)


def _with_arrays(p):
    """The stand-in problem with stand-in arrays of its shapes (B, H, L|S, E)."""
    p.query = _Arr((p.batch, p.num_heads, p.seqlen_q, p.head_dim), p.dtype)
    p.key = _Arr((p.batch, p.num_kv_heads, p.seqlen_k, p.head_dim), p.dtype)
    p.value = _Arr((p.batch, p.num_kv_heads, p.seqlen_k, p.head_dim_v), p.dtype)
    return p


def test_backward_plan_of_mod_calls():
    """The split backward's rows kernels take the mods; a score_mod without its derivative, or a mod beside a window,
    softcap or ALiBi (which the split backward lacks), is refused before the forward runs."""
    with_grad = cupy_attn.AttentionMod(score_mod=ALIBI, score_mod_grad="return 1.f;", mask_mod=DOC)
    aux = {"slopes": np.zeros(8, np.float32), "doc": np.zeros((2, 9), np.int32)}
    plan = _dispatch.plan_backward(_with_arrays(_gpu_problem(_bound(with_grad, aux))), arch=90)
    assert plan.kernel == "sm90" and "flash_bwd_sm90_mod" in plan.reason and plan.bucket == 128
    for kw, arch in ((dict(E=512), 90), (dict(E=128), 80), (dict(E=128, dtype="float32"), 90)):
        plan = _dispatch.plan_backward(_with_arrays(_gpu_problem(_bound(with_grad, aux), **kw)), arch=arch)
        assert plan.kernel == "split" and "rows kernels with the mod" in plan.reason, (kw, arch)
    with pytest.raises(NotImplementedError, match="needs its derivative"):
        _dispatch.plan_backward(_gpu_problem(_bound(_alibi_mod(), aux)), arch=90)
    p = _gpu_problem(_bound(_doc_mod(), aux))
    p.variants = dataclasses.replace(p.variants, softcap=30.0)
    with pytest.raises(NotImplementedError, match="backward of score_mod / mask_mod has no softcap"):
        _dispatch.plan_backward(p, arch=90)


def test_backward_rows_mod_instantiation_compiles_without_spills():
    from cupy_attn.attention.kernels import bwd_rows
    mod = cupy_attn.AttentionMod(score_mod="return 8.f * tanhf(score / 8.f);",
                                 score_mod_grad="const float t = tanhf(score / 8.f);\nreturn 1.f - t * t;",
                                 mask_mod=DOC)
    fam = bwd_rows.mod_family(_bound(mod, {"doc": np.zeros((2, 9), np.int32)}))
    for arch in ("sm_80", "sm_90"):
        for grad in ("false", "true"):
            expr = fam.name_expression(dtype="__half", grad=grad, dropout="true")
            report = _compile.compile_variant(fam, expr, arch).report
            assert report.registers and not report.spill_bytes, (arch, grad, report)


def test_fa3_mod_launch_bytes(monkeypatch):
    """The FA3-design kernel's mod launch: FlashFwdSm90Params as the variants' launch fills them, then mod_num_heads
    and the aux (ModParams<FlashFwdSm90Params, Mod>, 64-byte aligned), the kernel asked for at the chosen tile."""
    from cupy_attn.attention.kernels import flash_fwd_sm90
    from cupy_attn.runtime import tma

    class Arr:
        def __init__(self, shape, ptr=1 << 20):
            self.shape, self.dtype, self.itemsize = shape, np.dtype(np.float16), 2
            self.strides = tuple(int(np.prod(shape[i + 1:])) * 2 for i in range(len(shape)))
            self.data = types.SimpleNamespace(ptr=ptr)

    slopes = Arr((8,), ptr=4096)
    bound = dataclasses.replace(_bound(_alibi_mod(), {"slopes": np.zeros(8, np.float32)}), arrays=(slopes,))
    p = _gpu_problem(bound, E=128, L=1000, S=1000)
    p.query, p.key, p.value = Arr((16, 8, 1000, 128)), Arr((16, 8, 1000, 128)), Arr((16, 8, 1000, 128))
    choice = flash_fwd_sm90.choose(p, "3")
    asked = []

    def kernel(**row):
        asked.append(row)
        return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xF00), max_dynamic_shared_size_bytes=0)

    fam = flash_fwd_sm90.mod_family(bound)
    monkeypatch.setattr(flash_fwd_sm90, "mod_family", lambda b: types.SimpleNamespace(kernel=kernel,
                                                                                      structs=fam.structs))
    monkeypatch.setattr(flash_fwd_sm90, "device_sms", lambda device: 132)
    import cupy
    monkeypatch.setattr(cupy.cuda, "Device", lambda: types.SimpleNamespace(id=0))
    monkeypatch.setattr(tma.MapSpec, "encode", lambda spec, ptr: np.zeros(128, np.uint8))
    launch = flash_fwd_sm90.build(p, choice, Arr((16, 8, 1000, 128)), None)
    prm = launch.params
    assert prm.dtype == fam.structs[0][1] and prm.dtype.itemsize % 64 == 0
    assert prm.dtype.fields["mod_num_heads"][1] == flash_fwd_sm90.PARAMS.itemsize
    assert (prm["mod_num_heads"], prm["aux"]["slopes"], prm["aux"]["slopes_shape"].tolist()) == (8, 4096, [8])
    assert (prm["seqlen_q"], prm["seqlen_k"], prm["batch"], prm["num_heads"]) == (1000, 1000, 16, 8)
    assert asked == [{"dtype": "__half", "head_dim": 128, "tile": choice.tile, "varlen": "false"}]


WINDOW_MOD = cupy_attn.AttentionMod(mask_mod="return q_idx - kv_idx <= 200 && kv_idx <= q_idx;",
                                    reference_mask_mod=lambda b, h, i, j, aux: (i - j <= 200) & (j <= i))


def test_create_block_mask_ranges_on_the_cpu():
    """Each block of 128 query rows gets the first and last key some row of it sees, then the full run (the first key
    every row sees, the last of the unbroken run from it); (S, -1) where none; batch and heads None broadcast one
    entry."""
    q = np.zeros((1, 1, 1, 8), np.float32)
    bm = cupy_attn.create_block_mask(WINDOW_MOD, None, None, 300, 300, like=q)
    assert isinstance(bm, cupy_attn.BlockMask) and bm.ranges.shape == (1, 1, 3, 4) and bm.row_blocks == 3
    # rows 0-127 see keys 0 ... 127, all of them key 0; rows 128-255: 0 ... 255, all 55 ... 128 (row 255's window
    # starts at 55, row 128 ends at 128); rows 256-299: 56 ... 299, all 99 ... 256
    assert bm.ranges[0, 0].tolist() == [[0, 127, 0, 0], [0, 255, 55, 128], [56, 299, 99, 256]]
    # the backward's table: keys 0-63 are seen by rows 0 ... 263 (63 + 200), all of them by rows 63 ... 200; ...;
    # keys 256-299 by rows 256 ... 299, all of them by row 299 only
    assert bm.query_ranges[0, 0].tolist() == [[0, 263, 63, 200], [64, 299, 127, 264], [128, 299, 191, 299],
                                              [192, 299, 255, 299], [256, 299, 299, 299]]
    doc = np.array([[0] * 100 + [1] * 200, [0] * 250 + [1] * 50], np.int32)
    doc_mod = cupy_attn.AttentionMod(mask_mod=DOC,
                                     reference_mask_mod=lambda b, h, i, j, aux: aux.doc[b, i] == aux.doc[b, j])
    bm = cupy_attn.create_block_mask(doc_mod, 2, None, 300, 300, aux={"doc": doc})
    assert bm.ranges.shape == (2, 1, 3, 4)
    # rows 0-127 of sequence 0 span both documents: no key all of them see
    assert bm.ranges[0, 0].tolist() == [[0, 299, 300, -1], [100, 299, 100, 299], [100, 299, 100, 299]]
    assert bm.ranges[1, 0].tolist() == [[0, 249, 0, 249], [0, 299, 300, -1], [250, 299, 250, 299]]
    hidden = cupy_attn.AttentionMod(mask_mod="return q_idx >= 200;",
                                    reference_mask_mod=lambda b, h, i, j, aux: (i >= 200) & (j >= 0))
    assert cupy_attn.create_block_mask(hidden, None, 2, 300, 50, like=q).ranges[0, 1].tolist() == [
        [50, -1, 50, -1], [0, 49, 50, -1], [0, 49, 0, 49]]
    gap = cupy_attn.AttentionMod(mask_mod="return kv_idx != 7;",
                                 reference_mask_mod=lambda b, h, i, j, aux: (j != 7) & (i >= 0))
    assert cupy_attn.create_block_mask(gap, None, None, 10, 20, like=q).ranges[0, 0].tolist() == [[0, 19, 0, 6]]


def test_block_mask_arguments_are_checked():
    q, k, v = _qkv(L=300, S=300)
    with pytest.raises(ValueError, match="needs a mask_mod"):
        cupy_attn.create_block_mask(_alibi_mod(), None, None, 300, 300, like=q)
    with pytest.raises(ValueError, match="pass like="):
        cupy_attn.create_block_mask(WINDOW_MOD, None, None, 300, 300)
    with pytest.raises(ValueError, match="batch and heads must be >= 1"):
        cupy_attn.create_block_mask(WINDOW_MOD, 0, None, 300, 300, like=q)
    bm = cupy_attn.create_block_mask(WINDOW_MOD, None, None, 300, 300, like=q)
    with pytest.raises(ValueError, match="block_mask is given without score_mod or mask_mod"):
        cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, block_mask=bm)
    with pytest.raises(ValueError, match="another mask_mod"):
        cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, score_mod=_doc_mod(), block_mask=bm,
                                               aux={"doc": np.zeros((2, 300), np.int32)})
    with pytest.raises(ValueError, match=r"block_mask is for \(L, S\) = \(300, 300\)"):
        cupy_attn.scaled_dot_product_attention(q[:, :, :200], k, v, enable_gqa=True, score_mod=WINDOW_MOD,
                                               block_mask=bm)
    with pytest.raises(TypeError, match="block_mask must be a cupy_attn.BlockMask"):
        cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, score_mod=WINDOW_MOD, block_mask=bm.ranges)
    two = cupy_attn.create_block_mask(WINDOW_MOD, 3, None, 300, 300, like=q)
    with pytest.raises(ValueError, match="batch 3 and heads 1; the call needs 1 or 2"):
        cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, score_mod=WINDOW_MOD, block_mask=two)
    out = cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, score_mod=WINDOW_MOD, block_mask=bm)
    want = cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, score_mod=WINDOW_MOD)
    np.testing.assert_array_equal(out, want)


def test_block_mask_reaches_the_fa3_launch(monkeypatch):
    """A call's BlockMask goes into ModParams' KeyRanges (pointer, strides in entries, rows per block); without one
    the pointer is null (every key block visited)."""
    bm = _mods.BlockMask("fwd", 1, 8, 1000, 1000, WINDOW_MOD.mask_mod, "cupy", 0, query_ranges="bwd")
    monkeypatch.setattr(_mods.BlockMask, "as_cupy", lambda self, table: types.SimpleNamespace(
        data=types.SimpleNamespace(ptr={"fwd": 0xABC0, "bwd": 0xDEF0}[table])))
    bound = _bound(WINDOW_MOD, {})
    prm = np.zeros((), _mods.mod_params_dtype(np.dtype([("x", np.int64)]), bound.spec))
    _mods.fill_aux(prm, dataclasses.replace(bound, block_mask=bm), 8, key_ranges=True)
    kr, qr = prm["key_ranges"], prm["query_ranges"]
    assert (kr["ranges"], kr["stride_b"], kr["stride_h"], kr["block_rows"]) == (0xABC0, 0, 8, 128)
    assert qr["ranges"] == 0, "the forward's launch leaves the backward's table out"
    _mods.fill_aux(prm := np.zeros((), prm.dtype), dataclasses.replace(bound, block_mask=bm), 8, query_ranges=True)
    assert (prm["query_ranges"]["ranges"], prm["query_ranges"]["stride_h"], prm["query_ranges"]["block_rows"]) == (
        0xDEF0, 16, 64) and prm["key_ranges"]["ranges"] == 0
    _mods.fill_aux(prm := np.zeros((), prm.dtype), bound, 8, key_ranges=True)
    assert prm["key_ranges"]["ranges"] == 0


class _MaskView:
    """A broadcast mask view's layout (shape, byte strides, dtype), as mods.mask_as_mod reads it."""

    def __init__(self, shape, strides, dtype=np.bool_):
        self.shape, self.strides, self.dtype = shape, strides, np.dtype(dtype)


@pytest.mark.parametrize("shape,strides,kept", [
    ((8, 32, 2048, 2048), (2048 * 2048, 0, 2048, 1), (0, 2, 3)),      # Hugging Face's (B, 1, L, S) causal + padding
    ((8, 32, 2048, 2048), (2048, 0, 0, 1), (0, 3)),                    # key padding (B, 1, 1, S)
    ((8, 32, 2048, 2048), (0, 0, 2048, 1), (2, 3)),                    # one (L, S) mask for all
])
def test_masked_calls_plan_the_fa3_kernel_with_the_mask_as_a_mod(shape, strides, kept):
    p = _gpu_problem(E=128, L=2048, S=2048)
    p.batch, p.num_heads = shape[0], shape[1]
    p.mask, p.mask_kind = _MaskView(shape, strides), "bool"
    plan = _dispatch.plan_sdpa(p, "auto", arch=90, num_sms=132)
    assert plan.backend == "fused" and "attn_mask as a mod" in plan.reason
    q = plan.problem
    assert q.mask is None and q.mask_kind == "none" and q.variants.mod.mask_source[1] == kept
    assert q.variants.mod.spec == (("mask", "bool", len(kept)),) and q.variants.mod.mod.mask_mod.endswith(
        "return aux.mask[i];")
    p.mask_kind, p.mask = "float", _MaskView(shape, strides, np.float16)
    plan = _dispatch.plan_sdpa(p, "auto", arch=90, num_sms=132)
    assert plan.problem.variants.mod.mod.score_mod.endswith("return score + float(aux.mask[i]);")
    assert _dispatch.plan_sdpa(p, "split", arch=90, num_sms=132).backend == "split"


@pytest.mark.parametrize("change,why", [(dict(dropout_p=0.1), "dropout"), (dict(seqlen_q=64, seqlen_k=64), "small"),
                                        (dict(dtype=np.dtype(np.float32)), "fp16 and bf16")])
def test_other_masked_calls_keep_their_paths(change, why):
    p = dataclasses.replace(_gpu_problem(E=128, L=2048, S=2048), **change)
    p.mask = _MaskView((2, 8, p.seqlen_q, p.seqlen_k), (p.seqlen_q * p.seqlen_k, 0, p.seqlen_k, 1))
    p.mask_kind = "bool"
    assert why in _dispatch.mask_fa3_reason(p, 90)
    assert "attn_mask as a mod" not in _dispatch.plan_sdpa(p, "auto", arch=90, num_sms=132).reason


def test_head_dim_512_calls_take_the_d512_mod_instantiation():
    """Head dims 257-512: mod calls and masked calls run the head-dim-512 kernel's mod instantiation (one tile per
    CTA); it compiles for sm_90a."""
    from cupy_attn.attention.kernels import flash_fwd_d512_sm90 as d512
    bound = _bound(WINDOW_MOD, {})
    plan = _dispatch.plan_sdpa(_gpu_problem(bound, E=512, L=4096, S=4096), "auto", arch=90, num_sms=132)
    assert plan.backend == "fused" and "flash_fwd_d512_sm90_mod" in plan.reason and not plan.choice.persistent
    p = _gpu_problem(E=384, L=2048, S=2048)
    p.mask, p.mask_kind = _MaskView((2, 8, 2048, 2048), (2048 * 2048, 0, 2048, 1)), "bool"
    plan = _dispatch.plan_sdpa(p, "auto", arch=90, num_sms=132)
    assert plan.backend == "fused" and "head-dim-512 kernel" in plan.reason
    fam = d512.mod_family(bound)
    report = _compile.compile_variant(fam, fam.name_expressions()[0], "sm_90a").report
    assert report.registers, report


@pytest.mark.parametrize("name,kw,aux", [
    ("tanh", dict(score_mod="return 8.f * tanhf(score / 8.f);",
                  score_mod_grad="const float t = tanhf(score / 8.f);\nreturn 1.f - t * t;"), {}),
    ("doc", dict(mask_mod=DOC), {"doc": np.zeros((2, 9), np.int32)}),
    ("alibi", dict(score_mod=ALIBI, score_mod_grad="return 1.f;"), {"slopes": np.zeros(8, np.float32)})])
def test_hopper_backward_mod_instantiation_compiles(name, kw, aux):
    """flash_bwd_sm90_mod (the Hopper backward's kUserMod consumers) compiles for sm_90a at every bucket; its spills
    are recorded in bench/notes/mods.md (the consumers run at 227-230 of 240 registers without a mod)."""
    from cupy_attn.attention.kernels import flash_bwd_sm90
    fam = flash_bwd_sm90.mod_family(_bound(cupy_attn.AttentionMod(**kw), aux))
    for expr in fam.name_expressions():
        if "__half" in expr:
            assert _compile.compile_variant(fam, expr, "sm_90a").report.registers, expr


def test_mask_route_leaves_decode_calls_and_honours_the_fa3_switch(monkeypatch):
    """Few query rows per KV head keep the decode kernel (it takes masks), as does num_splits; CUPY_ATTN_FA3=0 keeps
    masked calls and mod calls off the FA3 kernel; CUPY_ATTN_FA3_M192=1 does not give a mod call the 192-row tile."""
    p = _gpu_problem(E=128, L=1, S=1 << 20)
    p.mask, p.mask_kind = _MaskView((2, 8, 1, 1 << 20), (1 << 20, 0, 0, 1)), "bool"
    assert _dispatch.mask_fa3_reason(p, 90) == "decode-sized"
    big = _gpu_problem(E=128, L=2048, S=2048)
    big.mask, big.mask_kind = _MaskView((2, 8, 2048, 2048), (2048 * 2048, 0, 2048, 1)), "bool"
    assert "attn_mask as a mod" not in _dispatch.plan_sdpa(big, "auto", arch=90, num_sms=132, num_splits=4).reason
    monkeypatch.setenv("CUPY_ATTN_FA3", "0")
    assert _dispatch.mask_fa3_reason(big, 90) == "CUPY_ATTN_FA3=0"
    mod = _gpu_problem(_bound(WINDOW_MOD, {}), E=64)
    assert "flash_fwd_sm90_mod" not in _dispatch.plan_sdpa(mod, "auto", arch=90, num_sms=132).reason
    monkeypatch.setenv("CUPY_ATTN_FA3", "3")
    monkeypatch.setenv("CUPY_ATTN_FA3_M192", "1")
    from cupy_attn.attention.kernels import flash_fwd_sm90
    plan = _dispatch.plan_sdpa(mod, "auto", arch=90, num_sms=132)
    assert plan.choice.tile == flash_fwd_sm90.PERSISTENT_TILES[64]


def test_aux_names_cannot_collide_with_shape_fields():
    with pytest.raises(ValueError, match="collides with aux\\['x'\\]'s shape field"):
        cupy_attn.AttentionMod(mask_mod="return true;").validate({"x": np.zeros(2, np.int32),
                                                                  "x_shape": np.zeros(2, np.int32)})


def test_masked_backward_runs_the_hopper_kernel_with_the_mask_as_a_mod(monkeypatch):
    """The backward plan of a large masked call says so (mask_as_mod); dispatch.masked_backward gives the problem
    with the mask as a mod (the materialized arrays faked here)."""
    monkeypatch.setattr(_mods, "materialize", lambda bound, p, ranges="forward": bound)  # no device arrays here
    p = _with_arrays(_gpu_problem(E=128, L=2048, S=2048))
    p.mask, p.mask_kind = _MaskView((2, 8, 2048, 2048), (2048 * 2048, 0, 2048, 1)), "bool"
    plan = _dispatch.plan_backward(p, arch=90)
    assert plan.kernel == "sm90" and plan.mask_as_mod and plan.bucket == 128 and "attn_mask as a mod" in plan.reason
    q = _dispatch.masked_backward(p)
    assert q.mask is None and q.variants.mod.mask_source[1] == (0, 2, 3)
    p.mask_kind, p.mask = "float", _MaskView((2, 8, 2048, 2048), (2048 * 2048, 0, 2048, 1), np.float16)
    assert _dispatch.masked_backward(p).variants.mod.mod.score_mod_grad == "return 1.f;"  # an additive mask's
    assert not _dispatch.plan_backward(p, arch=80).mask_as_mod
    assert not _dispatch.plan_backward(dataclasses.replace(p, dropout_p=0.1), arch=90).mask_as_mod
    monkeypatch.setenv("CUPY_ATTN_BWD", "split")
    assert _dispatch.plan_backward(p, arch=90).kernel == "split"


def test_trainable_bias_table_gets_its_gradient_on_the_cpu():
    """A bias table that requires grad (CPU torch): its gradient flows through the mod's Python form, equal to the
    gradient of the same bias built explicitly; the GPU backward's snippet (score_mod_aux_grad) compiles."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn((2, 4, 9, 8), generator=g, requires_grad=True) for _ in range(3))
    table = torch.randn((4, 16), generator=g, requires_grad=True)
    mod = cupy_attn.AttentionMod(
        score_mod=REL_BIAS, score_mod_grad="return 1.f;",
        score_mod_aux_grad="const int n = aux.table_shape[1];\n"
                           "atomicAdd(&aux.table_grad[h * n + min(abs(q_idx - kv_idx), n - 1)], grad);",
        reference_score_mod=lambda s, b, h, i, j, aux: s + aux.table[h, abs(i - j).clamp(max=15)])
    mod.validate({"table": np.zeros((4, 16), np.float32)})
    out = cupy_attn.scaled_dot_product_attention(q, k, v, score_mod=mod, aux={"table": table})
    dout = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (q, table), dout)
    dist = (torch.arange(9)[:, None] - torch.arange(9)[None]).abs().clamp(max=15)
    want_out = cupy_attn.scaled_dot_product_attention(q, k, v, table[:, dist][None])
    want = torch.autograd.grad(want_out, (q, table), dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_aux_gradients_need_their_snippet():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="score_mod_aux_grad without score_mod"):
        cupy_attn.AttentionMod(mask_mod="return true;", score_mod_aux_grad="return;")
    with pytest.raises(ValueError, match="collides with aux\\['t'\\]'s grad field"):
        cupy_attn.AttentionMod(mask_mod="return true;").validate({"t": np.zeros(2, np.float32),
                                                                  "t_grad": np.zeros(2, np.float32)})
    assert torch is not None


def test_split_schedules_of_mod_calls_are_not_kept(monkeypatch):
    """A mod call's split schedule holds its mods' kernel and aux pointers: never kept under the layout's key, where
    the next mod (or the plain call) of that layout would replay it (seen on the GPU: the second mod of a process ran
    the first's softmax kernel)."""
    from cupy_attn.attention.paths import split
    monkeypatch.setattr(split, "_SCHEDULES", {})
    monkeypatch.setattr(split, "_build_schedule", lambda p, choice, out, lse: object())
    out = types.SimpleNamespace(size=1, shape=(2, 8, 1024, 128), strides=(1, 1, 1, 1))
    for mod in (_alibi_mod(), cupy_attn.AttentionMod(score_mod="return score;")):
        p = _gpu_problem(_bound(mod, {"slopes": np.zeros(8, np.float32)}))
        assert split.schedule(p, None, out) is not split.schedule(p, None, out)
    assert split._SCHEDULES == {}
    plain = dataclasses.replace(p, variants=_variants.Variants())
    monkeypatch.setattr(split, "_schedule_key", lambda p, choice, out, lse: "layout")
    assert split.schedule(plain, None, out) is split.schedule(plain, None, out)


def test_block_mask_tables_must_hold_four_ints_an_entry():
    """The kernels read entries 4 ints apart (key range, full run): a 2-int table is refused before any launch."""
    from cupy_attn.runtime import interop
    q = np.zeros((1, 1, 1, 8), np.float32)
    bm = cupy_attn.create_block_mask(WINDOW_MOD, None, None, 300, 300, like=q)
    ctx = interop.CallContext(bm.kind, bm.device_id)
    bm.check(WINDOW_MOD, ctx, 1, 1, 300, 300)
    old = dataclasses.replace(bm, ranges=bm.ranges[..., :2])
    with pytest.raises(ValueError, match=r"block_mask.ranges must be \(batch, heads, blocks, 4\)"):
        old.check(WINDOW_MOD, ctx, 1, 1, 300, 300)
