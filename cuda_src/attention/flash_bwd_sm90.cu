// Fused attention backward for Hopper (sm_90a), FlashAttention-3 design: dQ, dK, dV of out = softmax(scale · Q Kᵀ) V
// with an optional causal mask (top-left or bottom-right), GQA, fp16/bf16, head dims up to 256; the kVariants
// instantiations also serve a sliding window's lower bound (the upper bound is the causal one), softcap and ALiBi
// (sm90/bwd_variants.cuh: the consumers' two modes, picked per CTA from the parameters).
//
// Math (FlashAttention-2's backward, Dao 2023, Algorithm 2, as flash_bwd.cu): with P rebuilt from the forward's lse
// and D_i = Σ_c dO_ic O_ic (attn_bwd_delta_padded in bwd_rows.cu, which also stores lse·log2 e),
//   dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ∘ (dP − D),  dK = scale · dSᵀ Q,  dQ = scale · dS K.
// Structure (FlashAttention-3, Shah et al. 2024, §3 and its hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp; our own code on
// the forward's TMA/mbarrier/wgmma vocabulary, common/tma.cuh and common/wgmma.cuh):
//   * one block per kBlockN keys (128; 64 at D = 256) of a key/value head; it loops over the query heads of its GQA
//     group and over the query blocks that see its keys, so dK and dV accumulate in registers (fp32) across the group;
//   * warp specialization: warpgroup 0 is the producer (setmaxnreg.dec 24; one thread issues every TMA load: K and V
//     once, Q + its lse row and dO + its D row per step, into 2-stage mbarrier rings), warpgroups 1 and 2 are the
//     consumers (setmaxnreg.inc 240), 64 keys each (at D = 256 the same 64 keys, split by queries and columns);
//   * the five GEMMs on wgmma: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (both operands from shared memory), dV += Pᵀ dO and
//     dK += dSᵀ Q (Pᵀ, dSᵀ straight from the accumulator registers as A fragments; at D = 256 from shared memory),
//     dQ = dS K (dSᵀ through shared memory, read as an MN-major A operand; K as stored, as an MN-major B operand):
//     no transposed copy of any tile;
//   * dQ is reduced across key blocks into a zeroed fp32 (B, Hq, L, E) buffer that the launcher rounds to the input
//     dtype (as flash_bwd.cu). Each consumer warpgroup writes its dQ tile into a shared staging buffer and warp 1 of
//     the producer warpgroup (the dQ writer, sm90/bwd_mainloop.cuh: bwd_dq_write) adds it into the buffer by TMA
//     reduces, as FlashAttention-3 does (at kBlockN = 64 half the tile at a time, with dO single-staged to make
//     room). Not the consumers' own reductions (red.global.add): each step's fence.proxy.async (MEMBAR.ALL.CTA)
//     waits for the issuing thread's outstanding global operations.
// Why TMA + a producer warpgroup rather than cp.async double-buffering: the consumers hold 128 fp32 dK/dV
// accumulators at D = 128 plus Sᵀ and dPᵀ (64 + 64 at D = 64, kBlockM = 128), so they have no registers for copy
// addresses, and TMA's zero fill past L, S and E replaces all bounds code (the forward's FA3 kernel beat its cp.async
// wgmma predecessor with this structure). Two stages: a third would cost 32 KB for a step that already
// overlaps one load with one step of five GEMMs.
//
// Thread mapping (consumers, sm90/bwd_mainloop.cuh: BwdSplit): at kBlockN = 128 warpgroup w owns keys n0 + 64w ...
// + 63; Sᵀ, dPᵀ are m64 × kBlockM wgmma accumulators whose per-warp layout is mma.sync's (lane 4g+t: keys g, g+8 of
// its warp's 16; queries 8j+2t, +1), so the lse and D of a column come from shared memory and no shuffle is needed.
// dQ of a step (kBlockM × kHeadDim) is two 64 × 64 tiles, one per warpgroup. At kBlockN = 64 (D = 256: 64 keys ×
// 256 columns of dK and dV would be 256 fp32 registers per thread) both warpgroups own keys n0 ... + 63: warpgroup w
// computes Sᵀ, dPᵀ for queries 32w ... + 31 of the step, dK, dV for columns 128w ... + 127 (Pᵀ and dSᵀ of all 64
// queries from shared memory) and dQ's 64 × 128 tile of those columns.
//
// Tiles (cupy_attn/attention/backward_sm90.py, SM90_BWD_TILES): D = 128: kBlockM = 64 (FA3's hdim-128 tile): dK + dV
// 128 registers, Sᵀ + dPᵀ 64; D = 64: kBlockM = 128 (FA3's hdim-64 tile): dK + dV 64, Sᵀ + dPᵀ 128; D = 256:
// kBlockM = kBlockN = 64: dK + dV 128, Sᵀ + dPᵀ 32, dQ 64 (FA3's hdim-256 backward: 64 × 80 with the head dim split
// over two warpgroups and P, dS in shared memory). Shared memory: K, V, 2 stages of Q and dO, 2 dSᵀ buffers (and 2
// Pᵀ buffers at D = 256; there dO has one stage), 2 dQ staging buffers of 16 KB, statistics: 194 KB at D = 128,
// 195 KB at D = 64, 226 KB at D = 256 of the 227 KB per block. Accumulation fp32; P and dS are rounded to T only as
// MMA operands.
//
// History and measurements: bench/notes/kernels_flash_bwd_sm90.md.
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/wgmma.cuh"
#include "common/tma.cuh"
#include "common/visibility.cuh"
#include "attention/sm90/bwd_params.cuh"
#include "attention/sm90/bwd_mainloop.cuh"
#include "attention/sm90/roles.cuh"

