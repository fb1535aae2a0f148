// Mainloop of flash_fwd_sm90.cu, by role: the producer (one thread issuing TMA loads of Q and of the K/V tiles into a
// kStages-deep mbarrier ring) and the consumers (two warpgroups of 64 query rows each: S = Q Kᵀ, softmax, O += P V).
// Owns the shared-memory layout and the pipeline protocol, for one tile per CTA and for the persistent variant's loop
// over tiles (tile order in tile_scheduler.cuh); math of the softmax in softmax.cuh. kBlockM / 64 consumer warpgroups:
// two (kBlockM = 128) or three (192, FlashAttention-3's hdim-64 tile).
//
// Shared-memory tiles are stored as column blocks of rows × kSwizzleBytes, each written by one TMA box in that swizzle
// (SharedStorage: CuTe's smem selector rule, FlashAttention-3's choice): 128 bytes (64 columns) when the row width
// kHeadDim·2 is a multiple of 128 bytes, 16-byte chunk c of row r at chunk c ^ (r % 8), 8-row atoms of 1024 bytes;
// else 64 bytes (32 columns: kHeadDim = 96, 3 blocks), chunk c of row r at chunk c ^ ((r / 2) % 4), 8-row atoms of
// 512 bytes. Both are canonical wgmma operand layouts (PTX ISA "Shared Memory Matrix Layout"; CUTLASS's
// make_gmma_desc): K-major for Q and K, MN-major for V; at 128 bytes the same descriptors as flash_fwd.cu's wgmma
// variant.
//
// The K and V rings (common/pipeline.cuh: k_bars, v_bars): per stage a full barrier (1 arrival: the producer's
// expect_tx, plus the TMA bytes) and an empty one (4·kBlockM/64 arrivals: lane 0 of each consumer warp once its wgmma
// reading the stage has completed); iteration i uses stage i % kStages, phase (i / kStages) & 1.
//
// Persistent variant (kPersistent): the iteration count runs on across the CTA's tiles (a tile's block i is iteration
// it0 + i, it0 = the key blocks of the CTA's earlier tiles), so the ring needs no reset or drain between tiles. Q has
// one buffer and a Slot's two barriers (q_bars): full (phase k: the k-th non-empty tile's Q has landed) and empty (one
// arrival from lane 0 of each consumer warp once the wgmma of its tile's last S GEMM, the last reader of Q, has
// completed). The producer loads the next tile's first K, then waits on q_bars.empty, then loads its Q: the load
// overlaps the consumers' last P·V GEMM and epilogue of the tile before. Tiles whose rows see no key load nothing and
// count in neither barrier.
#pragma once
#include "common/tma.cuh"
#include "common/pipeline.cuh"
#include "attention/sm90/roles.cuh"
#include "common/visibility.cuh"
#include "common/user_mod.cuh"
#include "common/wgmma.cuh"
#include "attention/sm90/params.cuh"
#include "common/score_mod.cuh"
#include "attention/sm90/softmax.cuh"
#include "attention/sm90/epilogue.cuh"
#include "attention/sm90/tile_scheduler.cuh"

