// Kernel parameters of flash_fwd_sm90.cu, and the compile-time check that they match the NumPy structured dtype the
// launcher fills (cupy_attn/attention/fused_sm90.py: _PARAMS). The launcher passes the dtype's size, field count,
// field bytes and every field's size as -D options (FA3_PARAMS_SIZE, FA3_NUM_FIELDS, FA3_FIELD_BYTES,
// FA3_SIZE_<field>), so a field added, dropped or resized on one side only fails the compile.
#pragma once
#include "common/tma.cuh"

namespace cupy_attn {

// Passed by value as one __grid_constant__ parameter (512 bytes): the tensor maps must stay in the parameter space,
// where TMA reads them by address. Integers are 8 bytes wide, like the NumPy side's int64 fields.
struct FlashFwdSm90Params {
  tma::TensorMap tma_q;  // Q as (E, L, Hq, B), box (64, kBlockM, 1, 1), 128-byte swizzle
  tma::TensorMap tma_k;  // K as (E, S, Hkv, B), box (64, kBlockN, 1, 1)
  tma::TensorMap tma_v;  // V as (Ev, S, Hkv, B), box (64, kBlockN, 1, 1)
  void* out;             // (B, Hq, L, Ev), element pairs 4-byte aligned
  float* lse;            // (B, Hq, L) fp32 natural log, or nullptr
  long long seqlen_q, seqlen_k, head_dim_v;
  long long groups;         // Hq / Hkv: query head h reads key/value head h / groups
  long long is_causal;      // 1: key j is visible to query i iff j <= i + causal_offset
  long long causal_offset;  // 0 (top-left, torch's is_causal) or S - L (bottom-right)
  double scale_log2;        // scale · log2(e), > 0
  long long out_stride_b, out_stride_h, out_stride_l;
  long long lse_stride_b, lse_stride_h, lse_stride_l;
};

#define CUPY_ATTN_FA3_FIELDS(X)                                                                                       \
  X(tma_q) X(tma_k) X(tma_v) X(out) X(lse) X(seqlen_q) X(seqlen_k) X(head_dim_v) X(groups) X(is_causal)             \
  X(causal_offset) X(scale_log2) X(out_stride_b) X(out_stride_h) X(out_stride_l) X(lse_stride_b) X(lse_stride_h)   \
  X(lse_stride_l)

// NVRTC has no constant-expression offsetof (no __builtin_offsetof, no <cstddef>), so the check is: the same size,
// the same field count, every field of the NumPy side's size, and the sizes adding up to the last field's end (no
// padding but the tail). The field order is checked on the CPU by tests/test_flash_sm90.py against the declaration
// above.
#if !defined(FA3_PARAMS_SIZE) || !defined(FA3_NUM_FIELDS) || !defined(FA3_FIELD_BYTES)
#error "flash_fwd_sm90: compile with the layout options of cupy_attn.attention.fused_sm90 (FA3_PARAMS_SIZE, ...)"
#endif
static_assert(sizeof(FlashFwdSm90Params) == FA3_PARAMS_SIZE, "params size differs from the NumPy dtype");
#define CUPY_ATTN_FA3_COUNT(f) +1
static_assert(0 CUPY_ATTN_FA3_FIELDS(CUPY_ATTN_FA3_COUNT) == FA3_NUM_FIELDS, "params field count differs");
#define CUPY_ATTN_FA3_BYTES(f) +sizeof(FlashFwdSm90Params::f)
static_assert(0 CUPY_ATTN_FA3_FIELDS(CUPY_ATTN_FA3_BYTES) == FA3_FIELD_BYTES, "params field bytes differ");
#define CUPY_ATTN_FA3_SIZE(f) \
  static_assert(sizeof(FlashFwdSm90Params::f) == FA3_SIZE_##f, "params field size differs: " #f);
CUPY_ATTN_FA3_FIELDS(CUPY_ATTN_FA3_SIZE)
#undef CUPY_ATTN_FA3_SIZE
#undef CUPY_ATTN_FA3_BYTES
#undef CUPY_ATTN_FA3_COUNT

}  // namespace cupy_attn
