// The attention kernels' shared mask vocabulary: the mask-kind codes the launchers pass (_MASK_KIND in the Python
// launchers), -inf, and one mask element read as a base-2 score offset.
#pragma once
#include "common/types.cuh"

namespace cupy_attn {

// 0 none, 1 bool (True = the key takes part), 2 fp16, 3 bf16, 4 fp32 (added to the scaled scores).
enum MaskKind : int { kMaskNone = 0, kMaskBool = 1, kMaskHalf = 2, kMaskBf16 = 3, kMaskFloat = 4 };

__device__ __forceinline__ float neg_inf() { return -inf(); }

__device__ __forceinline__ int mask_itemsize(int kind) {
  return kind == kMaskBool ? 1 : (kind == kMaskFloat ? 4 : 2);
}

// One mask element at byte address m as a log2-unit score offset: bool gives 0 or -inf, floats their value times
// log2(e). One code path for all four kinds (a switch around four unrolled copies of a tile loop cost ~1 KB of
// register spills at D=128 in flash_fwd.cu).
__device__ __forceinline__ float mask_value(const unsigned char* m, int kind) {
  if (kind == kMaskBool) return *m ? 0.f : neg_inf();
  if (kind == kMaskFloat) return *reinterpret_cast<const float*>(m) * kLog2e;
  const unsigned short bits = *reinterpret_cast<const unsigned short*>(m);
  const float x = kind == kMaskHalf ? __half2float(__ushort_as_half(bits)) : __uint_as_float(unsigned(bits) << 16);
  return x * kLog2e;
}

}  // namespace cupy_attn
