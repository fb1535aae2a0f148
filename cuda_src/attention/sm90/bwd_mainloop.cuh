// Mainloop of flash_bwd_sm90.cu, by role: the producer (one thread: TMA loads of the block's K and V once, then per
// step Q + lse and dO + D into kStages-deep mbarrier rings) and the consumers (two warpgroups: the five GEMMs of a step
// with wgmma, P and dS in registers, dSᵀ through shared memory for dQ). Owns the shared-memory layout and the pipeline
// protocol; the gradient stores and the dQ reduction are in bwd_epilogue.cuh.
//
// How the two consumer warpgroups share a block (BwdSplit below):
//   kBlockN = 128 (head dims 64, 128): by keys. Warpgroup w owns keys 64w ... 64w + 63: Sᵀ and dPᵀ over all kBlockM
//     queries of the step, dK and dV over all kHeadDim columns, with Pᵀ and dSᵀ as register A operands (rs).
//   kBlockN = 64 (head dim 256, where 64 keys × 256 columns of dK and dV would be 256 fp32 registers per thread): by
//     queries and columns. Both warpgroups see all 64 keys; warpgroup w computes Sᵀ and dPᵀ for queries
//     w·kBlockM/2 ..., writes its Pᵀ and dSᵀ to shared memory, and after the step's named barrier accumulates dK and
//     dV for columns w·kHeadDim/2 ... over all kBlockM queries with both operands from shared memory (ss_bmn):
//     64 + 64 accumulator registers instead of 256 (FlashAttention-3 splits hdim 256 the same way: its dKV_swapAB
//     tiles give each of two warpgroups half of the head dim, with P and dS in shared memory).
//
// Shared-memory tiles (K, V, Q, dO) are stored as kHeadDim/64 column blocks of rows × 128 bytes, each written by one
// TMA box in the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)): the canonical K-major layout of a
// wgmma operand, 8-row atoms 1024 bytes apart, read as K-major (Sᵀ = K Qᵀ, dPᵀ = V dOᵀ) and as MN-major (dO and Q as
// the B operands of dV += Pᵀ dO and dK += dSᵀ Q; K as the B operand of dQ = dS K) without any transposed copy.
// dSᵀ is stored by the consumers in the same swizzled form, [key][query] with kBlockM/64 column blocks of kBlockN
// rows: the MN-major A operand of dQ = dS K, and at kBlockN = 64 the K-major A operand of dK += dSᵀ Q (Pᵀ likewise,
// for dV += Pᵀ dO).
//
// Protocol. Barriers: kv_full (1 arrival: the producer's expect_tx of K + V, plus the TMA bytes), and the Q and dO
// rings (common/pipeline.cuh: q_bars, do_bars): per stage a full barrier (1 arrival + bytes: tile and its lse or D row)
// and an empty one (8 arrivals: lane 0 of each consumer warp once the last wgmma reading the stage has completed: dK +=
// dSᵀ Q for Q, dV += Pᵀ dO for dO); step i is ring iteration i. dSᵀ is double-buffered (buffer i % 2) and the two
// consumer warpgroups meet at one named barrier per step, after both stored their dSᵀ rows and before either reads
// them: a warpgroup writing buffer i % 2 in step i has passed the barrier of step i − 1, which the other reached only
// after its dQ GEMM of step i − 2 (the last reader of that buffer) had completed. The Pᵀ buffers of kBlockN = 64 follow
// the same rule (written with dSᵀ, read by dV += Pᵀ dO of the same step, which completes before the step ends). dQ:
// each consumer warpgroup's staging buffer passes between it and the dQ writer warp through two named barriers
// (bwd_dq_write).
#pragma once
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/tma.cuh"
#include "common/pipeline.cuh"
#include "attention/sm90/roles.cuh"
#include "common/visibility.cuh"
#include "common/wgmma.cuh"
#include "attention/sm90/bwd_params.cuh"
#include "attention/sm90/bwd_epilogue.cuh"
#include "attention/sm90/bwd_variants.cuh"

