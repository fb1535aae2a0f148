// Attention probabilities for Hopper (sm_90a), whole rows on chip: P = softmax(scale · Q Kᵀ) in the input dtype and
// lse = log Σ_j exp(scale · q·k_j) (fp32, natural log), for seqlen_k ≤ 512. The split path (cupy_attn/attention/
// split.py) feeds P to its P·V GEMM (cuBLAS, or pv_sm90.cu for causal calls): this kernel replaces a Q·Kᵀ GEMM into an
// fp32 score buffer and the softmax pass over it (issue 14: head dims above 256, where no fused kernel applies).
//
// Algorithm: a GEMM with the softmax in its epilogue. S is never written: a CTA holds whole score rows (64 query rows ×
// all S ≤ 512 keys) in wgmma accumulators, so the epilogue knows each row's exact max m and sum l before it writes
// P = 2^(S·c − m) / l (c = scale·log2 e, folded into one FFMA) and lse = (m + log2 l)·ln 2. No online rescaling.
// The mainloop is FlashAttention-3's producer/consumer pattern (Shah et al. 2024, §3.1; common/pipeline.cuh,
// sm90/roles.cuh): a producer warpgroup (setmaxnreg.dec to 24) whose one thread issues TMA loads into a kStages-deep
// mbarrier ring, two consumer warpgroups (setmaxnreg.inc to 240) issuing wgmma. Accumulation fp32 (S and the row
// statistics); P is rounded to T once, when stored.
//
// Thread mapping: 384 threads. Warpgroup 0 produces. Consumer warpgroup w = 0, 1 (warpgroups 1, 2) computes the 64 ×
// kHalfN block of S for keys w·kHalfN ... w·kHalfN + kHalfN − 1, K-loop over the head dim in 64-column steps (one
// 128-byte swizzle atom wide), four m64nkHalfNk16 wgmma per step (kHalfN/2 accumulator registers per thread: lane
// 4g+t of warp v holds rows 16v+g and 16v+g+8, columns 8j+2t and 8j+2t+1). Row statistics: a quad shuffle inside the
// warpgroup, then one exchange through shared memory between the two warpgroups (each owns half of every row).
//
// Stage s of the ring: Q rows m0..m0+63 × head-dim columns 64·kb..64·kb+63 (8 KB) and K rows 0..2·kHalfN−1 × the same
// columns (two TMA boxes of kHalfN rows, one per consumer warpgroup), both in the 128-byte swizzle; full[s] (1 arrival:
// the producer's expect_tx, plus the TMA bytes) and empty[s] (8 arrivals: lane 0 of each consumer warp once the wgmma
// reading the stage has completed; 16 in a cluster of two). Rows past L or S and columns past E are outside the
// tensor maps and land as zeros; key columns past S are set to −inf before the max, rows past L are not stored.
//
// Tiles (cupy_attn/attention/scores_sm90.py, SCORES_TILES): kHalfN ∈ {64, 128, 192, 256} = the smallest multiple of
// 64 with 2·kHalfN ≥ S; kStages = 4 (3 at kHalfN = 256: 3 × 72 KB fills the 227 KB per block). One CTA per SM (its
// accumulators take half the register file).
//
// K multicast (scores_softmax_sm90_cluster2): every CTA reads its head's whole K, which can make the L2 → SM traffic
// the limit. In a cluster of two CTAs (adjacent row blocks of one head) each producer loads one of the stage's two K
// boxes and multicasts it to both, so K crosses from L2 once per 128 rows. The protocol (scores_softmax below,
// tma.cuh's cluster section): full[s] expects the whole stage in each CTA; empty[s] takes 16 arrivals, the consumer
// warps of both CTAs (the local one and, through mapa, the peer's); cluster barriers after the barrier initialization
// and before exit.
//
// Causal (not the cluster variant: the launcher keeps it non-causal): a block's keys end at n_vis, the limit of its
// last row (common/visibility.cuh). Its keys 0 ... n_vis − 1 are split evenly between the two warpgroups,
// nw = ⌈n_vis / 128⌉·64 each (≤ kHalfN): warpgroup w multiplies keys w·nw ... w·nw + nw − 1 with wgmma m64nNwk16 (a
// runtime choice among the instantiations N = 64 ... kHalfN), and the producer loads the second box from key nw. A
// warpgroup's chain of wgmma is what a block waits for, so both shorten. A warpgroup whose keys all lie at or past
// n_vis issues no wgmma (it only follows the ring's phases). Every key past a row's limit gets P = 0, keys
// 2·nw ... S − 1 by stores of zeros (16-byte stores in the persistent kernel, TMA stores of a zero box in the one-tile
// kernels; the P·V GEMM reads whole rows); a row that sees no key (bottom-right, L > S) gets P = 0 and lse = −inf. The
// persistent kernel's 256-key tile also pairs row blocks (Tile: a narrow block's keys and the overflow of a wide one's
// share a tile).
//
// Persistent variant (scores_softmax_sm90_persistent, the default): one CTA per SM walks its row blocks (TileWalk);
// the producer loads the next block's first stages while the consumers run a block's softmax and P stores. P leaves
// from registers by 16-byte global stores (a quad transpose gives each lane 8 consecutive keys), so a tile's last
// stage is released as soon as its wgmma have read it and all kStages stages refill during the epilogue (the one-tile
// kernels stage P in that stage for TMA stores). It does not overlap the epilogue with the next block's wgmma (both
// consumer warpgroups hold one block's rows: a ping-pong of blocks would need 256 accumulator registers per thread at
// S = 512); the tensor cores idle during the epilogue.
// Not (yet) here: attn_mask other than key padding (the masked persistent kernel).
// History and measurements: bench/notes/kernels_scores_sm90.md.
#include "common/types.cuh"
#include "common/mask.cuh"
#include "common/mma.cuh"
#include "common/wgmma.cuh"
#include "common/tma.cuh"
#include "common/pipeline.cuh"
#include "common/visibility.cuh"
#include "attention/sm90/pack.cuh"
#include "attention/sm90/roles.cuh"

