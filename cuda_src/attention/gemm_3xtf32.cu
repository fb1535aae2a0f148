// Batched fp32 GEMM on TF32 tensor cores at fp32 accuracy: C[b] = alpha · A[b] · op(B[b]), row-major, fp32 in and out.
//
// Algorithm: 3xTF32, CUTLASS's OpMultiplyAddFastF32 (include/cutlass/gemm/warp/mma_tensor_op_fast_f32.h), which is
// what PyTorch's default fp32 attention kernel on sm80+ (memory-efficient attention, from xFormers:
// gemm_kernel_utils.h, DefaultGemmType<Sm80, float>) runs its two GEMMs on. Every fp32 operand x is split once per
// fragment, after its load from shared memory, into two TF32 numbers (11 significant bits each):
//   big   = x rounded to TF32, to nearest, ties away from zero: (bits + 0x1000) & ~0x1fff (cvt.rna.tf32.f32's result
//           for every finite x, without its inf/NaN select)
//   small = (x − big) truncated to TF32: x − big is exact in fp32 and |x − big| ≤ 2^-11·|x|, so |x − big − small| <
//           2^-22·|x|, with either sign: big + small is x to about fp32 rounding, without bias (for |x| ≥ 2^-103;
//           below, small can be subnormal and keeps fewer bits, as in CUTLASS's split)
// and per k-step of 8 one fp32 accumulator takes three mma.sync.m16n8k8 TF32 products, the small ones first:
//   acc += a_small·b_big;  acc += a_big·b_small;  acc += a_big·b_big     (a_small·b_small, ≤ 2^-22·|a·b|, is dropped)
// Two levels: that accumulator starts from zero at every k-tile of 32 and is then added to the result by one fp32 add,
// so the tensor core's 12 roundings per k-tile act on a 32-term partial sum instead of the whole dot product. The
// unit's rounding of its fp32 sum is not documented (Fasi et al. 2021 report round-toward-zero normalization in
// V100/A100 tensor cores): in a NumPy model of attention scores at |s| ~ 100 the two levels give 0.19-0.25× an SGEMM
// chain's output error whether the unit rounds to nearest or truncates, CUTLASS's single accumulator 0.54× or 3.4×.
// On an H200 the single accumulator measured less accurate than SGEMM, as the truncating model predicts
// (bench/notes/kernels_gemm_3xtf32.md). Cost against it: 64 more registers (one CTA per SM, not two).
// Three integer/fp32 ops per element: the tensor core reads only the top 19 bits of a TF32 register, and ptxas, which
// knows it, drops both "& ~0x1fff" where the value only feeds HMMA (the mask on big stays for the subtraction).
// CUTLASS's FastF32 rounds big toward zero and small by adding half an ulp (round_toward_zero, round_half_ulp_truncate;
// the same op count): rounding big to nearest instead halves |x − big| and makes small and the dropped small·small
// term sign-symmetric, where CUTLASS's are biased away from zero (both have the sign of x). cvt.rna.tf32.f32 on small
// too would gain one bit on a 2^-22 term for 3 more ops per element (its SASS adds an inf/NaN test and a select).
// NaN propagates (a NaN x may leave a wrong big, but x − big is NaN). An infinite element gives NaN where it enters
// (small = inf − inf), as in CUTLASS; SGEMM would give ±inf.
// Why not cuBLAS SGEMM (the split path's fp32 GEMM before): SGEMM rounds its fp32 accumulator after every one of the
// k products (one FFMA chain per dot product), the tensor core once per k-step of 8 and product; at |scale·q·k| ~ 100
// SGEMM's scores made our fp32 attention 2.6-4× less accurate than torch's (bench/notes/split.md, issue 14). And why
// not three cuBLAS TF32 GEMMs on a split done outside: measured no more accurate than SGEMM (why is not known:
// cuBLAS's own fp32 -> TF32 conversion, its kernels' accumulation, or three separately rounded results) and
// twice as slow with the split passes.
//
// Shapes (row-major, element strides, batch b < batch): A[b] is m×k (row stride lda, batch stride stride_a), B[b] is
// n×k (kTransB: C = A·Bᵀ, the attention scores Q·Kᵀ) or k×n (C = A·B, the output P·V), C[b] is m×n (ldc, stride_c).
// Any m, n, k ≥ 1: tiles are zero-filled past m, n and k, and C is written only inside m×n.
//
// Thread mapping: a CTA of 8 warps (2 along m × 4 along n) computes one kBlockM × kBlockN tile of one batch; a warp
// owns kBlockM/2 × kBlockN/4 of it as kMTiles × kNTiles mma tiles of 16×8 (128×128: 64×32, 4×4 tiles, 64 fp32
// accumulators per thread). The 1-D grid runs over (batch, m tile, n tile), n fastest, so the CTAs working at once
// share A rows and the whole B of a batch in L2.
//
// Shared memory: kStages × (A tile + B tile), a cp.async ring with one barrier per k-tile of kBlockK = 32 (the copy of
// k-tile kt + kStages − 1 is issued right after the barrier that frees its stage, then k-tile kt is computed).
//   A (and B when kTransB): kBlock rows × 32 fp32, pitch 36: the 8 rows of an ldmatrix phase start 36 words apart,
//     i.e. in bank groups 4·r, all 8 distinct: conflict-free, and the rows stay 16-byte aligned for cp.async.
//   B (k × n): 32 rows × kBlockN fp32, pitch kBlockN + 8. The B fragment wants b0 = B[k = t][n = g] per mma tile, a
//     transposed read that ldmatrix cannot do for 32-bit elements; so the warp's n columns are permuted: lane g of mma
//     tile j stands for column 4g + j of the warp's 32, and one 16-byte load gives b0 of all 4 tiles (row t, columns
//     4g .. 4g+3). Within a quarter-warp (g ∈ {2q, 2q+1}, t = 0..3) those loads sit at 8t + 4g mod 32 words: no
//     conflict. The accumulators come out permuted the same way: lane (g, t) holds row g, columns 8t .. 8t+7 of the
//     warp's 32 (c0 of tiles 0..3, then c1), two 16-byte stores per row.
// Loads: 16-byte cp.async (kAlignA / kAlignB: the operand's rows and base are 16-byte aligned, lda/ldb % 4 == 0),
// zero-filling the bytes past k or n; otherwise 4-byte cp.async (any fp32 layout, 4× the copy instructions).
//
// Tile sizes: gemm_3xtf32.TILE in cupy_attn/attention/gemm_3xtf32.py, 128×128×32 with 4 stages (144 KB; 215-231
// registers, one CTA per SM).
//
// History and measurements: bench/notes/kernels_gemm_3xtf32.md.
#include "common/mma.cuh"

