// Merging two partial attention results by their log-sum-exps (cupy_attn.merge_attention_states).
//
// Math: two results over disjoint key sets A and B of the same query rows, out_x = Σ_{j∈X} e^{s_j} v_j / e^{lse_x}
// and lse_x = log Σ_{j∈X} e^{s_j}, give the result over A ∪ B:
//   m = max(lse_a, lse_b) (0 when both are −inf),  w_x = e^{lse_x − m},
//   lse = m + log(w_a + w_b),  out = (w_a·out_a + w_b·out_b) / (w_a + w_b)  (0 when w_a + w_b = 0).
// A side with lse −inf (no key) takes no part; both −inf give out 0 and lse −inf, the convention of a row that sees
// no key. NaN in either lse propagates to the row. This is FlashInfer's merge_state (Ye et al. 2025) and the split-KV
// combine of Flash-Decoding, for two parts.
//
// merge_states<T>: one warp per row (8 per 256-thread block); rows of out_a, out_b and out at their own pitches
// (elements), the last axis contiguous; lse_a, lse_b and lse contiguous fp32 (rows). Lanes stride over the row's
// head_dim_v elements, 16 bytes a lane when every row start is 16-byte aligned (kVec = 16 / sizeof(T) elements),
// else one element. Weights and arithmetic in fp32; out rounded once to T.
#include "common/mask.cuh"
#include "common/types.cuh"

namespace cupy_attn {

struct MergeStatesParams {
  const void* out_a;     // (rows, head_dim_v) T, row pitch stride_a elements
  const void* out_b;     // (rows, head_dim_v) T, row pitch stride_b elements
  const float* lse_a;    // (rows,) natural-log lse of out_a's rows
  const float* lse_b;    // (rows,)
  void* out;             // (rows, head_dim_v) T, row pitch stride_out elements
  float* lse;            // (rows,) the merged lse; may be null (not asked for)
  long long rows, head_dim_v;
  long long stride_a, stride_b, stride_out;
  long long vec;         // 1: 16-byte accesses (every row start 16-byte aligned, head_dim_v a multiple of kVec)
};

template <typename T>
__global__ void __launch_bounds__(256) merge_states(const MergeStatesParams p) {
  const long long row = static_cast<long long>(blockIdx.x) * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.rows) return;
  const float la = p.lse_a[row], lb = p.lse_b[row];
  // fmaxf drops a NaN operand: keep it, so that a NaN row stays NaN.
  const float m = (la != la || lb != lb) ? la + lb : fmaxf(la, lb);
  const float ref = m == neg_inf() ? 0.f : m;
  const float wa = expf(la - ref), wb = expf(lb - ref);
  const float sum = wa + wb;
  const float ca = sum == 0.f ? 0.f : wa / sum, cb = sum == 0.f ? 0.f : wb / sum;
  if (lane == 0 && p.lse != nullptr) p.lse[row] = ref + logf(sum);

  const T* a = static_cast<const T*>(p.out_a) + row * p.stride_a;
  const T* b = static_cast<const T*>(p.out_b) + row * p.stride_b;
  T* o = static_cast<T*>(p.out) + row * p.stride_out;
  constexpr int kVec = 16 / sizeof(T);
  if (p.vec) {
    for (long long c = lane * kVec; c < p.head_dim_v; c += 32 * kVec) {
      const uint4 va = *reinterpret_cast<const uint4*>(a + c), vb = *reinterpret_cast<const uint4*>(b + c);
      const T* xa = reinterpret_cast<const T*>(&va);
      const T* xb = reinterpret_cast<const T*>(&vb);
      uint4 vo;
      T* xo = reinterpret_cast<T*>(&vo);
      #pragma unroll
      for (int e = 0; e < kVec; ++e) xo[e] = from_float<T>(ca * to_float(xa[e]) + cb * to_float(xb[e]));
      *reinterpret_cast<uint4*>(o + c) = vo;
    }
  } else {
    for (long long c = lane; c < p.head_dim_v; c += 32)
      o[c] = from_float<T>(ca * to_float(a[c]) + cb * to_float(b[c]));
  }
}

}  // namespace cupy_attn
