// Fused attention backward: dQ, dK, dV of out = softmax(scale · Q Kᵀ) V without any L×S matrix in memory.
//
// Math (FlashAttention-2's backward, Dao 2023, Algorithm 2): with P = exp(scale·QKᵀ − lse) rebuilt from the
// forward's lse and D_i = Σ_c dO_ic O_ic (attn_bwd_delta in bwd_rows.cu),
//   dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ∘ (dP − D),  dK = scale · dSᵀ Q,  dQ = scale · dS K.
// One block owns kBlockN keys of one key/value head and loops over the query heads of its GQA group and over query
// blocks of kBlockM rows, so dK and dV accumulate in registers (fp32) across the whole group; dQ is accumulated across
// key blocks by fp32 atomics into a zeroed (B, Hq, L, E) buffer that a final pass rounds to the input dtype.
//
// Thread mapping: kNWarps warps, warp w owns keys [16w, 16w + 16) of the block. Per query block it computes the
// transposed scores Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (16 keys × kBlockM queries per warp, mma.sync m16n8k16, fp32), so Pᵀ
// and dSᵀ come out in the accumulator layout that is the A-fragment layout of the next GEMMs (as P in the forward):
// dV += Pᵀ dO and dK += dSᵀ Q take A from registers and B = dO, Q through ldmatrix.trans. dSᵀ also goes to shared
// memory, where warp w reads it back transposed (ldmatrix.trans as an A operand) for dQ rows [16w, 16w + 16) += dS K.
// Quad shuffles are not needed: the softmax statistics are the saved lse and D, read per query column from shared
// memory. Masking: keys past S, queries past L (their lse is +inf in shared memory, so P = 0) and, when causal, key
// j > query i + causal_offset. Rows whose lse is −inf (every key masked in the forward) give P = 0 and no gradient.
//
// Shared memory: K, V (kBlockN rows), two stages of Q and dO (kBlockM rows; the next query block's copies are in flight
// while one is computed), pitch kHeadDim + 8 (conflict-free ldmatrix, see common/tile.cuh); dSᵀ (kBlockN ×
// kBlockM + 8); lse·log2(e) and D for the query block. 123 KB at D = 128 with double-buffered Q/dO: 158 KB.
// Tiles: kBlockN = 16·kNWarps keys, kBlockM queries per step; FLASH_BWD_TILES in cupy_attn/attention/backward.py
// (8 warps: 128 keys × 64 queries). dK and dV hold kHeadDim accumulators per thread (128 at D = 128) next to Sᵀ and
// dPᵀ (kBlockM / 2 each). D = 256 would need 256 accumulators and is left to the split backward. Accumulation fp32;
// P and dS are rounded to T only as MMA operands, as FlashAttention-2 does.
//
// No attn_mask yet (masked calls take the split backward). History and measurements: bench/notes/kernels_flash_bwd.md.
//
// Dropout (kDropout): the forward used P ∘ Z / (1 − p) with Z the keep mask of common/philox.cuh, recomputed here from
// the same rng pair, so dV = (P ∘ Z)ᵀ dO · 1/(1 − p) (scaled once at the end), dP = (dO Vᵀ) ∘ Z / (1 − p) and
// dS = P ∘ (dP − D) with the same D = rowsum(dO ∘ O). Each lane holds query pairs (2t, 2t + 1) of keys g and g + 8;
// a Philox block covers a 2×2 tile, whose other key is in the lane four apart (one shuffle, as in the forward).
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/tile.cuh"
#include "common/philox.cuh"
#include "common/reduce.cuh"
#include "common/visibility.cuh"

