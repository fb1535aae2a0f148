// Packing wgmma accumulators for 16-byte stores, shared by the scores kernel (P), the head-dim-512 forward (O) and
// the P·V kernel (O): Pair<T> makes a 32-bit register of two 16-bit values; quad_transpose gives each lane of a quad
// 8 consecutive columns of its row; store_row_16b stores a row half of an accumulator block that way (the P·V
// kernel's epilogue; the head-dim-512 forward keeps its own copy of the loop: calling this helper changed its SASS
// and measured 3% slower in bf16, session 18).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cupy_attn {
namespace sm90 {

template <typename T> struct Pair;
template <> struct Pair<__half> {
  using type = __half2;
  __device__ __forceinline__ static type make(float a, float b) { return __floats2half2_rn(a, b); }
};
template <> struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  __device__ __forceinline__ static type make(float a, float b) { return __floats2bfloat162_rn(a, b); }
};

// The 4 × 4 transpose of 32-bit words across the 4 lanes of a quad (lanes 4g ... 4g + 3): word u of lane t becomes word
// t of lane u. Two butterfly steps (bit 0, then bit 1 of lane ^ word), each moving the two words whose bit differs from
// the lane's through one shfl.xor: 4 SHFL and 12 SEL per 4 words. A lane holding packed pairs of columns 8j + 2t, + 1
// for j = 4i ... 4i + 3 (the wgmma accumulator layout) then holds the 8 consecutive columns 32i + 8t ... + 7.
__device__ __forceinline__ void quad_transpose(unsigned (&w)[4], int t) {
  #pragma unroll
  for (int bit = 1; bit <= 2; bit <<= 1) {
    const bool hi = (t & bit) != 0;
    #pragma unroll
    for (int lo = 0; lo < 4; ++lo) {
      if (lo & bit) continue;
      const unsigned send = hi ? w[lo] : w[lo | bit];
      const unsigned got = __shfl_xor_sync(0xffffffffu, send, bit);
      if (hi) w[lo] = got; else w[lo | bit] = got;
    }
  }
}

// One row half of a warpgroup's 64 × kN accumulator block (a[4j + 2·half + e]: the lane's row `row`, column 8j + 2t
// + e) as T, each value times `scale`, by 16-byte stores to out[row · stride + col0 + 32i + 8t ... + 7] where
// row < rows and the chunk's first column is below `cols` (cols a multiple of 8, rows 16-byte aligned).
template <typename T, int kN>
__device__ __forceinline__ void store_row_16b(const float (&a)[kN / 2], int half, float scale, T* out, int row,
                                              long long stride, long long rows, int col0, long long cols, int t) {
  using P2 = typename Pair<T>::type;
  T* const o_row = out + static_cast<long long>(row) * stride;
  #pragma unroll
  for (int i = 0; i < kN / 32; ++i) {
    unsigned w[4];
    #pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int jj = 4 * i + u;
      const P2 v = Pair<T>::make(a[4 * jj + 2 * half] * scale, a[4 * jj + 2 * half + 1] * scale);
      w[u] = *reinterpret_cast<const unsigned*>(&v);
    }
    quad_transpose(w, t);
    const int col = col0 + 32 * i + 8 * t;
    if (row < rows && col < cols) *reinterpret_cast<uint4*>(o_row + col) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace sm90
}  // namespace cupy_attn
