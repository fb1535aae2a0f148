// Fused attention forward: out = softmax(scale · Q Kᵀ + mask) V, and lse = log Σ_j exp(scale · q·k_j + mask_j).
//
// Algorithm: FlashAttention-2 forward (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and
// Work Partitioning", Algorithm 1). One block owns kBlockM query rows of one (batch, head) and streams key/value tiles
// of kBlockN rows through shared memory; the L×S score matrix never leaves registers. Per key tile:
//   S   = Q Kᵀ                        mma.sync m16n8k16, fp32 accumulate, A = Q and B = K fed by ldmatrix
//   S   = S · scale·log2(e) (+ mask·log2(e), -inf where masked)   base 2 from here on: exp2 is one MUFU op
//   m'  = max(m, rowmax S);  α = 2^(m − m');  P = 2^(S − m');  l = α·l + rowsum P;  O = α·O + P V
// and at the end out = O / l, lse = (m + log2 l)·ln 2. The running max m and sum l are fp32 registers; the P tile
// goes from the S accumulator registers straight into A fragments (the m16n8k16 C layout of two adjacent 8-column
// tiles is the A layout of one 16-column k step), V is read as B with ldmatrix.trans. An empty row (every key masked)
// keeps m = -inf; it is replaced by 0 inside the exponentials, so P = 0, l = 0, and the epilogue writes out = 0 and
// lse = -inf instead of NaN.
// Dropout (kDropout, mma.sync only): P ∘ Z enters O += P V while l sums the undropped P, and the epilogue multiplies
// by 1/(1 − p): out = (P ∘ Z / (1 − p)) V with P the softmax, lse unchanged. Z is the keep mask of common/philox.cuh
// (dropout_keep_word: one Philox block per 2×2 tile, shared with the lane four apart by one shuffle).
//
// Thread mapping: kNWarps warps; warp w owns query rows [w·16·kMTiles, (w+1)·16·kMTiles) of the block as kMTiles
// 16-row mma tiles and computes all kBlockN columns of S and all kHeadDim columns of O for them, so the softmax row
// statistics need only a 4-lane (quad) shuffle and no shared memory. Lane 4g+t holds rows g and g+8 of each tile.
//
// Shared memory: Q (kBlockM rows), kStages × (K and V, kBlockN rows each), row pitch kHeadDim + 8 elements. The 16-byte pad makes
// the pitch an odd number of 16-byte units for every head dim here (all multiples of 16), so the 8 row addresses of
// an ldmatrix phase fall in 8 distinct bank groups: conflict-free without an XOR swizzle, which would need power-of-two
// rows (head dims 96 and 160 are not).
//
// Pipeline (cp.async), kStages from the tile table. kStages = 2 (Hopper): two K and two V buffers; at the top of
// iteration j the copies of tile j-1 are issued into the other buffers, while only O is live in registers, and have a
// whole iteration to land; one barrier per iteration. kStages = 1 (sm_8x, whose 99 KB cannot hold two stages at
// large head dims): FlashAttention-2's interleave, V[j] in flight during S = Q K[j]ᵀ and K[j-1] during O += P V[j].
// Key tiles are visited from the last to the first, so the tiles that need element masks (the partial tile at S
// and, under a causal mask, the diagonal) come first; the others keep raw scores and fold scale·log2(e) into the
// exponent's FFMA. A bool mask shared by every query row (key padding, row stride 0) is pre-scanned so that trailing
// key tiles it hides are never visited.
//
// Head dims: Q and K are zero-padded in shared memory from E to kHeadDim columns, V from Ev (cp.async zero-fill; the
// inputs are never copied), so any E, Ev ≤ kHeadDim is exact. Rows past L or S are zero-filled too.
// Layouts: any element strides for batch, head and row (int64); the last dimension must be contiguous. 16-byte
// cp.async needs 16-byte aligned rows; otherwise (odd strides, tiny E) the same tile is loaded by plain loads.
//
// Hopper (kWgmma, compiled for sm_90a): the same loop with warpgroup MMAs. Each warpgroup of 4 warps owns 64 query
// rows; S = Q Kᵀ is wgmma.m64n{kBlockN}k16 with Q and K read from shared memory by descriptor, O += P V is
// wgmma.m64n{kHeadDim}k16 with P from registers (the accumulator layout of S is, per warp, the mma.sync one, so the
// softmax and P packing above are shared) and V read MN-major. Tiles are stored in 128-byte-swizzled atoms
// (load_tile's kSwizzle128) instead of padded rows; cp.async writes are made visible to the tensor cores' async proxy
// by fence.proxy.async before the barrier. With two warpgroups the S GEMMs are issued in turn (named barriers), so one
// warpgroup's softmax overlaps the other's GEMM (FlashAttention-3's ping-pong, Shah et al. 2024, without its
// producer warp, TMA or intra-warpgroup overlap). Head-dim buckets that are multiples of 64 only.
//
// Tile sizes: TILES and WGMMA_TILES in cupy_attn/attention/fused.py, one entry per (dtype, head dim, arch) with the limit behind it
// (registers: kMTiles·(kBlockN/2 + kHeadDim/2) fp32 accumulators per thread must stay under 255 without spills;
// shared memory: (kBlockM + 2·kStages·kBlockN)·(kHeadDim + 8)·2 bytes, two CTAs per SM where it fits).
//
// History and measurements: bench/notes/kernels_flash_fwd.md.
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/wgmma.cuh"
#include "common/tile.cuh"
#include "common/mask.cuh"
#include "common/visibility.cuh"
#include "common/philox.cuh"

