// Packing wgmma accumulators for 16-byte stores, shared by the scores kernel (P), the head-dim-512 forward (O) and
// the P·V kernel (O): Pair<T> makes a 32-bit register of two 16-bit values; quad_transpose gives each lane of a quad
// 8 consecutive columns of its row; pack_row_half and store_row_half store a row half of an accumulator block that
// way in two steps (the P·V kernel packs a tile's out, then stores it under the next tile's first wgmma; the
// head-dim-512 forward keeps its own loop: a shared helper changed its SASS and measured slower in bf16,
// bench/notes/kernels_flash_fwd_d512_sm90.md).
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

// One row half of a warpgroup's 64 × kN accumulator block (a[4j + 2·half + e]: the lane's row r0 + 8·half, column
// 8j + 2t + e) as kN / 4 words of T pairs, each value times `scale`: word 4i + u holds columns 8(4i + u) + 2t, + 1.
template <typename T, int kN>
__device__ __forceinline__ void pack_row_half(const float (&a)[kN / 2], int half, float scale, unsigned* words) {
  using P2 = typename Pair<T>::type;
  #pragma unroll
  for (int jj = 0; jj < kN / 8; ++jj) {
    const P2 v = Pair<T>::make(a[4 * jj + 2 * half] * scale, a[4 * jj + 2 * half + 1] * scale);
    words[jj] = *reinterpret_cast<const unsigned*>(&v);
  }
}

// pack_row_half's words stored by 16-byte stores: the quad's transpose gives lane t columns col0 + 32i + 8t ... + 7,
// stored at row_ptr[col] where row_ok and col < cols (cols a multiple of 8, rows 16-byte aligned).
template <typename T, int kN>
__device__ __forceinline__ void store_row_half(const unsigned* words, T* row_ptr, bool row_ok, int col0,
                                               long long cols, int t) {
  #pragma unroll
  for (int i = 0; i < kN / 32; ++i) {
    unsigned w[4] = {words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3]};
    quad_transpose(w, t);
    const int col = col0 + 32 * i + 8 * t;
    if (row_ok && col < cols) *reinterpret_cast<uint4*>(row_ptr + col) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace sm90
}  // namespace cupy_attn
