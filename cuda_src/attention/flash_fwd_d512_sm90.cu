// Fused attention forward for head dims 257-512 on Hopper (sm_90a): out = softmax(scale · Q Kᵀ) V and
// lse = log Σ_j exp(scale · q·k_j), with an optional causal mask (top-left or bottom-right). Issue 14's route (b):
// no L × S score buffer, and causal calls skip the key blocks above the diagonal.
//
// Algorithm: FlashAttention-2's online softmax (Dao 2023) in base 2, as flash_fwd_sm90.cu computes it, with
// FlashAttention-3's producer/consumer mainloop (Shah et al. 2024, §3.1): a producer warpgroup (setmaxnreg.dec to 24)
// whose one thread issues every TMA load into a kStages-deep mbarrier ring, and two consumer warpgroups
// (setmaxnreg.inc to 240). What differs from the head-dim ≤ 256 kernel is how the two consumers share the work, since
// one warpgroup cannot hold a 64 × 512 fp32 O (256 registers a thread):
//   * both consumer warpgroups work on the same 64 query rows; warpgroup w owns O[:, 256w ... 256w + 255] (128
//     accumulator registers);
//   * S for a block of 256 keys: warpgroup w computes S[:, 128w ... 128w + 127] over the whole head dim (wgmma
//     m64n128k16, Q and K from shared memory), so each holds half of every row;
//   * the row max is exchanged once per block through shared memory (both then apply the same new max m and
//     rescale factor α = 2^(m_old − m)); each keeps its own share of the row sum, added at the end;
//   * P (64 × 256) goes to shared memory in the 128-byte swizzle, each warpgroup its 128 keys, in four parts of 32 keys
//     per warpgroup; after each part's barrier each computes O_w += P V[:, its columns] over that part's 64 keys
//     (wgmma m64n256k16, A = P and B = V MN-major, both from shared memory) while it exponentiates the next part.
// The ring carries 32 KB stages in the order the consumers read them: per key block, 8 K chunks (256 keys × 64 head-dim
// columns, one box) for S, then 8 V chunks (32 keys × 512 columns, eight 64-column boxes) for P·V, in the parts' key
// order (v_stage_key). Q (64 × 512, eight
// 64-column boxes) is loaded once per CTA.
// kVariants (one tile per CTA only: the persistent kernel spilled with them): a sliding window's lower bound (key
// blocks from the window's first, masks at its edge), ALiBi and sinks (common/visibility.cuh, common/score_mod.cuh);
// no softcap (its two SFU operations per score spilled here too).
// Mods (flash_fwd_d512_sm90_mod): a user's score_mod / mask_mod, and attn_mask read as one (cupy_attn/attention/
// mods.py), after ALiBi, with the key blocks narrowed by the mask's key ranges (common/user_mod.cuh).
// Not (yet) here: overlap of the row max and the first part's exponentials with wgmma (the rest of the softmax runs
// under P·V; deeper overlap measured slower). Accumulation fp32 (S, O, the row statistics); P is rounded to T as the
// P·V operand.
//
// Thread mapping: 384 threads. Warpgroup 0 produces; consumer warpgroup w = 0, 1 (warpgroups 1, 2): warp v, lane
// 4g + t holds rows 16v + g and 16v + g + 8 of the wgmma accumulators (columns 8j + 2t, + 1).
// Shared memory: Q 64 KB + P 32 KB + kStages × 32 KB (4: 128 KB) + barriers + row statistics + 1 KB of alignment
// slack = 232,016 bytes of the 232,448 per block.
// Inputs are read in place through 4-D tensor maps (E, seqlen, heads, batch) (cupy_attn/attention/fused_d512.py);
// rows past L or S and columns past E, Ev arrive as zeros. Keys past S and past a row's causal limit are set to −inf
// before the max; rows past L and columns past Ev are not stored. out is written by 16-byte stores (the launcher
// requires Ev a multiple of 8 and 16-byte aligned rows).
//
// History and measurements: bench/notes/kernels_flash_fwd_d512_sm90.md.
#include "common/types.cuh"
#include "common/mask.cuh"
#include "common/mma.cuh"
#include "common/wgmma.cuh"
#include "common/tma.cuh"
#include "common/pipeline.cuh"
#include "common/visibility.cuh"
#include "attention/sm90/params.cuh"
#include "common/score_mod.cuh"
#include "attention/sm90/pack.cuh"
#include "attention/sm90/softmax.cuh"
#include "attention/sm90/roles.cuh"
#include "attention/sm90/tile_scheduler.cuh"

