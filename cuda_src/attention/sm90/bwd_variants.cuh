// The variants of flash_bwd_sm90.cu (its kVariants instantiations): a sliding window's lower bound on a consumer
// warpgroup's Sᵀ tile, with the forward's definition (common/visibility.cuh) in the backward's transposed layout: lane
// 4g+t holds keys key0 (= its warp's first key + g) and key0 + 8 (half = 0, 1) against queries q0 + 8j + 2t + e at
// acc[4j + 2·half + e] (q0: the warpgroup's first query of the step). Sinks need nothing here: dS = P ∘ (dP − D)
// holds with the sink's term in lse (the sinks' own gradient, −Σ_i e^(sink − lse_i) D_i, is computed outside the
// kernel).
#pragma once
#include "common/mma.cuh"

namespace cupy_attn {
namespace sm90 {

// What the consumers compute per step: kPlain in the plain instantiations (the exponentials between the two wgmma
// waits, the causal mask), kWindow in the kVariants ones (the same with both edges of a window, the lower one too).
enum class BwdMode { kPlain, kWindow };

// Sᵀ -> Pᵀ = 2^(r · sc − lse·log2 e) in place, lse·log2 e of query 8j + 2t (+1) at lse[8j + 2t]: kPlain's and
// kWindow's pass, between the waits (it overlaps dPᵀ = V dOᵀ).
template <int kSN>
__device__ __forceinline__ void bwd_exp_scores(float (&s)[kSN / 2], const float* lse, int t, float sc) {
  #pragma unroll
  for (int j = 0; j < kSN / 8; ++j) {
    const float2 l = *reinterpret_cast<const float2*>(lse + 8 * j + 2 * t);
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      s[4 * j + 2 * half] = exp2_approx(fmaf(s[4 * j + 2 * half], sc, -l.x));
      s[4 * j + 2 * half + 1] = exp2_approx(fmaf(s[4 * j + 2 * half + 1], sc, -l.y));
    }
  }
}

// The visible query columns of key `key` in the lane's layout: column 8j + e (query q0 + 8j + 2t + e) is visible iff
// bwd_first_col <= 8j + e <= bwd_last_col. First: past every column for keys past S; key − causal_offset − q0 − 2t
// under the upper bound (causal and/or a window's right side), else 0. Last: key − window_lo − q0 − 2t, past every
// column with the consumer's no-bound window_lo, −(L + 3·kBlockM). Ints: |S − L| and |window_lo| are below L + S +
// 3·kBlockM < 2^31 (first is Visibility::causal_first_row(key) − q0 − 2t; the 64-bit helper changed the plain
// kernel's SASS).
template <int kSN>
__device__ __forceinline__ int bwd_first_col(int key, int q0, int t, int S, bool causal, int causal_offset) {
  return key >= S ? kSN : (causal ? key - causal_offset - q0 - 2 * t : 0);
}
__device__ __forceinline__ int bwd_last_col(int key, int q0, int t, int window_lo) {
  return key - window_lo - q0 - 2 * t;
}

// After the exponentials (kPlain, kWindow): Pᵀ -> 0 outside each key's visible columns: past S and the upper bound,
// and with kLower (the variants) a window's lower bound.
template <int kSN, bool kLower>
__device__ __forceinline__ void bwd_mask(float (&s)[kSN / 2], int key0, int q0, int t, int S, bool causal,
                                         int causal_offset, int window_lo) {
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int first = bwd_first_col<kSN>(key0 + 8 * half, q0, t, S, causal, causal_offset);
    [[maybe_unused]] const int last = bwd_last_col(key0 + 8 * half, q0, t, window_lo);
    #pragma unroll
    for (int j = 0; j < kSN / 8; ++j)
      #pragma unroll
      for (int e = 0; e < 2; ++e)
        if (8 * j + e < first || (kLower && 8 * j + e > last)) s[4 * j + 2 * half + e] = 0.f;
  }
}

}  // namespace sm90
}  // namespace cupy_attn
