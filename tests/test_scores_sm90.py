"""The Hopper scores kernel (cupy_attn.attention.scores_sm90, cuda_src/attention/scores_softmax_sm90.cu): P = softmax(
scale · Q Kᵀ) in the input dtype and lse, whole rows on chip, S ≤ 512; and the split path's schedule that runs it
before the cuBLAS P·V GEMM (CUPY_ATTN_SPLIT_FUSED=1).

CPU: every instantiation compiles for sm_90a without spills or ptxas performance warnings; its SASS holds HGMMA of the
tile's width, TMA loads, mbarrier operations, setmaxnreg and no local memory (skipped without cuobjdump); the tile
table fits shared memory; a lane-level NumPy transcription of the kernel's epilogue (the wgmma accumulator layout, the
−inf mask past S, the quad shuffles and the shared-memory exchange between the two warpgroups, the stores) reproduces
the float64 softmax and writes every element of P[:L, :S] exactly once and nothing else.
GPU (``gpu`` marker): the kernel alone on NaN-poisoned P (padding columns past S must stay NaN) and lse against the
float64 reference with tests/_tolerance.py's rule (torch's same-precision softmax(Q Kᵀ) as the comparison); and
through cupy_attn.scaled_dot_product_attention with the switch set (explain() names the kernel; a second call replays).

    PYTHONPATH=. timeout 600 python3 -m pytest -m gpu tests/test_scores_sm90.py -x -k smoke    # first: one small case
    PYTHONPATH=. timeout 1200 python3 -m pytest -m gpu tests/test_scores_sm90.py
"""
import numpy as np
import pytest

from cupy_attn.attention import scores_sm90 as _scores
from cupy_attn.runtime import compile as _compile

from _tolerance import as_f64, assert_close
from test_flash_sm90 import _bhsd, _cuobjdump, sass_summary, sass_text

FAMILY = _scores.SCORES_SOFTMAX_SM90
DTYPES = ("float16", "bfloat16")

# ---------------------------------------------------------------------------------------------------------------------
# CPU


def test_every_instantiation_compiles_without_spills():
    reports = _compile.compile_family(FAMILY, "sm_90a")
    assert len(reports) == len(DTYPES) * len(_scores.SCORES_TILES)
    # 168 = the launch-time allocation at 384 threads; the consumers' 240 after setmaxnreg is not in this report.
    assert all(r.registers is not None and r.registers <= 168 for r in reports), reports
    spilled = [(r.name_expression, r.spill_bytes, r.stack_bytes) for r in reports if r.spill_bytes or r.stack_bytes]
    assert not spilled, f"register spills / stack: {spilled}"
    warned = [(r.name_expression, r.perf_warnings) for r in reports if r.perf_warnings]
    assert not warned, f"ptxas performance warnings: {warned}"


def test_sass_has_wgmma_of_the_tile_width_tma_and_no_local_memory():
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    cubin = _compile.family_cubin(FAMILY, "sm_90a")
    kernels = sass_summary(cubin)
    listings = sass_text(cubin)
    assert len(kernels) == len(listings) == len(FAMILY.name_expressions())
    for name, ops in kernels.items():
        half_n = int(name.split("ELi")[0].split("Li")[-1])  # ..._sm90I6__halfLi256ELi3EE...: the first int argument
        assert f"HGMMA.64x{half_n}x16.F32" in listings[name], f"{name}: no HGMMA.64x{half_n}x16"
        for op in ("HGMMA", "UTMALDG", "SYNCS", "USETMAXREG"):
            assert ops.get(op, 0) > 0, f"{name}: no {op} in the SASS"
        for op in ("LDL", "STL"):
            assert op not in ops, f"{name}: local memory ({op}: {ops[op]})"


def test_tiles():
    declared = set(FAMILY.name_expressions())
    for half_n, tile in _scores.SCORES_TILES.items():
        assert tile.half_n == half_n and half_n % 64 == 0 and half_n <= 256 and tile.stages >= 2
        assert tile.smem_bytes() <= 232448, tile
        for dtype in ("__half", "__nv_bfloat16"):
            assert FAMILY.name_expression(dtype=dtype, tile=tile) in declared
    for S in range(1, 513):
        half_n = _scores.tile_for(S).half_n
        assert 2 * half_n >= S and (half_n == 64 or 2 * (half_n - 64) < S), S
    for S in (0, 513):
        with pytest.raises(ValueError, match="seqlen_k"):
            _scores.tile_for(S)


