"""The fused forward for head dims 257-512 on Hopper (cuda_src/attention/flash_fwd_d512_sm90.cu): issue 14's route (b).

FlashAttention's online softmax with FlashAttention-3's TMA producer and two wgmma consumers that split the work of one
64-row block: each computes S for half of a 256-key block over the whole head dim and owns half of O's 512 columns;
P passes through shared memory. No L × S score buffer, and causal calls skip the key blocks above the diagonal (the
split path computes them).

It takes the same parameter struct and launch object as the head-dim ≤ 256 kernel (fused_sm90.FlashFwdSm90Params,
Sm90Launch), with its own boxes: Q (64 columns, 64 rows), K (64, 256), V (64, 32).

Dispatch (dispatch.plan_sdpa): ``CUPY_ATTN_D512=1`` takes it for every call it can serve, ``0`` never; unset, auto
takes it where :func:`prefer_grid` says so (S > 512 and a grid that fills the device; measured 1.17-1.84x
the split path).
"""
from __future__ import annotations

import functools
import os

import numpy as np

from ..runtime.compile import KernelFamily
from ..runtime.interop import dtype_name
from . import fused_sm90 as _sm90

ENV = "CUPY_ATTN_D512"
BLOCK_M, BLOCK_N, HEAD_DIM, V_KEYS, STAGES = 64, 256, 512, 32, 4
THREADS = 384
_C_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


def smem_bytes(stages: int = STAGES) -> int:
    """Q (64 × 512) + P (64 × 256) 16-bit tiles, stages × 32 KB, 2·stages + 2 barriers, row statistics (3 × 2 × 64
    floats), 1 KB of alignment slack: 232,016 bytes at four stages (SharedStorage::kBytes)."""
    return BLOCK_M * HEAD_DIM * 2 + BLOCK_M * BLOCK_N * 2 + stages * 32768 + 8 * (2 * stages + 2) + 4 * 6 * BLOCK_M + 1024


FLASH_FWD_D512_SM90 = KernelFamily(
    name="flash_fwd_d512_sm90",
    source="attention/flash_fwd_d512_sm90.cu",
    template="cupy_attn::flash_fwd_d512_sm90<{dtype}, {stages}, {persistent}, {variants}>",
    axes={"dtype": tuple(_C_TYPES.values()), "stages": (STAGES,), "persistent": ("false", "true"),
          "variants": ("false", "true")},
    # The variants run one tile per CTA: the persistent kernel, at its 240-register limit, spills with them.
    where=lambda row: row["variants"] == "false" or row["persistent"] == "false",
    archs=("sm_90a",),
    structs=(("cupy_attn::FlashFwdSm90Params", _sm90._PARAMS),),
    arch="sm_90a",
)


def unsupported_reason(dtype, head_dim: int, head_dim_v: int, mask_kind: str, arch: int, scale: float) -> str | None:
    """None when this kernel can serve a call of this kind (layout still to check: :func:`layout_reason`).

    >>> unsupported_reason(np.dtype("float16"), 320, 320, "none", 90, 0.05) is None
    True
    >>> unsupported_reason(np.dtype("float16"), 1024, 1024, "none", 90, 0.03)
    'head dims E=1024, Ev=1024: the head-dim-512 kernel serves 257-512 (Ev a multiple of 8)'
    """
    if arch != 90:
        return f"sm_{arch}: the head-dim-512 kernel needs sm_90a (H100/H200)"
    if dtype_name(dtype) not in _C_TYPES:
        return f"dtype {dtype_name(dtype)}: the head-dim-512 kernel serves fp16 and bf16"
    if not (256 < max(head_dim, head_dim_v) and head_dim <= HEAD_DIM and head_dim_v <= HEAD_DIM
            and head_dim_v % 8 == 0):
        return f"head dims E={head_dim}, Ev={head_dim_v}: the head-dim-512 kernel serves 257-512 (Ev a multiple of 8)"
    if mask_kind != "none":
        return "attn_mask: the head-dim-512 kernel has no mask input (causal only)"
    if not scale > 0:
        return f"scale {scale}: the head-dim-512 kernel folds the scale into exp2 and needs scale > 0"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return "cuda-bindings is not installed (cuTensorMapEncodeTiled)"
    return None


def layout_reason(q, k, v, out) -> str | None:
    """fused_sm90.layout_reason (TMA reads q, k, v in place), and out's rows 16-byte aligned (16-byte stores; out=None:
    allocated by the call, contiguous)."""
    why = _sm90.layout_reason(q, k, v, None)
    if why is not None or out is None:
        return why
    return _sm90.out_16b_reason(out)


