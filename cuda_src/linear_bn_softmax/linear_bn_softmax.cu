// Fused Linear -> BatchNorm1d -> scale -> softmax, the part after the GEMM.
//
// Math (y = x·Wᵀ of shape (N, F), computed by cuBLAS *without* the Linear bias, see below):
//   training:  mu_f = mean_n y[n, f],  var_f = mean_n (y[n, f] - mu_f)²   (biased, as BatchNorm normalizes with)
//   eval:      mu_f = running_mean_f - bias_f,  var_f = running_var_f
//   a_f = gamma_f · scale_f / sqrt(var_f + eps),   d_f = beta_f · scale_f
//   out[n, :] = softmax_f(a_f · (y[n, f] - mu_f) + d_f)
// For fp32, (y - mu) is kept as a subtraction: the one-FMA form a·y + b, b = d - a·mu, cancels when |mu| >> std
// (small batches, large offsets): 4.7x torch's fp32 error on a 3-row batch at F = 20000. For fp16/bf16 the row
// kernel uses the one-FMA form: its cancellation error |a·mu|·2⁻²⁴ is far below y's own rounding |y|·2⁻¹¹ (|y| ≈
// |mu| there), and it keeps two values per column in registers instead of three.
// The Linear bias never enters the GEMM: in training BatchNorm subtracts the batch mean, which absorbs any per-feature
// constant exactly, so bias only shifts the running_mean update (mean of y + bias); in eval it folds into mu_f.
// Running stats (training): running_mean = (1-m)·running_mean + m·(mu + bias); running_var = (1-m)·running_var +
// m·var·N/(N-1) (unbiased), m = momentum, or 1/(num_batches_tracked + 1) for momentum=None (cumulative average);
// num_batches_tracked += 1.
//
// Algorithm: two kernels after the GEMM, each one pass over the (N, F) activations y, which sit mostly in L2 right
// after the GEMM (1024 × 8192 fp16 = 16 MB of the H200's 50 MB L2). y is a per-stream workspace (or the output
// itself, for large y): the row kernel reads y and writes out, in place when they alias.
//   column_stats:  (training) per-feature mean / M2 in fp32. Each thread takes 8 rows at a time (all loads in
//                  flight), reduces them to a batch mean and M2 in registers and merges that into its running
//                  (count, mean, M2) with Chan et al.'s pairwise formula; the partials then merge across lanes
//                  (shuffles) and warps (shared memory) the same way. Stable for any |mean|/std ratio, unlike
//                  sum/sum-of-squares. The same block folds the statistics into Affine (mu, a, d, b, invstd), a,
//                  d and b pre-multiplied by log2(e), and updates the running stats in place; the per-feature
//                  parameters it needs are loaded before the main loop. (mu, invstd) are what the backward reads.
//   fold_running_stats: (eval) the same fold from the running stats, one thread per feature; reads no activations.
//   softmax_rows:  the thread's Affine entries loaded once into registers, then a grid-stride loop over kRows rows
//                  at a time: s = a·y + b (16-bit) or a·(y - mu) + d (fp32), in base-2 units, block max, exp2,
//                  block sum, scale, store. 16-bit types load the next kRows rows (packed) while the current ones
//                  are reduced and written.
//   softmax_rows_streaming: rows too long for registers (F > 8192): online (max, sum) in a first pass, then a
//                  second pass writes; both passes read y from L2/HBM.
// Accumulation: fp32 throughout (statistics, affine, exp, sums); storage in the input dtype T.
//
// Thread mapping and tile sizes (the launcher reads the same tables, cupy_attn/linear_bn_softmax/launch.py):
//   column_stats<T, kVec, kColThreads, kThreads>: kColThreads threads across a strip of kVec·kColThreads columns,
//     kThreads / kColThreads rows deep. 16-byte loads (kVec = 8 for 16-bit types, 4 for fp32); F = 8192 fp16 takes
//     (8, 4, 256): 32-column strips of 64-byte row segments, 256 blocks, several resident per SM, no cross-block
//     reduction, so the block that owns a strip also finalizes it.
//   softmax_rows<T, kThreads, kVec, kChunks, kRows>: kThreads threads per row, each owning kChunks vectors of kVec
//     elements (kVec = 1 when F is not a multiple of the vector width). F = 8192 fp16/bf16 takes 256 threads × 32
//     elements, one row per iteration: a, b (64 floats), the row (32) and the next row packed (16) fit 128
//     registers, so two blocks share an SM and one block's loads overlap the other's reductions. fp32 takes 512 ×
//     16 elements, two rows per iteration (mu, a, d and two rows: 80 floats). The Affine is read once per block,
//     not per row (96 KB of L2 traffic per 16 KB row otherwise).
//
// History and measurements: bench/notes/kernels_linear_bn_softmax.md.
#include "common/types.cuh"
#include "common/reduce.cuh"
#include "linear_bn_softmax/common.cuh"

