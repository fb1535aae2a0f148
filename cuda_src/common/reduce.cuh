// Warp and block reductions (max, sum) in fp32 for groups of kThreads threads that share one row.
// A group is either a part of a warp (kThreads <= 32, shuffles only) or whole warps (kThreads a multiple of 32,
// shuffles then one pass through shared memory). Every thread of the group gets the result.
// Also the fp32 reductions into global memory that the fused backward kernels accumulate dQ with.
#pragma once

namespace cupy_attn {

struct MaxOp { __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct SumOp { __device__ __forceinline__ float operator()(float a, float b) const { return a + b; } };

template <int kWidth, typename Op>
__device__ __forceinline__ float warp_reduce(float x, Op op) {
  #pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, offset, kWidth));
  return x;
}

// kThreads threads (a power of two) starting at a multiple of kThreads reduce x; `scratch` must hold
// kThreads / 32 floats per group when kThreads > 32 and is reused across calls (hence the leading barrier).
template <int kThreads, typename Op>
__device__ __forceinline__ float group_reduce(float x, Op op, float* scratch) {
  if constexpr (kThreads <= 32) {
    return warp_reduce<kThreads>(x, op);
  } else {
    constexpr int kWarps = kThreads / 32;
    const int lane = threadIdx.x % 32;
    const int warp_in_group = (threadIdx.x % kThreads) / 32;
    float* s = scratch + (threadIdx.x / kThreads) * kWarps;
    x = warp_reduce<32>(x, op);
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) s[warp_in_group] = x;
    __syncthreads();
    x = s[0];
    #pragma unroll
    for (int w = 1; w < kWarps; ++w) x = op(x, s[w]);
    return x;
  }
}

// dst[0] += a, dst[1] += b (dst 8-byte aligned): one vector reduction on sm_90 (red.global.add.v2.f32, PTX 8.1),
// two scalar atomics before. Halves the atomic operations of the dQ accumulation.
__device__ __forceinline__ void red_add2(float* dst, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

}  // namespace cupy_attn
