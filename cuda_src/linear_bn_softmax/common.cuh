// Linear -> BatchNorm1d -> scale -> softmax: the vocabulary its forward (linear_bn_softmax.cu) and backward
// (backward.cu) kernels share: dtype codes of the per-feature vectors, packed 16-byte row loads and stores through
// fp32 registers, and scalar loads/stores of a per-feature vector of any of the three dtypes.
#pragma once
#include "common/types.cuh"
#include "common/pdl.cuh"

namespace cupy_attn {
namespace lbs {

// Element-type codes of the small per-feature vectors (they may be fp32 while x is fp16: mixed-precision modules).
enum DtypeCode : int { kAbsent = 0, kF32 = 1, kF16 = 2, kBF16 = 3 };

// -inf from its bits: NVRTC has no <math.h> INFINITY.
__device__ __forceinline__ float minus_inf() { return __int_as_float(static_cast<int>(0xff800000u)); }

template <typename T, int kN>
struct alignas(kN * sizeof(T)) VecN { T v[kN]; };

// Used only where one thread handles one feature (column_stats' finalize, fold_running_stats): inside the unrolled
// register loops of softmax_rows NVRTC unswitched the five runtime dtype switches, 4^5 = 1024 copies of the loop body
// (80 s compile, 330k lines of PTX per variant), and __noinline__ serialized the loads (v1 above).
// kN consecutive elements through fp32 registers as raw 32-bit words: no copies of __nv_bfloat16 class objects,
// which ptxas for sm_80 put on the stack (32 bytes spilled in softmax_rows_streaming<bf16, 512, 8>).
template <typename T> __device__ __forceinline__ float bits_to_float(unsigned short b);
template <> __device__ __forceinline__ float bits_to_float<__half>(unsigned short b) {
  return __half2float(__ushort_as_half(b));
}
template <> __device__ __forceinline__ float bits_to_float<__nv_bfloat16>(unsigned short b) {
  return __uint_as_float(static_cast<unsigned>(b) << 16);
}
template <typename T> __device__ __forceinline__ unsigned short float_to_bits(float x);
template <> __device__ __forceinline__ unsigned short float_to_bits<__half>(float x) {
  return __half_as_ushort(__float2half_rn(x));
}
template <> __device__ __forceinline__ unsigned short float_to_bits<__nv_bfloat16>(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// kN consecutive elements as loaded from memory, before conversion: 32-bit words holding two 16-bit elements each
// (kept packed while a load is in flight: 8 elements = 4 registers, half of their fp32 form), floats for fp32,
// a single 16-bit element for kN = 1.
template <typename T, int kN> struct RawOf { using type = VecN<unsigned, kN / 2>; };
template <typename T> struct RawOf<T, 1> { using type = VecN<unsigned short, 1>; };
template <int kN> struct RawOf<float, kN> { using type = VecN<float, kN>; };
template <> struct RawOf<float, 1> { using type = VecN<float, 1>; };
template <typename T, int kN> using Raw = typename RawOf<T, kN>::type;

// Two 16-bit elements of one word to fp32: bf16 by shifts alone, fp16 by the paired conversion.
template <typename T> __device__ __forceinline__ float2 word_to_float2(unsigned w);
template <> __device__ __forceinline__ float2 word_to_float2<__half>(unsigned w) {
  return __half22float2(__halves2half2(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)),
                                       __ushort_as_half(static_cast<unsigned short>(w >> 16))));
}
template <> __device__ __forceinline__ float2 word_to_float2<__nv_bfloat16>(unsigned w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

template <typename T, int kN>
__device__ __forceinline__ Raw<T, kN> load_raw(const T* src) {
  return *reinterpret_cast<const Raw<T, kN>*>(src);
}

template <typename T, int kN>
__device__ __forceinline__ void unpack(const Raw<T, kN>& u, float (&x)[kN]) {
  if constexpr (sizeof(T) == 4) {
    #pragma unroll
    for (int v = 0; v < kN; ++v) x[v] = u.v[v];
  } else if constexpr (kN == 1) {
    x[0] = bits_to_float<T>(u.v[0]);
  } else {
    #pragma unroll
    for (int v = 0; v < kN / 2; ++v) {
      const float2 f = word_to_float2<T>(u.v[v]);
      x[2 * v] = f.x;
      x[2 * v + 1] = f.y;
    }
  }
}

template <typename T, int kN>
__device__ __forceinline__ void load_vec(const T* src, float (&x)[kN]) {
  unpack<T, kN>(load_raw<T, kN>(src), x);
}

template <typename T, int kN>
__device__ __forceinline__ void store_vec(T* dst, const float (&x)[kN]) {
  if constexpr (kN == 1) {
    *dst = from_float<T>(x[0]);
  } else if constexpr (sizeof(T) == 4) {
    VecN<float, kN> u;
    #pragma unroll
    for (int v = 0; v < kN; ++v) u.v[v] = x[v];
    *reinterpret_cast<VecN<float, kN>*>(dst) = u;
  } else {
    VecN<unsigned, kN / 2> u;
    #pragma unroll
    for (int v = 0; v < kN / 2; ++v) {
      u.v[v] = static_cast<unsigned>(float_to_bits<T>(x[2 * v])) |
               (static_cast<unsigned>(float_to_bits<T>(x[2 * v + 1])) << 16);
    }
    *reinterpret_cast<VecN<unsigned, kN / 2>*>(dst) = u;
  }
}

__device__ __forceinline__ float load_param(const void* p, int code, long long i, float absent) {
  switch (code) {
    case kF32: return static_cast<const float*>(p)[i];
    case kF16: return __half2float(static_cast<const __half*>(p)[i]);
    case kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return absent;
  }
}

__device__ __forceinline__ void store_param(void* p, int code, long long i, float v) {
  switch (code) {
    case kF32: static_cast<float*>(p)[i] = v; break;
    case kF16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case kBF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    default: break;
  }
}

}  // namespace lbs
}  // namespace cupy_attn