namespace cupy_attn {
namespace d512 {

constexpr int kBlockM = 64;                  // query rows per CTA
constexpr int kBlockN = 256;                 // keys per block (128 per consumer warpgroup in S)
constexpr int kHeadDim = 512;                // Q, K, V padded by TMA's zero fill
constexpr int kKChunks = kHeadDim / 64;      // S's k loop: 64 head-dim columns (one swizzle atom) per stage
constexpr int kVKeys = 32;                   // P·V's k loop: 32 keys per stage
constexpr int kVChunks = kBlockN / kVKeys;
constexpr int kStageBytes = 32768;           // 256 × 64 or 32 × 512 16-bit elements
constexpr int kQBytes = kBlockM * kHeadDim * 2;
constexpr int kPBytes = kBlockM * kBlockN * 2;
// Named barriers (256 consumer threads): the row-max exchange, P written, the row-sum exchange.
constexpr int kMaxBarrier = 1, kPBarrier = 2, kSumBarrier = 3;

template <int kStages>
struct SharedStorage {
  static constexpr int kBytes = kQBytes + kPBytes + kStages * kStageBytes + 8 * (2 * kStages + 2) +
                                4 * (2 * 2 * kBlockM + 2 * kBlockM) + 1024;
  static_assert(kBytes <= sm90::kMaxSmemBytes && kStages >= 2, "a ring of at least two stages in 227 KB");
  unsigned char* q;     // 8 boxes of 64 rows × 64 columns (8 KB each), 128-byte swizzle
  unsigned char* p;     // 4 atoms of 64 rows × 64 keys (8 KB each), 128-byte swizzle: the P·V A operand
  unsigned char* ring;  // kStages × 32 KB
  pipeline::Ring<kStages> bars;  // empty: 8 arrivals, lane 0 of each consumer warp
  pipeline::Slot q_bars;         // Q of a tile; empty: both consumers are done with it (8 warp arrivals)
  float* row_max;       // [block parity][warpgroup][row]: the warpgroup's max of S over its keys (unscaled)
  float* row_sum;       // [warpgroup][row]: the warpgroup's share of l