namespace cupy_attn {

// Kernel parameters, declared once in NumPy (cupy_attn/attention/scores_sm90.py: _PARAMS; sizes asserted at compile
// time, field order by tests/test_structs.py). One __grid_constant__ parameter: TMA reads the maps by address.
struct ScoresSm90Params {
  tma::TensorMap tma_q;  // Q as (E, L, Hq, B), box (64, 64, 1, 1), 128-byte swizzle
  tma::TensorMap tma_k;  // K as (E, S, Hkv, B), box (64, kHalfN, 1, 1)
  tma::TensorMap tma_p;  // P (B, Hq, L, S) in the input dtype as (S, L, Hq, B), rows ld elements apart (ld a
                         // multiple of 8), box (64, 64, 1, 1), 128-byte swizzle: the epilogue's TMA stores
  float* lse;            // (B, Hq, L) fp32 natural log, or nullptr
  long long seqlen_q, seqlen_k, head_dim;
  long long groups;      // Hq / Hkv: query head h reads key head h / groups
  double scale_log2;     // scale · log2(e), > 0
  long long lse_stride_b, lse_stride_h, lse_stride_l;
  long long is_causal;      // 1: key j is visible to query row i iff j <= i + causal_offset
  long long causal_offset;  // 0 (top-left) or S - L (bottom-right)
  long long num_heads, batch;  // Hq, B: the persistent kernel's tiles are (row block, head, batch), row block fastest
  void* p;                     // P's base (the same array as tma_p): the persistent kernel's 16-byte stores
  long long ld;                // P's row pitch in elements (a multiple of 8)
  // Causal row-block pairs (persistent kernel, kHalfN = 256; cupy_attn/attention/scores_sm90.py: causal_pairs): the
  // row blocks pair_p0 ... pair_p0 + pair_n − 1 of every head see some but not all keys; the outer pair_count pairs
  // of that window, (pair_p0 + j, pair_p0 + pair_n − 1 − j), each run as one tile. 0 pairs: one tile per row block.
  long long pair_p0, pair_n, pair_count;
  // The P·V GEMM reads only keys 0 ... read_keys − 1 of rows 0 ... read_rows − 1 (the split path's first causal row
  // band): the zeros past them are not stored. 0 rows: every row is read whole.
  long long read_rows, read_keys;
  // attn_mask that varies only along the keys (key padding: (B|1, Hq|1, 1, S) broadcast to (B, Hq, L, S)), in the
  // masked kernel: mask_kind (common/mask.cuh: 1 bool, 2 fp16, 3 bf16, 4 fp32), element strides along batch, query
  // head and key.
  const void* mask;
  long long mask_kind, mask_stride_b, mask_stride_h, mask_stride_k;
  tma::TensorMap tma_k64;      // K as tma_k, box (64, 64, 1, 1): a pair tile's keys 256 ... in 64-row pieces
};

namespace scores_sm90 {

constexpr int kBlockM = 64;

template <typename T, int kHalfN, int kStages>
struct SharedStorage {
  static constexpr int kQBytes = kBlockM * 128;       // 64 rows × 64 16-bit columns
  static constexpr int kKBytes = 2 * kHalfN * 128;    // both warpgroups' keys × 64 columns
  // Ring tiles, full and empty barriers, the two warpgroups' row statistics (2 × 64 float2), and 1 KB of
  // slack to align the base to 1024 bytes (the swizzle atoms' alignment; the runtime only guarantees 16).
  static constexpr int kBytes = kStages * (kQBytes + kKBytes) + 16 * kStages + 2 * kBlockM * 8 + 1024;

  T* q;  // kStages tiles
  T* k;
  pipeline::Ring<kStages> bars;  // empty: 8 arrivals per CTA of the cluster (every consumer warp reading the stage)
  float2* stats;   // [warpgroup][row]: (max·c of the warpgroup's keys, Σ 2^(s·c − that max))

  __device__ __forceinline__ explicit SharedStorage(unsigned char* base) {
    unsigned char* smem = sm90::smem_base(base);
    q = reinterpret_cast<T*>(smem);
    k = reinterpret_cast<T*>(smem + kStages * kQBytes);
    bars.full = reinterpret_cast<unsigned long long*>(smem + kStages * (kQBytes + kKBytes));
    bars.empty = bars.full + kStages;
    stats = reinterpret_cast<float2*>(bars.empty + kStages);
  }
};

using sm90::Pair;
using sm90::quad_transpose;

// Named barrier 1: the 256 consumer threads, around each exchange of row statistics (in its unaligned form: a pair
// tile's warpgroups reach it from different code, tma::named_barrier_sync_unaligned); 2 and 3: each consumer
// warpgroup's 128 threads, between their writes of P into shared memory and the TMA stores.
constexpr int kStatsBarrier = 1;
constexpr int kStoreBarrier = 2;

}  // namespace scores_sm90

namespace scores_sm90 {

// 2^(s·c − m_c) in place over a warpgroup's accumulators of a 64 × kN block (acc[4j + 2·half + e]: row r0 + 8·half
// of this lane), one FFMA and one MUFU.EX2 per score (ex2.approx.ftz: −inf → 0; results below 2^−126 flush to 0:
// below fp16's least value, and among bf16's subnormals an absolute error under 2^−126), and each row's sum: this
// lane's, then the quad's (shuffles; the four lanes of a quad hold a row's columns). sum starts at 0. Not exp2f: its
// denormal range fix-up costs 3 instructions per score.
template <int kN>
__device__ __forceinline__ void exp2_rows(float (&acc)[kN / 2], float c, const float (&m_c)[2], float (&sum)[2]) {
  sum[0] = sum[1] = 0.f;
  #pragma unroll
  for (int j = 0; j < kN / 8; ++j)
    #pragma unroll
    for (int half = 0; half < 2; ++half)
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = acc[4 * j + 2 * half + e];
        x = exp2_approx(fmaf(x, c, -m_c[half]));
        sum[half] += x;
      }
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    sum[half] += __shfl_xor_sync(0xffffffffu, sum[half], 1);
    sum[half] += __shfl_xor_sync(0xffffffffu, sum[half], 2);
  }
}

// The consumer's K loop: S block (64 × kN) = Q K_wgᵀ over the head dim, into the first kN/2 accumulators. Each stage:
// four k steps of 16 columns = 32 bytes inside the 128-byte swizzled rows (the hardware applies the XOR to the
// computed address); 8-row atoms 1024 bytes apart. wait<1> after a stage's commit: the previous stage's wgmma has
// completed, so that stage is released while this one runs (two groups in flight). Returns after wait<0>.
template <typename T, int kN, int kHalfN, int kStages, int kClusterM>
__device__ __forceinline__ void k_loop(float (&acc)[kHalfN / 2], const SharedStorage<T, kHalfN, kStages>& ss,
                                       unsigned q_base, unsigned k_base, int k_blocks, int lane, unsigned rank,
                                       int step0) {
  using Smem = SharedStorage<T, kHalfN, kStages>;
  float (&d)[kN / 2] = *reinterpret_cast<float (*)[kN / 2]>(&acc[0]);
  // Stage kb's four k steps, issued and committed once its loads have landed.
  auto issue = [&](int kb) {
    const int s = ss.bars.wait(step0 + kb);
    const unsigned q_st = q_base + s * Smem::kQBytes, k_st = k_base + s * Smem::kKBytes;
    wgmma::fence();
    #pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma::Mma<T, kN>::ss(d, wgmma::desc_sw128(q_st + kk * 32, 16, 1024),
                              wgmma::desc_sw128(k_st + kk * 32, 16, 1024), kb > 0 || kk > 0);
    wgmma::commit();
  };
  // wait<1>: stage kb − 1's wgmma have completed; release that stage (kb ≥ 1).
  auto retire = [&](int kb) {
    wgmma::wait<1>();
    if (kb > 0) {
      __syncwarp();
      if (lane == 0) {
        ss.bars.arrive_empty(step0 + kb - 1);
        if constexpr (kClusterM > 1) ss.bars.arrive_empty_cluster(step0 + kb - 1, rank ^ 1);
      }
    }
  };
  // The first two k blocks peeled off the loop: faster than the plain loop (bench/notes/kernels_scores_sm90.md; from
  // ptxas's schedule of the copies, not otherwise explained).
  issue(0);
  retire(0);
  if (k_blocks > 1) {
    issue(1);
    retire(1);
  }
  for (int kb = 2; kb < k_blocks; ++kb) {
    issue(kb);
    retire(kb);
  }
  wgmma::wait<0>();
}

