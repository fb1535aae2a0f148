// Shared element-type helpers: load/store any of fp16 / bf16 / fp32 through fp32 registers.
// Kernels template on the storage type T and compute in float; these overloads keep that one line per access.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cupy_attn {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Four consecutive elements, 8 bytes for 16-bit types and 16 bytes for fp32: one vector access per thread.
template <typename T> struct alignas(4 * sizeof(T)) Vec4 { T v[4]; };

template <typename T>
__device__ __forceinline__ void store4(T* dst, float a, float b, float c, float d) {
  Vec4<T> out;
  out.v[0] = from_float<T>(a); out.v[1] = from_float<T>(b);
  out.v[2] = from_float<T>(c); out.v[3] = from_float<T>(d);
  *reinterpret_cast<Vec4<T>*>(dst) = out;
}

// log2(e): kernels work in base 2 (exp2f is one MUFU instruction); scales are pre-multiplied by it on the host.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// +inf. NVRTC has no <math.h> (no INFINITY) and rejects overflowing constant expressions: build it from its bits.
__device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }

}  // namespace cupy_attn
