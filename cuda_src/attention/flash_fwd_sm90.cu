// Fused attention forward for Hopper (sm_90a), FlashAttention-3 design: out = softmax(scale · Q Kᵀ) V and
// lse = log Σ_j exp(scale · q·k_j), with an optional causal mask (top-left or bottom-right).
//
// Algorithm: FlashAttention-3 (Shah et al. 2024, "FlashAttention-3: Fast and Accurate Attention with Asynchrony and
// Low-precision", §3.1-3.2), on top of FlashAttention-2's online softmax (the same math as flash_fwd.cu, in base 2:
// S = Q Kᵀ; m' = max(m, rowmax S·c); P = 2^(S·c − m'); l = 2^(m−m')·l + rowsum P; O = 2^(m−m')·O + P V with
// c = scale·log2(e); out = O / l, lse = (m + log2 l)·ln 2). What FA3 adds and this kernel keeps:
//   * warp specialization: warpgroup 0 is the producer: after setmaxnreg.dec to 24 registers, one thread issues every
//     TMA load (cp.async.bulk.tensor with 128- or 64-byte swizzle, completing on mbarriers); warpgroups 1 and 2 (and 3
//     in the 192-row tile) are the consumers (setmaxnreg.inc to 240, or 160 with three: RegisterSplit) and only compute;
//   * a kStages-deep K/V ring with full/empty mbarriers per stage (sm90/mainloop.cuh): loads of the next tiles run
//     while the consumers compute, with no __syncthreads in the loop;
//   * ping-pong: the consumer warpgroups issue their S GEMMs (with kOverlap: both GEMMs) in turn, round robin (named
//     barriers), so one's softmax runs while another's GEMMs occupy the tensor cores;
//   * kOverlap (the variant under CUPY_ATTN_FA3=2): intra-warpgroup overlap, the turn issues S_i = Q K_iᵀ and then
//     O += P_{i-1} V_{i-1}, and the softmax of S_i may run while the second is in flight (sm90/mainloop.cuh).
//   * kPersistent (the variant under CUPY_ATTN_FA3=3, with kOverlap): FlashAttention-3's persistent kernel: grid =
//     min(#SMs, #work units), each CTA loops over its tiles (static striding, sm90/tile_scheduler.cuh: the m-blocks of
//     one head adjacent for L2 reuse of K/V, causal tiles in equal-cost pairs (M−1−k, k)); the producer loads the next
//     tile's first K and its Q while the consumers finish the current tile's last P·V and epilogue (q_empty barrier,
//     K/V ring phases running on across tiles, one ping-pong turn sequence over all tiles: sm90/mainloop.cuh).
// Epilogue: O through a per-warpgroup shared-memory staging buffer and TMA stores (sm90/epilogue.cuh; 4-byte global
// stores where TMA cannot write out exactly).
// Not (yet) here: a dynamic (atomic-counter) tile scheduler, clusters, attn_mask, head dims up to 32
// (flash_fwd.cu serves those calls). Head dims between the buckets 64/96/128/256 run the next one on TMA's zero fill.
//
// Thread mapping: 384 threads (512 with kBlockM = 192). Warpgroup w = 1 ... kBlockM/64 owns query rows m0 + 64(w−1)
// ... + 63 of the block: S and O are
// wgmma m64 accumulators, whose per-warp layout is mma.sync's (lane 4g+t: rows g, g+8; columns 8j+2t, +1), so the
// softmax row statistics need a quad shuffle only (sm90/softmax.cuh). P goes from the S registers into the A
// fragments of O += P V (wgmma with A from registers).
//
// Tiles (cupy_attn/attention/fused_sm90.py, SM90_TILES): kBlockM = 128 (2 × 64), kBlockN = 128 at D = 64, 96 and 128,
// 64 at D = 256; 2 stages, 3 at D = 96. M192_MODE_TILES (non-causal calls at D = 64 in the overlap and persistent
// variants; CUPY_ATTN_FA3_M192 overrides): kBlockM = 192 (3 × 64), FlashAttention-3's hdim-64 tile. Shared memory
// (kBlockM + 2·kStages·kBlockN)·D·2 bytes + the O staging (kBlockM/64 × 64 rows × min(D, 128) columns × 2 bytes) +
// barriers + 1 KB of alignment slack: 97 KB (D=64), 193 KB (D=96), 193 KB (D=128), 225 KB (D=256) of the 227 KB per
// block; 116 KB for 192 × 128 (3 KB of it the row-sum anchor of sm90/mainloop.cuh).
// Registers per consumer thread: S (kBlockN/2) + O (D/2) fp32 + P (kBlockN/4) within 240 (160 with three consumer
// warpgroups: 128 of them at D = 64, no spills). fp32 accumulation throughout. D = 96
// (FlashAttention-3's hdim-96 tiles): rows of 192 bytes are no multiple of 128, so its tiles use the 64-byte swizzle
// (3 column blocks of 32) and P·V runs N = 96 instead of the 128 bucket's padded N = 128 (sm90/mainloop.cuh).
//
// Inputs are read in place through 4-D tensor maps (E, seqlen, heads, batch) made by the launcher, which needs
// 16-byte aligned bases and strides that are multiples of 16 bytes (BHSD and BSHD both qualify); rows past L or S
// of a head are outside the map and arrive as zeros, so they never read the next head's rows.
//
// History and measurements: bench/notes/kernels_flash_fwd_sm90.md.
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/wgmma.cuh"
#include "common/tma.cuh"
#include "common/visibility.cuh"
#include "attention/sm90/params.cuh"
#include "attention/sm90/roles.cuh"
#include "attention/sm90/mainloop.cuh"
#include "attention/sm90/tile_scheduler.cuh"