  __device__ __forceinline__ explicit SharedStorage(unsigned char* base) {
    q = sm90::smem_base(base);
    p = q + kQBytes;
    ring = p + kPBytes;
    bars.full = reinterpret_cast<unsigned long long*>(ring + kStages * kStageBytes);
    bars.empty = bars.full + kStages;
    q_bars.full = bars.empty + kStages;
    q_bars.empty = q_bars.full + 1;
    row_max = reinterpret_cast<float*>(q_bars.empty + 1);
    row_sum = row_max + 2 * 2 * kBlockM;
  }
};

// P·V in parts: a block's P goes to shared memory in kPParts parts of 128 / kPParts keys per warpgroup, each followed
// by the P·V stages of its keys, so the exponentials of part k + 1 run under the wgmma of part k (only the first
// part's are exposed).
constexpr int kPParts = 4;
static_assert(kPParts == 1 || kPParts == 2 || kPParts == 4, "P in 1, 2 or 4 parts");

// The first key (within the block) of P·V stage vc (32 keys): part vc / (8 / kPParts) takes 128 / kPParts keys from
// each warpgroup's half of the block, warpgroup 0's first. The producer loads V in this order.
template <int kParts>
__device__ __forceinline__ int v_stage_key(int vc) {
  constexpr int per = kVChunks / kParts, half = per / 2;
  const int part = vc / per, i = vc % per;
  return (i < half ? 0 : kBlockN / 2) + part * (kBlockN / 2 / kParts) + (i % half) * kVKeys;
}

// The kernel's Visibility: with kVariants the window's lower bound (window_lo) is read at run time; the plain
// instantiations have none, at compile time.
template <bool kVariants>
__device__ __forceinline__ Visibility d512_visibility(const FlashFwdSm90Params& p) {
  if constexpr (kVariants) {
    return visibility_of(p);
  } else {
    return {p.seqlen_k, p.causal_offset, p.is_causal != 0};
  }
}

// Key blocks a 64-row block visits: from the block of the first key its first row sees (0 without a window's lower
// bound) through the last key any of its rows may see (all S without a causal mask); count() <= 0 when its rows see
// no key.
// range: a mask_mod's KeyRanges entry covering the block's rows (common/user_mod.cuh; nullptr: none) narrows the keys.
template <bool kVariants>
__device__ __forceinline__ KeyBlocks key_blocks(const FlashFwdSm90Params& p, int m0, const int* range = nullptr) {
  const Visibility vis = d512_visibility<kVariants>(p);
  long long last_key = vis.last_key(min(static_cast<long long>(m0 + kBlockM), p.seqlen_q) - 1);
  long long first_key = vis.first_key(m0);
  if (range != nullptr) {
    first_key = max(first_key, static_cast<long long>(range[0]));
    last_key = min(last_key, static_cast<long long>(range[1]));
  }
  return last_key < first_key ? KeyBlocks{0, -1} : vis.blocks<kBlockN>(first_key, last_key);
}

// FlashAttention-4's conditional rescale: the running max (and with it O and l) moves only when a block's max exceeds
// it by more than kLazySlack in log2 units, so P ≤ 2^kLazySlack (fp16/bf16 hold it with the same relative precision
// as values in [0, 1]); most blocks then skip O's 128 multiplications per thread.
constexpr float kLazySlack = 8.f;

// The CTA's tiles (m0, h, b): its one tile (grid (⌈L / 64⌉, Hq, B), causal row blocks longest first), or with
// kPersistent sm90/tile_scheduler.cuh's static striding (causal: m-block pairs (M−1−k, k) of equal cost when
// p.tile_pairs). The producer thread and the consumers each walk their own copy.
template <bool kPersistent>
struct TileWalk {
  sm90::StaticTileScheduler<kBlockM> sched;
  bool one_left = true;
  __device__ __forceinline__ explicit TileWalk(const FlashFwdSm90Params& p) : sched(p) {}
  __device__ __forceinline__ bool next(const FlashFwdSm90Params& p, int& m0, int& h, int& b) {
    if constexpr (kPersistent) {
      if (!sched.valid()) return false;
      const sm90::WorkTile w = sched.tile();
      sched.advance();
      m0 = w.m_block * kBlockM;
      h = w.h;
      b = w.b;
    } else {
      if (!one_left) return false;
      one_left = false;
      m0 = (p.is_causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * kBlockM;
      h = blockIdx.y;
      b = blockIdx.z;
    }
    return true;
  }
};

// The producer thread. Per tile with keys to see: Q once its previous contents are released (q_bars), then per key
// block the 8 K chunks and the 8 V chunks in the order the consumers read them.
template <int kStages, bool kVariants, typename Tiles>
__device__ __forceinline__ void produce(const FlashFwdSm90Params& p, const SharedStorage<kStages>& ss, Tiles& tiles,
                                        const KeyRanges* kr = nullptr) {
  tma::prefetch_map(&p.tma_q);
  tma::prefetch_map(&p.tma_k);
  tma::prefetch_map(&p.tma_v);
  int step = 0, q_round = 0;
  auto stage = [&]() -> unsigned char* {
    ss.bars.acquire(step, kStageBytes);
    return ss.ring + ss.bars.stage(step) * kStageBytes;
  };
  for (int m0, h, b; tiles.next(p, m0, h, b);) {
    const int h_kv = h / static_cast<int>(p.groups);
    const KeyBlocks kb = key_blocks<kVariants>(p, m0, kr ? kr->of(b, h, m0) : nullptr);
    const int n_blocks = kb.count();
    if (n_blocks <= 0) continue;  // no key to see (bottom-right, L > S): the consumers write the empty rows
    ss.q_bars.wait_free(q_round);
    tma::mbar_arrive_expect_tx(ss.q_bars.full, kQBytes);
    for (int i = 0; i < kKChunks; ++i)
      tma::load_4d(ss.q + i * 8192, &p.tma_q, ss.q_bars.full, i * 64, m0, h, b);
    ++q_round;
    for (int i = 0; i < n_blocks; ++i) {
      const int j = kb.first + i;
      for (int c = 0; c < kKChunks; ++c, ++step) {
        unsigned char* dst = stage();
        tma::load_4d(dst, &p.tma_k, &ss.bars.full[ss.bars.stage(step)], c * 64, j * kBlockN, h_kv, b);
      }
      for (int c = 0; c < kVChunks; ++c, ++step) {
        unsigned char* dst = stage();
        #pragma unroll
        for (int i = 0; i < kHeadDim / 64; ++i)
          tma::load_4d(dst + i * (kVKeys * 128), &p.tma_v, &ss.bars.full[ss.bars.stage(step)], i * 64,
                       j * kBlockN + v_stage_key<kPParts>(c), h_kv, b);
      }
    }
  }
}

// One consumer thread (tid over both consumer warpgroups, 0 ... 255) and its walk over the ring: the phases of a key
// block (s_block, mask, rescale, pv_parts) and of a tile's end (store).
// Mod (common/user_mod.cuh; with kVariants): a user's score_mod / mask_mod after ALiBi, before the masks (aux: its
// arrays in the kernel's parameters); kr: its key ranges (nullptr: none).
template <typename T, int kStages, bool kVariants, typename Mod = NoMod>
struct Consumer {
  using P2 = typename sm90::Pair<T>::type;
  using Smem = SharedStorage<kStages>;
  using Params = FlashFwdSm90Params;
  int wg, warp, lane, g, t;
  int r0;  // this lane's rows in the block: r0 and r0 + 8
  float c;
  unsigned q_base, p_base, ring_base;
  int step = 0, q_round = 0, blk = 0;  // blk: key blocks done by this CTA (row-max buffer parity across tiles)