namespace cupy_attn {
namespace sm90 {

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct SharedStorage {
  // The swizzle: the widest of 128 and 64 bytes that divides a row (wgmma's canonical layouts need whole atoms along
  // the MN extent of V, N = kHeadDim); TMA boxes and descriptors follow it (fused_sm90.swizzle_bytes).
  static constexpr int kSwizzleBytes = (kHeadDim * 2) % 128 == 0 ? 128 : 64;
  static constexpr int kAtomCols = kSwizzleBytes / 2;          // 16-bit columns per block (one TMA box)
  static constexpr int kColBlocks = kHeadDim / kAtomCols;
  static constexpr int kAtomBytes = 8 * kSwizzleBytes;         // 8-row atom: a descriptor's SBO
  static_assert(kHeadDim % kAtomCols == 0, "whole swizzle atoms");
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;      // one K or V stage
  // Q's full; K's and V's full, then K's and V's empty, per stage; Q's empty (the persistent variant's, last so that
  // the others keep their addresses in both variants).
  static constexpr int kBarriers = 2 + 4 * kStages;
  // Three consumer warpgroups only: two fp32 words per consumer thread, after the barriers, that the overlap mainloop
  // stores its row sums to ahead of its scheduling barrier (never read: see consume).
  static constexpr int kSinkBytes = kBlockM == 192 ? (kBlockM / 64) * 128 * 2 * 4 : 0;
  // The epilogue's staging of O for its TMA stores (epilogue.cuh): per consumer warpgroup 64 rows × kOChunkCols
  // columns (the head dim in chunks of at most 128 columns: two at 256), in the tiles' swizzle; after the V stages.
  static constexpr int kOChunkCols = kHeadDim < 128 ? kHeadDim : 128;
  static constexpr int kOStageBytes = 64 * kOChunkCols * 2;
  static constexpr int kOBytes = (kBlockM / 64) * kOStageBytes;
  // The dynamic shared memory the launcher must request: tiles, barriers, and 1 KB of slack to align the base to
  // 1024 bytes (the 128-byte swizzle atoms' alignment, a multiple of the 64-byte ones' 512; the runtime only
  // guarantees 16). Every tile and column block is a multiple of 1024 bytes, so each starts on an atom boundary.
  static constexpr int kBytes = kQBytes + 2 * kStages * kKVBytes + kOBytes + 8 * kBarriers + kSinkBytes + 1024;

  T* q;
  T* k;  // kStages tiles of kBlockN rows
  T* v;
  unsigned char* o_stage;  // kBlockM / 64 buffers of kOStageBytes
  pipeline::Ring<kStages> k_bars;  // K stages (full: the producer's expect_tx + the boxes; empty: every consumer warp)
  pipeline::Ring<kStages> v_bars;  // V stages, as K's
  pipeline::Slot q_bars;           // Q (empty: the persistent variant's, each consumer warp once per tile)
  float* sink;

  __device__ __forceinline__ explicit SharedStorage(unsigned char* base) {
    unsigned char* smem = sm90::smem_base(base);
    q = reinterpret_cast<T*>(smem);
    k = reinterpret_cast<T*>(smem + kQBytes);
    v = reinterpret_cast<T*>(smem + kQBytes + kStages * kKVBytes);
    o_stage = smem + kQBytes + 2 * kStages * kKVBytes;
    q_bars.full = reinterpret_cast<unsigned long long*>(smem + kQBytes + 2 * kStages * kKVBytes + kOBytes);
    k_bars.full = q_bars.full + 1;
    v_bars.full = k_bars.full + kStages;
    k_bars.empty = v_bars.full + kStages;
    v_bars.empty = k_bars.empty + kStages;
    q_bars.empty = v_bars.empty + kStages;
    sink = reinterpret_cast<float*>(q_bars.empty + 1);
  }
};

// The Visibility of a tile's sequence: with kVariants the window's lower bound (window_lo) is read at run time; the
// plain instantiations have none, at compile time.
template <bool kVariants, typename Seq>
__device__ __forceinline__ Visibility fwd_visibility(const FlashFwdSm90Params& p, const Seq& seq) {
  if constexpr (kVariants) {
    return {seq.seqlen_k(), seq.causal_offset(), p.is_causal != 0, seq.window_lo() != kNoLowerBound, seq.window_lo()};
  } else {
    return {seq.seqlen_k(), seq.causal_offset(), p.is_causal != 0};
  }
}

// Key blocks the kBlockM-row tile at query row m0 visits: from the block of the first key its first row sees (0
// without a window's lower bound) to the block of the last key its last row sees, visited last to first; count() <= 0
// for a tile whose rows see no key (bottom-right alignment with L > S, a window past the keys). The same rule as the
// one-tile kernel's prologue (flash_fwd_sm90.cu).
// range (a mask_mod's KeyRanges entry for the tile's rows, common/user_mod.cuh; nullptr: none) narrows the keys to
// range[0] ... range[1].
template <int kBlockM, int kBlockN, bool kVariants, typename Seq>
__device__ __forceinline__ KeyBlocks key_blocks(const FlashFwdSm90Params& p, const Seq& seq, int m0,
                                                const int* range = nullptr) {
  const int rows_valid = min(kBlockM, static_cast<int>(seq.seqlen_q()) - m0);
  const Visibility vis = fwd_visibility<kVariants>(p, seq);
  long long last_key = vis.last_key(m0 + rows_valid - 1), first_key = vis.first_key(m0);
  if (range != nullptr) {
    first_key = max(first_key, static_cast<long long>(range[0]));
    last_key = min(last_key, static_cast<long long>(range[1]));
  }
  return last_key < first_key ? KeyBlocks{0, -1} : vis.blocks<kBlockN>(first_key, last_key);
}

// The producer's TMA issues (one thread). Q: the expect_tx and the kColBlocks boxes (kAtomCols columns each) of one
// tile. K or V of iteration it (key rows n0 ...): wait until all consumer warpgroups have released the stage's
// previous contents (round 0 waits on parity 1 of a fresh barrier, which returns at once; round r > 0 for the release
// of round r - 1), then load.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct Producer {
  using Smem = SharedStorage<T, kHeadDim, kBlockM, kBlockN, kStages>;
  const FlashFwdSm90Params& p;
  const Smem& ss;