// k_loop at the runtime width nw (a multiple of 64, 64 ≤ nw ≤ kN): one instantiation per width.
template <typename T, int kN, int kHalfN, int kStages, int kClusterM>
__device__ __forceinline__ void k_loop_width(int nw, float (&acc)[kHalfN / 2],
                                             const SharedStorage<T, kHalfN, kStages>& ss, unsigned q_base,
                                             unsigned k_base, int k_blocks, int lane, unsigned rank, int step0) {
  if constexpr (kN == 64) {
    k_loop<T, 64, kHalfN, kStages, kClusterM>(acc, ss, q_base, k_base, k_blocks, lane, rank, step0);
  } else {
    if (nw == kN) {
      k_loop<T, kN, kHalfN, kStages, kClusterM>(acc, ss, q_base, k_base, k_blocks, lane, rank, step0);
    } else {
      k_loop_width<T, kN - 64, kHalfN, kStages, kClusterM>(nw, acc, ss, q_base, k_base, k_blocks, lane, rank,
                                                           step0);
    }
  }
}

// Keys 0 ... n_vis − 1 are visible to some row of the 64-row block at m0: all S, or under a causal mask those up to
// the limit of its last row (0 when no row sees a key).
__device__ __forceinline__ int visible_keys(const ScoresSm90Params& p, int m0) {
  int n_vis = static_cast<int>(p.seqlen_k);
  if (p.is_causal) {
    const long long last_row = min(static_cast<long long>(m0 + kBlockM), p.seqlen_q) - 1;
    n_vis = static_cast<int>(max(0ll, Visibility{p.seqlen_k, p.causal_offset, true}.end_key(last_row)));
  }
  return n_vis;
}

// One tile of the kernel: 64 query rows (m0 ...) of head h, batch b, and the keys its rows may see (n_vis,
// visible_keys). Keys per warpgroup nw: kHalfN, or under a causal mask half of n_vis rounded up to 64 (warpgroup w
// takes keys w·nw ... w·nw + nw − 1; the producer loads the second box from key nw). P is written for keys 0 ...
// zero_from − 1 from the accumulators and as zeros from there to S. A causal pair tile (lo_m0 ≥ 0; persistent kernel,
// kHalfN = 256): the rows of a wide block (m0) and of a narrow one (lo_m0) whose visible keys, rounded up to 64, add up
// to at most 512, so the tile does a whole tile's work and the narrow block no longer costs a tile of its own (a narrow
// block alone is paced by its loads like a full one). Warpgroup 0 multiplies the wide block's keys 0 ... nw − 1 (nw =
// min(256, its width)) as in any tile; warpgroup 1 the rest of them, 256 ... 256 + n1 − 1, and the narrow block's keys
// 0 ... 255 − n1 (pair_tile_wg1). Each stage holds both Q tiles: the narrow block's in the second K box's rows 192 ...
// 255, since that box loads only the n1 ≤ 192 keys warpgroup 1 needs.
template <int kHalfN>
struct Tile {
  int m0, h, b, n_vis, nw;
  int lo_m0 = -1, n1 = 0;                // a pair tile's narrow block; n1: the wide block's keys in warpgroup 1
  int zero_from, zero_lo_from = 0;       // P's zeros start here (past every row's limit), in the block (and lo block)
  __device__ __forceinline__ Tile(const ScoresSm90Params& p, int mb, int h_, int b_) : m0(mb * kBlockM), h(h_), b(b_) {
    n_vis = visible_keys(p, m0);
    nw = p.is_causal ? min(kHalfN, max(64, (n_vis + 127) / 128 * 64)) : kHalfN;
    zero_from = 2 * nw;
  }
  __device__ __forceinline__ Tile(const ScoresSm90Params& p, int mb, int mb_lo, int h_, int b_)
      : m0(mb * kBlockM), h(h_), b(b_), lo_m0(mb_lo * kBlockM) {
    n_vis = visible_keys(p, m0);
    const int width = (n_vis + 63) / 64 * 64;
    nw = min(kHalfN, width);
    n1 = width - nw;
    zero_from = nw + n1;
    zero_lo_from = kHalfN - n1;
  }
  __device__ __forceinline__ bool pair() const { return lo_m0 >= 0; }
};

// The tiles of a CTA, in order. One-CTA and cluster kernels: the block's own (grid (row blocks, Hq, B)). Persistent
// kernel (grid (min(tiles, SMs), 1, 1)): tiles blockIdx.x, blockIdx.x + gridDim.x, ... of the (tile of the head,
// head, batch) order with the head's tiles fastest, so that the CTAs running at one time cover a few heads' row
// blocks side by side, and each head's K is read from DRAM about once (as the one-CTA grid's order does). A head's
// tiles: its pair_count causal pairs first (ScoresSm90Params), then its other row blocks in order.
template <bool kPersistent, bool kPairs>
struct TileWalk {
  int next, stride, count, per_head, heads, pairs, p0, n;
  __device__ __forceinline__ explicit TileWalk(const ScoresSm90Params& p) {
    const int m_blocks = static_cast<int>((p.seqlen_q + kBlockM - 1) / kBlockM);
    heads = static_cast<int>(p.num_heads);
    pairs = kPairs ? static_cast<int>(p.pair_count) : 0;
    p0 = static_cast<int>(p.pair_p0);
    n = static_cast<int>(p.pair_n);
    per_head = m_blocks - pairs;
    if constexpr (kPersistent) {
      next = blockIdx.x;
      stride = gridDim.x;
      count = per_head * heads * static_cast<int>(p.batch);
    } else {
      next = 0;
      stride = 1;
      count = 1;
    }
  }
  __device__ __forceinline__ bool more() const { return next < count; }
  template <int kHalfN>
  __device__ __forceinline__ Tile<kHalfN> take(const ScoresSm90Params& p) {
    const int t = next;
    next += stride;
    if constexpr (kPersistent) {
      const int i = t % per_head, h = (t / per_head) % heads, b = t / (per_head * heads);
      if (i < pairs) return Tile<kHalfN>(p, p0 + n - 1 - i, p0 + i, h, b);
      // The row blocks no pair holds: [0, p0), [p0 + pairs, p0 + n − pairs), [p0 + n, m_blocks).
      int mb = i - pairs;
      if (mb >= p0) mb += pairs;
      if (mb >= p0 + n - pairs) mb += pairs;
      return Tile<kHalfN>(p, mb, h, b);
    } else {
      return Tile<kHalfN>(p, blockIdx.x, blockIdx.y, blockIdx.z);
    }
  }
};

// The epilogue's parts over one wgmma chain's accumulators a (a 64 × kN block: a[4j + 2·half + e] is row
// m0 + r0 + 8·half, key column n0 + 8j + 2t + e), shared by a tile's warpgroups and a pair tile's two chains.