  __device__ __forceinline__ Consumer(const Params& p, const Smem& ss, int tid) {
    wg = tid / 128;
    warp = (tid / 32) % 4;
    lane = tid % 32;
    g = lane / 4;
    t = lane % 4;
    r0 = warp * 16 + g;
    c = static_cast<float>(p.scale_log2);
    q_base = tma::smem_u32(ss.q);
    p_base = tma::smem_u32(ss.p);
    ring_base = tma::smem_u32(ss.ring);
  }
  // Wait for the stage of ring step `step` to land.
  __device__ __forceinline__ unsigned wait_full(const Smem& ss) const {
    ss.bars.wait(step);
    return ring_base + ss.bars.stage(step) * kStageBytes;
  }
  // The stage of ring step st is read: lane 0 of each warp releases it (after its wgmma have completed).
  __device__ __forceinline__ void release(const Smem& ss, int st) const { ss.bars.release(st, lane); }

  // S (64 × 128, this warpgroup's keys) = Q K_wᵀ over the head dim; wait<1> after each stage's commit: the previous
  // stage's wgmma are complete and it is released while this one runs.
  //
  // Two head-dim chunks per loop trip in the plain kernels: left to itself the compiler keeps one, and the persistent
  // kernel then ran 4-7% slower than with two (bench/ab.py). The variants' kernel keeps one: with two it spills 8 bytes.
  __device__ __forceinline__ void s_block(const Smem& ss, float (&s)[64]) {
    #pragma unroll (kVariants ? 1 : 2)
    for (int kc = 0; kc < kKChunks; ++kc, ++step) {
      const unsigned k_st = wait_full(ss) + wg * 128 * 128;
      wgmma::fence();
      #pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma::Mma<T, 128>::ss(s, wgmma::desc_sw128(q_base + kc * 8192 + kk * 32, 16, 1024),
                               wgmma::desc_sw128(k_st + kk * 32, 16, 1024), kc > 0 || kk > 0);
      wgmma::commit();
      wgmma::wait<1>();
      if (kc > 0) release(ss, step - 1);
    }
    wgmma::wait<0>();
    release(ss, step - 1);
    wgmma::fence_operands(s);
  }