def enabled() -> str | None:
    """CUPY_ATTN_D512: "1" (every call it can serve), "0" (never), None (auto)."""
    value = os.environ.get(ENV)
    if value not in (None, "0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value


def prefer_grid(B: int, Hq: int, L: int, S: int, num_sms: int) -> tuple[bool, str]:
    """Auto rule between this kernel and the split path for a call both can run: this kernel when L ≥ 128, S > 512 and
    its grid (⌈L / 64⌉ · Hq · B CTAs, one per SM) fills the device at least once. At S ≤ 512 the split path runs the
    scores kernel (whole score rows on chip, cuBLAS P·V), which measured faster; below one wave of CTAs the split
    path's GEMMs spread the call wider (not measured).

    Measured on an H200 (session 14: bench/experiments/d512_fwd.py and the main job, whole calls), this kernel
    against the split path: (4,16,2048,2048,512) fp16 1.28-1.40x, causal 1.59x; (2,8,4096,4096,512) bf16 1.28x,
    causal 1.73x; (8,16,1024,1024,512) fp16 1.27x; (4,16,2048,2048,384) fp16 1.17x; (4,16,2048,2048,320) bf16
    causal 1.29x; L = S = 1024-8192 at D = 512 1.32-1.39x (against the split rows of the previous main job); but
    (128,16,256,256,512) fp16 0.906 ms against the split path's 0.810 (scores kernel). Session 15 (v1.3, 6-7% faster
    kernel): (4,16,2048,2048,512) fp16 1.41-1.50x, causal 1.69x; (2,8,4096,4096,512) bf16 1.45x, causal 1.84x.

    >>> prefer_grid(4, 16, 2048, 2048, 132)[0], prefer_grid(1, 2, 300, 700, 132)[0], prefer_grid(128, 16, 256, 256, 132)[0]
    (True, False, False)
    """
    ctas = -(-L // BLOCK_M) * Hq * B
    if L < 2 * BLOCK_M:
        return False, (f"L = {L} < {2 * BLOCK_M}: the head-dim-512 kernel's 64-row blocks would be mostly padding "
                       "(decode-like calls stay on the split path; not measured)")
    if S <= 512:
        return False, f"S = {S} <= 512: the split path's scores kernel holds whole rows (faster there, measured)"
    if ctas >= num_sms:
        return True, (f"head-dim-512 fused kernel: {ctas} CTAs fill the {num_sms} SMs (1.17-1.84x the split path at "
                      "head dims 320-512, measured)")
    return False, f"{ctas} CTAs of the head-dim-512 kernel would not fill the {num_sms} SMs"


def grid_for(B: int, Hq: int, L: int, causal: bool, persistent: bool, num_sms: int) -> tuple[tuple, bool]:
    """(grid, tile_pairs): one tile per CTA, or min(SMs, units) persistent CTAs over sm90/tile_scheduler.cuh's units
    (causal calls with more tiles than SMs pair the m-blocks (M−1−k, k) of a head).

    >>> grid_for(4, 16, 2048, False, True, 132), grid_for(2, 8, 4096, True, True, 132)
    (((132, 1, 1), False), ((132, 1, 1), True))
    >>> grid_for(1, 1, 300, True, True, 132)
    ((5, 1, 1), False)
    >>> grid_for(2, 8, 4096, True, False, 132)
    ((64, 8, 2), False)
    """
    m_blocks = -(-L // BLOCK_M)
    if not persistent:
        return (m_blocks, Hq, B), False
    pairs = causal and m_blocks * Hq * B > num_sms
    units = Hq * B * (-(-m_blocks // 2) if pairs else m_blocks)
    return (min(num_sms, units), 1, 1), pairs


def prepare(q, k, v, out, lse, *, scale: float, causal: str | None, family: KernelFamily = FLASH_FWD_D512_SM90,
            persistent: bool = True) -> "_sm90.Sm90Launch":
    """The launch for arrays accepted by unsupported_reason and layout_reason (out as allocated by the call); family:
    FLASH_FWD_D512_SM90 or a copy with other NVRTC options; persistent=False: one tile per CTA (the baseline row of
    bench/experiments/d512_wall.py)."""
    B, Hq, L, E = q.shape
    _, Hkv, S, Ev = v.shape
    # Persistent CTAs (v1.2: 1.028 vs 1.057 ms at (4,16,2048,2048,512) fp16, 0.579 vs 0.598 at (8,16,1024,1024,512)).
    # Causal calls with more tiles than SMs walk m-block pairs (M−1−k, k) of equal cost (tile_scheduler.cuh; static
    # striding over single tiles, longest first, measured 0.715 ms against 0.548 for one tile per CTA at
    # (2,8,4096,4096,512) bf16); persistent=False: one tile per CTA, causal row blocks longest first.
    from ..runtime.interop import device_sms
    import cupy
    kernel = family.kernel(dtype=_C_TYPES[dtype_name(q.dtype)], stages=STAGES,
                           persistent="true" if persistent else "false", variants="false")
    p = np.zeros((), dtype=_sm90._PARAMS)
    p["seqlen_q"], p["seqlen_k"], p["head_dim_v"], p["groups"] = L, S, Ev, Hq // Hkv
    p["is_causal"] = causal is not None
    p["causal_offset"] = S - L if causal == "bottom_right" else 0
    p["scale_log2"] = float(scale) * _sm90._LOG2E
    p["batch"], p["num_heads"] = B, Hq
    for axis, stride in zip("bhl", _sm90._estrides(out)):
        p[f"out_stride_{axis}"] = stride
    if lse is not None:
        for axis, stride in zip("bhl", _sm90._estrides(lse)):
            p[f"lse_stride_{axis}"] = stride
    maps = (_sm90._MapSpec.of(q, BLOCK_M), _sm90._MapSpec.of(k, BLOCK_N), _sm90._MapSpec.of(v, V_KEYS))
    grid, p["tile_pairs"] = grid_for(B, Hq, L, causal is not None, persistent, device_sms(cupy.cuda.Device().id))
    return _sm90.Sm90Launch(kernel, p, maps, grid, (THREADS,), smem_bytes(), None)


def prepare_problem(p, out, lse):
    """The launch for a checked problem (checks.SDPAProblem), bound to the call's stream."""
    launch = prepare(p.query, p.key, p.value, out, lse, scale=p.scale, causal=p.causal)
    return functools.partial(launch.launch_on, p.ctx.stream.ptr)


def details(p) -> dict:
    return {"kernel": FLASH_FWD_D512_SM90.name,
            "tile": f"{BLOCK_M} rows x {BLOCK_N}-key blocks, head dim padded to {HEAD_DIM}; two consumer warpgroups "
                    f"(S split by keys, O by columns, P through shared memory), {STAGES} x 32 KB TMA stages",
            "causal": "key blocks above the diagonal skipped" if p.causal else "none"}
