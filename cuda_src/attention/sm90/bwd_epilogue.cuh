// Epilogue pieces of flash_bwd_sm90.cu: dQ's per-step reduction into the fp32 accumulator in global memory, and dK,
// dV of the key block rounded once to T and stored. Owns the gradient indexing; layouts of the accumulators as in
// common/wgmma.cuh (lane 4g+t: acc[4j + 2·half + e] = row g + 8·half of its warp's 16, column 8j + 2t + e).
#pragma once
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/reduce.cuh"

namespace cupy_attn {
namespace sm90 {

// dq_accum rows row0, row0 + 8 (this lane's), columns col0 + 8j (+1) for j < kN/8, += scale · dq: kN columns of one
// warpgroup's 64 × kN tile. Pairs go by red.global.add.v2.f32 when E is even (8-byte aligned pairs); rows past L
// and columns past E are skipped (their values come from TMA's zero fill and are 0 anyway).
template <int kN>
__device__ __forceinline__ void reduce_dq(const float (&dq)[kN / 2], float* dq_head, int row0, int col0, int seqlen_q,
                                          int head_dim, float scale) {
  // Even E with all kN columns of the tile inside it (E = 64, 128, 256 ...): pairs without per-column tests.
  const bool whole = head_dim % 2 == 0 && (col0 & ~7) + kN <= head_dim;
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + 8 * half;
    if (row >= seqlen_q) continue;
    float* dst = dq_head + static_cast<long long>(row) * head_dim + col0;
    if (whole) {
      #pragma unroll
      for (int j = 0; j < kN / 8; ++j)
        red_add2(dst + 8 * j, scale * dq[4 * j + 2 * half], scale * dq[4 * j + 2 * half + 1]);
    } else {
      #pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
        const int col = col0 + 8 * j;
        const float a = scale * dq[4 * j + 2 * half], b = scale * dq[4 * j + 2 * half + 1];
        if (head_dim % 2 == 0 && col + 1 < head_dim) {
          red_add2(dst + 8 * j, a, b);
        } else {
          if (col < head_dim) atomicAdd(dst + 8 * j, a);
          if (col + 1 < head_dim) atomicAdd(dst + 8 * j + 1, b);
        }
      }
    }
  }
}

// Rows key0, key0 + 8 of one gradient (dK or dV: (B, Hkv, S, cols) contiguous, `head` = its (b, h) slice), columns
// col_wg + 8j + 2t (+1) for j < kN/8 (col_wg: this warpgroup's first column), = scale · acc rounded to T; keys past
// S and columns past `cols` are not stored.
template <typename T, int kN>
__device__ __forceinline__ void store_grad(const float (&acc)[kN / 2], T* head, int key0, int t, int col_wg,
                                           int seqlen_k, int cols, float scale) {
  const bool pairs = cols % 2 == 0;  // 4-byte aligned element pairs
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key0 + 8 * half;
    if (key >= seqlen_k) continue;
    T* row = head + static_cast<long long>(key) * cols;
    #pragma unroll
    for (int d = 0; d < kN / 8; ++d) {
      const int col = d * 8 + 2 * t + col_wg;
      const float x0 = scale * acc[4 * d + 2 * half], x1 = scale * acc[4 * d + 2 * half + 1];
      if (pairs && col + 1 < cols) {
        *reinterpret_cast<unsigned*>(row + col) = pack2<T>(x0, x1);
      } else {
        if (col < cols) row[col] = from_float<T>(x0);
        if (col + 1 < cols) row[col + 1] = from_float<T>(x1);
      }
    }
  }
}

}  // namespace sm90
}  // namespace cupy_attn
