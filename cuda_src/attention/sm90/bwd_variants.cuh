// The variants of flash_bwd_sm90.cu (its kVariants instantiations): a sliding window's lower bound, softcap and ALiBi
// on a consumer warpgroup's Sᵀ tile, with the forward's definitions and units (common/visibility.cuh,
// common/score_mod.cuh) in the backward's transposed layout: lane 4g+t holds keys key0 (= its warp's first key + g)
// and key0 + 8 (half = 0, 1) against queries q0 + 8j + 2t + e at acc[4j + 2·half + e] (q0: the warpgroup's first
// query of the step). Sinks need nothing here: dS = P ∘ (dP − D) holds with the sink's term in lse (the sinks' own
// gradient, −Σ_i e^(sink − lse_i) D_i, is computed outside the kernel).
//
// Math. The forward kept t = tanh(r · softcap_in) for the raw score r = q·k (softcap_in = scale / c) and P =
// 2^(t · sc − lse·log2 e) with sc = c · log2 e (without a softcap t = r and sc = scale · log2 e); ALiBi adds
// alibi_k · |i + S − L − j| to t before the exponential (alibi_k = −slope_h · alibi_scale, the bias in t's units). The
// gradient with respect to r is dS · c · (1 − t²) · softcap_in = dS · scale · (1 − t²), with t the capped score before
// the bias: the kernel applies scale as without a softcap (dK's store, dQ's staging), so the softcap's part is dS ∘
// (1 − t²), taken in fp32 before dS is rounded to T for the GEMMs. ALiBi's bias is constant in q and k; the slopes get
// no gradient (fixed slopes, as FlashAttention's ALiBi; issue 33 asks for none).
//
// Registers. The consumers run at 227-230 of their 240 registers in the plain instantiations, so the softcap keeps no
// second array for (1 − t²): between the two wgmma waits (Sᵀ done, dPᵀ in flight) Sᵀ becomes t in place (tanh
// instead of the exponential), and the dS pass forms each element's Pᵀ from its t once dPᵀ is done, with the bias,
// the mask and (1 − t²), so that the tile's fp32 values die as they are packed (as the plain dS pass does).
#pragma once
#include "common/mma.cuh"
#include "common/score_mod.cuh"
#include "common/user_mod.cuh"

namespace cupy_attn {
namespace sm90 {

// What the consumers compute per step. The kVariants instantiations hold two copies of bwd_consume, chosen once per
// CTA from the parameters: run-time branches between the two kinds of step inside one step loop made ptxas spill (its
// allocation is the union of the paths' at each merge), and a copy per combination (softcap, ALiBi, both) cost three
// times the compile time for one FSEL and the bias's FADD and FFMA per element.
//   kPlain      the plain instantiations: the exponentials between the two wgmma waits, the causal mask;
//   kWindow     the same with both edges of a window (the lower one too): windowed calls without softcap or ALiBi;
//   kScoreMods  the window, with softcap and/or ALiBi: tanh between the waits (with a softcap), Pᵀ with the bias,
//               the mask and dSᵀ's (1 − t²) in the dS pass (bwd_score_mod_ds).
//   kUserMod    a user's score_mod / mask_mod (common/user_mod.cuh), as kScoreMods without softcap or ALiBi: the
//               mod's score, mask and score_grad per element in the dS pass (bwd_user_mod_ds).
enum class BwdMode { kPlain, kWindow, kScoreMods, kUserMod };

// Sᵀ -> Pᵀ = 2^(r · sc − lse·log2 e) in place, lse·log2 e of query 8j + 2t (+1) at lse[8j + 2t]: kPlain's and
// kWindow's pass, between the waits (it overlaps dPᵀ = V dOᵀ).
template <int kSN>
__device__ __forceinline__ void bwd_exp_scores(float (&s)[kSN / 2], const float* lse, int t, float sc) {
  #pragma unroll
  for (int j = 0; j < kSN / 8; ++j) {
    const float2 l = *reinterpret_cast<const float2*>(lse + 8 * j + 2 * t);
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      s[4 * j + 2 * half] = exp2_approx(fmaf(s[4 * j + 2 * half], sc, -l.x));
      s[4 * j + 2 * half + 1] = exp2_approx(fmaf(s[4 * j + 2 * half + 1], sc, -l.y));
    }
  }
}

// Softcap, between the waits: Sᵀ -> t = tanh(r · softcap_in) in place (tanh.approx, as the forward).
template <int kSN>
__device__ __forceinline__ void bwd_tanh_scores(float (&s)[kSN / 2], float softcap_in) {
  #pragma unroll
  for (int i = 0; i < kSN / 2; ++i) s[i] = tanh_approx(s[i] * softcap_in);
}

// The visible query columns of key `key` in the lane's layout: column 8j + e (query q0 + 8j + 2t + e) is visible iff
// bwd_first_col <= 8j + e <= bwd_last_col. First: past every column for keys past S; key − causal_offset − q0 − 2t
// under the upper bound (causal and/or a window's right side), else 0. Last: key − window_lo − q0 − 2t, past every
// column with the consumer's no-bound window_lo, −(L + 3·kBlockM). Ints: |S − L| and |window_lo| are below L + S +
// 3·kBlockM < 2^31 (first is Visibility::causal_first_row(key) − q0 − 2t; the 64-bit helper changed the plain
// kernel's SASS).
template <int kSN>
__device__ __forceinline__ int bwd_first_col(int key, int q0, int t, int S, bool causal, int causal_offset) {
  return key >= S ? kSN : (causal ? key - causal_offset - q0 - 2 * t : 0);
}
__device__ __forceinline__ int bwd_last_col(int key, int q0, int t, int window_lo) {
  return key - window_lo - q0 - 2 * t;
}

// After the exponentials (kPlain, kWindow): Pᵀ -> 0 outside each key's visible columns: past S and the upper bound,
// and with kLower (the variants) a window's lower bound.
template <int kSN, bool kLower>
__device__ __forceinline__ void bwd_mask(float (&s)[kSN / 2], int key0, int q0, int t, int S, bool causal,
                                         int causal_offset, int window_lo) {
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int first = bwd_first_col<kSN>(key0 + 8 * half, q0, t, S, causal, causal_offset);
    [[maybe_unused]] const int last = bwd_last_col(key0 + 8 * half, q0, t, window_lo);
    #pragma unroll
    for (int j = 0; j < kSN / 8; ++j)
      #pragma unroll
      for (int e = 0; e < 2; ++e)
        if (8 * j + e < first || (kLower && 8 * j + e > last)) s[4 * j + 2 * half + e] = 0.f;
  }
}

