// Kernel parameters of flash_bwd_sm90.cu. Declared once, in NumPy (cupy_attn/attention/backward_sm90.py: _PARAMS):
// the size and every field's size are asserted when the family compiles (KernelFamily.structs), and
// tests/test_structs.py checks the field order against this declaration.
#pragma once
#include "common/tma.cuh"

namespace cupy_attn {

// Passed by value as one __grid_constant__ parameter (960 bytes): the tensor maps must stay in the parameter space,
// where TMA reads them by address. Integers are 8 bytes wide, like the NumPy side's int64 fields.
struct FlashBwdSm90Params {
  tma::TensorMap tma_q;     // Q as (E, L, Hq, B), box (64, kBlockM, 1, 1), 128-byte swizzle
  tma::TensorMap tma_k;     // K as (E, S, Hkv, B), box (64, kBlockN, 1, 1)
  tma::TensorMap tma_v;     // V as (Ev, S, Hkv, B), box (64, kBlockN, 1, 1)
  tma::TensorMap tma_do;    // dO as (Ev, L, Hq, B), box (64, kBlockM, 1, 1)
  tma::TensorMap tma_stats; // lse_log2 then delta as one fp32 (seqlen_q_padded, 2·B·Hq) matrix: row b·Hq + h is
                            // the lse row, B·Hq + b·Hq + h the D row; box (kBlockM, 1), no swizzle
  tma::TensorMap tma_dq;    // dq_accum as fp32 (E, L, Hq, B), box (32, 64, 1, 1), 128-byte swizzle: dQ's TMA reduce
                            // (its kStageCols / 32 boxes a round; E a multiple of 4: 16-byte rows)
  void* dk;                 // (B, Hkv, S, E) contiguous, T
  void* dv;                 // (B, Hkv, S, Ev) contiguous, T
  float* dq_accum;          // (B, Hq, L, E) contiguous fp32, zeroed by the pre-pass, accumulated by TMA reduce
  const float* lse_log2;    // (B, Hq, seqlen_q_padded): lse·log2(e); +inf for empty rows and rows past L (P = 0)
  const float* delta;       // (B, Hq, seqlen_q_padded): D = rowsum(dO ∘ O); 0 past L
  long long seqlen_q, seqlen_k, seqlen_q_padded, head_dim, head_dim_v;
  long long num_heads;      // Hq
  long long groups;         // Hq / Hkv: key/value head h serves query heads h·groups ... h·groups + groups − 1
  long long is_causal;      // 1: key j is visible to query i iff j <= i + causal_offset
  long long causal_offset;  // 0 (top-left, torch's is_causal) or S - L (bottom-right); with a window's right side
                            // the smaller of that and S − L + right
  double scale;             // softmax scale (dK = scale · dSᵀ Q; dQ's scale is applied by the atomics)
  double scale_log2;        // scale · log2(e); c · log2(e) with a softcap c (the forward's P = 2^(t·sc − lse·log2 e))
  // The variants (common/visibility.cuh, common/score_mod.cuh; the forward's names), read by the kVariants
  // instantiations only. A window's right side is folded into is_causal / causal_offset by the launcher (the smaller
  // upper bound); its left side is window_lo. Sinks need nothing here: dS = P ∘ (dP − D) holds with the sink in lse,
  // and the sinks' own gradient is computed outside the kernel.
  long long window_lo;         // key j is visible to query i only if j >= i + window_lo (kNoLowerBound: no bound)
  double softcap_in;           // scale / c, or 0 without a softcap. scale stays the softmax scale: dS with respect
                               // to the raw score is dS · scale · (1 − t²), the kernel's scale times (1 − t²)
  const float* alibi_slopes;   // fp32 ALiBi slopes (Hq,) or (B, Hq), or nullptr
  long long alibi_stride_b;    // 0 for (Hq,) slopes, Hq for (B, Hq)
  double alibi_scale;          // 1 / scale, or 1 / c with a softcap (the bias in raw-score units)
};

}  // namespace cupy_attn
