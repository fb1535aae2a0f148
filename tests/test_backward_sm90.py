"""The Hopper fused backward (cupy_attn.attention.backward_sm90, cuda_src/attention/flash_bwd_sm90.cu) and the
backward's kernel choice (backward.plan_backward).

CPU: every instantiation compiles for sm_90a without spills, stack or ptxas performance warnings; its SASS holds
HGMMA (with the transposed-operand form of dQ = dS K), TMA loads (UTMALDG) and bulk copies (UBLKCP), mbarrier
operations, setmaxnreg, the dQ reductions, no local memory, and the exponentials of Pᵀ between the two wgmma waits
(they overlap dPᵀ = V dOᵀ); the tile table against shared memory and the generated wgmma wrappers; the choice rules on
fake problems (arch, dtype, head dims, mask, layout, size, CUPY_ATTN_BWD). GPU (``gpu`` marker): dq, dk, dv from
backward.sdpa_backward into NaN-poisoned tensors, after asserting which kernel the plan chose, against the float64
reference with the tolerance rule of tests/_tolerance.py (torch's same-precision gradients as the error scale), and
against the mma.sync kernel's gradients (the same rule with the mma.sync kernel's error as the scale).

    PYTHONPATH=. timeout 1800 python3 -m pytest -m gpu tests/test_backward_sm90.py

A wrong mbarrier phase or transaction count hangs the kernel: every GPU call here waits at most 120 s and then ends
the process with a message (``_sync_or_die``).
"""
import os
import re
import time
import types

import numpy as np
import pytest

from cupy_attn.attention import backward as _bwd
from cupy_attn.attention import backward_sm90 as _sm90
from cupy_attn.attention import wgmma_gen as _gen
from cupy_attn.runtime import compile as _compile

FAMILY = _sm90.FLASH_BWD_SM90
F16 = np.dtype("float16")

# ---------------------------------------------------------------------------------------------------------------------
# CPU


def test_every_instantiation_compiles_without_spills():
    reports = _compile.compile_family(FAMILY, "sm_90a")
    assert len(reports) == len(list(FAMILY.variants())) == 2 * len(_sm90.SM90_BWD_TILES)
    # 168 = the launch-time allocation at 384 threads; the consumers' 240 after setmaxnreg is not in this report.
    assert all(r.registers is not None and r.registers <= 168 for r in reports), reports
    spilled = [(r.name_expression, r.spill_bytes, r.stack_bytes) for r in reports if r.spill_bytes or r.stack_bytes]
    assert not spilled, f"register spills / stack: {spilled}"
    warned = [(r.name_expression, r.perf_warnings) for r in reports if r.perf_warnings]
    assert not warned, f"ptxas performance warnings (C7514: serialized wgmma): {warned}"


def _sass(expr):
    from test_flash_sm90 import _cuobjdump, sass_text
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    return next(iter(sass_text(_compile.whole_cubin(
        _compile.compile_variant(FAMILY, expr, "sm_90a").image.read_bytes())).values()))


