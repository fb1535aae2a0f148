// Which keys a query row sees: the one definition every attention kernel asks (forward, decode, scores, P·V,
// backward). Rows are query indices 0 ... L − 1 and keys 0 ... S − 1 of one (batch, head).
//
//   key j is visible to row i  iff  first_key(i) <= j <= last_key(i), with
//     first_key(i) = 0, or with a lower bound max(0, i + window_lo)
//     last_key(i)  = S − 1, and under an upper bound min(S − 1, i + causal_offset)
//   The upper bound (is_causal = 1) is the causal mask's, causal_offset = 0 for the top-left alignment (torch's
//   is_causal) or S − L for bottom-right (the last row sees the last key), and/or a sliding window's right side,
//   S − L + right (the launcher passes the smaller of the two); the lower bound is a window's left side, window_lo =
//   S − L − left (FlashAttention's bottom-right aligned window (left, right): i + S − L − left <= j <= i + S − L +
//   right). A row with last_key(i) < first_key(i) sees no key (bottom-right with L > S, or a window past the keys):
//   out 0, lse −inf.
//
// ALiBi, softcap and sinks act on a visible key's score and on the row sum after this test (common/score_mod.cuh).
//
// The kernels' parameter structs carry (seqlen_k, is_causal, causal_offset), and window_lo where the kernel serves
// windows; Visibility is built from them (visibility_of: no lower bound for a struct without window_lo). Some
// kernels (bwd_rows, softmax, flash_bwd) receive causal_offset = S when the call is not causal, so that their
// test j <= i + causal_offset is the causal one unchanged (i + S >= S − 1 for every row): limit_offset() gives that
// form from a Visibility.
//
// Where a kernel still spells a test itself (calling the helper changed its SASS, which issue 32 kept identical), it
// says so beside the test; the kernels that serve windows add the lower bound there (the FA3-design forward, the
// head-dim-512 forward, the Hopper backward, the split path's softmax), the others refuse windowed calls:
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

// A window_lo that never binds: far below any row index minus any key index (rows and keys are < 2^31).
constexpr long long kNoLowerBound = -(1ll << 40);

// SeqLen: the type the kernel holds S in (long long, or int where S − 1 is taken in 32 bits: flash_fwd.cu, whose S
// may be lowered to a key-padding prefix); bounds and limits are 64-bit.
template <typename SeqLen>
struct BasicVisibility {
  SeqLen seqlen_k;          // S
  long long causal_offset;  // the upper bound's offset (causal and/or a window's right side); used only when causal
  bool causal;              // the keys have an upper bound per row
  bool lower = false;       // the keys have a lower bound per row (a window's left side)
  long long window_lo = kNoLowerBound;  // key j >= row + window_lo; used only when lower

  // The causal limit of row `row`: under a causal mask it sees no key past it.
  __device__ __forceinline__ long long causal_limit(long long row) const { return row + causal_offset; }
  // The last key row `row` sees (< 0: none).
  __device__ __forceinline__ long long last_key(long long row) const {
    long long last = seqlen_k - 1;
    if (causal) last = min(last, causal_limit(row));
    return last;
  }
  // The first key row `row` sees (0 without a lower bound).
  __device__ __forceinline__ long long first_key(long long row) const {
    return lower ? max(0ll, row + window_lo) : 0ll;
  }
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

  // The lower end of the same test: column c of the lane is visible iff c >= lane_lower, clamped to [0, kN] (0 when
  // there is no lower bound: every column).
  template <int kN>
  __device__ __forceinline__ int lane_lower(long long row, int n0, int lane_col) const {
    return static_cast<int>(max(0ll, min(static_cast<long long>(kN), first_key(row) - n0 - lane_col)));
  }

  // The backward's view, per key: the first row the causal mask lets see key `key`, the inverse of causal_limit
  // (may be negative or past L: the caller clamps), and the first row that sees it under this Visibility. The rows
  // first_row(key) ... last_row(key) see it.
  __device__ __forceinline__ long long causal_first_row(long long key) const { return key - causal_offset; }
  __device__ __forceinline__ long long first_row(long long key) const { return causal ? causal_first_row(key) : 0; }
  // The last row that sees key `key`: the inverse of first_key, key − window_lo under a window's lower bound (key −
  // (S − L) + left; may be negative or past L: the caller clamps), else past every row (key + 2^40).
  __device__ __forceinline__ long long last_row(long long key) const {
    return key - (lower ? window_lo : kNoLowerBound);
  }

  // The causal test as `key <= row + limit_offset()` for every row: causal_offset, or S when not causal.
  __device__ __forceinline__ long long limit_offset() const { return causal ? causal_offset : seqlen_k; }
};

using Visibility = BasicVisibility<long long>;

// Whether a parameter struct has a window_lo field (the kernels that serve windows).
template <typename Params, typename = void>
struct HasWindowLo {
  static constexpr bool value = false;
};
template <typename Params>
struct HasWindowLo<Params, decltype(void(Params::window_lo))> {
  static constexpr bool value = true;
};

// A kernel's Visibility from its parameter struct (every struct names the three fields alike; window_lo where the
// kernel has one, kNoLowerBound meaning none).
template <typename Params>
__device__ __forceinline__ Visibility visibility_of(const Params& p) {
  if constexpr (HasWindowLo<Params>::value) {
    return {static_cast<long long>(p.seqlen_k), static_cast<long long>(p.causal_offset), p.is_causal != 0,
            p.window_lo != kNoLowerBound, static_cast<long long>(p.window_lo)};
  } else {
    return {static_cast<long long>(p.seqlen_k), static_cast<long long>(p.causal_offset), p.is_causal != 0};
  }
}

}  // namespace cupy_attn