// Keys past S (zero rows of K from TMA's fill), past n0 + nw and past a row's causal limit take no part: −inf before
// the max (an assignment: an inactive chain's accumulators are never written).
template <int kN>
__device__ __forceinline__ void mask_keys(float (&a)[kN / 2], bool active, int n0, int nw, int m0, int r0, int t,
                                          const ScoresSm90Params& p) {
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    // Column 8j + e of this lane is visible iff 8j + e < lim: the chain's keys end at n0 + nw (a Visibility with S
    // cut there).
    // Keys < limit are visible to this row: a Visibility with S cut at the chain's end, n0 + nw. Column 8j + e of
    // this lane is visible iff 8j + e < lim (the clamped-int form of Visibility::lane_limit, exclusive).
    const long long limit = Visibility{min(p.seqlen_k, static_cast<long long>(n0 + nw)), p.causal_offset,
                                       p.is_causal != 0}.end_key(m0 + r0 + 8 * half);
    const int lim = active ? static_cast<int>(max(-1ll, min(static_cast<long long>(kN), limit - n0 - 2 * t))) : -1;
    #pragma unroll
    for (int j = 0; j < kN / 8; ++j)
      #pragma unroll
      for (int e = 0; e < 2; ++e)
        if (8 * j + e >= lim) a[4 * j + 2 * half + e] = neg_inf();
  }
}

// attn_mask varying only along the keys (the masked kernel): each of this lane's keys n0 + 8j + 2t + e (< S, within
// the warpgroup's nw) gets the mask's base-2 offset (mask_value: bool 0 or −inf, floats times log2 e) divided by c, so
// that the epilogue's s·c − m is the scaled score plus the mask; both of the lane's rows take the same value.
template <int kN, int kKind>
__device__ __forceinline__ void add_key_mask_of(float (&a)[kN / 2], const unsigned char* lane, int step, int keys,
                                                int nw, float inv_c) {
  #pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    if (8 * j >= nw) break;
    #pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (8 * j + e < keys) {
        const float off = mask_value(lane + (8 * j + e) * step, kKind) * inv_c;
        a[4 * j + e] += off;
        a[4 * j + 2 + e] += off;
      }
    }
  }
}

template <int kN>
__device__ __forceinline__ void add_key_mask(float (&a)[kN / 2], int n0, int nw, int t, int b, int h, float c,
                                             const ScoresSm90Params& p) {
  const int kind = static_cast<int>(p.mask_kind), isz = mask_itemsize(kind);
  const int step = static_cast<int>(p.mask_stride_k) * isz;  // bytes between keys
  const unsigned char* const lane = static_cast<const unsigned char*>(p.mask) +
                                    (b * p.mask_stride_b + h * p.mask_stride_h + (n0 + 2 * t) * p.mask_stride_k) * isz;
  const int keys = static_cast<int>(p.seqlen_k) - n0 - 2 * t;  // this lane's key 8j + e is in range iff 8j + e < keys
  const float inv_c = 1.f / c;
  if (kind == kMaskBool) add_key_mask_of<kN, kMaskBool>(a, lane, step, keys, nw, inv_c);
  else if (kind == kMaskFloat) add_key_mask_of<kN, kMaskFloat>(a, lane, step, keys, nw, inv_c);
  else if (kind == kMaskHalf) add_key_mask_of<kN, kMaskHalf>(a, lane, step, keys, nw, inv_c);
  else add_key_mask_of<kN, kMaskBf16>(a, lane, step, keys, nw, inv_c);
}

// Each row's max over the chain's keys, times c (m_c; −inf for a row that sees none of them), and the exponent
// reference (m_c, or 0 where it is −inf: P = 0, no NaN).
template <int kN>
__device__ __forceinline__ void row_max(const float (&a)[kN / 2], float c, float (&m_c)[2], float (&ref)[2]) {
  float mx[2] = {neg_inf(), neg_inf()};
  #pragma unroll
  for (int j = 0; j < kN / 8; ++j)
    #pragma unroll
    for (int half = 0; half < 2; ++half)
      mx[half] = fmaxf(mx[half], fmaxf(a[4 * j + 2 * half], a[4 * j + 2 * half + 1]));
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 1));
    mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 2));
    m_c[half] = mx[half] * c;
    ref[half] = m_c[half] == neg_inf() ? 0.f : m_c[half];
  }
}

// FlashAttention's merge of two partial softmaxes of a row, (m_c, sum) this chain's and (peer.x, peer.y) the other's
// (m_c = −inf, sum = 0 for keys the row cannot see): m = max of the two, l = sum·2^(m_c − m) + peer.y·2^(peer.x − m)
// (the products rounded apart, __fmul_rn/__fadd_rn: both sides add the same two floats and get the same l bit for
// bit). Returns this chain's P scale 2^(m_c − m) / l (0 for a row that sees no key).
__device__ __forceinline__ float merge_stats(float m_c, float sum, float2 peer, float& m, float& l) {
  m = fmaxf(m_c, peer.x);
  l = 0.f;
  if (m == neg_inf()) return 0.f;
  const float e_own = exp2_approx(m_c - m), e_peer = exp2_approx(peer.x - m);  // −inf − m → 0
  l = __fadd_rn(__fmul_rn(sum, e_own), __fmul_rn(peer.y, e_peer));
  return l > 0.f ? e_own / l : 0.f;
}

// lse = (m + log2 l)·ln 2 of row `row` (m, l in base 2, m scaled by c), −inf for a row that sees no key; rows past L
// are not stored.
__device__ __forceinline__ void store_lse(const ScoresSm90Params& p, int b, int h, int row, float m, float l) {
  if (p.lse != nullptr && row < p.seqlen_q)
    p.lse[b * p.lse_stride_b + h * p.lse_stride_h + row * p.lse_stride_l] =
        l > 0.f ? (m + __log2f(l)) * kLn2 : neg_inf();
}