namespace cupy_attn {

// Every field 8 bytes wide, so NumPy's structured dtype in cupy_attn/attention/fused.py has the same layout.
struct FlashFwdParams {
  void* out;                // (B, Hq, L, Ev)
  float* lse;               // (B, Hq, L) fp32 natural log, or nullptr
  const void* q;            // (B, Hq, L, E)
  const void* k;            // (B, Hkv, S, E)
  const void* v;            // (B, Hkv, S, Ev)
  const void* mask;         // element (b, h, i, j) of the broadcast mask, or nullptr
  long long seqlen_q, seqlen_k, head_dim, head_dim_v;
  long long groups;         // Hq / Hkv: query head h reads key/value head h / groups
  long long is_causal;      // 1: key j is visible to query i iff j <= i + causal_offset
  long long causal_offset;  // 0 (top-left, torch's is_causal) or S - L (bottom-right)
  long long mask_kind;      // 1 bool (True = attend), 2 fp16, 3 bf16, 4 fp32 (added to the scaled scores)
  long long vec_flags;      // bit 0/1/2: q/k/v rows 16-byte aligned (cp.async); bit 3: out pairs 4-byte aligned
  double scale_log2;        // scale · log2(e)
  long long q_stride_b, q_stride_h, q_stride_l;
  long long k_stride_b, k_stride_h, k_stride_s;
  long long v_stride_b, v_stride_h, v_stride_s;
  long long out_stride_b, out_stride_h, out_stride_l;
  long long lse_stride_b, lse_stride_h, lse_stride_l;
  long long mask_stride_b, mask_stride_h, mask_stride_l, mask_stride_s;
  const long long* rng;          // kDropout: the call's int64 {seed, offset} (common/philox.cuh), else unused
  long long dropout_threshold;   // keep when the Philox draw is below it
  double dropout_scale;          // 1/(1 − p), 0 for p = 1
};

namespace flash {

// s (log2 units) += mask at this thread's accumulator positions; rows >= L are left alone (never stored).
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void add_mask(float (&s)[kMTiles][kNTiles][4], const FlashFwdParams& p,
                                         const unsigned char* mask, int elem_bytes, int row0, int col0) {
  const int kind = static_cast<int>(p.mask_kind);
  const long long stride_s = p.mask_stride_s * elem_bytes;
  #pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + mi * 16 + half * 8;
      if (row >= p.seqlen_q) continue;
      // One running pointer (a 64-bit offset per column would hold 2·kNTiles·2 registers next to the accumulators).
      const unsigned char* m = mask + row * p.mask_stride_l * elem_bytes + col0 * stride_s;
      #pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (col0 + ni * 8 + e < p.seqlen_k) s[mi][ni][2 * half + e] += mask_value(m, kind);
          m += e == 0 ? stride_s : 7 * stride_s;
        }
      }
    }
  }
}