@pytest.mark.parametrize("row", list(FAMILY.variants()), ids=lambda r: f"{r['dtype']}-{r['head_dim']}")
def test_sass(row):
    expr = FAMILY.name_expression(**row)
    text = _sass(expr)
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*[^;]*);", text)
    names = [op.split()[0] for op in ops]
    for op in ("UTMALDG", "UBLKCP", "SYNCS", "USETMAXREG", "REDG", "MUFU.EX2", "STSM"):
        assert any(n.startswith(op) for n in names), f"{expr}: no {op} in the SASS"
    for op in ("LDL", "STL"):
        assert not any(n.startswith(op) for n in names), f"{expr}: local memory ({op})"
    hgmma = [op for op in ops if op.startswith("HGMMA")]
    # Per step: Sᵀ and dPᵀ (kHeadDim/16 each), dV and dK (kBlockM/16 each), dQ (kBlockN/16, both operands transposed).
    d, tile = row["head_dim"], row["tile"]
    assert len(hgmma) >= 2 * d // 16 + 2 * tile.block_m // 16 + tile.block_n // 16, (expr, len(hgmma))
    assert any("tnspA" in op and "tnspB" in op for op in hgmma), f"{expr}: dQ = dS K has no transposed-A HGMMA"
    # Pᵀ's exponentials (block_m/2 per thread) run between wait_group 1 (Sᵀ done) and wait_group 0 (dPᵀ done).
    first = next(i for i, op in enumerate(ops) if op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1"))
    second = next(i for i, op in enumerate(ops[first:], first) if op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    between = sum(op.startswith("MUFU.EX2") for op in ops[first:second])
    assert between >= tile.block_m // 2, f"{expr}: {between} MUFU.EX2 between the waits"


def test_tiles():
    declared = set(FAMILY.name_expressions())
    for d, tile in _sm90.SM90_BWD_TILES.items():
        assert tile.block_n == 128 and tile.block_m % 64 == 0 and tile.stages >= 2
        assert (tile.block_m // 64) * (d // 64) == 2, "one 64 x 64 dQ tile per consumer warpgroup"
        assert _sm90.STAT_PAD % tile.block_m == 0
        assert tile.smem_bytes(d) <= 232448, (d, tile)
        assert tile.block_m in _gen.SS_N and d in _gen.RS_N and 64 in _gen.SS_MN_N
        for dtype in _sm90._C_TYPES.values():
            assert FAMILY.name_expression(dtype=dtype, head_dim=d, tile=tile) in declared
    assert set(_sm90.SM90_BWD_TILES) == set(_bwd.FLASH_BWD_TILES), "the same head-dim buckets as the mma.sync kernel"


def test_params_layout():
    """The kernel reads its four tensor maps at 0/128/256/384 and dk right after them (bwd_params.cuh)."""
    p = _sm90._PARAMS
    assert p.itemsize == 640
    assert [p.fields[n][1] for n in ("tma_q", "tma_k", "tma_v", "tma_do", "dk", "scale_log2")] == \
        [0, 128, 256, 384, 512, 632]


def test_head_bucket_and_reasons():
    assert [_sm90.head_bucket(*e) for e in ((64, 64), (1, 1), (65, 64), (96, 96), (128, 40), (129, 129))] == \
        [64, 64, 128, 128, 128, None]
    assert "sm_90a" in _sm90.unsupported_reason(F16, 64, 64, False, 80)
    assert "fp16 and bf16" in _sm90.unsupported_reason(np.dtype("float32"), 64, 64, False, 90)
    assert "up to 128" in _sm90.unsupported_reason(F16, 256, 256, False, 90)
    assert "attn_mask" in _sm90.unsupported_reason(F16, 64, 64, True, 90)


class _FakeArray:
    """Shape, byte strides and base address, as layout_reason and plan_backward read them."""

    def __init__(self, shape, strides, ptr=1 << 20):
        self.shape, self.strides = shape, strides
        self.data = types.SimpleNamespace(ptr=ptr)


def _bhsd(B, H, S, D, ptr=1 << 20):
    return _FakeArray((B, H, S, D), (H * S * D * 2, S * D * 2, D * 2, 2), ptr)


def _bshd(B, H, S, D):
    return _FakeArray((B, H, S, D), (S * H * D * 2, D * 2, H * D * 2, 2))


def _problem(B=8, H=16, L=2048, S=2048, E=128, Ev=None, Hkv=None, mask=None, dtype="float16", q=None, k=None,
             dropout_p=0.0):
    Ev, Hkv = Ev or E, Hkv or H
    return types.SimpleNamespace(
        query=q or _bhsd(B, H, L, E), key=k or _bhsd(B, Hkv, S, E), value=_bhsd(B, Hkv, S, Ev), mask=mask,
        dtype=np.dtype(dtype), head_dim=E, head_dim_v=Ev, batch=B, num_heads=H, num_kv_heads=Hkv, seqlen_q=L,
        seqlen_k=S, groups=H // Hkv, causal=None, scale=E ** -0.5, dropout_p=dropout_p)


def _cuda_bindings():
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        pytest.skip("cuda-bindings missing: the Hopper backward is never chosen")


@pytest.mark.parametrize("env,arch,problem,kernel,why", [
    ("", 90, {}, "sm90", "FlashAttention-3"),
    ("", 90, {"E": 64, "H": 32, "B": 4, "L": 4096, "S": 4096}, "sm90", "FlashAttention-3"),
    ("", 90, {"L": 64, "S": 64}, "mma", "four tensor-map encodes"),           # small: the encodes would dominate
    ("sm90", 90, {"L": 64, "S": 64}, "sm90", "forced"),
    ("auto", 90, {"E": 96, "Ev": 96}, "sm90", "FlashAttention-3"),             # padded to 128 by TMA's zero fill
    ("", 90, {"Hkv": 4}, "sm90", "FlashAttention-3"),                          # GQA
    ("", 90, {"q": _bshd(8, 16, 2048, 128)}, "sm90", "FlashAttention-3"),     # BSHD views read in place
    ("sm90", 90, {"E": 100}, "mma", "stride along s is 200 bytes"),           # rows not a multiple of 16 bytes
    ("sm90", 90, {"q": _bhsd(8, 16, 2048, 128, ptr=(1 << 20) + 8)}, "mma", "not 16-byte aligned"),
    ("sm90", 80, {}, "mma", "needs sm_90a"),
    ("", 120, {}, "mma", "needs sm_90a"),
    ("mma", 90, {}, "mma", "forced"),
    ("split", 90, {}, "split", "forced"),
    ("", 90, {"E": 256}, "split", "up to 128"),
    ("sm90", 90, {"dtype": "float32"}, "split", "fp16 and bf16"),
    ("sm90", 90, {"mask": object()}, "split", "attn_mask"),
    ("", 75, {}, "split", "sm_80"),
    ("", 90, {"dropout_p": 0.1}, "mma", "dropout"),                           # no dropout variant on Hopper
    ("sm90", 90, {"dropout_p": 0.1}, "mma", "dropout"),
])
def test_plan_backward(env, arch, problem, kernel, why, monkeypatch):
    _cuda_bindings()
    monkeypatch.setenv(_bwd.ENV_BWD, env)
    plan = _bwd.plan_backward(_problem(**problem), arch)
    assert (plan.kernel, why in plan.reason) == (kernel, True), str(plan)
    assert (plan.bucket is None) == (kernel == "split")
    if kernel == "sm90":
        assert plan.bucket in _sm90.SM90_BWD_TILES


def test_plan_backward_rejects_unknown_env(monkeypatch):
    monkeypatch.setenv(_bwd.ENV_BWD, "fast")
    with pytest.raises(ValueError, match="CUPY_ATTN_BWD must be one of"):
        _bwd.plan_backward(_problem(), 90)


def test_small_problem_threshold_is_the_forward_rule():
    """auto takes the Hopper backward from BWD_SM90_MIN_FLOPS forward FLOPs on: (4,8,1024,128) is exactly 2^34."""
    _cuda_bindings()
    assert _bwd.plan_backward(_problem(B=4, H=8, L=1024, S=1024), 90).kernel == "sm90"
    assert _bwd.plan_backward(_problem(B=4, H=8, L=1024, S=1023), 90).kernel == "mma"


# ---------------------------------------------------------------------------------------------------------------------
# GPU

DTYPES = ("float16", "bfloat16")


def _torch():
    return pytest.importorskip("torch")


def _require_hopper():
    import cupy
    if int(cupy.cuda.Device().compute_capability) != 90:
        pytest.skip("the Hopper backward needs compute capability 9.0")
    _cuda_bindings()


def _rand(shape, dtype, gen):
    torch = _torch()
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(getattr(torch, dtype))


def _sync_or_die(what, timeout_s=120.0):
    """Wait for the current stream; a hung kernel (mbarrier phase or byte count wrong) ends the process instead."""
    import cupy
    ev = cupy.cuda.Event()
    ev.record(cupy.cuda.ExternalStream(_torch().cuda.current_stream().cuda_stream))
    t = time.time()
    while not ev.done:
        if time.time() - t > timeout_s:
            print(f"ERROR: {what} did not finish in {timeout_s:.0f} s (mbarrier/TMA hang?)", flush=True)
            os._exit(3)
        time.sleep(0.001)


_IS_CAUSAL = {None: False, "top_left": True, "bottom_right": "bottom_right"}


def _backward(q, k, v, dout, causal, mode, monkeypatch, expect, what):
    """dq, dk, dv from backward.sdpa_backward under CUPY_ATTN_BWD=mode, written into NaN-poisoned contiguous tensors,
    after asserting that plan_backward chose ``expect``."""
    import cupy_attn
    from cupy_attn.attention import checks
    torch = _torch()
    monkeypatch.setenv(_bwd.ENV_BWD, mode)
    gqa = q.shape[1] != k.shape[1]
    out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=_IS_CAUSAL[causal], enable_gqa=gqa,
                                                      return_lse=True)
    p = checks.check_sdpa(q, k, v, None, 0.0, _IS_CAUSAL[causal], None, gqa, "auto")
    plan = _bwd.plan_backward(p)
    assert plan.kernel == expect, f"{what}: {plan}"
    grads = [torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda") for x in (q, k, v)]
    views = [p.ctx.as_cupy(t) for t in (out, lse, dout, *grads)]
    _bwd.sdpa_backward(p, *views)
    _sync_or_die(f"{mode} backward, {what}")
    return grads


def _reference_grads(q, k, v, dout, causal):
    """float64 CPU autograd (tests/test_backward.py's reference, rows without a visible key give 0)."""
    from test_backward import _grads, _reference
    ins = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    _, grads = _grads(lambda a, b, c: _reference(a, b, c, None, causal or False, None, q.shape[1] // k.shape[1]),
                      ins, dout.double().cpu())
    return [g.numpy() for g in grads]


def _torch_grads(q, k, v, dout, causal):
    """torch's SDPA gradients in the same precision (the error scale); NaN rows (no visible key) become 0."""
    torch = _torch()
    L, S = q.shape[-2], k.shape[-2]
    ins = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    kw = dict(enable_gqa=q.shape[1] != k.shape[1])
    if causal == "top_left":
        kw["is_causal"] = True
    elif causal == "bottom_right":
        kw["attn_mask"] = torch.ones(L, S, dtype=torch.bool, device="cuda").tril(S - L)
    torch.nn.functional.scaled_dot_product_attention(*ins, **kw).backward(dout)
    return [torch.nan_to_num(x.grad, nan=0.0) for x in ins]


def _check(q, k, v, dtype, causal, monkeypatch, what, expect="sm90"):
    """The Hopper backward (forced) against the float64 reference, torch's error and the mma.sync kernel's error."""
    from _tolerance import assert_close
    g = _torch().Generator("cuda").manual_seed(7)
    dout = _rand(q.shape[:-1] + (v.shape[-1],), dtype, g)
    got = _backward(q, k, v, dout, causal, "sm90", monkeypatch, expect, what)
    mma = _backward(q, k, v, dout, causal, "mma", monkeypatch, "mma", what)
    ref = _reference_grads(q, k, v, dout, causal)
    theirs = _torch_grads(q, k, v, dout, causal)
    for label, a, b, r, t in zip(("dq", "dk", "dv"), got, mma, ref, theirs):
        assert_close(a, r, dtype, t, f"{what} {label} (vs torch's error)")
        assert_close(a, r, dtype, b, f"{what} {label} (vs the mma.sync kernel's error)")


LS = [(1, 1), (17, 17), (129, 129), (1000, 1000), (1, 1000), (1000, 17), (17, 129), (129, 1000), (200, 333)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", sorted(_sm90.SM90_BWD_TILES))
@pytest.mark.parametrize("L,S", LS)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_shapes(dtype, E, L, S, causal, monkeypatch):
    _require_hopper()
    g = _torch().Generator("cuda").manual_seed(L * 31 + S + E)
    q, k, v = _rand((2, 2, L, E), dtype, g), _rand((2, 2, S, E), dtype, g), _rand((2, 2, S, E), dtype, g)
    _check(q, k, v, dtype, causal, monkeypatch, f"{dtype} E={E} L={L} S={S} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", sorted(_sm90.SM90_BWD_TILES))
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_gqa(dtype, E, causal, monkeypatch):
    """8 query heads on 2 key/value heads: a block's dK and dV sum over the 4 query heads of its group."""
    _require_hopper()
    g = _torch().Generator("cuda").manual_seed(E + 8)
    q, k, v = _rand((2, 8, 300, E), dtype, g), _rand((2, 2, 333, E), dtype, g), _rand((2, 2, 333, E), dtype, g)
    _check(q, k, v, dtype, causal, monkeypatch, f"{dtype} GQA 8/2 E={E} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", sorted(_sm90.SM90_BWD_TILES))
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_bshd_views(dtype, E, causal, monkeypatch):
    """(B, S, H, D) storage viewed as (B, H, S, D): read in place by the 4-D tensor maps."""
    _require_hopper()
    g = _torch().Generator("cuda").manual_seed(E + 1)
    q = _rand((2, 257, 4, E), dtype, g).transpose(1, 2)
    k = _rand((2, 190, 4, E), dtype, g).transpose(1, 2)
    v = _rand((2, 190, 4, E), dtype, g).transpose(1, 2)
    _check(q, k, v, dtype, causal, monkeypatch, f"{dtype} BSHD E={E} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E,Ev", [(80, 80), (96, 96), (40, 40), (8, 8), (72, 128), (128, 64), (32, 56)])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_padded_head_dims(dtype, E, Ev, causal, monkeypatch):
    """Head dims below a bucket run its kernel on TMA's zero fill past E (Ev); dQ, dK, dV store only E (Ev) columns."""
    _require_hopper()
    g = _torch().Generator("cuda").manual_seed(E * 3 + Ev)
    q, k, v = _rand((2, 4, 257, E), dtype, g), _rand((2, 4, 190, E), dtype, g), _rand((2, 4, 190, Ev), dtype, g)
    _check(q, k, v, dtype, causal, monkeypatch, f"{dtype} E={E} Ev={Ev} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_long_causal(causal, monkeypatch):
    _require_hopper()
    g = _torch().Generator("cuda").manual_seed(4224)
    q, k, v = (_rand((1, 2, 4224, 128), "float16", g) for _ in range(3))
    _check(q, k, v, "float16", causal, monkeypatch, f"4224² causal={causal}")


@pytest.mark.gpu
def test_falls_back_to_mma(monkeypatch):
    """Rows TMA cannot read (q a slice of wider rows: 136-byte row stride) keep the mma.sync kernel under sm90."""
    _require_hopper()
    g = _torch().Generator("cuda").manual_seed(5)
    q = _rand((1, 2, 100, 68), "float16", g)[..., :64]
    k, v = _rand((1, 2, 100, 64), "float16", g), _rand((1, 2, 100, 64), "float16", g)
    _check(q, k, v, "float16", None, monkeypatch, "row stride 136 B", expect="mma")


@pytest.mark.gpu
def test_auto_takes_it_through_autograd(monkeypatch):
    """A call of 2^34 forward FLOPs through torch autograd: auto plans the Hopper kernel, gradients match mma.sync's
    within the tolerance rule."""
    _require_hopper()
    import cupy_attn
    from cupy_attn.attention import checks
    from _tolerance import assert_close
    torch = _torch()
    g = torch.Generator("cuda").manual_seed(11)
    q, k, v = (_rand((4, 8, 1024, 128), "bfloat16", g) for _ in range(3))
    dout = _rand((4, 8, 1024, 128), "bfloat16", g)
    monkeypatch.delenv(_bwd.ENV_BWD, raising=False)
    assert _bwd.plan_backward(checks.check_sdpa(q, k, v, None, 0.0, True, None, False, "auto")).kernel == "sm90"
    grads = {}
    for mode in ("auto", "mma"):
        monkeypatch.setenv(_bwd.ENV_BWD, mode)
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        cupy_attn.scaled_dot_product_attention(*ins, is_causal=True).backward(dout)
        _sync_or_die(f"autograd backward ({mode})")
        grads[mode] = [x.grad for x in ins]
    theirs = _torch_grads(q, k, v, dout, "top_left")
    ref = _reference_grads(q[:1, :2], k[:1, :2], v[:1, :2], dout[:1, :2], "top_left")  # batch 0, heads 0-1
    for i, label in enumerate(("dq", "dk", "dv")):
        for mode in ("auto", "mma"):
            assert torch.isfinite(grads[mode][i]).all(), f"{mode} {label}"
        assert_close(grads["auto"][i][:1, :2], ref[i], "bfloat16", theirs[i][:1, :2], f"auto {label}")
        assert_close(grads["auto"][i][:1, :2], ref[i], "bfloat16", grads["mma"][i][:1, :2], f"auto vs mma {label}")
