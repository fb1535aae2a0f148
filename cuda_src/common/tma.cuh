// Hopper (sm_90a) asynchronous-copy vocabulary: tensor maps, TMA loads (multicast included), mbarriers, proxy fences,
// thread-block clusters, register reallocation and named barriers. Thin PTX wrappers (PTX ISA 8.0+), one instruction
// each, so that a kernel reads as its algorithm and compiles in seconds (no CUTLASS/CuTe headers).
//
// The pattern they serve (FlashAttention-3's producer/consumer pipeline):
//   producer thread:  mbar_wait(empty[s], phase ^ 1); mbar_arrive_expect_tx(full[s], bytes); load_4d(..., full[s])
//   consumer threads: mbar_wait(full[s], phase); ...read stage s (wgmma)...; mbar_arrive(empty[s])
// An mbarrier completes a phase when its pending arrival count reaches zero and the transaction bytes announced by
// expect_tx have all landed; try_wait.parity(P) returns true once the phase of parity P has completed. A freshly
// initialized barrier is in phase 0, so a wait on parity 1 returns at once: the producer's first pass over the stages
// does not wait for releases that never happened.
#pragma once

namespace cupy_attn {
namespace tma {

// CUtensorMap (cuda.h: 128 opaque bytes, 64-byte aligned), encoded on the host by cuTensorMapEncodeTiled and passed
// in a __grid_constant__ kernel parameter: TMA reads it from the parameter space by its generic address. NVRTC has
// no cuda.h, so the type is declared here with the same size and alignment.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};
static_assert(sizeof(TensorMap) == 128, "CUtensorMap is 128 bytes");

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// ---- mbarriers (8 bytes of shared memory each) ----

// Expected arrivals per phase: `count` threads call mbar_arrive (or arrive_expect_tx) before the phase can complete.
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Makes the initializations visible to the async proxy (TMA's complete_tx) and, after a __syncthreads, to all
// threads. The only form PTX has is .release.cluster; a CTA launched without clusters is a cluster of one.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival, and `bytes` more transaction bytes the current phase must see land (the TMA loads to follow).
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

// One arrival (release semantics: this thread's earlier reads and writes happen before the phase completes).
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// Spin until the phase of parity `parity` has completed (acquire semantics). try_wait suspends the thread for a
// hardware-chosen time before it reports false, so the loop is not a hot spin.
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "LAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\n"
      "bra LAB_WAIT;\n"
      "DONE:\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// ---- TMA ----

// Fetch the tensor map into the descriptor cache ahead of its first use.
__device__ __forceinline__ void prefetch_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// Copy the box at coordinates (c0 innermost, ..., c3) of a 4-D tensor map into shared memory at dst, completing
// box-bytes transactions on `bar` (elements outside the tensor's bounds arrive as zeros and still count). dst must be
// 128-byte aligned, and 1024-byte aligned for the 128-byte swizzle pattern to line up with wgmma's (base offset 0).
// Issued by one thread.
__device__ __forceinline__ void load_4d(void* dst, const TensorMap* map, unsigned long long* bar, int c0, int c1,
                                        int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// The same for a 2-D tensor map: the box at coordinates (c0 innermost, c1). Without swizzle dst needs 128-byte
// alignment.
__device__ __forceinline__ void load_2d(void* dst, const TensorMap* map, unsigned long long* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// Copy shared memory at src into the box at coordinates (c0 innermost, ..., c3) of a 4-D tensor map (TMA store; box
// elements outside the tensor's bounds are not written), in this thread's bulk async-group. src: as load_4d's dst.
// The writing threads' fence_proxy_async and a barrier must precede it; issued by one thread, which then commits
// (bulk_commit) and, before the shared memory is reused or the CTA exits, waits until the copies have read it
// (bulk_wait_read).
__device__ __forceinline__ void store_4d(const TensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
               ::"l"(reinterpret_cast<unsigned long long>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2),
               "r"(c3) : "memory");
}
// The same copy as an element-wise add into global memory (TMA reduce: cp.reduce.async.bulk.tensor ... .add; for
// float32, an atomic add per element done by the memory system), with store_4d's protocol.
__device__ __forceinline__ void reduce_add_4d(const TensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
               ::"l"(reinterpret_cast<unsigned long long>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2),
               "r"(c3) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Until this thread's bulk copies have completed (their global writes done, not only their shared-memory reads).
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Orders this thread's generic-proxy shared-memory writes (st.shared, cp.async) before later async-proxy accesses
// (wgmma operand reads, TMA stores). TMA writes read by wgmma need no fence: both are async proxy, and the mbarrier
// wait orders them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- thread-block clusters (sm_90: CTAs of one cluster run side by side on one GPC and reach each other's shared
// memory). A TMA load multicast to several CTAs writes the same box at the same CTA-relative offset in each and
// completes its bytes on the mbarrier at the same offset in each; so a consumer stage shared that way is refilled only
// after the consumers of every receiving CTA have released it (each consumer arrives on the empty barrier of every
// CTA that writes into its stage: mbar_arrive_cluster), and no CTA exits while a peer may still write into it or
// arrive on its barriers (cluster_arrive after the last remote access, cluster_wait before exit). ----

// This CTA's rank in its cluster (0 .. cluster size − 1; along x for a (n, 1, 1) cluster: blockIdx.x % n).
__device__ __forceinline__ unsigned cluster_ctarank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// One arrival on the mbarrier at `bar`'s offset in the shared memory of CTA `cta` of this cluster (mapa gives its
// shared::cluster address): a consumer releasing a stage that CTA's producer multicasts into. The default semantics
// (.release at .cta scope), as CUTLASS's ClusterBarrier::arrive(cta_id): the stage's only readers are wgmma, complete
// at wgmma.wait_group before the arrive; .release.cluster would put a MEMBAR.ALL.GPU before every arrival (seen in
// the SASS), in the mainloop.
__device__ __forceinline__ void mbar_arrive_cluster(unsigned long long* bar, unsigned cta) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(cta)
      : "memory");
}

// load_4d into every CTA of the cluster whose bit is set in cta_mask (bit r: rank r), at dst's offset in each, the
// bytes completing on the mbarrier at bar's offset in each. One L2 read feeds them all (sm_90a).
__device__ __forceinline__ void load_4d_multicast(void* dst, const TensorMap* map, unsigned long long* bar,
                                                  unsigned short cta_mask, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], "
      "[%1, {%4, %5, %6, %7}], [%2], %3;\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(smem_u32(bar)), "h"(cta_mask), "r"(c0), "r"(c1), "r"(c2),
      "r"(c3)
      : "memory");
}

// The cluster barrier, split: arrive marks this thread's arrival without waiting; wait (acquire) returns once every
// thread of every CTA in the cluster has arrived. Each thread pairs one arrive with one wait; a CTA's threads that
// have not arrived hold back the whole cluster. arrive.release orders this thread's earlier memory accesses (remote
// arrivals included) before the peers' return from wait (a MEMBAR.ALL.GPU: once per thread, not in a loop);
// arrive.relaxed does not (after fence_barrier_init, which has released the barrier initializations). Not the
// .aligned forms: callers may have diverged.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
}

// ---- warp-group register reallocation (executed by all 128 threads of a warpgroup) ----

// Give registers back to the SM's pool (producer) or take them (consumers), per thread, a multiple of 8 in
// [24, 256]. `inc` blocks until the pool holds enough, i.e. until the producer's `dec` has run.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- named barriers 1..15 (0 is __syncthreads) ----

// sync waits until `threads` threads have arrived at barrier `id` (counting itself); arrive counts without waiting.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same barrier in its unaligned form (barrier.sync): the threads may reach it from different instructions. bar.sync
// is barrier.sync.aligned, which requires every participating thread to execute the same instruction; the scores
// kernel's pair tiles meet its statistics barrier from two code paths (compute-sanitizer's synccheck flags the aligned
// form there as a divergent barrier).
__device__ __forceinline__ void named_barrier_sync_unaligned(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace tma
}  // namespace cupy_attn