// Bool masks as bits, loaded at the top of an iteration so that their latency hides behind S = Q Kᵀ: bit 2·ni + e
// of bits[mi][half] is mask[row][col0 + 8·ni + e] (0 past L or S). 2·kNTiles <= 32 bits per row: one register
// per row instead of kNTiles·2 floats. A key-padding mask (row stride 0) is read once and shared by the rows.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void load_mask_bits(unsigned (&bits)[kMTiles][2], const FlashFwdParams& p,
                                               const unsigned char* mask, int row0, int col0) {
  static_assert(kNTiles * 2 <= 32, "one 32-bit word per row");
  const long long stride_s = p.mask_stride_s;
  auto row_bits = [&](int row) {
    const unsigned char* m = mask + row * p.mask_stride_l + col0 * stride_s;
    unsigned r = 0;
    #pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni) {
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (col0 + ni * 8 + e < p.seqlen_k && *m) r |= 1u << (2 * ni + e);
        m += e == 0 ? stride_s : 7 * stride_s;
      }
    }
    return r;
  };
  const unsigned shared_row = p.mask_stride_l == 0 ? row_bits(0) : 0u;
  #pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + mi * 16 + half * 8;
      bits[mi][half] = row >= p.seqlen_q ? 0u : p.mask_stride_l == 0 ? shared_row : row_bits(row);
    }
  }
}

// blockIdx.y / blockIdx.z read afresh at each call (volatile, so the compiler cannot reuse an earlier read): a
// pointer derived from them is then recomputed where it is used instead of being held in registers across the loop.
__device__ __forceinline__ int fresh_block_idx_y() {
  int r;
  asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(r));
  return r;
}
// Named barriers 1..15 (0 is __syncthreads): arrive does not wait; sync waits until `threads` have arrived or synced.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ int fresh_block_idx_z() {
  int r;
  asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(r));
  return r;
}

// Dropout keep bits of this lane's row `row` in key tile n0: bit 2·ni + e for column n0 + 8·ni + 2t + e, the S
// accumulator layout. One Philox block covers rows (row, row ^ 1) × a column pair (common/philox.cuh); the lane four
// apart (g ^ 1, same t) holds row ^ 1. Each lane of the pair draws the block of every other column tile (even g:
// tiles 2k, odd g: 2k + 1), keeps its row's two bits and sends the other row's two across (one shuffle per block), so
// every Philox output is used once. All lanes take part (rows past L included: their bits are never used).
// The rng pair and bh are re-read per call, not held across the key loop (registers; the loads hit L1/constant cache).
template <int kNTiles>
__device__ __forceinline__ unsigned dropout_keep_word(const FlashFwdParams& p, int row, int n0, int g, int t) {
  static_assert(kNTiles % 2 == 0, "column tiles come in pairs");
  const Dropout drop = Dropout::load(p.rng, p.dropout_threshold);
  const unsigned bh = static_cast<unsigned>(fresh_block_idx_z()) * gridDim.y +
                      static_cast<unsigned>(fresh_block_idx_y());
  const unsigned odd = g & 1;
  unsigned keep = 0;
  #pragma unroll
  for (int k = 0; k < kNTiles / 2; ++k) {
    const int ni = 2 * k + static_cast<int>(odd);
    const unsigned bits = drop.keep_bits(bh, static_cast<unsigned>(row) >> 1,
                                         static_cast<unsigned>(n0 + ni * 8 + 2 * t) >> 1);
    const unsigned mine = (bits >> (2 * odd)) & 3u, theirs = (bits >> (2 - 2 * odd)) & 3u;
    const unsigned got = __shfl_xor_sync(0xffffffffu, theirs, 4);
    keep |= mine << (2 * ni) | got << (2 * (ni ^ 1));
  }
  return keep;
}

// A bool mask shared by all query rows (row stride 0: key padding) hides trailing keys from the whole block: the
// last key it shows becomes last_key (those tiles are never loaded). When it also shows every key before that one
// (the usual padding mask: a prefix of each sequence), it equals a shorter S for this block (S = last_key + 1,
// mask_on = false), and the per-tile mask loads and tests are skipped. All kThreads threads take part; smem_raw (Q's
// space, before Q is loaded) holds the two reductions.
template <int kThreads>
__device__ __forceinline__ void key_padding_prefix(const FlashFwdParams& p, unsigned char* smem_raw, int b, int h,
                                                   long long& last_key, bool& mask_on, int& S) {
  int* last_shown = reinterpret_cast<int*>(smem_raw);  // Q's space, before Q is loaded
  int* first_hidden = last_shown + 1;
  if (threadIdx.x == 0) {
    *last_shown = -1;
    *first_hidden = 0x7fffffff;
  }
  __syncthreads();
  const unsigned char* mrow = static_cast<const unsigned char*>(p.mask) + b * p.mask_stride_b + h * p.mask_stride_h;
  int shown = -1, hidden = 0x7fffffff;
  for (int j = threadIdx.x; j <= last_key; j += kThreads) {
    if (mrow[j * p.mask_stride_s]) shown = j;
    else hidden = min(hidden, j);
  }
  if (shown >= 0) atomicMax(last_shown, shown);
  if (hidden != 0x7fffffff) atomicMin(first_hidden, hidden);
  __syncthreads();
  last_key = *last_shown;
  if (*first_hidden > last_key) {
    mask_on = false;
    S = static_cast<int>(last_key) + 1;
  }
  __syncthreads();  // everyone has read them before Q's copy overwrites them
}

