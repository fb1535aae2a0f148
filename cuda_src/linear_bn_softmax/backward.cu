// Fused Linear -> BatchNorm1d -> scale -> softmax, backward of the part after the GEMM.
//
// Math (forward, linear_bn_softmax.cu: y = x·Wᵀ without the Linear bias, ŷ = (y - mu)·invstd, z = scale·(γ·ŷ + β),
// out = softmax(z) over features; gradients for an output gradient dout):
//   delta_n = Σ_f dout[n, f]·out[n, f] / S_n,  S_n = Σ_f out[n, f]             bwd_row_dot
//   dz      = out ∘ (dout - delta_n)                                           (softmax backward)
//   A_f     = Σ_n dz[n, f],   B_f = Σ_n dz[n, f]·ŷ[n, f]                       bwd_columns, pass 1
//   dβ_f = scale_f·A_f,  dγ_f = scale_f·B_f,  dscale_f = γ_f·B_f + β_f·A_f     (Σ_f dscale_f for a one-element scale)
//   dy      = c_f·(dz - A_f/N - ŷ·B_f/N)   batch statistics (training, or no running stats)
//             c_f·dz                        running statistics (eval),   c_f = γ_f·scale_f·invstd_f   bwd_columns, pass 2
//   dbias_f = Σ_n dy[n, f] = 0 with batch statistics (Σ_n ŷ = 0: written as 0), c_f·A_f with running statistics
// then dx = dy·W and dW = dyᵀ·x by cuBLAS (cupy_attn/linear_bn_softmax/backward.py). The BatchNorm part is the
// standard training backward (Ioffe & Szegedy 2015, §3) with BatchNorm's output gradient scale·dz.
// S_n is 1 in exact arithmetic; the stored out (rounded to T) sums to 1 ± ~2^-9 in bf16. Dividing by it makes dz the
// softmax backward at the distribution out/S_n, so that Σ_f dz = 0 per row holds as it does exactly: otherwise every
// row adds delta_n·(1 - S_n)·ū_n to a one-element scale's gradient Σ_{n,f} dz·(γ·ŷ + β), ū_n = Σ_f out·(γ·ŷ + β)
// the row's softmax-weighted logit (large where the row is peaked), and that term dominated its error: bf16, eval,
// (70, 40, 1000), the float64 sum from the same stored y and out was 0.70 off with it, 0.053 without (of which 0.056
// is y's own rounding to bf16, which torch's Linear output has too). The other gradients do not move (median error
// over 48 random cases the same to 1%); bench/experiments/linear_bn_softmax/lbs_dscale_accuracy.py has the numbers.
//
// What the forward kept (no GEMM is recomputed): out, y (the GEMM result it normalized, in T), and rows 0 (mu) and 4
// (invstd) of its Affine. ŷ is recomputed from y in fp32 exactly as the forward formed it. Recovering ŷ from out
// instead (log out + lse, minus β, over γ) would be cheaper in memory but divides by γ and loses every probability
// that underflowed; y costs one (N, F) buffer in T, which torch's own autograd also keeps (Linear's output).
//
// Kernels:
//   bwd_row_dot<T, kThreads, kVec>: one block per row (grid-stride), delta_n = Σ_f dout·out / Σ_f out in fp32, written
//     to an (N,) fp32 scratch. Block 0 also zeroes the counter bwd_columns' last block uses.
//   bwd_columns<T, kVec, kColThreads, kThreads>: column_stats' tile: a block owns a strip of kVec·kColThreads
//     features over all N rows, kColThreads threads across the strip and kThreads / kColThreads row groups deep.
//     Pass 1 accumulates A and B in registers, kUnroll rows of (dout, out, y) 16-byte loads in flight per thread,
//     then reduces them across row groups (shuffles, then shared memory) in a fixed order: deterministic, no
//     atomics. Threads t < kStrip then write feature f's dγ, dβ, dscale (or its term of a one-element scale's sum) and
//     dbias. Pass 2 re-reads the strip (from L2 for the most part) and writes dy. A one-element scale's gradient
//     Σ_f dscale_f is summed, in a fixed order, by the block that finishes last (a fenced atomic counter).
// Accumulation: fp32 throughout; dy stored in T (the dtype the GEMMs read); the per-feature gradients in each
// parameter's own dtype (fp32 BatchNorm parameters next to fp16 activations are allowed, as in the forward).
//
// History: bench/notes/kernels_linear_bn_softmax.md.
#include "common/types.cuh"
#include "common/reduce.cuh"
#include "linear_bn_softmax/common.cuh"

