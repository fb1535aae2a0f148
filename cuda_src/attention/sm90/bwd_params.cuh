// Kernel parameters of flash_bwd_sm90.cu. Declared once, in NumPy (cupy_attn/attention/backward_sm90.py: _PARAMS):
// the size and every field's size are asserted when the family compiles (KernelFamily.structs), and
// tests/test_structs.py checks the field order against this declaration.
#pragma once
#include "common/tma.cuh"

namespace cupy_attn {

// Passed by value as one __grid_constant__ parameter (896 bytes): the tensor maps must stay in the parameter space,
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
  long long causal_offset;  // 0 (top-left, torch's is_causal) or S - L (bottom-right)
  double scale;             // softmax scale (dK = scale · dSᵀ Q; dQ's scale is applied by the atomics)
  double scale_log2;        // scale · log2(e)
};

}  // namespace cupy_attn