namespace cupy_attn {
namespace sm90 {

// How the two consumer warpgroups share a block of kBlockN keys × kBlockM queries × kHeadDim columns (see the top):
// warpgroup w's Sᵀ / dPᵀ tile is keys key_row(w) + 0..63 × queries q_col(w) + 0..kSN−1, its dK / dV tile keys
// key_row(w) + 0..63 × columns kv_col(w) + 0..kKvN−1.
template <int kHeadDim, int kBlockM, int kBlockN>
struct BwdSplit {
  static_assert(kBlockN == 128 || kBlockN == 64, "two warpgroups of 64 keys, or two sharing 64 keys");
  static constexpr bool kByColumns = kBlockN == 64;              // Pᵀ, dSᵀ through shared memory, dK, dV ss
  static constexpr int kSN = kByColumns ? kBlockM / 2 : kBlockM;     // queries of a warpgroup's Sᵀ, dPᵀ
  static constexpr int kKvN = kByColumns ? kHeadDim / 2 : kHeadDim;  // columns of its dK, dV
  __device__ __forceinline__ static int key_row(int wg) { return kByColumns ? 0 : 64 * wg; }
  __device__ __forceinline__ static int q_col(int wg) { return kByColumns ? kSN * wg : 0; }
  __device__ __forceinline__ static int kv_col(int wg) { return kByColumns ? kKvN * wg : 0; }
};

// dQ of a step is kBlockM × kHeadDim, two tiles of 64 queries × kN columns, one per consumer warpgroup: warpgroup w
// has query block row_block(w), columns 64·col_block(w) ... + kN, reduced into dq_accum by TMA from a staging buffer
// in shared memory, in kRounds rounds of kStageCols columns (the dQ writer, bwd_dq_write). kBlockN = 64 (head dim
// 256) makes room for its staging by single-staging dO (kDoStages; FlashAttention-3's hdim-256 backward does too) and
// stages half of the 64 × 128 tile at a time.
template <int kHeadDim, int kBlockM, int kBlockN>
struct BwdDq {
  static constexpr int kRowBlocks = kBlockM / 64;
  static constexpr int kN = kHeadDim * kRowBlocks / 2;
  static_assert(kRowBlocks * (kHeadDim / kN) == 2 && kN % 64 == 0, "one 64 x kN dQ tile per warpgroup");
  static constexpr int kRounds = kBlockN == 64 ? 2 : 1;
  static constexpr int kStageCols = kN / kRounds;
  __host__ __device__ static constexpr int kDoStages(int stages) { return kBlockN == 64 ? 1 : stages; }
  __device__ __forceinline__ static int row_block(int wg) { return wg % kRowBlocks; }
  __device__ __forceinline__ static int col_block(int wg) { return (wg / kRowBlocks) * (kN / 64); }
};

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct BwdSharedStorage {
  static constexpr int kColBlocks = kHeadDim / 64;      // 128-byte swizzle atoms hold 64 16-bit columns
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // K or V of the key block
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;   // one Q or dO stage
  static constexpr int kDSBytes = kBlockN * kBlockM * 2;   // one dSᵀ buffer
  // One Pᵀ buffer: only when the warpgroups split by columns (else Pᵀ stays in registers).
  static constexpr int kPBytes = BwdSplit<kHeadDim, kBlockM, kBlockN>::kByColumns ? kDSBytes : 0;
  // dQ's staging for its TMA reduce: 64 rows × kStageCols fp32 of a consumer warpgroup's dQ tile as kStageCols / 32
  // boxes of 64 rows × 128 bytes in the 128-byte swizzle.
  using Dq = BwdDq<kHeadDim, kBlockM, kBlockN>;
  static constexpr int kDqStageBytes = 64 * Dq::kStageCols * 4;
  static constexpr int kDoStages = Dq::kDoStages(kStages);  // dO ring depth (the Q ring's is kStages)
  static constexpr int kStatBytes = kBlockM * 4;           // one stage of lse·log2(e) or D
  static constexpr int kBarriers = 1 + 2 * kStages + 2 * kDoStages;  // kv_full; q_full, q_empty, do_full, do_empty
  // The dynamic shared memory the launcher must request: tiles (each a multiple of 1024 bytes, so every tile stays
  // 1024-byte aligned), statistics, barriers, and 1 KB of slack to align the base to 1024 bytes.
  static constexpr int kBytes = 2 * kKVBytes + (kStages + kDoStages) * kQBytes + 2 * kDSBytes + 2 * kPBytes
                                + 2 * kDqStageBytes + (kStages + kDoStages) * kStatBytes + 8 * kBarriers + 1024;
  static_assert(kKVBytes % 1024 == 0 && kQBytes % 1024 == 0 && kDSBytes % 1024 == 0, "1024-byte aligned tiles");
  static_assert(kStatBytes % 16 == 0, "a TMA box row is a multiple of 16 bytes");

  T* k;
  T* v;
  T* q;      // kStages tiles of kBlockM rows
  T* dout;   // kDoStages tiles of kBlockM rows
  T* ds;     // 2 buffers of dSᵀ
  T* p;      // 2 buffers of Pᵀ (kPBytes each; none when kPBytes = 0)
  float* dq_stage;  // consumer warpgroup w's dQ staging at w·kDqStageBytes
  float* lse;    // kStages rows of kBlockM
  float* delta;  // kDoStages rows of kBlockM
  unsigned long long* kv_full;         // K and V of the block, loaded once
  pipeline::Ring<kStages> q_bars;      // Q (and its lse row) per step
  pipeline::Ring<kDoStages> do_bars;   // dO (and its D row) per step

  __device__ __forceinline__ explicit BwdSharedStorage(unsigned char* base) {
    unsigned char* smem = sm90::smem_base(base);
    k = reinterpret_cast<T*>(smem);
    v = reinterpret_cast<T*>(smem + kKVBytes);
    q = reinterpret_cast<T*>(smem + 2 * kKVBytes);
    dout = reinterpret_cast<T*>(smem + 2 * kKVBytes + kStages * kQBytes);
    ds = reinterpret_cast<T*>(smem + 2 * kKVBytes + (kStages + kDoStages) * kQBytes);
    p = ds + 2 * kDSBytes / 2;
    dq_stage = reinterpret_cast<float*>(p + 2 * kPBytes / 2);
    lse = dq_stage + 2 * kDqStageBytes / 4;
    delta = lse + kStages * kBlockM;
    kv_full = reinterpret_cast<unsigned long long*>(delta + kDoStages * kBlockM);
    q_bars.full = kv_full + 1;
    q_bars.empty = q_bars.full + kStages;
    do_bars.full = q_bars.empty + kStages;
    do_bars.empty = do_bars.full + kDoStages;
  }
};

// The steps of one key block: every (query head of the GQA group, query block that sees a key of the block) pair,
// flattened. Step i is query head h_kv·groups + i / m_count, query block m_first + i % m_count.
struct BwdSteps {
  int m_first;  // first query block with a visible key
  int m_count;  // query blocks per head from m_first on
  int count;    // steps: groups · m_count (0 when no query sees the block)
  // kUserMod with a BlockMask: the query rows that see every key of the block under the mask_mod, for every head of
  // the group (KeyRanges' full runs, intersected); their tiles skip the mask_mod. Empty (0, -1) otherwise.
  int full_first = 0, full_last = -1;
};

// One thread. K and V once, then per step the Q tile with its lse row and the dO tile with its D row, each stage
// reused once all 8 consumer warps have released it.
template <bool kVarlen, typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages>
__device__ __forceinline__ void bwd_produce(const FlashBwdSm90Params& p,
                                            const BwdSharedStorage<T, kHeadDim, kBlockM, kBlockN, kStages>& ss,
                                            const BwdSeq& seq, int n0, int h_kv, BwdSteps steps) {
  const int b = seq.b_map;
  using Smem = BwdSharedStorage<T, kHeadDim, kBlockM, kBlockN, kStages>;
  tma::prefetch_map(&p.tma_q);
  tma::prefetch_map(&p.tma_k);
  tma::prefetch_map(&p.tma_v);
  tma::prefetch_map(&p.tma_do);
  tma::prefetch_map(&p.tma_stats);
  tma::mbar_arrive_expect_tx(ss.kv_full, 2 * Smem::kKVBytes);
  #pragma unroll
  for (int c = 0; c < Smem::kColBlocks; ++c) {
    tma::load_4d(ss.k + c * kBlockN * 64, &p.tma_k, ss.kv_full, c * 64, seq.k0 + n0, h_kv, b);
    tma::load_4d(ss.v + c * kBlockN * 64, &p.tma_v, ss.kv_full, c * 64, seq.k0 + n0, h_kv, b);
  }
  const int groups = static_cast<int>(p.groups);
  #pragma unroll 1  // not unrolled: 24 registers (setmaxnreg.dec), shared with the dQ writer's warp
  for (int i = 0; i < steps.count; ++i) {
    // Stages and phases up front: computed at the waits instead, ptxas scheduled this 24-register loop differently.
    const int s = ss.q_bars.stage(i), sd = ss.do_bars.stage(i);
    const unsigned parity = ss.q_bars.phase(i), parity_do = ss.do_bars.phase(i);
    const int h = h_kv * groups + i / steps.m_count;
    const int m0 = (steps.m_first + i % steps.m_count) * kBlockM;
    // The stats rows come by TMA through tma_stats (lse row, then the D row B·Hq rows further; gridDim.z = B; packed:
    // BwdSeq's rows and first column) like the tiles: compute-sanitizer racecheck flagged the consumers' reads against
    // plain bulk copies into the rows.
    const int stat_row = kVarlen ? seq.stat_row0 + h : b * static_cast<int>(p.num_heads) + h;
    const int delta_row = kVarlen ? seq.delta_row0 + h
                                  : static_cast<int>(gridDim.z) * static_cast<int>(p.num_heads) + stat_row;
    unsigned long long* q_full = ss.q_bars.acquire(s, parity, Smem::kQBytes + Smem::kStatBytes);
    T* q_dst = ss.q + s * kBlockM * kHeadDim;
    #pragma unroll
    for (int c = 0; c < Smem::kColBlocks; ++c)
      tma::load_4d(q_dst + c * kBlockM * 64, &p.tma_q, q_full, c * 64, seq.q0 + m0, h, b);
    tma::load_2d(ss.lse + s * kBlockM, &p.tma_stats, q_full, seq.stat_col + m0, stat_row);
    unsigned long long* do_full = ss.do_bars.acquire(sd, parity_do, Smem::kQBytes + Smem::kStatBytes);
    T* do_dst = ss.dout + sd * kBlockM * kHeadDim;
    #pragma unroll
    for (int c = 0; c < Smem::kColBlocks; ++c)
      tma::load_4d(do_dst + c * kBlockM * 64, &p.tma_do, do_full, c * 64, seq.q0 + m0, h, b);
    tma::load_2d(ss.delta + sd * kBlockM, &p.tma_stats, do_full, seq.stat_col + m0, delta_row);
  }
}

// Named barrier 1: both consumer warpgroups have stored this step's dSᵀ (see the protocol above). For consumer
// warpgroup w and the dQ writer warp (128 + 32 threads): kDqFullBarrier + w, its
// staging holds the step's dQ (the warpgroup arrives, the writer waits); kDqEmptyBarrier + w, the writer's reduce
// has read it (the writer arrives, the warpgroup waits before writing the next step's).
constexpr int kDsReadyBarrier = 1;
constexpr int kDqFullBarrier = 2;
constexpr int kDqEmptyBarrier = 4;
constexpr int kDqBarrierThreads = 160;

// The dQ writer (one warp of the producer warpgroup): per step, for each consumer warpgroup in turn,
// waits until its staging holds the step's scale · dQ tile (or, in two rounds, half of it), has lane 0 reduce it into
// dq_accum by TMA (kStageCols / 32 boxes of 32 columns × 64 rows a round; rows past L and columns past E clipped) and
// wait until the copies have read the staging, then lets the warpgroup write it again (one arrival before the first
// round, none after the last: each consumer round waits once).
// Why a writer warp: a consumer thread's fence.proxy.async (MEMBAR.ALL.CTA in SASS) waits for that thread's own
// outstanding global operations; reductions issued by the consumers (red.global.add, or TMA reduces from their
// threads) put that wait into every step, a large share of the kernel at head dims 64 and 128
// (bench/notes/kernels_flash_bwd_sm90.md).
template <bool kVarlen, typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages>
__device__ __forceinline__ void bwd_dq_write(const FlashBwdSm90Params& p,
                                             const BwdSharedStorage<T, kHeadDim, kBlockM, kBlockN, kStages>& ss,
                                             const BwdSeq& seq, int h_kv, BwdSteps steps, int lane) {
  const int b = seq.b_map;
  using Smem = BwdSharedStorage<T, kHeadDim, kBlockM, kBlockN, kStages>;
  using Dq = BwdDq<kHeadDim, kBlockM, kBlockN>;
  // Step i's query head and block (bwd_produce's), by counters: this warp has 24 registers (setmaxnreg.dec).
  int h = h_kv * static_cast<int>(p.groups), mb = steps.m_first;
  tma::named_barrier_arrive(kDqEmptyBarrier, kDqBarrierThreads);  // both stagings start free
  tma::named_barrier_arrive(kDqEmptyBarrier + 1, kDqBarrierThreads);
  #pragma unroll 1
  for (int i = 0; i < steps.count; ++i) {
    const int m0 = seq.q0 + mb * kBlockM;  // rows of the accumulator (packed: past L, the next sequence's, + 0)
    #pragma unroll
    for (int round = 0; round < Dq::kRounds; ++round) {
      #pragma unroll
      for (int w = 0; w < 2; ++w) {
        tma::named_barrier_sync(kDqFullBarrier + w, kDqBarrierThreads);
        if (lane == 0) {
          const unsigned char* stage = reinterpret_cast<const unsigned char*>(ss.dq_stage) + w * Smem::kDqStageBytes;
          #pragma unroll
          for (int box = 0; box < Dq::kStageCols / 32; ++box)
            tma::reduce_add_4d(&p.tma_dq, stage + box * 8192,
                               64 * Dq::col_block(w) + round * Dq::kStageCols + 32 * box, m0 + 64 * Dq::row_block(w),
                               h, b);
          tma::bulk_commit();
          tma::bulk_wait_read();
        }
        __syncwarp();
        if (i + 1 < steps.count || round + 1 < Dq::kRounds)
          tma::named_barrier_arrive(kDqEmptyBarrier + w, kDqBarrierThreads);
      }
    }
    if (++mb == steps.m_first + steps.m_count) {
      mb = steps.m_first;
      ++h;
    }
  }
  if (lane == 0) tma::bulk_wait();  // the reduces complete before the block exits
}

// dV += Pᵀ dO or dK += dSᵀ Q at kBlockN = 64: acc (64 keys × kN columns) += A (64 keys × kBlockM queries: a Pᵀ or
// dSᵀ buffer, [key][query] K-major as the consumers stored it) · B (kBlockM × kN: dO or Q from this warpgroup's first
// column block on, MN-major: 64-column blocks kBlockM·128 bytes apart (LBO), 8-row groups 1024 bytes (SBO)).
// Issued and committed, not waited for.
template <typename T, int kN, int kBlockM, int kBlockN>
__device__ __forceinline__ void issue_dkv_ss(float (&acc)[kN / 2], unsigned a_tile, unsigned b_tile) {
  wgmma::fence();
  #pragma unroll
  for (int kk = 0; kk < kBlockM / 16; ++kk) {
    const unsigned a = a_tile + (kk / 4) * kBlockN * 128 + (kk % 4) * 32;
    wgmma::Mma<T, kN>::ss_bmn(acc, wgmma::desc_sw128(a, 16, 1024),
                              wgmma::desc_sw128(b_tile + kk * 16 * 128, kBlockM * 128, 1024), 1);
  }
  wgmma::commit();
}

// One consumer warpgroup (wg = 0 or 1; tid = thread index within the two consumer warpgroups, 0..255): its tiles of
// the block as BwdSplit gives them (64 keys; at kBlockN = 128 keys n0 + 64·wg ... + 63, at kBlockN = 64 all keys of
// the block with half of the queries for Sᵀ and half of the columns for dK, dV). dK and dV (fp32) stay in registers
// across all steps; per step
//   Sᵀ = K Qᵀ, dPᵀ = V dOᵀ                (ss, 64 × kSN each, issued together)
//   Pᵀ = 2^(Sᵀ·scale·log2 e − lse·log2 e)  (masked on the sequence end and the causal diagonal)
//   dSᵀ = Pᵀ ∘ (dPᵀ − D)
//   dV += Pᵀ dO, dK += dSᵀ Q              (rs: Pᵀ and dSᵀ from registers, or at kBlockN = 64 ss_bmn: both warpgroups'
//                                          Pᵀ, dSᵀ from shared memory; dO, Q MN-major)
//   dQ (64 × kDqN of this warpgroup) = dS K (ss_mn: dSᵀ from shared memory, all keys of the block), then written to
//   this warpgroup's staging for the dQ writer's TMA reduce into dq_accum (bwd_dq_write).
// wgmma groups complete in order: after issuing Sᵀ and dPᵀ, wait<1> returns with Sᵀ done, so the exponentials run
// while dPᵀ is in flight; dV is issued before dQ, wait<1> then releases dO (dV done) while dQ runs, and so on. The
// named barrier sits after dV's issue at kBlockN = 128 (dV reads only this warpgroup's registers) and before it at
// kBlockN = 64 (dV reads the other warpgroup's Pᵀ).
// kMode (sm90/bwd_variants.cuh: BwdMode): kPlain for the plain instantiations; the kVariants ones run kWindow (the
// mask at a window's lower edge too) or kScoreMods (softcap and/or ALiBi: tanh between the waits, Pᵀ and the
// softcap's factor in the dS pass), picked per CTA by the kernel.
// kUserMod: Mod's score_mod / mask_mod (aux: its arrays in the kernel's parameters), per element in the dS pass.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, BwdMode kMode, bool kVarlen,
          typename Mod = NoMod>
__device__ __forceinline__ void bwd_consume(const FlashBwdSm90Params& p,
                                            const BwdSharedStorage<T, kHeadDim, kBlockM, kBlockN, kStages>& ss,
                                            const BwdSeq& seq, int n0, int h_kv, int b, BwdSteps steps, int tid,
                                            const typename Mod::Aux* aux = nullptr) {
  using Smem = BwdSharedStorage<T, kHeadDim, kBlockM, kBlockN, kStages>;
  using Split = BwdSplit<kHeadDim, kBlockM, kBlockN>;
  constexpr int kSN = Split::kSN, kKvN = Split::kKvN;
  using Dq = BwdDq<kHeadDim, kBlockM, kBlockN>;
  constexpr int kDqN = Dq::kN;
  static_assert(kSN % 16 == 0 && kKvN % 64 == 0, "whole k steps of Sᵀ; 64-column blocks of dK, dV");
  // Warpgroup and warp indices through a shuffle: ptxas then knows them warp-uniform and keeps what derives from them
  // (descriptor addresses, key ranges) in uniform registers, next to 192 live accumulators at the peak.
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0), warp = __shfl_sync(0xffffffffu, (tid / 32) % 4, 0);
  const int lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int dq_rb = Dq::row_block(wg), dq_cb = Dq::col_block(wg);  // dQ tile: query, column block
  const int key_wg = n0 + Split::key_row(wg);  // first key of this warpgroup
  const int key0 = key_wg + 16 * warp + g;     // this lane's keys: key0 and key0 + 8
  const int q_col = Split::q_col(wg);          // first query (within the step) of this warpgroup's Sᵀ
  const int kv_col = Split::kv_col(wg);        // first column of this warpgroup's dK, dV
  // The sequence's lengths and bounds: a packed call's from BwdSeq, a dense call's read here from the parameters.
  const int S = kVarlen ? seq.S : static_cast<int>(p.seqlen_k);
  const bool causal = p.is_causal != 0;
  const int causal_offset = static_cast<int>(kVarlen ? seq.causal_offset : p.causal_offset);  // |S − L| < 2^31
  const float sc = static_cast<float>(p.scale_log2);
  const int groups = static_cast<int>(p.groups);
  // The variants (sm90/bwd_variants.cuh; kMode != kPlain). A window's lower bound that binds for some row has −L <
  // window_lo < S; one that binds for none (or none at all) becomes −(L + 3·kBlockM), which no tile's edge test or
  // column limit reaches. kScoreMods: the softcap (softcap_in != 0) and ALiBi (alibi_k != 0 per step) at run time.
  constexpr bool kVariants = kMode != BwdMode::kPlain;
  constexpr bool kUserMod = kMode == BwdMode::kUserMod;
  constexpr bool kScoreMods = kMode == BwdMode::kScoreMods || kUserMod;  // Pᵀ per element in the dS pass
  const int L = kVarlen ? seq.L : static_cast<int>(p.seqlen_q);
  const long long lo = kVarlen ? seq.window_lo : p.window_lo;
  const int window_lo = kVariants && lo > (kVarlen ? -L : -p.seqlen_q) ? static_cast<int>(lo) : -(L + 3 * kBlockM);
  const float softcap_in = kMode == BwdMode::kScoreMods ? static_cast<float>(p.softcap_in) : 0.f;
  const bool capped = softcap_in != 0.f;
  const int dist_lane = 2 * t + S - L - key0;  // ALiBi's distance i + S − L − j of the lane's first element, − q0