namespace cupy_attn {
namespace lbs {

enum BwdFlag : int {
  kBatchStats = 1,   // the forward normalized with batch statistics: dy gets the -A/N - ŷ·B/N terms, dbias = 0
};

// One backward launch's arguments, passed by value (the launcher builds the same layout as a NumPy structured scalar).
struct BwdParams {
  void* dy;                     // (N, F) T, row-major, contiguous: gradient of y, read by the GEMMs; null = not needed
  void* dbias;                  // (F,) T (the Linear bias has x's dtype) or null
  void* dgamma;                 // (F,) in gamma_t or null
  void* dbeta;                  // (F,) in beta_t or null
  void* dscale;                 // (F,) (scale_stride 1) or one element (scale_stride 0), in scale_t, or null
  float* delta;                 // (N,) fp32 scratch: rowsum(dout ∘ out), written by bwd_row_dot
  float* dscale_partial;        // (F,) fp32 scratch: dscale_f before the sum over f (one-element scale)
  unsigned* counter;            // one word of scratch: blocks of bwd_columns finished (zeroed by bwd_row_dot)
  const void* dout;             // (N, F) T, row-major, contiguous: the output gradient
  const void* out;              // (N, F) T: the forward's output
  const void* y;                // (N, F) T: the forward's bias-free GEMM result
  const float* stats;           // (5, F) fp32: the forward's Affine; row 0 mu, row 4 invstd
  const void* gamma;            // (F,) BatchNorm weight or null (affine=False: 1)
  const void* beta;             // (F,) BatchNorm bias or null (0)
  const void* scale;            // (1,) or (F,): element f at f · scale_stride
  long long n_rows, n_cols;     // N, F
  long long scale_stride;       // 0 for a one-element scale, 1 for (F,)
  int gamma_t, beta_t, scale_t; // DtypeCode of each vector
  int flags;                    // BwdFlag bits
};
// Layout asserted against _BWD_PARAMS in cupy_attn/linear_bn_softmax/backward.py when compiled (KernelFamily.structs).

// Affine row of invstd in stats (AFFINE_INVSTD in launch.py); mu is row 0.
constexpr int kInvstdRow = 4;

// ---------------------------------------------------------------------------------------------------------------------
// delta_n = Σ_f dout[n, f]·out[n, f] / Σ_f out[n, f] for every row n (see the header: the stored out sums to 1 only
// up to its rounding); one block per row, kVec-element loads (F % kVec == 0).
template <typename T, int kThreads, int kVec>
__global__ void __launch_bounds__(kThreads) bwd_row_dot(const BwdParams p) {
  constexpr int kWarps = kThreads / 32;
  __shared__ float scratch[2][kWarps];
  const long long N = p.n_rows, F = p.n_cols;
  const T* dout = static_cast<const T*>(p.dout);
  const T* out = static_cast<const T*>(p.out);
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.counter = 0u;  // bwd_columns runs after this kernel on the stream
  for (long long row = blockIdx.x; row < N; row += gridDim.x) {
    float acc = 0.f, sum = 0.f;
    #pragma unroll 4
    for (long long col0 = static_cast<long long>(threadIdx.x) * kVec; col0 < F; col0 += kThreads * kVec) {
      float g[kVec], o[kVec];
      load_vec<T, kVec>(dout + row * F + col0, g);
      load_vec<T, kVec>(out + row * F + col0, o);
      #pragma unroll
      for (int v = 0; v < kVec; ++v) {
        acc = fmaf(g[v], o[v], acc);
        sum += o[v];
      }
    }
    // Both sums in one block reduction: warps, then thread 0 over the warps' partials in a fixed order.
    acc = warp_reduce<32>(acc, SumOp{});
    sum = warp_reduce<32>(sum, SumOp{});
    __syncthreads();  // the previous row's partials have been read
    if (threadIdx.x % 32 == 0) {
      scratch[0][threadIdx.x / 32] = acc;
      scratch[1][threadIdx.x / 32] = sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      acc = scratch[0][0];
      sum = scratch[1][0];
      #pragma unroll
      for (int w = 1; w < kWarps; ++w) {
        acc += scratch[0][w];
        sum += scratch[1][w];
      }
      p.delta[row] = acc / sum;
    }
  }
}

// dz and ŷ of kVec columns of one row, in fp32, from the raw (packed) loads.
template <typename T, int kVec>
__device__ __forceinline__ void dz_yhat(const Raw<T, kVec>& g_raw, const Raw<T, kVec>& o_raw, const Raw<T, kVec>& y_raw,
                                        float delta, const float (&mu)[kVec], const float (&invstd)[kVec],
                                        float (&dz)[kVec], float (&yh)[kVec]) {
  float g[kVec], o[kVec], y[kVec];
  unpack<T, kVec>(g_raw, g);
  unpack<T, kVec>(o_raw, o);
  unpack<T, kVec>(y_raw, y);
  #pragma unroll
  for (int v = 0; v < kVec; ++v) {
    dz[v] = o[v] * (g[v] - delta);
    yh[v] = (y[v] - mu[v]) * invstd[v];
  }
}

// body(row, dz, ŷ) for the rows rg, rg + kRowGroups, ... < N of the kVec columns at col0: kUnroll rows' loads of
// dout, out, y and delta issued together before any is used.
template <typename T, int kVec, int kRowGroups, int kUnroll, typename Body>
__device__ __forceinline__ void for_each_row(const BwdParams& p, int rg, long long col0, const float (&mu)[kVec],
                                             const float (&invstd)[kVec], Body body) {
  const T* dout = static_cast<const T*>(p.dout);
  const T* out = static_cast<const T*>(p.out);
  const T* y = static_cast<const T*>(p.y);
  const long long N = p.n_rows, F = p.n_cols;
  long long row = rg;
  for (; row + (kUnroll - 1) * kRowGroups < N; row += kUnroll * kRowGroups) {
    Raw<T, kVec> g[kUnroll], o[kUnroll], yr[kUnroll];
    float d[kUnroll];
    #pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const long long r = row + u * kRowGroups;
      g[u] = load_raw<T, kVec>(dout + r * F + col0);
      o[u] = load_raw<T, kVec>(out + r * F + col0);
      yr[u] = load_raw<T, kVec>(y + r * F + col0);
      d[u] = p.delta[r];
    }
    #pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float dz[kVec], yh[kVec];
      dz_yhat<T, kVec>(g[u], o[u], yr[u], d[u], mu, invstd, dz, yh);
      body(row + u * kRowGroups, dz, yh);
    }
  }
  for (; row < N; row += kRowGroups) {  // the last < kUnroll rows of this thread
    float dz[kVec], yh[kVec];
    dz_yhat<T, kVec>(load_raw<T, kVec>(dout + row * F + col0), load_raw<T, kVec>(out + row * F + col0),
                     load_raw<T, kVec>(y + row * F + col0), p.delta[row], mu, invstd, dz, yh);
    body(row, dz, yh);
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// Column sums A, B -> per-feature gradients, then dy. Grid: ceil(F / (kVec·kColThreads)) blocks, each over all N rows
// of its strip. Every thread reaches every barrier (no early return: the last block's sum needs all blocks).
template <typename T, int kVec, int kColThreads, int kThreads>
__global__ void __launch_bounds__(kThreads) bwd_columns(const BwdParams p) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kStrip = kVec * kColThreads;
  constexpr int kRowGroups = kThreads / kColThreads;
  constexpr int kUnroll = 4;  // rows of loads in flight per thread: 4 × 3 × 16 bytes
  static_assert(32 % kColThreads == 0, "a row segment must not straddle warps");
  static_assert(kStrip <= kThreads, "one finalizing thread per feature of the strip");
  __shared__ float s_a[kWarps][kStrip];
  __shared__ float s_b[kWarps][kStrip];
  __shared__ float s_c[kStrip], s_ea[kStrip], s_eb[kStrip];
  __shared__ float s_red[kWarps];
  __shared__ int s_last;

  const long long N = p.n_rows, F = p.n_cols;
  const unsigned ct = threadIdx.x % kColThreads;
  const int rg = threadIdx.x / kColThreads;
  // Unsigned index arithmetic: with a signed ct, NVVM split dy's 16-byte stores into four 4-byte ones (PTX, NVRTC 12.9).
  const long long col0 = static_cast<long long>(blockIdx.x * kStrip + ct * kVec);
  const bool active = col0 < F;  // F % kVec == 0 on the vector path: a vector is entirely inside or outside
  // Thread t < kStrip finalizes feature f: its parameters are loaded now, their latency hidden behind pass 1.
  const long long f = static_cast<long long>(blockIdx.x) * kStrip + threadIdx.x;
  const bool finalizes = threadIdx.x < kStrip && f < F;
  float gamma_f = 1.f, beta_f = 0.f, scale_f = 1.f, invstd_f = 0.f;
  if (finalizes) {
    gamma_f = load_param(p.gamma, p.gamma_t, f, 1.f);
    beta_f = load_param(p.beta, p.beta_t, f, 0.f);
    scale_f = load_param(p.scale, p.scale_t, f * p.scale_stride, 1.f);
    invstd_f = p.stats[kInvstdRow * F + f];
  }

  float mu[kVec], invstd[kVec], a[kVec], b[kVec];
  #pragma unroll
  for (int v = 0; v < kVec; ++v) mu[v] = invstd[v] = a[v] = b[v] = 0.f;
  if (active) {
    load_vec<float, kVec>(p.stats + col0, mu);
    load_vec<float, kVec>(p.stats + kInvstdRow * F + col0, invstd);
    for_each_row<T, kVec, kRowGroups, kUnroll>(p, rg, col0, mu, invstd,
        [&](long long, const float (&dz)[kVec], const float (&yh)[kVec]) {
          #pragma unroll
          for (int v = 0; v < kVec; ++v) {
            a[v] += dz[v];
            b[v] = fmaf(dz[v], yh[v], b[v]);
          }
        });
  }

  // Lanes kColThreads apart hold the same columns (other rows): sum them with shuffles, then the warps' partials.
  #pragma unroll
  for (int off = kColThreads; off < 32; off *= 2) {
    #pragma unroll
    for (int v = 0; v < kVec; ++v) {
      a[v] += __shfl_xor_sync(0xffffffffu, a[v], off);
      b[v] += __shfl_xor_sync(0xffffffffu, b[v], off);
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane < kColThreads) {
    #pragma unroll
    for (int v = 0; v < kVec; ++v) {
      s_a[warp][ct * kVec + v] = a[v];
      s_b[warp][ct * kVec + v] = b[v];
    }
  }
  __syncthreads();

  if (threadIdx.x < kStrip) {
    float a_f = 0.f, b_f = 0.f;
    #pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      a_f += s_a[w][threadIdx.x];
      b_f += s_b[w][threadIdx.x];
    }
    const bool batch_stats = p.flags & kBatchStats;
    const float c = gamma_f * scale_f * invstd_f;
    const float inv_n = 1.f / static_cast<float>(N);
    // dy = c·dz - ea - eb·ŷ: the batch-statistics terms pre-multiplied by c (0 for padding columns and in eval).
    s_c[threadIdx.x] = finalizes ? c : 0.f;
    s_ea[threadIdx.x] = finalizes && batch_stats ? c * a_f * inv_n : 0.f;
    s_eb[threadIdx.x] = finalizes && batch_stats ? c * b_f * inv_n : 0.f;
    if (finalizes) {
      if (p.dbeta != nullptr) store_param(p.dbeta, p.beta_t, f, scale_f * a_f);
      if (p.dgamma != nullptr) store_param(p.dgamma, p.gamma_t, f, scale_f * b_f);
      if (p.dscale != nullptr) {
        const float ds = fmaf(gamma_f, b_f, beta_f * a_f);
        if (p.scale_stride != 0) {
          store_param(p.dscale, p.scale_t, f, ds);
        } else {
          p.dscale_partial[f] = ds;
        }
      }
      if (p.dbias != nullptr) static_cast<T*>(p.dbias)[f] = from_float<T>(batch_stats ? 0.f : c * a_f);
    }
  }
  __syncthreads();

  if (p.dy != nullptr && active) {
    float c[kVec], ea[kVec], eb[kVec];
    #pragma unroll
    for (int v = 0; v < kVec; ++v) {
      c[v] = s_c[ct * kVec + v];
      ea[v] = s_ea[ct * kVec + v];
      eb[v] = s_eb[ct * kVec + v];
    }
    T* dy = static_cast<T*>(p.dy);
    for_each_row<T, kVec, kRowGroups, kUnroll>(p, rg, col0, mu, invstd,
        [&](long long row, const float (&dz)[kVec], const float (&yh)[kVec]) {
          float d[kVec];
          #pragma unroll
          for (int v = 0; v < kVec; ++v) d[v] = fmaf(c[v], dz[v], -fmaf(eb[v], yh[v], ea[v]));
          store_vec<T, kVec>(dy + row * F + col0, d);
        });
  }

  // One-element scale: the last block to finish sums the per-feature terms (fixed order, so deterministic).
  if (p.dscale != nullptr && p.scale_stride == 0) {
    __threadfence();  // this thread's dscale_partial store is visible device-wide before the block counts itself
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(p.counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (s_last) {
      __threadfence();
      float acc = 0.f;
      for (long long i = threadIdx.x; i < F; i += kThreads) acc += __ldcg(p.dscale_partial + i);  // not via L1
      acc = group_reduce<kThreads>(acc, SumOp{}, s_red);
      if (threadIdx.x == 0) store_param(p.dscale, p.scale_t, 0, acc);
    }
  }
}

}  // namespace lbs
}  // namespace cupy_attn
