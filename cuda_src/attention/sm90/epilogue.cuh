// Epilogue of flash_fwd_sm90.cu: out = O / l from one warpgroup's accumulators, and lse = (m + log2 l)·ln 2. Two
// ways (the launcher's o_tma word): through a shared-memory staging buffer and TMA stores (store_output_tma), or
// straight to global memory by 4-byte stores of element pairs (store_output; the launcher requires 4-byte aligned
// pairs). Owns the output indexing. Rows past L (zero-filled by TMA, computed but meaningless) are not stored.
#pragma once
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/score_mod.cuh"
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

// Named barriers kOStoreBarrier + wg (wg = 0 ... 2): one consumer warpgroup's 128 threads around its O staging buffer
// (the ping-pong uses 1 ... 3).
constexpr int kOStoreBarrier = 4;
static_assert(kOStoreBarrier > 3 && kOStoreBarrier + 2 <= 15, "after the ping-pong's barriers 1-3, within 0-15");

// The same result through shared memory and TMA (o_tma = 1: out's rows 16-byte strided and aligned, Ev a multiple of
// 8, so that TMA's 16-byte granularity at the Ev edge stays inside a row). Per chunk of kChunkCols head-dim columns:
// the lanes write out = O / l converted to T into this warpgroup's staging buffer `stage` (64 rows, boxes of
// kSwizzleBytes / 2 columns in the tiles' swizzle: 16-byte chunk c of row r at c ^ (r % 8) for 128 bytes,
// c ^ ((r / 2) % 4) for 64; the 32 lanes of a 4-byte store hit 32 distinct banks), a proxy fence and a warpgroup
// barrier, then lane 0 of the warpgroup (tid_wg 0) issues one TMA store per box (rows past L and columns past Ev are
// clipped) and commits. Before the buffer is written again (the next chunk, or the next tile's epilogue) that thread
// waits until the stores have read it; the kernel's last wait is epilogue_drain. So a tile's stores drain while the
// warpgroup starts its next tile. lse as store_output.
template <typename T, int kHeadDim, int kSwizzleBytes, int kChunkCols, typename Seq>
__device__ __forceinline__ void store_output_tma(const float (&o)[kHeadDim / 2], const float (&m)[2],
                                                 const float (&l)[2], unsigned char* stage_base,
                                                 const FlashFwdSm90Params& p, const Seq& seq, int m0, int h,
                                                 float* lse) {
  constexpr int kAtomCols = kSwizzleBytes / 2;
  constexpr int kBoxBytes = 64 * kSwizzleBytes;
  // The thread's place, read again from %tid.x here (asm volatile: not hoisted into the mainloop, where the 160- and
  // 240-register consumers have no room to keep it).
  unsigned x;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(x));
  const int c = static_cast<int>(x) - 128;
  const int wg = c >> 7, tid_wg = c & 127, warp = tid_wg >> 5, g = (c & 31) >> 2, t = c & 3;
  const int wg_row0 = m0 + 64 * wg, row0 = wg_row0 + 16 * warp + g;
  unsigned char* stage = stage_base + wg * (64 * kChunkCols * 2);
  const int seqlen_q = static_cast<int>(seq.seqlen_q());
  float inv[2];
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = l[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    inv[half] = sum > 0.f ? 1.f / sum : 0.f;
    const int r = row0 + 8 * half;
    if (lse != nullptr && t == 0 && r < seqlen_q)
      lse[r * p.lse_stride_l] = sum > 0.f ? (m[half] + __log2f(sum)) * kLn2 : neg_inf();
  }
  #pragma unroll
  for (int chunk = 0; chunk < kHeadDim / kChunkCols; ++chunk) {
    if (tid_wg == 0) tma::bulk_wait_read();  // the buffer's previous stores have read it
    tma::named_barrier_sync(kOStoreBarrier + wg, 128);
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp * 16 + g + 8 * half;  // row within the warpgroup's 64
      const int sw = kSwizzleBytes == 128 ? r % 8 : (r / 2) % 4;
      #pragma unroll
      for (int dd = 0; dd < kChunkCols / 8; ++dd) {
        const int d = chunk * (kChunkCols / 8) + dd;  // column block 8d ... 8d + 7 of the head dim
        const int col = dd * 8;                       // within the chunk
        const int box = col / kAtomCols, c16 = (col % kAtomCols) / 8;
        const unsigned v = pack2<T>(o[4 * d + 2 * half] * inv[half], o[4 * d + 2 * half + 1] * inv[half]);
        *reinterpret_cast<unsigned*>(stage + box * kBoxBytes + r * kSwizzleBytes + ((c16 ^ sw) * 16) + 4 * t) = v;
      }
    }
    tma::fence_proxy_async();
    tma::named_barrier_sync(kOStoreBarrier + wg, 128);
    if (tid_wg == 0) {
      #pragma unroll
      for (int box = 0; box < kChunkCols / kAtomCols; ++box)
        tma::store_4d(&p.tma_o, stage + box * kBoxBytes, chunk * kChunkCols + box * kAtomCols, seq.q0() + wg_row0, h,
                      seq.b_map());
      tma::bulk_commit();
    }
  }
}

// Before a consumer warpgroup exits: its last TMA stores have read the staging buffer (shared memory stays valid
// until then).
__device__ __forceinline__ void epilogue_drain(int tid_wg) {
  if (tid_wg == 0) tma::bulk_wait_read();
}

// A tile whose rows see no key (bottom-right alignment with L > S, a window past the keys): out 0 and lse -inf (the
// sink's logit with sinks) for its `rows` rows from query row m0 of head h in the sequence seq (sm90/params.cuh's
// SeqSpan), written by `threads` threads (tid = 0 ...
// threads - 1) without loading anything.
template <typename T, bool kVariants, typename Seq>
__device__ __forceinline__ void store_empty_rows(const FlashFwdSm90Params& p, const Seq& seq, int m0, int h, int rows,
                                                 int tid, int threads) {
  const int b = seq.b_map();
  T* out = static_cast<T*>(p.out) + b * p.out_stride_b + h * p.out_stride_h + (seq.q0() + m0) * p.out_stride_l;
  const int Ev = static_cast<int>(p.head_dim_v);
  for (int i = tid; i < rows * Ev; i += threads) out[(i / Ev) * p.out_stride_l + i % Ev] = from_float<T>(0.f);
  if (p.lse) {
    // With sinks a row that sees no key has the sink alone in its denominator: lse = the sink's logit.
    const float empty = kVariants && p.sinks ? sink_log2<T>(p.sinks, p.sinks_kind, h) * kLn2 : neg_inf();
    float* lse = p.lse + b * p.lse_stride_b + h * p.lse_stride_h + seq.q0() * p.lse_stride_l;
    for (int i = tid; i < rows; i += threads) lse[(m0 + i) * p.lse_stride_l] = empty;
  }
}

}  // namespace sm90
}  // namespace cupy_attn