  __device__ __forceinline__ void prefetch_maps() const {
    tma::prefetch_map(&p.tma_q);
    tma::prefetch_map(&p.tma_k);
    tma::prefetch_map(&p.tma_v);
  }
  __device__ __forceinline__ void load_q(int m0, int h, int b) const {
    tma::mbar_arrive_expect_tx(ss.q_bars.full, Smem::kQBytes);
    #pragma unroll
    for (int c = 0; c < Smem::kColBlocks; ++c)
      tma::load_4d(ss.q + c * kBlockM * Smem::kAtomCols, &p.tma_q, ss.q_bars.full, c * Smem::kAtomCols, m0, h, b);
  }
  __device__ __forceinline__ void load_kv(T* tiles, const tma::TensorMap* map, const pipeline::Ring<kStages>& bars,
                                          int it, int n0, int h_kv, int b) const {
    unsigned long long* full = bars.acquire(it, Smem::kKVBytes);
    T* dst = tiles + bars.stage(it) * kBlockN * kHeadDim;
    #pragma unroll
    for (int c = 0; c < Smem::kColBlocks; ++c)
      tma::load_4d(dst + c * kBlockN * Smem::kAtomCols, map, full, c * Smem::kAtomCols, n0, h_kv, b);
  }
  __device__ __forceinline__ void load_k(int it, int n0, int h_kv, int b) const {
    load_kv(ss.k, &p.tma_k, ss.k_bars, it, n0, h_kv, b);
  }
  __device__ __forceinline__ void load_v(int it, int n0, int h_kv, int b) const {
    load_kv(ss.v, &p.tma_v, ss.v_bars, it, n0, h_kv, b);
  }
  // Paged K/V (params.cuh: block_table): sequence b's keys key0 ... key0 + kBlockN − 1 from their pages, one box of
  // min(page_size, kBlockN) rows per page part. Keys past the sequence's S (the last block's tail, masked) read its
  // last page again: table entries past the pages in use are often unset.
  __device__ __forceinline__ void load_kv_paged(T* tiles, const tma::TensorMap* map,
                                                const pipeline::Ring<kStages>& bars, int it, int b, int S, int key0,
                                                int h_kv) const {
    unsigned long long* full = bars.acquire(it, Smem::kKVBytes);
    T* dst = tiles + bars.stage(it) * kBlockN * kHeadDim;
    const int ps = static_cast<int>(p.page_size), last = max(S - 1, 0) / ps;
    const int* pages = p.block_table + static_cast<long long>(b) * p.max_blocks;
    const int rows = min(ps, kBlockN);
    #pragma unroll 1
    for (int r = 0; r < kBlockN; r += rows) {
      const int key = key0 + r;
      const int row = pages[min(key / ps, last)] * ps + key % ps;
      #pragma unroll
      for (int c = 0; c < Smem::kColBlocks; ++c)
        tma::load_4d(dst + (c * kBlockN + r) * Smem::kAtomCols, map, full, c * Smem::kAtomCols, row, h_kv, 0);
    }
  }
  // Keys key0 ... of sequence `seq` into K's or V's ring: from their pages with a block table, else from the rows at
  // the sequence's offset.
  template <typename Seq>
  __device__ __forceinline__ void load_seq_kv(T* tiles, const tma::TensorMap* map,
                                              const pipeline::Ring<kStages>& bars, int it, const Seq& seq, int key0,
                                              int h_kv) const {
    if (Seq::kPacked && p.block_table != nullptr) {
      load_kv_paged(tiles, map, bars, it, seq.b, static_cast<int>(seq.seqlen_k()), key0, h_kv);
    } else {
      load_kv(tiles, map, bars, it, seq.k0() + key0, h_kv, seq.b_map());
    }
  }
  template <typename Seq>
  __device__ __forceinline__ void load_k(int it, const Seq& seq, int key0, int h_kv) const {
    load_seq_kv(ss.k, &p.tma_k, ss.k_bars, it, seq, key0, h_kv);
  }
  template <typename Seq>
  __device__ __forceinline__ void load_v(int it, const Seq& seq, int key0, int h_kv) const {
    load_seq_kv(ss.v, &p.tma_v, ss.v_bars, it, seq, key0, h_kv);
  }
};

// One thread, one tile (query rows m0 ... of head h in the sequence seq). Q once, then the K and V tiles of key blocks
// kb.last down to kb.first (the order the consumers visit them), each stage reused once all consumer warpgroups have
// released it.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, typename Seq>
__device__ __forceinline__ void produce(const FlashFwdSm90Params& p, const SharedStorage<T, kHeadDim, kBlockM, kBlockN,
                                        kStages>& ss, const Seq& seq, int m0, int h, KeyBlocks kb) {
  const Producer<T, kHeadDim, kBlockM, kBlockN, kStages> load{p, ss};
  load.prefetch_maps();
  const int b = seq.b_map();
  load.load_q(seq.q0() + m0, h, b);
  const int h_kv = h / static_cast<int>(p.groups);
  const int n_blocks = kb.count();
  for (int i = 0; i < n_blocks; ++i) {
    const int n0 = seq.k0() + (kb.last - i) * kBlockN;
    load.load_k(i, n0, h_kv, b);
    load.load_v(i, n0, h_kv, b);
  }
}

// One thread, the persistent variant: every tile of the CTA in the scheduler's order, the K/V iteration count running
// on across tiles. Per tile: K of its first block (its stage was freed by an S GEMM of the tile before, so this need
// not wait for that tile to end), then Q once the consumers have released the previous tile's (q_empty), then V and
// the remaining blocks. Tiles with no key to visit are skipped (the consumers write their rows).
// kr: a mask_mod's key ranges (common/user_mod.cuh), or nullptr: the producer and the consumers narrow each tile's
// key blocks alike.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, bool kVariants, bool kVarlen>
__device__ __forceinline__ void produce_persistent(const FlashFwdSm90Params& p, const SharedStorage<T, kHeadDim,
                                                   kBlockM, kBlockN, kStages>& ss, const KeyRanges* kr = nullptr) {
  const Producer<T, kHeadDim, kBlockM, kBlockN, kStages> load{p, ss};
  load.prefetch_maps();
  int it = 0;     // K/V iterations issued so far
  int tiles = 0;  // non-empty tiles so far: Q phases
  for (TileScheduler<kBlockM, kVarlen> sched(p); sched.valid(); sched.advance()) {
    const WorkTile w = sched.tile();
    const int m0 = w.m_block * kBlockM;
    const SeqSpan<kVarlen> seq(p, w.b);
    const KeyBlocks kb = key_blocks<kBlockM, kBlockN, kVariants>(p, seq, m0, kr ? kr->of(w.b, w.h, m0) : nullptr);
    const int n_blocks = kb.count();
    if (n_blocks <= 0) continue;
    const int h_kv = w.h / static_cast<int>(p.groups);
    load.load_k(it, seq, kb.last * kBlockN, h_kv);  // keys of the sequence: load_k / load_v place them (or page)
    ss.q_bars.wait_free(tiles);
    load.load_q(seq.q0() + m0, w.h, seq.b_map());
    load.load_v(it, seq, kb.last * kBlockN, h_kv);
    for (int i = 1; i < n_blocks; ++i) {
      const int key0 = (kb.last - i) * kBlockN;
      load.load_k(it + i, seq, key0, h_kv);
      load.load_v(it + i, seq, key0, h_kv);
    }
    it += n_blocks;
    ++tiles;
  }
}

// Named barriers 1 ... kWGs (kWGs = kBlockM / 64 consumer warpgroups: 2, or 3 in the 192-row tile): the consumer
// warpgroups issue their GEMMs in turns, round robin (FlashAttention-3's ping-pong, generalized as its three-warpgroup
// hdim-64 tile does; a turn is S_i, or with kOverlap S_i and P_{i-1} V_{i-1}): warpgroup w waits on barrier 1 + w,
// issues, then arrives on the next one's, 1 + (w + 1) % kWGs. Each barrier has 256 participants: the 128 threads of
// its owner's sync and the 128 of its predecessor's arrive. The last warpgroup gives warpgroup 0 the first turn and
// skips its own last arrive, so each barrier sees exactly as many arrives as syncs (n_blocks turns each; a named
// barrier left half-arrived at exit is avoided). The turns go 0, 1, ..., kWGs-1, 0, ... strictly: warpgroup w's next
// arrive on barrier 1 + (w + 1) % kWGs needs its next turn, which needs every other warpgroup's turn in between, the
// successor's sync included, so a barrier never holds two generations of arrivals. While one warpgroup issues,
// the others run their softmax: with three, the tensor cores have two other warpgroups' GEMMs queued behind a softmax.
//
// Persistent variant: the turns of all the CTA's tiles form one sequence (every warpgroup walks the same tiles with
// the same n_blocks, and tiles with no key take no turn). The last warpgroup grants the first turn once, before the
// first tile; every turn, the last of a tile included, ends with the arrive on the next one's barrier (so warpgroup 0
// may take the next tile's first turn while the others are still in their epilogue); after its last tile warpgroup 0
// takes one empty turn (a sync on barrier 1) that absorbs the last warpgroup's last arrive. Invariant, per barrier:
// arrives = syncs (barrier 1: 1 + N arrives by the last warpgroup, N + 1 syncs by warpgroup 0; the others: N and N,
// N = the CTA's turns, 0 included), and the turns go round strictly as above.
constexpr int kPingPongBarrier = 1;
// Named barriers kVTailBarrier + wg: one consumer warpgroup's 128 threads after zeroing a packed batch's V tail
// (consume's zero_v_tail); after the ping-pong's 1-3 and the epilogue's 4-6 (epilogue.cuh's kOStoreBarrier).
constexpr int kVTailBarrier = 7;
static_assert(kVTailBarrier >= kOStoreBarrier + 3 && kVTailBarrier + 2 <= 15, "named barriers 7-9, within 0-15");

// One consumer warpgroup (wg = 0 ... kBlockM/64 - 1; tid = thread index within the consumer warpgroups, from 0): 64
// query rows m0 + 64·wg ... of the block against key blocks kb.last down to kb.first (kb.count() >= 1), then the
// epilogue. kVariants: the window's lower bound, the softcap and ALiBi of common/score_mod.cuh on each S block
// before its mask, and the sinks in the epilogue (read at run time: any of them may be off); the plain
// instantiations carry none of that code.
// kPersistent: one tile of consume_persistent's loop: it0 = the K/V iterations of the CTA's earlier tiles, q_parity =
// the q_full phase of this tile's Q; the ping-pong's first grant and last turn are consume_persistent's, and the
// warps release Q (q_empty) once their last S GEMM has completed.
//
// kOverlap = false: per block i, S_i = Q K_iᵀ (in the ping-pong turn), softmax, O += P_i V_i, each GEMM waited for.
// kOverlap = true (FlashAttention-3's intra-warpgroup overlap, §3.2): the turn issues S_i and then O += P_{i-1}
// V_{i-1}; wgmma.wait_group 1 returns once S_i is done (groups complete in order), so the softmax of S_i can run while
// the P·V GEMM of block i-1 still occupies the tensor cores. P_{i-1}'s registers are read by that GEMM until
// wait_group 0, so S_i stays fp32 until then; only after it are O rescaled and P_i packed (fence_operands on S after
// the wait keeps the compiler from hoisting the packing above it). One S and one P register set, as without overlap.
// kHeadDimQK (a multiple of 16, ≤ kHeadDim): the columns of Q and K the S GEMM reads; E = 80 in the kHeadDim = 96 tiles
// runs 5 of its 6 k steps (E = 80 or 96 with Ev > 96 in the 128 tiles: 5 or 6 of 8; the rest are TMA's zeros),
// while P·V keeps N = kHeadDim.
// Mod (common/user_mod.cuh; with kVariants): a user's score_mod / mask_mod on each S block after the variants' score
// mods, before the masks; `aux` its arrays (the kernel's ModParams, in parameter space).
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, bool kOverlap, bool kPersistent,
          int kHeadDimQK = kHeadDim, bool kVariants = false, typename Mod = NoMod, typename Seq>
__device__ __forceinline__ void consume(const FlashFwdSm90Params& p, const SharedStorage<T, kHeadDim, kBlockM, kBlockN,
                                        kStages>& ss, const Seq& seq, int m0, int h, int b, KeyBlocks kb, int tid,
                                        int it0, unsigned q_parity, const typename Mod::Aux* aux = nullptr,
                                        const int* range = nullptr) {
  const int n_blocks = kb.count();
  constexpr int kWGs = kBlockM / 64;  // consumer warpgroups
  const int wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int wg_row0 = m0 + wg * 64;          // first query row of this warpgroup
  const int row0 = wg_row0 + warp * 16 + g;  // this lane's rows: row0 and row0 + 8
  // row0 where the mask and the epilogue use it. Three consumer warpgroups run at 160 registers, and ptxas kept row0
  // live across the mainloop in a spill slot (4 bytes of STL, 4 LDL): there it is derived again from %tid.x (asm
  // volatile, so it is not hoisted and kept; both callers pass tid = threadIdx.x - 128);
  // m0 + (tid / 32)·16 + lane / 4 = m0 + 64·wg + 16·warp + g.
  auto lane_row0 = [&]() {
    if constexpr (kWGs == 2) {
      return row0;
    } else {
      unsigned x;
      asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(x));
      const int c = static_cast<int>(x) - 128;
      return m0 + (c >> 5) * 16 + ((c & 31) >> 2);
    }
  };
  const int S = static_cast<int>(seq.seqlen_k());
  const bool causal = p.is_causal != 0;
  const long long causal_offset = seq.causal_offset();
  const float sc = static_cast<float>(p.scale_log2);
  ScoreMods score_mods{};
  if constexpr (kVariants) {
    const float slope = p.alibi_slopes ? p.alibi_slopes[b * p.alibi_stride_b + h] : 0.f;
    score_mods = {static_cast<float>(p.softcap_in), -slope * static_cast<float>(p.alibi_scale),
                  static_cast<int>(seq.seqlen_k() - seq.seqlen_q())};
  }