namespace cupy_attn {

// kVariants: the parameters' window_lo, softcap_in and alibi_slopes are read at run time (any may be off); false: the
// plain kernel, without their code. Grid: (ceil(S / kBlockN), Hkv, B); block: 384 threads.
// Mod: a user's score_mod / mask_mod (flash_bwd_sm90_mod below; with kVariants), its consumers in kUserMod.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, bool kVariants, bool kVarlen,
          typename Mod = NoMod>
__device__ __forceinline__ void flash_bwd_sm90_body(const FlashBwdSm90Params& p,
                                                    const typename Mod::Aux* aux = nullptr,
                                                    const KeyRanges* qr = nullptr) {
  using namespace sm90;
  using Smem = BwdSharedStorage<T, kHeadDim, kBlockM, kBlockN, kStages>;
  static_assert(kBlockN == 128 || kBlockN == 64, "two consumer warpgroups of 64 keys each, or sharing 64 keys");
  static_assert(kHeadDim % 64 == 0 && kBlockM % 64 == 0 && kBlockM <= 256, "64-column swizzle atoms, TMA box <= 256");
  static_assert(kStages >= 2, "Q and dO rings of at least two stages");
  static_assert(Smem::kBytes <= sm90::kMaxSmemBytes, "227 KB of shared memory per block");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Smem ss(smem_raw);

  const int n0 = blockIdx.x * kBlockN, h_kv = blockIdx.y, b = blockIdx.z;
  const BwdSeq seq = bwd_seq<kVarlen, kBlockM>(p, b);  // packed calls: sequence b's rows and keys
  if (kVarlen && n0 >= seq.S) return;  // the grid covers the longest sequence's keys
  const int L = seq.L, S = seq.S;
  // Queries that see a key of this block: i >= n0 - causal_offset when causal, all otherwise; with kVariants also
  // i <= (the block's last key) − window_lo under a window's lower bound (Visibility::first_row, last_row).
  BwdSteps steps;
  const Visibility vis = [&] {
    if constexpr (kVarlen) {
      return Visibility{seq.S, seq.causal_offset, p.is_causal != 0, seq.window_lo != kNoLowerBound, seq.window_lo};
    } else {
      return visibility_of(p);
    }
  }();
  if constexpr (kVariants) {
    long long first = max(0ll, vis.first_row(n0));
    long long last = min(static_cast<long long>(L) - 1, vis.last_row(min(n0 + kBlockN, S) - 1));
    if (qr != nullptr && qr->ranges != nullptr) {  // a mask_mod's query rows per key block, over the group's heads
      long long q_first = L, q_last = -1;
      int f_first = 0, f_last = L - 1;  // the rows every (head, key) of the block is seen by: the full runs' meet
      const int groups = static_cast<int>(p.groups);
      for (int g = 0; g < groups; ++g)
        for (int key = n0; key < min(n0 + kBlockN, S); key += static_cast<int>(qr->block_rows)) {
          const int* r = qr->of(b, h_kv * groups + g, key);
          q_first = min(q_first, static_cast<long long>(r[0]));
          q_last = max(q_last, static_cast<long long>(r[1]));
          f_first = max(f_first, r[2]);
          f_last = min(f_last, r[3]);
        }
      first = max(first, q_first);
      last = min(last, q_last);
      steps.full_first = f_first;
      steps.full_last = f_last;
    }
    steps.m_first = static_cast<int>(min(first, static_cast<long long>(L)) / kBlockM);
    steps.m_count = first <= last ? static_cast<int>(last / kBlockM) - steps.m_first + 1 : 0;
  } else {
    steps.m_first = p.is_causal ? static_cast<int>(max(0ll, vis.causal_first_row(n0) / kBlockM)) : 0;
    steps.m_count = (L + kBlockM - 1) / kBlockM - steps.m_first;
  }
  steps.count = steps.m_count > 0 ? static_cast<int>(p.groups) * steps.m_count : 0;
  if (steps.count == 0) {  // no query sees these keys (causal, a window): their dK and dV are 0
    const int rows = min(kBlockN, S - n0);
    const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.head_dim_v);
    const KvRows kv = bwd_kv_rows<kVarlen>(p, b, gridDim.y, h_kv, S);
    T* dk = static_cast<T*>(p.dk) + (kv.first + n0 * kv.step) * E;
    T* dv = static_cast<T*>(p.dv) + (kv.first + n0 * kv.step) * Ev;
    if constexpr (!kVarlen) {  // the block's rows are consecutive
      for (int i = threadIdx.x; i < rows * E; i += blockDim.x) dk[i] = from_float<T>(0.f);
      for (int i = threadIdx.x; i < rows * Ev; i += blockDim.x) dv[i] = from_float<T>(0.f);
    } else {  // rows kv.step rows apart
      for (int i = threadIdx.x; i < rows * E; i += blockDim.x) dk[(i / E) * kv.step * E + i % E] = from_float<T>(0.f);
      for (int i = threadIdx.x; i < rows * Ev; i += blockDim.x)
        dv[(i / Ev) * kv.step * Ev + i % Ev] = from_float<T>(0.f);
    }
    return;
  }

