// Online softmax of one warpgroup's score tile for flash_fwd_sm90.cu: the causal / sequence-end mask, the running row
// max m and sum l (base 2), P packed into wgmma A fragments, and the rescale of O. Owns the per-row statistics.
//
// Register layout (wgmma m64nN accumulators, per warp of the warpgroup = the mma.sync C layout): lane 4g+t holds rows
// g and g+8 of its warp's 16; s[4j + 2·half + e] is row g + 8·half, column 8j + 2t + e.
#pragma once
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/mask.cuh"
#include "common/visibility.cuh"
#include "common/score_mod.cuh"
#include "common/user_mod.cuh"

namespace cupy_attn {
namespace sm90 {

// Scores past the last visible key of each row become -inf (common/visibility.cuh). row: this lane's first row (g);
// n0 and t: the tile's and lane's first column (key n0 + 2t); each element compares against Visibility::lane_limit.
template <int kBlockN>
__device__ __forceinline__ void mask_tile(float (&s)[kBlockN / 2], long long row, int n0, int t,
                                          Visibility vis) {
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int lim = vis.lane_limit<kBlockN>(row + 8 * half, n0, 2 * t);
    #pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
      #pragma unroll
      for (int e = 0; e < 2; ++e)
        if (j * 8 + e > lim) s[4 * j + 2 * half + e] = neg_inf();
  }
}

// Scores before the first visible key of each row become -inf: a window's lower bound, key j >= row + window_lo
// (Visibility::lane_lower's clamped-int form; only tiles at the window's lower edge call this).
template <int kBlockN>
__device__ __forceinline__ void mask_tile_lower(float (&s)[kBlockN / 2], long long row, int n0, int t,
                                                long long window_lo) {
  const Visibility vis{0, 0, false, true, window_lo};
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int lo = vis.lane_lower<kBlockN>(row + 8 * half, n0, 2 * t);
    #pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
      #pragma unroll
      for (int e = 0; e < 2; ++e)
        if (j * 8 + e < lo) s[4 * j + 2 * half + e] = neg_inf();
  }
}

// Softcap and ALiBi (common/score_mod.cuh) on a lane's scores of key tile n0: column 8j + 2t + e of row row + 8·half
// is key n0 + 8j + 2t + e, at ALiBi distance row + 8·half + diag − key (kept relative to the tile in an int).
template <int kBlockN>
__device__ __forceinline__ void apply_score_mods(float (&s)[kBlockN / 2], const ScoreMods& mods, long long row,
                                                 int n0, int t) {
  if (mods.softcap_in != 0.f) {
    #pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) s[i] = tanh_approx(s[i] * mods.softcap_in);
  }
  if (mods.alibi_k != 0.f) {
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float d0 = static_cast<float>(static_cast<int>(row) + 8 * half + mods.diag - n0 - 2 * t);
      #pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j)
        #pragma unroll
        for (int e = 0; e < 2; ++e)
          s[4 * j + 2 * half + e] = fmaf(mods.alibi_k, fabsf(d0 - static_cast<float>(8 * j + e)),
                                         s[4 * j + 2 * half + e]);
    }
  }
}

// A user's score_mod / mask_mod (common/user_mod.cuh) on a lane's scores of key tile n0 of batch b (the sequence in
// a packed call), head h: element s[4j + 2·half + e] is query row + 8·half, key n0 + 8j + 2t + e. s holds raw units
// (times sc = the exponent's scale·log2 e, or c·log2 e with a softcap, gives base 2), so the mod sees s·sc·ln 2 and
// its result goes back as s'·log2(e) / sc; mask_mod's false becomes -inf. The mods are called only for rows < L and
// keys < S (a snippet may index aux by them); the masks that follow hide the others. with_mask = false: the tile
// lies in its rows' full run (KeyRanges), so mask_mod is not called (a mask-only mod then does nothing).
template <int kBlockN, typename Mod>
__device__ __forceinline__ void apply_user_mod(float (&s)[kBlockN / 2], const typename Mod::Aux& aux, int b, int h,
                                               long long row, int n0, int t, float sc, int L, int S,
                                               bool with_mask = true) {
  if constexpr (!Mod::kScore) {
    if (!with_mask) return;
  }
  const float to_natural = sc * kLn2, from_natural = kLog2e / sc;
  const int key_end = min(S - n0, kBlockN);  // the tile's columns < key_end are keys (all but in the last block)
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int qi = static_cast<int>(row) + 8 * half;
    if (qi >= L) continue;
    #pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int kj = n0 + 8 * j + 2 * t + e;
        if (8 * j + 2 * t + e >= key_end) continue;
        float x = s[4 * j + 2 * half + e];
        if constexpr (Mod::kScore) x = Mod::score(x * to_natural, b, h, qi, kj, aux) * from_natural;
        if constexpr (Mod::kMask) {
          if (with_mask) x = Mod::mask(b, h, qi, kj, aux) ? x : neg_inf();
        }
        s[4 * j + 2 * half + e] = x;
      }
  }
}

