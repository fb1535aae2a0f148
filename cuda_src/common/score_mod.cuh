// What happens to a visible key's score besides the mask (common/visibility.cuh says which keys are visible):
// softcap (Gemma 2), ALiBi (Press et al. 2022, FlashAttention's convention) and attention sinks (gpt-oss's learned
// per-head logits), with cupy_attn.reference.scaled_dot_product_attention's math:
//
//   s = scale · q·k;   s <- c · tanh(s / c)  (softcap c);   s <- s − slope_h · |i + S − L − j|  (ALiBi);
//   out_i = Σ_j e^(s_j) v_j / (Σ_j e^(s_j) + e^(sink_h)),   lse_i = log of that denominator.
//
// Units. The kernels keep raw scores r = q·k in their accumulators and fold the factor to base-2 units into the
// exponent (2^(r·sc − m), sc = scale·log2(e)). With a softcap they keep r' = tanh(r · scale / c) instead and use
// sc = c·log2(e) (FlashAttention's arrangement: one multiply and one tanh per score), so the launcher passes
// softcap_in = scale / c and sc accordingly. ALiBi's bias is added in the same raw units: b / (c or scale), so the
// launcher passes alibi_scale = 1 / c with a softcap, 1 / scale without, and the per-head factor is
// −slope_h · alibi_scale. Sinks enter the row sum at the end, in base-2 units: l += 2^(sink_h·log2(e) − m).
#pragma once
#include "common/types.cuh"

namespace cupy_attn {

// tanh(x) = 2 / (1 + 2^(−2·log2(e)·x)) − 1 by two SFU operations (ex2.approx, rcp.approx): absolute error ~1e-7,
// saturating to ±1 (2^+big = inf gives −1, 2^−big = 0 gives 1). Not tanh.approx.f32: its relative error of 2^-11
// becomes an error of c·2^-11 in a softcapped score (0.025 at c = 50, 2.5% in P), as large as fp16's own rounding of
// the scores; this one keeps the softcap within fp32 rounding for one more MUFU operation per score.
__device__ __forceinline__ float tanh_approx(float x) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-2.f * kLog2e * x));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + e));
  return fmaf(2.f, r, -1.f);
}

// The score mods of one (batch, head) for one kernel: softcap_in = scale / c (0: no softcap), alibi_k = −slope_h ·
// alibi_scale (0: no ALiBi), diag = S − L (ALiBi's distance |i + diag − j|).
struct ScoreMods {
  float softcap_in;
  float alibi_k;
  int diag;

  // r -> tanh(r · softcap_in), then + alibi_k · |row + diag − key|: one visible score in raw units. `dist` is
  // row + diag − key as a float (the caller keeps it relative to its tile to stay in int range).
  __device__ __forceinline__ float apply(float r, float dist) const {
    if (softcap_in != 0.f) r = tanh_approx(r * softcap_in);
    if (alibi_k != 0.f) r = fmaf(alibi_k, fabsf(dist), r);
    return r;
  }
};

// The sink's share of a row's softmax, at the end: m (base 2, the running max the row sum l is relative to) and l
// become those of the row with e^(sink) in its denominator. A row that saw no key (m = −inf, l = 0) takes m = the
// sink's logit and l = 1, so out = 0 and lse = sink.
__device__ __forceinline__ void add_sink(float& m, float& l, float sink_log2) {
  if (m == -inf()) {
    m = sink_log2;
    l = 1.f;
  } else {
    l += exp2f(sink_log2 - m);
  }
}

// One head's sink logit in base-2 units from the launcher's array (fp32, or the kernel's element type T when
// kind = 1).
template <typename T>
__device__ __forceinline__ float sink_log2(const void* sinks, long long kind, int h) {
  const float v = kind == 1 ? to_float(static_cast<const T*>(sinks)[h]) : static_cast<const float*>(sinks)[h];
  return v * kLog2e;
}

}  // namespace cupy_attn
