"""The fused FlashAttention-2 backward on mma.sync (cuda_src/attention/flash_bwd.cu), sm_80+.

FlashAttention-2's Algorithm 2 (Dao 2023) in one kernel per key block: P recomputed from the forward's lse, dV += Pᵀ dO
and dK += dSᵀ Q accumulated in registers, dQ added into an fp32 accumulator by atomics. fp16 and bf16, head dims up to
128, no attn_mask, either causal alignment, GQA, dropout (the forward's keep mask from the call's rng pair). The plan
(dispatch.plan_backward) says when it runs; :func:`build` prepares a call's :class:`FlashBackward`.
"""
from __future__ import annotations

import numpy as np

from ... import philox
from ...runtime.compile import KernelFamily
from ...runtime.interop import dtype_name
from ...runtime.kernel_abi import C_TYPE, LOG2E, Layout, head_dim_bucket as _bucket, rows16, set_strides
from ...runtime.launch import AlignFlag, PreparedLaunch, Step
from . import bwd_rows

# Head-dim bucket -> (warps, kBlockM); kBlockN = 16 · warps. Both buckets: 4 warps, 64 keys × 64 queries per step; at
# D = 128 dK and dV take 128 accumulators per thread and the kernel sits at 255 registers with no spills (the dQ loop
# over keys is not unrolled, the Sᵀ loop by 2: fully unrolled they spilled 8 bytes). Head dims above 128 take the
# Hopper kernel or the split backward.
TILES = {64: (8, 64), 128: (8, 64)}
TILE_CHOICES = ((8, 64),)

PARAMS = np.dtype([(n, np.float64 if n in ("scale", "scale_log2", "dropout_scale") else np.int64) for n in (
    "dk", "dv", "dq_accum", "q", "k", "v", "dout", "lse", "delta", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v",
    "num_heads", "groups", "is_causal", "causal_offset", "vec_flags", "scale", "scale_log2",
    "q_stride_b", "q_stride_h", "q_stride_l", "k_stride_b", "k_stride_h", "k_stride_s",
    "v_stride_b", "v_stride_h", "v_stride_s", "do_stride_b", "do_stride_h", "do_stride_l", "rng",
    "dropout_threshold", "dropout_scale")])

FLASH_BWD = KernelFamily(
    name="flash_bwd",
    source="attention/flash_bwd.cu",
    template="cupy_attn::flash_bwd<{dtype}, {head_dim}, {tile[0]}, {tile[1]}, {dropout}>",
    axes={"dtype": ("__half", "__nv_bfloat16"), "head_dim": tuple(TILES),
          "tile": TILE_CHOICES, "dropout": ("false", "true")},
    structs=(("cupy_attn::FlashBwdParams", PARAMS),),
)


def head_dim_bucket(head_dim: int, head_dim_v: int) -> int | None:
    """The kernel's head-dim bucket (64 or 128) for E and Ev, None above 128."""
    return _bucket(head_dim, head_dim_v, TILES)


class FlashBackward(bwd_rows.FusedBackward):
    """The mma.sync fused backward of one problem layout, prepared once (the call cache of the autograd backward
    replays it): D = rowsum(dO ∘ O) by attn_bwd_delta, the kernel (dQ accumulated in fp32 by atomics), dQ's rounding.
    Scratch: D (B·Hq·L fp32) and the dQ accumulator (B·Hq·L·E fp32)."""

    def __init__(self, p, bucket: int):
        self.ctx = p.ctx
        B, Hq, Hkv, L, S, E, Ev = p.batch, p.num_heads, p.num_kv_heads, p.seqlen_q, p.seqlen_k, p.head_dim, \
            p.head_dim_v
        ctype = C_TYPE[dtype_name(p.dtype)]
        self.dq32_offset = bwd_rows.round_up_256(B * Hq * L * 4)
        self.scratch_bytes = self.dq32_offset + B * Hq * L * E * 4
        delta = np.zeros((), dtype=bwd_rows.BWD_PARAMS)
        delta["rows"], delta["head_dim_v"] = B * Hq * L, Ev
        self.delta = PreparedLaunch(
            delta, [Step(bwd_rows.BACKWARD_DELTA.kernel(dtype=ctype), (-(-B * Hq * L // 8),), (256,))],
            args=("dout", "out", "scratch"), pointers={"dout": "dout", "o": "out", "delta": "scratch"})

        warps, block_m = TILES[bucket]
        prm = self.params = np.zeros((), dtype=PARAMS)
        prm["seqlen_q"], prm["seqlen_k"], prm["head_dim"], prm["head_dim_v"] = L, S, E, Ev
        prm["num_heads"], prm["groups"] = Hq, p.groups
        prm["is_causal"] = p.causal is not None
        prm["causal_offset"] = p.causal_offset
        do = Layout.contiguous((B, Hq, L, Ev), p.dtype)  # dout as the kernel reads it (base: per call)
        prm["vec_flags"] = rows16(p.query) | rows16(p.key) << 1 | rows16(p.value) << 2
        do_vec_flag = rows16(do) << 3  # when dout's base is 16-byte aligned too
        prm["scale"], prm["scale_log2"] = p.scale, p.scale * LOG2E
        if p.dropout_p > 0:
            prm["dropout_threshold"] = philox.dropout_threshold(p.dropout_p)
            prm["dropout_scale"] = philox.dropout_scale(p.dropout_p)
        set_strides(prm, ("q", p.query, "bhl"), ("k", p.key, "bhs"), ("v", p.value, "bhs"), ("do", do, "bhl"))
        if Hkv > 65535 or B > 65535:
            raise ValueError(f"fused backward: grid limit: heads {Hkv} and batch {B} must each be <= 65535")
        kernel = FLASH_BWD.kernel(dtype=ctype, head_dim=bucket, tile=(warps, block_m),
                                  dropout="true" if p.dropout_p > 0 else "false")
        block_n = 16 * warps
        smem = ((2 * block_n + 4 * block_m) * (bucket + 8) + block_n * (block_m + 8)) * 2 + 2 * block_m * 4
        self.kernel = PreparedLaunch(
            prm, [Step(kernel, (-(-S // block_n), Hkv, B), (warps * 32,), smem)],
            args=("q", "k", "v", "dout", "lse", "scratch", "dk", "dv", "rng"),
            pointers={"q": "q", "k": "k", "v": "v", "dout": "dout", "lse": "lse", "delta": "scratch",
                      "dq_accum": ("scratch", self.dq32_offset), "dk": "dk", "dv": "dv", "rng": "rng"},
            flags=[AlignFlag("vec_flags", "dout", 16, do_vec_flag)])
        self.cast = bwd_rows.GroupSum(ctype, B * Hq * L * E, B * Hq * L * E, 1)

    def _launch(self, stream, scratch, q, k, v, out, lse, dout, dk, dv, rng):
        self.delta.launch_on(stream, dout, out, scratch)
        self.kernel.launch_on(stream, q, k, v, dout, lse, scratch, dk, dv, rng)


def build(p, bucket: int) -> FlashBackward:
    """The prepared backward of a checked problem (checks.SDPAProblem) at head-dim bucket ``bucket`` (the plan's:
    dispatch.plan_backward), replayed as ``launch(q, k, v, out, lse, dout, dq, dk, dv, rng)`` on device pointers."""
    return FlashBackward(p, bucket)