  OnlineSoftmax<kBlockN, kHeadDim> softmax;
  softmax.init();
  float o[kHeadDim / 2];
  #pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.f;
  float acc_s[kBlockN / 2];
  unsigned pa[kBlockN / 16][4];

  // Descriptor addresses: this warpgroup's 64 rows of Q inside each kBlockM-row column block; K and V per stage.
  using Smem = SharedStorage<T, kHeadDim, kBlockM, kBlockN, kStages>;
  constexpr int kRowBytes = Smem::kSwizzleBytes, kAtomBytes = Smem::kAtomBytes;
  constexpr int kStepsPerBlock = Smem::kAtomCols / 16;  // 16-column k steps per column block: 4 (128 B) or 2 (64 B)
  const unsigned q_wg = tma::smem_u32(ss.q) + wg * 64 * kRowBytes;
  const unsigned k_base = tma::smem_u32(ss.k), v_base = tma::smem_u32(ss.v);
  constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  // A descriptor in the tiles' swizzle (SharedStorage::kSwizzleBytes).
  auto desc = [](unsigned addr, unsigned lbo, unsigned sbo) {
    if constexpr (Smem::kSwizzleBytes == 128) {
      return wgmma::desc_sw128(addr, lbo, sbo);
    } else {
      return wgmma::desc_sw64(addr, lbo, sbo);
    }
  };