  // kVariants: ALiBi (common/score_mod.cuh) on the block's scores, before the mask. Row r0 + 8·half, key key0 + 8jj +
  // 2t + e. No softcap here: its two SFU operations per score pushed this kernel's consumers (o and s take 192 of
  // their 240 registers) into spilling; softcapped calls at head dims above 256 take the split path.
  __device__ __forceinline__ void score_mods(const Params& p, float (&s)[64], int j, int m0, int h, int b) const {
    const float slope = p.alibi_slopes ? p.alibi_slopes[b * p.alibi_stride_b + h] : 0.f;
    const ScoreMods mods{0.f, -slope * static_cast<float>(p.alibi_scale), static_cast<int>(p.seqlen_k - p.seqlen_q)};
    sm90::apply_score_mods<128>(s, mods, m0 + r0, j * kBlockN + wg * 128, t);
  }

  // Keys past each row's last visible key (common/visibility.cuh): −inf. s[4jj + 2·half + e] is row r0 + 8·half, key
  // key0 + 8jj + 2t + e; only a tile reaching past S or the causal limit of the block's first row has any. kVariants:
  // keys before a window's lower bound too (only a tile reaching below the block's last row's first key has any).
  __device__ __forceinline__ void mask(const Params& p, float (&s)[64], int j, int m0) const {
    const Visibility vis = d512_visibility<false>(p);  // the upper bound; the lower one below
    const int key0 = j * kBlockN + wg * 128;
    if constexpr (kVariants) {
      if (p.window_lo != kNoLowerBound && key0 < m0 + kBlockM - 1 + p.window_lo)
        sm90::mask_tile_lower<128>(s, m0 + r0, key0, t, p.window_lo);
    }
    if (vis.tile_needs_mask<128>(key0, m0)) {
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int lim = vis.lane_limit<128>(m0 + r0 + 8 * half, key0, 2 * t);  // visible iff 8jj + e <= lim
        #pragma unroll
        for (int jj = 0; jj < 16; ++jj)
          #pragma unroll
          for (int e = 0; e < 2; ++e)
            if (8 * jj + e > lim) s[4 * jj + 2 * half + e] = neg_inf();
      }
    }
  }