// A tile that needs element masks (the partial tile at S, the causal diagonal, any attn_mask): its scores scaled by
// scale·log2(e) here and the hidden ones set to -inf: keys past each row's last visible key (common/visibility.cuh;
// only where limit_keys: the tile reaches past S or the diagonal), then the attn_mask (bool bits mbits, or additive
// values read from mask). row0: this lane's first row (g of its first 16-row tile); t: its column pair.
template <int kMTiles, int kNTiles, int kBlockN, bool HasMask>
__device__ __forceinline__ void scale_and_mask(float (&s)[kMTiles][kNTiles][4], const FlashFwdParams& p,
                                               float scale_log2, int S, int n0, int row0, int t, bool limit_keys,
                                               bool mask_on, const unsigned (&mbits)[kMTiles][2],
                                               const unsigned char* mask, int mask_bytes) {
  #pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
    #pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
      #pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][ni][e] *= scale_log2;
  if (limit_keys) {
    #pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        // Column ni·8 + e of this lane (key n0 + 8·ni + 2t + e) is visible iff ni·8 + e <= lim (the clamped-int form).
        const int lim = BasicVisibility<int>{S, p.causal_offset, p.is_causal != 0}.lane_limit<kBlockN>(
            row0 + mi * 16 + half * 8, n0, 2 * t);
        #pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni)
          #pragma unroll
          for (int e = 0; e < 2; ++e)
            if (ni * 8 + e > lim) s[mi][ni][2 * half + e] = neg_inf();
      }
    }
  }
  if constexpr (HasMask) {
    if (mask_on && p.mask_kind == 1) {  // (mask_on is false for a prefix key-padding mask: applied as S)
      #pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
        #pragma unroll
        for (int half = 0; half < 2; ++half)
          #pragma unroll
          for (int ni = 0; ni < kNTiles; ++ni)
            #pragma unroll
            for (int e = 0; e < 2; ++e)
              if (!((mbits[mi][half] >> (2 * ni + e)) & 1u)) s[mi][ni][2 * half + e] = neg_inf();
    } else if (mask_on) {
      add_mask(s, p, mask, mask_bytes, row0, n0 + 2 * t);
    }
  }
}

// The online softmax of one key tile (FlashAttention-2, base 2): per row half, m' = max(m, rowmax S·sc), P =
// 2^(S·sc − m') (P ∘ Z with dropout; l sums the undropped P), l = 2^(m − m')·l + rowsum P, O = 2^(m − m')·O; P goes
// to A fragments (pa) as it is produced. sc: scale·log2(e) for raw scores, 1 for a tile scale_and_mask scaled already.
// row0: this lane's first row.
template <typename T, int kMTiles, int kNTiles, int kDTiles, bool kDropout>
__device__ __forceinline__ void online_softmax(float (&s)[kMTiles][kNTiles][4], unsigned (&pa)[kMTiles][kNTiles / 2][4],
                                               float (&acc_o)[kMTiles][kDTiles][4], float (&m_i)[kMTiles][2],
                                               float (&l_i)[kMTiles][2], float sc, const FlashFwdParams& p, int row0,
                                               int n0, int g, int t) {
  constexpr int kBlockN = kNTiles * 8;
  #pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = neg_inf();
      #pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni) mx = fmaxf(mx, fmaxf(s[mi][ni][2 * half], s[mi][ni][2 * half + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_old = m_i[mi][half];
      const float m_new = fmaxf(m_old, mx * sc);
      const float m_use = m_new == neg_inf() ? 0.f : m_new;  // empty so far: 2^(-inf - 0) = 0 keeps P and α at 0
      m_i[mi][half] = m_new;
      const unsigned keep = kDropout ? dropout_keep_word<kNTiles>(p, row0 + mi * 16 + half * 8, n0, g, t)
                                     : 0u;
      float sum = 0.f;
      #pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[mi][ni][2 * half + e] = exp2_approx(fmaf(s[mi][ni][2 * half + e], sc, -m_use));
          sum += s[mi][ni][2 * half + e];  // l is the undropped row sum: dropout acts on the normalized P
          if constexpr (kDropout) {
            if (!((keep >> (2 * ni + e)) & 1u)) s[mi][ni][2 * half + e] = 0.f;
          }
        }
      }
      // This half's P goes to 16 bits at once (A layout: registers 0/2 hold row g, 1/3 row g+8), so its fp32
      // scores are dead before the other half is exponentiated.
      #pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        pa[mi][kk][half] = pack2<T>(s[mi][2 * kk][2 * half], s[mi][2 * kk][2 * half + 1]);
        pa[mi][kk][2 + half] = pack2<T>(s[mi][2 * kk + 1][2 * half], s[mi][2 * kk + 1][2 * half + 1]);
      }
      const float alpha = exp2_approx(m_old - m_use);
      l_i[mi][half] = l_i[mi][half] * alpha + sum;
      // Once the running max settles it rarely moves: skip the O rescale when no row of the warp's tile changed.
      if (__any_sync(0xffffffffu, m_new != m_old)) {
        #pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          acc_o[mi][dt][2 * half] *= alpha;
          acc_o[mi][dt][2 * half + 1] *= alpha;
        }
      }
    }
  }
}

