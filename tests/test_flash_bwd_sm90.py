"""The Hopper fused backward (cupy_attn.attention.kernels.flash_bwd_sm90, cuda_src/attention/flash_bwd_sm90.cu) and
the backward's kernel choice (dispatch.plan_backward).

CPU: every instantiation (head dims 64, 128, 256) compiles for sm_90a without spills, stack or ptxas performance
warnings; its SASS holds HGMMA of the shapes its warpgroup split implies (with the transposed-operand form of dQ = dS
K, and at 256 the transposed-B form of dV, dK with Pᵀ, dSᵀ from shared memory), TMA loads (UTMALDG, the lse/D rows
included: no plain bulk copies), mbarrier operations, setmaxnreg, the dQ reductions, no local memory, and the exponentials of Pᵀ between the
two wgmma waits (they overlap dPᵀ = V dOᵀ); the tile table against shared memory, registers and the generated wgmma
wrappers; the choice rules on fake problems (arch, dtype, head dims, mask, layout, size, dropout, CUPY_ATTN_BWD). GPU
(``gpu`` marker): dq, dk, dv from backward.sdpa_backward into NaN-poisoned tensors, after asserting which kernel the
plan chose, against the float64 reference with the tolerance rule of tests/_helpers/_tolerance.py (torch's same-precision
gradients as the error scale), and against the mma.sync kernel's gradients (the split backward's above head dim 128;
the same rule with that backward's error as the scale).

    PYTHONPATH=. timeout 1800 python3 -m pytest -m gpu tests/test_flash_bwd_sm90.py

A wrong mbarrier phase or transaction count hangs the kernel: every GPU call here waits at most 120 s and then ends
the process with a message (``_sync_or_die``).
"""
import os
import re
import time
import types

import numpy as np
import pytest

from cupy_attn.attention import dispatch as _plan
from cupy_attn.attention.kernels import flash_bwd as _mma
from cupy_attn.attention.kernels import flash_bwd_sm90 as _sm90
from cupy_attn.attention.paths import backward as _bwd
from cupy_attn.runtime import compile as _compile
from cupy_attn.runtime import compile_check
from cupy_attn.runtime.kernel_abi import C_TYPE_16
from _compile_checks import assert_clean

FAMILY = _sm90.FLASH_BWD_SM90
F16 = np.dtype("float16")

# ---------------------------------------------------------------------------------------------------------------------
# CPU


def test_every_instantiation_compiles_without_spills():
    reports = compile_check.compile_family(FAMILY, "sm_90a")
    # dtypes × (plain, variants, variants for packed batches) × tiles
    assert len(reports) == len(list(FAMILY.variants())) == 2 * 3 * len(_sm90.TILES)
    assert_clean(reports, max_registers=168)


def _sass(expr):
    from test_flash_fwd_sm90 import _cuobjdump, sass_text
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    return next(iter(sass_text(compile_check.whole_cubin(
        _compile.compile_variant(FAMILY, expr, "sm_90a").image.read_bytes())).values()))


@pytest.mark.parametrize("row", list(FAMILY.variants()),
                         ids=lambda r: f"{r['dtype']}-{r['head_dim']}" + ("-variants" * (r["variants"] == "true"))
                         + ("-varlen" * (r["varlen"] == "true")))