// Running statistics of this lane's two rows. Scores stay raw (unscaled) in s; scale·log2(e) = sc > 0 is folded into
// the exponent's FFMA, so max(raw)·sc is the scaled max (the launcher only selects this kernel for scale > 0).
// An empty row so far keeps m = -inf; 0 replaces it inside the exponentials, so P = 0, α = 0 and l = 0, and the
// epilogue writes out = 0, lse = -inf (not NaN).
// The lazy rescale's threshold, log2 units (see OnlineSoftmax::update_half).
constexpr float kRescaleLog2 = 8.f;

template <int kBlockN, int kHeadDim>
struct OnlineSoftmax {
  static constexpr bool kLazyRescale = kHeadDim >= 128;
  float m[2];  // running max of the scaled scores, log2 units
  float l[2];  // this lane's partial row sum (the quad's four partials are summed in the epilogue)

  __device__ __forceinline__ void init() {
    m[0] = m[1] = neg_inf();
    l[0] = l[1] = 0.f;
  }

  // The sink's term (base 2) in rows g + 8·half's sum, at the end: l is this lane's quarter of the row sum, so the
  // quad's lanes add a quarter each (the epilogue sums the four); a row that saw no key takes m = the sink, l = 1.
  __device__ __forceinline__ void add_sink(int half, float sink_log2) {
    if (m[half] == neg_inf()) {
      m[half] = sink_log2;
      l[half] = 0.25f;
    } else {
      l[half] += 0.25f * exp2f(sink_log2 - m[half]);
    }
  }

  // Rows g + 8·half: row max, s -> 2^(s·sc − m) in place (fp32), m and l updated. Returns α = 2^(m_old − m) and
  // *moved: whether the warp's 16 rows took a new max (else α = 1 and the O rescale may be skipped).
  // From head dim 128 on (kLazyRescale) the max moves lazily (FlashAttention-4's trick, flash_decode.cu's
  // kRescaleLog2): only when some row of the warp sees a block max above its running max by more than kRescaleLog2
  // (log2 units; also a row's first visible block, m = -inf); then every row of the warp takes its exact new max.
  // Otherwise P = 2^(s·sc − m) <= 2^8, exact in fp32 and within P's fp16/bf16 range, and the kHeadDim/2 multiplies
  // of O run on a few blocks per row instead of on every block where some max grows a little. O, l and m always
  // agree, so out = O / l and lse = m + log2 l are as with an exact running max. Below 128 the O rescale is cheap
  // and the eager max measured faster (bench/notes/kernels_flash_fwd_sm90.md).
  __device__ __forceinline__ float update_half(float (&s)[kBlockN / 2], int half, float sc, bool& moved) {
    float mx = neg_inf();
    #pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * half], s[4 * j + 2 * half + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_old = m[half];
    const float block_max = mx * sc;  // -inf for a row that sees no key of this block
    float alpha = 1.f;
    if constexpr (kLazyRescale) {
      moved = __any_sync(0xffffffffu, block_max > m_old + kRescaleLog2);
      if (moved) {
        const float m_new = fmaxf(m_old, block_max);
        alpha = exp2_approx(m_old - (m_new == neg_inf() ? 0.f : m_new));
        m[half] = m_new;
      }
    } else {
      m[half] = fmaxf(m_old, block_max);
    }
    const float m_use = m[half] == neg_inf() ? 0.f : m[half];
    float sum = 0.f;
    #pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[4 * j + 2 * half + e] = exp2_approx(fmaf(s[4 * j + 2 * half + e], sc, -m_use));
        sum += s[4 * j + 2 * half + e];
      }
    }
    if constexpr (!kLazyRescale) alpha = exp2_approx(m_old - m_use);
    l[half] = l[half] * alpha + sum;
    if constexpr (!kLazyRescale) moved = __any_sync(0xffffffffu, m[half] != m_old);
    return alpha;
  }

  // P of rows g + 8·half into the A fragments of the P·V wgmma (k step kk: registers 0/2 row g, 1/3 row g+8,
  // columns 16kk + 2t (+8)).
  template <typename T>
  __device__ __forceinline__ static void pack_half(const float (&s)[kBlockN / 2], unsigned (&pa)[kBlockN / 16][4],
                                                   int half) {
    #pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      pa[kk][half] = pack2<T>(s[8 * kk + 2 * half], s[8 * kk + 2 * half + 1]);
      pa[kk][2 + half] = pack2<T>(s[8 * kk + 4 + 2 * half], s[8 * kk + 4 + 2 * half + 1]);
    }
  }

  __device__ __forceinline__ static void rescale_half(float (&o)[kHeadDim / 2], int half, float alpha) {
    #pragma unroll
    for (int d = 0; d < kHeadDim / 8; ++d) {
      o[4 * d + 2 * half] *= alpha;
      o[4 * d + 2 * half + 1] *= alpha;
    }
  }

  // All of a step at once (no P·V wgmma in flight): each half's P goes to 16 bits right after its exponentials, so
  // its fp32 scores are dead before the other half's.
  template <typename T>
  __device__ __forceinline__ void step(float (&s)[kBlockN / 2], unsigned (&pa)[kBlockN / 16][4],
                                       float (&o)[kHeadDim / 2], float sc) {
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      bool moved;
      const float alpha = update_half(s, half, sc, moved);
      pack_half<T>(s, pa, half);
      if (moved) rescale_half(o, half, alpha);
    }
  }
};

}  // namespace sm90
}  // namespace cupy_attn
