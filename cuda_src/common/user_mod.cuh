// User score and mask mods (cupy_attn.AttentionMod): CUDA C++ snippets compiled into a kernel's mod instantiation.
//
//   s_ij <- score_mod(s_ij, b, h, i, j, aux)   (s: the scaled score after softcap and ALiBi, natural units)
//   key j hidden from query i where mask_mod(b, h, i, j, aux) is false
//
// b is the flat batch index over the query's leading axes, h the query head, i and j the query row and key column.
// The host generates one struct per mod (cupy_attn/attention/mods.py):
//
//   struct Mod {
//     static constexpr bool kScore, kMask, kScoreGrad;
//     struct Aux { const float* bias; long long bias_shape[2]; ... };  // the call's aux arrays, contiguous
//     static __device__ float score(float score, int b, int h, int q_idx, int kv_idx, const Aux& aux);
//     static __device__ bool mask(int b, int h, int q_idx, int kv_idx, const Aux& aux);
//     static __device__ float score_grad(float score, int b, int h, int q_idx, int kv_idx, const Aux& aux);
//     static __device__ void score_aux_grad(float grad, float score, int b, int h, int q_idx, int kv_idx,
//                                           const Aux& aux);  // adds into aux.<name>_grad (float*, or nullptr)
//   };
//
// and appends it to the kernel's source after this header; the kernels name it as a template argument. NoMod is the
// absent mod: every kernel without one compiles as before (the hooks are `if constexpr`).
#pragma once
#include "common/types.cuh"

namespace cupy_attn {

struct NoMod {
  static constexpr bool kScore = false, kMask = false, kScoreGrad = false, kScoreAuxGrad = false;
  struct Aux {};
  static __device__ __forceinline__ float score(float s, int, int, int, int, const Aux&) { return s; }
  static __device__ __forceinline__ bool mask(int, int, int, int, const Aux&) { return true; }
  static __device__ __forceinline__ float score_grad(float, int, int, int, int, const Aux&) { return 1.f; }
  static __device__ __forceinline__ void score_aux_grad(float, float, int, int, int, int, const Aux&) {}
};

// Ranges of a mask_mod (cupy_attn.create_block_mask; mod_key_ranges below): for each (batch, head, block of
// block_rows query rows) four ints: the first and last key any of its rows sees under the mask_mod, (S, -1) for none,
// then the full run: the first key every row of the block sees and the last key of the run of such keys from it
// (S, -1 for none), whose key blocks need no mask_mod call. A batch or head stride of 0 broadcasts one entry. The
// fused forward kernels visit only the key blocks between first and last and evaluate the mask_mod only on those not
// inside the full run (FlexAttention's partial and full blocks, as two intervals). The backward's table has the same
// layout with the roles swapped: per block of block_rows keys, the query rows that see one of them (the Hopper
// backward visits only those query blocks) and the run of rows that see all of them.
struct KeyRanges {
  const int* ranges;  // (.., .., row_blocks, 4) int32, or nullptr (no ranges: every key block is visited)
  long long stride_b, stride_h;  // in entries of 4 ints
  long long block_rows;

