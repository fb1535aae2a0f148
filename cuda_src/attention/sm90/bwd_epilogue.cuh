// Epilogue piece of flash_bwd_sm90.cu: dK, dV of the key block rounded once to T and stored (dQ's per-step reduction
// is the dQ writer's, bwd_mainloop.cuh: bwd_dq_write). Owns the gradient indexing; layouts of the accumulators as in
// common/wgmma.cuh (lane 4g+t: acc[4j + 2·half + e] = row g + 8·half of its warp's 16, column 8j + 2t + e).
#pragma once
#include "common/types.cuh"
#include "common/mma.cuh"

namespace cupy_attn {
namespace sm90 {

// Rows key0, key0 + 8 of one gradient (dK or dV, rows of `cols` elements; `head` = the row of key 0 of its (b, h)
// slice, key j's row `row_step` rows after key j − 1's: 1 for (B, Hkv, S, cols), Hkv for a packed (total_k, Hkv,
// cols)), columns col_wg + 8j + 2t (+1) for j < kN/8 (col_wg: this warpgroup's first column), = scale · acc rounded
// to T; keys past S and columns past `cols` are not stored.
template <typename T, int kN>
__device__ __forceinline__ void store_grad(const float (&acc)[kN / 2], T* head, int key0, int t, int col_wg,
                                           int seqlen_k, int cols, float scale, long long row_step = 1) {
  const bool pairs = cols % 2 == 0;  // 4-byte aligned element pairs
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key0 + 8 * half;
    if (key >= seqlen_k) continue;
    T* row = head + static_cast<long long>(key) * row_step * cols;
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
