// Kernel parameters of flash_fwd_sm90.cu. Declared once, in NumPy (cupy_attn/attention/fused_sm90.py: _PARAMS): the
// size and every field's size are asserted when the family compiles (KernelFamily.structs), and tests/test_structs.py
// checks the field order against this declaration.
#pragma once
#include "common/tma.cuh"
#include "common/visibility.cuh"

namespace cupy_attn {

// Passed by value as one __grid_constant__ parameter (768 bytes): the tensor maps must stay in the parameter space,
// where TMA reads them by address. Integers are 8 bytes wide, like the NumPy side's int64 fields.
struct FlashFwdSm90Params {
  tma::TensorMap tma_q;  // Q as (E, L, Hq, B), box (64 or 32, kBlockM, 1, 1): one 128- or 64-byte swizzle atom wide
  tma::TensorMap tma_k;  // K as (E, S, Hkv, B), box (64 or 32, kBlockN, 1, 1)
  tma::TensorMap tma_v;  // V as (Ev, S, Hkv, B), box (64 or 32, kBlockN, 1, 1)
  tma::TensorMap tma_o;  // out as (Ev, L, Hq, B), box (64 or 32, 64, 1, 1): the epilogue's TMA stores (o_tma = 1)
  void* out;             // (B, Hq, L, Ev), element pairs 4-byte aligned
  float* lse;            // (B, Hq, L) fp32 natural log, or nullptr
  long long seqlen_q, seqlen_k, head_dim_v;
  long long groups;         // Hq / Hkv: query head h reads key/value head h / groups
  long long is_causal;      // 1: key j is visible to query i iff j <= i + causal_offset
  long long causal_offset;  // 0 (top-left, torch's is_causal) or S - L (bottom-right)
  double scale_log2;        // scale · log2(e), > 0
  long long out_stride_b, out_stride_h, out_stride_l;
  long long lse_stride_b, lse_stride_h, lse_stride_l;
  long long batch, num_heads;  // B, Hq: the persistent variant's tile count (sm90/tile_scheduler.cuh)
  long long tile_pairs;        // persistent and causal: 1 = units of two m-blocks (M-1-k, k), 0 = single m-blocks
  long long o_tma;             // 1: out stored through shared memory by TMA (tma_o); 0: 4-byte global stores
  // The variants (common/visibility.cuh, common/score_mod.cuh), read by the kVariants instantiations only. A window's
  // right side is folded into is_causal / causal_offset by the launcher (the smaller upper bound); its left side is
  // window_lo.
  long long window_lo;         // key j is visible to query i only if j >= i + window_lo (kNoLowerBound: no bound)
  const void* sinks;           // (Hq,) sink logits (natural log), or nullptr
  long long sinks_kind;        // 0: fp32 sinks; 1: sinks of the element type T
  double softcap_in;           // kVariants: scale / c, or 0 without a softcap (scale_log2 is then c · log2(e))
  const float* alibi_slopes;   // kVariants: fp32 ALiBi slopes (Hq,) or (B, Hq), or nullptr
  long long alibi_stride_b;    // 0 for (Hq,) slopes, Hq for (B, Hq)
  double alibi_scale;          // kVariants: 1 / scale, or 1 / c with a softcap (the bias in raw-score units)
  // Packed variable-length batches (kVarlen; FlashAttention's varlen layout): q (total_q, Hq, E), k/v (total_k, Hkv,
  // E|Ev), out (total_q, Hq, Ev), lse (Hq, total_q), read as batch 1 of total rows (seqlen_q, seqlen_k: total_q and
  // total_k). Sequence b holds query rows
  // cu_seqlens_q[b] ... cu_seqlens_q[b+1] − 1 and keys from cu_seqlens_k[b] on, seqused_k[b] of them (or up to
  // cu_seqlens_k[b+1] without seqused_k). Bounds are bottom-right aligned per sequence: causal_offset and window_lo
  // hold the offsets relative to S_b − L_b (SeqSpan adds it).
  const int* cu_seqlens_q;     // (B + 1,) int32, or nullptr (not packed)
  const int* cu_seqlens_k;     // (B + 1,) int32, or nullptr with a block table
  const int* seqused_k;        // (B,) int32, or nullptr (required with a block table)
  // Paged K/V (kVarlen with block_table): k, v caches (num_blocks, page_size, Hkv, E|Ev), read as num_blocks·page_size
  // rows (seqlen_k: max_blocks·page_size, the keys a table row can address); sequence b's key j is row
  // block_table[b·max_blocks + j / page_size]·page_size + j % page_size. page_size a multiple of 8, and a multiple or
  // a divisor of kBlockN (the maps' boxes are min(page_size, kBlockN) rows).
  const int* block_table;      // (B, max_blocks) int32, or nullptr
  long long max_blocks;        // the block table's row length
  long long page_size;
};

// The sequence a tile belongs to: where its rows and keys start in the arrays, how many there are, and its bounds.
// Dense calls (kVarlen = false): batch b of the tensor maps and strides, rows and keys from 0, the call's own L, S and
// bounds, each read from the parameter space where it is used (no register holds them). Packed calls: batch 0 of
// maps holding every sequence's rows, the sequence's offsets q0, k0 and lengths L, S (four registers), and the
// bounds moved by its diagonal S − L.
template <bool kVarlen>
struct SeqSpan {
  static constexpr bool kPacked = kVarlen;
  const FlashFwdSm90Params& p;
  int b, q0_, k0_, L, S;  // b: the tile's batch index; the rest packed calls only

