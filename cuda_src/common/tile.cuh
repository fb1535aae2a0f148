// Global -> shared tile loads shared by the fused attention kernels (forward and backward): row-major tiles with a
// padded pitch (kHeadDim + 8 elements: conflict-free ldmatrix for every head dim that is a multiple of 16) or, for the
// wgmma kernels, 128-byte-swizzled atoms; zero-filled past the valid rows and columns.
#pragma once
#include "common/mma.cuh"

namespace cupy_attn {
namespace flash {

// Copy rows [0, kRows) × columns [0, kHeadDim) of a row-major global tile into shared memory (pitch kHeadDim + 8).
// Rows >= rows_valid and columns >= cols_valid become zeros. vec: rows are 16-byte aligned, so whole 16-byte chunks
// go by cp.async (asynchronous; the caller commits and waits); otherwise plain 2-byte loads (synchronous).
// Thread mapping: kColThreads threads share a row (kColThreads = the largest power of two dividing the row's chunk
// count, so 12- and 20-chunk rows work too); a thread's chunks then sit at fixed columns on rows kRowStep apart, and
// one pointer bumped by kRowStep rows addresses them all (this loader runs between the two GEMMs, when 192 fp32
// accumulators are live, so it must not hold a 64-bit address per chunk).
//
// kSwizzle128 (the wgmma kernels): instead of padded rows, the tile is stored as kHeadDim/64 column blocks of kRows ×
// 128 bytes, and 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its row: the canonical 128-byte-swizzled
// K-major layout of a wgmma shared-memory operand (PTX ISA, "Shared Memory Matrix Layout"), whose 8-row atoms must
// start 1024-byte aligned. A thread's rows are kRowStep apart, a multiple of 8, so its XOR term is one constant.
template <int kRows, int kHeadDim, bool kSwizzle128>
__device__ __forceinline__ int tile_offset(int r, int col) {
  if constexpr (kSwizzle128) {
    return (col / 64) * (kRows * 64) + r * 64 + ((((col % 64) / 8) ^ (r % 8)) * 8);
  } else {
    return r * (kHeadDim + 8) + col;
  }
}

template <int kRows, int kHeadDim, int kThreads, bool kSwizzle128 = false, typename T>
__device__ __forceinline__ void load_tile(T* dst, const T* src, long long row_stride, int rows_valid, int cols_valid,
                                          bool vec) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kColThreads = kChunksPerRow & -kChunksPerRow;
  constexpr int kRowStep = kThreads / kColThreads;
  static_assert(kThreads % kColThreads == 0 && kRows % kRowStep == 0, "every thread copies the same chunks");
  static_assert(!kSwizzle128 || (kHeadDim % 64 == 0 && kRowStep % 8 == 0), "128-byte swizzle atoms: 64 x 8 rows");
  const int r0 = threadIdx.x / kColThreads, c0 = (threadIdx.x % kColThreads) * 8;
  if (vec) {
    #pragma unroll
    for (int j = 0; j < kChunksPerRow / kColThreads; ++j) {
      const int col = c0 + j * kColThreads * 8;
      const int bytes = max(0, min(16, (cols_valid - col) * 2));
      const T* from = src + r0 * row_stride + col;
      #pragma unroll
      for (int i = 0; i < kRows / kRowStep; ++i) {
        const int r = r0 + i * kRowStep;
        // A zero-byte copy reads nothing, but its address must still be valid and aligned: use the tile's start.
        const bool ok = r < rows_valid && bytes > 0;
        const int at = tile_offset<kRows, kHeadDim, kSwizzle128>(r, col);
        cp_async_16(smem_addr(dst + at), ok ? from : src, ok ? bytes : 0);
        from += kRowStep * row_stride;
      }
    }
  } else {
    const unsigned short* s16 = reinterpret_cast<const unsigned short*>(src);
    for (int c = threadIdx.x; c < kRows * kChunksPerRow; c += kThreads) {
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      unsigned short e[8];
      #pragma unroll
      for (int x = 0; x < 8; ++x) e[x] = (r < rows_valid && col + x < cols_valid) ? s16[r * row_stride + col + x] : 0;
      uint4 packed;
      packed.x = e[0] | (unsigned(e[1]) << 16); packed.y = e[2] | (unsigned(e[3]) << 16);
      packed.z = e[4] | (unsigned(e[5]) << 16); packed.w = e[6] | (unsigned(e[7]) << 16);
      *reinterpret_cast<uint4*>(dst + tile_offset<kRows, kHeadDim, kSwizzle128>(r, col)) = packed;
    }
  }
}

}  // namespace flash
}  // namespace cupy_attn