namespace cupy_attn {
namespace lbs {

enum Flag : int {
  kUpdateRunning = 1,   // training with running stats: update running_mean / running_var in place
  kCumulative = 2,      // momentum=None: factor 1 / (num_batches_tracked + 1)
  kCountBatch = 4,      // increment num_batches_tracked (done by softmax_rows, after column_stats has read it)
};

// One launch's arguments, passed by value (the launcher builds the same layout as a NumPy structured scalar).
struct Params {
  void* out;                        // (N, F) T, row-major, contiguous: the softmax output
  const void* y;                    // (N, F) T, the GEMM result (a workspace, or out itself: the kernels work in place)
  float* affine;                    // (5, F) rows mu, a·log2e, d·log2e, b = d - a·mu, invstd (structure of arrays),
                                    // written by column_stats / fold_running_stats, rows 0-3 read by the row kernels,
                                    // rows 0 and 4 by the backward (cuda_src/linear_bn_softmax/backward.cu)
  const void* bias;                 // (F,) Linear bias or null
  const void* gamma;                // (F,) BatchNorm weight or null (affine=False)
  const void* beta;                 // (F,) BatchNorm bias or null
  const void* scale;                // (1,) or (F,): element f at f · scale_stride
  void* running_mean;               // (F,) or null (track_running_stats=False)
  void* running_var;                // (F,) or null
  long long* num_batches_tracked;   // (1,) int64 or null
  long long n_rows, n_cols;         // N, F
  long long scale_stride;           // 0 for a (1,) scale, 1 for (F,)
  int bias_t, gamma_t, beta_t, scale_t, stats_t;  // DtypeCode of each vector (stats_t: running_mean and running_var)
  int flags;                        // Flag bits
  float eps, momentum;
};
// Layout asserted against _PARAMS in cupy_attn/linear_bn_softmax/launch.py when compiled (KernelFamily.structs).

// The per-feature parameters one feature's fold and running-stat update read, loaded together: column_stats issues
// these loads before its main loop, so their L2/HBM latency hides behind it instead of adding two dependent round
// trips at the end (the fold's, then the running stats').
struct Feature {
  float gamma, beta, scale, bias, running_mean, running_var;
};

__device__ __forceinline__ Feature load_feature(const Params& p, long long f) {
  Feature x;
  x.gamma = load_param(p.gamma, p.gamma_t, f, 1.f);
  x.beta = load_param(p.beta, p.beta_t, f, 0.f);
  x.scale = load_param(p.scale, p.scale_t, f * p.scale_stride, 1.f);
  x.bias = load_param(p.bias, p.bias_t, f, 0.f);
  x.running_mean = load_param(p.running_mean, p.stats_t, f, 0.f);
  x.running_var = load_param(p.running_var, p.stats_t, f, 1.f);
  return x;
}

// Affine (mu, a, d, b, invstd) of feature f, a, d, b in log2 units, from the bias-free mean and the variance BatchNorm
// normalizes with.
// 1/sqrtf, not rsqrtf: rsqrt.approx's 2-ulp error scales a whole column's logits (measured 4.5x torch's fp32 error
// at |logit| ~ 3000); correctly rounded, as torch computes invstd.
__device__ __forceinline__ void fold_affine(const Params& p, long long f, float mu, float var, const Feature& x) {
  const float invstd = 1.f / sqrtf(var + p.eps);
  const float s = x.scale * kLog2e;
  const long long F = p.n_cols;
  const float a = x.gamma * invstd * s;
  const float d = x.beta * s;
  p.affine[f] = mu;
  p.affine[F + f] = a;
  p.affine[2 * F + f] = d;
  p.affine[3 * F + f] = fmaf(-a, mu, d);  // b of the one-FMA form a·y + b, read by the 16-bit row kernels only
  p.affine[4 * F + f] = invstd;           // for the backward: ŷ = (y - mu) · invstd
}

// 2^x with subnormal results flushed to zero: one MUFU.EX2, where exp2f (ex2.approx.f32) adds a scaling around it
// for subnormal results. Probabilities below 2^-126 of a row's maximum are zero in fp16 anyway and, in bf16/fp32,
// an absolute error under 1.2e-38.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float affine_apply(const Params& p, long long f, float y) {
  return fmaf(p.affine[p.n_cols + f], y - p.affine[f], p.affine[2 * p.n_cols + f]);
}

// Chan et al.: merge (nb, mb, m2b) into (n, mean, m2) for kVec columns that share one row count.
template <int kVec>
__device__ __forceinline__ void chan_merge(float& n, float (&mean)[kVec], float (&m2)[kVec], float nb,
                                           const float (&mb)[kVec], const float (&m2b)[kVec]) {
  const float nab = n + nb;
  if (nab == 0.f) return;
  const float wb = nb / nab;
  #pragma unroll
  for (int v = 0; v < kVec; ++v) {
    const float d = mb[v] - mean[v];
    mean[v] += d * wb;
    m2[v] += m2b[v] + d * d * n * wb;
  }
  n = nab;
}

// ---------------------------------------------------------------------------------------------------------------------
// Per-feature batch statistics -> Affine and the running-stat update. Grid: ceil(F / (kVec·kColThreads)) blocks.
// Each thread takes kUnroll rows at a time (all loads in flight together), reduces them to a batch mean and M2 in
// registers (two passes over registers: exact within the batch), and Chan-merges that batch into its running
// (n, mean, M2): one division per kUnroll rows instead of one per row (v3's per-row Welford was instruction-bound).
template <typename T, int kVec, int kColThreads, int kThreads>
__global__ void __launch_bounds__(kThreads, 1) column_stats(const Params p) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kStrip = kVec * kColThreads;
  constexpr int kRowGroups = kThreads / kColThreads;
  constexpr int kUnroll = 8;  // loads in flight per thread before the dependent reduction
  static_assert(32 % kColThreads == 0, "a row segment must not straddle warps");
  __shared__ float s_n[kWarps];
  __shared__ float s_mean[kWarps][kStrip];
  __shared__ float s_m2[kWarps][kStrip];