def test_sass(row):
    expr = FAMILY.name_expression(**row)
    text = _sass(expr)
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*[^;]*);", text)
    names = [op.split()[0] for op in ops]
    # the variants' softcap: tanh from ex2 and rcp (common/score_mod.cuh)
    for op in ("UTMALDG", "SYNCS", "USETMAXREG", "MUFU.EX2", "STSM") + (("MUFU.RCP",) if row["variants"] == "true"
                                                                       else ()):
        assert any(n.startswith(op) for n in names), f"{expr}: no {op} in the SASS"
    # dQ: TMA reduces from the staging, issued by the writer warp; no red.global.add.
    assert any(n.startswith("UTMAREDG") for n in names), f"{expr}: no UTMAREDG in the SASS"
    assert not any(n.startswith("REDG") for n in names), f"{expr}: REDG in the SASS"
    for op in ("LDL", "STL", "UBLKCP"):
        assert not any(n.startswith(op) for n in names), f"{expr}: local memory ({op})"
    hgmma = [op for op in ops if op.startswith("HGMMA")]
    # Per step: Sᵀ and dPᵀ (kHeadDim/16 each), dV and dK (kBlockM/16 each), dQ (kBlockN/16, both operands transposed).
    d, tile = row["head_dim"], row["tile"]
    assert len(hgmma) >= 2 * d // 16 + 2 * tile.block_m // 16 + tile.block_n // 16, (expr, len(hgmma))
    assert any("tnspA" in op and "tnspB" in op for op in hgmma), f"{expr}: dQ = dS K has no transposed-A HGMMA"
    # The shapes each split uses: Sᵀ, dPᵀ 64 × (block_m, or block_m/2 by columns); dV, dK 64 × (d, or d/2 by columns,
    # then with A from shared memory: tnspB without tnspA); dQ 64 × (d · block_m/64 / 2).
    s_n, kv_n = (tile.block_m // 2, d // 2) if tile.by_columns else (tile.block_m, d)
    dq_n = d * (tile.block_m // 64) // 2
    shapes = {(m.group(1), "tnspA" in op, "tnspB" in op)
              for op in hgmma for m in [re.match(r"HGMMA\.64x(\d+)x16", op)]}
    assert (str(s_n), False, False) in shapes and (str(dq_n), True, True) in shapes, (expr, shapes)
    if tile.by_columns:
        assert (str(kv_n), False, True) in shapes, (expr, shapes)
        # dSᵀ and Pᵀ stores: two stmatrix per 16-query k step of this warpgroup's Sᵀ.
        assert sum(n.startswith("STSM") for n in names) >= 2 * (s_n // 16), expr
    # Pᵀ's exponentials (block_m/2 per thread) run between wait_group 1 (Sᵀ done) and wait_group 0 (dPᵀ done).
    first = next(i for i, op in enumerate(ops) if op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1"))
    second = next(i for i, op in enumerate(ops[first:], first) if op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    between = sum(op.startswith("MUFU.EX2") for op in ops[first:second])
    assert between >= s_n // 2, f"{expr}: {between} MUFU.EX2 between the waits"


def test_tiles():
    from _compile_checks import wgmma_gen
    _gen = wgmma_gen()
    declared = set(FAMILY.name_expressions())
    for d, tile in _sm90.TILES.items():
        assert tile.block_n in (64, 128) and tile.block_m % 64 == 0 and tile.stages >= 2
        assert _sm90.STAT_PAD % tile.block_m == 0
        assert tile.smem_bytes(d) <= 232448, (d, tile)
        dq_n = d * (tile.block_m // 64) // 2  # one 64 × dq_n dQ tile per consumer warpgroup
        assert dq_n % 64 == 0 and dq_n in _gen.SS_MN_N
        if tile.by_columns:  # both warpgroups on the same 64 keys: Sᵀ by query halves, dK/dV by column halves
            assert tile.block_m // 2 in _gen.SS_N and d // 2 in _gen.SS_BMN_N and (d // 2) % 64 == 0
        else:  # a warpgroup per 64 keys: all queries, all columns
            assert tile.block_m in _gen.SS_N and d in _gen.RS_N
        for dtype in C_TYPE_16.values():
            for variants in ("false", "true"):
                assert FAMILY.name_expression(dtype=dtype, head_dim=d, tile=tile, variants=variants,
                                              varlen="false") in declared
    # Above the mma.sync kernel's 128, the Hopper kernel's 256 (the forward's FA3 buckets).
    assert set(_sm90.TILES) == set(_mma.TILES) | {256}


def test_tile_registers_fit_by_columns_only_at_256():
    """Why D = 256 splits by columns: a 64-key warpgroup holding dK and dV over all 256 columns needs 256 fp32
    accumulators per thread, above setmaxnreg's 240; by columns it holds 128, + Sᵀ/dPᵀ 32 + dQ 64 = 224."""
    tile = _sm90.TILES[256]
    assert tile.by_columns and 2 * 256 // 2 > 240
    assert 2 * 128 // 2 + 2 * tile.block_m // 2 // 2 + 256 * (tile.block_m // 64) // 2 // 2 <= 240


def test_params_layout():
    """The kernel reads its six tensor maps at 0/128/.../640 and dk right after them (bwd_params.cuh)."""
    p = _sm90._PARAMS
    assert p.itemsize == 960
    assert [p.fields[n][1] for n in ("tma_q", "tma_k", "tma_v", "tma_do", "tma_stats", "tma_dq", "dk", "scale_log2",
                                     "window_lo", "alibi_scale")] == [0, 128, 256, 384, 512, 640, 768, 888, 896, 928]


def test_head_bucket_and_reasons():
    cases = ((64, 64), (1, 1), (65, 64), (96, 96), (128, 40), (129, 129), (160, 160), (64, 192), (256, 256), (257, 8))
    assert [_sm90.head_bucket(*e) for e in cases] == [64, 64, 128, 128, 128, 256, 256, 256, 256, None]
    assert "sm_90a" in _sm90.unsupported_reason(F16, 64, 64, False, 80)
    assert "fp16 and bf16" in _sm90.unsupported_reason(np.dtype("float32"), 64, 64, False, 90)
    assert "head dims" not in (_sm90.unsupported_reason(F16, 256, 256, False, 90) or "")
    assert "up to 256" in _sm90.unsupported_reason(F16, 320, 320, False, 90)
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
    ("", 90, {"L": 64, "S": 64}, "sm90", "FlashAttention-3"),                # small: no size threshold
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
    ("", 90, {"E": 256, "L": 1024, "S": 1024}, "sm90", "FlashAttention-3"),  # issue 11's (8,16,1024,256)
    ("", 90, {"E": 256, "L": 64, "S": 64}, "sm90", "FlashAttention-3"),  # small, but the alternative is split
    ("", 90, {"E": 160, "Ev": 160}, "sm90", "FlashAttention-3"),          # padded to 256 by TMA's zero fill
    ("", 90, {"E": 128, "Ev": 192, "Hkv": 4}, "sm90", "FlashAttention-3"),  # E != Ev, GQA
    ("mma", 90, {"E": 256}, "split", "up to 128"),                        # the mma.sync kernel stops at 128
    ("sm90", 90, {"E": 264}, "split", "up to 256"),
    ("", 80, {"E": 256}, "split", "needs sm_90a"),
    ("", 90, {"E": 256, "dropout_p": 0.1}, "split", "dropout"),
    ("sm90", 90, {"E": 196}, "split", "stride along s is 392 bytes"),     # no TMA, no mma.sync above 128
    ("sm90", 90, {"dtype": "float32"}, "split", "fp16 and bf16"),
    ("sm90", 90, {"mask": object()}, "sm90", "attn_mask as a mod"),          # the mask read as a mod
    ("", 90, {"mask": object(), "L": 256, "S": 256}, "split", "attn_mask"),  # small: the split backward
    ("split", 90, {"mask": object()}, "split", "forced"),
    ("", 75, {}, "split", "sm_80"),
    ("", 90, {"dropout_p": 0.1}, "mma", "dropout"),                           # no dropout variant on Hopper
    # E = 66 sliced from rows 72 wide: strides pass TMA's checks, but the fp32 dQ accumulator's rows (264 bytes) do not
    ("sm90", 90, {"E": 66, "Ev": 64, "q": _FakeArray((8, 16, 2048, 66), (16 * 2048 * 144, 2048 * 144, 144, 2), 1 << 20),
                  "k": _FakeArray((8, 16, 2048, 66), (16 * 2048 * 144, 2048 * 144, 144, 2), 1 << 20)}, "mma", "multiple of 4"),
    ("sm90", 90, {"dropout_p": 0.1}, "mma", "dropout"),
])
def test_plan_backward(env, arch, problem, kernel, why, monkeypatch):
    _cuda_bindings()
    monkeypatch.setenv(_plan.ENV_BWD, env)
    plan = _plan.plan_backward(_problem(**problem), arch)
    assert (plan.kernel, why in plan.reason) == (kernel, True), str(plan)
    assert (plan.bucket is None) == (kernel == "split")
    if kernel == "sm90":
        assert plan.bucket in _sm90.TILES


def test_plan_backward_rejects_unknown_env(monkeypatch):
    monkeypatch.setenv(_plan.ENV_BWD, "fast")
    with pytest.raises(ValueError, match="CUPY_ATTN_BWD must be one of"):
        _plan.plan_backward(_problem(), 90)


def test_auto_takes_the_hopper_backward_at_any_size():
    """No size threshold (session 19: the Hopper kernel was as fast as the mma.sync one or faster at every size
    measured); mma stays for dropout and under CUPY_ATTN_BWD=mma."""
    _cuda_bindings()
    for B, H, L, S in ((4, 8, 1024, 1024), (4, 8, 1024, 1023), (1, 1, 1, 1), (1, 8, 256, 64)):
        assert _plan.plan_backward(_problem(B=B, H=H, L=L, S=S), 90).kernel == "sm90"


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
    monkeypatch.setenv(_plan.ENV_BWD, mode)
    gqa = q.shape[1] != k.shape[1]
    out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=_IS_CAUSAL[causal], enable_gqa=gqa,
                                                      return_lse=True)
    p = checks.check_sdpa(q, k, v, None, 0.0, _IS_CAUSAL[causal], None, gqa, "auto")
    plan = _plan.plan_backward(p)
    assert plan.kernel == expect, f"{what}: {plan}"
    grads = [torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda") for x in (q, k, v)]
    views = [p.ctx.as_cupy(t) for t in (out, lse, dout, *grads)]
    _bwd.sdpa_backward(p, plan, *views)
    _sync_or_die(f"{mode} backward, {what}")
    return grads


def _reference_grads(q, k, v, dout, causal):
    """float64 CPU autograd (tests/test_sdpa_backward.py's reference, rows without a visible key give 0)."""
    from test_sdpa_backward import _grads, _reference
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


def _other(q, v) -> str:
    """The backward to compare with: the mma.sync kernel up to head dim 128, the split backward above."""
    return "mma" if max(q.shape[-1], v.shape[-1]) <= max(_mma.TILES) else "split"


def _check(q, k, v, dtype, causal, monkeypatch, what, expect="sm90"):
    """The Hopper backward (forced) against the float64 reference, torch's error and the mma.sync kernel's error (the
    split backward's above head dim 128)."""
    from _tolerance import assert_close
    g = _torch().Generator("cuda").manual_seed(7)
    dout = _rand(q.shape[:-1] + (v.shape[-1],), dtype, g)
    other = _other(q, v)
    got = _backward(q, k, v, dout, causal, "sm90", monkeypatch, expect, what)
    theirs_ours = _backward(q, k, v, dout, causal, other, monkeypatch, other, what)
    ref = _reference_grads(q, k, v, dout, causal)
    theirs = _torch_grads(q, k, v, dout, causal)
    for label, a, b, r, t in zip(("dq", "dk", "dv"), got, theirs_ours, ref, theirs):
        assert_close(a, r, dtype, t, f"{what} {label} (vs torch's error)")
        assert_close(a, r, dtype, b, f"{what} {label} (vs the {other} backward's error)")


LS = [(1, 1), (17, 17), (129, 129), (1000, 1000), (1, 1000), (1000, 17), (17, 129), (129, 1000), (200, 333)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", sorted(_sm90.TILES))
@pytest.mark.parametrize("L,S", LS)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_shapes(dtype, E, L, S, causal, monkeypatch):
    _require_hopper()
    g = _torch().Generator("cuda").manual_seed(L * 31 + S + E)
    q, k, v = _rand((2, 2, L, E), dtype, g), _rand((2, 2, S, E), dtype, g), _rand((2, 2, S, E), dtype, g)
    _check(q, k, v, dtype, causal, monkeypatch, f"{dtype} E={E} L={L} S={S} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", sorted(_sm90.TILES))
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_gqa(dtype, E, causal, monkeypatch):
    """8 query heads on 2 key/value heads: a block's dK and dV sum over the 4 query heads of its group."""
    _require_hopper()
    g = _torch().Generator("cuda").manual_seed(E + 8)
    q, k, v = _rand((2, 8, 300, E), dtype, g), _rand((2, 2, 333, E), dtype, g), _rand((2, 2, 333, E), dtype, g)
    _check(q, k, v, dtype, causal, monkeypatch, f"{dtype} GQA 8/2 E={E} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", sorted(_sm90.TILES))
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
@pytest.mark.parametrize("E,Ev", [(80, 80), (96, 96), (40, 40), (8, 8), (72, 128), (128, 64), (32, 56),
                                  (160, 160), (192, 192), (200, 136), (256, 64), (96, 256), (136, 256)])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_padded_head_dims(dtype, E, Ev, causal, monkeypatch):
    """Head dims below a bucket run its kernel on TMA's zero fill past E (Ev); dQ, dK, dV store only E (Ev) columns."""
    _require_hopper()
    g = _torch().Generator("cuda").manual_seed(E * 3 + Ev)
    q, k, v = _rand((2, 4, 257, E), dtype, g), _rand((2, 4, 190, E), dtype, g), _rand((2, 4, 190, Ev), dtype, g)
    _check(q, k, v, dtype, causal, monkeypatch, f"{dtype} E={E} Ev={Ev} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("E", [128, 256])
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_long_causal(E, causal, monkeypatch):
    _require_hopper()
    g = _torch().Generator("cuda").manual_seed(4224 + E)
    q, k, v = (_rand((1, 2, 4224, E), "float16", g) for _ in range(3))
    _check(q, k, v, "float16", causal, monkeypatch, f"4224² E={E} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("E,width,expect", [(64, 68, "mma"), (200, 204, "split")])
def test_falls_back(E, width, expect, monkeypatch):
    """Rows TMA cannot read (q a slice of wider rows: a row stride of 2·width bytes, not a multiple of 16) keep the
    mma.sync kernel under sm90, or above head dim 128 the split backward."""
    _require_hopper()
    g = _torch().Generator("cuda").manual_seed(5)
    q = _rand((1, 2, 100, width), "float16", g)[..., :E]
    k, v = _rand((1, 2, 100, E), "float16", g), _rand((1, 2, 100, E), "float16", g)
    _check(q, k, v, "float16", None, monkeypatch, f"row stride {2 * width} B", expect=expect)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 8, 1024, 128), (2, 4, 1024, 256)])
def test_auto_takes_it_through_autograd(shape, monkeypatch):
    """Through torch autograd, auto plans the Hopper kernel (any size) and its gradients match the mma.sync kernel's (above 128 the split backward's) within the tolerance rule."""
    _require_hopper()
    import cupy_attn
    from cupy_attn.attention import checks
    from _tolerance import assert_close
    torch = _torch()
    g = torch.Generator("cuda").manual_seed(11)
    q, k, v = (_rand(shape, "bfloat16", g) for _ in range(3))
    dout = _rand(shape, "bfloat16", g)
    other = _other(q, v)
    monkeypatch.delenv(_plan.ENV_BWD, raising=False)
    assert _plan.plan_backward(checks.check_sdpa(q, k, v, None, 0.0, True, None, False, "auto")).kernel == "sm90"
    grads = {}
    for mode in ("auto", other):
        monkeypatch.setenv(_plan.ENV_BWD, mode)
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        cupy_attn.scaled_dot_product_attention(*ins, is_causal=True).backward(dout)
        _sync_or_die(f"autograd backward ({mode})")
        grads[mode] = [x.grad for x in ins]
    theirs = _torch_grads(q, k, v, dout, "top_left")
    ref = _reference_grads(q[:1, :2], k[:1, :2], v[:1, :2], dout[:1, :2], "top_left")  # batch 0, heads 0-1
    for i, label in enumerate(("dq", "dk", "dv")):
        for mode in ("auto", other):
            assert torch.isfinite(grads[mode][i]).all(), f"{mode} {label}"
        assert_close(grads["auto"][i][:1, :2], ref[i], "bfloat16", theirs[i][:1, :2], f"auto {label}")
        assert_close(grads["auto"][i][:1, :2], ref[i], "bfloat16", grads[other][i][:1, :2], f"auto vs {other} {label}")