namespace cupy_attn {

// Every field 8 bytes wide, so NumPy's structured dtype in cupy_attn/attention/gemm_3xtf32.py has the same layout.
struct Gemm3xTf32Params {
  float* c;                 // (batch, m, n) through ldc, stride_c
  const float* a;           // (batch, m, k) through lda, stride_a
  const float* b;           // (batch, n, k) [kTransB] or (batch, k, n), through ldb, stride_b
  long long m, n, k, batch;
  long long lda, ldb, ldc;  // row strides, elements
  long long stride_a, stride_b, stride_c;  // batch strides, elements (0: one matrix for every batch)
  long long tiles_m, tiles_n;              // ⌈m / kBlockM⌉, ⌈n / kBlockN⌉
  double alpha;             // an fp32 value (the host rounds it), applied to the fp32 accumulator at the store
};

namespace gemm3x {

constexpr int kThreads = 256;  // 8 warps: 2 along m × 4 along n
constexpr int kBlockK = 32;

// x = big + small + r, |r| < 2^-22·|x|: both TF32 bit patterns (low 13 bits zero) in fp32 registers (see the header;
// ptxas drops the masks where the value goes only to HMMA, which ignores those bits).
__device__ __forceinline__ void split_tf32(unsigned x, unsigned& big, unsigned& small) {
  big = (x + 0x1000u) & 0xffffe000u;
  small = __float_as_uint(__uint_as_float(x) - __uint_as_float(big)) & 0xffffe000u;
}

// One operand's global -> shared copies, per thread: a kRows × kCols fp32 tile (row pitch kPitch floats in shared
// memory) is copied in chunks of 4 consecutive floats, a thread's kChunks chunks in one column on rows kRowStep apart.
// kAligned: one 16-byte cp.async per chunk (rows 16-byte aligned; a chunk that straddles the valid columns copies its
// valid bytes and zero-fills the rest); else four 4-byte cp.async (any fp32 layout). The pointer of the thread's first
// chunk is moved along k by the caller after each k-tile, so a copy costs an add per chunk, and the checks for rows
// and columns past the matrix are made only where a tile crosses its edge (kChecked). A chunk with nothing to read is
// given ``safe`` (the operand's base address: in the matrix, aligned) as its address, with 0 bytes.
template <int kRows, int kCols, int kPitch, bool kAligned>
struct TileCopy {
  static constexpr int kPerRow = kCols / 4;
  static constexpr int kRowStep = kThreads / kPerRow;
  static constexpr int kChunks = kRows / kRowStep;
  static_assert(kThreads % kPerRow == 0 && kRows % kRowStep == 0, "every thread copies the same number of chunks");
  const float* ptr;  // the thread's first chunk in the next k-tile to copy
  long long step;    // kRowStep rows, elements
  unsigned to;       // shared address of the first chunk in stage 0
  int r, c;          // the first chunk's row and column in the tile