  float acc_dk[kKvN / 2], acc_dv[kKvN / 2];
  #pragma unroll
  for (int i = 0; i < kKvN / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;
  float acc_s[kSN / 2], acc_dp[kSN / 2], dq[kDqN / 2];
  unsigned pa[kSN / 16][4], dsa[kSN / 16][4];

  // Descriptor addresses. K and V: this warpgroup's 64 rows inside each kBlockN-row column block.
  const unsigned k_base = tma::smem_u32(ss.k), v_base = tma::smem_u32(ss.v);
  const unsigned q_base = tma::smem_u32(ss.q), do_base = tma::smem_u32(ss.dout), ds_base = tma::smem_u32(ss.ds);
  const unsigned p_base = tma::smem_u32(ss.p);
  // dSᵀ (and Pᵀ) stores (stmatrix x4, one per 16-query k step): lane l gives the row address of matrix l / 8 (rows:
  // keys key_row + 16·warp + l % 8, + 8 for matrices 1 and 3; 16-byte chunk 2kk (+1 for matrices 2 and 3) of the
  // row, at chunk ^ (row % 8) in the swizzle, kk counted from query 0 of the step). Row r sits at r · 128 bytes
  // inside a column block of 64 queries.
  const int st_row = Split::key_row(wg) + 16 * warp + lane % 8 + 8 * ((lane / 8) % 2);
  const unsigned ds_lane = ds_base + st_row * 128, p_lane = p_base + st_row * 128;
  const int ds_xor = (lane / 16) ^ (lane % 8);  // (2kk + lane / 16) ^ (row % 8) = 2kk ^ ds_xor, 2kk even

  // Sᵀ = K Qᵀ (or dPᵀ = V dOᵀ: a = V, b = dO): 64 keys × kSN queries, kHeadDim/16 k steps of 32 bytes inside a
  // swizzled 128-byte row, the next 64-column block every 4 steps. Issued and committed, not waited for.
  auto issue_ss = [&](float (&acc)[kSN / 2], unsigned a_tile, unsigned b_tile) {
    #pragma unroll
    for (int j = 0; j < kSN / 2; ++j) acc[j] = 0.f;
    wgmma::fence();
    #pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const unsigned a = a_tile + (kk / 4) * kBlockN * 128 + Split::key_row(wg) * 128 + (kk % 4) * 32;
      const unsigned bb = b_tile + (kk / 4) * kBlockM * 128 + q_col * 128 + (kk % 4) * 32;
      wgmma::Mma<T, kSN>::ss(acc, wgmma::desc_sw128(a, 16, 1024), wgmma::desc_sw128(bb, 16, 1024), kk > 0);
    }
    wgmma::commit();
  };
  // acc (64 keys × kKvN) += A (64 keys × kBlockM queries, registers) · B (kBlockM × kKvN, MN-major: its 64-column
  // blocks kBlockM·128 bytes apart (LBO), 8-row groups 1024 bytes (SBO)). kBlockN = 128 only (kSN = kBlockM there);
  // kBlockN = 64 reads A from shared memory: issue_dkv_ss.
  auto issue_rs = [&](float (&acc)[kKvN / 2], const unsigned (&a)[kSN / 16][4], unsigned b_tile) {
    wgmma::fence();
    #pragma unroll
    for (int kk = 0; kk < kSN / 16; ++kk)
      wgmma::Mma<T, kKvN>::rs(acc, a[kk], wgmma::desc_sw128(b_tile + kk * 16 * 128, kBlockM * 128, 1024), 1);
    wgmma::commit();
  };

