// Masked row softmax for the split attention path: P = softmax(S + mask) with S = scale·log2(e)·Q Kᵀ from cuBLAS.
//
// Math: for each score row s (already in base-2 units, the scale and log2(e) folded into the GEMM's alpha),
//   s'_j = s_j + log2(e)·mask_j (float mask) | -inf where a bool mask is False or j > i + causal_offset,
//   m = max_j s'_j,  l = Σ_j 2^(s'_j − m),  P_j = 2^(s'_j − m) / l,  lse = ln2·(m + log2 l)  (natural log).
// Algorithm: the safe (max-subtracted) softmax, one pass over registers (Milakov & Gimelshein 2018 would merge max and
// sum online; with the row in registers, two reductions over registers are cheaper than the rescaling).
//
// Thread mapping: kThreadsPerRow threads own one row; thread t holds float4 v at column 4·(v·kThreadsPerRow + t), so
// each of the kVecs loads is coalesced across the group. A block is max(kThreadsPerRow, 128) threads, i.e. four rows
// per block for the 32-thread groups that serve short rows. kVecs == 0 is the looping variant for rows longer than
// the register tiles (> 16384): three sweeps over global memory (max, sum, write), the row re-read from L1/L2.
//
// In place: the scores buffer is fp32 with row pitch `ld` floats (ld % 4 == 0). P is written as OutT over the same
// row, starting at the row's first byte, so the second GEMM reads it with a pitch of ld·4/sizeof(OutT) elements. A row
// is read completely (reductions include a barrier) before any of it is written, so no element is overwritten before
// its owner has read it. The looping variant writes tile by tile, each after a barrier: tile k's fp16 writes cover
// fp32 columns below the tile's end, all of which were read already.
//
// Accumulation: fp32 throughout. Scores stay fp32 in memory on purpose: with |scale·q·k| up to ~50, fp16 scores would
// carry an absolute error of ~0.02 in the exponent (2% in P) and bf16 ~0.2 (20%); fp32 keeps P within output rounding.
//
// Batch indexing: a row r of the launch is (local batch b = r / rows_per_batch, query row i = row0 + r % rows_per_batch).
// The global batch index batch0 + b decomposes into up to three original axes (outer, middle, inner; sizes n1, n2
// for the inner two) to find the row's mask and lse addresses, so broadcast masks need no expansion.
//
// Dropout (kDropout, with kMasked): P_j is written as P_j · Z_j / (1 − p), Z_j the keep bit of common/philox.cuh for
// (bh, i, j); m, l and lse are those of the undropped row. bh = bh0 + Σ (batch axis index · its bh stride), decomposed
// like the mask's batch index. Two Philox blocks per float4 (2×2 tiles: this row's half of each).
//
// User mods (masked_softmax_mod, common/user_mod.cuh): score_mod and mask_mod after the variants, before the mask.
//
// History and measurements: bench/notes/kernels_softmax.md.
#include "common/types.cuh"
#include "common/reduce.cuh"
#include "common/mask.cuh"
#include "common/visibility.cuh"
#include "common/philox.cuh"
#include "common/score_mod.cuh"
#include "common/user_mod.cuh"