  __device__ __forceinline__ TileCopy(const float* tile, float* smem_tile, long long ld) {
    r = threadIdx.x / kPerRow;
    c = (threadIdx.x % kPerRow) * 4;
    ptr = tile + r * ld + c;
    step = kRowStep * ld;
    to = smem_addr(smem_tile + r * kPitch + c);
  }

  // Copy into the stage at byte offset stage_bytes; rows_valid / cols_valid: the tile's rows and columns inside the
  // matrix (read only when kChecked).
  template <bool kChecked>
  __device__ __forceinline__ void copy(unsigned stage_bytes, int rows_valid, int cols_valid, const float* safe) const {
    const int valid = kChecked ? max(0, min(4, cols_valid - c)) : 4;
    const float* from = ptr;
    #pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const unsigned at = to + stage_bytes + i * kRowStep * kPitch * 4;
      const bool row_ok = !kChecked || r + i * kRowStep < rows_valid;
      if constexpr (kAligned) {
        const int bytes = row_ok ? valid * 4 : 0;
        cp_async_16(at, kChecked && bytes == 0 ? safe : from, bytes);
      } else {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool ok = row_ok && e < valid;
          cp_async_4(at + 4 * e, kChecked && !ok ? safe : from + e, ok ? 4 : 0);
        }
      }
      from += step;
    }
  }
};

}  // namespace gemm3x