  const T* y = static_cast<const T*>(p.y);
  const long long N = p.n_rows, F = p.n_cols;
  const int ct = threadIdx.x % kColThreads;
  const int rg = threadIdx.x / kColThreads;
  const long long col0 = static_cast<long long>(blockIdx.x) * kStrip + ct * kVec;
  // Thread t < kStrip finalizes feature f: its parameters are loaded now (see Feature).
  const long long f = static_cast<long long>(blockIdx.x) * kStrip + threadIdx.x;
  const bool finalizes = threadIdx.x < kStrip && f < F;
  Feature feat{};
  float batches = 1.f;  // num_batches_tracked + 1, for momentum=None
  pdl_launch_dependents();  // the row kernel may be launched now: it waits for this grid before it reads anything
  if (finalizes) {  // written by earlier calls' kernels, all complete before the GEMM started: no wait needed
    feat = load_feature(p, f);
    if (p.flags & kCumulative) batches = static_cast<float>(*p.num_batches_tracked + 1);
  }
  pdl_wait();  // y: the GEMM's output

  float n = 0.f, mean[kVec], m2[kVec];
  #pragma unroll
  for (int v = 0; v < kVec; ++v) mean[v] = m2[v] = 0.f;

  if (col0 < F) {  // F % kVec == 0 on the vector path: a vector is entirely inside or outside
    long long row = rg;
    for (; row + (kUnroll - 1) * kRowGroups < N; row += kUnroll * kRowGroups) {
      Raw<T, kVec> buf[kUnroll];
      #pragma unroll
      for (int u = 0; u < kUnroll; ++u) buf[u] = load_raw<T, kVec>(y + (row + u * kRowGroups) * F + col0);
      float bm[kVec], bq[kVec], yv[kUnroll][kVec];
      #pragma unroll
      for (int u = 0; u < kUnroll; ++u) unpack<T, kVec>(buf[u], yv[u]);
      #pragma unroll
      for (int v = 0; v < kVec; ++v) {
        float sum = 0.f;
        #pragma unroll
        for (int u = 0; u < kUnroll; ++u) sum += yv[u][v];
        bm[v] = sum * (1.f / kUnroll);
        bq[v] = 0.f;
        #pragma unroll
        for (int u = 0; u < kUnroll; ++u) bq[v] = fmaf(yv[u][v] - bm[v], yv[u][v] - bm[v], bq[v]);
      }
      chan_merge<kVec>(n, mean, m2, static_cast<float>(kUnroll), bm, bq);
    }
    for (; row < N; row += kRowGroups) {  // the last < kUnroll rows: one-row batches
      float yv[kVec], zero[kVec];
      load_vec<T, kVec>(y + row * F + col0, yv);
      #pragma unroll
      for (int v = 0; v < kVec; ++v) zero[v] = 0.f;
      chan_merge<kVec>(n, mean, m2, 1.f, yv, zero);
    }
  }

