// Tile scheduler of flash_fwd_sm90.cu's persistent variant (kPersistent): which 128-row output tiles a CTA runs, and in
// which order. Owns the tile order; the producer thread and the consumer warpgroups each walk their own copy of it and
// see the same sequence (it depends on the parameters and blockIdx.x only).
//
// Static striding over work units (FlashAttention-3's StaticPersistentTileScheduler: unit = blockIdx.x + i·gridDim.x,
// gridDim.x = min(#SMs, #units)). Units are numbered (batch, head, m) with m fastest, so the CTAs running at the same
// time work on the m-blocks of a few adjacent (batch, head) pairs (adjacent query heads of a GQA group share one K/V
// head) and their K/V stays in L2.
//   * Not causal: a unit is one m-block, m ascending; all tiles cost the same.
//   * Causal, more tiles than CTAs (p.tile_pairs = 1): a unit is the pair of m-blocks (M−1−k, k) of one head (M =
//     m-blocks per head, k < ⌈M/2⌉), the longer one first; under a causal mask an m-block's cost is linear in its
//     index, so every pair costs the same (M+1 key blocks for top-left L = S; the middle m-block of an odd M runs
//     alone). With equal units static striding balances about as well as a greedy order (simulated:
//     bench/notes/kernels_flash_fwd_sm90.md); its weak spot is the tail, when units / CTAs is just above an integer.
//   * Causal, at most one tile per CTA (p.tile_pairs = 0): one m-block per unit, the last m-blocks of each head first.
// Not a dynamic (atomic-counter) scheduler: it needs a counter zeroed before every launch (a memset, or a self-reset
// that two launches on different streams sharing one counter would race on) and a shared-memory broadcast of the next
// tile behind two more named barriers; with equal-cost units static is within the tail's quantization of it.
#pragma once
#include "attention/sm90/params.cuh"

namespace cupy_attn {
namespace sm90 {

struct WorkTile {
  int m_block, h, b;
};

template <int kBlockM>
struct StaticTileScheduler {
  int m_blocks;        // query blocks per (batch, head): ceil(L / kBlockM)
  int units_per_head;  // m_blocks, or ceil(m_blocks / 2) with pairs
  int num_units;       // units_per_head · heads · batch (< 2^31: that many 128-row tiles of Q would not fit in memory)
  int heads;
  bool causal, pairs;
  int unit;            // current unit (< num_units while valid)
  bool second;         // on the second m-block of a pair

  __device__ __forceinline__ explicit StaticTileScheduler(const FlashFwdSm90Params& p) {
    m_blocks = static_cast<int>((p.seqlen_q + kBlockM - 1) / kBlockM);
    heads = static_cast<int>(p.num_heads);
    causal = p.is_causal != 0;
    pairs = causal && p.tile_pairs != 0;
    units_per_head = pairs ? (m_blocks + 1) / 2 : m_blocks;
    num_units = units_per_head * heads * static_cast<int>(p.batch);
    unit = blockIdx.x;
    second = false;
  }

  __device__ __forceinline__ bool valid() const { return unit < num_units; }

  __device__ __forceinline__ WorkTile tile() const {
    const int bh = unit / units_per_head, k = unit % units_per_head;
    int m_block;
    if (pairs) {
      m_block = second ? k : m_blocks - 1 - k;
    } else {
      m_block = causal ? m_blocks - 1 - k : k;
    }
    return {m_block, bh % heads, bh / heads};
  }

  __device__ __forceinline__ void advance() {
    if (pairs && !second) {
      const int k = unit % units_per_head;
      if (k < m_blocks - 1 - k) {  // the pair has a second m-block (not the middle one of an odd m_blocks)
        second = true;
        return;
      }
    }
    second = false;
    unit += gridDim.x;
  }
};

// The same static striding over a packed batch (varlen_attention: p.cu_seqlens_q), whose sequences have m-blocks of
// their own: units are numbered (sequence, head, m) with m fastest, a sequence b contributing Hq · ⌈L_b / kBlockM⌉
// units (halved, rounded up, into the pairs above when p.tile_pairs), so sequences of L_b = 0 none. A unit's sequence
// is found by walking forward from the previous unit's: a CTA's units only increase, so the walk reads each entry of
// cu_seqlens_q once per CTA. tile().b is the sequence (SeqSpan<true> reads its offsets).
template <int kBlockM>
struct VarlenTileScheduler {
  const FlashFwdSm90Params& p;
  int batch, heads;
  bool causal, pairs;
  int unit;            // current unit (valid while b < batch)
  int b;               // the current unit's sequence
  int base;            // the first unit of sequence b
  int m_blocks;        // of sequence b
  int units_per_head;  // of sequence b: m_blocks, or ⌈m_blocks / 2⌉ with pairs
  bool second;

  __device__ __forceinline__ explicit VarlenTileScheduler(const FlashFwdSm90Params& params) : p(params) {
    batch = static_cast<int>(p.batch);
    heads = static_cast<int>(p.num_heads);
    causal = p.is_causal != 0;
    pairs = causal && p.tile_pairs != 0;
    unit = blockIdx.x;
    b = 0;
    base = 0;
    second = false;
    if (batch > 0) load(0);
    seek();
  }
  __device__ __forceinline__ void load(int seq) {
    m_blocks = (p.cu_seqlens_q[seq + 1] - p.cu_seqlens_q[seq] + kBlockM - 1) / kBlockM;
    units_per_head = pairs ? (m_blocks + 1) / 2 : m_blocks;
  }
  // Move b forward to the sequence holding `unit` (past the last sequence: not valid).
  __device__ __forceinline__ void seek() {
    while (b < batch && unit >= base + units_per_head * heads) {
      base += units_per_head * heads;
      if (++b < batch) load(b);
    }
  }

  __device__ __forceinline__ bool valid() const { return b < batch; }

  __device__ __forceinline__ WorkTile tile() const {
    const int r = unit - base, k = r % units_per_head;
    int m_block;
    if (pairs) {
      m_block = second ? k : m_blocks - 1 - k;
    } else {
      m_block = causal ? m_blocks - 1 - k : k;
    }
    return {m_block, r / units_per_head, b};
  }

  __device__ __forceinline__ void advance() {
    if (pairs && !second) {
      const int k = (unit - base) % units_per_head;
      if (k < m_blocks - 1 - k) {
        second = true;
        return;
      }
    }
    second = false;
    unit += gridDim.x;
    seek();
  }
};

// The persistent kernels' scheduler: packed batches walk their sequences.
template <int kBlockM, bool kVarlen>
struct SchedulerFor {
  using type = StaticTileScheduler<kBlockM>;
};
template <int kBlockM>
struct SchedulerFor<kBlockM, true> {
  using type = VarlenTileScheduler<kBlockM>;
};
template <int kBlockM, bool kVarlen>
using TileScheduler = typename SchedulerFor<kBlockM, kVarlen>::type;

}  // namespace sm90
}  // namespace cupy_attn