namespace cupy_attn {

struct FlashBwdParams {
  void* dk;                  // (B, Hkv, S, E) contiguous, T
  void* dv;                  // (B, Hkv, S, Ev) contiguous, T
  float* dq_accum;           // (B, Hq, L, E) contiguous fp32, zeroed by the host
  const void* q;             // (B, Hq, L, E)
  const void* k;             // (B, Hkv, S, E)
  const void* v;             // (B, Hkv, S, Ev)
  const void* dout;          // (B, Hq, L, Ev)
  const float* lse;          // (B, Hq, L) contiguous, natural log
  const float* delta;        // (B, Hq, L) contiguous: rowsum(dO ∘ O)
  long long seqlen_q, seqlen_k, head_dim, head_dim_v, num_heads, groups;
  long long is_causal, causal_offset, vec_flags;  // vec_flags bits 0-3: q, k, v, dout rows 16-byte aligned
  double scale, scale_log2;
  long long q_stride_b, q_stride_h, q_stride_l;
  long long k_stride_b, k_stride_h, k_stride_s;
  long long v_stride_b, v_stride_h, v_stride_s;
  long long do_stride_b, do_stride_h, do_stride_l;
  const long long* rng;      // kDropout: the forward's int64 {seed, offset}
  long long dropout_threshold;
  double dropout_scale;      // 1/(1 − p), 0 for p = 1
};

// Keep bits of this lane's elements of Sᵀ in a query block: bit 16·half + 2·mt + e for key key0 + 8·half and query
// m0 + 8·mt + 2t + e (queries are the rows i of the mask, keys its columns j). The lanes g and g ^ 1 (four apart)
// hold keys j and j ^ 1: each draws the blocks of every other query tile (even g: tiles 2k, odd g: 2k + 1), keeps its
// key's two bits and sends the other key's two across.
template <int kMTiles>
__device__ __forceinline__ unsigned dropout_keep_word_t(const FlashBwdParams& p, unsigned bh, int key0, int m0, int g,
                                                        int t) {
  static_assert(kMTiles % 2 == 0 && 2 * kMTiles <= 16, "query tiles in pairs, 16 bits per key");
  const Dropout drop = Dropout::load(p.rng, p.dropout_threshold);
  const unsigned odd = g & 1;
  unsigned keep = 0;
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const unsigned j2 = static_cast<unsigned>(key0 + 8 * half) >> 1;
    #pragma unroll
    for (int k = 0; k < kMTiles / 2; ++k) {
      const int mt = 2 * k + static_cast<int>(odd);
      const unsigned bits = drop.keep_bits(bh, static_cast<unsigned>(m0 + mt * 8 + 2 * t) >> 1, j2);
      const unsigned mine = ((bits >> odd) & 1u) | ((bits >> (2 + odd)) & 1u) << 1;
      const unsigned theirs = ((bits >> (1 - odd)) & 1u) | ((bits >> (3 - odd)) & 1u) << 1;
      const unsigned got = __shfl_xor_sync(0xffffffffu, theirs, 4);
      keep |= (mine << (2 * mt) | got << (2 * (mt ^ 1))) << (16 * half);
    }
  }
  return keep;
}

