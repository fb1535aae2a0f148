// Epilogue of flash_fwd_sm90.cu: out = O / l from one warpgroup's accumulators straight to global memory (4-byte
// stores of element pairs; the launcher requires 4-byte aligned pairs), and lse = (m + log2 l)·ln 2. Owns the
// output indexing. Rows past L (zero-filled by TMA, computed but meaningless) are not stored.
#pragma once
#include "common/types.cuh"
#include "common/mma.cuh"

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

}  // namespace sm90
}  // namespace cupy_attn