  // Block i of this tile is K/V iteration it0 + i.
  auto stage = [&](int i) { return ss.k_bars.stage(it0 + i); };
  // K_i has landed (waited for before taking the ping-pong turn: the turn is not held while TMA is pending).
  auto wait_k = [&](int i) { ss.k_bars.wait(it0 + i); };
  // S (64 × kBlockN) = Q K_iᵀ, issued and committed (not waited for): kHeadDimQK/16 k steps of 16 elements = 32 bytes
  // inside a kRowBytes swizzled row (the hardware applies the XOR to the computed address); every kStepsPerBlock
  // steps the next column block. K-major: SBO = one 8-row atom, LBO unused (16).
  auto issue_s = [&](int i) {
    const int s = stage(i);
    #pragma unroll
    for (int j = 0; j < kBlockN / 2; ++j) acc_s[j] = 0.f;
    const unsigned k_st = k_base + s * kKVBytes;
    wgmma::fence();
    #pragma unroll
    for (int kk = 0; kk < kHeadDimQK / 16; ++kk) {  // columns past kHeadDimQK are TMA's zero fill: skipped
      const unsigned a = q_wg + (kk / kStepsPerBlock) * kBlockM * kRowBytes + (kk % kStepsPerBlock) * 32;
      const unsigned bk = k_st + (kk / kStepsPerBlock) * kBlockN * kRowBytes + (kk % kStepsPerBlock) * 32;
      wgmma::Mma<T, kBlockN>::ss(acc_s, desc(a, 16, kAtomBytes), desc(bk, 16, kAtomBytes), kk > 0);
    }
    wgmma::commit();
  };
  // O (64 × kHeadDim) += P V_i, issued and committed: P from registers (A-fragment layout), V as an MN-major B operand
  // (transpose-B): its column blocks (kAtomCols wide: N = kHeadDim covers whole atoms) are kBlockN·kRowBytes bytes
  // apart (LBO), 8-row (k) groups one atom (SBO); a k step is 16 rows.
  // Packed batches: V rows past the sequence's keys hold the next sequence's values, or whatever lies past them (a
  // KV cache's unused slots under seqused_k). Their probabilities are 0, but 0 × NaN is NaN, so in the block that
  // reaches past S the rows from S − n0 on are zeroed in shared memory before this warpgroup's P·V reads them (whole
  // rows: the swizzle permutes 16-byte chunks within a row, and a column block's rows are consecutive lines), then
  // the async-proxy fence and a barrier of the warpgroup. The other warpgroup writes the same zeros, so neither's wgmma can read anything else.
  auto zero_v_tail = [&](int i) {
    if constexpr (Seq::kPacked) {
      const int valid = S - (kb.last - i) * kBlockN;
      if (valid < kBlockN) {
        unsigned char* v_st = reinterpret_cast<unsigned char*>(ss.v) + stage(i) * kKVBytes;
        #pragma unroll
        for (int block = 0; block < Smem::kColBlocks; ++block)  // rows valid ... of a column block: one byte range
          for (int off = valid * kRowBytes + 16 * (tid % 128); off < kBlockN * kRowBytes; off += 16 * 128)
            *reinterpret_cast<uint4*>(v_st + block * kBlockN * kRowBytes + off) = make_uint4(0u, 0u, 0u, 0u);
        tma::fence_proxy_async();
        tma::named_barrier_sync(kVTailBarrier + wg, 128);
      }
    }
  };
  auto issue_pv = [&](int i) {
    const int s = stage(i);
    ss.v_bars.wait(it0 + i);
    zero_v_tail(i);
    const unsigned v_st = v_base + s * kKVBytes;
    wgmma::fence();
    #pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      wgmma::Mma<T, kHeadDim>::rs(o, pa[kk], desc(v_st + kk * 16 * kRowBytes, kBlockN * kRowBytes, kAtomBytes), 1);
    wgmma::commit();
  };
  // The stage's K or V may be overwritten once all 4·kWGs consumer warps have waited for the wgmma reading it.
  auto release = [&](const pipeline::Ring<kStages>& bars, int i) { bars.release(it0 + i, lane); };
  // After release(k_empty, i): the S GEMM of the tile's last block was Q's last reader (persistent: the producer
  // loads the next tile's Q once all 4·kWGs warps are here).
  auto release_q = [&](int i) {
    if constexpr (kPersistent) {
      if (i == n_blocks - 1 && lane == 0) tma::mbar_arrive(ss.q_bars.empty);
    }
  };
  // Only the tile at the end of the keys and tiles crossing this warpgroup's causal diagonal (the upper bound) or
  // the lower edge of its window need element masks (Visibility::tile_needs_mask's test, spelled out: calling it
  // changed the SASS). The lower edge: the warpgroup's last row sees keys from wg_row0 + 63 + window_lo on. With
  // kVariants the score mods come first (mask_tile's -inf wins).
  const bool lower = kVariants && seq.window_lo() != kNoLowerBound;
  auto mask = [&](int i) {
    const int n0 = (kb.last - i) * kBlockN;
    if constexpr (kVariants) apply_score_mods<kBlockN>(acc_s, score_mods, lane_row0(), n0, t);
    if constexpr (Mod::kScore || Mod::kMask)
      apply_user_mod<kBlockN, Mod>(acc_s, *aux, b, h, lane_row0(), n0, t, sc, static_cast<int>(seq.seqlen_q()), S,
                                   !full_run(range, n0, kBlockN));
    if (n0 + kBlockN > S || (causal && n0 + kBlockN - 1 > wg_row0 + causal_offset))
      mask_tile<kBlockN>(acc_s, lane_row0(), n0, t, Visibility{seq.seqlen_k(), causal_offset, causal});
    if (lower && n0 < wg_row0 + 63 + seq.window_lo())
      mask_tile_lower<kBlockN>(acc_s, lane_row0(), n0, t, seq.window_lo());
  };
  // End of ping-pong turn i: the last warpgroup skips its last arrive (see kPingPongBarrier; not in the persistent
  // variant). (The two-warpgroup spellings, wg == 0 and wg ^ 1, keep the 128-row tile's SASS as it was.)
  auto pass_turn = [&](int i) {
    const bool not_last_wg = kWGs == 2 ? wg == 0 : wg != kWGs - 1;
    const int next_wg = kWGs == 2 ? wg ^ 1 : (wg + 1 == kWGs ? 0 : wg + 1);
    if (kPersistent || not_last_wg || i + 1 < n_blocks) tma::named_barrier_arrive(kPingPongBarrier + next_wg, 256);
  };

