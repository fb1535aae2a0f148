// Which keys a query row sees: the one definition every attention kernel asks (forward, decode, scores, P·V,
// backward). Rows are query indices 0 ... L − 1 and keys 0 ... S − 1 of one (batch, head).
//
//   key j is visible to row i  iff  first_key(i) <= j <= last_key(i), with
//     first_key(i) = 0
//     last_key(i)  = S − 1, and under a causal mask min(S − 1, i + causal_offset)
//   causal_offset = 0 for the top-left alignment (torch's is_causal), S − L for bottom-right (the last row sees the
//   last key). A row with last_key(i) < first_key(i) sees no key (bottom-right with L > S): out 0, lse −inf.
//
// Where the next variants plug in (not here yet):
//   * sliding window (left, right), FlashAttention's convention: first_key(i) = max(0, i + (S − L) − left) and
//     last_key(i) = min(last_key(i), i + (S − L) + right). The per-row bounds, the key-block ranges and the lane
//     limits below then have a lower end as well as an upper one (first_key is already asked where one is needed).
//   * ALiBi, softcap, sinks and user score_mod hooks act on a visible key's score (and sinks on the row sum), after
//     this test: a `score(i, j, s)` hook beside `visible`.
//
// The kernels' parameter structs carry (seqlen_k, is_causal, causal_offset); Visibility is built from them. Some
// kernels (bwd_rows, softmax, flash_bwd) receive causal_offset = S when the call is not causal, so that their
// test j <= i + causal_offset is the causal one unchanged (i + S >= S − 1 for every row): limit_offset() gives that
// form from a Visibility.
//
// Where a kernel still spells a test itself (calling the helper changed its SASS, which issue 32 kept identical), it
// says so beside the test; a window or score hook must be added there too:
//   * the per-tile pre-test "does this key tile need element masks" (tile_needs_mask's condition) in
//     sm90/mainloop.cuh (consume) and scores_sm90.cu (consume); flash_fwd.cu's uses causal_limit;
//   * the Hopper backward's per-element test, per key (sm90/bwd_mainloop.cuh: causal_first_row in int), and its
//     per-tile pre-test;
//   * flash_bwd.cu's per-element test `key <= query + limit_offset()` and first query block;
//   * flash_decode.cu's per-element test compares against the row's last_key (RowLimits), clamped in int.
#pragma once

namespace cupy_attn {

// The key blocks [first, last] of kBlockN keys a row tile visits; empty (count() <= 0) when its rows see no key.
struct KeyBlocks {
  int first, last;
  __device__ __forceinline__ int count() const { return last - first + 1; }
};

// SeqLen: the type the kernel holds S in (long long, or int where S − 1 is taken in 32 bits: flash_fwd.cu, whose S
// may be lowered to a key-padding prefix); bounds and limits are 64-bit.
template <typename SeqLen>
struct BasicVisibility {
  SeqLen seqlen_k;          // S
  long long causal_offset;  // 0 or S − L; used only when causal
  bool causal;

  // The causal limit of row `row`: under a causal mask it sees no key past it.
  __device__ __forceinline__ long long causal_limit(long long row) const { return row + causal_offset; }
  // The last key row `row` sees (< 0: none).
  __device__ __forceinline__ long long last_key(long long row) const {
    long long last = seqlen_k - 1;
    if (causal) last = min(last, causal_limit(row));
    return last;
  }
  // The first key row `row` sees (0 until a window gives it a lower end).
  __device__ __forceinline__ long long first_key(long long) const { return 0; }
  // One past the last key row `row` sees, last_key(row) + 1 (the form of the kernels that count keys).
  __device__ __forceinline__ long long end_key(long long row) const {
    long long end = seqlen_k;
    if (causal) end = min(end, causal_limit(row) + 1);
    return end;
  }

  // The key blocks of kBlockN keys that hold keys first ... last (first <= last, both >= 0). A row tile with rows
  // first_row ... last_row visits blocks(first_key(first_row), last_key(last_row)): every row in between sees a
  // sub-range of that union. The caller tests last_key(last_row) < 0 (no key: no block) first, once: the kernels
  // compute that key once and pass it here.
  template <int kBlockN>
  __device__ __forceinline__ static KeyBlocks blocks(long long first, long long last) {
    return {static_cast<int>(first / kBlockN), static_cast<int>(last / kBlockN)};
  }

  // Whether a key tile [n0, n0 + kN) needs per-element masks for the rows from row0 on: it holds keys past S, or
  // (causal) keys past the limit of row0, the row that sees the fewest (later rows see more). Tile indices are ints
  // (S < 2^31 keys); the causal limit is 64-bit.
  template <int kN>
  __device__ __forceinline__ bool tile_needs_mask(int n0, int row0) const {
    return n0 + kN > static_cast<int>(seqlen_k) || (causal && n0 + kN - 1 > causal_limit(row0));
  }

  // The per-element test of a lane's kN consecutive-in-the-layout columns: the limit relative to the lane's first
  // column (key n0 + lane_col), clamped to [-1, kN] so that it fits an int and each column c (a compile-time constant
  // per element) is visible iff c <= lane_limit. Comparing the 64-bit keys themselves kept the column indices live
  // next to the score accumulators and spilled (flash_fwd.cu at 128 × 128, D = 64: 208-688 bytes).
  template <int kN>
  __device__ __forceinline__ int lane_limit(long long row, int n0, int lane_col) const {
    return static_cast<int>(max(-1ll, min(static_cast<long long>(kN), last_key(row) - n0 - lane_col)));
  }

  // The backward's view, per key: the first row the causal mask lets see key `key`, the inverse of causal_limit
  // (may be negative or past L: the caller clamps), and the first row that sees it under this Visibility. All rows
  // from there on see it (no window yet: a window adds a last row, key − (S − L) + left).
  __device__ __forceinline__ long long causal_first_row(long long key) const { return key - causal_offset; }
  __device__ __forceinline__ long long first_row(long long key) const { return causal ? causal_first_row(key) : 0; }

  // The causal test as `key <= row + limit_offset()` for every row: causal_offset, or S when not causal.
  __device__ __forceinline__ long long limit_offset() const { return causal ? causal_offset : seqlen_k; }
};

using Visibility = BasicVisibility<long long>;

// A kernel's Visibility from its parameter struct (every struct names the three fields alike).
template <typename Params>
__device__ __forceinline__ Visibility visibility_of(const Params& p) {
  return {static_cast<long long>(p.seqlen_k), static_cast<long long>(p.causal_offset), p.is_causal != 0};
}

}  // namespace cupy_attn