namespace cupy_attn {

// Grid: (m_blocks, Hq, B) with one tile per CTA, or with kPersistent (min(#SMs, #units), 1, 1) (the launcher's
// fused_sm90.grid_for). Block: 128 · (kBlockM / 64 + 1) threads (Sm90Tile.threads).
// Mod: a user's score_mod / mask_mod (flash_fwd_sm90_mod below); aux its arrays, in the kernel's parameters.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, bool kOverlap, bool kPersistent,
          int kHeadDimQK, bool kVariants, bool kVarlen, typename Mod = NoMod>
__device__ __forceinline__ void flash_fwd_sm90_body(const FlashFwdSm90Params& p,
                                                    const typename Mod::Aux* aux = nullptr,
                                                    const KeyRanges* kr = nullptr) {
  using namespace sm90;
  using Smem = SharedStorage<T, kHeadDim, kBlockM, kBlockN, kStages>;
  constexpr int kConsumerWarpgroups = kBlockM / 64;
  using Regs = RegisterSplit<kConsumerWarpgroups>;
  static_assert(kBlockM == 128 || kBlockM == 192, "two or three consumer warpgroups of 64 rows each");
  static_assert(kHeadDim % Smem::kAtomCols == 0 && kBlockN % 64 == 0 && kBlockN <= 256 && kBlockM <= 256,
                "whole swizzle atoms, TMA box <= 256 rows");
  static_assert(kStages >= 2, "a K/V ring of at least two stages");
  static_assert(kHeadDimQK % 16 == 0 && kHeadDimQK <= kHeadDim, "the S GEMM's k steps are 16 columns");
  static_assert(Smem::kBytes <= sm90::kMaxSmemBytes, "227 KB of shared memory per block");
  static_assert(kOverlap || !kPersistent, "the persistent variant is built on the overlap mainloop only");

  // Declared 16-byte aligned only, so that the compiler cannot fold away SharedStorage's realignment to 1024.
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Smem ss(smem_raw);

  // One tile per CTA (the persistent variant's CTAs take theirs from the scheduler inside produce_persistent and
  // consume_persistent).
  int m0 = 0, h = 0;
  const int b = kPersistent ? 0 : blockIdx.z;
  // The tile's sequence (packed calls: its offsets and lengths; the persistent kernel finds its tiles' own).
  const SeqSpan<kVarlen && !kPersistent> seq(p, b);
  KeyBlocks kb{0, -1};
  if constexpr (!kPersistent) {
    // Causal blocks differ in work (the last query rows see the most keys): launch the longest first.
    const int m_block = p.is_causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    h = blockIdx.y;
    m0 = m_block * kBlockM;
    // Packed batches: the grid covers the longest sequence; blocks past this one's rows have nothing to do.
    if (kVarlen && m0 >= seq.seqlen_q()) return;
    // The key blocks of this tile; a tile whose rows see no key (bottom-right alignment with L > S, a window past the
    // keys, a sequence without keys) writes the empty-row result (out 0, lse -inf or the sink) directly.
    kb = key_blocks<kBlockM, kBlockN, kVariants>(p, seq, m0);
    if (kb.count() <= 0) {
      store_empty_rows<T, kVariants>(p, seq, m0, h, min(kBlockM, static_cast<int>(seq.seqlen_q()) - m0), threadIdx.x,
                                     blockDim.x);
      return;
    }
  }

  pipeline::init_barriers([&] {
    tma::mbar_init(ss.q_bars.full, 1);
    pipeline::init_rings<kStages>(4 * kConsumerWarpgroups, ss.k_bars, ss.v_bars);  // lane 0 of each consumer warp
    if constexpr (kPersistent) tma::mbar_init(ss.q_bars.empty, 4 * kConsumerWarpgroups);  // each consumer warp
  });

  warp_specialize<Regs>(
      [&](int tid) {
        if (tid != 0) return;  // one thread issues every load
        if constexpr (kPersistent) {
          produce_persistent<T, kHeadDim, kBlockM, kBlockN, kStages, kVariants, kVarlen>(p, ss, kr);
        } else {
          produce(p, ss, seq, m0, h, kb);
        }
      },
      [&](int tid) {
        if constexpr (kPersistent) {
          consume_persistent<T, kHeadDim, kBlockM, kBlockN, kStages, kOverlap, kHeadDimQK, kVariants, kVarlen, Mod>(
              p, ss, tid, aux, kr);
        } else {
          consume<T, kHeadDim, kBlockM, kBlockN, kStages, kOverlap, false, kHeadDimQK, kVariants, Mod>(
              p, ss, seq, m0, h, b, kb, tid, 0, 0u, aux);
        }
        if (p.o_tma) epilogue_drain(threadIdx.x % 128);  // the thread's index in its warpgroup
      });
}

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, bool kOverlap, bool kPersistent,
          int kHeadDimQK, bool kVariants, bool kVarlen>
__global__ void __launch_bounds__(128 * (kBlockM / 64 + 1), 1) flash_fwd_sm90(const __grid_constant__
                                                                              FlashFwdSm90Params p) {
  flash_fwd_sm90_body<T, kHeadDim, kBlockM, kBlockN, kStages, kOverlap, kPersistent, kHeadDimQK, kVariants, kVarlen>(p);
}

// A user's mods (cupy_attn.AttentionMod) with the variants' code: instantiated only in a mod's own program, which
// appends the Mod struct (attention/mods.py); the parameters are FlashFwdSm90Params, then the mod's.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, bool kOverlap, bool kPersistent,
          int kHeadDimQK, bool kVarlen, typename Mod>
__global__ void __launch_bounds__(128 * (kBlockM / 64 + 1), 1)
    flash_fwd_sm90_mod(const __grid_constant__ ModParams<FlashFwdSm90Params, Mod> p) {
  static_assert(kPersistent, "the mods' key ranges are read by the persistent variant's tiles");
  flash_fwd_sm90_body<T, kHeadDim, kBlockM, kBlockN, kStages, kOverlap, kPersistent, kHeadDimQK, true, kVarlen, Mod>(
      p, &p.aux, &p.key_ranges);
}

}  // namespace cupy_attn