namespace cupy_attn {

struct SoftmaxParams {
  float* scores;          // in: fp32 scores (rows, ld); out: P as OutT in place
  float* lse;             // optional (nullptr): fp32 natural-log lse
  const void* mask;       // optional: element (i, j) of a row's mask at mask_row + i·mask_stride_q + j·mask_stride_k
  long long rows, rows_per_batch, row0, seqlen_k, ld;
  long long causal_offset;  // key j is visible to query i iff j <= i + causal_offset (seqlen_k: no causal mask)
  long long mask_kind;      // MaskKind; every field is 8 bytes so the host's NumPy struct has the same layout
  long long batch0, n1, n2;                          // global batch index decomposition (outer, middle: n1, inner: n2)
  long long mask_stride_b0, mask_stride_b1, mask_stride_b2, mask_stride_q, mask_stride_k;
  long long lse_stride_b0, lse_stride_b1, lse_stride_b2;
  // Dropout (kDropout only): rng = {seed, offset} (int64, device), threshold (uint32 value), scale = 1/(1 − p) (0 for
  // p = 1), bh of the chunk's first row and the bh strides of the three batch axes.
  const long long* rng;
  long long dropout_threshold;
  double dropout_scale;
  long long bh0, bh_stride_b0, bh_stride_b1, bh_stride_b2;
  // Variants (masked_softmax_variants only; common/visibility.cuh, common/score_mod.cuh), in the scores' base-2
  // units: key j is visible only if j >= i + window_lo (kNoLowerBound: no lower bound); softcap_log2 = c·log2(e) (0:
  // none); the ALiBi slope and the sink logit of the row's (batch, query head) at its flat index bh (the Philox
  // counter's: bh0 + the decomposed batch index over bh_stride_b0..2) in fp32 arrays of B·Hq (the launcher expands
  // them), or nullptr; ALiBi's distance |i + diag − j| (diag = S − L).
  long long window_lo;
  double softcap_log2;
  const float* alibi_slopes;
  const float* sinks;
  long long diag;
};

// The global batch index as its (outer, middle, inner) axis indices. k32: in 32-bit arithmetic (the variants'
// instantiations: a 64-bit division is a called subroutine, and around its calls their rows spilled); the plain ones
// keep 64-bit batch_offset below.
struct BatchIndex {
  long long i0, i1, i2;
  __device__ __forceinline__ static BatchIndex of32(long long idx, long long n1, long long n2) {
    unsigned x = static_cast<unsigned>(idx);
    const unsigned i2 = x % static_cast<unsigned>(n2);
    x /= static_cast<unsigned>(n2);
    return {x / static_cast<unsigned>(n1), x % static_cast<unsigned>(n1), i2};
  }
  __device__ __forceinline__ long long offset(long long s0, long long s1, long long s2) const {
    return i0 * s0 + i1 * s1 + i2 * s2;
  }
};

__device__ __forceinline__ long long batch_offset(long long idx, long long n1, long long n2,
                                                  long long s0, long long s1, long long s2) {
  const long long i2 = idx % n2; idx /= n2;
  const long long i1 = idx % n1; idx /= n1;
  return idx * s0 + i1 * s1 + i2 * s2;
}

// The score s_j after masking, in base-2 units: -inf for masked keys.
__device__ __forceinline__ float apply_mask(float s, long long j, long long limit, const SoftmaxParams& p,
                                            const char* mask_row) {
  if (j > limit) return -inf();
  if (p.mask_kind == kMaskNone) return s;
  const long long off = j * p.mask_stride_k;
  switch (p.mask_kind) {
    case kMaskBool: return reinterpret_cast<const unsigned char*>(mask_row)[off] ? s : -inf();
    case kMaskHalf: return s + kLog2e * to_float(reinterpret_cast<const __half*>(mask_row)[off]);
    case kMaskBf16: return s + kLog2e * to_float(reinterpret_cast<const __nv_bfloat16*>(mask_row)[off]);
    default:        return s + kLog2e * reinterpret_cast<const float*>(mask_row)[off];
  }
}

// The variants of one row (kVariants): the window's lower bound, softcap and ALiBi on each score (base-2 units),
// and the sink's logit for the row's statistics.
struct RowVariants {
  long long first_key;  // keys j < first_key are not visible
  float softcap;        // c·log2(e), or 0
  float slope;          // −slope·log2(e), or 0
  int dist0;            // i + diag: ALiBi's distance to key j is |dist0 − j| (rows and keys are < 2^31)
  bool has_sink;
  float sink;           // the sink's logit in base-2 units

