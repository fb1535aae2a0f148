// Kernel parameters of flash_bwd_sm90.cu. Declared once, in NumPy (cupy_attn/attention/backward_sm90.py: _PARAMS):
// the size and every field's size are asserted when the family compiles (KernelFamily.structs), and
// tests/test_structs.py checks the field order against this declaration.
#pragma once
#include "common/tma.cuh"
#include "common/visibility.cuh"

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
  // Packed batches (kVarlen; the forward's FlashFwdSm90Params fields): q, dO, out (total_q, Hq, E|Ev), k, v, dk, dv
  // (total_k, Hkv, E|Ev), dq_accum (total_q, Hq, E) fp32, the statistics (2·Hq, seqlen_q_padded) with sequence b's
  // columns from BwdSeq::stat_col on; seqlen_q / seqlen_k hold total_q / total_k, causal_offset and window_lo the
  // offsets relative to each sequence's diagonal S_b − L_b. Grid (⌈max S_b / kBlockN⌉, Hkv, B).
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  const int* seqused_k;
};

// The sequence of a key block, and where its rows are. Dense calls: batch b of the maps, rows and keys from 0, the
// call's L, S and bounds. Packed calls (kVarlen): batch 0, the sequence's offsets q0 / k0 and lengths (clamped to the
// arrays' rows), its bounds, and its statistics from column stat_col = ⌊(q0 + b·kBlockM) / kBlockM⌋·kBlockM
// (FlashAttention-3's padded offsets: a kBlockM box of one sequence never reaches the next's columns, whose padding
// holds lse +inf and D 0, so P = 0 on rows past L). Where dK / dV rows go: bwd_kv_rows.
struct BwdSeq {
  int b_map;                   // the batch coordinate of the tensor maps
  int q0, k0, L, S;
  long long causal_offset;     // used only when is_causal
  long long window_lo;         // kNoLowerBound: none
  int stat_col;                // the statistics' first column of this sequence
  int stat_row0, delta_row0;   // query head h's lse row: stat_row0 + h; its D row: delta_row0 + h
};

template <bool kVarlen, int kBlockM>
__device__ __forceinline__ BwdSeq bwd_seq(const FlashBwdSm90Params& p, int b) {
  const int Hq = static_cast<int>(p.num_heads);
  if constexpr (!kVarlen) {
    return {b, 0, 0, static_cast<int>(p.seqlen_q), static_cast<int>(p.seqlen_k), p.causal_offset, p.window_lo, 0,
            b * Hq, static_cast<int>(gridDim.z) * Hq + b * Hq};
  } else {
    const int total_q = static_cast<int>(p.seqlen_q), total_k = static_cast<int>(p.seqlen_k);
    const int q0 = min(max(p.cu_seqlens_q[b], 0), total_q), k0 = min(max(p.cu_seqlens_k[b], 0), total_k);
    const int L = min(max(p.cu_seqlens_q[b + 1] - q0, 0), total_q - q0);
    const int S = min(max(p.seqused_k != nullptr ? p.seqused_k[b] : p.cu_seqlens_k[b + 1] - k0, 0), total_k - k0);
    const long long d = S - L;
    return {0, q0, k0, L, S, p.causal_offset + d, p.window_lo == kNoLowerBound ? kNoLowerBound : p.window_lo + d,
            (q0 + b * kBlockM) / kBlockM * kBlockM, 0, Hq};
  }
}

// dK / dV rows of head h_kv of key block's sequence b: key j at row first + j·step of (rows, cols) — dense (B, Hkv,
// S, cols): first (b·Hkv + h_kv)·S, step 1; packed (total_k, Hkv, cols): first k0·Hkv + h_kv, step Hkv (hkv = Hkv, in
// the type the caller has it). Computed where
// the gradients are stored (k0 read again: nothing held across the mainloop).
struct KvRows {
  long long first, step;
};
template <bool kVarlen, typename Heads>
__device__ __forceinline__ KvRows bwd_kv_rows(const FlashBwdSm90Params& p, int b, Heads hkv, int h_kv, int S) {
  if constexpr (!kVarlen) {
    return {(static_cast<long long>(b) * hkv + h_kv) * S, 1};
  } else {
    const long long k0 = min(max(p.cu_seqlens_k[b], 0), static_cast<int>(p.seqlen_k));
    return {k0 * hkv + h_kv, static_cast<long long>(hkv)};
  }
}

}  // namespace cupy_attn
