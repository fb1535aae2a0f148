// The skeleton every warp-specialized Hopper kernel shares (flash_fwd_sm90, flash_fwd_d512_sm90, scores_softmax_sm90,
// pv_sm90, flash_bwd_sm90; FlashAttention-3's hopper/flash_fwd_kernel_sm90.h): its shared memory aligned for the
// swizzle atoms, its barriers initialized by one thread, and the split of the CTA into a producer warpgroup (TMA
// loads, few registers) and consumer warpgroups (wgmma, many registers). The ring protocol between them is
// common/pipeline.cuh's; each kernel's SharedStorage lays out its own tiles from smem_base.
#pragma once
#include "common/tma.cuh"
#include "common/pipeline.cuh"

namespace cupy_attn {
namespace sm90 {

// Dynamic shared memory per block on sm_90 (227 KB): every SharedStorage asserts its kBytes against it.
constexpr int kMaxSmemBytes = 232448;

// Register split by the number of consumer warpgroups (FlashAttention-3's), the launch-time allocation being
// 65536 / threads per thread at one block per SM (__launch_bounds__(threads, 1)):
//   two (384 threads): 128·24 + 256·240 = 64512 <= 65536 (168 per thread at launch);
//   three (512 threads): 128·32 + 384·160 = 65536 (128 per thread at launch).
template <int kConsumerWarpgroups>
struct RegisterSplit {
  static constexpr int kThreads = 128 * (kConsumerWarpgroups + 1);
  static constexpr int kProducer = kConsumerWarpgroups == 2 ? 24 : 32;
  static constexpr int kConsumer = kConsumerWarpgroups == 2 ? 240 : 160;
  static_assert(128 * kProducer + 128 * kConsumerWarpgroups * kConsumer <= 65536, "one block's registers per SM");
};

// The dynamic shared memory's base aligned up to 1024 bytes: the 128-byte swizzle's 8-row atoms (and a multiple of
// the 64-byte swizzle's 512) must start on such a boundary for TMA's and wgmma's swizzle patterns to agree (base
// offset 0); the runtime guarantees 16 only, so every SharedStorage::kBytes includes 1 KB of slack. The kernels
// declare their extern buffer __align__(16), so that the compiler cannot fold this realignment away.
__device__ __forceinline__ unsigned char* smem_base(unsigned char* raw) {
  return raw + ((1024 - tma::smem_u32(raw) % 1024) % 1024);
}

// Warp specialization: warpgroup 0 gives registers back (setmaxnreg.dec to Regs::kProducer) and runs
// produce(threadIdx.x) (usually thread 0 alone issues the TMA loads); warpgroups 1 ... take theirs
// (setmaxnreg.inc to Regs::kConsumer) and run consume(tid), tid = threadIdx.x − 128 counted over the consumers.
template <typename Regs, typename Produce, typename Consume>
__device__ __forceinline__ void warp_specialize(const Produce& produce, const Consume& consume) {
  if (threadIdx.x < 128) {
    tma::setmaxnreg_dec<Regs::kProducer>();
    produce(static_cast<int>(threadIdx.x));
  } else {
    tma::setmaxnreg_inc<Regs::kConsumer>();
    consume(static_cast<int>(threadIdx.x - 128));
  }
}

}  // namespace sm90
}  // namespace cupy_attn
