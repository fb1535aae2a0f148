// Attention backward, split path: the elementwise steps between cuBLAS GEMMs.
//
// Math (FlashAttention-2's backward, Dao 2023, Algorithm 2, with P recomputed from the saved lse instead of stored):
//   S = scale·Q Kᵀ (+ mask),  P = exp(S − lse),  dV = Pᵀ dO,  dP = dO Vᵀ,
//   D_i = Σ_c dO_ic · O_ic  (= Σ_j P_ij dP_ij),  dS = P ∘ (dP − D),  dQ = scale · dS K,  dK = scale · dSᵀ Q,
//   and d(mask) = dS for a float mask (summed over its broadcast axes by the host).
// The host runs the five GEMMs (cuBLAS, fp32 accumulate); these kernels do the rest:
//   attn_bwd_delta<T>:        D for every row (one warp per row, fp32).
//   attn_bwd_delta_padded<T>: D and lse·log2(e) in padded rows, for the Hopper fused backward (flash_bwd_sm90.cu).
//   attn_bwd_rows<T, false, kDropout>:  P = 2^(s − lse·log2 e) with the mask and causal limit applied (times Z·r
//                             with dropout), written as T for dV's GEMM.
//   attn_bwd_rows<T, true, kDropout>:   dS = P ∘ (dP − D) with P recomputed the same way (dP times Z·r with
//                             dropout), written as T for dQ's and dK's GEMMs (and as fp32 into dmask when the float
//                             mask needs a gradient).
//   attn_bwd_rows_mod<T, kGrad, kDropout, Mod>: the same with a user's score_mod / mask_mod (bwd_rows below).
//   attn_bwd_group_sum<T, kVec>: dK, dV from their fp32 per-query-head accumulators: the sum over each GQA group
//                             (g = 1 without GQA), rounded once to T; also dQ's rounding for the fused kernels.
// s arrives in base-2 units: the host folds scale·log2(e) into the first GEMM's alpha, as the forward does.
// A row whose keys are all masked has lse = −inf (forward convention): its P and dS are 0.
// Dropout (kDropout): with Z the forward's keep mask (common/philox.cuh, recomputed from the same rng pair) and
// r = 1/(1 − p), out = (P ∘ Z·r) V, so dV = (P ∘ Z·r)ᵀ dO (the rows kernel writes P ∘ Z·r), dP = (dO Vᵀ) ∘ Z·r and
// dS = P ∘ (dP − D) with the same D = rowsum(dO ∘ O) (= Σ_j P_ij dP_ij still holds).
//
// Thread mapping: attn_bwd_rows: one 128-thread block per score row, thread t at columns 4t + 512k: float4 loads of
// the fp32 rows (pitch ld, a multiple of 8 floats) and 4-element stores of T into rows of the same pitch.
// attn_bwd_delta: 8 warps per block, one row each, lanes strided over the head dim (16-byte loads where aligned).
// Accumulation: fp32 throughout; only P and dS are rounded to T, as FlashAttention-2 does for its GEMM operands.
//
// History: bench/notes/kernels_bwd_rows.md.
#include "common/types.cuh"
#include "common/mask.cuh"
#include "common/mma.cuh"
#include "common/philox.cuh"
#include "common/visibility.cuh"
#include "common/user_mod.cuh"

