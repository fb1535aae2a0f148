// out = P V for the split path's scores kernel (scores_sm90.cu) on Hopper (sm_90a), skipping the keys past
// each row block's causal limit: the P·V half of a causal call at head dims above 256 and S ≤ 512, in one launch.
//
// Why not cuBLAS: a batched GEMM multiplies every key of every row. The split path cut causal P·V into two row bands
// (two cuBLAS launches: 3/4 of the work), but the second band re-reads V from DRAM, and bands of 128 rows or fewer
// are slow in cuBLAS: at the seed's causal variant the two bands took as long as the full product
// (bench/notes/kernels_pv_sm90.md). Here every 64-row block multiplies
// only the 64-key steps holding its visible keys (9/16 of the work at L = S = 512), and a head's tiles run side by
// side, so its V crosses from DRAM about once.
//
// Algorithm: a persistent GEMM with FlashAttention-3's producer/consumer pipeline (Shah et al. 2024, §3.1): a
// producer warpgroup (setmaxnreg.dec to 24) whose one thread issues every TMA load into a kStages-deep mbarrier ring,
// two consumer warpgroups (setmaxnreg.inc to 240). A tile is 128 query rows × 256 columns of out; consumer warpgroup
// w owns rows 64w ... 64w + 63 (m64n256 fp32 accumulators, 128 registers a thread). A stage holds 64 keys: P (128 rows
// × 64 keys, one 128-byte-swizzled box) and V (64 keys × 256 columns, four 64-column boxes); each warpgroup issues
// four wgmma m64n256k16 per stage (A = its 64 rows of P, K-major; B = V, MN-major: wgmma::Mma::ss_bmn). Warpgroup w
// stops after the stages holding its block's visible keys and stores its rows while the other finishes.
//
// P's keys past a row's limit are 0 (the scores kernel writes them up to its block's visible keys rounded up to 64:
// 2·nw or a pair tile's widths); keys past S and rows past L arrive as zeros from TMA's bounds. Row blocks whose rows
// see no key (bottom-right, L > S) store zeros, as the reference's 0 rows.
// Tiles (m tile, n tile, head, batch) are walked by static striding over one CTA per SM, with a head's tiles
// adjacent (its V and P stay in L2 while its tiles run) and its m tiles heaviest first.
//
// Thread mapping: 384 threads. Warpgroup 0 produces; consumer warpgroup w = 0, 1 (warpgroups 1, 2): warp v, lane 4g + t
// holds rows 64w + 16v + g and + 8 of the tile, columns 8j + 2t, + 1 (the wgmma accumulator layout).
// Tiles: 128 × 256 of out (wgmma's widest N, as cuBLAS's 128 × 256 tiles: per k step the shared-memory port carries
// 48 KB of TMA writes and 2 × 40 KB of operand reads), 64 keys per stage; shared memory kStages × 48 KB (4: 192 KB) +
// 2·kStages barriers + 1 KB of alignment slack. Accumulation fp32; out rounded to T once.
// out is written by 16-byte stores (the launcher requires Ev a multiple of 8 and 16-byte aligned rows).
// History and measurements: bench/notes/kernels_pv_sm90.md.
#include "common/types.cuh"
#include "common/wgmma.cuh"
#include "common/tma.cuh"
#include "common/pipeline.cuh"
#include "common/visibility.cuh"
#include "attention/sm90/roles.cuh"
#include "attention/sm90/pack.cuh"