// O (64 × kHeadDim) += P V by wgmma (kWgmma): P from registers (already in the A-fragment layout), V as an MN-major B
// operand (transpose-B): its 64-column blocks are kBlockN·128 bytes apart (LBO), 8-row (k) groups 1024 bytes (SBO).
template <typename T, int kHeadDim, int kBlockN>
__device__ __forceinline__ void pv_wgmma(float (&acc_o)[1][kHeadDim / 8][4], const unsigned (&pa)[kBlockN / 16][4],
                                         const T* sV, int stage) {
  constexpr int kDTiles = kHeadDim / 8;
  constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  const unsigned v_st = smem_addr(sV) + stage * kKVBytes;
  wgmma::fence();
  #pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk)
    wgmma::Mma<T, kHeadDim>::rs(reinterpret_cast<float(&)[kDTiles * 4]>(acc_o[0]), pa[kk],
                                wgmma::desc_sw128(v_st + kk * 16 * 128, kBlockN * 128, 1024), 1);
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::fence_operands(reinterpret_cast<float(&)[kDTiles * 4]>(acc_o[0]));
}

// O += P V by mma.sync: P from registers (pa), V by ldmatrix.trans ([k][n] storage); v_stage is this lane's V address
// in the stage.
template <typename T, int kHeadDim, int kBlockN, int kMTiles, int kPitch>
__device__ __forceinline__ void pv_mma(float (&acc_o)[kMTiles][kHeadDim / 8][4],
                                       const unsigned (&pa)[kMTiles][kBlockN / 16][4], unsigned v_stage) {
  #pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    #pragma unroll
    for (int dn = 0; dn < kHeadDim / 16; ++dn) {
      unsigned bv[4];
      ldmatrix_x4_trans(bv, v_stage + (kk * 16 * kPitch + dn * 16) * 2);
      #pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        mma_16816<T>(acc_o[mi][2 * dn], pa[mi][kk], bv[0], bv[1]);
        mma_16816<T>(acc_o[mi][2 * dn + 1], pa[mi][kk], bv[2], bv[3]);
      }
    }
  }
}

}  // namespace flash

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, bool HasMask, bool kWgmma,
          bool kDropout>