namespace cupy_attn {

struct BwdParams {
  const float* scores;   // (rows, ld) fp32 base-2 scores of this chunk
  const float* dp;       // (rows, ld) fp32 dP (rows kernel with kGrad)
  void* out;             // (rows, ld) T: P, or dS with kGrad
  float* dmask;          // optional (rows, seqlen_k) fp32 dS for a float mask's gradient (kGrad only)
  const float* lse;      // (heads, seqlen_q) natural-log lse, contiguous
  float* delta;          // (heads, seqlen_q) D: written by attn_bwd_delta, read by attn_bwd_rows<T, true>
  const void* mask;      // optional mask element (b, h, i, j) at b·sb + h·sh + i·sl + j·ss elements
  const void* dout;      // attn_bwd_delta: dO (rows of head_dim_v, pitch head_dim_v), T
  const void* o;         // attn_bwd_delta: O, same layout
  long long rows;        // rows of this launch: chunk heads × chunk query rows
  long long rows_per_head, row0;  // query rows per head in the chunk, and the chunk's first query row
  long long seqlen_q, seqlen_k, ld, head_dim_v;
  long long head0, num_heads;     // first (batch·head) index of the chunk; heads per batch (splits b and h)
  long long causal_offset;        // key j is visible to query i iff j <= i + causal_offset (seqlen_k: no limit)
  long long mask_kind;            // 0 none, 1 bool, 2 fp16, 3 bf16, 4 fp32
  long long mask_stride_b, mask_stride_h, mask_stride_l, mask_stride_s;
  const long long* rng;           // kDropout: the forward's int64 {seed, offset}
  long long dropout_threshold;    // keep when the Philox draw is below it
  double dropout_scale;           // 1/(1 − p), 0 for p = 1
  float* lse_log2;                // attn_bwd_delta_padded: lse·log2(e) out, padded rows
  float* dq_zero;                 // attn_bwd_delta_padded: optional (heads, seqlen_q, dq_cols) fp32, zeroed
  long long dq_cols;              // its row length (the fused backward's dQ accumulator, E)
  long long row_threads;          // attn_bwd_delta_padded: threads per row (delta_row_threads in backward.py)
};

// This thread's part of Σ_c dout[c]·o[c] over one row of n elements, `threads` threads strided over it (sub = this
// one's index among them): 16-byte loads (8 16-bit elements a thread) when n is a multiple of 8 and both rows are
// 16-byte aligned, else one element.
template <typename T>
__device__ __forceinline__ float partial_dot(const T* dout, const T* o, long long n, int sub, int threads) {
  float acc = 0.f;
  const bool vec = sizeof(T) == 2 && n % 8 == 0 &&
                   ((reinterpret_cast<unsigned long long>(dout) | reinterpret_cast<unsigned long long>(o)) & 15) == 0;
  if (vec) {
    for (long long c = sub * 8; c < n; c += threads * 8) {
      const uint4 a = *reinterpret_cast<const uint4*>(dout + c), b = *reinterpret_cast<const uint4*>(o + c);
      const T* x = reinterpret_cast<const T*>(&a);
      const T* y = reinterpret_cast<const T*>(&b);
      #pragma unroll
      for (int e = 0; e < 8; ++e) acc += to_float(x[e]) * to_float(y[e]);
    }
  } else {
    for (long long c = sub; c < n; c += threads) acc += to_float(dout[c]) * to_float(o[c]);
  }
  return acc;
}

// Σ_c dout[c]·o[c] over one row, the lanes of one warp strided over it, the sum left in every lane.
template <typename T>
__device__ __forceinline__ float row_dot(const T* dout, const T* o, long long n, int lane) {
  float acc = partial_dot(dout, o, n, lane, 32);
  #pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}

template <typename T>
__global__ void __launch_bounds__(256) attn_bwd_delta(const BwdParams p) {
  const long long row = static_cast<long long>(blockIdx.x) * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.rows) return;
  const float acc = row_dot(static_cast<const T*>(p.dout) + row * p.head_dim_v,
                            static_cast<const T*>(p.o) + row * p.head_dim_v, p.head_dim_v, lane);
  if (lane == 0) p.delta[row] = acc;
}

// The statistics of flash_bwd_sm90.cu in rows padded to ld (seqlen_q rounded up to a multiple of every query block
// size), so that each query block's statistics are one aligned TMA box: row (head, i) for i < L gets D = Σ dO∘O and
// lse·log2(e) (+inf for a row whose keys were all masked, lse = −inf: P = 2^(s − inf) = 0); padding rows get D = 0 and
// +inf. Reuses BwdParams: rows = heads · ld, ld, seqlen_q = L, lse (heads, L) in, delta (heads, ld) and lse_log2
// (heads, ld) out, dout and o (heads, L, head_dim_v) contiguous. When dq_zero is set, the threads of row (head, i < L)
// also zero dq_zero's row (head, i) (the kernel's fp32 dQ accumulator, which it adds into; cuDNN's pre-pass does
// the same), in place of a separate memset: 16-byte stores when dq_cols is a multiple of 4 (16-byte aligned base).
template <typename T>
__global__ void __launch_bounds__(256) attn_bwd_delta_padded(const BwdParams p) {
  // row_threads (a power of two ≤ 32) consecutive lanes per row, 8 elements a lane per 16-byte load: at head dim 64
  // a warp takes 4 rows, at 128 two (one row per warp left three quarters of the lanes idle at 64: ~1.5 TB/s). A
  // group past the last row computes nothing but stays for the shuffles.
  const int per_row = static_cast<int>(p.row_threads);
  const long long row = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / per_row;
  const int sub = threadIdx.x % per_row;
  const long long i = row % p.ld, src = (row / p.ld) * p.seqlen_q + i;
  const bool live = row < p.rows, valid = live && i < p.seqlen_q;
  float acc = 0.f;
  if (valid) {
    acc = partial_dot(static_cast<const T*>(p.dout) + src * p.head_dim_v, static_cast<const T*>(p.o) + src * p.head_dim_v,
                      p.head_dim_v, sub, per_row);
    if (p.dq_zero != nullptr) {
      float* z = p.dq_zero + src * p.dq_cols;
      if (p.dq_cols % 4 == 0) {
        for (long long c = sub * 4; c < p.dq_cols; c += per_row * 4)
          *reinterpret_cast<float4*>(z + c) = make_float4(0.f, 0.f, 0.f, 0.f);
      } else {
        for (long long c = sub; c < p.dq_cols; c += per_row) z[c] = 0.f;
      }
    }
  }
  for (int off = per_row / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (live && sub == 0) {
    const float lse = valid ? p.lse[src] : -inf();
    p.delta[row] = acc;
    p.lse_log2[row] = lse == -inf() ? inf() : lse * kLog2e;
  }
}

// dst[o] = Σ_{j<g} src[(o / inner · g + j) · inner + o % inner] for o < rows (= output elements), as T.
// Reuses BwdParams: scores = src (fp32), out = dst, rows = output elements, ld = inner, num_heads = g.
// kVec = 4 (rows and inner multiples of 4, src 16-byte and dst 4·sizeof(T)-byte aligned): a thread sums 4 adjacent outputs of
// one group row with 16-byte loads and stores them as 8 bytes; the scalar kernel, one 64-bit index division per
// element, ran at ~1.4 TB/s on dQ's rounding (H200, 134 MB fp32 in).
template <typename T, int kVec>
__global__ void __launch_bounds__(256) attn_bwd_group_sum(const BwdParams p) {
  const long long o = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (o >= p.rows) return;
  const long long inner = p.ld, g = p.num_heads;
  const float* src = p.scores + (o / inner) * g * inner + o % inner;
  if constexpr (kVec == 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (long long j = 0; j < g; ++j) {
      const float4 x = *reinterpret_cast<const float4*>(src + j * inner);
      acc.x += x.x;
      acc.y += x.y;
      acc.z += x.z;
      acc.w += x.w;
    }
    if constexpr (sizeof(T) == 4) {  // fp32 (the split backward's dK, dV): 16-byte stores
      *reinterpret_cast<float4*>(static_cast<T*>(p.out) + o) = acc;
    } else {
      *reinterpret_cast<uint2*>(static_cast<T*>(p.out) + o) = make_uint2(pack2<T>(acc.x, acc.y), pack2<T>(acc.z, acc.w));
    }
  } else {
    float acc = 0.f;
    for (long long j = 0; j < g; ++j) acc += src[j * inner];
    static_cast<T*>(p.out)[o] = from_float<T>(acc);
  }
}

// Mod (common/user_mod.cuh; attn_bwd_rows_mod): a user's mask_mod hides keys and score_mod maps the scaled score
// s (natural units, before a float mask) to s' = score_mod(s); P is recomputed from s', and dS takes the chain
// factor: dS = P ∘ (dP − D) · score_mod_grad(s) (a float mask's gradient is dS before that factor: it is added to s').
template <typename T, bool kGrad, bool kDropout, typename Mod = NoMod>
__device__ __forceinline__ void bwd_rows(const BwdParams& p, const typename Mod::Aux& aux = {}) {
  const long long row = blockIdx.x;
  if (row >= p.rows) return;
  const long long head = p.head0 + row / p.rows_per_head;  // global (batch·head) index
  const long long i = p.row0 + row % p.rows_per_head;      // query row
  const long long S = p.seqlen_k;
  const float lse = p.lse[head * p.seqlen_q + i];
  const bool empty = lse == -inf();
  const float lse2 = lse * kLog2e;
  const float d = kGrad ? p.delta[head * p.seqlen_q + i] : 0.f;
  // The causal limit of row i (common/visibility.cuh); the host passes causal_offset = S when the call is not causal.
  const long long limit = Visibility{p.seqlen_k, p.causal_offset, true}.causal_limit(i);
  const unsigned char* mrow = nullptr;
  long long mstride = 0;
  if (p.mask_kind != 0) {
    const long long b = head / p.num_heads, h = head % p.num_heads;
    const int isz = mask_itemsize(static_cast<int>(p.mask_kind));
    mrow = static_cast<const unsigned char*>(p.mask) +
           (b * p.mask_stride_b + h * p.mask_stride_h + i * p.mask_stride_l) * isz;
    mstride = p.mask_stride_s * isz;
  }
  Dropout drop{};
  float keep_scale = 1.f;
  if constexpr (kDropout) {
    drop = Dropout::load(p.rng, p.dropout_threshold);
    keep_scale = static_cast<float>(p.dropout_scale);
  }
  const float* srow = p.scores + row * p.ld;
  const float* dprow = kGrad ? p.dp + row * p.ld : nullptr;
  T* orow = static_cast<T*>(p.out) + row * p.ld;
  for (long long c = 4LL * threadIdx.x; c < S; c += 4LL * blockDim.x) {
    const float4 s4 = *reinterpret_cast<const float4*>(srow + c);
    float4 dp4 = make_float4(0.f, 0.f, 0.f, 0.f);
    if constexpr (kGrad) dp4 = *reinterpret_cast<const float4*>(dprow + c);
    const int kind = static_cast<int>(p.mask_kind);
    const unsigned z = kDropout ? drop.keep4(static_cast<unsigned>(head), i, c) : 0xFu;
    // One element: P (or dS) of column j from its score s and dP value dpv. A lambda over scalars, not a loop over
    // float[4] copies of the vectors: those arrays went to the stack on sm_80 (8 bytes of spills).
    auto elem = [&](float s, float dpv, long long j, int e) {
      [[maybe_unused]] float chain = 1.f;  // d score_mod / d s (Mod::kScore)
      [[maybe_unused]] float x = 0.f;      // the natural score score_mod saw (Mod::kScoreAuxGrad)
      if (j >= S || j > limit) {
        s = -inf();
      } else {
        if constexpr (Mod::kScore || Mod::kMask) {
          const int b = static_cast<int>(head / p.num_heads), h = static_cast<int>(head % p.num_heads);
          const int qi = static_cast<int>(i), kj = static_cast<int>(j);
          x = kLn2 * s;
          if constexpr (Mod::kScore && kGrad) chain = Mod::score_grad(x, b, h, qi, kj, aux);
          s = apply_mod_log2<Mod>(s, b, h, qi, kj, aux);
        }
        if (mrow) s += mask_value(mrow + j * mstride, kind);
      }
      const float prob = (empty || s == -inf()) ? 0.f : exp2f(s - lse2);
      float r;
      if constexpr (kDropout) {
        const float zr = (z >> e) & 1u ? keep_scale : 0.f;
        r = kGrad ? prob * (dpv * zr - d) : prob * zr;
      } else {
        r = kGrad ? prob * (dpv - d) : prob;
      }
      if (kGrad && p.dmask != nullptr && j < S) p.dmask[row * S + j] = r;
      if constexpr (Mod::kScoreAuxGrad && kGrad) {  // d loss / d score_mod(x) = r, for the aux arrays' gradients
        if (prob != 0.f)
          Mod::score_aux_grad(r, x, static_cast<int>(head / p.num_heads), static_cast<int>(head % p.num_heads),
                              static_cast<int>(i), static_cast<int>(j), aux);
      }
      if constexpr (Mod::kScore && kGrad) r = prob == 0.f ? 0.f : r * chain;  // hidden keys: 0, not 0·chain
      return r;
    };
    const float r0 = elem(s4.x, dp4.x, c, 0), r1 = elem(s4.y, dp4.y, c + 1, 1), r2 = elem(s4.z, dp4.z, c + 2, 2),
                r3 = elem(s4.w, dp4.w, c + 3, 3);
    store4<T>(orow + c, r0, r1, r2, r3);  // columns up to c + 3 < ld: inside the row's pitch
  }
}

template <typename T, bool kGrad, bool kDropout>
__global__ void __launch_bounds__(128) attn_bwd_rows(const BwdParams p) {
  bwd_rows<T, kGrad, kDropout>(p);
}

// With a user's mods (cupy_attn.AttentionMod): instantiated only in a mod's own program, which appends the Mod struct.
template <typename T, bool kGrad, bool kDropout, typename Mod>
__global__ void __launch_bounds__(128) attn_bwd_rows_mod(const ModParams<BwdParams, Mod> p) {
  bwd_rows<T, kGrad, kDropout, Mod>(p, p.aux);
}

// The statistics of flash_bwd_sm90.cu for a packed batch (its kVarlen instantiations): per query head h, sequence b's
// rows occupy columns stat_col_b ... stat_col_b + L_b − 1 of the (2·Hq, ld) statistics, stat_col_b = ⌊(q0_b +
// b·block_m) / block_m⌋·block_m (sm90/bwd_params.cuh: BwdSeq); column c holds lse·log2(e) (row h) and D = Σ dO∘O (row
// Hq + h) of packed row q0_b + c − stat_col_b, and +inf / 0 on the columns no sequence covers. A column's sequence is
// found by binary search over the stat_col_b (non-decreasing in b). dout and o: (total_q, Hq, head_dim_v) rows,
// lse: (Hq, total_q). Threads as attn_bwd_delta_padded's (row_threads per column).
struct BwdVarlenStatsParams {
  const void* dout;
  const void* o;
  const float* lse;
  float* stats;              // (2·Hq, ld): lse·log2(e) rows, then D rows
  const int* cu_seqlens_q;   // (B + 1,)
  long long batch, num_heads, total_q, ld, head_dim_v, block_m, row_threads;
};

__device__ __forceinline__ int varlen_stat_col(const BwdVarlenStatsParams& p, int b) {
  const int q0 = min(max(p.cu_seqlens_q[b], 0), static_cast<int>(p.total_q));
  return (q0 + b * static_cast<int>(p.block_m)) / static_cast<int>(p.block_m) * static_cast<int>(p.block_m);
}

template <typename T>
__global__ void __launch_bounds__(256) attn_bwd_delta_varlen(const BwdVarlenStatsParams p) {
  const int per_row = static_cast<int>(p.row_threads);
  const long long idx = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / per_row;  // h·ld + c
  const int sub = threadIdx.x % per_row;
  const bool live = idx < p.num_heads * p.ld;
  const long long h = idx / p.ld, c = idx % p.ld;
  long long row = -1;  // the packed row of column c, or -1 (padding)
  if (live) {
    int lo = 0, hi = static_cast<int>(p.batch) - 1;  // the last sequence b with stat_col_b <= c
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (varlen_stat_col(p, mid) <= c) lo = mid; else hi = mid - 1;
    }
    const int total = static_cast<int>(p.total_q);
    const int q0 = min(max(p.cu_seqlens_q[lo], 0), total);
    const int L = min(max(p.cu_seqlens_q[lo + 1] - q0, 0), total - q0);
    const long long i = c - varlen_stat_col(p, lo);
    if (p.batch > 0 && i >= 0 && i < L) row = q0 + i;
  }
  float acc = 0.f;
  if (row >= 0) {
    const long long off = (row * p.num_heads + h) * p.head_dim_v;
    acc = partial_dot(static_cast<const T*>(p.dout) + off, static_cast<const T*>(p.o) + off, p.head_dim_v, sub,
                      per_row);
  }
  for (int off = per_row / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (live && sub == 0) {
    const float lse = row >= 0 ? p.lse[h * p.total_q + row] : -inf();
    p.stats[h * p.ld + c] = lse == -inf() ? inf() : lse * kLog2e;
    p.stats[(p.num_heads + h) * p.ld + c] = acc;
  }
}

}  // namespace cupy_attn