  if constexpr (!kPersistent) {
    if (wg == kWGs - 1) tma::named_barrier_arrive(kPingPongBarrier, 256);
  }
  tma::mbar_wait(ss.q_bars.full, q_parity);

  if constexpr (!kOverlap) {
    static_assert(!kPersistent, "the persistent variant is built on the overlap mainloop only");
    for (int i = 0; i < n_blocks; ++i) {
      wait_k(i);
      tma::named_barrier_sync(kPingPongBarrier + wg, 256);
      issue_s(i);
      pass_turn(i);
      wgmma::wait<0>();
      wgmma::fence_operands(acc_s);
      release(ss.k_bars, i);
      mask(i);
      softmax.template step<T>(acc_s, pa, o, sc);
      issue_pv(i);
      wgmma::wait<0>();
      wgmma::fence_operands(o);
      release(ss.v_bars, i);
    }
  } else {
    // Block 0: S_0 and its softmax (O is still 0: nothing to rescale).
    wait_k(0);
    tma::named_barrier_sync(kPingPongBarrier + wg, 256);
    issue_s(0);
    pass_turn(0);
    wgmma::wait<0>();
    wgmma::fence_operands(acc_s);
    release(ss.k_bars, 0);
    release_q(0);
    mask(0);
    softmax.template step<T>(acc_s, pa, o, sc);
    for (int i = 1; i < n_blocks; ++i) {
      wait_k(i);
      tma::named_barrier_sync(kPingPongBarrier + wg, 256);
      issue_s(i);
      issue_pv(i - 1);
      pass_turn(i);
      wgmma::wait<1>();  // S_i done; P_{i-1} V_{i-1} may still run
      wgmma::fence_operands(acc_s);
      release(ss.k_bars, i);
      release_q(i);
      mask(i);
      float alpha[2];
      bool moved[2];
      #pragma unroll
      for (int half = 0; half < 2; ++half) alpha[half] = softmax.update_half(acc_s, half, sc, moved[half]);
      wgmma::fence_operands(acc_s);
      // Three consumer warpgroups (160 registers): ptxas sank all 64 exponentials (and the row sums) below the
      // MEMBAR and the wait, so the softmax ran after P_{i-1} V_{i-1} again. Two shared-memory stores of the row sums
      // l, which depend on every exponential and may not pass the MEMBAR, pin them above it (2 STS per block; the
      // words are never read). The two-warpgroup tiles need no such anchor and keep their SASS.
      if constexpr (kWGs == 3) {
        ss.sink[2 * tid] = softmax.l[0];
        ss.sink[2 * tid + 1] = softmax.l[1];
      }
      // A scheduling barrier for ptxas (MEMBAR.SC.CTA; the consumers have no memory operations pending here): without
      // it ptxas hoists the wait below to the top of the softmax, so the exponentials ran only after P_{i-1} V_{i-1}
      // finished. With it, D = 64 and 128 run all their MUFU.EX2 between the two waits (checked in the SASS by
      // tests/test_flash_sm90.py), the 192-row tile with the anchor above. D = 256 still waits first: ptxas places
      // the exponentials in P_{i-1}'s registers.
      __threadfence_block();
      wgmma::wait<0>();  // P_{i-1} V_{i-1} done: O and P's registers are free
      wgmma::fence_operands(o);
      wgmma::fence_operands(acc_s);
      release(ss.v_bars, i - 1);
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (moved[half]) softmax.rescale_half(o, half, alpha[half]);
        softmax.template pack_half<T>(acc_s, pa, half);
      }
    }
    issue_pv(n_blocks - 1);
    wgmma::wait<0>();
    wgmma::fence_operands(o);
    release(ss.v_bars, n_blocks - 1);
  }

  T* out = static_cast<T*>(p.out) + seq.b_map() * p.out_stride_b + h * p.out_stride_h + seq.q0() * p.out_stride_l;
  float* lse = p.lse ? p.lse + seq.b_map() * p.lse_stride_b + h * p.lse_stride_h + seq.q0() * p.lse_stride_l : nullptr;
  if (kVariants && p.sinks) {  // the sink's term joins each row's sum (common/score_mod.cuh); once per tile, off the mainloop
    const float sink = sink_log2<T>(p.sinks, p.sinks_kind, h);
    #pragma unroll
    for (int half = 0; half < 2; ++half) softmax.add_sink(half, sink);
  }
  // A packed batch's warpgroup stores by TMA only when its 64 rows are all its sequence's (a box crossing the
  // sequence's end would write the next one's rows); the crossing one stores from registers. At head dim 256 packed
  // batches store from registers only: holding both ways beside O's 128 accumulators spilled 48-96 bytes.
  constexpr bool kTmaStore = !Seq::kPacked || kHeadDim < 256;
  if (kTmaStore && p.o_tma && (!Seq::kPacked || wg_row0 + 64 <= seq.seqlen_q())) {
    store_output_tma<T, kHeadDim, Smem::kSwizzleBytes, Smem::kOChunkCols>(o, softmax.m, softmax.l, ss.o_stage, p,
                                                                          seq, m0, h, lse);
  } else {
    store_output<T, kHeadDim>(o, softmax.m, softmax.l, out, p.out_stride_l, lse, p.lse_stride_l, lane_row0(), t,
                              static_cast<int>(seq.seqlen_q()), static_cast<int>(p.head_dim_v));
  }
}