  // Lanes kColThreads apart hold the same columns (other rows): merge them with shuffles.
  #pragma unroll
  for (int off = kColThreads; off < 32; off *= 2) {
    float mb[kVec], m2b[kVec];
    const float nb = __shfl_xor_sync(0xffffffffu, n, off);
    #pragma unroll
    for (int v = 0; v < kVec; ++v) {
      mb[v] = __shfl_xor_sync(0xffffffffu, mean[v], off);
      m2b[v] = __shfl_xor_sync(0xffffffffu, m2[v], off);
    }
    chan_merge<kVec>(n, mean, m2, nb, mb, m2b);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane < kColThreads) {
    if (lane == 0) s_n[warp] = n;
    #pragma unroll
    for (int v = 0; v < kVec; ++v) {
      s_mean[warp][ct * kVec + v] = mean[v];
      s_m2[warp][ct * kVec + v] = m2[v];
    }
  }
  __syncthreads();
  if (!finalizes) return;

  // One thread per column merges the kWarps partials (serially) and finalizes the feature.
  float tn = s_n[0], tmean[1] = {s_mean[0][threadIdx.x]}, tm2[1] = {s_m2[0][threadIdx.x]};
  #pragma unroll
  for (int w = 1; w < kWarps; ++w) {
    const float mb[1] = {s_mean[w][threadIdx.x]}, m2b[1] = {s_m2[w][threadIdx.x]};
    chan_merge<1>(tn, tmean, tm2, s_n[w], mb, m2b);
  }
  const float mu = tmean[0];
  const float var = tm2[0] / static_cast<float>(N);
  fold_affine(p, f, mu, var, feat);

  if (p.flags & kUpdateRunning) {
    const float m = (p.flags & kCumulative) ? 1.f / batches : p.momentum;
    const float mean_y = mu + feat.bias;
    const float var_unbiased = tm2[0] / static_cast<float>(N - 1);
    store_param(p.running_mean, p.stats_t, f, (1.f - m) * feat.running_mean + m * mean_y);
    store_param(p.running_var, p.stats_t, f, (1.f - m) * feat.running_var + m * var_unbiased);
  }
}

// Eval: Affine from the running stats (shifted by the bias the GEMM left out). One thread per feature.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) fold_running_stats(const Params p) {
  pdl_launch_dependents();
  pdl_wait();
  const long long f = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  if (f >= p.n_cols) return;
  const Feature feat = load_feature(p, f);
  fold_affine(p, f, feat.running_mean - feat.bias, feat.running_var, feat);
}

// kRows values reduced across the block at once; every thread gets the results. One barrier per call: callers
// alternate between two scratch buffers, so the buffer written here was last read two reductions ago, with a
// barrier in between.
template <int kThreads, int kRows, typename Op>
__device__ __forceinline__ void block_reduce_rows(float (&x)[kRows], Op op, float* scratch) {
  constexpr int kWarps = kThreads / 32;
  #pragma unroll
  for (int r = 0; r < kRows; ++r) x[r] = warp_reduce<32>(x[r], op);
  if constexpr (kWarps > 1) {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
      #pragma unroll
      for (int r = 0; r < kRows; ++r) scratch[warp * kRows + r] = x[r];
    }
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float acc = scratch[r];
      #pragma unroll
      for (int w = 1; w < kWarps; ++w) acc = op(acc, scratch[w * kRows + r]);
      x[r] = acc;
    }
  }
}

