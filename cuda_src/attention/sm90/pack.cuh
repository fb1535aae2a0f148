// Packing wgmma accumulators for 16-byte stores, shared by the scores kernel (P) and the head-dim-512 forward (O):
// Pair<T> makes a 32-bit register of two 16-bit values; quad_transpose gives each lane of a quad 8 consecutive
// columns of its row.
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

}  // namespace sm90
}  // namespace cupy_attn