  __device__ __forceinline__ static RowVariants of(const SoftmaxParams& p, const BatchIndex& bi, long long i) {
    const long long bh = p.bh0 + bi.offset(p.bh_stride_b0, p.bh_stride_b1, p.bh_stride_b2);
    RowVariants r;
    r.first_key = p.window_lo == kNoLowerBound ? 0 : i + p.window_lo;
    r.softcap = static_cast<float>(p.softcap_log2);
    r.slope = 0.f;
    if (p.alibi_slopes) r.slope = -kLog2e * p.alibi_slopes[bh];
    r.dist0 = static_cast<int>(i + p.diag);
    r.has_sink = p.sinks != nullptr;
    r.sink = 0.f;
    if (r.has_sink) r.sink = kLog2e * p.sinks[bh];
    return r;
  }
};

// kMasked = false: no attn_mask and no causal limit (the host's choice), so no element is masked and apply_mask's
// per-element 64-bit compare and kind switch are compiled out (faster at the seed shape:
// bench/notes/kernels_softmax.md). kDropout: dropout_p > 0 (declared with kMasked only).
// kVariants: the window's lower bound, softcap, ALiBi and sinks (RowVariants), in the masked_softmax_variants kernels.
// Mod (common/user_mod.cuh; with kVariants): a user's score_mod / mask_mod after them, at (b, h) = the row's flat
// (batch, head) index split by num_heads.
template <typename OutT, int kThreadsPerRow, int kVecs, bool kMasked, bool kDropout, bool kVariants,
          typename Mod = NoMod>
__device__ __forceinline__ void softmax_rows(const SoftmaxParams& p, const typename Mod::Aux& aux = {},
                                             long long num_heads = 1) {
  static_assert(kMasked || !kVariants, "the variants run on the masked instantiations");
  constexpr int kBlockThreads = kThreadsPerRow > 128 ? kThreadsPerRow : 128;
  constexpr int kRowsPerBlock = kBlockThreads / kThreadsPerRow;
  __shared__ float scratch[kBlockThreads / 32];

  const long long row = static_cast<long long>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kThreadsPerRow;
  const int t = threadIdx.x % kThreadsPerRow;
  // Rows past the end still join the block reductions (barriers) but never touch memory.
  const bool active = row < p.rows;
  long long b, i;
  if constexpr (kVariants) {  // 32-bit (BatchIndex): a launch's rows are < 2^32
    const unsigned r = active ? static_cast<unsigned>(row) : 0u, per = static_cast<unsigned>(p.rows_per_batch);
    b = r / per;
    i = p.row0 + r % per;
  } else {
    b = active ? row / p.rows_per_batch : 0;
    i = p.row0 + (active ? row % p.rows_per_batch : 0);
  }
  // The causal limit of row i (common/visibility.cuh); the host passes causal_offset = S when the call is not causal.
  const long long limit = Visibility{p.seqlen_k, p.causal_offset, true}.causal_limit(i);
  const long long gbatch = p.batch0 + b;
  BatchIndex bi{};
  if constexpr (kVariants) bi = BatchIndex::of32(gbatch, p.n1, p.n2);
  // The row's offset along the batch axes for strides (s0, s1, s2).
  auto batch_off = [&](long long s0, long long s1, long long s2) {
    if constexpr (kVariants) {
      return bi.offset(s0, s1, s2);
    } else {
      return batch_offset(gbatch, p.n1, p.n2, s0, s1, s2);
    }
  };
  const char* mask_row = nullptr;
  if (p.mask_kind != kMaskNone) {
    mask_row = reinterpret_cast<const char*>(p.mask) +
               (batch_off(p.mask_stride_b0, p.mask_stride_b1, p.mask_stride_b2) + i * p.mask_stride_q) *
               mask_itemsize(p.mask_kind);
  }
  float* srow = p.scores + (active ? row : 0) * p.ld;
  OutT* prow = reinterpret_cast<OutT*>(srow);
  const long long S = p.seqlen_k;
  Dropout drop{};
  unsigned bh = 0;
  float keep_scale = 1.f;
  if constexpr (kDropout) {
    drop = Dropout::load(p.rng, p.dropout_threshold);
    bh = static_cast<unsigned>(p.bh0 + batch_off(p.bh_stride_b0, p.bh_stride_b1, p.bh_stride_b2));
    keep_scale = static_cast<float>(p.dropout_scale);
  }

  RowVariants rv{};
  if constexpr (kVariants) rv = RowVariants::of(p, bi, i);
  [[maybe_unused]] int mod_b = 0, mod_h = 0;
  if constexpr (Mod::kScore || Mod::kMask) {
    const long long bh_row = p.bh0 + bi.offset(p.bh_stride_b0, p.bh_stride_b1, p.bh_stride_b2);
    mod_b = static_cast<int>(bh_row / num_heads);
    mod_h = static_cast<int>(bh_row % num_heads);
  }
  // The score of key j after the variants and the mask (kMasked), in base-2 units.
  const long long first_key = rv.first_key;
  const int dist0 = rv.dist0;
  const float softcap = rv.softcap, slope = rv.slope;
  auto score = [&](float x, long long j) {
    if constexpr (kVariants) {
      if (j < first_key) return -inf();
      if (softcap != 0.f) x = softcap * tanh_approx(__fdividef(x, softcap));
      if (slope != 0.f) x = fmaf(slope, fabsf(static_cast<float>(dist0 - static_cast<int>(j))), x);
      x = apply_mod_log2<Mod>(x, mod_b, mod_h, static_cast<int>(i), static_cast<int>(j), aux);
    }
    return apply_mask(x, j, limit, p, mask_row);
  };

  float m = -inf(), l = 0.f;
  if constexpr (kVecs > 0) {
    float x[kVecs][4];
    #pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const long long c = 4LL * (v * kThreadsPerRow + t);
      float4 f = make_float4(-inf(), -inf(), -inf(), -inf());
      if (active && c < S) f = *reinterpret_cast<const float4*>(srow + c);
      x[v][0] = f.x; x[v][1] = f.y; x[v][2] = f.z; x[v][3] = f.w;
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (kMasked) {
          x[v][e] = (active && c + e < S) ? score(x[v][e], c + e) : -inf();
        } else {
          x[v][e] = (active && c + e < S) ? x[v][e] : -inf();
        }
        m = fmaxf(m, x[v][e]);
      }
    }
    m = group_reduce<kThreadsPerRow>(m, MaxOp(), scratch);
    if constexpr (kVariants) {
      if (rv.has_sink) m = fmaxf(m, rv.sink);  // the sink takes part in the max and the sum
    }
    // A fully masked row has m = -inf; subtracting 0 instead keeps every 2^(s - m) at 0 (and NaN stays NaN).
    const float m_safe = m == -inf() ? 0.f : m;
    #pragma unroll
    for (int v = 0; v < kVecs; ++v)
      #pragma unroll
      for (int e = 0; e < 4; ++e) { x[v][e] = exp2f(x[v][e] - m_safe); l += x[v][e]; }
    l = group_reduce<kThreadsPerRow>(l, SumOp(), scratch);  // its barrier also ends every read of this row
    if constexpr (kVariants) {
      if (rv.has_sink) l += exp2f(rv.sink - m_safe);
    }
    const float inv_l = l == 0.f ? 0.f : 1.f / l;
    if (active) {
      #pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const long long c = 4LL * (v * kThreadsPerRow + t);
        if (c >= S) continue;
        if constexpr (kDropout) {
          const unsigned z = drop.keep4(bh, i, c);
          const float kept = inv_l * keep_scale;
          store4<OutT>(prow + c, z & 1u ? x[v][0] * kept : 0.f, z & 2u ? x[v][1] * kept : 0.f,
                       z & 4u ? x[v][2] * kept : 0.f, z & 8u ? x[v][3] * kept : 0.f);
        } else {
          store4<OutT>(prow + c, x[v][0] * inv_l, x[v][1] * inv_l, x[v][2] * inv_l, x[v][3] * inv_l);
        }
      }
    }
  } else {
    // Looping variant: the row does not fit in registers (S > 16384). It applies the mask test whatever kMasked (an
    // unmasked call has mask_kind none and causal_offset = S, so nothing is masked): specialising it made ptxas
    // spill, and three sweeps over global memory dwarf the test. Sweep 1: online max and sum (one read).
    for (long long c = 4LL * t; c < S; c += 4LL * kThreadsPerRow) {
      const float4 f = active ? *reinterpret_cast<const float4*>(srow + c) : make_float4(0.f, 0.f, 0.f, 0.f);
      auto online = [&](float x, int e) {
        const float s = (active && c + e < S) ? (kVariants ? score(x, c + e) : apply_mask(x, c + e, limit, p, mask_row))
                                              : -inf();
        if (s > m) { l = l * exp2f(m - s) + 1.f; m = s; }
        else l += exp2f(s - (m == -inf() ? 0.f : m));
      };
      online(f.x, 0); online(f.y, 1); online(f.z, 2); online(f.w, 3);
    }
    const float m_red = group_reduce<kThreadsPerRow>(m, MaxOp(), scratch);
    const float m_row = kVariants && rv.has_sink ? fmaxf(m_red, rv.sink) : m_red;
    const float m_safe = m_row == -inf() ? 0.f : m_row;
    l = group_reduce<kThreadsPerRow>(l * exp2f((m == -inf() ? 0.f : m) - m_safe), SumOp(), scratch);
    if constexpr (kVariants) {
      if (rv.has_sink) l += exp2f(rv.sink - m_safe);
    }
    const float inv_l = l == 0.f ? 0.f : 1.f / l;
    // Sweep 2: read a tile, barrier, write it (see the in-place note in the header).
    for (long long base = 0; base < S; base += 4LL * kThreadsPerRow) {
      const long long c = base + 4LL * t;
      float4 y = make_float4(0.f, 0.f, 0.f, 0.f);
      if (active && c < S) {
        y = *reinterpret_cast<const float4*>(srow + c);
        const unsigned z = kDropout ? drop.keep4(bh, i, c) : 0xFu;
        const float kept = kDropout ? inv_l * keep_scale : inv_l;
        auto prob = [&](float s, int e) {
          if (!(c + e < S && (z >> e) & 1u)) return 0.f;
          return exp2f((kVariants ? score(s, c + e) : apply_mask(s, c + e, limit, p, mask_row)) - m_safe) * kept;
        };
        y = make_float4(prob(y.x, 0), prob(y.y, 1), prob(y.z, 2), prob(y.w, 3));
      }
      __syncthreads();
      if (active && c < S) store4<OutT>(prow + c, y.x, y.y, y.z, y.w);
    }
    m = m_row;
  }

  if (p.lse != nullptr && active && t == 0) {
    const long long off = batch_off(p.lse_stride_b0, p.lse_stride_b1, p.lse_stride_b2) + i;
    p.lse[off] = l == 0.f ? -inf() : kLn2 * ((m == -inf() ? 0.f : m) + log2f(l));
  }
}

