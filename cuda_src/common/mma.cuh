// Inline-PTX wrappers for the sm_80+ tensor-core path: cp.async (global -> shared without registers), ldmatrix
// (shared -> mma fragments) and mma.sync m16n8k16 (fp16/bf16) and m16n8k8 (tf32) with fp32 accumulation. Valid on
// sm_80..sm_90 (and later), so one source serves Ampere and Hopper.
//
// Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"), lane = 4·g + t:
//   A (16x16, row-major), 4 regs of 2 elements: a0 (row g, cols 2t,2t+1) a1 (row g+8, same) a2 (row g, cols 2t+8,+9)
//                                               a3 (row g+8, cols 2t+8,+9)
//   B (16x8, "col"),      2 regs of 2 elements: b0 (k rows 2t,2t+1, col g) b1 (k rows 2t+8,2t+9, col g)
//   C (16x8, fp32),       4 floats:             c0,c1 (row g, cols 2t,2t+1) c2,c3 (row g+8, cols 2t,2t+1)
// ldmatrix.x4 loads four 8x8 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and register i of every lane
// receives matrix i in exactly the A/B register layout above (with .trans: transposed, for B stored k-major).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cupy_attn {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1 (.cg); bytes past src_bytes (0..16) are zero-filled, so a
// partial or out-of-range chunk still writes defined zeros. src must be 16-byte aligned even when src_bytes < 16.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// cp_async_16 with an L2 prefetch-size hint (PTX ISA: cp.async's .L2::128B / .L2::256B): the L2 brings the whole
// aligned span around the 16 bytes in from DRAM, for data read once in long runs (decode's K/V streams).
template <int kPrefetchBytes>
__device__ __forceinline__ void cp_async_16_prefetch(unsigned dst, const void* src, int src_bytes) {
  static_assert(kPrefetchBytes == 0 || kPrefetchBytes == 128 || kPrefetchBytes == 256, "prefetch 0, 128 or 256");
  if constexpr (kPrefetchBytes == 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
  } else if constexpr (kPrefetchBytes == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
  } else {
    cp_async_16(dst, src, src_bytes);
  }
}
// 4-byte global -> shared copy (cp.async allows 4 bytes only with .ca, through L1); src_bytes 0 or 4, 0 writes a zero.
// For rows that are not 16-byte aligned (an fp32 row of odd length); src needs only 4-byte alignment.
__device__ __forceinline__ void cp_async_4(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory"); }

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// The inverse of ldmatrix_x4 (sm_90+): register i of every lane (the A/B/C fragment layout: row lane / 4, columns
// 2·(lane % 4), +1) goes to matrix i, whose 8 row addresses lanes 8i..8i+7 give.
__device__ __forceinline__ void stmatrix_x4(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3) : "memory");
}

// Two floats to shared memory at a byte address (8-byte aligned): st.shared.v2.f32.
__device__ __forceinline__ void st_shared_f32x2(unsigned addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}

// d += a·b for one 16x8x16 tile; T selects the f16 or bf16 instruction. Not volatile: it touches only registers, so
// the compiler may schedule it freely (ldmatrix/cp.async stay volatile: they must not cross __syncthreads()).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                         unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a·b for one 16x8x8 tile of TF32 operands (fp32 bit patterns; the unit reads the top 19 bits of each register:
// sign, exponent, 10 mantissa bits). Fragment layout (PTX ISA, "Matrix fragments for mma.m16n8k8", .tf32), lane 4g+t:
//   A (16x8, row-major): a0 (row g, col t) a1 (row g+8, col t) a2 (row g, col t+4) a3 (row g+8, col t+4)
//   B (8x8, "col"):      b0 (k row t, col g) b1 (k row t+4, col g)
//   C (16x8, fp32):      the m16n8k16 layout above.
// An 8-row × 16-byte block of fp32 is one ldmatrix b16 matrix whose lane-l register is row l/4, fp32 column l%4: so
// ldmatrix_x4 fills a whole A fragment (or two B fragments of a k-contiguous B) from fp32 rows.
__device__ __forceinline__ void mma_1688_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x in one MUFU instruction (ex2.approx.ftz: rel. error ~2^-22, far below fp16/bf16 rounding); 2^-inf = +0,
// which the online softmax relies on for masked scores and empty rows.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two fp32 values -> one register of two 16-bit values (lo = first), the A-fragment packing.
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

}  // namespace cupy_attn