__device__ __forceinline__ void count_batch(const Params& p) {
  if ((p.flags & kCountBatch) && blockIdx.x == 0 && threadIdx.x == 0) *p.num_batches_tracked += 1;
}

// ---------------------------------------------------------------------------------------------------------------------
// Affine + row softmax, registers only. Requires F <= kThreads·kVec·kChunks and F % kVec == 0. Reads p.y, writes
// p.out (they may alias).
// 16-bit T: s = a·y + b (Affine rows 1 and 3), and the next kRows rows are loaded, still packed, while the current
// ones are reduced and written (software pipelining; the packed rows cost kRows·kChunks·kVec/2 registers).
// fp32: s = a·(y − mu) + d (rows 0–2), no prefetch. Why the forms differ: the one-FMA form loses |a·mu|·2⁻²⁴ to
// cancellation when |mu| >> std, which is far below a 16-bit y's own rounding (|y|·2⁻¹¹ with |y| ≈ |mu|) but
// measured 4.7x torch's error for fp32 inputs (see the header).
template <typename T, int kThreads, int kVec, int kChunks, int kRows>
__global__ void __launch_bounds__(kThreads) softmax_rows(const Params p) {
  constexpr bool kOneFma = sizeof(T) == 2;
  constexpr bool kPrefetch = sizeof(T) == 2 && kVec > 1;  // scalar loads (odd F) would need a register each
  constexpr int kMu = kOneFma ? 1 : kChunks;  // mu is not kept in the one-FMA form
  constexpr int kWarps = kThreads / 32;
  __shared__ float s_max[kWarps * kRows];
  __shared__ float s_sum[kWarps * kRows];
  T* out = static_cast<T*>(p.out);
  const T* y = static_cast<const T*>(p.y);
  const long long N = p.n_rows, F = p.n_cols;
  const long long row_stride = static_cast<long long>(gridDim.x) * kRows;
  pdl_wait();  // Affine and num_batches_tracked: column_stats / fold_running_stats

  // Columns of chunk c: [(c·kThreads + tid)·kVec, +kVec): consecutive threads read consecutive 16-byte vectors.
  float mu[kMu][kVec], a[kChunks][kVec], b[kChunks][kVec];
  #pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const long long col0 = static_cast<long long>(c * kThreads + threadIdx.x) * kVec;
    if (col0 < F) {  // structure of arrays: a warp reads 32 consecutive kVec-float vectors of each row
      load_vec<float, kVec>(p.affine + F + col0, a[c]);
      if constexpr (kOneFma) {
        load_vec<float, kVec>(p.affine + 3 * F + col0, b[c]);
      } else {
        load_vec<float, kVec>(p.affine + col0, mu[c]);
        load_vec<float, kVec>(p.affine + 2 * F + col0, b[c]);
      }
    } else {  // padding columns: s = -inf contributes exp2(-inf) = 0 and never wins the max
      #pragma unroll
      for (int v = 0; v < kVec; ++v) {
        a[c][v] = 0.f;
        b[c][v] = minus_inf();
        if constexpr (!kOneFma) mu[c][v] = 0.f;
      }
    }
  }
  count_batch(p);

  Raw<T, kVec> raw[kRows][kChunks];
  auto load_rows = [&](long long r0) {
    #pragma unroll
    for (int r = 0; r < kRows; ++r) {
      #pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const long long col0 = static_cast<long long>(c * kThreads + threadIdx.x) * kVec;
        // Assigned on every path: a conditional assignment would keep the previous rows' registers live.
        raw[r][c] = (r0 + r < N && col0 < F) ? load_raw<T, kVec>(y + (r0 + r) * F + col0) : Raw<T, kVec>{};
      }
    }
  };
  long long row0 = static_cast<long long>(blockIdx.x) * kRows;
  if (kPrefetch && row0 < N) load_rows(row0);
  for (; row0 < N; row0 += row_stride) {
    if (!kPrefetch) load_rows(row0);
    float s[kRows][kChunks][kVec];
    #pragma unroll
    for (int r = 0; r < kRows; ++r) {
      #pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const long long col0 = static_cast<long long>(c * kThreads + threadIdx.x) * kVec;
        float yv[kVec];
        if (row0 + r < N && col0 < F) {
          unpack<T, kVec>(raw[r][c], yv);
        } else {
          #pragma unroll
          for (int v = 0; v < kVec; ++v) yv[v] = 0.f;
        }
        #pragma unroll
        for (int v = 0; v < kVec; ++v) {
          if constexpr (kOneFma) {
            s[r][c][v] = fmaf(a[c][v], yv[v], b[c][v]);
          } else {
            s[r][c][v] = fmaf(a[c][v], yv[v] - mu[c][v], b[c][v]);
          }
        }
      }
    }
    if (kPrefetch && row0 + row_stride < N) load_rows(row0 + row_stride);  // raw is free again: next rows in flight
    float m[kRows];
    #pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m[r] = minus_inf();
      #pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        #pragma unroll
        for (int v = 0; v < kVec; ++v) m[r] = fmaxf(m[r], s[r][c][v]);
      }
    }
    block_reduce_rows<kThreads, kRows>(m, MaxOp{}, s_max);
    float l[kRows];
    #pragma unroll
    for (int r = 0; r < kRows; ++r) {
      l[r] = 0.f;
      #pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        #pragma unroll
        for (int v = 0; v < kVec; ++v) {
          s[r][c][v] = exp2_ftz(s[r][c][v] - m[r]);  // a row of -inf (or NaN) gives NaN, as torch.softmax does
          l[r] += s[r][c][v];
        }
      }
    }
    block_reduce_rows<kThreads, kRows>(l, SumOp{}, s_sum);
    #pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r >= N) continue;
      const float inv = 1.f / l[r];
      #pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const long long col0 = static_cast<long long>(c * kThreads + threadIdx.x) * kVec;
        if (col0 >= F) continue;
        float o[kVec];
        #pragma unroll
        for (int v = 0; v < kVec; ++v) o[v] = s[r][c][v] * inv;
        store_vec<T, kVec>(out + (row0 + r) * F + col0, o);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// Affine + row softmax for rows of any length: pass 1 keeps an online (max, sum) per thread, pass 2 writes.