  // The (first, last, full first, full last) entry of the block of rows holding row m0 of batch b, head h; nullptr
  // without ranges.
  __device__ __forceinline__ const int* of(int b, int h, int m0) const {
    if (ranges == nullptr) return nullptr;
    return ranges + 4 * (b * stride_b + h * stride_h + m0 / block_rows);
  }
};

// Whether the `width` keys from n0 lie in an entry's full run (range: KeyRanges::of's, or nullptr: none do). Read
// per key block: kept in registers across the FA3 consumer's mainloop, the two ints spilled at head dim 128.
__device__ __forceinline__ bool full_run(const int* range, int n0, int width) {
  return range != nullptr && n0 >= range[2] && n0 + width - 1 <= range[3];
}

// A kernel's parameter struct with a mod's: the (B, Hq) split of the flat (batch, head) index, the key ranges and the
// aux struct, after the base's fields (the host's NumPy declaration appends them in this order).
template <typename Base, typename Mod>
struct ModParams : Base {
  long long mod_num_heads;
  KeyRanges key_ranges;    // the forward's: keys per block of query rows
  KeyRanges query_ranges;  // the backward's: query rows per block of keys (the same layout, roles swapped)
  typename Mod::Aux aux;
};

// The pre-pass of cupy_attn.create_block_mask: one block of 256 threads per (row block, head, batch) of the ranges;
// the threads test keys in chunks of 256 from the front until some row of the block sees one (the first), then from
// the back (the last), so that a band-shaped mask costs about its visible keys, not L·S. Then the full run: from the
// first, the first key every row sees, and from there the first key some row does not (the run's end), each test
// stopping at the first row that fails; its cost is about the run's visible pairs, a pass over that part of the mask.
// kTransposed: the backward's table, the roles swapped (blocks of keys, the query rows that see any or all of them).
struct KeyRangeParams {
  int* ranges;  // (batch, heads, row_blocks, 4) int32, contiguous
  long long batch, heads, seqlen_q, seqlen_k, row_blocks, block_rows;
};

template <typename Mod, bool kTransposed>
__global__ void __launch_bounds__(256) mod_key_ranges(const ModParams<KeyRangeParams, Mod> p) {
  const int rb = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int S = static_cast<int>(kTransposed ? p.seqlen_q : p.seqlen_k);  // the scanned axis
  const int r0 = rb * static_cast<int>(p.block_rows);
  const int r1 = min(r0 + static_cast<int>(p.block_rows), static_cast<int>(kTransposed ? p.seqlen_k : p.seqlen_q));
  __shared__ int first, last, full_first, full_end;
  if (threadIdx.x == 0) {
    first = S;
    last = -1;
    full_first = S;
    full_end = S;
  }
  __syncthreads();
  auto visible = [&](int row, int j) {
    return Mod::mask(b, h, kTransposed ? j : row, kTransposed ? row : j, p.aux);
  };
  // Whether some row of the block sees key j: rows top-down for the first key, bottom-up for the last (under a causal
  // mask the last rows see the most keys, so the backward scan stops at its first row).
  auto seen = [&](int j, bool bottom_up) {
    if (j < 0 || j >= S) return false;
    for (int n = 0; n < r1 - r0; ++n) {
      if (visible(bottom_up ? r1 - 1 - n : r0 + n, j)) return true;
    }
    return false;
  };
  // Whether every row sees key j: four rows a step (their mask reads in flight together), stopping at a step with a
  // row that does not.
  auto seen_by_all = [&](int j) {
    if (j < 0 || j >= S) return false;
    int n = 0;
    for (; n + 4 <= r1 - r0; n += 4) {
      const bool a = visible(r0 + n, j), c = visible(r0 + n + 1, j), d = visible(r0 + n + 2, j),
                 e = visible(r0 + n + 3, j);
      if (!(a && c && d && e)) return false;
    }
    for (; n < r1 - r0; ++n) {
      if (!visible(r0 + n, j)) return false;
    }
    return true;
  };
  for (int c = 0; c < S; c += blockDim.x) {
    const int j = c + static_cast<int>(threadIdx.x);
    const bool any = seen(j, false);
    if (any) atomicMin(&first, j);
    if (__syncthreads_or(any)) break;
  }
  if (first < S) {
    for (int c = S - 1; c >= first; c -= blockDim.x) {
      const int j = c - static_cast<int>(threadIdx.x);
      const bool any = j >= first && seen(j, true);
      if (any) atomicMax(&last, j);
      if (__syncthreads_or(any)) break;
    }
  }
  __syncthreads();
  const int lo = first, hi = last;  // the full run lies inside [lo, hi]
  for (int c = lo; c <= hi; c += blockDim.x) {
    const int j = c + static_cast<int>(threadIdx.x);
    const bool all = j <= hi && seen_by_all(j);
    if (all) atomicMin(&full_first, j);
    if (__syncthreads_or(all)) break;
  }
  __syncthreads();
  const int ff = full_first;
  if (ff <= hi) {
    for (int c = ff + 1; c <= hi; c += blockDim.x) {
      const int j = c + static_cast<int>(threadIdx.x);
      const bool gap = j <= hi && !seen_by_all(j);
      if (gap) atomicMin(&full_end, j);
      if (__syncthreads_or(gap)) break;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int* out = p.ranges + 4 * ((static_cast<long long>(b) * p.heads + h) * p.row_blocks + rb);
    out[0] = first;
    out[1] = last;
    out[2] = ff <= hi ? ff : S;
    out[3] = ff <= hi ? min(full_end, hi + 1) - 1 : -1;
  }
}

// One score in base-2 units (s·log2 e, the kernels' units) through the mods: -inf where mask_mod hides the key.
template <typename Mod>
__device__ __forceinline__ float apply_mod_log2(float s_log2, int b, int h, int q_idx, int kv_idx,
                                               const typename Mod::Aux& aux) {
  if constexpr (Mod::kMask) {
    if (!Mod::mask(b, h, q_idx, kv_idx, aux)) return -inf();
  }
  if constexpr (Mod::kScore) s_log2 = kLog2e * Mod::score(kLn2 * s_log2, b, h, q_idx, kv_idx, aux);
  return s_log2;
}

}  // namespace cupy_attn
