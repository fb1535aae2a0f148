// Kernel parameters of flash_fwd_sm90.cu. Declared once, in NumPy (cupy_attn/attention/fused_sm90.py: _PARAMS): the
// size and every field's size are asserted when the family compiles (KernelFamily.structs), and tests/test_structs.py
// checks the field order against this declaration.
#pragma once
#include "common/tma.cuh"

namespace cupy_attn {

// Passed by value as one __grid_constant__ parameter (768 bytes): the tensor maps must stay in the parameter space,
// where TMA reads them by address. Integers are 8 bytes wide, like the NumPy side's int64 fields.
struct FlashFwdSm90Params {
  tma::TensorMap tma_q;  // Q as (E, L, Hq, B), box (64 or 32, kBlockM, 1, 1): one 128- or 64-byte swizzle atom wide
  tma::TensorMap tma_k;  // K as (E, S, Hkv, B), box (64 or 32, kBlockN, 1, 1)
  tma::TensorMap tma_v;  // V as (Ev, S, Hkv, B), box (64 or 32, kBlockN, 1, 1)
  tma::TensorMap tma_o;  // out as (Ev, L, Hq, B), box (64 or 32, 64, 1, 1): the epilogue's TMA stores (o_tma = 1)
  void* out;             // (B, Hq, L, Ev), element pairs 4-byte aligned
  float* lse;            // (B, Hq, L) fp32 natural log, or nullptr
  long long seqlen_q, seqlen_k, head_dim_v;
  long long groups;         // Hq / Hkv: query head h reads key/value head h / groups
  long long is_causal;      // 1: key j is visible to query i iff j <= i + causal_offset
  long long causal_offset;  // 0 (top-left, torch's is_causal) or S - L (bottom-right)
  double scale_log2;        // scale · log2(e), > 0
  long long out_stride_b, out_stride_h, out_stride_l;
  long long lse_stride_b, lse_stride_h, lse_stride_l;
  long long batch, num_heads;  // B, Hq: the persistent variant's tile count (sm90/tile_scheduler.cuh)
  long long tile_pairs;        // persistent and causal: 1 = units of two m-blocks (M-1-k, k), 0 = single m-blocks
  long long o_tma;             // 1: out stored through shared memory by TMA (tma_o); 0: 4-byte global stores
  // The variants (common/visibility.cuh, common/score_mod.cuh), read by the kVariants instantiations only. A window's
  // right side is folded into is_causal / causal_offset by the launcher (the smaller upper bound); its left side is
  // window_lo.
  long long window_lo;         // key j is visible to query i only if j >= i + window_lo (kNoLowerBound: no bound)
  const void* sinks;           // (Hq,) sink logits (natural log), or nullptr
  long long sinks_kind;        // 0: fp32 sinks; 1: sinks of the element type T
  double softcap_in;           // kVariants: scale / c, or 0 without a softcap (scale_log2 is then c · log2(e))
  const float* alibi_slopes;   // kVariants: fp32 ALiBi slopes (Hq,) or (B, Hq), or nullptr
  long long alibi_stride_b;    // 0 for (Hq,) slopes, Hq for (B, Hq)
  double alibi_scale;          // kVariants: 1 / scale, or 1 / c with a softcap (the bias in raw-score units)
};

}  // namespace cupy_attn