template <int kBlockM, int kBlockN, int kStages, bool kTransB, bool kAlignA, bool kAlignB>
__global__ void __launch_bounds__(gemm3x::kThreads, 1) gemm_3xtf32(const Gemm3xTf32Params p) {
  using namespace gemm3x;
  constexpr int kWarpM = kBlockM / 2, kWarpN = kBlockN / 4;
  constexpr int kMTiles = kWarpM / 16, kNTiles = kWarpN / 8;
  constexpr int kPitchK = kBlockK + 4;   // rows along k: A, and B when kTransB
  constexpr int kPitchN = kBlockN + 8;   // rows along n: B when !kTransB
  constexpr int kTileA = kBlockM * kPitchK;
  constexpr int kTileB = kTransB ? kBlockN * kPitchK : kBlockK * kPitchN;
  static_assert(kMTiles >= 1 && kNTiles % 2 == 0, "ldmatrix_x4 loads B fragments of two n tiles");
  static_assert(kTransB || kNTiles == 4, "the permuted B (k × n) loads give 4 n tiles per 16-byte load");
  static_assert(kStages >= 2, "a ring of at least two stages");
  extern __shared__ __align__(16) float smem[];
  float* sA = smem;
  float* sB = smem + kStages * kTileA;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm0 = (warp >> 2) * kWarpM, wn0 = (warp & 3) * kWarpN;

  const long long tiles = p.tiles_m * p.tiles_n;
  const long long batch = blockIdx.x / tiles;
  const long long tile = blockIdx.x - batch * tiles;
  const int m0 = static_cast<int>(tile / p.tiles_n) * kBlockM;
  const int n0 = static_cast<int>(tile % p.tiles_n) * kBlockN;
  const int M = static_cast<int>(p.m), N = static_cast<int>(p.n), K = static_cast<int>(p.k);
  const float* a_base = p.a + batch * p.stride_a;
  const float* b_base = p.b + batch * p.stride_b;
  float* c_batch = p.c + batch * p.stride_c;

  TileCopy<kBlockM, kBlockK, kPitchK, kAlignA> copy_a(a_base + m0 * p.lda, sA, p.lda);     // from (m0, 0)
  using CopyB = TileCopy<kTransB ? kBlockN : kBlockK, kTransB ? kBlockK : kBlockN, kTransB ? kPitchK : kPitchN,
                         kAlignB>;
  CopyB copy_b(b_base + (kTransB ? n0 * p.ldb : n0), sB, p.ldb);                          // from (n0, 0) or (0, n0)
  const long long b_advance = kTransB ? kBlockK : kBlockK * p.ldb;
  // The CTA's tile is inside the matrices along m and n: only its last k-tile (when k % 32 ≠ 0) needs checks.
  const bool interior = m0 + kBlockM <= M && n0 + kBlockN <= N;

  // Copy k-tile kt (the next one in order) into stage `stage`, then move both copy pointers on by one k-tile.
  auto load_stage = [&](int stage, int kt) {
    const int k_valid = K - kt * kBlockK;
    const int b_rows = kTransB ? N - n0 : k_valid, b_cols = kTransB ? k_valid : N - n0;
    if (interior && k_valid >= kBlockK) {
      copy_a.template copy<false>(stage * kTileA * 4, 0, 0, a_base);
      copy_b.template copy<false>(stage * kTileB * 4, 0, 0, b_base);
    } else {
      copy_a.template copy<true>(stage * kTileA * 4, M - m0, k_valid, a_base);
      copy_b.template copy<true>(stage * kTileB * 4, b_rows, b_cols, b_base);
    }
    copy_a.ptr += kBlockK;
    copy_b.ptr += b_advance;
  };

  const int k_tiles = (K + kBlockK - 1) / kBlockK;
  #pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();  // empty groups keep the count that cp_async_wait relies on
  }

  // ldmatrix row addresses (bytes, stage 0, k-step 0). A: lanes 0-15 give rows 0-15 at k 0, lanes 16-31 rows 0-15 at
  // k 4: matrices (rows 0-7, k 0-3), (8-15, 0-3), (0-7, 4-7), (8-15, 4-7) = a0, a1, a2, a3. B (kTransB, n × k): lane
  // l gives n row (l & 7) + 8·(l >> 4) at k 4·((l >> 3) & 1): matrices = b0, b1 of n tile 2jj, then of tile 2jj + 1.
  const unsigned a_ld = smem_addr(sA + (wm0 + (lane & 15)) * kPitchK + 4 * (lane >> 4));
  const unsigned b_ld = kTransB ? smem_addr(sB + (wn0 + (lane & 7) + 8 * (lane >> 4)) * kPitchK + 4 * ((lane >> 3) & 1))
                                : 0u;
  const float* b_lds = sB + t * kPitchN + wn0 + 4 * g;  // !kTransB: row t, columns 4g .. 4g+3 of the warp's 32

  // acc: the result; part sums one k-tile (12 tensor-core roundings from zero) and is added to acc by one fp32 add per
  // k-tile.
  float acc[kMTiles][kNTiles][4], part[kMTiles][kNTiles][4];
  auto zero = [](float (&x)[kMTiles][kNTiles][4]) {
    #pragma unroll
    for (int i = 0; i < kMTiles; ++i) {
      #pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) x[i][j][e] = 0.f;
      }
    }
  };
  zero(acc);

  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // k-tile kt landed for every thread's copies; every warp is done with k-tile kt − 1's stage
    if (kt + kStages - 1 < k_tiles) load_stage((kt + kStages - 1) % kStages, kt + kStages - 1);
    cp_async_commit();
    const int stage = kt % kStages;
    zero(part);

    // Not unrolled: unrolled, ptxas hoists the next k-steps' fragment loads and splits (on the removed single-
    // accumulator tile: ~165 registers instead of 128); rolled, the other warps cover the loads' latency.
    #pragma unroll 1
    for (int ks = 0; ks < kBlockK / 8; ++ks) {
      // B fragments of the k-step, split once; then per m tile its A fragment, split, and its 3·kNTiles products
      // (only one A fragment pair is live at a time: the accumulators, + 16 B and 8 A split registers).
      unsigned b_big[kNTiles][2], b_small[kNTiles][2];
      if constexpr (kTransB) {
        #pragma unroll
        for (int jj = 0; jj < kNTiles / 2; ++jj) {
          unsigned r[4];
          ldmatrix_x4(r, b_ld + (stage * kTileB + jj * 16 * kPitchK + ks * 8) * 4);
          #pragma unroll
          for (int e = 0; e < 4; ++e) split_tf32(r[e], b_big[2 * jj + e / 2][e % 2], b_small[2 * jj + e / 2][e % 2]);
        }
      } else {
        const float* row = b_lds + stage * kTileB + ks * 8 * kPitchN;
        const float4 lo = *reinterpret_cast<const float4*>(row);                // k row t:     b0 of tiles 0..3
        const float4 hi = *reinterpret_cast<const float4*>(row + 4 * kPitchN);  // k row t + 4: b1 of tiles 0..3
        const float b0[4] = {lo.x, lo.y, lo.z, lo.w}, b1[4] = {hi.x, hi.y, hi.z, hi.w};
        #pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
          split_tf32(__float_as_uint(b0[j]), b_big[j][0], b_small[j][0]);
          split_tf32(__float_as_uint(b1[j]), b_big[j][1], b_small[j][1]);
        }
      }
      #pragma unroll
      for (int i = 0; i < kMTiles; ++i) {
        unsigned r[4], a_big[4], a_small[4];
        ldmatrix_x4(r, a_ld + (stage * kTileA + i * 16 * kPitchK + ks * 8) * 4);
        #pragma unroll
        for (int e = 0; e < 4; ++e) split_tf32(r[e], a_big[e], a_small[e]);
        // CUTLASS FastF32's order into one accumulator: small·big, big·small, then big·big.
        #pragma unroll
        for (int j = 0; j < kNTiles; ++j) mma_1688_tf32(part[i][j], a_small, b_big[j][0], b_big[j][1]);
        #pragma unroll
        for (int j = 0; j < kNTiles; ++j) mma_1688_tf32(part[i][j], a_big, b_small[j][0], b_small[j][1]);
        #pragma unroll
        for (int j = 0; j < kNTiles; ++j) mma_1688_tf32(part[i][j], a_big, b_big[j][0], b_big[j][1]);
      }
    }
    #pragma unroll
    for (int i = 0; i < kMTiles; ++i) {
      #pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] += part[i][j][e];
      }
    }
  }
  cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits (only empty groups remain)

  // Epilogue: C = alpha · acc, rows ≥ m and columns ≥ n skipped. Vector stores where C's rows allow them.
  const float alpha = static_cast<float>(p.alpha);
  const unsigned long long c_bits = reinterpret_cast<unsigned long long>(c_batch) | static_cast<unsigned long long>(
      p.ldc * 4);
  #pragma unroll
  for (int i = 0; i < kMTiles; ++i) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + wm0 + i * 16 + h * 8 + g;
      if (row >= M) continue;
      float* c_row = c_batch + row * p.ldc;
      if constexpr (kTransB) {  // lane (g, t): columns 8j + 2t, 8j + 2t + 1 of the warp's
        #pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
          const int col = n0 + wn0 + j * 8 + 2 * t;
          const float v0 = alpha * acc[i][j][2 * h], v1 = alpha * acc[i][j][2 * h + 1];
          if ((c_bits & 7) == 0 && col + 2 <= N) {
            *reinterpret_cast<float2*>(c_row + col) = make_float2(v0, v1);
          } else {
            if (col < N) c_row[col] = v0;
            if (col + 1 < N) c_row[col + 1] = v1;
          }
        }
      } else {  // lane (g, t): columns 8t .. 8t+7 of the warp's (c0 of tiles 0..3, then c1), see the header
        const int col = n0 + wn0 + 8 * t;
        float v[8];
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
          v[j] = alpha * acc[i][j][2 * h];
          v[4 + j] = alpha * acc[i][j][2 * h + 1];
        }
        if ((c_bits & 15) == 0 && col + 8 <= N) {
          *reinterpret_cast<float4*>(c_row + col) = make_float4(v[0], v[1], v[2], v[3]);
          *reinterpret_cast<float4*>(c_row + col + 4) = make_float4(v[4], v[5], v[6], v[7]);
        } else {
          #pragma unroll
          for (int e = 0; e < 8; ++e) {
            if (col + e < N) c_row[col + e] = v[e];
          }
        }
      }
    }
  }
}

}  // namespace cupy_attn