  // The block's row max: this warpgroup's (a quad shuffle), then the peer's through shared memory (buffers alternate
  // by block parity: the peer read this buffer two blocks ago, before the P barrier in between). The running max
  // m_run moves lazily (kLazySlack); l is rescaled by α here, O by pv_parts. ref: the exponentials' reference, the
  // running max (0 while a row has seen no key).
  __device__ __forceinline__ void rescale(const Smem& ss, const float (&s)[64], float (&m_run)[2], float (&l_part)[2],
                                          float (&alpha)[2], float (&ref)[2]) const {
    float mx[2] = {neg_inf(), neg_inf()};
    #pragma unroll
    for (int jj = 0; jj < 16; ++jj)
      #pragma unroll
      for (int half = 0; half < 2; ++half)
        mx[half] = fmaxf(mx[half], fmaxf(s[4 * jj + 2 * half], s[4 * jj + 2 * half + 1]));
    float* const mbuf = ss.row_max + (blk & 1) * 2 * kBlockM;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 1));
      mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 2));
      if (t == 0) mbuf[wg * kBlockM + r0 + 8 * half] = mx[half];
    }
    tma::named_barrier_sync(kMaxBarrier, 256);
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float m_blk = fmaxf(mx[half], mbuf[(wg ^ 1) * kBlockM + r0 + 8 * half]);
      float m_new = fmaxf(m_run[half], m_blk * c);
      if (m_new <= m_run[half] + kLazySlack) m_new = m_run[half];  // −inf + 8 = −inf: a first key moves it
      alpha[half] = m_new == m_run[half] ? 1.f : exp2_approx(m_run[half] - m_new);  // −inf → −inf: 1, not NaN
      ref[half] = m_new == neg_inf() ? 0.f : m_new;  // a row that has seen no key yet: P = 2^−inf = 0
      m_run[half] = m_new;
    }
    #pragma unroll
    for (int half = 0; half < 2; ++half) l_part[half] *= alpha[half];
  }

  // O *= α, skipped when no row of the warp moved its max.
  __device__ __forceinline__ static void rescale_o(float (&o)[128], const float (&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
      #pragma unroll
      for (int jj = 0; jj < 32; ++jj)
        #pragma unroll
        for (int half = 0; half < 2; ++half)
          #pragma unroll
          for (int e = 0; e < 2; ++e) o[4 * jj + 2 * half + e] *= alpha[half];
    }
  }

  // The block's P in kPParts parts of 128 / kPParts keys per warpgroup. Part k: P = 2^(s·c − m) of those keys in
  // place (and this lane's share of the sum), into shared memory, a barrier, then the P·V stages of those keys from
  // both warpgroups (v_stage_key): the next part's exponentials run while that part's wgmma do.
  // P into shared memory: both warpgroups have finished the previous block's P·V (each waited for its wgmma before
  // the max barrier just passed). Key column kc = 128w + 8jj + 2t of row r: atom kc / 64, 16-byte chunk
  // (kc % 64) / 8 at chunk ^ (r % 8) (the 32 lanes of a store hit 32 banks).
  // O is rescaled (rescale_o) after part 0's P stores, which do not depend on it: written before them, ptxas issued
  // the 128 multiplications first and the stores' latency was not hidden behind them.
  __device__ __forceinline__ void pv_parts(const Smem& ss, float (&s)[64], float (&o)[128], float (&l_part)[2],
                                           const float (&alpha)[2], const float (&ref)[2]) {
    constexpr int kJJ = 16 / kPParts, kPartStages = kVChunks / kPParts;
    #pragma unroll
    for (int part = 0; part < kPParts; ++part) {
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        float sum = 0.f;
        #pragma unroll
        for (int jj = part * kJJ; jj < (part + 1) * kJJ; ++jj)
          #pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[4 * jj + 2 * half + e];
            x = exp2_approx(fmaf(x, c, -ref[half]));
            sum += x;
          }
        l_part[half] += sum;
      }
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = r0 + 8 * half;
        #pragma unroll
        for (int jj = part * kJJ; jj < (part + 1) * kJJ; ++jj) {
          const P2 v = sm90::Pair<T>::make(s[4 * jj + 2 * half], s[4 * jj + 2 * half + 1]);
          *reinterpret_cast<P2*>(ss.p + (2 * wg + jj / 8) * 8192 + r * 128 + (((jj % 8) ^ (r % 8)) * 16) + 4 * t) = v;
        }
      }
      if (part == 0) rescale_o(o, alpha);
      tma::fence_proxy_async();  // the generic-proxy stores before the wgmma (async proxy) reads
      tma::named_barrier_sync(kPBarrier, 256);

      // O_w (64 × 256) += P V[:, 256w ...]: per stage 32 keys, two k steps of 16; V is the MN-major B operand (eight
      // 64-column boxes of 32 rows: LBO 4 KB between them, SBO 1 KB between 8-row groups).
      #pragma unroll
      for (int i = 0; i < kPartStages; ++i, ++step) {
        const int vc = part * kPartStages + i;
        const unsigned v_st = wait_full(ss) + wg * 4 * (kVKeys * 128);
        wgmma::fence();
        #pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const int k0 = v_stage_key<kPParts>(vc) + kk * 16;
          wgmma::Mma<T, 256>::ss_bmn(o, wgmma::desc_sw128(p_base + (k0 / 64) * 8192 + (k0 % 64) * 2, 16, 1024),
                                     wgmma::desc_sw128(v_st + kk * 16 * 128, kVKeys * 128, 1024), 1);
        }
        wgmma::commit();
        wgmma::wait<1>();
        if (vc > 0) release(ss, step - 1);
      }
    }
    wgmma::wait<0>();
    release(ss, step - 1);
    wgmma::fence_operands(o);
  }

  // Epilogue: l = the two warpgroups' shares (added in the same order by both), out = O / l, lse = (m + log2 l)·ln 2.
  // A row that saw no key (bottom-right, L > S) has l = 0: out 0, lse −inf. out by 16-byte stores: a quad's
  // transpose gives lane t the 8 consecutive columns 32i + 8t ... + 7.
  __device__ __forceinline__ void store(const Params& p, const Smem& ss, const float (&o)[128],
                                        const float (&m_in)[2], const float (&l_part)[2], int m0, int h, int b) const {
    float m_run[2] = {m_in[0], m_in[1]};
    float inv[2];
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = l_part[half];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (t == 0) ss.row_sum[wg * kBlockM + r0 + 8 * half] = l;
    }
    tma::named_barrier_sync(kSumBarrier, 256);
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + 8 * half;
      float l = __fadd_rn(ss.row_sum[r], ss.row_sum[kBlockM + r]);
      if constexpr (kVariants) {  // the sink's term joins the row sum (a row that saw no key: lse = the sink)
        if (p.sinks) add_sink(m_run[half], l, sink_log2<T>(p.sinks, p.sinks_kind, h));
      }
      inv[half] = l > 0.f ? 1.f / l : 0.f;
      const int row = m0 + r;
      if (wg == 0 && t == 0 && p.lse != nullptr && row < p.seqlen_q)
        p.lse[b * p.lse_stride_b + h * p.lse_stride_h + row * p.lse_stride_l] =
            l > 0.f ? (m_run[half] + __log2f(l)) * kLn2 : neg_inf();
    }
    T* const out = static_cast<T*>(p.out) + b * p.out_stride_b + h * p.out_stride_h;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m0 + r0 + 8 * half;
      T* const o_row = out + static_cast<long long>(row) * p.out_stride_l;
      #pragma unroll
      for (int i = 0; i < 8; ++i) {
        unsigned w[4];
        #pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int jj = 4 * i + u;
          const P2 v = sm90::Pair<T>::make(o[4 * jj + 2 * half] * inv[half], o[4 * jj + 2 * half + 1] * inv[half]);
          w[u] = *reinterpret_cast<const unsigned*>(&v);
        }
        sm90::quad_transpose(w, t);
        const int col = wg * 256 + 32 * i + 8 * t;
        if (row < p.seqlen_q && col < p.head_dim_v)
          *reinterpret_cast<uint4*>(o_row + col) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }

  // One tile: its key blocks, then the epilogue. The persistent kernel's next tile writes row_sum only after both
  // warpgroups have read this one's (a tile without key blocks reaches them with no barrier in between).
  template <bool kPersistent>
  __device__ __forceinline__ void tile(const Params& p, const Smem& ss, int m0, int h, int b,
                                       const typename Mod::Aux* aux = nullptr, const KeyRanges* kr = nullptr) {
    const int* range = kr ? kr->of(b, h, m0) : nullptr;
    const KeyBlocks kb = key_blocks<kVariants>(p, m0, range);
    const int n_blocks = kb.count();
    // The tile's full run of keys (KeyRanges), read once: its key blocks skip the mask_mod.
    [[maybe_unused]] int full_lo = 0, full_hi = -1;
    if constexpr (Mod::kMask) {
      if (range != nullptr) {
        full_lo = range[2];
        full_hi = range[3];
      }
    }
    float o[128];
    #pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m_run[2] = {neg_inf(), neg_inf()};  // running row max, times c
    float l_part[2] = {0.f, 0.f};              // this lane's share of the row sum, relative to m_run
    if (n_blocks > 0) ss.q_bars.wait(q_round++);
    for (int i = 0; i < n_blocks; ++i, ++blk) {
      const int j = kb.first + i;
      float s[64];
      s_block(ss, s);
      if (i == n_blocks - 1) ss.q_bars.release(lane);  // the tile's last S: Q may be reloaded for the next tile
      if constexpr (kVariants) score_mods(p, s, j, m0, h, b);
      if constexpr (Mod::kScore || Mod::kMask)
        sm90::apply_user_mod<128, Mod>(s, *aux, b, h, m0 + r0, j * kBlockN + wg * 128, t,
                                       static_cast<float>(p.scale_log2), static_cast<int>(p.seqlen_q),
                                       static_cast<int>(p.seqlen_k),
                                       !(j * kBlockN + wg * 128 >= full_lo && j * kBlockN + wg * 128 + 127 <= full_hi));
      mask(p, s, j, m0);
      float alpha[2], ref[2] = {0.f, 0.f};
      rescale(ss, s, m_run, l_part, alpha, ref);
      pv_parts(ss, s, o, l_part, alpha, ref);
    }
    store(p, ss, o, m_run, l_part, m0, h, b);
    if constexpr (kPersistent) tma::named_barrier_sync(kSumBarrier, 256);
  }
};

}  // namespace d512

