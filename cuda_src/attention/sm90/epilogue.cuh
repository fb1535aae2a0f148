// Epilogue of flash_fwd_sm90.cu: out = O / l from one warpgroup's accumulators straight to global memory (4-byte
// stores of element pairs; the launcher requires 4-byte aligned pairs), and lse = (m + log2 l)·ln 2. Owns the
// output indexing. Rows past L (zero-filled by TMA, computed but meaningless) are not stored.
#pragma once
#include "common/types.cuh"
#include "common/mma.cuh"
#include "attention/sm90/params.cuh"

namespace cupy_attn {
namespace sm90 {

// o: this lane's accumulators (o[4d + 2·half + e] = row row0 + 8·half, column 8d + 2t + e); m, l: its rows'
// statistics from OnlineSoftmax. out/lse: the (batch, head) bases; an empty row (l = 0) gets out 0 and lse -inf.
template <typename T, int kHeadDim>
__device__ __forceinline__ void store_output(const float (&o)[kHeadDim / 2], const float (&m)[2], const float (&l)[2],
                                             T* out, long long out_stride_l, float* lse, long long lse_stride_l,
                                             int row0, int t, int seqlen_q, int head_dim_v) {
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = l[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // the quad's four lanes hold parts of the same row
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int r = row0 + 8 * half;
    if (r >= seqlen_q) continue;
    T* orow = out + r * out_stride_l;
    #pragma unroll
    for (int d = 0; d < kHeadDim / 8; ++d) {
      const int col = d * 8 + 2 * t;
      const float o0 = o[4 * d + 2 * half] * inv, o1 = o[4 * d + 2 * half + 1] * inv;
      if (col + 1 < head_dim_v) {
        *reinterpret_cast<unsigned*>(orow + col) = pack2<T>(o0, o1);
      } else if (col < head_dim_v) {
        orow[col] = from_float<T>(o0);
      }
    }
    if (lse != nullptr && t == 0) lse[r * lse_stride_l] = sum > 0.f ? (m[half] + __log2f(sum)) * kLn2 : neg_inf();
  }
}

// A tile whose rows see no key (bottom-right alignment with L > S): out 0 and lse -inf for its `rows` rows from query
// row m0 of (b, h), written by `threads` threads (tid = 0 ... threads - 1) without loading anything. (The one-tile
// variant's kernel has the same loops inline, with all 384 threads.)
template <typename T>
__device__ __forceinline__ void store_empty_rows(const FlashFwdSm90Params& p, int m0, int h, int b, int rows, int tid,
                                                 int threads) {
  T* out = static_cast<T*>(p.out) + b * p.out_stride_b + h * p.out_stride_h + m0 * p.out_stride_l;
  const int Ev = static_cast<int>(p.head_dim_v);
  for (int i = tid; i < rows * Ev; i += threads) out[(i / Ev) * p.out_stride_l + i % Ev] = from_float<T>(0.f);
  if (p.lse) {
    float* lse = p.lse + b * p.lse_stride_b + h * p.lse_stride_h;
    for (int i = tid; i < rows; i += threads) lse[(m0 + i) * p.lse_stride_l] = neg_inf();
  }
}

}  // namespace sm90
}  // namespace cupy_attn