def emulate_epilogue(s_block, S, rows, c, half_n, ld):
    """The kernel's epilogue, lane by lane, in float32: s_block (64, 2·half_n) = one CTA's raw scores (columns past S
    are the products with TMA's zero rows of K: 0); rows = valid query rows of the block; c = scale·log2 e. Returns
    (P (64, ld) float64 with NaN where nothing was written, lse (64,), writes per element)."""
    f32 = np.float32
    P = np.full((64, ld), np.nan)
    writes = np.zeros((64, ld), int)
    lse = np.full(64, np.nan)
    n_acc = half_n // 2
    acc = np.zeros((2, 4, 32, n_acc), f32)  # [warpgroup][warp][lane][register]
    for wg in range(2):
        for warp in range(4):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for j in range(half_n // 8):
                    for half in range(2):
                        for e in range(2):
                            acc[wg, warp, lane, 4 * j + 2 * half + e] = s_block[warp * 16 + g + 8 * half,
                                                                                 wg * half_n + 8 * j + 2 * t + e]
    # Mask past S, per warpgroup whose keys reach past it.
    for wg in range(2):
        n0 = wg * half_n
        if n0 + half_n > S:
            for lane in range(32):
                lim = S - n0 - 2 * (lane % 4)
                for j in range(half_n // 8):
                    for e in range(2):
                        if 8 * j + e >= lim:
                            acc[wg, :, lane, 4 * j + e] = acc[wg, :, lane, 4 * j + 2 + e] = -np.inf
    lanes = np.arange(32)

    def quad(x, op):  # __shfl_xor_sync with 1, then 2, along the lane axis
        x = op(x, x[:, :, lanes ^ 1])
        return op(x, x[:, :, lanes ^ 2])

    mx = np.stack([np.max(acc[..., [4 * j + 2 * h + e for j in range(half_n // 8) for e in range(2)]], axis=-1)
                   for h in range(2)], axis=-1)  # [wg][warp][lane][half]
    mx = quad(mx, np.maximum)
    row_max = np.full((2, 64), np.nan, f32)
    for wg in range(2):
        for warp in range(4):
            for lane in range(0, 32, 4):  # t == 0
                for h in range(2):
                    row_max[wg, warp * 16 + lane // 4 + 8 * h] = mx[wg, warp, lane, h]
    m_c = np.zeros_like(mx)
    for wg in range(2):
        for warp in range(4):
            for lane in range(32):
                for h in range(2):
                    m_c[wg, warp, lane, h] = f32(max(mx[wg, warp, lane, h],
                                                     row_max[wg ^ 1, warp * 16 + lane // 4 + 8 * h]) * f32(c))
    x = acc.copy()
    sums = np.zeros_like(mx)
    for j in range(half_n // 8):
        for h in range(2):
            for e in range(2):
                i = 4 * j + 2 * h + e
                with np.errstate(invalid="ignore"):
                    x[..., i] = np.exp2(x[..., i] * f32(c) - m_c[..., h])
                sums[..., h] += x[..., i]
    sums = quad(sums, np.add)
    row_sum = np.full((2, 64), np.nan, f32)
    for wg in range(2):
        for warp in range(4):
            for lane in range(0, 32, 4):
                for h in range(2):
                    row_sum[wg, warp * 16 + lane // 4 + 8 * h] = sums[wg, warp, lane, h]
    for wg in range(2):
        n0 = wg * half_n
        for warp in range(4):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for h in range(2):
                    r = warp * 16 + g + 8 * h
                    l_sum = sums[wg, warp, lane, h] + row_sum[wg ^ 1, r]
                    inv = f32(1) / l_sum
                    if wg == 0 and t == 0 and r < rows:
                        lse[r] = (m_c[wg, warp, lane, h] + np.log2(l_sum)) * np.log(2)
                    if r >= rows:
                        continue
                    col0 = n0 + 2 * t
                    lim = S - n0 - 2 * t
                    for j in range(half_n // 8):
                        x0 = x[wg, warp, lane, 4 * j + 2 * h] * inv
                        x1 = x[wg, warp, lane, 4 * j + 2 * h + 1] * inv
                        if 8 * j + 1 < lim:
                            P[r, col0 + 8 * j], P[r, col0 + 8 * j + 1] = x0, x1
                            writes[r, col0 + 8 * j] += 1
                            writes[r, col0 + 8 * j + 1] += 1
                        elif 8 * j < lim:
                            P[r, col0 + 8 * j] = x0
                            writes[r, col0 + 8 * j] += 1
    return P, lse, writes


@pytest.mark.parametrize("S", [1, 7, 64, 100, 129, 256, 300, 385, 511, 512])
@pytest.mark.parametrize("rows", [64, 13])
def test_epilogue_emulation_matches_softmax(S, rows):
    rng = np.random.default_rng(S * 100 + rows)
    half_n = _scores.tile_for(S).half_n
    ld = -(-S // 8) * 8
    scale = 0.37
    s = np.zeros((64, 2 * half_n), np.float32)
    s[:, :S] = rng.standard_normal((64, S)).astype(np.float32) * 6  # large logits: the max matters
    P, lse, writes = emulate_epilogue(s, S, rows, scale * 1.4426950408889634, half_n, ld)
    z = s[:rows, :S].astype(np.float64) * scale
    ref = np.exp(z - z.max(-1, keepdims=True))
    ref_lse = np.log(ref.sum(-1)) + z.max(-1)
    ref /= ref.sum(-1, keepdims=True)
    assert (writes[:rows, :S] == 1).all(), "every element of P[:L, :S] is written once"
    assert (writes[rows:] == 0).all() and (writes[:, S:] == 0).all(), "nothing past L or S is written"
    np.testing.assert_allclose(P[:rows, :S], ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lse[:rows], ref_lse, rtol=1e-5, atol=1e-5)
    assert np.isnan(lse[rows:]).all()


def _problem(**kw):
    import types
    q = _bhsd(2, 4, 100, 1024)
    p = dict(query=q, key=_bhsd(2, 4, 300, 1024), value=_bhsd(2, 4, 300, 1024), mask=None, causal=None,
             dropout_p=0.0, scale=0.03, dtype=np.dtype("float16"), seqlen_k=300)
    return types.SimpleNamespace(**{**p, **kw})


def test_unsupported_reasons():
    if _scores.unsupported_reason(_problem(), 90) is not None:
        pytest.skip(_scores.unsupported_reason(_problem(), 90))  # cuda-bindings missing
    assert _scores.unsupported_reason(_problem(dtype=np.dtype("bfloat16")), 90) is None
    for kw, arch, words in (({}, 80, "sm_80"), ({"dtype": np.dtype("float32")}, 90, "float32"),
                            ({"seqlen_k": 513}, 90, "512"), ({"causal": "top_left"}, 90, "is_causal"),
                            ({"mask": object()}, 90, "attn_mask"), ({"dropout_p": 0.1}, 90, "dropout"),
                            ({"scale": -1.0}, 90, "scale"), ({"key": _bhsd(2, 4, 300, 1024, ptr=(1 << 20) + 8)}, 90,
                                                             "16-byte")):
        why = _scores.unsupported_reason(_problem(**kw), arch)
        assert why is not None and words in why, (kw, why)


def test_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv(_scores.ENV_SPLIT_FUSED, raising=False)
    assert not _scores.enabled()
    monkeypatch.setenv(_scores.ENV_SPLIT_FUSED, "1")
    assert _scores.enabled()
    from cupy_attn.runtime import callcache
    assert _scores.ENV_SPLIT_FUSED in callcache.ENV_KEYS, "a cached call must not replay the other schedule"


# ---------------------------------------------------------------------------------------------------------------------
# GPU

def _torch():
    return pytest.importorskip("torch")


def _run_kernel(q, k, scale, ld):
    """The kernel alone on torch CUDA tensors (passed as CuPy views): (P (B, Hq, L, ld) NaN-poisoned before the
    launch, lse (B, Hq, L) likewise), as torch tensors."""
    import cupy
    torch = _torch()
    B, Hq, L, _ = q.shape
    P = torch.full((B, Hq, L, ld), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, L), float("nan"), dtype=torch.float32, device=q.device)
    cq, ck, clse = cupy.from_dlpack(q), cupy.from_dlpack(k), cupy.from_dlpack(lse)
    launch = _scores.prepare(cq, ck, clse, scale=scale, ld=ld)
    launch(cq.data.ptr, ck.data.ptr, P.data_ptr(), lse.data_ptr())
    torch.cuda.synchronize()
    return P, lse


def _reference(q, k, scale):
    """float64 P and lse from the same (rounded) inputs; GQA by head index h // groups."""
    q64, k64 = as_f64(q), as_f64(k)
    groups = q64.shape[1] // k64.shape[1]
    k64 = np.repeat(k64, groups, axis=1)
    z = (q64 @ k64.swapaxes(-1, -2)) * scale
    m = z.max(-1, keepdims=True)
    e = np.exp(z - m)
    return e / e.sum(-1, keepdims=True), np.log(e.sum(-1)) + m[..., 0]


def _torch_softmax(q, k, scale):
    """torch's same-precision P: softmax(Q Kᵀ · scale) with the GEMM and the softmax in the input dtype."""
    torch = _torch()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1)


def _check_kernel(B, Hq, Hkv, L, S, D, dtype, layout="bhsd", seed=0):
    torch = _torch()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)

    def rand(b, h, n):
        if layout == "bshd":  # read in place through the tensor maps' strides
            return torch.randn(b, n, h, D, generator=gen, device="cuda").to(dt).transpose(1, 2)
        return torch.randn(b, h, n, D, generator=gen, device="cuda").to(dt)

    q, k = rand(B, Hq, L), rand(B, Hkv, S)
    scale = D ** -0.5
    ld = -(-S // 8) * 8
    P, lse = _run_kernel(q, k, scale, ld)
    ref, ref_lse = _reference(q, k, scale)
    what = f"(B,Hq,Hkv,L,S,D)=({B},{Hq},{Hkv},{L},{S},{D}) {dtype} {layout}"
    assert_close(P[..., :S], ref, dtype, _torch_softmax(q, k, scale), what)
    if ld > S:
        assert bool(torch.isnan(P[..., S:]).all()), f"{what}: the kernel wrote padding columns past S"
    np.testing.assert_allclose(as_f64(lse), ref_lse, rtol=1e-4, atol=2e-3, err_msg=what)


@pytest.mark.gpu
def test_smoke():
    """One small case: run first (a barrier mistake hangs; run under timeout)."""
    _check_kernel(1, 2, 2, 100, 100, 320, "float16")


CASES = [  # (B, Hq, Hkv, L, S, D)
    (2, 3, 3, 100, 1, 320),
    (1, 2, 2, 64, 64, 512),
    (2, 2, 2, 130, 100, 1000),
    (1, 4, 4, 200, 256, 1024),
    (2, 1, 1, 77, 300, 320),
    (1, 2, 2, 128, 384, 512),
    (1, 2, 2, 129, 512, 1024),
    (2, 4, 4, 512, 512, 1024),   # the seed (32, 32, 512, 1024) with fewer heads
    (1, 8, 2, 70, 200, 512),     # GQA 8/2
    (1, 1, 1, 1, 512, 64),       # one query row, one k block
    (1, 1, 1, 65, 511, 8),       # E = 8: one zero-filled k block
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,L,S,D", CASES)
def test_kernel(B, Hq, Hkv, L, S, D, dtype):
    _check_kernel(B, Hq, Hkv, L, S, D, dtype)


@pytest.mark.gpu
def test_kernel_bshd_layout():
    _check_kernel(2, 3, 3, 90, 300, 512, "bfloat16", layout="bshd")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_public_api_with_switch(monkeypatch, dtype):
    """scaled_dot_product_attention under CUPY_ATTN_SPLIT_FUSED=1 at a head dim no fused kernel serves: the split
    path's schedule is this kernel → cuBLAS P·V (explain() says so); out and lse against float64; a second call on new
    arrays replays the cached launch (new tensor maps)."""
    import cupy_attn
    from cupy_attn import reference
    torch = _torch()
    monkeypatch.setenv(_scores.ENV_SPLIT_FUSED, "1")
    gen = torch.Generator(device="cuda").manual_seed(1)
    dt = getattr(torch, dtype)
    for seed in range(2):
        q, k, v = (torch.randn(*s, generator=gen, device="cuda").to(dt)
                   for s in ((2, 4, 200, 512), (2, 4, 300, 512), (2, 4, 300, 384)))
        plan = cupy_attn.explain(q, k, v)
        assert plan.backend == "split" and plan.details["schedule"].startswith("scores_softmax_sm90"), str(plan)
        out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, return_lse=True)
        ref, ref_lse = reference.scaled_dot_product_attention(*(as_f64(x) for x in (q, k, v)), return_lse=True)
        torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        assert_close(out, ref, dtype, torch_out, what=f"public call {seed}")
        np.testing.assert_allclose(as_f64(lse), ref_lse, rtol=1e-4, atol=2e-3)
    monkeypatch.setenv(_scores.ENV_SPLIT_FUSED, "0")
    plan = cupy_attn.explain(q, k, v)
    assert plan.details["scores kernel"].startswith("not used"), str(plan)