// P = a·inv from registers, 32 keys of a row at a time: four packed pairs per lane (keys n0 + 8j + 2t, + 1 for
// j = 4i ... 4i + 3), a quad's 4 × 4 transpose (quad_transpose) gives lane t the 8 consecutive keys
// n0 + 32i + 8t ... + 7: one 16-byte store; a warp's store covers 8 rows × 64 contiguous bytes. Keys n0 ...
// n0 + nw − 1; rows past L are not stored; a chunk holding key S − 1 is stored whole (P = 0 past S, within the row
// pitch: ld is a multiple of 8 ≥ S). head: P of the tile's (batch, head).
template <typename T, int kN>
__device__ __forceinline__ void store_p(const float (&a)[kN / 2], const float (&inv)[2], T* head, int m0, int r0, int t,
                                        int n0, int nw, const ScoresSm90Params& p) {
  using P2 = typename Pair<T>::type;
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = m0 + r0 + 8 * half;
    T* const p_row = head + static_cast<long long>(row) * p.ld;
    #pragma unroll
    for (int i = 0; i < kN / 32; ++i) {
      if (32 * i >= nw) break;  // columns past the chain's keys (causal blocks)
      unsigned w[4];
      #pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int j = 4 * i + u;
        const P2 v = Pair<T>::make(a[4 * j + 2 * half] * inv[half], a[4 * j + 2 * half + 1] * inv[half]);
        w[u] = *reinterpret_cast<const unsigned*>(&v);
      }
      quad_transpose(w, t);
      const int col = n0 + 32 * i + 8 * t;
      // (`&& true`: NVRTC's front end lowers this three-term form to the schedule the kernel was measured with; the
      // two-term test moves one 64-bit compare and costs 8 more SASS instructions.)
      if (row < p.seqlen_q && col < p.seqlen_k && true)
        *reinterpret_cast<uint4*>(p_row + col) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// Causal: keys from ... to − 1 of the block's rows lie past every row's limit: zeros, 16-byte chunks spread over the
// 256 consumer threads (tid; the chunk holding key to − 1 whole: within the row pitch). to = S, or read_keys for a
// block whose rows the P·V GEMM reads only that far (read_rows). from is a multiple of 8. (A warp per row without the
// division made ptxas serialize the kernel's wgmma, C7511, as did a fixed 64-chunk stride: the register allocation
// of this kernel is at its edge.)
template <typename T>
__device__ __forceinline__ void zero_tail(T* head, int m0, int from, int tid, const ScoresSm90Params& p) {
  long long to = p.seqlen_k;
  if (m0 + kBlockM <= p.read_rows) to = min(to, p.read_keys);
  if (from >= to) return;
  const int chunks = static_cast<int>((to - from + 7) / 8);
  for (int idx = tid; idx < kBlockM * chunks; idx += 256) {
    const int row = m0 + idx / chunks;
    if (row < p.seqlen_q)
      *reinterpret_cast<uint4*>(head + static_cast<long long>(row) * p.ld + from + 8 * (idx % chunks)) =
          make_uint4(0, 0, 0, 0);
  }
}

// Warpgroup 1 of a causal pair tile (Tile::pair; persistent kernel, kHalfN = 256): its 256 keys as four chunks of 64,
// m64n64 wgmma each, into acc[c] (the tile's accumulator registers, shared with the plain path: a second array made
// ptxas serialize every wgmma of the kernel, C7511). Chunks c < c1 = n1/64 hold the wide block's keys 256 + 64c ...
// (A: the stage's Q tile, B: the second K box); the others the narrow block's keys 64(c − c1) ... (A: its Q tile in
// the second K box's rows 192 ... 255, B: the first K box). Then the wide block's rows as warpgroup 1 of a plain tile
// (their statistics merged with warpgroup 0's through the exchange), the narrow block's rows alone (their keys are
// all here: no exchange), P and lse of both.
// A chunk's role is a run-time choice of operands, so one code path serves every n1 (two wgmma chains of compile-time
// widths, one instantiation per n1, read A once per chain but made the kernel much larger and slower: the two
// warpgroups then run different code; bench/notes/kernels_scores_sm90.md).
template <typename T, int kStages>
__device__ __forceinline__ void pair_tile_wg1(float (&acc)[4][32], const SharedStorage<T, 256, kStages>& ss,
                                              const Tile<256>& tl,
                                              const ScoresSm90Params& p, int step, int k_blocks, int tid) {
  using Smem = SharedStorage<T, 256, kStages>;
  const int lane = tid % 32, t = lane % 4, r0 = ((tid / 32) % 4) * 16 + lane / 4;
  const int c1 = tl.n1 / 64;
  const unsigned q_base = tma::smem_u32(ss.q), k_base = tma::smem_u32(ss.k);
  auto issue = [&](int kb) {
    const int s = ss.bars.wait(step + kb);
    const unsigned q_st = q_base + s * Smem::kQBytes, k0 = k_base + s * Smem::kKBytes, k1 = k0 + 256 * 128;
    wgmma::fence();
    #pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      #pragma unroll
      for (int c = 0; c < 4; ++c) {
        const bool hi = c < c1;
        const unsigned a = (hi ? q_st : k1 + 192 * 128) + kk * 32;
        const unsigned b = (hi ? k1 + c * 64 * 128 : k0 + (c - c1) * 64 * 128) + kk * 32;
        wgmma::Mma<T, 64>::ss(acc[c], wgmma::desc_sw128(a, 16, 1024), wgmma::desc_sw128(b, 16, 1024),
                              kb > 0 || kk > 0);
      }
    wgmma::commit();
  };
  auto retire = [&](int kb) {
    wgmma::wait<1>();
    if (kb > 0) {
      __syncwarp();
      if (lane == 0) ss.bars.arrive_empty(step + kb - 1);
    }
  };
  for (int kb = 0; kb < k_blocks; ++kb) {
    issue(kb);
    retire(kb);
  }
  wgmma::wait<0>();
  #pragma unroll
  for (int c = 0; c < 4; ++c) wgmma::fence_operands(acc[c]);
  // P leaves from registers: the tile's last stage is free once this warp's wgmma have read it.
  ss.bars.release(step + k_blocks - 1, lane);

  // Chunk c's keys start at n0[c] and its rows at m0c[c].
  int n0[4], m0c[4];
  #pragma unroll
  for (int c = 0; c < 4; ++c) {
    n0[c] = c < c1 ? 256 + 64 * c : 64 * (c - c1);
    m0c[c] = c < c1 ? tl.m0 : tl.lo_m0;
    mask_keys<64>(acc[c], true, n0[c], 64, m0c[c], r0, t, p);
  }
  const float c_log2 = static_cast<float>(p.scale_log2);
  float m_hi[2] = {neg_inf(), neg_inf()}, m_lo[2] = {neg_inf(), neg_inf()};
  #pragma unroll
  for (int c = 0; c < 4; ++c)
    #pragma unroll
    for (int j = 0; j < 8; ++j)
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float x = fmaxf(acc[c][4 * j + 2 * half], acc[c][4 * j + 2 * half + 1]);
        if (c < c1) m_hi[half] = fmaxf(m_hi[half], x);
        else m_lo[half] = fmaxf(m_lo[half], x);
      }
  float ref_hi[2], ref_lo[2];
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    m_hi[half] = fmaxf(m_hi[half], __shfl_xor_sync(0xffffffffu, m_hi[half], 1));
    m_hi[half] = fmaxf(m_hi[half], __shfl_xor_sync(0xffffffffu, m_hi[half], 2));
    m_lo[half] = fmaxf(m_lo[half], __shfl_xor_sync(0xffffffffu, m_lo[half], 1));
    m_lo[half] = fmaxf(m_lo[half], __shfl_xor_sync(0xffffffffu, m_lo[half], 2));
    m_hi[half] *= c_log2;
    m_lo[half] *= c_log2;
    ref_hi[half] = m_hi[half] == neg_inf() ? 0.f : m_hi[half];
    ref_lo[half] = m_lo[half] == neg_inf() ? 0.f : m_lo[half];
  }
  float sum_hi[2] = {0.f, 0.f}, sum_lo[2] = {0.f, 0.f};
  #pragma unroll
  for (int c = 0; c < 4; ++c) {
    const bool hi = c < c1;
    const float ref[2] = {hi ? ref_hi[0] : ref_lo[0], hi ? ref_hi[1] : ref_lo[1]};
    float sum[2];
    exp2_rows<64>(acc[c], c_log2, ref, sum);
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (hi) sum_hi[half] += sum[half];
      else sum_lo[half] += sum[half];
    }
  }
  float2* const st = ss.stats;
  #pragma unroll
  for (int half = 0; half < 2; ++half)
    if (t == 0) st[kBlockM + r0 + 8 * half] = make_float2(m_hi[half], sum_hi[half]);
  tma::named_barrier_sync_unaligned(kStatsBarrier, 256);
  float inv_hi[2], inv_lo[2];
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    float m, l;
    inv_hi[half] = merge_stats(m_hi[half], sum_hi[half], st[r0 + 8 * half], m, l);
    inv_lo[half] = merge_stats(m_lo[half], sum_lo[half], make_float2(neg_inf(), 0.f), m, l);
    if (t == 0) store_lse(p, tl.b, tl.h, tl.lo_m0 + r0 + 8 * half, m, l);
  }
  if (k_blocks <= kStages) tma::named_barrier_sync_unaligned(kStatsBarrier, 256);
  T* const head = static_cast<T*>(p.p) + (static_cast<long long>(tl.b) * p.num_heads + tl.h) * p.seqlen_q * p.ld;
  #pragma unroll
  for (int c = 0; c < 4; ++c) {
    const bool hi = c < c1;
    const float inv[2] = {hi ? inv_hi[0] : inv_lo[0], hi ? inv_hi[1] : inv_lo[1]};
    store_p<T, 64>(acc[c], inv, head, m0c[c], r0, t, n0[c], 64, p);
  }
}