  tma::mbar_wait(ss.kv_full, 0);
  for (int i = 0; i < steps.count; ++i) {
    const int s = i % kStages;
    const int m0 = (steps.m_first + i % steps.m_count) * kBlockM;
    const int sd = i % Smem::kDoStages;
    const unsigned q_st = q_base + s * Smem::kQBytes, do_st = do_base + sd * Smem::kQBytes;
    const unsigned ds_buf = (i & 1) * Smem::kDSBytes;

    // ALiBi's factor for this step's query head (its slope read while the GEMMs run); 0 without ALiBi.
    float alibi_k = 0.f;
    if (kScoreMods && p.alibi_slopes)
      alibi_k = -p.alibi_slopes[b * p.alibi_stride_b + h_kv * groups + i / steps.m_count]
                * static_cast<float>(p.alibi_scale);

    ss.q_bars.wait(i);
    issue_ss(acc_s, k_base, q_st);
    ss.do_bars.wait(i);
    issue_ss(acc_dp, v_base, do_st);

    // Pᵀ while dPᵀ runs. Rows past L have lse = +inf (P = 0); keys past S and above the causal diagonal (with
    // kVariants also below a window's lower edge: this tile's last query sees keys from q0 + kSN − 1 + window_lo on)
    // are masked only in blocks that have any (warpgroup-uniform test; bwd_mask: the columns 8j + e of this lane,
    // queries q0 + 8j + 2t + e, hidden from key0 + 8·half). kScoreMods: only the softcap's tanh runs here, and the dS
    // pass below forms Pᵀ with its bias and mask (sm90/bwd_variants.cuh).
    wgmma::wait<1>();
    wgmma::fence_operands(acc_s);
    const float* lse = ss.lse + s * kBlockM + q_col;
    const int q0 = m0 + q_col;  // first query of this warpgroup's Sᵀ columns
    const float* delta = ss.delta + sd * kBlockM + q_col;
    [[maybe_unused]] int lo[2], hi[2];  // kScoreMods: the visible columns lo <= 8j + e <= hi of key0 + 8·half
    [[maybe_unused]] float dist;        // kScoreMods: ALiBi's distance i + S − L − j of the lane's first element
    if constexpr (!kScoreMods) {
      bwd_exp_scores<kSN>(acc_s, lse, t, sc);
      if (key_wg + 63 >= S || (causal && key_wg + 63 > q0 + causal_offset)
          || (kVariants && q0 + kSN - 1 + window_lo > key_wg))
        bwd_mask<kSN, kVariants>(acc_s, key0, q0, t, S, causal, causal_offset, window_lo);
    } else {
      if (capped) bwd_tanh_scores<kSN>(acc_s, softcap_in);
      const bool edge = key_wg + 63 >= S || (causal && key_wg + 63 > q0 + causal_offset)
                        || q0 + kSN - 1 + window_lo > key_wg;
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        lo[half] = edge ? bwd_first_col<kSN>(key0 + 8 * half, q0, t, S, causal, causal_offset) : 0;
        hi[half] = edge ? bwd_last_col(key0 + 8 * half, q0, t, window_lo) : kSN;
      }
      dist = static_cast<float>(q0 + dist_lane);
    }
    // ptxas keeps the exponentials above this wait here (tests/test_backward_sm90.py checks the SASS), without the
    // forward's scheduling barrier (sm90/mainloop.cuh): a MEMBAR.SC.CTA would also order the previous step's dQ
    // reductions, which may still be in flight.
    wgmma::wait<0>();
    wgmma::fence_operands(acc_dp);
    // dSᵀ = Pᵀ ∘ (dPᵀ − D), and Pᵀ, dSᵀ packed as A fragments (query = the k dimension of dV's and dK's GEMMs: the
    // 8 columns 8j.. are k step j / 2, registers 2·(j % 2) + half), one 8-column tile at a time so that its fp32
    // values die at once; each k step's dSᵀ (and at kBlockN = 64 its Pᵀ) also goes to shared memory (one stmatrix:
    // the four registers of an A fragment are four 8 × 8 matrices; conflict-free, the swizzle spreads 8 rows over 8
    // chunks). kScoreMods: each element's Pᵀ first (bias, mask), and dSᵀ with the softcap's factor (1 − t²).
    #pragma unroll
    for (int j = 0; j < kSN / 8; ++j) {
      const float2 d = *reinterpret_cast<const float2*>(delta + 8 * j + 2 * t);
      [[maybe_unused]] float2 l;
      if constexpr (kScoreMods) l = *reinterpret_cast<const float2*>(lse + 8 * j + 2 * t);
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int a = 4 * j + 2 * half;
        float ds0, ds1;
        if constexpr (kUserMod) {
          const int qi = q0 + 8 * j + 2 * t, kj = key0 + 8 * half, hq = h_kv * groups + i / steps.m_count;
          const bool with_mask = !(q0 >= steps.full_first && q0 + kSN - 1 <= steps.full_last);
          ds0 = bwd_user_mod_ds<Mod>(acc_s[a], acc_dp[a], l.x, d.x, sc, 8 * j < lo[half] || 8 * j > hi[half], b, hq,
                                     qi, kj, L, *aux, with_mask);
          ds1 = bwd_user_mod_ds<Mod>(acc_s[a + 1], acc_dp[a + 1], l.y, d.y, sc,
                                     8 * j + 1 < lo[half] || 8 * j + 1 > hi[half], b, hq, qi + 1, kj, L, *aux,
                                     with_mask);
        } else if constexpr (kScoreMods) {
          const float dist0 = dist + static_cast<float>(8 * j - 8 * half);  // element a's (a + 1's: one more)
          ds0 = bwd_score_mod_ds(acc_s[a], acc_dp[a], l.x, d.x, sc, capped, alibi_k, dist0,
                                 8 * j < lo[half] || 8 * j > hi[half]);
          ds1 = bwd_score_mod_ds(acc_s[a + 1], acc_dp[a + 1], l.y, d.y, sc, capped, alibi_k, dist0 + 1.f,
                                 8 * j + 1 < lo[half] || 8 * j + 1 > hi[half]);
        } else {
          ds0 = acc_s[a] * (acc_dp[a] - d.x), ds1 = acc_s[a + 1] * (acc_dp[a + 1] - d.y);
        }
        pa[j / 2][2 * (j % 2) + half] = pack2<T>(acc_s[a], acc_s[a + 1]);
        dsa[j / 2][2 * (j % 2) + half] = pack2<T>(ds0, ds1);
      }
      if (j % 2 == 1) {
        const int kk = j / 2, kq = q_col / 16 + kk;  // k step within this warpgroup's queries, within the step's
        stmatrix_x4(ds_lane + ds_buf + (kq / 4) * kBlockN * 128 + (((2 * kq) % 8) ^ ds_xor) * 16, dsa[kk][0],
                    dsa[kk][1], dsa[kk][2], dsa[kk][3]);
        if constexpr (Split::kByColumns)
          stmatrix_x4(p_lane + ds_buf + (kq / 4) * kBlockN * 128 + (((2 * kq) % 8) ^ ds_xor) * 16, pa[kk][0],
                      pa[kk][1], pa[kk][2], pa[kk][3]);
      }
    }
    const unsigned do_kv = do_st + (kv_col / 64) * kBlockM * 128, q_kv = q_st + (kv_col / 64) * kBlockM * 128;
    if constexpr (!Split::kByColumns) issue_rs(acc_dv, pa, do_kv);
    tma::fence_proxy_async();  // the dSᵀ (Pᵀ) stores, before the barrier, become visible to the other warpgroup's wgmma
    tma::named_barrier_sync(kDsReadyBarrier, 256);
    if constexpr (Split::kByColumns) issue_dkv_ss<T, kKvN, kBlockM, kBlockN>(acc_dv, p_base + ds_buf, do_kv);

