// Programmatic dependent launch (PDL, sm_90+). A kernel launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_
// SERIALIZATION (runtime/compile.py's StructLaunch(pdl=True)) may start while the previous kernel in the stream is
// still finishing, which hides the launch latency between the two.
//   pdl_wait()              blocks until the previous kernel in the stream has completed and its writes are visible.
//                           A PDL-launched kernel calls it before it reads what that kernel wrote, and before it
//                           ends, so that its own completion still implies its predecessors' (the chain stays
//                           transitive for the kernel after it).
//   pdl_launch_dependents() lets the next kernel, if PDL-launched, be launched now (its blocks then wait in their own
//                           pdl_wait); without it, the next one launches as this one's blocks exit.
// Both are no-ops on a plain launch and compile to nothing below sm_90.
#pragma once

namespace cupy_attn {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace cupy_attn