template <typename OutT, int kThreadsPerRow, int kVecs, bool kMasked, bool kDropout>
__global__ void __launch_bounds__(kThreadsPerRow > 128 ? kThreadsPerRow : 128)
masked_softmax(const SoftmaxParams p) {
  softmax_rows<OutT, kThreadsPerRow, kVecs, kMasked, kDropout, false>(p);
}

// The variants (always masked). One block per SM is declared: left to its own heuristic, ptxas held the wide tiles
// to 64 registers and spilled around the row's extra state.
template <typename OutT, int kThreadsPerRow, int kVecs, bool kDropout>
__global__ void __launch_bounds__(kThreadsPerRow > 128 ? kThreadsPerRow : 128, 1)
masked_softmax_variants(const SoftmaxParams p) {
  softmax_rows<OutT, kThreadsPerRow, kVecs, true, kDropout, true>(p);
}

// A user's mods (cupy_attn.AttentionMod) with the variants: instantiated only in a mod's own program, whose source
// appends the Mod struct (attention/mods.py), one block per SM declared as the variants'.
template <typename OutT, int kThreadsPerRow, int kVecs, bool kDropout, typename Mod>
__global__ void __launch_bounds__(kThreadsPerRow > 128 ? kThreadsPerRow : 128, 1)
masked_softmax_mod(const ModParams<SoftmaxParams, Mod> p) {
  softmax_rows<OutT, kThreadsPerRow, kVecs, true, kDropout, true, Mod>(p, p.aux, p.mod_num_heads);
}

}  // namespace cupy_attn