  // Packed calls read the sequence's offsets and lengths from the index arrays (every thread its own copy; the
  // values are the same in a warp, but loaded from memory ptxas keeps them, and the ring indices and descriptors
  // derived from them, in vector registers: the S GEMM's descriptors reach the wgmma through R2UR). The arrays are
  // not checked on the host, so the sequence is clamped to the arrays' rows (p.seqlen_q / p.seqlen_k hold total_q
  // and total_k in packed calls): index arrays that overrun them cannot make the register stores write past out.
  __device__ __forceinline__ SeqSpan(const FlashFwdSm90Params& params, int batch) : p(params), b(batch) {
    if constexpr (kVarlen) {
      const int total_q = static_cast<int>(p.seqlen_q), total_k = static_cast<int>(p.seqlen_k);
      q0_ = min(max(p.cu_seqlens_q[b], 0), total_q);
      // paged (block_table): keys by page from 0, whatever cu_seqlens_k says
      k0_ = p.cu_seqlens_k != nullptr && p.block_table == nullptr ? min(max(p.cu_seqlens_k[b], 0), total_k) : 0;
      L = min(max(p.cu_seqlens_q[b + 1] - q0_, 0), total_q - q0_);
      S = min(max(p.seqused_k != nullptr ? p.seqused_k[b] : p.cu_seqlens_k[b + 1] - k0_, 0), total_k - k0_);
    }
  }
  // The batch coordinate of the tensor maps and of out's and lse's batch strides.
  __device__ __forceinline__ int b_map() const { return kVarlen ? 0 : b; }
  // The sequence's first query row and first key in the arrays.
  __device__ __forceinline__ int q0() const { return kVarlen ? q0_ : 0; }
  __device__ __forceinline__ int k0() const { return kVarlen ? k0_ : 0; }
  __device__ __forceinline__ long long seqlen_q() const { return kVarlen ? L : p.seqlen_q; }
  __device__ __forceinline__ long long seqlen_k() const { return kVarlen ? S : p.seqlen_k; }
  // The upper bound's offset (used only when is_causal) and the lower one's (kVariants only; kNoLowerBound: none).
  __device__ __forceinline__ long long causal_offset() const {
    return kVarlen ? p.causal_offset + (S - L) : p.causal_offset;
  }
  __device__ __forceinline__ long long window_lo() const {
    return kVarlen && p.window_lo != kNoLowerBound ? p.window_lo + (S - L) : p.window_lo;
  }
};

}  // namespace cupy_attn