// One row per block iteration (grid-stride); Affine read per element (L1/L2 hits). Reads p.y, writes p.out (may alias).
template <typename T, int kThreads, int kVec>
__global__ void __launch_bounds__(kThreads) softmax_rows_streaming(const Params p) {
  constexpr int kWarps = kThreads / 32;
  __shared__ float s_max[kWarps];
  __shared__ float s_sum[kWarps];
  const long long N = p.n_rows, F = p.n_cols;
  pdl_wait();
  count_batch(p);

  for (long long row = blockIdx.x; row < N; row += gridDim.x) {
    const T* y = static_cast<const T*>(p.y) + row * F;
    T* out = static_cast<T*>(p.out) + row * F;
    float m = minus_inf(), l = 0.f;
    for (long long col0 = static_cast<long long>(threadIdx.x) * kVec; col0 < F; col0 += kThreads * kVec) {
      float yv[kVec];
      load_vec<T, kVec>(y + col0, yv);
      #pragma unroll
      for (int v = 0; v < kVec; ++v) {
        const float s = affine_apply(p, col0 + v, yv[v]);
        if (s > m) {
          l = l * exp2f(m - s) + 1.f;
          m = s;
        } else if (!(s == minus_inf())) {  // -inf adds nothing (and -inf - -inf would be NaN); NaN propagates
          l += exp2f(s - m);
        }
      }
    }
    // Merge the threads' (m, l): M = max m_i, L = sum l_i · 2^(m_i - M); an empty thread (m_i = -inf) adds 0.
    float mm[1] = {m};
    block_reduce_rows<kThreads, 1>(mm, MaxOp{}, s_max);
    float ll[1] = {m == minus_inf() ? 0.f : l * exp2f(m - mm[0])};
    block_reduce_rows<kThreads, 1>(ll, SumOp{}, s_sum);
    const float inv = 1.f / ll[0];
    for (long long col0 = static_cast<long long>(threadIdx.x) * kVec; col0 < F; col0 += kThreads * kVec) {
      float e[kVec];
      load_vec<T, kVec>(y + col0, e);
      #pragma unroll
      for (int v = 0; v < kVec; ++v) e[v] = exp2f(affine_apply(p, col0 + v, e[v]) - mm[0]) * inv;
      store_vec<T, kVec>(out + col0, e);
    }
  }
}

}  // namespace lbs
}  // namespace cupy_attn