// The consumer warpgroups (kBlockM / 64) of the persistent variant: every tile of the CTA in the scheduler's order (the
// producer walks the same sequence), each through consume()'s mainloop and epilogue; a tile whose rows see no key
// writes out 0 and lse -inf and takes no ping-pong turn and no Q or K/V phase. The ping-pong's first grant and the
// closing empty turn are here (kPingPongBarrier).
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, bool kOverlap, int kHeadDimQK,
          bool kVariants, bool kVarlen, typename Mod = NoMod>
__device__ __forceinline__ void consume_persistent(const FlashFwdSm90Params& p, const SharedStorage<T, kHeadDim,
                                                   kBlockM, kBlockN, kStages>& ss, int tid,
                                                   const typename Mod::Aux* aux = nullptr,
                                                   const KeyRanges* kr = nullptr) {
  constexpr int kWGs = kBlockM / 64;
  const int wg = tid / 128;
  if (wg == kWGs - 1) tma::named_barrier_arrive(kPingPongBarrier, 256);
  int it = 0;     // K/V iterations consumed so far
  int tiles = 0;  // non-empty tiles so far: Q phases
  for (TileScheduler<kBlockM, kVarlen> sched(p); sched.valid(); sched.advance()) {
    const WorkTile w = sched.tile();
    const int m0 = w.m_block * kBlockM;
    const SeqSpan<kVarlen> seq(p, w.b);
    const int* range = kr ? kr->of(w.b, w.h, m0) : nullptr;
    const KeyBlocks kb = key_blocks<kBlockM, kBlockN, kVariants>(p, seq, m0, range);
    if (kb.count() <= 0) {
      store_empty_rows<T, kVariants>(p, seq, m0, w.h, min(kBlockM, static_cast<int>(seq.seqlen_q()) - m0), tid,
                                     128 * kWGs);
      continue;
    }
    consume<T, kHeadDim, kBlockM, kBlockN, kStages, kOverlap, true, kHeadDimQK, kVariants, Mod>(
        p, ss, seq, m0, w.h, w.b, kb, tid, it, static_cast<unsigned>(tiles & 1), aux, range);
    it += kb.count();
    ++tiles;
  }
  if (wg == 0) tma::named_barrier_sync(kPingPongBarrier, 256);
}

}  // namespace sm90
}  // namespace cupy_attn
