// Mainloop of flash_fwd_sm90.cu, by role: the producer (one thread issuing TMA loads of Q and of the K/V tiles into a
// kStages-deep mbarrier ring) and the consumers (two warpgroups of 64 query rows each: S = Q Kᵀ, softmax, O += P V).
// Owns the shared-memory layout and the pipeline protocol; math of the softmax in softmax.cuh.
//
// Shared-memory tiles are stored as kHeadDim/64 column blocks of rows × 128 bytes, each written by one TMA box in the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)): the canonical K-major layout of a wgmma operand
// (PTX ISA "Shared Memory Matrix Layout"), 8-row atoms 1024 bytes apart, so the same descriptors as flash_fwd.cu's
// wgmma variant read them.
//
// Barriers per stage s: k_full[s] / v_full[s] (1 arrival: the producer's expect_tx, plus the TMA bytes) and
// k_empty[s] / v_empty[s] (8 arrivals: lane 0 of each consumer warp once its wgmma reading the stage has completed).
// Iteration i uses stage i % kStages in round i / kStages; the full barriers' phase parity in round r is r & 1.
#pragma once
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "attention/sm90/params.cuh"
#include "attention/sm90/softmax.cuh"
#include "attention/sm90/epilogue.cuh"

namespace cupy_attn {
namespace sm90 {

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct SharedStorage {
  static constexpr int kColBlocks = kHeadDim / 64;            // 128-byte swizzle atoms hold 64 16-bit columns
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;      // one K or V stage
  static constexpr int kBarriers = 1 + 4 * kStages;            // q_full; k_full, v_full, k_empty, v_empty per stage
  // The dynamic shared memory the launcher must request: tiles, barriers, and 1 KB of slack to align the base to
  // 1024 bytes (the swizzle atoms' alignment; the runtime only guarantees 16).
  static constexpr int kBytes = kQBytes + 2 * kStages * kKVBytes + 8 * kBarriers + 1024;

  T* q;
  T* k;  // kStages tiles of kBlockN rows
  T* v;
  unsigned long long* q_full;
  unsigned long long* k_full;
  unsigned long long* v_full;
  unsigned long long* k_empty;
  unsigned long long* v_empty;

  __device__ __forceinline__ explicit SharedStorage(unsigned char* base) {
    unsigned char* smem = base + ((1024 - tma::smem_u32(base) % 1024) % 1024);
    q = reinterpret_cast<T*>(smem);
    k = reinterpret_cast<T*>(smem + kQBytes);
    v = reinterpret_cast<T*>(smem + kQBytes + kStages * kKVBytes);
    q_full = reinterpret_cast<unsigned long long*>(smem + kQBytes + 2 * kStages * kKVBytes);
    k_full = q_full + 1;
    v_full = k_full + kStages;
    k_empty = v_full + kStages;
    v_empty = k_empty + kStages;
  }
};

// One thread. Q once, then the K and V tiles of key blocks n_blocks-1 down to 0 (the order the consumers visit
// them), each stage reused once both consumer warpgroups have released it.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages>
__device__ __forceinline__ void produce(const FlashFwdSm90Params& p, const SharedStorage<T, kHeadDim, kBlockM, kBlockN,
                                        kStages>& ss, int m0, int h, int b, int n_blocks) {
  using Smem = SharedStorage<T, kHeadDim, kBlockM, kBlockN, kStages>;
  tma::prefetch_map(&p.tma_q);
  tma::prefetch_map(&p.tma_k);
  tma::prefetch_map(&p.tma_v);
  tma::mbar_arrive_expect_tx(ss.q_full, Smem::kQBytes);
  #pragma unroll
  for (int c = 0; c < Smem::kColBlocks; ++c) tma::load_4d(ss.q + c * kBlockM * 64, &p.tma_q, ss.q_full, c * 64, m0, h, b);
  const int h_kv = h / static_cast<int>(p.groups);
  for (int i = 0; i < n_blocks; ++i) {
    const int s = i % kStages, n0 = (n_blocks - 1 - i) * kBlockN;
    const unsigned parity = (i / kStages) & 1;
    // Round 0 waits on parity 1 of a fresh barrier, which returns at once; round r > 0 waits for the consumers'
    // release of round r - 1.
    tma::mbar_wait(&ss.k_empty[s], parity ^ 1);
    tma::mbar_arrive_expect_tx(&ss.k_full[s], Smem::kKVBytes);
    T* k_dst = ss.k + s * kBlockN * kHeadDim;
    #pragma unroll
    for (int c = 0; c < Smem::kColBlocks; ++c)
      tma::load_4d(k_dst + c * kBlockN * 64, &p.tma_k, &ss.k_full[s], c * 64, n0, h_kv, b);
    tma::mbar_wait(&ss.v_empty[s], parity ^ 1);
    tma::mbar_arrive_expect_tx(&ss.v_full[s], Smem::kKVBytes);
    T* v_dst = ss.v + s * kBlockN * kHeadDim;
    #pragma unroll
    for (int c = 0; c < Smem::kColBlocks; ++c)
      tma::load_4d(v_dst + c * kBlockN * 64, &p.tma_v, &ss.v_full[s], c * 64, n0, h_kv, b);
  }
}

// Named barriers 1 and 2: the two consumer warpgroups issue their GEMMs in turns (FlashAttention-3's ping-pong; a
// turn is S_i, or with kOverlap S_i and P_{i-1} V_{i-1}): warpgroup w waits on barrier 1 + w, issues, then arrives
// on the other's. Warpgroup 1 gives warpgroup 0 the first turn and skips its last arrive, so each barrier sees
// exactly as many arrives as syncs (n_blocks turns each; a named barrier left half-arrived at exit is avoided).
constexpr int kPingPongBarrier = 1;

// One consumer warpgroup (wg = 0 or 1; tid = thread index within the two consumer warpgroups, 0..255): 64 query
// rows m0 + 64·wg ... of the block against key blocks n_blocks-1 down to 0, then the epilogue. kHeadDimQK (a multiple
// of 16, ≤ kHeadDim): the columns of Q and K the S GEMM reads; E = 80 or 96 in the kHeadDim = 128 tiles run 5 or 6
// of its 8 k steps (the rest are zeros), while P·V keeps N = kHeadDim.
//
// kOverlap = false: per block i, S_i = Q K_iᵀ (in the ping-pong turn), softmax, O += P_i V_i, each GEMM waited for.
// kOverlap = true (FlashAttention-3's intra-warpgroup overlap, §3.2): the turn issues S_i and then O += P_{i-1}
// V_{i-1}; wgmma.wait_group 1 returns once S_i is done (groups complete in order), so the softmax of S_i can run while
// the P·V GEMM of block i-1 still occupies the tensor cores. P_{i-1}'s registers are read by that GEMM until
// wait_group 0, so S_i stays fp32 until then; only after it are O rescaled and P_i packed (fence_operands on S after
// the wait keeps the compiler from hoisting the packing above it). One S and one P register set, as without overlap.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, bool kOverlap, int kHeadDimQK = kHeadDim>
__device__ __forceinline__ void consume(const FlashFwdSm90Params& p, const SharedStorage<T, kHeadDim, kBlockM, kBlockN,
                                        kStages>& ss, int m0, int h, int b, int n_blocks, int tid) {
  const int wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int wg_row0 = m0 + wg * 64;          // first query row of this warpgroup
  const int row0 = wg_row0 + warp * 16 + g;  // this lane's rows: row0 and row0 + 8
  const int S = static_cast<int>(p.seqlen_k);
  const bool causal = p.is_causal != 0;
  const long long causal_offset = p.causal_offset;
  const float sc = static_cast<float>(p.scale_log2);

  OnlineSoftmax<kBlockN, kHeadDim> softmax;
  softmax.init();
  float o[kHeadDim / 2];
  #pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.f;
  float acc_s[kBlockN / 2];
  unsigned pa[kBlockN / 16][4];

  // Descriptor addresses: this warpgroup's 64 rows of Q inside each 128-row column block; K and V per stage.
  const unsigned q_wg = tma::smem_u32(ss.q) + wg * 64 * 128;
  const unsigned k_base = tma::smem_u32(ss.k), v_base = tma::smem_u32(ss.v);
  constexpr int kKVBytes = kBlockN * kHeadDim * 2;

  // K_i has landed (waited for before taking the ping-pong turn: the turn is not held while TMA is pending).
  auto wait_k = [&](int i) { tma::mbar_wait(&ss.k_full[i % kStages], (i / kStages) & 1); };
  // S (64 × kBlockN) = Q K_iᵀ, issued and committed (not waited for): kHeadDim/16 k steps of 16 elements = 32 bytes
  // inside a 128-byte swizzled row (the hardware applies the XOR to the computed address); every 4 steps the next
  // 64-column block.
  auto issue_s = [&](int i) {
    const int s = i % kStages;
    #pragma unroll
    for (int j = 0; j < kBlockN / 2; ++j) acc_s[j] = 0.f;
    const unsigned k_st = k_base + s * kKVBytes;
    wgmma::fence();
    #pragma unroll
    for (int kk = 0; kk < kHeadDimQK / 16; ++kk) {  // columns past kHeadDimQK are TMA's zero fill: skipped
      const unsigned a = q_wg + (kk / 4) * kBlockM * 128 + (kk % 4) * 32;
      const unsigned bk = k_st + (kk / 4) * kBlockN * 128 + (kk % 4) * 32;
      wgmma::Mma<T, kBlockN>::ss(acc_s, wgmma::desc_sw128(a, 16, 1024), wgmma::desc_sw128(bk, 16, 1024), kk > 0);
    }
    wgmma::commit();
  };
  // O (64 × kHeadDim) += P V_i, issued and committed: P from registers (A-fragment layout), V as an MN-major B operand
  // (transpose-B): its 64-column blocks are kBlockN·128 bytes apart (LBO), 8-row (k) groups 1024 bytes (SBO).
  auto issue_pv = [&](int i) {
    const int s = i % kStages;
    tma::mbar_wait(&ss.v_full[s], (i / kStages) & 1);
    const unsigned v_st = v_base + s * kKVBytes;
    wgmma::fence();
    #pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      wgmma::Mma<T, kHeadDim>::rs(o, pa[kk], wgmma::desc_sw128(v_st + kk * 16 * 128, kBlockN * 128, 1024), 1);
    wgmma::commit();
  };
  // The stage's K or V may be overwritten once all 8 consumer warps have waited for the wgmma reading it.
  auto release = [&](unsigned long long* empty, int i) {
    __syncwarp();
    if (lane == 0) tma::mbar_arrive(&empty[i % kStages]);
  };
  // Only the tile at the end of the keys and tiles crossing this warpgroup's causal diagonal need element masks.
  auto mask = [&](int i) {
    const int n0 = (n_blocks - 1 - i) * kBlockN;
    if (n0 + kBlockN > S || (causal && n0 + kBlockN - 1 > wg_row0 + causal_offset))
      mask_tile<kBlockN>(acc_s, row0, n0, t, p.seqlen_k, causal, causal_offset);
  };
  // End of ping-pong turn i: warpgroup 1 skips its last arrive (see kPingPongBarrier).
  auto pass_turn = [&](int i) {
    if (wg == 0 || i + 1 < n_blocks) tma::named_barrier_arrive(kPingPongBarrier + (wg ^ 1), 256);
  };

  if (wg == 1) tma::named_barrier_arrive(kPingPongBarrier, 256);
  tma::mbar_wait(ss.q_full, 0);

  if constexpr (!kOverlap) {
    for (int i = 0; i < n_blocks; ++i) {
      wait_k(i);
      tma::named_barrier_sync(kPingPongBarrier + wg, 256);
      issue_s(i);
      pass_turn(i);
      wgmma::wait<0>();
      wgmma::fence_operands(acc_s);
      release(ss.k_empty, i);
      mask(i);
      softmax.template step<T>(acc_s, pa, o, sc);
      issue_pv(i);
      wgmma::wait<0>();
      wgmma::fence_operands(o);
      release(ss.v_empty, i);
    }
  } else {
    // Block 0: S_0 and its softmax (O is still 0: nothing to rescale).
    wait_k(0);
    tma::named_barrier_sync(kPingPongBarrier + wg, 256);
    issue_s(0);
    pass_turn(0);
    wgmma::wait<0>();
    wgmma::fence_operands(acc_s);
    release(ss.k_empty, 0);
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
      release(ss.k_empty, i);
      mask(i);
      float alpha[2];
      bool moved[2];
      #pragma unroll
      for (int half = 0; half < 2; ++half) alpha[half] = softmax.update_half(acc_s, half, sc, moved[half]);
      wgmma::fence_operands(acc_s);
      // A scheduling barrier for ptxas (MEMBAR.SC.CTA; the consumers have no memory operations pending here): without
      // it ptxas hoists the wait below to the top of the softmax, so the exponentials ran only after P_{i-1} V_{i-1}
      // finished. With it, D = 64 and 128 run all their MUFU.EX2 between the two waits (checked in the SASS by
      // tests/test_flash_sm90.py). D = 256 still waits first: ptxas places the exponentials in P_{i-1}'s registers.
      __threadfence_block();
      wgmma::wait<0>();  // P_{i-1} V_{i-1} done: O and P's registers are free
      wgmma::fence_operands(o);
      wgmma::fence_operands(acc_s);
      release(ss.v_empty, i - 1);
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (moved[half]) softmax.rescale_half(o, half, alpha[half]);
        softmax.template pack_half<T>(acc_s, pa, half);
      }
    }
    issue_pv(n_blocks - 1);
    wgmma::wait<0>();
    wgmma::fence_operands(o);
    release(ss.v_empty, n_blocks - 1);
  }

  T* out = static_cast<T*>(p.out) + b * p.out_stride_b + h * p.out_stride_h;
  float* lse = p.lse ? p.lse + b * p.lse_stride_b + h * p.lse_stride_h : nullptr;
  store_output<T, kHeadDim>(o, softmax.m, softmax.l, out, p.out_stride_l, lse, p.lse_stride_l, row0, t,
                            static_cast<int>(p.seqlen_q), static_cast<int>(p.head_dim_v));
}

}  // namespace sm90
}  // namespace cupy_attn