// The producer thread: every tile's k blocks in ring order, each stage Q's box and the K boxes (a cluster CTA its own K
// box, multicast to both; a causal pair tile both blocks' Q tiles and the wide block's keys past 256 in 64-row
// pieces).
template <typename T, int kHalfN, int kStages, int kClusterM, bool kPersistent, bool kPairTiles>
__device__ __forceinline__ void produce(const ScoresSm90Params& p, const SharedStorage<T, kHalfN, kStages>& ss,
                                        int k_blocks, unsigned rank) {
  using Smem = SharedStorage<T, kHalfN, kStages>;
  int step = 0;
  for (TileWalk<kPersistent, kPairTiles> walk(p); walk.more();) {
    const Tile<kHalfN> tl = walk.template take<kHalfN>(p);
    const int h_kv = tl.h / static_cast<int>(p.groups);
    if constexpr (kPairTiles) {
      if (tl.pair()) {
        // A causal pair tile's stage: the wide block's Q tile, K keys 0 ... 255 (the first box), keys 256 ...
        // 256 + n1 − 1 in 64-row pieces and the narrow block's Q tile in the second box's rows 192 ... 255.
        const unsigned bytes = 2 * Smem::kQBytes + Smem::kKBytes / 2 + tl.n1 * 128;
        for (int kb = 0; kb < k_blocks; ++kb, ++step) {
          const int s = ss.bars.stage(step);
          unsigned long long* full = ss.bars.acquire(s, ss.bars.phase(step), bytes);
          T* k = ss.k + s * 2 * kHalfN * 64;
          tma::load_4d(ss.q + s * kBlockM * 64, &p.tma_q, full, kb * 64, tl.m0, tl.h, tl.b);
          tma::load_4d(k, &p.tma_k, full, kb * 64, 0, h_kv, tl.b);
          for (int i = 0; i < tl.n1 / 64; ++i)
            tma::load_4d(k + (256 + 64 * i) * 64, &p.tma_k64, full, kb * 64, 256 + 64 * i, h_kv, tl.b);
          tma::load_4d(k + (256 + 192) * 64, &p.tma_q, full, kb * 64, tl.lo_m0, tl.h, tl.b);
        }
        continue;
      }
    }
    // n_vis ≤ nw (S ≤ 64, or a causal block that sees at most 64 keys): the second warpgroup sees no key. Its
    // box is not loaded; that warpgroup issues no wgmma and sets every column to −inf.
    const bool load_hi = tl.nw < tl.n_vis;
    const bool load_q = kClusterM == 1 || tl.m0 < p.seqlen_q;  // false only in a cluster's padding CTA
    const unsigned bytes = (load_q ? Smem::kQBytes : 0) + (load_hi ? Smem::kKBytes : Smem::kKBytes / 2);
    for (int kb = 0; kb < k_blocks; ++kb, ++step) {
      // With a cluster the peer's box may land before this expect_tx: the transaction count goes negative for a
      // while, and the phase still needs this arrival to complete.
      const int s = ss.bars.stage(step);
      unsigned long long* full = ss.bars.acquire(s, ss.bars.phase(step), bytes);
      if (load_q) tma::load_4d(ss.q + s * kBlockM * 64, &p.tma_q, full, kb * 64, tl.m0, tl.h, tl.b);
      T* k = ss.k + s * 2 * kHalfN * 64;
      if constexpr (kClusterM > 1) {
        if (rank == 0 || load_hi)
          tma::load_4d_multicast(k + rank * kHalfN * 64, &p.tma_k, full, 0x3, kb * 64, rank * kHalfN,
                                 h_kv, tl.b);
      } else {
        tma::load_4d(k, &p.tma_k, full, kb * 64, 0, h_kv, tl.b);
        if (load_hi) tma::load_4d(k + kHalfN * 64, &p.tma_k, full, kb * 64, tl.nw, h_kv, tl.b);
      }
    }
  }
}