// kScoreMods, one element of the dS pass (dPᵀ done): s holds t (r without a softcap) and becomes Pᵀ =
// 2^((t + alibi_k · |dist|) · sc − l), 0 when `hidden`; returns dSᵀ = Pᵀ · (dPᵀ − D) · (1 − t²) with a softcap
// (capped), Pᵀ · (dPᵀ − D) without. dist = i + S − L − j of the element (exact in fp32 below 2^24); alibi_k = 0
// without ALiBi (the bias is then +0). A hidden element's Pᵀ is 0 and the rest finite (|t| <= 1 with a softcap):
// dSᵀ = 0, as for rows past L (lse = +inf: Pᵀ = 0).
__device__ __forceinline__ float bwd_score_mod_ds(float& s, float dp, float l, float d, float sc, bool capped,
                                                  float alibi_k, float dist, bool hidden) {
  const float tt = s;
  const float pv = hidden ? 0.f : exp2_approx(fmaf(fmaf(alibi_k, fabsf(dist), tt), sc, -l));
  s = pv;
  return pv * ((dp - d) * (capped ? fmaf(-tt, tt, 1.f) : 1.f));
}

// kUserMod, one element of the dS pass: s holds the raw score r (q·k) of query qi, key kj; the mod sees the natural
// scaled score x = r · sc · ln 2 and gives s' = score_mod(x) (its mask_mod's false, `hidden`, or a query past L: Pᵀ =
// 0, dSᵀ = 0; the mod is not called there, so a snippet may index aux by qi and kj); Pᵀ = 2^(s' · log2 e − l) and
// dSᵀ = Pᵀ · (dPᵀ − D) · score_grad(x) (the kernel applies scale afterwards: d x / d r = scale). with_mask = false:
// the tile lies in its keys' full run (BwdSteps), so mask_mod is not called.
template <typename Mod>
__device__ __forceinline__ float bwd_user_mod_ds(float& s, float dp, float l, float d, float sc, bool hidden, int b,
                                                 int h, int qi, int kj, int L, const typename Mod::Aux& aux,
                                                 bool with_mask = true) {
  if (hidden || qi >= L) {
    s = 0.f;
    return 0.f;
  }
  if constexpr (Mod::kMask) {
    if (with_mask && !Mod::mask(b, h, qi, kj, aux)) {
      s = 0.f;
      return 0.f;
    }
  }
  // A mask-only mod leaves the score as it is: Pᵀ = 2^(r·sc − l) in one FFMA, as the plain modes form it.
  [[maybe_unused]] const float x = s * sc * kLn2;
  float g = 1.f, pv;
  if constexpr (Mod::kScore) {
    const float y = Mod::score(x, b, h, qi, kj, aux);
    g = Mod::score_grad(x, b, h, qi, kj, aux);
    pv = exp2_approx(fmaf(y, kLog2e, -l));
  } else {
    pv = exp2_approx(fmaf(s, sc, -l));
  }
  s = pv;
  const float ds = pv * (dp - d);  // d loss / d score_mod(x)
  if constexpr (Mod::kScoreAuxGrad) {
    if (pv != 0.f) Mod::score_aux_grad(ds, x, b, h, qi, kj, aux);
  }
  return ds * g;
}

}  // namespace sm90
}  // namespace cupy_attn