// Grid (⌈L / 64⌉, Hq, B), causal row blocks longest first, or with kPersistent (min(units, SMs), 1, 1). Block: 384
// threads. kPersistent: each CTA walks the units blockIdx.x, + gridDim.x, ... of sm90/tile_scheduler.cuh (row block
// fastest; causal calls with more tiles than SMs in m-block pairs (M−1−k, k)); the producer loads the next tile's Q
// once both consumers are done with the current one's (q_bars) and its K stages while they finish the tile's last
// P·V and store O. Otherwise one tile per CTA.
template <typename T, int kStages, bool kPersistent, bool kVariants, typename Mod = NoMod>
__device__ __forceinline__ void flash_fwd_d512_body(const FlashFwdSm90Params& p,
                                                    const typename Mod::Aux* aux = nullptr,
                                                    const KeyRanges* kr = nullptr) {
  using namespace d512;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const SharedStorage<kStages> ss(smem_raw);
  TileWalk<kPersistent> tiles(p);
  pipeline::init_barriers([&] {
    ss.bars.init(8);  // lane 0 of each consumer warp
    ss.q_bars.init(8);
  });
  sm90::warp_specialize<sm90::RegisterSplit<2>>(
      [&](int tid) {
        if (tid == 0) produce<kStages, kVariants>(p, ss, tiles, kr);  // one thread issues the loads
      },
      [&](int tid) {
        Consumer<T, kStages, kVariants, Mod> consumer(p, ss, tid);
        for (int m0, h, b; tiles.next(p, m0, h, b);) consumer.template tile<kPersistent>(p, ss, m0, h, b, aux, kr);
      });
}

template <typename T, int kStages, bool kPersistent, bool kVariants>
__global__ void __launch_bounds__(384, 1) flash_fwd_d512_sm90(const __grid_constant__ FlashFwdSm90Params p) {
  flash_fwd_d512_body<T, kStages, kPersistent, kVariants>(p);
}

// A user's mods (cupy_attn.AttentionMod) with the variants' code, one tile per CTA as the variants: instantiated only
// in a mod's own program, which appends the Mod struct (attention/mods.py).
template <typename T, int kStages, typename Mod>
__global__ void __launch_bounds__(384, 1)
    flash_fwd_d512_sm90_mod(const __grid_constant__ ModParams<FlashFwdSm90Params, Mod> p) {
  flash_fwd_d512_body<T, kStages, false, true, Mod>(p, &p.aux, &p.key_ranges);
}

}  // namespace cupy_attn