// The consumer warpgroups (tid = 0 ... 255 over both): per tile the S block of their keys (k_loop, or a pair tile's
// warpgroup 1: pair_tile_wg1), the masks, the row statistics exchanged between the two, and P and lse stored.
template <typename T, int kHalfN, int kStages, int kClusterM, bool kPersistent, bool kMasked, bool kPairTiles>
__device__ __forceinline__ void consume(const ScoresSm90Params& p, const SharedStorage<T, kHalfN, kStages>& ss,
                                        int k_blocks, unsigned rank, int tid) {
  using Smem = SharedStorage<T, kHalfN, kStages>;

  const int wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int r0 = warp * 16 + g;  // this lane's rows in the block: r0 and r0 + 8
  const int S = static_cast<int>(p.seqlen_k);
  const bool causal = p.is_causal != 0;
  const float c = static_cast<float>(p.scale_log2);
  const unsigned q_base = tma::smem_u32(ss.q);
  const unsigned k_base = tma::smem_u32(ss.k) + wg * kHalfN * 128;
  int step = 0;  // the ring step of the tile's first k block
  for (TileWalk<kPersistent, kPairTiles> walk(p); walk.more(); step += k_blocks) {
    const Tile<kHalfN> tl = walk.template take<kHalfN>(p);
    const int m0 = tl.m0, h = tl.h, b = tl.b, n_vis = tl.n_vis, nw = tl.nw;
    const int n0 = wg * nw;
    const bool active = n0 < n_vis;  // some row of the block sees some key of this warpgroup
    // The tile's last stage: released after the wgmma (persistent), or P's staging, released after its TMA stores.
    const int last = ss.bars.stage(step + k_blocks - 1);

    // S block (64 × nw) = Q K_wgᵀ over the head dim (k_loop).
    float acc[kHalfN / 2];
    #pragma unroll
    for (int i = 0; i < kHalfN / 2; ++i) acc[i] = 0.f;
    if constexpr (kPairTiles) {
      if (tl.pair() && wg == 1) {  // warpgroup 0 runs a pair tile's wide block as in any tile
        pair_tile_wg1<T, kStages>(*reinterpret_cast<float (*)[4][32]>(&acc[0]), ss, tl, p, step, k_blocks, tid);
        T* const head = static_cast<T*>(p.p) + (static_cast<long long>(tl.b) * p.num_heads + tl.h) * p.seqlen_q * p.ld;
        zero_tail(head, tl.m0, tl.zero_from, tid, p);
        zero_tail(head, tl.lo_m0, tl.zero_lo_from, tid, p);
        continue;
      }
    }
    if (active) {
      k_loop_width<T, kHalfN, kHalfN, kStages, kClusterM>(nw, acc, ss, q_base, k_base, k_blocks, lane, rank, step);
    } else {
      // Nothing to multiply (every key of this warpgroup lies at or past n_vis: S ≤ 64, or causal): follow the
      // ring's phases, releasing each stage but the tile's last (in a cluster, in both CTAs) as soon as it has come,
      // so the empty barriers keep their count; the last is released with the active path's (after the wgmma in the
      // persistent kernel, after the stores where P is staged in it).
      for (int kb = 0; kb < k_blocks; ++kb) {
        ss.bars.wait(step + kb);
        __syncwarp();
        if (lane == 0 && kb + 1 < k_blocks) {
          ss.bars.arrive_empty(step + kb);
          if constexpr (kClusterM > 1) ss.bars.arrive_empty_cluster(step + kb, rank ^ 1);
        }
      }
    }
    wgmma::fence_operands(acc);
    if constexpr (kPersistent) {
      // P leaves from registers: the tile's last stage is free once this warp's wgmma have read it (k_loop's
      // wait<0>), so the producer refills all kStages stages while the softmax and the stores run.
      ss.bars.release_stage(last, lane);
    }
    // In a cluster the last stage needs no release: the producers have nothing left to load. This CTA's last access
    // to the peer's shared memory is behind it: arrive now, wait before exit (the epilogue hides the barrier).
    if constexpr (kClusterM > 1) tma::cluster_arrive();

    // Keys past S and past a row's causal limit take no part (mask_keys; the pre-test is Visibility::tile_needs_mask's,
    // spelled out with the chain's own conditions).
    if (!active || nw < kHalfN || n0 + kHalfN > S || (causal && n0 + kHalfN - 1 > m0 + p.causal_offset))
      mask_keys<kHalfN>(acc, active, n0, nw, m0, r0, t, p);
    if constexpr (kMasked) {
      if (active) add_key_mask<kHalfN>(acc, n0, nw, t, b, h, c, p);
    }

    // Row statistics, one exchange between the two warpgroups (merge_stats): each exponentiates its own keys against
    // its own row max, m_w·c, and sums them, l_w; after one barrier both read the peer's (m, l), merge, and scale
    // their P by 2^(m_w − m) / l. Without a causal mask column 0 is a key (S ≥ 1), so m is finite for finite inputs
    // (c > 0); a warpgroup whose keys a row cannot see has m_w = −inf, l_w = 0; a row that sees no key at all
    // (bottom-right causal, L > S) gets P = 0 and lse = −inf. Reuse across tiles (persistent kernel): a warpgroup
    // writes tile i + 1's statistics after tile i + 1's mainloop, whose last k block needs a ring stage released by
    // the peer in its own tile-(i + 1) K loop, i.e. after the peer has read tile i's, when k_blocks > kStages (every
    // head dim above 256, and above 192 with kHalfN = 256's three stages). With fewer k blocks the ring can hold a
    // whole tile ahead (at k_blocks = kStages the early release of tile i's last stage is the one the producer
    // needs), so a second barrier closes the exchange there.
    float m_c[2], ref[2], sum[2];
    row_max<kHalfN>(acc, c, m_c, ref);
    // P unnormalized in place: 2^(s·c − m_w·c), and this warpgroup's share of each row's sum.
    exp2_rows<kHalfN>(acc, c, ref, sum);
    float2* const st = ss.stats;
    #pragma unroll
    for (int half = 0; half < 2; ++half)
      if (t == 0) st[wg * kBlockM + r0 + 8 * half] = make_float2(m_c[half], sum[half]);
    tma::named_barrier_sync_unaligned(kStatsBarrier, 256);
    float inv[2];  // this warpgroup's P scale, 2^(m_w − m) / l
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      float m, l;
      inv[half] = merge_stats(m_c[half], sum[half], st[(wg ^ 1) * kBlockM + r0 + 8 * half], m, l);
      if (wg == 0 && t == 0) store_lse(p, b, h, m0 + r0 + 8 * half, m, l);
    }
    if (kPersistent && k_blocks <= kStages) tma::named_barrier_sync_unaligned(kStatsBarrier, 256);

    // The one-tile kernels: stores through shared memory and TMA: each warpgroup writes its 64 × nw block of P into its
    // own K box of the
    // tile's last stage (that stage's loads have landed and this warpgroup's wgmma reading it have completed; the
    // stage is not refilled before its release below), as 64-column boxes of 64 rows in the 128-byte swizzle (16-byte
    // chunk c of row r at chunk c ^ (r % 8): the 32 lanes of a 4-byte store hit 32 banks), then one thread stores the
    // boxes by TMA. The copies run asynchronously, so the tile's P bytes drain while the next tile runs (4-byte global
    // stores from registers cost far more). TMA clips the boxes to L rows, and to S keys in whole
    // 16-byte chunks: the chunk holding key S − 1 is written in full (P = 0 past S; ld is a multiple of 8, so never
    // past the row pitch), nothing else.
    // Causal: keys 2·nw ... S − 1 lie past every row's limit; they are stored from a box of zeros, the boxes split
    // between the warpgroups. There are such keys only when nw < kHalfN (2·nw < S ≤ 2·kHalfN), so the warpgroup's K
    // box has a free 64-column box past its nw keys: the zeros go there.
    using P2 = typename Pair<T>::type;
    if constexpr (kPersistent) {
      T* const head = static_cast<T*>(p.p) + (static_cast<long long>(b) * p.num_heads + h) * p.seqlen_q * p.ld;
      store_p<T, kHalfN>(acc, inv, head, m0, r0, t, n0, nw, p);
      zero_tail(head, m0, tl.zero_from, tid, p);
      if (tl.pair()) zero_tail(head, tl.lo_m0, tl.zero_lo_from, tid, p);
      continue;
    }
    unsigned char* slot = reinterpret_cast<unsigned char*>(ss.k) + last * Smem::kKBytes + wg * kHalfN * 128;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + 8 * half;
      #pragma unroll
      for (int j = 0; j < kHalfN / 8; ++j) {
        if (8 * j >= nw) break;  // columns past the warpgroup's keys (causal blocks)
        const P2 v = Pair<T>::make(acc[4 * j + 2 * half] * inv[half], acc[4 * j + 2 * half + 1] * inv[half]);
        *reinterpret_cast<P2*>(slot + (j / 8) * 8192 + r * 128 + (((j % 8) ^ (r % 8)) * 16) + 4 * t) = v;
      }
    }
    const int zero_boxes = 2 * nw < S ? (S - 2 * nw + 63) / 64 : 0;
    unsigned char* zeros = slot + (nw / 64) * 8192;
    if (zero_boxes > wg) {
      const int i0 = tid % 128;
      #pragma unroll
      for (int i = 0; i < 4; ++i) reinterpret_cast<uint4*>(zeros)[i0 + 128 * i] = make_uint4(0, 0, 0, 0);
    }
    tma::fence_proxy_async();
    tma::named_barrier_sync(kStoreBarrier + wg, 128);
    if (tid % 128 == 0) {
      for (int i = 0; i < nw / 64; ++i) tma::store_4d(&p.tma_p, slot + i * 8192, n0 + 64 * i, m0, h, b);
      for (int i = wg; i < zero_boxes; i += 2) tma::store_4d(&p.tma_p, zeros, 2 * nw + 64 * i, m0, h, b);
      tma::bulk_commit();
      tma::bulk_wait_read();
    }
  }
  if constexpr (kClusterM > 1) tma::cluster_wait();  // the peer no longer writes into or arrives on this CTA
}