    // dQ tile (queries 64·dq_rb, columns 64·dq_cb ... + kDqN) = dS K over the block's kBlockN keys: A = dSᵀ's column
    // block dq_rb (MN-major, 64 queries × 16 keys per step, one 1024-byte atom pair per step), B = K's column blocks
    // from dq_cb (MN-major: keys = k, head-dim columns = n).
    #pragma unroll
    for (int j = 0; j < kDqN / 2; ++j) dq[j] = 0.f;
    wgmma::fence();
    #pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const unsigned a = ds_base + ds_buf + dq_rb * kBlockN * 128 + kk * 16 * 128;
      const unsigned bk = k_base + dq_cb * kBlockN * 128 + kk * 16 * 128;
      wgmma::Mma<T, kDqN>::ss_mn(dq, wgmma::desc_sw128(a, kBlockN * 128, 1024),
                                 wgmma::desc_sw128(bk, kBlockN * 128, 1024), kk > 0);
    }
    wgmma::commit();
    wgmma::wait<1>();  // dV += Pᵀ dO done: dO's stage is free
    wgmma::fence_operands(acc_dv);
    ss.do_bars.release(i, lane);
    if constexpr (Split::kByColumns) {
      issue_dkv_ss<T, kKvN, kBlockM, kBlockN>(acc_dk, ds_base + ds_buf, q_kv);
    } else {
      issue_rs(acc_dk, dsa, q_kv);
    }
    wgmma::wait<1>();  // dQ done
    wgmma::fence_operands(dq);
    // scale · dQ into this warpgroup's staging (float2 of columns 8j + 2t, + 1 of rows g, g + 8 of its warp's 16:
    // 16-byte chunk 2(j % 4) + t / 2 of box j / 4's row, at chunk ^ (row % 8); a warp's store covers 16 distinct
    // chunks, two wavefronts) once the dQ writer has read the previous step's (kDqEmptyBarrier), then a proxy fence
    // and an arrival on kDqFullBarrier: bwd_dq_write reduces it into dq_accum by TMA.
    // The lane's address for j % 4 = 0 (1024-byte aligned staging, rows 128 bytes: bits 4-6 are the chunk); the
    // others XOR 2(j % 4) into the chunk (2(j % 4) + t / 2 = 2(j % 4) ^ t / 2), one register for all stores.
    // With two rounds (kBlockN = 64) the second waits for the writer to have read the first.
    const unsigned lane_addr = tma::smem_u32(ss.dq_stage) + wg * Smem::kDqStageBytes + (16 * warp + g) * 128
                               + (((t / 2) ^ g) * 16) + 8 * (t % 2);
    const float scale = static_cast<float>(p.scale);
    #pragma unroll
    for (int round = 0; round < Dq::kRounds; ++round) {
      tma::named_barrier_sync(kDqEmptyBarrier + wg, kDqBarrierThreads);
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        #pragma unroll
        for (int jj = 0; jj < Dq::kStageCols / 8; ++jj) {
          const int j = round * (Dq::kStageCols / 8) + jj;
          st_shared_f32x2((lane_addr ^ ((2 * (jj % 4)) << 4)) + (jj / 4) * 8192 + half * 1024,
                          scale * dq[4 * j + 2 * half], scale * dq[4 * j + 2 * half + 1]);
        }
      }
      tma::fence_proxy_async();
      tma::named_barrier_arrive(kDqFullBarrier + wg, kDqBarrierThreads);
    }
    wgmma::wait<0>();  // dK += dSᵀ Q done: Q's stage is free
    wgmma::fence_operands(acc_dk);
    ss.q_bars.release(i, lane);
  }

  const KvRows kv = bwd_kv_rows<kVarlen>(p, b, p.num_heads / groups, h_kv, S);
  store_grad<T, kKvN>(acc_dk, static_cast<T*>(p.dk) + kv.first * p.head_dim, key0, t, kv_col, S,
                      static_cast<int>(p.head_dim), static_cast<float>(p.scale), kv.step);
  store_grad<T, kKvN>(acc_dv, static_cast<T*>(p.dv) + kv.first * p.head_dim_v, key0, t, kv_col, S,
                      static_cast<int>(p.head_dim_v), 1.f, kv.step);
}

}  // namespace sm90
}  // namespace cupy_attn
