// The mbarrier pipeline of the Hopper kernels (FlashAttention-3's producer/consumer ring, Shah et al. 2024, §3.1): a
// producer fills kStages shared-memory stages by TMA, consumers read them, and two mbarriers per stage carry the
// hand-offs, with no CTA-wide barrier in the loop. Used by every kernel with such a ring: flash_fwd_sm90
// (sm90/mainloop.cuh: K and V rings), flash_fwd_d512_sm90, scores_softmax_sm90, pv_sm90, flash_decode_sm90 and the
// Hopper backward (sm90/bwd_mainloop.cuh: Q and dO rings).
//
// Protocol of a Ring (iteration it = the it-th fill of the ring, counted from 0 over the kernel's whole life):
//   stage(it) = it % kStages, round = it / kStages, phase(it) = round & 1.
//   full[s]:  1 arrival (the producer's arrive_expect_tx, announcing the stage's bytes) + those TMA bytes.
//   empty[s]: `readers` arrivals (typically lane 0 of each consumer warp, once the wgmma or ldmatrix reading the stage
//             have completed).
//   producer: acquire(it, bytes): wait on empty[s] for parity phase(it) ^ 1, i.e. for the release of round − 1 (round
//             0 waits on parity 1 of a fresh barrier, which returns at once: tma.cuh), then arrive_expect_tx on
//             full[s]; then issues the loads completing on full[s].
//   consumer: wait(it) on full[s] for parity phase(it); reads the stage; release(it): one arrival on empty[s].
// A barrier completes a phase per round, so a waiter never confuses rounds as long as producer and consumers are at
// most one round apart, which the empty barriers enforce.
//
// A Slot is a ring of one buffer that the producer refills once per round (the persistent kernels' Q): round r's
// fill waits for round r − 1's release, and round 0 does not wait at all.
#pragma once
#include "common/tma.cuh"

namespace cupy_attn {
namespace pipeline {

template <int kStages>
struct Ring {
  static_assert(kStages >= 1, "a ring of at least one stage");
  unsigned long long* full;   // [kStages]
  unsigned long long* empty;  // [kStages]

  __device__ __forceinline__ static int stage(int it) { return it % kStages; }
  __device__ __forceinline__ static int phase(int it) { return (it / kStages) & 1; }

  // Stage s's barriers (one thread, before tma::fence_barrier_init).
  __device__ __forceinline__ void init_full(int s) const { tma::mbar_init(&full[s], 1); }
  __device__ __forceinline__ void init_empty(int s, unsigned readers) const { tma::mbar_init(&empty[s], readers); }
  __device__ __forceinline__ void init(unsigned readers) const {
    #pragma unroll
    for (int s = 0; s < kStages; ++s) {
      init_full(s);
      init_empty(s, readers);
    }
  }

  // Producer: iteration it's stage is free (its previous contents released); `bytes` announced on its full barrier,
  // which the returned pointer names for the loads.
  __device__ __forceinline__ unsigned long long* acquire(int it, unsigned bytes) const {
    const int s = stage(it);
    tma::mbar_wait(&empty[s], phase(it) ^ 1);
    tma::mbar_arrive_expect_tx(&full[s], bytes);
    return &full[s];
  }
  // The same for a stage and phase the producer computed already (stage(it), phase(it)).
  __device__ __forceinline__ unsigned long long* acquire(int s, unsigned phase, unsigned bytes) const {
    tma::mbar_wait(&empty[s], phase ^ 1);
    tma::mbar_arrive_expect_tx(&full[s], bytes);
    return &full[s];
  }
  // Consumer: iteration it's loads have landed. Returns its stage. (stage and phase spelled out: calling them here
  // changed flash_decode_sm90's SASS at kStages = 3 and 6, where % and / are not shifts.)
  __device__ __forceinline__ int wait(int it) const {
    const int s = it % kStages;
    tma::mbar_wait(&full[s], (it / kStages) & 1);
    return s;
  }
  // Consumer: one arrival on iteration it's empty barrier (a single thread, usually lane 0 of a warp).
  __device__ __forceinline__ void arrive_empty(int it) const { tma::mbar_arrive(&empty[stage(it)]); }
  // The same arrival on the empty barrier of CTA `cta` of this cluster (a stage its producer multicasts into).
  __device__ __forceinline__ void arrive_empty_cluster(int it, unsigned cta) const {
    tma::mbar_arrive_cluster(&empty[it % kStages], cta);
  }
  // Consumer warp: release iteration it's stage once every lane's reads of it have returned (__syncwarp orders them
  // before lane 0's arrival, which has release semantics).
  __device__ __forceinline__ void release(int it, int lane) const {
    __syncwarp();
    if (lane == 0) arrive_empty(it);
  }
  // The same for a stage index the caller holds (stage(it)).
  __device__ __forceinline__ void release_stage(int s, int lane) const {
    __syncwarp();
    if (lane == 0) tma::mbar_arrive(&empty[s]);
  }
};

// Several rings of the same depth that advance together (flash_fwd_sm90's K and V): stage s's full barriers, then its
// empty ones, ring by ring.
template <int kStages, typename... Rings>
__device__ __forceinline__ void init_rings(unsigned readers, const Rings&... rings) {
  #pragma unroll
  for (int s = 0; s < kStages; ++s) {
    (rings.init_full(s), ...);
    (rings.init_empty(s, readers), ...);
  }
}

// Thread 0 runs init (the mbarrier initializations) and fences them for the async proxy; the block barrier then
// publishes them to every thread.
template <typename Init>
__device__ __forceinline__ void init_barriers(const Init& init) {
  if (threadIdx.x == 0) {
    init();
    tma::fence_barrier_init();
  }
  __syncthreads();
}

struct Slot {
  unsigned long long* full;   // 1 arrival + the bytes of a fill
  unsigned long long* empty;  // `readers` arrivals: the buffer's contents of this round are no longer needed

  __device__ __forceinline__ void init(unsigned readers) const {
    tma::mbar_init(full, 1);
    tma::mbar_init(empty, readers);
  }
  // Producer, before fill `round`: the readers have released fill round − 1 (nothing to wait for before fill 0).
  __device__ __forceinline__ void wait_free(int round) const {
    if (round > 0) tma::mbar_wait(empty, (round - 1) & 1);
  }
  // Consumer: fill `round` has landed.
  __device__ __forceinline__ void wait(int round) const { tma::mbar_wait(full, round & 1); }
  // Consumer warp: done with the buffer's contents (lane 0 arrives after __syncwarp, as Ring::release).
  __device__ __forceinline__ void release(int lane) const {
    __syncwarp();
    if (lane == 0) tma::mbar_arrive(empty);
  }
};

}  // namespace pipeline
}  // namespace cupy_attn
