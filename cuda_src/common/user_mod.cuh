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
//   };
//
// and appends it to the kernel's source after this header; the kernels name it as a template argument. NoMod is the
// absent mod: every kernel without one compiles as before (the hooks are `if constexpr`).
#pragma once
#include "common/types.cuh"

namespace cupy_attn {

struct NoMod {
  static constexpr bool kScore = false, kMask = false, kScoreGrad = false;
  struct Aux {};
  static __device__ __forceinline__ float score(float s, int, int, int, int, const Aux&) { return s; }
  static __device__ __forceinline__ bool mask(int, int, int, int, const Aux&) { return true; }
  static __device__ __forceinline__ float score_grad(float, int, int, int, int, const Aux&) { return 1.f; }
};

// A kernel's parameter struct with a mod's: the (B, Hq) split of the flat (batch, head) index and the aux struct,
// after the base's fields (the host's NumPy declaration appends them in this order).
template <typename Base, typename Mod>
struct ModParams : Base {
  long long mod_num_heads;
  typename Mod::Aux aux;
};

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