template <typename T, int kHeadDim, int kNWarps, int kBlockM, bool kDropout>
__global__ void __launch_bounds__(kNWarps * 32) flash_bwd(const FlashBwdParams p) {
  using namespace flash;
  constexpr int kThreads = kNWarps * 32;
  constexpr int kBlockN = 16 * kNWarps;   // keys per block, 16 per warp
  // dQ phase: kBlockM / 16 query tiles, each shared by kColSplit warps that take kWarpCols columns of dQ each.
  constexpr int kQTiles = kBlockM / 16;
  constexpr int kColSplit = kNWarps / kQTiles;
  constexpr int kWarpCols = kHeadDim / kColSplit;
  static_assert(kBlockM % 16 == 0 && kNWarps % kQTiles == 0 && kHeadDim % (16 * kColSplit) == 0, "dQ phase split");
  constexpr int kPitch = kHeadDim + 8;
  constexpr int kSPitch = kBlockM + 8;    // dSᵀ rows: odd number of 16-byte units, conflict-free ldmatrix
  constexpr int kMTiles = kBlockM / 8;    // 8-column (query) tiles of Sᵀ per warp
  constexpr int kDTiles = kHeadDim / 8;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBlockN * kPitch;
  T* sQ = sV + kBlockN * kPitch;       // two stages: the next query block lands while this one is computed
  T* sdO = sQ + 2 * kBlockM * kPitch;  // two stages
  T* sdS = sdO + 2 * kBlockM * kPitch;
  float* slse = reinterpret_cast<float*>(sdS + kBlockN * kSPitch);  // lse·log2(e); +inf for rows without keys
  float* sdelta = slse + kBlockM;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int n_block = blockIdx.x, hkv = blockIdx.y, b = blockIdx.z;
  const int L = static_cast<int>(p.seqlen_q), S = static_cast<int>(p.seqlen_k);
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.head_dim_v);
  const int n0 = n_block * kBlockN;
  const bool vec_q = p.vec_flags & 1, vec_k = p.vec_flags & 2, vec_v = p.vec_flags & 4, vec_do = p.vec_flags & 8;
  const float scale_log2 = static_cast<float>(p.scale_log2);
  // Key j is visible to query i iff j < S and j <= i + off (common/visibility.cuh: limit_offset).
  const long long off = BasicVisibility<int>{S, p.causal_offset, p.is_causal != 0}.limit_offset();

  load_tile<kBlockN, kHeadDim, kThreads>(sK, static_cast<const T*>(p.k) + b * p.k_stride_b + hkv * p.k_stride_h +
                                             n0 * p.k_stride_s, p.k_stride_s, S - n0, E, vec_k);
  load_tile<kBlockN, kHeadDim, kThreads>(sV, static_cast<const T*>(p.v) + b * p.v_stride_b + hkv * p.v_stride_h +
                                             n0 * p.v_stride_s, p.v_stride_s, S - n0, Ev, vec_v);
  cp_async_commit();

  // ldmatrix lane addresses (common/mma.cuh): A from [row][k] storage; B from [n][k] storage; B from [k][n] storage
  // (.trans); A from [k][row] storage (.trans: dS read out of dSᵀ).
  const unsigned k_as_a = smem_addr(sK + (warp * 16 + lane % 16) * kPitch + (lane / 16) * 8);
  const unsigned v_as_a = smem_addr(sV + (warp * 16 + lane % 16) * kPitch + (lane / 16) * 8);
  const unsigned q_as_b = smem_addr(sQ + ((lane / 16) * 8 + lane % 8) * kPitch + ((lane / 8) % 2) * 8);
  const unsigned do_as_b = smem_addr(sdO + ((lane / 16) * 8 + lane % 8) * kPitch + ((lane / 8) % 2) * 8);
  const unsigned q_as_bt = smem_addr(sQ + (((lane / 8) % 2) * 8 + lane % 8) * kPitch + (lane / 16) * 8);
  const unsigned do_as_bt = smem_addr(sdO + (((lane / 8) % 2) * 8 + lane % 8) * kPitch + (lane / 16) * 8);
  const unsigned k_as_bt = smem_addr(sK + (((lane / 8) % 2) * 8 + lane % 8) * kPitch + (lane / 16) * 8);
  const int qt = warp / kColSplit, c_first = (warp % kColSplit) * kWarpCols;  // this warp's dQ tile and columns
  const unsigned ds_as_at = smem_addr(sdS + ((lane / 16) * 8 + lane % 8) * kSPitch + qt * 16 + ((lane / 8) % 2) * 8);

  float acc_dk[kDTiles][4], acc_dv[kDTiles][4];
  #pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
    #pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[dt][e] = acc_dv[dt][e] = 0.f;

  // Queries that can see a key of this block: i >= n0 - off.
  const int m_first = static_cast<int>(max(0ll, (static_cast<long long>(n0) - off) / kBlockM));
  const int m_blocks = (L + kBlockM - 1) / kBlockM;
  const int key_row0 = n0 + warp * 16 + g;  // this lane's keys: key_row0 and key_row0 + 8

  // One iteration per (query head of the group, query block), flattened so that the next one's Q and dO tiles can be
  // in flight (cp.async into the other stage) while this one is computed.
  const int m_count = m_blocks - m_first;
  const int iters = m_count > 0 ? static_cast<int>(p.groups) * m_count : 0;
  auto load_q_do = [&](int it, int stage) {
    const int hq = hkv * static_cast<int>(p.groups) + it / m_count, m0 = (m_first + it % m_count) * kBlockM;
    load_tile<kBlockM, kHeadDim, kThreads>(sQ + stage * kBlockM * kPitch, static_cast<const T*>(p.q) +
                                           b * p.q_stride_b + hq * p.q_stride_h + m0 * p.q_stride_l,
                                           p.q_stride_l, L - m0, E, vec_q);
    load_tile<kBlockM, kHeadDim, kThreads>(sdO + stage * kBlockM * kPitch, static_cast<const T*>(p.dout) +
                                           b * p.do_stride_b + hq * p.do_stride_h + m0 * p.do_stride_l,
                                           p.do_stride_l, L - m0, Ev, vec_do);
  };
  if (iters > 0) load_q_do(0, 0);
  cp_async_commit();
  for (int it = 0; it < iters; ++it) {
    const int stage = it & 1;
    const int hq = hkv * static_cast<int>(p.groups) + it / m_count;
    const int m0 = (m_first + it % m_count) * kBlockM;
    const long long row_base = (static_cast<long long>(b) * p.num_heads + hq) * L;  // lse, delta, dq_accum rows
    __syncthreads();  // iteration it - 1 is done with the other stage, sdS, slse and sdelta
    if (it + 1 < iters) load_q_do(it + 1, stage ^ 1);
    cp_async_commit();
    for (int i = threadIdx.x; i < kBlockM; i += kThreads) {
      const int row = m0 + i;
      const float lse = row < L ? p.lse[row_base + row] : -inf();
      slse[i] = lse == -inf() ? inf() : lse * kLog2e;  // +inf: P = 2^(s - inf) = 0 for empty or absent rows
      sdelta[i] = row < L ? p.delta[row_base + row] : 0.f;
    }
    cp_async_wait<1>();  // this iteration's group (and K, V) landed; the next one may still be in flight
    __syncthreads();
    const unsigned st = stage * kBlockM * kPitch * 2;  // byte offset of this stage in sQ and sdO

    // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: 16 keys × kBlockM queries per warp.
    float s[kMTiles][4], dp[kMTiles][4];
    #pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][e] = dp[mt][e] = 0.f;
    #pragma unroll 2
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      unsigned a[4], av[4];
      ldmatrix_x4(a, k_as_a + kk * 16 * 2);
      ldmatrix_x4(av, v_as_a + kk * 16 * 2);
      #pragma unroll
      for (int nj = 0; nj < kBlockM / 16; ++nj) {
        unsigned bq[4], bo[4];
        ldmatrix_x4(bq, q_as_b + st + (nj * 16 * kPitch + kk * 16) * 2);
        ldmatrix_x4(bo, do_as_b + st + (nj * 16 * kPitch + kk * 16) * 2);
        mma_16816<T>(s[2 * nj], a, bq[0], bq[1]);
        mma_16816<T>(s[2 * nj + 1], a, bq[2], bq[3]);
        mma_16816<T>(dp[2 * nj], av, bo[0], bo[1]);
        mma_16816<T>(dp[2 * nj + 1], av, bo[2], bo[3]);
      }
    }

    // Pᵀ and dSᵀ in registers, packed straight into A fragments (query = k dimension of the next GEMMs).
    const unsigned keep = kDropout ? dropout_keep_word_t<kMTiles>(p, static_cast<unsigned>(b * p.num_heads + hq),
                                                                   key_row0, m0, g, t)
                                   : 0u;
    unsigned pa[kBlockM / 16][4], dsa[kBlockM / 16][4];
    #pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int key = key_row0 + half * 8;
        float pr[2], ds[2];
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = mt * 8 + 2 * t + e;  // query index inside the block
          const int query = m0 + col;
          const bool visible = key < S && query < L && key <= query + off;
          pr[e] = visible ? exp2f(s[mt][2 * half + e] * scale_log2 - slse[col]) : 0.f;
          if constexpr (kDropout) {
            const bool kept = (keep >> (16 * half + 2 * mt + e)) & 1u;
            ds[e] = pr[e] * ((kept ? dp[mt][2 * half + e] * static_cast<float>(p.dropout_scale) : 0.f) - sdelta[col]);
            if (!kept) pr[e] = 0.f;  // P ∘ Z for dV (1/(1 − p) applied once at the end)
          } else {
            ds[e] = pr[e] * (dp[mt][2 * half + e] - sdelta[col]);
          }
        }
        const int kk = mt / 2, hi = (mt % 2) * 2;
        pa[kk][hi + half] = pack2<T>(pr[0], pr[1]);
        dsa[kk][hi + half] = pack2<T>(ds[0], ds[1]);
        // dSᵀ row (key) warp*16 + g + 8·half, columns mt·8 + 2t, +1, for the dQ phase.
        *reinterpret_cast<unsigned*>(sdS + (warp * 16 + g + half * 8) * kSPitch + mt * 8 + 2 * t) =
            dsa[kk][hi + half];
      }
    }

    // dV += Pᵀ dO and dK += dSᵀ Q (scale applied at the end).
    #pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      #pragma unroll
      for (int dn = 0; dn < kHeadDim / 16; ++dn) {
        unsigned bo[4], bq[4];
        ldmatrix_x4_trans(bo, do_as_bt + st + (kk * 16 * kPitch + dn * 16) * 2);
        ldmatrix_x4_trans(bq, q_as_bt + st + (kk * 16 * kPitch + dn * 16) * 2);
        mma_16816<T>(acc_dv[2 * dn], pa[kk], bo[0], bo[1]);
        mma_16816<T>(acc_dv[2 * dn + 1], pa[kk], bo[2], bo[3]);
        mma_16816<T>(acc_dk[2 * dn], dsa[kk], bq[0], bq[1]);
        mma_16816<T>(acc_dk[2 * dn + 1], dsa[kk], bq[2], bq[3]);
      }
    }
    __syncthreads();  // every warp's dSᵀ rows are in shared memory

    // dQ rows [16·qt, 16·qt + 16), columns [c_first, c_first + kWarpCols) of this query block += scale · dS K, in
    // chunks of at most 64 columns, then fp32 atomics.
    const int q_row = m0 + qt * 16 + g;
    float* dq_row = p.dq_accum + (row_base + q_row) * E;
    #pragma unroll
    for (int c0 = c_first; c0 < c_first + kWarpCols; c0 += 64) {
      constexpr int kChunk = kWarpCols < 64 ? kWarpCols : 64;
      float dq[kChunk / 8][4];
      #pragma unroll
      for (int dt = 0; dt < kChunk / 8; ++dt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) dq[dt][e] = 0.f;
      #pragma unroll 1
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        unsigned a[4];
        ldmatrix_x4_trans(a, ds_as_at + kk * 16 * kSPitch * 2);
        #pragma unroll
        for (int dn = 0; dn < kChunk / 16; ++dn) {
          unsigned bk[4];
          ldmatrix_x4_trans(bk, k_as_bt + (kk * 16 * kPitch + c0 + dn * 16) * 2);
          mma_16816<T>(dq[2 * dn], a, bk[0], bk[1]);
          mma_16816<T>(dq[2 * dn + 1], a, bk[2], bk[3]);
        }
      }
      const float sc = static_cast<float>(p.scale);
      #pragma unroll
      for (int dt = 0; dt < kChunk / 8; ++dt) {
        const int col = c0 + dt * 8 + 2 * t;
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
          if (q_row + half * 8 >= L) continue;
          float* dst = dq_row + half * 8 * E + col;
          if (col + 1 < E && E % 2 == 0) {  // even E: rows and pairs are 8-byte aligned
            red_add2(dst, sc * dq[dt][2 * half], sc * dq[dt][2 * half + 1]);
          } else {
            if (col < E) atomicAdd(dst, sc * dq[dt][2 * half]);
            if (col + 1 < E) atomicAdd(dst + 1, sc * dq[dt][2 * half + 1]);
          }
        }
      }
    }
  }

  cp_async_wait<0>();  // a block with no visible query never waited for its K and V copies

  // dK = scale · Σ dSᵀ Q and dV = Σ Pᵀ dO for this block's keys, rounded once to T.
  const float sc = static_cast<float>(p.scale);
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key_row0 + half * 8;
    if (key >= S) continue;
    T* dk_row = static_cast<T*>(p.dk) + ((static_cast<long long>(b) * gridDim.y + hkv) * S + key) * E;
    T* dv_row = static_cast<T*>(p.dv) + ((static_cast<long long>(b) * gridDim.y + hkv) * S + key) * Ev;
    #pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      const int col = dt * 8 + 2 * t;
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (col + e < E) dk_row[col + e] = from_float<T>(sc * acc_dk[dt][2 * half + e]);
        if (col + e < Ev) {
          dv_row[col + e] = from_float<T>(kDropout ? acc_dv[dt][2 * half + e] * static_cast<float>(p.dropout_scale)
                                                   : acc_dv[dt][2 * half + e]);
        }
      }
    }
  }
}

}  // namespace cupy_attn