namespace cupy_attn {

struct PvSm90Params {
  tma::TensorMap tma_p;   // P (S, L, Hq, B) in the input dtype, rows `ld` apart: box 64 keys × 128 rows
  tma::TensorMap tma_v;   // V (Ev, S, Hkv, B): box 64 columns × 64 keys
  void* out;              // (B, Hq, L, Ev) by the strides below, in elements
  long long out_stride_b, out_stride_h, out_stride_l;
  long long seqlen_q, seqlen_k, head_dim_v, groups, num_heads, batch;
  long long is_causal, causal_offset;  // key j visible to row i iff j ≤ i + causal_offset (0, or S − L bottom-right)
};

namespace pv {

constexpr int kBlockM = 128;  // query rows per tile, 64 per consumer warpgroup
constexpr int kBlockN = 256;  // out columns per tile
constexpr int kBlockK = 64;   // keys per stage
constexpr int kPBytes = kBlockM * kBlockK * 2;  // two 8 KB atoms of 64 rows
constexpr int kVBytes = kBlockK * kBlockN * 2;  // four 8 KB boxes of 64 keys × 64 columns
constexpr int kStageBytes = kPBytes + kVBytes;

template <int kStages>
struct SharedStorage {
  static constexpr int kBytes = kStages * kStageBytes + 8 * 2 * kStages + 1024;
  static_assert(kBytes <= sm90::kMaxSmemBytes && kStages >= 2, "a ring of at least two stages in 227 KB");
  unsigned char* ring;
  pipeline::Ring<kStages> bars;  // full: the stage's P and V boxes; empty: 8 arrivals, lane 0 of each consumer warp
  __device__ __forceinline__ explicit SharedStorage(unsigned char* base) {
    ring = sm90::smem_base(base);
    bars.full = reinterpret_cast<unsigned long long*>(ring + kStages * kStageBytes);
    bars.empty = bars.full + kStages;
  }
};

// Key steps of the 64-row block at m0: its visible keys (those of its last row inside L; scores_sm90.cu's
// visible_keys) in steps of 64. 0 for a block past L or whose rows see no key.
__device__ __forceinline__ int key_steps(const PvSm90Params& p, long long m0) {
  if (m0 >= p.seqlen_q) return 0;
  long long n = p.seqlen_k;
  if (p.is_causal) {
    const long long last_row = min(m0 + kBlockM / 2, p.seqlen_q) - 1;
    n = max(0ll, Visibility{n, p.causal_offset, true}.end_key(last_row));
  }
  return static_cast<int>((n + kBlockK - 1) / kBlockK);
}

// The producer thread: per tile, the key steps of its wider block, each stage P's box and V's four.
template <int kStages, typename Tile>
__device__ __forceinline__ void produce(const PvSm90Params& p, const SharedStorage<kStages>& ss, int count,
                                        const Tile& tile) {
  tma::prefetch_map(&p.tma_p);
  tma::prefetch_map(&p.tma_v);
  int step = 0;
  for (int t = blockIdx.x; t < count; t += gridDim.x) {
    int m0, n0, h, b;
    tile(t, m0, n0, h, b);
    const int h_kv = h / static_cast<int>(p.groups);
    const int steps = max(key_steps(p, m0), key_steps(p, m0 + kBlockM / 2));
    for (int k = 0; k < steps; ++k, ++step) {
      unsigned long long* full = ss.bars.acquire(step, kStageBytes);
      unsigned char* dst = ss.ring + ss.bars.stage(step) * kStageBytes;
      tma::load_4d(dst, &p.tma_p, full, k * kBlockK, m0, h, b);
      #pragma unroll
      for (int i = 0; i < kBlockN / 64; ++i)
        tma::load_4d(dst + kPBytes + i * (kBlockK * 128), &p.tma_v, full, n0 + i * 64, k * kBlockK, h_kv, b);
    }
  }
}

// One consumer warpgroup (tid over both, 0 ... 255): its 64-row block of every tile.
template <typename T, int kStages, typename Tile>
__device__ __forceinline__ void consume(const PvSm90Params& p, const SharedStorage<kStages>& ss, int count,
                                        const Tile& tile, int tid) {
  const int wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int r0 = warp * 16 + g;  // this lane's rows in the warpgroup's block: r0 and r0 + 8
  const unsigned ring_base = tma::smem_u32(ss.ring);
  int step = 0;
  auto wait_full = [&]() -> unsigned {
    ss.bars.wait(step);
    return ring_base + ss.bars.stage(step) * kStageBytes;
  };
  // The stage of ring step st is read: lane 0 of each warp releases it (after its wgmma have completed).
  auto release = [&](int st) { ss.bars.release(st, lane); };
  // A tile's out rows wait packed (this lane's 2 × 32 words of T pairs) until the next tile's first wgmma are issued,
  // and are stored under them: the stores leave the tensor pipe's critical path.
  unsigned packed[2][32];
  T* pend_out = nullptr;  // the packed rows' first row (this lane's r0) in out; nullptr: none
  long long pend_row = 0;
  int pend_n0 = 0;
  auto store_pending = [&]() {
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      const long long row = pend_row + 8 * half;
      sm90::store_row_half<T, 256>(packed[half], pend_out + 8 * half * p.out_stride_l,
                                   row < p.seqlen_q, pend_n0, p.head_dim_v, t);
    }
    pend_out = nullptr;
  };
  for (int tt = blockIdx.x; tt < count; tt += gridDim.x) {
    int m0, n0, h, b;
    tile(tt, m0, n0, h, b);
    const int steps = max(key_steps(p, m0), key_steps(p, m0 + kBlockM / 2));
    const int mine = key_steps(p, m0 + wg * (kBlockM / 2));  // ≤ steps: a later block sees at least as many keys
    float o[128];
    // One k step: four wgmma m64n256k16 on the stage; the tile's first k step overwrites the accumulators.
    auto mma_step = [&](int k) {
      const unsigned st = wait_full();
      wgmma::fence();
      #pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk)
        wgmma::Mma<T, 256>::ss_bmn(o, wgmma::desc_sw128(st + wg * 8192 + kk * 32, 16, 1024),
                                   wgmma::desc_sw128(st + kPBytes + kk * 16 * 128, kBlockK * 128, 1024),
                                   k > 0 || kk > 0);
      wgmma::commit();
    };
    if (mine > 0) {  // the first k step apart: the previous tile's packed rows are stored under its wgmma
      mma_step(0);
      if (pend_out != nullptr) store_pending();
      ++step;
    }
    for (int k = 1; k < mine; ++k, ++step) {
      mma_step(k);
      wgmma::wait<1>();
      release(step - 1);
    }
    wgmma::wait<0>();
    if (mine > 0) release(step - 1);
    wgmma::fence_operands(o);
    if (pend_out != nullptr) store_pending();  // no wgmma in this tile to hide them under
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (mine > 0) {
        sm90::pack_row_half<T, 256>(o, half, 1.f, packed[half]);
      } else {  // rows that see no key: out 0
        #pragma unroll
        for (int i = 0; i < 32; ++i) packed[half][i] = 0u;
      }
    }
    pend_row = m0 + wg * (kBlockM / 2) + r0;
    pend_n0 = n0;
    pend_out = static_cast<T*>(p.out) + b * p.out_stride_b + h * p.out_stride_h + pend_row * p.out_stride_l;
    // The stages this warpgroup does not read (the other block's extra keys): waited for, so that this warpgroup's
    // arrivals stay in the ring's round (an early arrival would count toward the previous round's release), and
    // released.
    for (int k = mine; k < steps; ++k, ++step) {
      wait_full();
      release(step);
    }
  }
  if (pend_out != nullptr) store_pending();
}

}  // namespace pv