  pipeline::init_barriers([&] {
    tma::mbar_init(ss.kv_full, 1);
    ss.q_bars.init(8);  // lane 0 of each of the 8 consumer warps
    ss.do_bars.init(8);
  });
  warp_specialize<RegisterSplit<2>>(
      [&](int tid) {
        if (tid == 0) {
          bwd_produce<kVarlen>(p, ss, seq, n0, h_kv, steps);
        } else if (tid / 32 == 1) {  // warp 1: the dQ writer
          bwd_dq_write<kVarlen>(p, ss, seq, h_kv, steps, tid % 32);
        }
      },
      [&](int tid) {
        if constexpr (Mod::kScore || Mod::kMask) {
          bwd_consume<T, kHeadDim, kBlockM, kBlockN, kStages, BwdMode::kUserMod, kVarlen, Mod>(p, ss, seq, n0, h_kv,
                                                                                               b, steps, tid, aux);
        } else if constexpr (!kVariants) {
          bwd_consume<T, kHeadDim, kBlockM, kBlockN, kStages, BwdMode::kPlain, kVarlen>(p, ss, seq, n0, h_kv, b, steps,
                                                                                         tid);
        } else if (p.softcap_in != 0.0 || p.alibi_slopes) {
          bwd_consume<T, kHeadDim, kBlockM, kBlockN, kStages, BwdMode::kScoreMods, kVarlen>(p, ss, seq, n0, h_kv, b,
                                                                                            steps, tid);
        } else {
          bwd_consume<T, kHeadDim, kBlockM, kBlockN, kStages, BwdMode::kWindow, kVarlen>(p, ss, seq, n0, h_kv, b,
                                                                                         steps, tid);
        }
      });
}

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, bool kVariants, bool kVarlen>
__global__ void __launch_bounds__(384, 1) flash_bwd_sm90(const __grid_constant__ FlashBwdSm90Params p) {
  flash_bwd_sm90_body<T, kHeadDim, kBlockM, kBlockN, kStages, kVariants, kVarlen>(p);
}

// A user's mods (cupy_attn.AttentionMod), dense calls: instantiated only in a mod's own program, which appends the Mod
// struct (attention/mods.py); the parameters are FlashBwdSm90Params, then the mod's.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, typename Mod>
__global__ void __launch_bounds__(384, 1) flash_bwd_sm90_mod(const __grid_constant__
                                                             ModParams<FlashBwdSm90Params, Mod> p) {
  flash_bwd_sm90_body<T, kHeadDim, kBlockM, kBlockN, kStages, true, false, Mod>(p, &p.aux, &p.query_ranges);
}

}  // namespace cupy_attn