// The kernel body, for one CTA (kClusterM = 1) or a cluster of two CTAs (kClusterM = 2: adjacent 64-row blocks of
// one (batch, head)) that share each K stage by TMA multicast: the CTA of rank r loads K box r (keys r·kHalfN ...
// r·kHalfN + kHalfN − 1) of every stage into both CTAs, so the head's K is read from L2 once per pair of row blocks
// instead of once per block. Each CTA's full[s] still expects the whole stage (its own Q tile, both K boxes: one
// from each producer); empty[s] counts the 8 consumer warps of both CTAs (16 arrivals), since both producers write
// into both CTAs' stage s. A CTA whose rows all lie past L (the one padding an odd number of row blocks to a pair)
// loads no Q and stores nothing, but loads its K box and keeps the barrier protocol.
// kPersistent (one CTA, no cluster): the CTA walks its tiles (TileWalk) with one ring: the producer runs ahead into
// the next tile's k blocks while the consumers finish a tile's softmax and P stores (the fixed cost per tile that a
// one-tile CTA does not overlap). Ring steps are counted across tiles
// (step = tile's first step + kb). P leaves from registers by 16-byte stores, so each warp releases a tile's last
// stage as soon as its wgmma have read it, before the softmax.
template <typename T, int kHalfN, int kStages, int kClusterM, bool kPersistent, bool kMasked = false>
__device__ __forceinline__ void scores_softmax(const ScoresSm90Params& p) {
  using Smem = SharedStorage<T, kHalfN, kStages>;
  static_assert(kHalfN % 64 == 0 && kHalfN <= 256, "K boxes of at most 256 rows, 64-row multiples");
  static_assert(kStages >= 2, "a ring of at least two stages");
  static_assert(Smem::kBytes <= sm90::kMaxSmemBytes, "227 KB of shared memory per block");
  static_assert(kClusterM == 1 || kClusterM == 2, "one CTA, or two sharing each stage's two K boxes");
  static_assert(!kPersistent || kClusterM == 1, "the persistent kernel is one CTA");
  // Causal pair tiles (Tile): the persistent kernel's 256-key tile, P stored from registers.
  constexpr bool kPairTiles = kPersistent && kHalfN == 256 && !kMasked;  // masks are never causal

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // The same offsets in every CTA of a cluster (same kernel, same dynamic shared memory base): TMA multicast and
  // remote arrivals address the peer's tiles and barriers by this CTA's offsets.
  const Smem ss(smem_raw);
  const int k_blocks = static_cast<int>((p.head_dim + 63) / 64);
  const unsigned rank = kClusterM > 1 ? tma::cluster_ctarank() : 0;

  if (threadIdx.x == 0) {
    ss.bars.init(8 * kClusterM);  // every consumer warp, of every CTA in the cluster
    tma::fence_barrier_init();
  }
  if constexpr (kClusterM > 1) {
    // The peer's TMA and consumers touch this CTA's barriers from their first stage on: initialized cluster-wide
    // before anyone starts (fence_barrier_init released them; the wait doubles as __syncthreads).
    tma::cluster_arrive_relaxed();
    tma::cluster_wait();
  } else {
    __syncthreads();
  }

  sm90::warp_specialize<sm90::RegisterSplit<2>>(
      [&](int tid) {
        if (tid == 0) {  // one thread issues every load
          tma::prefetch_map(&p.tma_q);
          tma::prefetch_map(&p.tma_k);
          produce<T, kHalfN, kStages, kClusterM, kPersistent, kPairTiles>(p, ss, k_blocks, rank);
        }
        if constexpr (kClusterM > 1) {  // the producer's last remote access (multicast) is behind it
          tma::cluster_arrive();
          tma::cluster_wait();
        }
      },
      [&](int tid) {
        consume<T, kHalfN, kStages, kClusterM, kPersistent, kMasked, kPairTiles>(p, ss, k_blocks, rank, tid);
      });
}

}  // namespace scores_sm90

// Grid (⌈L / 64⌉, Hq, B): the m-blocks of one head run side by side, so the head's K is read from L2 by all of them.
template <typename T, int kHalfN, int kStages>
__global__ void __launch_bounds__(384, 1) scores_softmax_sm90(const __grid_constant__ ScoresSm90Params p) {
  scores_sm90::scores_softmax<T, kHalfN, kStages, 1, false>(p);
}

// Grid (2·⌈L / 128⌉, Hq, B) in clusters of (2, 1, 1): CTAs 2i and 2i + 1 (row blocks of the same head) share K.
template <typename T, int kHalfN, int kStages>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(384, 1)
    scores_softmax_sm90_cluster2(const __grid_constant__ ScoresSm90Params p) {
  scores_sm90::scores_softmax<T, kHalfN, kStages, 2, false>(p);
}

// Grid (min(⌈L / 64⌉·Hq·B, SMs), 1, 1): persistent CTAs, each walking its tiles (TileWalk).
template <typename T, int kHalfN, int kStages>
__global__ void __launch_bounds__(384, 1) scores_softmax_sm90_persistent(const __grid_constant__ ScoresSm90Params p) {
  scores_sm90::scores_softmax<T, kHalfN, kStages, 1, true>(p);
}

// The persistent kernel with a key-only attn_mask (ScoresSm90Params::mask): its own instantiation, so the unmasked
// kernels' code is untouched.
template <typename T, int kHalfN, int kStages>
__global__ void __launch_bounds__(384, 1)
    scores_softmax_sm90_persistent_masked(const __grid_constant__ ScoresSm90Params p) {
  scores_sm90::scores_softmax<T, kHalfN, kStages, 1, true, true>(p);
}

}  // namespace cupy_attn