template <typename T, int kStages>
__global__ void __launch_bounds__(384, 1) pv_sm90(const __grid_constant__ PvSm90Params p) {
  using namespace pv;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const SharedStorage<kStages> ss(smem_raw);
  const int m_tiles = static_cast<int>((p.seqlen_q + kBlockM - 1) / kBlockM);
  const int n_tiles = static_cast<int>((p.head_dim_v + kBlockN - 1) / kBlockN);
  const int heads = static_cast<int>(p.num_heads);
  const int count = m_tiles * n_tiles * heads * static_cast<int>(p.batch);
  // Tile t: (m tile heaviest first, n tile) fastest, then head, then batch.
  auto tile = [&](int t, int& m0, int& n0, int& h, int& b) {
    const int per_head = m_tiles * n_tiles, i = t % per_head, hb = t / per_head;
    m0 = (m_tiles - 1 - i / n_tiles) * kBlockM;
    n0 = (i % n_tiles) * kBlockN;
    h = hb % heads;
    b = hb / heads;
  };

  pipeline::init_barriers([&] { ss.bars.init(8); });  // empty: lane 0 of each consumer warp

  sm90::warp_specialize<sm90::RegisterSplit<2>>(
      [&](int tid) {
        if (tid == 0) produce(p, ss, count, tile);  // one thread issues the loads
      },
      [&](int tid) { consume<T>(p, ss, count, tile, tid); });
}

}  // namespace cupy_attn