__global__ void __launch_bounds__(kNWarps * 32) flash_fwd(const FlashFwdParams p) {
  using namespace flash;
  constexpr int kThreads = kNWarps * 32;
  constexpr int kMTiles = kBlockM / (16 * kNWarps);  // 16-row mma tiles per warp
  constexpr int kNTiles = kBlockN / 8;               // 8-column tiles of S per row tile
  constexpr int kDTiles = kHeadDim / 8;              // 8-column tiles of O per row tile
  // Shared-memory row pitch in elements: padded for ldmatrix (see header), packed in 128-byte swizzle atoms for wgmma.
  constexpr int kPitch = kWgmma ? kHeadDim : kHeadDim + 8;
  constexpr int kKVBytes = kBlockN * kPitch * 2;     // one K or V stage
  static_assert(kMTiles >= 1 && kBlockM == kMTiles * 16 * kNWarps, "warps split kBlockM into 16-row tiles");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "mma k steps are 16 wide");
  static_assert(kStages == 1 || kStages == 2, "single-buffered (interleaved) or double-buffered K/V");
  // wgmma: each warpgroup (4 warps) owns 64 query rows, one m64 instruction; K/V double-buffered.
  static_assert(!kWgmma || (kMTiles == 1 && kNWarps % 4 == 0 && kStages == 2), "wgmma: 16 rows per warp, 2 stages");
  static_assert(!(kDropout && kWgmma), "dropout runs the mma.sync kernel");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // wgmma's swizzle atoms need 1024-byte alignment; the launcher adds 1 KB of slack (Tile.smem_bytes).
  unsigned char* smem = kWgmma ? smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024) : smem_raw;
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kBlockM * kPitch;           // kStages K tiles
  T* sV = sK + kStages * kBlockN * kPitch;  // kStages V tiles

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  // Causal blocks differ in work (the last query rows see the most keys): launch the longest first.
  const int m_block = p.is_causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;  // query head h reads key/value head h / groups
  const int L = static_cast<int>(p.seqlen_q);
  int S = static_cast<int>(p.seqlen_k);  // lowered below when a key-padding mask is a prefix
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.head_dim_v);
  const int m0 = m_block * kBlockM;
  const int rows_valid = min(kBlockM, L - m0);
  const int warp_row0 = warp * kMTiles * 16;

  T* out = static_cast<T*>(p.out) + b * p.out_stride_b + h * p.out_stride_h;
  float* lse = p.lse ? p.lse + b * p.lse_stride_b + h * p.lse_stride_h : nullptr;

  // Last key any row of this block may see; a block whose rows see nothing (bottom-right alignment with L > S,
  // an all-False key-padding mask) writes the empty-row result directly.
  long long last_key = BasicVisibility<int>{S, p.causal_offset, p.is_causal != 0}.last_key(m0 + rows_valid - 1);
  bool mask_on = HasMask;  // false once a key-padding mask turns out to be a prefix (below)
  if constexpr (HasMask) {  // a key-padding mask: its trailing hidden keys end the block's keys (key_padding_prefix)
    if (p.mask_kind == 1 && p.mask_stride_l == 0 && last_key >= 0)
      key_padding_prefix<kThreads>(p, smem_raw, b, h, last_key, mask_on, S);
  }
  if (last_key < 0) {
    for (int i = threadIdx.x; i < rows_valid * Ev; i += kThreads)
      out[(m0 + i / Ev) * p.out_stride_l + i % Ev] = from_float<T>(0.f);
    if (lse)
      for (int i = threadIdx.x; i < rows_valid; i += kThreads) lse[(m0 + i) * p.lse_stride_l] = neg_inf();
    return;
  }
  const int n_blocks = static_cast<int>(last_key / kBlockN) + 1;

  const T* q = static_cast<const T*>(p.q) + b * p.q_stride_b + h * p.q_stride_h + m0 * p.q_stride_l;
  const bool vec_q = p.vec_flags & 1, vec_k = p.vec_flags & 2, vec_v = p.vec_flags & 4, vec_out = p.vec_flags & 8;
  // The (batch, kv head) base of K or V. Masked kernels, which also hold the mask's pointer and strides across the
  // loop, recompute it from a fresh block index at each load (holding it spilled at D=32 and 96); unmasked kernels
  // hold it (recomputing it was slower: bench/notes/kernels_flash_fwd.md).
  auto kv_base = [&](const void* base, long long stride_b, long long stride_h) {
    int bz = b, hy = h;
    if constexpr (HasMask) {
      bz = fresh_block_idx_z();
      hy = fresh_block_idx_y();
    }
    return static_cast<const T*>(base) + bz * stride_b + (hy / static_cast<int>(p.groups)) * stride_h;
  };
  auto load_k = [&](int nb, int stage) {
    const int n0 = nb * kBlockN;
    load_tile<kBlockN, kHeadDim, kThreads, kWgmma>(sK + stage * kBlockN * kPitch,
                                           kv_base(p.k, p.k_stride_b, p.k_stride_h) + n0 * p.k_stride_s,
                                           p.k_stride_s, S - n0, E, vec_k);
  };
  auto load_v = [&](int nb, int stage) {
    const int n0 = nb * kBlockN;
    load_tile<kBlockN, kHeadDim, kThreads, kWgmma>(sV + stage * kBlockN * kPitch,
                                           kv_base(p.v, p.v_stride_b, p.v_stride_h) + n0 * p.v_stride_s,
                                           p.v_stride_s, S - n0, Ev, vec_v);
  };

  load_tile<kBlockM, kHeadDim, kThreads, kWgmma>(sQ, q, p.q_stride_l, rows_valid, E, vec_q);
  load_k(n_blocks - 1, 0);
  if constexpr (kStages == 2) load_v(n_blocks - 1, 0);
  cp_async_commit();

  // Per-lane ldmatrix addresses (see common/mma.cuh for the lane -> matrix-row mapping).
  const unsigned q_addr = smem_addr(sQ + (warp_row0 + lane % 16) * kPitch + (lane / 16) * 8);
  const unsigned k_addr = smem_addr(sK + ((lane / 16) * 8 + lane % 8) * kPitch + ((lane / 8) % 2) * 8);
  const unsigned v_addr = smem_addr(sV + (((lane / 8) % 2) * 8 + lane % 8) * kPitch + (lane / 16) * 8);

  const float scale_log2 = static_cast<float>(p.scale_log2);
  const unsigned char* mask = nullptr;
  int mask_bytes = 0;
  if constexpr (HasMask) {
    mask_bytes = p.mask_kind == 1 ? 1 : p.mask_kind == 4 ? 4 : 2;
    mask = static_cast<const unsigned char*>(p.mask) + (b * p.mask_stride_b + h * p.mask_stride_h) * mask_bytes;
  }

  float acc_o[kMTiles][kDTiles][4];
  float m_i[kMTiles][2], l_i[kMTiles][2];  // running max (log2 units) and this lane's partial row sum
  #pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    #pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mi][dt][e] = 0.f;
    m_i[mi][0] = m_i[mi][1] = neg_inf();
    l_i[mi][0] = l_i[mi][1] = 0.f;
  }

  for (int nb = n_blocks - 1; nb >= 0; --nb) {
    const int n0 = nb * kBlockN;
    const int stage = kStages == 2 ? (n_blocks - 1 - nb) & 1 : 0;
    cp_async_wait<0>();
    // cp.async and plain stores write through the generic proxy, wgmma reads through the async proxy: each writer
    // fences before the barrier (PTX ISA, "Proxies").
    if constexpr (kWgmma) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // K[nb] (and V[nb] when double-buffered) landed; every warp is done with tile nb+1
    if constexpr (kStages == 2) {
      // Tile nb-1 goes into the other stage now, with only O live in registers: it has a whole iteration to land.
      if (nb > 0) {
        load_k(nb - 1, stage ^ 1);
        load_v(nb - 1, stage ^ 1);
      }
    } else {
      load_v(nb, 0);
    }
    cp_async_commit();

    unsigned mbits[kMTiles][2];
    if constexpr (HasMask) {
      if (mask_on && p.mask_kind == 1) {
        load_mask_bits<kMTiles, kNTiles>(mbits, p, mask, m0 + warp_row0 + g, n0 + 2 * t);
      }
    }

    float s[kMTiles][kNTiles][4];
    #pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
      #pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni)
        #pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][ni][e] = 0.f;

    if constexpr (kWgmma) {
      // S (64 rows of this warpgroup × kBlockN) = Q Kᵀ: kHeadDim/16 wgmma k steps, both operands K-major in shared
      // memory. A k step of 16 elements is 32 bytes inside a 128-byte swizzle row (the hardware applies the XOR to
      // the computed address), every 4 steps the next 64-column block; 8-row groups are 1024 bytes apart (SBO).
      const unsigned q_wg = smem_addr(sQ) + (warp / 4) * 64 * 128;
      const unsigned k_st = smem_addr(sK) + stage * kKVBytes;
      // Warpgroups issue their S GEMMs in turn (named barrier wg: warpgroup wg-1 arrives once it has issued), so
      // the tensor cores finish them one after the other and warpgroup 0's softmax runs while warpgroup 1's GEMM
      // does (FlashAttention-3's ping-pong schedule, within one iteration here: the block barrier above realigns).
      constexpr int kWarpGroups = kNWarps / 4;
      const int wg = warp / 4;
      if (kWarpGroups > 1 && wg > 0) named_barrier_sync(wg, 256);
      wgmma::fence();
      #pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        const unsigned a = q_wg + (kk / 4) * kBlockM * 128 + (kk % 4) * 32;
        const unsigned bk = k_st + (kk / 4) * kBlockN * 128 + (kk % 4) * 32;
        wgmma::Mma<T, kBlockN>::ss(reinterpret_cast<float(&)[kNTiles * 4]>(s[0]), wgmma::desc_sw128(a, 16, 1024),
                                   wgmma::desc_sw128(bk, 16, 1024), kk > 0);
      }
      wgmma::commit();
      if (kWarpGroups > 1 && wg + 1 < kWarpGroups) named_barrier_arrive(wg + 1, 256);
      wgmma::wait<0>();
      wgmma::fence_operands(reinterpret_cast<float(&)[kNTiles * 4]>(s[0]));
    } else {
      const unsigned k_stage = k_addr + stage * kKVBytes;
      #pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        unsigned a[kMTiles][4];
        #pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) ldmatrix_x4(a[mi], q_addr + (mi * 16 * kPitch + kk * 16) * 2);
        #pragma unroll
        for (int nj = 0; nj < kBlockN / 16; ++nj) {
          unsigned bk[4];
          ldmatrix_x4(bk, k_stage + (nj * 16 * kPitch + kk * 16) * 2);
          #pragma unroll
          for (int mi = 0; mi < kMTiles; ++mi) {
            mma_16816<T>(s[mi][2 * nj], a[mi], bk[0], bk[1]);
            mma_16816<T>(s[mi][2 * nj + 1], a[mi], bk[2], bk[3]);
          }
        }
      }
    }

    // Tiles that need element masks (the partial tile at S, the causal diagonal, any attn_mask) are scaled here and
    // masked with -inf; the others keep raw scores and fold the scale into the exponent's FFMA (sc below), which
    // needs scale > 0 so that the raw row max is the scaled one.
    const bool crosses_diagonal =
        p.is_causal && n0 + kBlockN - 1 > BasicVisibility<int>{S, p.causal_offset, true}.causal_limit(m0);
    const bool masked = mask_on || n0 + kBlockN > S || crosses_diagonal || !(scale_log2 > 0.f);
    const float sc = masked ? 1.f : scale_log2;
    if (masked)
      scale_and_mask<kMTiles, kNTiles, kBlockN, HasMask>(s, p, scale_log2, S, n0, m0 + warp_row0 + g, t,
                                                         n0 + kBlockN > S || crosses_diagonal, mask_on, mbits, mask,
                                                         mask_bytes);

    if constexpr (kStages == 1) {
      cp_async_wait<0>();
      __syncthreads();  // V[nb] landed; every warp is done with K[nb]
    }

    // Online softmax; P is packed into A fragments as it is produced.
    unsigned pa[kMTiles][kBlockN / 16][4];
    online_softmax<T, kMTiles, kNTiles, kDTiles, kDropout>(s, pa, acc_o, m_i, l_i, sc, p, m0 + warp_row0 + g, n0, g,
                                                           t);

    if constexpr (kStages == 1) {
      // K[nb-1] is fetched only now, behind O += P V: issued before the softmax (FlashAttention-2's place) it would
      // overlap more, but its addresses would be live next to the 64 S accumulators and spill.
      if (nb > 0) load_k(nb - 1, 0);
      cp_async_commit();
    }

    if constexpr (kWgmma) {
      pv_wgmma<T, kHeadDim, kBlockN>(acc_o, pa[0], sV, stage);
    } else {
      pv_mma<T, kHeadDim, kBlockN, kMTiles, kPitch>(acc_o, pa, v_addr + stage * kKVBytes);
    }
  }

  // Epilogue: the four lanes of a quad hold parts of the same rows; sum their partial l, then out = O / l.
  #pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = l_i[mi][half];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      float inv = l > 0.f ? 1.f / l : 0.f;
      if constexpr (kDropout) inv *= static_cast<float>(p.dropout_scale);  // kept P scaled by 1/(1 − p)
      const int r = warp_row0 + mi * 16 + half * 8 + g;
      if (r >= rows_valid) continue;
      T* orow = out + (m0 + r) * p.out_stride_l;
      #pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = dt * 8 + 2 * t;
        if (col >= Ev) continue;
        const float o0 = acc_o[mi][dt][2 * half] * inv, o1 = acc_o[mi][dt][2 * half + 1] * inv;
        if (vec_out && col + 1 < Ev) {
          *reinterpret_cast<unsigned*>(orow + col) = pack2<T>(o0, o1);
        } else {
          orow[col] = from_float<T>(o0);
          if (col + 1 < Ev) orow[col + 1] = from_float<T>(o1);
        }
      }
      if (lse && t == 0)
        lse[(m0 + r) * p.lse_stride_l] = l > 0.f ? (m_i[mi][half] + __log2f(l)) * kLn2 : neg_inf();
    }
  }
}

}  // namespace cupy_attn
