// Split-KV attention forward for decode and short queries: out = softmax(scale · Q Kᵀ + mask) V, lse = log Σ exp(...).
//
// Algorithm: Flash-Decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference", 2023) on top of
// the FlashAttention-2 inner loop (Dao 2023). With L = 1..16 query rows a (batch, head) has too little work for one
// CTA per 128 query rows, and under GQA every query head would re-read its K/V head. Here:
//   * GQA packing: the g = Hq/Hkv query heads that share a K/V head, times the L query rows, are the rows of one
//     16-row mma tile; packed row r is (query head hkv·g + r / L, query row r % L). K/V is read once per 16 packed
//     rows (rows past 16 take more row blocks, grid.y). Causal limits and masks are per packed row (h, i).
//   * Split-KV: grid = (num_splits, Hkv · row_blocks, B); split s streams keys [s·chunk, min(S, (s+1)·chunk)), chunk a
//     multiple of kBlockN, and writes its normalized partial O_s and lse_s (fp32) to a workspace; flash_decode_combine
//     then merges the splits per row: lse = log Σ_s exp(lse_s), out = Σ_s exp(lse_s − lse) · O_s. One split writes
//     out and lse directly. A split that sees no key (all masked, or past a causal limit) has lse_s = -inf and O_s = 0,
//     and is skipped by the combine; a row with every split empty gives out 0 and lse -inf.
// Per key tile (kBlockN keys, each warp kWarpN of them), in base 2 (exp2 is one MUFU op):
//   S_w = Q K_wᵀ · scale·log2(e) (+ mask·log2(e); -inf past the split's end, a causal limit or a False mask)
//   m' = max(m, rowmax S_w);  P = 2^(S_w − m');  l = 2^(m − m')·l + rowsum P;  O_w = 2^(m − m')·O_w + P V_w
// and at the end the warps' (m_w, l_w, O_w) are merged through shared memory, in the same way as the splits.
// Whole tiles that every packed row sees in full (no mask, scale >= 0: the CTA's first n_fast tiles) take a short
// path (softmax_fast): max of the raw scores, P = 2^(s·scale·log2(e) − m) by one FFMA, m moved only when it grows by
// more than 8 (log2 units), rows 8..15 skipped when they are all padding; the per-key limit and mask path
// (softmax_general) runs on the split's last tiles only. The loop is issue-bound (one or two warps per scheduler),
// so its instruction count per tile is the cost (bench/notes/kernels_flash_decode.md counts it in the SASS).
//
// Thread mapping: kNWarps warps share the 16 rows and split each key tile: warp w owns keys [w·kWarpN, (w+1)·kWarpN)
// of the tile (mma.sync m16n8k16, fp32 accumulate; Q and K by ldmatrix, V by ldmatrix.trans, P from the S
// accumulators as in flash_fwd.cu). So every K/V element goes from shared memory to exactly one warp once, and the
// softmax statistics need only quad shuffles; lane 4g+t holds rows g and g+8.
//
// Tile sizes (DECODE_TILES in cupy_attn/attention/decode.py, with the limit behind each entry): decode is memory-bound
// (1 packed row: ~2 FLOP per byte of K/V read), so the tile is chosen for bytes in flight, not for math: 16 rows,
// kBlockN = 64 keys (16 per warp, the smallest k step of P·V), kStages K/V buffers filled by 16-byte cp.async
// (kStages − 1 tiles in flight while one is consumed; the computation per tile is short, so a CTA keeps
// (kStages − 1)·kBlockN·(E + Ev)·2 bytes in flight almost all the time: 64 KB at D = 128 and 3 stages, two CTAs per SM
// on Hopper). Grids of about one CTA per SM or fewer take the 8-warp tile (WIDE_TILES: 128 keys, still 16 per warp,
// one CTA per SM): the same per-warp loop, but two warps per scheduler instead of one (the loop is issue-bound) and
// twice the bytes in flight per SM. Registers: O is kHeadDim/2 fp32 per thread, S kWarpN/2.
// Shared memory: kStages × (K and V, kBlockN rows each), then Q (16 rows, pitch kHeadDim + 8). K/V rows are unpadded
// (kHeadDim elements) with their 16-byte chunks XOR-swizzled by the row (kv_offset): ldmatrix stays conflict-free,
// and the 8 threads that copy one 128-byte line of global memory write one 128-byte span of shared memory. With the
// padded pitch (kHeadDim + 8) a warp's cp.async of two 256-byte rows cost the L2 24 sector reads instead of 16 (1.5×
// the bytes read). The K/V space is reused for the cross-warp
// merge at the end.
// Head dims: Q/K zero-padded from E, V from Ev to kHeadDim (cp.async zero-fill); keys past the split's loaded range
// are zero-filled rows (their V must not be garbage: P = 0 times NaN is NaN).
// Layouts: any int64 element strides for batch, head and row; last dimension contiguous. 16-byte aligned rows go by
// cp.async, others by plain loads.
//
// Hopper streaming variant (flash_decode_sm90, below): the same CTA work and math (decode::attend, merge_store), K/V
// by TMA into a deep mbarrier ring (common/pipeline.cuh) fed by a producer warp; its comment gives the design.
//
// History and measurements: bench/notes/kernels_flash_decode.md.
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/mask.cuh"
#include "common/tma.cuh"
#include "common/pipeline.cuh"
#include "attention/sm90/roles.cuh"
#include "common/pdl.cuh"
#include "common/visibility.cuh"

namespace cupy_attn {

// Declared once, here: cupy_attn/attention/decode.py builds its NumPy structured dtype by parsing this struct (one
// declaration per line: `type name[, name...];`, 8-byte types only) and passes the dtype's size back as a -D option,
// asserted below. Every field is 8 bytes wide, so the two layouts agree field by field.
struct FlashDecodeParams {
  void* out;                // (B, Hq, L, Ev)
  float* lse;               // (B, Hq, L) fp32 natural log, or nullptr
  const void* q;            // (B, Hq, L, E)
  const void* k;            // (B, Hkv, S, E)
  const void* v;            // (B, Hkv, S, Ev)
  const void* mask;         // element (b, h, i, j) of the broadcast mask, or nullptr
  float* o_part;            // (num_splits, B, Hq, L, Ev) fp32 normalized partial outputs (num_splits > 1)
  float* lse_part;          // (num_splits, B, Hq, L) fp32 natural-log partial lse (num_splits > 1)
  long long batch, num_heads, seqlen_q, seqlen_k, head_dim, head_dim_v;
  long long groups;         // Hq / Hkv
  long long row_blocks;     // ceil(groups · L / 16): packed 16-row tiles per kv head
  long long num_splits;     // grid.x
  long long split_keys;     // keys per split, a multiple of kBlockN
  long long is_causal;      // 1: key j is visible to query i iff j <= i + causal_offset
  long long causal_offset;  // 0 (top-left, torch's is_causal) or S - L (bottom-right)
  long long mask_kind;      // 1 bool (True = attend), 2 fp16, 3 bf16, 4 fp32 (added to the scaled scores)
  long long vec_flags;      // bit 0/1/2: q/k/v rows 16-byte aligned (cp.async)
  double scale_log2;        // scale · log2(e)
  long long q_stride_b, q_stride_h, q_stride_l;
  long long k_stride_b, k_stride_h, k_stride_s;
  long long v_stride_b, v_stride_h, v_stride_s;
  long long out_stride_b, out_stride_h, out_stride_l;
  long long lse_stride_b, lse_stride_h, lse_stride_l;
  long long mask_stride_b, mask_stride_h, mask_stride_l, mask_stride_s;
  // Paged caches (flash_decode_paged): k and v are the caches' rows (num_blocks · page_size rows of k_stride_s
  // elements, heads k_stride_h apart, k_stride_b unused); sequence b has seqused_k[b] keys (seqlen_k bounds them),
  // key j in row block_table[b · max_blocks + j / page_size] · page_size + j % page_size; causal masks bottom-right
  // per sequence (query i sees keys j <= i + seqused_k[b] − L).
  const int* seqused_k;
  const int* block_table;
  long long max_blocks, page_size;
};


namespace decode {

// Byte offset of 16-byte chunk c of row r in a K/V tile of unpadded rows (kHeadDim elements): the chunk index is
// XOR-ed with r % 8, so the 8 rows an ldmatrix reads at one logical chunk fall in 8 distinct bank groups, and the
// chunks of a 128-byte global line stay in one 128-byte span (kHeadDim >= 64: a row has >= 8 chunks).
template <int kHeadDim>
__device__ __forceinline__ unsigned kv_offset(int r, int c) {
  static_assert(kHeadDim % 64 == 0, "the swizzle permutes 8 chunks within each 128-byte span");
  return r * kHeadDim * 2 + ((c ^ (r & 7)) << 4);
}

// Rows [0, kRows) × columns [0, kHeadDim) of a row-major global tile into a swizzled K/V tile (kv_offset); rows
// >= rows_valid and columns >= cols_valid become zeros. vec: 16-byte cp.async (the caller commits); else plain loads.
// kThreads is a multiple of the row's chunk count for every tile here, so a thread's chunks share one column.
template <int kRows, int kHeadDim, int kThreads, typename T>
__device__ __forceinline__ void load_kv(T* dst, const T* src, long long row_stride, int rows_valid, int cols_valid,
                                        bool vec) {
  constexpr int kChunks = kHeadDim / 8;
  static_assert(kThreads % kChunks == 0, "a thread's chunks share one column");
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kRows % kRowStep == 0, "every thread copies the same number of rows");
  const int r0 = threadIdx.x / kChunks, col = (threadIdx.x % kChunks) * 8;
  if (vec) {
    const int bytes = max(0, min(16, (cols_valid - col) * 2));
    #pragma unroll
    for (int j = 0; j < kRows / kRowStep; ++j) {
      const int r = r0 + j * kRowStep;
      // A zero-byte copy reads nothing, but its address must still be valid and aligned: use the tile's start.
      const bool ok = r < rows_valid && bytes > 0;
      cp_async_16(smem_addr(dst) + kv_offset<kHeadDim>(r, col / 8), ok ? src + r * row_stride + col : src,
                  ok ? bytes : 0);
    }
  } else {
    // One row at a time: unrolled, the 2-byte loads of every row would be batched into ~128 registers.
    const unsigned short* s16 = reinterpret_cast<const unsigned short*>(src);
    #pragma unroll 1
    for (int j = 0; j < kRows / kRowStep; ++j) {
      const int r = r0 + j * kRowStep;
      unsigned short e[8];
      #pragma unroll
      for (int x = 0; x < 8; ++x) e[x] = (r < rows_valid && col + x < cols_valid) ? s16[r * row_stride + col + x] : 0;
      uint4 packed;
      packed.x = e[0] | (unsigned(e[1]) << 16); packed.y = e[2] | (unsigned(e[3]) << 16);
      packed.z = e[4] | (unsigned(e[5]) << 16); packed.w = e[6] | (unsigned(e[7]) << 16);
      *reinterpret_cast<uint4*>(reinterpret_cast<char*>(dst) + kv_offset<kHeadDim>(r, col / 8)) = packed;
    }
  }
}


// One thread's share of the whole-tile copies of K and V into a kStages ring (16-byte aligned rows, every row of the
// tile below n_end): the chunks at rows r0 + j·kRowStep, columns [col, col + 8), as load_kv's, by cp.async from
// pointers that walk the split one tile per load and a shared address that walks the ring, so a tile costs per chunk
// a 64-bit add and a cp.async, with no bounds test and no index arithmetic. (Values the compiler can recompute from
// threadIdx and the parameters it recomputes in the loop rather than keep in registers; the walking ones it cannot.)
// A chunk's bytes are the same in every tile: 16, fewer at E's last chunk, 0 past E (zero-filled; the source is then
// the row's column 0, a valid address). Tiles are copied (or, by load_kv, skipped over) in order, one per advance().
template <int kRows, int kHeadDim, int kThreads, int kStages>
struct TileCopy {
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kRowStep = kThreads / kChunks;
  static constexpr unsigned kTileBytes = kRows * kHeadDim * 2;
  static constexpr unsigned kVOffset = kStages * kTileBytes;  // V's ring after K's
  static_assert(kThreads % kChunks == 0 && kRows % kRowStep == 0, "every thread copies whole rows' chunks");
  const char* k_src;
  const char* v_src;
  long long k_row_bytes, v_row_bytes;
  unsigned dst;           // shared address of the K tile of the stage loaded next
  int stage;              // that stage
  int k_bytes, v_bytes;

  __device__ __forceinline__ TileCopy(const void* k0, long long k_stride, int E, const void* v0, long long v_stride,
                                      int Ev, unsigned smem_k) {
    const int r0 = threadIdx.x / kChunks, col = (threadIdx.x % kChunks) * 8;
    k_bytes = max(0, min(16, (E - col) * 2));
    v_bytes = max(0, min(16, (Ev - col) * 2));
    k_row_bytes = k_stride * 2;
    v_row_bytes = v_stride * 2;
    k_src = static_cast<const char*>(k0) + r0 * k_row_bytes + (k_bytes > 0 ? col * 2 : 0);
    v_src = static_cast<const char*>(v0) + r0 * v_row_bytes + (v_bytes > 0 ? col * 2 : 0);
    dst = smem_k;
    stage = 0;
  }
  // The next tile from rows starting at k0 and v0 (a paged cache: each tile's page, flash_decode_paged).
  __device__ __forceinline__ void rebase(const void* k0, const void* v0) {
    const int r0 = threadIdx.x / kChunks, col = (threadIdx.x % kChunks) * 8;
    k_src = static_cast<const char*>(k0) + r0 * k_row_bytes + (k_bytes > 0 ? col * 2 : 0);
    v_src = static_cast<const char*>(v0) + r0 * v_row_bytes + (v_bytes > 0 ? col * 2 : 0);
  }
  // The next tile, whole. kFullCols: E = Ev = kHeadDim, every chunk 16 bytes.
  template <bool kFullCols>
  __device__ __forceinline__ void copy() const {
    const char* k = k_src;
    const char* v = v_src;
    #pragma unroll
    for (int j = 0; j < kRows / kRowStep; ++j) {
      // Row r0 + j·kRowStep: its swizzle is row r0 + (j·kRowStep) % 8's, a per-thread constant (one or two per
      // thread at the tiles here), so the address is that row's offset plus an immediate.
      const int jm = (j * kRowStep) % 8;
      const unsigned at = dst + (j * kRowStep - jm) * kHeadDim * 2 +
                          kv_offset<kHeadDim>(threadIdx.x / kChunks + jm, threadIdx.x % kChunks);
      // L2::128B: measured faster than none and 256 bytes (bench/notes/kernels_flash_decode.md).
      cp_async_16_prefetch<128>(at, k, kFullCols ? 16 : k_bytes);
      cp_async_16_prefetch<128>(at + kVOffset, v, kFullCols ? 16 : v_bytes);
      k += kRowStep * k_row_bytes;
      v += kRowStep * v_row_bytes;
    }
  }
  __device__ __forceinline__ void advance() {
    k_src += kRows * k_row_bytes;
    v_src += kRows * v_row_bytes;
    if (++stage == kStages) {
      stage = 0;
      dst -= (kStages - 1) * kTileBytes;
    } else {
      dst += kTileBytes;
    }
  }
};

// One CTA's work: 16 packed rows (row block rb) of (batch b, kv head hkv) over one split's keys [n_start, n_end),
// n_tiles tiles of kBlockN keys. The split is cut at the last key any row of the CTA may see (causal: row i sees
// j <= i + offset, and the largest i among the packed rows is at most L - 1): a split past it loads nothing and
// writes empty rows. Keys [n_start, n_vis) are visible to every packed row (causal: up to the smallest i's limit), so
// the first n_fast = (n_vis - n_start) / kBlockN tiles are whole and need no per-key limit (the fast softmax).
// kPaged: the sequence's own key count (seqused_k) and bottom-right causal offset (causal_offset: paged only).
struct Item {
  int b, hkv, h0, r0, rows_valid, n_start, n_end, n_tiles, n_fast;
  int causal_offset;  // kPaged: S_b − L (|S − L| < 2^31)
};

template <int kBlockN, bool kPaged = false>
__device__ __forceinline__ Item make_item(const FlashDecodeParams& p, int split, int y, int b) {
  Item w;
  const int rb = y % static_cast<int>(p.row_blocks);
  const int L = static_cast<int>(p.seqlen_q), G = static_cast<int>(p.groups);
  const int S = kPaged ? min(max(p.seqused_k[b], 0), static_cast<int>(p.seqlen_k)) : static_cast<int>(p.seqlen_k);
  w.causal_offset = kPaged ? S - L : 0;  // read by the paged kernel only
  w.b = b;
  w.hkv = y / static_cast<int>(p.row_blocks);
  w.h0 = w.hkv * G;
  w.r0 = rb * 16;
  w.rows_valid = min(16, G * L - w.r0);
  w.n_start = split * static_cast<int>(p.split_keys);
  w.n_end = min(S, w.n_start + static_cast<int>(p.split_keys));
  int n_vis = w.n_end;
  if (p.is_causal) {
    int max_i = 0, min_i = L;
    for (int r = 0; r < w.rows_valid; ++r) {
      max_i = max(max_i, (w.r0 + r) % L);
      min_i = min(min_i, (w.r0 + r) % L);
    }
    // The split's keys [n_start, n_end) as a Visibility with S = n_end: the last row sees up to end_key(max_i), the
    // first only up to end_key(min_i).
    const long long causal_offset = kPaged ? static_cast<long long>(w.causal_offset) : p.causal_offset;
    w.n_end = static_cast<int>(BasicVisibility<int>{w.n_end, causal_offset, true}.end_key(max_i));
    n_vis = static_cast<int>(max(static_cast<long long>(w.n_start),
                                 BasicVisibility<int>{w.n_end, causal_offset, true}.end_key(min_i)));
  }
  w.n_tiles = w.n_end > w.n_start ? (w.n_end - w.n_start + kBlockN - 1) / kBlockN : 0;
  w.n_fast = max(0, n_vis - w.n_start) / kBlockN;
  return w;
}

// Q into sQ (16 rows, pitch kHeadDim + 8) by threads tid = 0 .. kThreads - 1: packed row r is (head h0 + (r0 + r) / L,
// row (r0 + r) % L); rows past the packed count and columns past E are zeros. 16-byte aligned rows by cp.async (the
// caller commits and waits), others by plain loads.
template <int kHeadDim, int kThreads, typename T>
__device__ __forceinline__ void load_q(T* sQ, const FlashDecodeParams& p, const Item& w, int tid) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kPitch = kHeadDim + 8;
  const int L = static_cast<int>(p.seqlen_q), E = static_cast<int>(p.head_dim);
  const bool vec_q = p.vec_flags & 1;
  const T* qbase = static_cast<const T*>(p.q) + w.b * p.q_stride_b + w.h0 * p.q_stride_h;
  for (int c = tid; c < 16 * kChunks; c += kThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const int pr = w.r0 + r;
    const T* src = qbase + (pr / L) * p.q_stride_h + (pr % L) * p.q_stride_l + col;
    const bool row_ok = r < w.rows_valid;
    if (vec_q) {
      const int bytes = row_ok ? max(0, min(16, (E - col) * 2)) : 0;
      cp_async_16(smem_addr(sQ + r * kPitch + col), bytes > 0 ? src : qbase, bytes);
    } else {
      const unsigned short* s16 = reinterpret_cast<const unsigned short*>(src);
      unsigned short e[8];
      #pragma unroll
      for (int x = 0; x < 8; ++x) e[x] = (row_ok && col + x < E) ? s16[x] : 0;
      uint4 packed4;
      packed4.x = e[0] | (unsigned(e[1]) << 16); packed4.y = e[2] | (unsigned(e[3]) << 16);
      packed4.z = e[4] | (unsigned(e[5]) << 16); packed4.w = e[6] | (unsigned(e[7]) << 16);
      *reinterpret_cast<uint4*>(sQ + r * kPitch + col) = packed4;
    }
  }
}

// A lane's two rows (g and g + 8): the last visible key (absolute; -1 for rows past the packed count) and, with a
// mask, the address of the row's mask element at key 0.
struct RowLimits {
  int limit[2];
  const unsigned char* mrow[2];
  int kind;
  long long mask_stride_s;  // bytes
};

template <bool HasMask, bool kPaged = false>
__device__ __forceinline__ RowLimits row_limits(const FlashDecodeParams& p, const Item& w, int g) {
  RowLimits rl;
  const int L = static_cast<int>(p.seqlen_q);
  rl.kind = static_cast<int>(p.mask_kind);
  const int mask_bytes = rl.kind == 1 ? 1 : rl.kind == 4 ? 4 : 2;
  rl.mask_stride_s = p.mask_stride_s * mask_bytes;
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half, pr = w.r0 + r;
    const int i = pr % L;
    const long long lim = BasicVisibility<int>{w.n_end, kPaged ? static_cast<long long>(w.causal_offset)
                                                                : p.causal_offset, p.is_causal != 0}.last_key(i);
    rl.limit[half] = r < w.rows_valid ? static_cast<int>(max(-1ll, lim)) : -1;
    rl.mrow[half] = nullptr;
    if constexpr (HasMask) {
      rl.mrow[half] = static_cast<const unsigned char*>(p.mask) +
                      (w.b * p.mask_stride_b + (w.h0 + pr / L) * p.mask_stride_h + i * p.mask_stride_l) * mask_bytes;
    }
  }
  return rl;
}

// Q's A fragments (16 rows × kHeadDim, by ldmatrix from its padded rows in shared memory). Up to kHeadDim = 128 they
// are read once and kept in registers (32 at D = 128), so a key tile issues no ldmatrix for Q; at D = 256 (64
// registers, next to O's 128) they are read again from shared memory at every k step.
template <int kHeadDim>
struct QFrags {
  static constexpr bool kInRegs = kHeadDim <= 128;
  unsigned a[kInRegs ? kHeadDim / 16 : 1][4];
  unsigned addr;

  __device__ __forceinline__ explicit QFrags(unsigned q_addr) : addr(q_addr) {
    if constexpr (kInRegs) {
      #pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) ldmatrix_x4(a[kk], addr + kk * 16 * 2);
    }
  }
  __device__ __forceinline__ void get(int kk, unsigned (&r)[4]) const {
    if constexpr (kInRegs) {
      #pragma unroll
      for (int x = 0; x < 4; ++x) r[x] = a[kk][x];
    } else {
      ldmatrix_x4(r, addr + kk * 16 * 2);
    }
  }
};

// How a warp treats one key tile (warp-uniform). kTileGeneral: per-key limits (split end, causal), the mask, and the
// exact online softmax. kTileFast2 / kTileFast1: every key of the tile is visible to every packed row (one of the
// CTA's first n_fast tiles), no mask and scale >= 0; Fast1 when rows 8..15 are all padding (g·L <= 8 packed rows:
// their softmax is skipped and their P is 0).
enum : int { kTileGeneral = 0, kTileFast1 = 1, kTileFast2 = 2 };

// The fast path's lazy rescale (FlashAttention-4's trick): the running max m of a row moves only when a tile's max
// exceeds it by more than this many log2 units, so P = 2^(s − m) <= 2^8 (exact in fp32 and in P's fp16/bf16 range)
// and the kHeadDim/2 multiplies of O by 2^(m_old − m_new) run on a few tiles per row instead of on every tile where
// the max grows a little. O and l always refer to the same m, so the result is the same.
constexpr float kRescaleLog2 = 8.f;

// Scale, mask, and the online softmax per row half (kTileGeneral); P goes to A fragments as it is produced.
template <typename T, int kHeadDim, int kWarpN, bool HasMask>
__device__ __forceinline__ void softmax_general(float (&s)[kWarpN / 8][4], unsigned (&pa)[kWarpN / 16][4],
                                                float (&acc_o)[kHeadDim / 8][4], float (&m_i)[2], float (&l_i)[2],
                                                int n0w, const RowLimits& rl, float scale_log2, int t) {
  constexpr int kNTiles = kWarpN / 8;
  constexpr int kDTiles = kHeadDim / 8;
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    // Element (ni, e) is key n0w + 8·ni + 2t + e; visible iff that key <= limit (clamped to fit an int).
    const int lim = max(-1, min(kWarpN, rl.limit[half] - n0w - 2 * t));
    #pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni) {
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = s[ni][2 * half + e] * scale_log2;
        if constexpr (HasMask) {
          if (ni * 8 + e <= lim) x += mask_value(rl.mrow[half] + (n0w + ni * 8 + 2 * t + e) * rl.mask_stride_s, rl.kind);
        }
        s[ni][2 * half + e] = ni * 8 + e > lim ? neg_inf() : x;
      }
    }
    float mx = neg_inf();
    #pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni) mx = fmaxf(mx, fmaxf(s[ni][2 * half], s[ni][2 * half + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_old = m_i[half];
    const float m_new = fmaxf(m_old, mx);
    const float m_use = m_new == neg_inf() ? 0.f : m_new;  // empty so far: 2^(-inf - 0) = 0 keeps P and α at 0
    m_i[half] = m_new;
    float sum = 0.f;
    #pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni) {
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[ni][2 * half + e] = exp2_approx(s[ni][2 * half + e] - m_use);
        sum += s[ni][2 * half + e];
      }
    }
    #pragma unroll
    for (int kk = 0; kk < kWarpN / 16; ++kk) {
      pa[kk][half] = pack2<T>(s[2 * kk][2 * half], s[2 * kk][2 * half + 1]);
      pa[kk][2 + half] = pack2<T>(s[2 * kk + 1][2 * half], s[2 * kk + 1][2 * half + 1]);
    }
    const float alpha = exp2_approx(m_old - m_use);
    l_i[half] = l_i[half] * alpha + sum;
    #pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      acc_o[dt][2 * half] *= alpha;
      acc_o[dt][2 * half + 1] *= alpha;
    }
  }
}

// The online softmax of a whole, unmasked tile (kTileFast1 / kTileFast2; scale_log2 >= 0). With scale >= 0 the max
// of the scaled scores is the scaled max of the raw ones, so each score costs one FFMA (s·scale − m) and one ex2;
// the running max moves lazily (kRescaleLog2), decided once per warp. Rows past kHalves·8 are skipped (P = 0).
template <typename T, int kHeadDim, int kWarpN, int kHalves>
__device__ __forceinline__ void softmax_fast(float (&s)[kWarpN / 8][4], unsigned (&pa)[kWarpN / 16][4],
                                             float (&acc_o)[kHeadDim / 8][4], float (&m_i)[2], float (&l_i)[2],
                                             float scale_log2) {
  constexpr int kNTiles = kWarpN / 8;
  constexpr int kDTiles = kHeadDim / 8;
  float mx[kHalves];
  bool grow = false;
  #pragma unroll
  for (int half = 0; half < kHalves; ++half) {
    float x = fmaxf(s[0][2 * half], s[0][2 * half + 1]);
    #pragma unroll
    for (int ni = 1; ni < kNTiles; ++ni) x = fmaxf(x, fmaxf(s[ni][2 * half], s[ni][2 * half + 1]));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    mx[half] = x * scale_log2;
    grow |= mx[half] > m_i[half] + kRescaleLog2;  // also true on a row's first tile (m = -inf)
  }
  if (__any_sync(0xffffffffu, grow)) {
    #pragma unroll
    for (int half = 0; half < kHalves; ++half) {
      const float m_new = fmaxf(m_i[half], mx[half]);  // finite: every key of the tile is visible
      const float alpha = exp2_approx(m_i[half] - m_new);
      m_i[half] = m_new;
      l_i[half] *= alpha;
      #pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        acc_o[dt][2 * half] *= alpha;
        acc_o[dt][2 * half + 1] *= alpha;
      }
    }
  }
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (half < kHalves) {
      const float neg_m = -m_i[half];
      float sum = 0.f;
      #pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[ni][2 * half + e] = exp2_approx(fmaf(s[ni][2 * half + e], scale_log2, neg_m));
          sum += s[ni][2 * half + e];
        }
      }
      l_i[half] += sum;
      #pragma unroll
      for (int kk = 0; kk < kWarpN / 16; ++kk) {
        pa[kk][half] = pack2<T>(s[2 * kk][2 * half], s[2 * kk][2 * half + 1]);
        pa[kk][2 + half] = pack2<T>(s[2 * kk + 1][2 * half], s[2 * kk + 1][2 * half + 1]);
      }
    } else {
      #pragma unroll
      for (int kk = 0; kk < kWarpN / 16; ++kk) pa[kk][half] = pa[kk][2 + half] = 0u;
    }
  }
}

// One warp's kWarpN keys of a tile, first key n0w: S = Q Kᵀ, the softmax of `mode` (kTileGeneral / kTileFast*),
// O += P V (see the file header). k_at(nj, kk): the ldmatrix_x4 address of K rows [16 nj, 16 nj + 16) × columns
// [16 kk, 16 kk + 16) of the warp's slice; v_at(kk, dn): the ldmatrix_x4_trans address of V rows [16 kk, ...) ×
// columns [16 dn, ...). The shared-memory layout (padded rows, or TMA's 128-byte swizzle) lives in these two
// functions only.
template <typename T, int kHeadDim, int kWarpN, bool HasMask, typename KAt, typename VAt>
__device__ __forceinline__ void attend(float (&acc_o)[kHeadDim / 8][4], float (&m_i)[2], float (&l_i)[2],
                                       const QFrags<kHeadDim>& q, KAt k_at, VAt v_at, int n0w, const RowLimits& rl,
                                       float scale_log2, int t, int mode) {
  constexpr int kNTiles = kWarpN / 8;
  float s[kNTiles][4];
  #pragma unroll
  for (int ni = 0; ni < kNTiles; ++ni)
    #pragma unroll
    for (int e = 0; e < 4; ++e) s[ni][e] = 0.f;
  #pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    unsigned a[4];
    q.get(kk, a);
    #pragma unroll
    for (int nj = 0; nj < kWarpN / 16; ++nj) {
      unsigned bk[4];
      ldmatrix_x4(bk, k_at(nj, kk));
      mma_16816<T>(s[2 * nj], a, bk[0], bk[1]);
      mma_16816<T>(s[2 * nj + 1], a, bk[2], bk[3]);
    }
  }

  unsigned pa[kWarpN / 16][4];
  if (HasMask || mode == kTileGeneral) {
    softmax_general<T, kHeadDim, kWarpN, HasMask>(s, pa, acc_o, m_i, l_i, n0w, rl, scale_log2, t);
  } else if constexpr (!HasMask) {
    if (mode == kTileFast2) softmax_fast<T, kHeadDim, kWarpN, 2>(s, pa, acc_o, m_i, l_i, scale_log2);
    else softmax_fast<T, kHeadDim, kWarpN, 1>(s, pa, acc_o, m_i, l_i, scale_log2);
  }

  #pragma unroll
  for (int kk = 0; kk < kWarpN / 16; ++kk) {
    #pragma unroll
    for (int dn = 0; dn < kHeadDim / 16; ++dn) {
      unsigned bv[4];
      ldmatrix_x4_trans(bv, v_at(kk, dn));
      mma_16816<T>(acc_o[2 * dn], pa[kk], bv[0], bv[1]);
      mma_16816<T>(acc_o[2 * dn + 1], pa[kk], bv[2], bv[3]);
    }
  }
}

// The fast mode of a CTA's first n_fast tiles (kTileGeneral where they cannot be fast: a mask, or scale < 0).
template <bool HasMask>
__device__ __forceinline__ int fast_mode(const Item& w, float scale_log2) {
  if (HasMask || !(scale_log2 >= 0.f)) return kTileGeneral;
  return w.rows_valid <= 8 ? kTileFast1 : kTileFast2;
}

// Merge the warps' partial rows through shared memory `scratch` (kNWarps × 16 × (kHeadDim + 2) floats) and write the
// CTA's rows: out and lse (one split) or the split's normalized partials. Per row: m = max_w m_w, l = Σ_w
// 2^(m_w - m)·l_w, O = Σ_w 2^(m_w - m)·O_w / l; l = 0 (no visible key) gives O = 0 and lse = -inf. Threads tid =
// 0 .. kThreads - 1 (kNWarps warps) take part; sync() is their barrier between the writes and the reads.
template <typename T, int kHeadDim, int kNWarps, typename Sync>
__device__ __forceinline__ void merge_store(float* scratch, const float (&acc_o)[kHeadDim / 8][4], const float (&m_i)[2],
                                            const float (&l_i)[2], const FlashDecodeParams& p, const Item& w,
                                            int split, int tid, Sync sync) {
  constexpr int kRows = 16, kThreads = kNWarps * 32;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  float* sO = scratch;                                    // [kNWarps][16][kHeadDim]
  float* sM = sO + kNWarps * kRows * kHeadDim;            // [kNWarps][16]
  float* sL = sM + kNWarps * kRows;                       // [kNWarps][16]
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
    float l = l_i[half];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t == 0) {
      sM[warp * kRows + r] = m_i[half];
      sL[warp * kRows + r] = l;
    }
    float* orow = sO + (warp * kRows + r) * kHeadDim;
    #pragma unroll
    for (int dt = 0; dt < kHeadDim / 8; ++dt)
      *reinterpret_cast<float2*>(orow + dt * 8 + 2 * t) = make_float2(acc_o[dt][2 * half], acc_o[dt][2 * half + 1]);
  }
  sync();

  const int L = static_cast<int>(p.seqlen_q), Ev = static_cast<int>(p.head_dim_v);
  const bool direct = p.num_splits == 1;
  const long long R = p.batch * p.num_heads * L;  // rows of the workspace, (b, h, i) order
  for (int x = tid; x < w.rows_valid * Ev; x += kThreads) {
    const int r = x / Ev, c = x % Ev;
    float m = neg_inf();
    #pragma unroll
    for (int v = 0; v < kNWarps; ++v) m = fmaxf(m, sM[v * kRows + r]);
    float l = 0.f, o = 0.f;
    #pragma unroll
    for (int v = 0; v < kNWarps; ++v) {
      const float mw = sM[v * kRows + r];
      const float f = mw == neg_inf() ? 0.f : exp2_approx(mw - m);
      l += f * sL[v * kRows + r];
      o += f * sO[(v * kRows + r) * kHeadDim + c];
    }
    o = l > 0.f ? o / l : 0.f;
    const float lse = l > 0.f ? (m + __log2f(l)) * kLn2 : neg_inf();
    const int pr = w.r0 + r, h = w.h0 + pr / L, i = pr % L;
    if (direct) {
      static_cast<T*>(p.out)[w.b * p.out_stride_b + h * p.out_stride_h + i * p.out_stride_l + c] = from_float<T>(o);
      if (c == 0 && p.lse) p.lse[w.b * p.lse_stride_b + h * p.lse_stride_h + i * p.lse_stride_l] = lse;
    } else {
      const long long row = split * R + (static_cast<long long>(w.b) * p.num_heads + h) * L + i;
      p.o_part[row * Ev + c] = o;
      if (c == 0) p.lse_part[row] = lse;
    }
  }
}

// A lane's online-softmax state at the start of its key range: O = 0, running max −inf, row sums 0.
template <int kDTiles>
__device__ __forceinline__ void zero_state(float (&acc_o)[kDTiles][4], float (&m_i)[2], float (&l_i)[2]) {
  #pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
    #pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[dt][e] = 0.f;
  m_i[0] = m_i[1] = neg_inf();
  l_i[0] = l_i[1] = 0.f;
}

}  // namespace decode

// One CTA: 16 packed rows of one (batch, kv head) over one split's keys, every thread loading K/V by cp.async into a
// kStages ring of padded rows. See the header for the mapping.
// kPaged (flash_decode_paged's instantiations, no mask): each tile's rows from its page (FlashDecodeParams'
// block_table), each sequence's own key count (seqused_k) and bottom-right causal offset.
template <typename T, int kHeadDim, int kBlockN, int kNWarps, int kStages, bool HasMask, bool kPaged = false>
__global__ void __launch_bounds__(kNWarps * 32) flash_decode(const FlashDecodeParams p) {
  using namespace decode;
  constexpr int kThreads = kNWarps * 32;
  constexpr int kRows = 16;
  constexpr int kWarpN = kBlockN / kNWarps;  // keys per warp per tile
  constexpr int kDTiles = kHeadDim / 8;      // 8-column O tiles
  constexpr int kPitch = kHeadDim + 8;            // Q rows
  constexpr int kTileElems = kBlockN * kHeadDim;  // one K or V tile (swizzled rows, kv_offset)
  constexpr int kRowBytes = kHeadDim * 2;
  static_assert(kWarpN % 16 == 0 && kHeadDim % 16 == 0, "mma k steps are 16 wide (P·V needs 16 keys per warp)");
  static_assert(kStages >= 2, "at least one tile in flight while one is consumed");
  // The merge scratch (per warp: m, l and a 16 × kHeadDim fp32 O) reuses the K/V buffers.
  static_assert(kNWarps * kRows * (kHeadDim + 2) * 4 <= 2 * kStages * kTileElems * 2, "merge scratch fits");
  pdl_launch_dependents();  // the combine kernel (PDL-launched) may start; it waits for this grid's partials

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // K/V from the base aligned up to a row (kRowBytes; DecodeTile.smem_bytes holds the slack), so that a lane's
  // swizzled ldmatrix address is its row's address XOR-ed with an immediate (below).
  T* sK = reinterpret_cast<T*>(smem_raw + (kRowBytes - smem_addr(smem_raw) % kRowBytes) % kRowBytes);  // kStages K
  T* sV = sK + kStages * kTileElems;        // kStages V tiles
  T* sQ = sV + kStages * kTileElems;        // 16 rows, pitch kPitch

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int split = blockIdx.x;
  const Item w = make_item<kBlockN, kPaged>(p, split, blockIdx.y, blockIdx.z);
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.head_dim_v);

  constexpr unsigned kTileBytes = kTileElems * 2;
  const bool vec_k = p.vec_flags & 2, vec_v = p.vec_flags & 4;
  const T* kbase = static_cast<const T*>(p.k) + w.b * p.k_stride_b + w.hkv * p.k_stride_h;
  const T* vbase = static_cast<const T*>(p.v) + w.b * p.v_stride_b + w.hkv * p.v_stride_h;
  // Tiles are loaded in order, one per call: whole tiles of 16-byte aligned rows by TileCopy, the split's last,
  // partial tile and unaligned rows by load_kv.
  TileCopy<kBlockN, kHeadDim, kThreads, kStages> copy(kbase + w.n_start * p.k_stride_s, p.k_stride_s, E,
                                                      vbase + w.n_start * p.v_stride_s, p.v_stride_s, Ev, smem_addr(sK));
  const bool vec_kv = vec_k && vec_v, full_cols = E == kHeadDim && Ev == kHeadDim;
  int n_load = w.n_start;  // first key of the next tile to load
  auto load_next = [&] {
    if constexpr (kPaged) {  // the tile's page (a tile never crosses one: page_size is a multiple of kBlockN)
      const int ps = static_cast<int>(p.page_size);
      const long long row = static_cast<long long>(p.block_table[w.b * p.max_blocks + n_load / ps]) * ps + n_load % ps;
      const T* kt = static_cast<const T*>(p.k) + row * p.k_stride_s + w.hkv * p.k_stride_h;
      const T* vt = static_cast<const T*>(p.v) + row * p.v_stride_s + w.hkv * p.v_stride_h;
      if (vec_kv && n_load + kBlockN <= w.n_end) {
        copy.rebase(kt, vt);
        if (full_cols) copy.template copy<true>();
        else copy.template copy<false>();
      } else {
        const int off = copy.stage * kTileElems;
        load_kv<kBlockN, kHeadDim, kThreads>(sK + off, kt, p.k_stride_s, w.n_end - n_load, E, vec_k);
        load_kv<kBlockN, kHeadDim, kThreads>(sV + off, vt, p.v_stride_s, w.n_end - n_load, Ev, vec_v);
      }
    } else if (vec_kv && n_load + kBlockN <= w.n_end) {
      if (full_cols) copy.template copy<true>();
      else copy.template copy<false>();
    } else {
      const int off = copy.stage * kTileElems;
      load_kv<kBlockN, kHeadDim, kThreads>(sK + off, kbase + n_load * p.k_stride_s, p.k_stride_s, w.n_end - n_load, E,
                                           vec_k);
      load_kv<kBlockN, kHeadDim, kThreads>(sV + off, vbase + n_load * p.v_stride_s, p.v_stride_s, w.n_end - n_load, Ev,
                                           vec_v);
    }
    copy.advance();
    n_load += kBlockN;
  };

  load_q<kHeadDim, kThreads>(sQ, p, w, threadIdx.x);
  // Prologue: Q joins tile 0's group; tiles 0 .. kStages-2 in flight, one commit group each (empty groups past the
  // last tile keep the wait_group count uniform).
  #pragma unroll
  for (int it = 0; it < kStages - 1; ++it) {
    if (it < w.n_tiles) load_next();
    cp_async_commit();
  }

  const RowLimits rl = row_limits<HasMask, kPaged>(p, w, g);

  // ldmatrix lane addresses (common/mma.cuh); K and V at this warp's key slice of the tile. A lane's K/V row is
  // ≡ lane % 8 (mod 8) at every k step, so its swizzled chunk (kv_offset) at logical chunk 2·step + c is at byte
  // ((c ^ lane % 8) << 4) ^ (step · 32) of the row: with rows aligned to kRowBytes, the address of step 0 XOR-ed
  // with the immediate step · 32 (one LOP3 per step, shared by the step's ldmatrix).
  const unsigned q_addr = smem_addr(sQ + (lane % 16) * kPitch + (lane / 16) * 8);
  const unsigned k_addr = smem_addr(sK) + (warp * kWarpN + (lane / 16) * 8 + lane % 8) * kRowBytes +
                          ((((lane / 8) % 2) ^ (lane % 8)) << 4);
  const unsigned v_addr = smem_addr(sV) + (warp * kWarpN + ((lane / 8) % 2) * 8 + lane % 8) * kRowBytes +
                          (((lane / 16) ^ (lane % 8)) << 4);
  const float scale_log2 = static_cast<float>(p.scale_log2);
  const int mode_fast = fast_mode<HasMask>(w, scale_log2);

  float acc_o[kDTiles][4];
  float m_i[2], l_i[2];  // running max (log2 units) and this lane's partial row sum
  zero_state(acc_o, m_i, l_i);

  // Q (in tile 0's group) into registers once: the loop's first wait and barrier then return at once.
  cp_async_wait<kStages - 2>();
  __syncthreads();
  const QFrags<kHeadDim> q(q_addr);

  // Loop-carried, so that the compiler does not recompute them from threadIdx in every iteration: the ldmatrix
  // addresses of tile it's stage, and its softmax mode (mode_fast for the first n_fast tiles).
  unsigned k_stage = k_addr, v_stage = v_addr;
  int read_stage = 0, fast_left = w.n_fast, mode = w.n_fast > 0 ? mode_fast : kTileGeneral;
  #pragma unroll 1
  for (int it = 0; it < w.n_tiles; ++it) {
    cp_async_wait<kStages - 2>();  // tile it landed: at most kStages - 2 newer groups still pending
    __syncthreads();               // ... for every thread; and every warp is done with tile it - 1, refilled next
    if (it + kStages - 1 < w.n_tiles) load_next();
    cp_async_commit();

    attend<T, kHeadDim, kWarpN, HasMask>(
        acc_o, m_i, l_i, q,
        [&](int nj, int kk) { return (k_stage ^ (kk * 32)) + nj * 16 * kRowBytes; },
        [&](int kk, int dn) { return (v_stage ^ (dn * 32)) + kk * 16 * kRowBytes; },
        w.n_start + it * kBlockN + warp * kWarpN, rl, scale_log2, t, mode);
    if (++read_stage == kStages) {
      read_stage = 0;
      k_stage -= (kStages - 1) * kTileBytes;
      v_stage -= (kStages - 1) * kTileBytes;
    } else {
      k_stage += kTileBytes;
      v_stage += kTileBytes;
    }
    if (--fast_left == 0) mode = kTileGeneral;
  }

  // The merge reuses the K/V space: no copy is pending after the wait, and no warp reads K/V after the barrier.
  cp_async_wait<0>();
  __syncthreads();
  merge_store<T, kHeadDim, kNWarps>(reinterpret_cast<float*>(sK), acc_o, m_i, l_i, p, w, split, threadIdx.x,
                                    [] { __syncthreads(); });
}

// Parameters of flash_decode_sm90: the K and V tensor maps, then FlashDecodeParams (its pointers k and v unused).
// Passed as one __grid_constant__ parameter, so that the maps stay in the parameter space, where TMA reads them by
// address. Declared in NumPy as well (cupy_attn/attention/decode.py: _SM90_PARAMS); sizes asserted at compile time.
struct FlashDecodeSm90Params {
  tma::TensorMap tma_k;  // K as (E, S, Hkv, B), box (64, kBlockN, 1, 1), 128-byte swizzle
  tma::TensorMap tma_v;  // V as (Ev, S, Hkv, B), box (64, kBlockN, 1, 1), 128-byte swizzle
  FlashDecodeParams p;
};

namespace decode {

// Shared memory of flash_decode_sm90, from a base aligned up to 1024 bytes (the 128-byte swizzle's atoms): kStages
// K tiles, kStages V tiles (each kHeadDim / 64 column blocks of kBlockN rows × 128 bytes, one TMA box each), Q
// (16 rows, pitch kHeadDim + 8, as flash_decode's), and the full / empty mbarrier of each stage.
// StreamTile.smem_bytes in cupy_attn/attention/decode.py is kBytes.
template <int kHeadDim, int kBlockN, int kStages>
struct StreamSmem {
  static constexpr int kTileBytes = kBlockN * kHeadDim * 2;    // one K or V stage
  static constexpr int kQBytes = 16 * (kHeadDim + 8) * 2;
  static constexpr int kBytes = 1024 + 2 * kStages * kTileBytes + kQBytes + 16 * kStages;

  unsigned char* k;  // stage s at k + s · kTileBytes
  unsigned char* v;
  unsigned char* q;
  pipeline::Ring<kStages> bars;  // full: the producer's expect_tx + the TMA bytes; empty: each consumer warp

  __device__ __forceinline__ explicit StreamSmem(unsigned char* base) {
    k = sm90::smem_base(base);
    v = k + kStages * kTileBytes;
    q = v + kStages * kTileBytes;
    bars.full = reinterpret_cast<unsigned long long*>(q + kQBytes);
    bars.empty = bars.full + kStages;
  }
};

}  // namespace decode

// The streaming variant for Hopper (sm_90a; CUPY_ATTN_DECODE=2 or 3): the same work per CTA and the same math as
// flash_decode (attend, merge_store), but K/V arrive by TMA (cp.async.bulk.tensor, 128-byte swizzle) into a kStages
// mbarrier ring, issued by one thread of a producer warp (warp kNWarps) while kNWarps consumer warps compute. Nothing
// in the loop is a CTA-wide barrier: a stage is refilled as soon as the last consumer warp has released it, so
// kStages - 1 to kStages tiles are in flight continuously, from 4 (K boxes) + 4 (V boxes) instructions per 64-key
// tile at D = 128, where flash_decode needs 2 cp.async per thread and a __syncthreads per tile.
// The tensor maps bound each (b, kv head) at S rows and E (Ev) columns: rows past S and columns past E arrive as
// zeros (and count toward the barrier's bytes); column blocks wholly past E (Ev) are not loaded and stay at the
// zeros written at the start. Keys in [n_end, tile end) below S arrive as real data: masked by the row limits, and
// their V rows zeroed by the consumers (only in a split's last tile).
// kPaged (flash_decode_sm90_paged, no mask): the maps span the whole cache as one sequence of num_pages·page_size
// rows (B = 1); a tile's rows come from its page (block_table; page_size a multiple of kBlockN, so no tile crosses
// one) and each sequence has its own key count (seqused_k). Rows of a page past the sequence's keys are other data:
// masked and zeroed like the keys past n_end above.
template <typename T, int kHeadDim, int kBlockN, int kNWarps, int kStages, int kMinBlocks, bool HasMask,
          bool kPaged = false>
__global__ void __launch_bounds__((kNWarps + 1) * 32, kMinBlocks)
    flash_decode_sm90(const __grid_constant__ FlashDecodeSm90Params P) {
  using namespace decode;
  using Smem = StreamSmem<kHeadDim, kBlockN, kStages>;
  const FlashDecodeParams& p = P.p;
  constexpr int kThreads = kNWarps * 32;     // consumers
  constexpr int kWarpN = kBlockN / kNWarps;  // keys per consumer warp per tile
  constexpr int kDTiles = kHeadDim / 8;
  constexpr int kColBlocks = kHeadDim / 64;  // 128-byte swizzle atoms hold 64 16-bit columns
  constexpr int kPitch = kHeadDim + 8;       // Q rows
  constexpr int kConsumerBarrier = 1;        // named barrier of the consumer warps (0 is __syncthreads)
  static_assert(kWarpN % 16 == 0 && kHeadDim % 64 == 0, "16 keys per warp per P·V step, 64-column TMA boxes");
  static_assert(kBlockN % 8 == 0 && kBlockN <= 256, "8-row swizzle atoms, TMA box rows <= 256");
  static_assert(kStages >= 2, "a ring of at least two stages");
  static_assert(Smem::kBytes <= sm90::kMaxSmemBytes, "227 KB of shared memory per block");
  static_assert(kNWarps * 16 * (kHeadDim + 2) * 4 <= 2 * kStages * Smem::kTileBytes, "merge scratch fits the ring");
  pdl_launch_dependents();  // the combine kernel (PDL-launched) may start; it waits for this grid's partials

  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Smem ss(smem_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int split = blockIdx.x;
  const Item w = make_item<kBlockN, kPaged>(p, split, blockIdx.y, blockIdx.z);
  const int E = static_cast<int>(p.head_dim), Ev = static_cast<int>(p.head_dim_v);
  const int kb_k = (E + 63) / 64, kb_v = (Ev + 63) / 64;  // column blocks TMA loads; the rest stay zero

  pipeline::init_barriers([&] { ss.bars.init(kNWarps); });  // empty: each consumer warp

  if (warp == kNWarps) {
    // Producer: tile it fills ring iteration it (common/pipeline.cuh).
    if (lane == 0 && w.n_tiles > 0) {
      tma::prefetch_map(&P.tma_k);
      tma::prefetch_map(&P.tma_v);
      #pragma unroll 1
      for (int it = 0; it < w.n_tiles; ++it) {
        const int s = ss.bars.stage(it), n0 = w.n_start + it * kBlockN;
        int row = n0, b = w.b;  // the tile's first row and batch coordinate in the maps
        if constexpr (kPaged) {
          const int ps = static_cast<int>(p.page_size);
          row = p.block_table[w.b * p.max_blocks + n0 / ps] * ps + n0 % ps;
          b = 0;
        }
        unsigned long long* full = ss.bars.acquire(it, (kb_k + kb_v) * kBlockN * 128);
        #pragma unroll 1
        for (int c = 0; c < kb_k; ++c)
          tma::load_4d(ss.k + s * Smem::kTileBytes + c * kBlockN * 128, &P.tma_k, full, c * 64, row, w.hkv, b);
        #pragma unroll 1
        for (int c = 0; c < kb_v; ++c)
          tma::load_4d(ss.v + s * Smem::kTileBytes + c * kBlockN * 128, &P.tma_v, full, c * 64, row, w.hkv, b);
      }
    }
    return;
  }

  // Consumers (threadIdx.x < kThreads). Q while the first tiles are in flight; zeros in the column blocks TMA never
  // writes (E or Ev below the bucket by 64 or more), in every stage.
  const int tid = threadIdx.x, g = lane / 4, t = lane % 4;
  T* sQ = reinterpret_cast<T*>(ss.q);
  load_q<kHeadDim, kThreads>(sQ, p, w, tid);
  cp_async_commit();
  if (kb_k < kColBlocks || kb_v < kColBlocks) {
    constexpr int kBlockChunks = kBlockN * 128 / 16;  // 16-byte chunks per column block
    for (int x = tid; x < kStages * kColBlocks * kBlockChunks; x += kThreads) {
      const int s = x / (kColBlocks * kBlockChunks), c = (x / kBlockChunks) % kColBlocks, off = x % kBlockChunks;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      if (c >= kb_k) reinterpret_cast<uint4*>(ss.k + s * Smem::kTileBytes + c * kBlockN * 128)[off] = zero;
      if (c >= kb_v) reinterpret_cast<uint4*>(ss.v + s * Smem::kTileBytes + c * kBlockN * 128)[off] = zero;
    }
  }
  cp_async_wait<0>();
  tma::named_barrier_sync(kConsumerBarrier, kThreads);

  const RowLimits rl = row_limits<HasMask, kPaged>(p, w, g);
  // ldmatrix lane addresses. Q: padded rows, as flash_decode. K and V: the 16-byte chunk c of row n (n % 8 = lane % 8
  // for every address below, all row offsets being multiples of 8) sits at chunk (c % 8) ^ (n % 8) of its 128-byte
  // row segment, in column block c / 8 (kBlockN · 128 bytes apart). K's chunk is 2·(kk % 4) + (lane / 8) % 2, V's
  // 2·(dn % 4) + lane / 16; as 2·(kk % 4) has bit 0 clear, the XOR splits into a per-lane constant xk (xv) and
  // 2·(kk % 4) (2·(dn % 4)). Eight rows of one 8 × 8 matrix hit eight different chunks: no bank conflicts.
  const unsigned q_addr = smem_addr(sQ + (lane % 16) * kPitch + (lane / 16) * 8);
  const unsigned k_lane = smem_addr(ss.k) + (warp * kWarpN + (lane / 16) * 8 + lane % 8) * 128;
  const unsigned v_lane = smem_addr(ss.v) + (warp * kWarpN + ((lane / 8) % 2) * 8 + lane % 8) * 128;
  const unsigned xk = ((lane / 8) % 2) ^ (lane % 8), xv = (lane / 16) ^ (lane % 8);
  const float scale_log2 = static_cast<float>(p.scale_log2);
  const int mode_fast = fast_mode<HasMask>(w, scale_log2);
  const QFrags<kHeadDim> q(q_addr);  // Q landed (the barrier above)

  float acc_o[kDTiles][4];
  float m_i[2], l_i[2];
  zero_state(acc_o, m_i, l_i);

  #pragma unroll 1
  for (int it = 0; it < w.n_tiles; ++it) {
    const int s = ss.bars.wait(it);
    // The split's last tile may run past n_end into keys below S (the next split's, or past a causal limit), which
    // arrive as real data: zero this warp's V rows there, as flash_decode's loads do (P is 0 there, but 0 · inf or
    // NaN is NaN). Each warp reads only its own kWarpN rows, so __syncwarp orders the writes before its ldmatrix.
    const int valid = w.n_end - w.n_start - it * kBlockN;
    if (valid < (warp + 1) * kWarpN) {
      constexpr int kRowChunks = kHeadDim / 8;  // 16-byte chunks of a row, over all column blocks
      unsigned char* vs = ss.v + s * Smem::kTileBytes;
      const int r0 = max(valid, warp * kWarpN);
      for (int x = lane; x < ((warp + 1) * kWarpN - r0) * kRowChunks; x += 32) {
        const int r = r0 + x / kRowChunks, c = x % kRowChunks;  // the swizzle permutes chunks within the row
        *reinterpret_cast<uint4*>(vs + (c / 8) * kBlockN * 128 + r * 128 + (c % 8) * 16) = make_uint4(0, 0, 0, 0);
      }
      __syncwarp();
    }
    const unsigned k_st = k_lane + s * Smem::kTileBytes, v_st = v_lane + s * Smem::kTileBytes;
    attend<T, kHeadDim, kWarpN, HasMask>(
        acc_o, m_i, l_i, q,
        [&](int nj, int kk) { return k_st + (kk / 4) * kBlockN * 128 + nj * 16 * 128 + (((kk % 4) * 2) ^ xk) * 16; },
        [&](int kk, int dn) { return v_st + (dn / 4) * kBlockN * 128 + kk * 16 * 128 + (((dn % 4) * 2) ^ xv) * 16; },
        w.n_start + it * kBlockN + warp * kWarpN, rl, scale_log2, t, it < w.n_fast ? mode_fast : kTileGeneral);
    // Release the stage once every lane's ldmatrix of it has returned.
    ss.bars.release(it, lane);
  }

  // The merge reuses the ring: every TMA load issued has landed (each full barrier was waited for), and after the
  // barrier no consumer warp reads K/V any more; the producer has issued its last load.
  tma::named_barrier_sync(kConsumerBarrier, kThreads);
  merge_store<T, kHeadDim, kNWarps>(reinterpret_cast<float*>(ss.k), acc_o, m_i, l_i, p, w, split, tid,
                                    [] { tma::named_barrier_sync(kConsumerBarrier, kThreads); });
}

// Merge the splits' partials of one output row per CTA: lse = log Σ_s exp(lse_s) (max-shifted), out = Σ_s
// exp(lse_s - lse)·O_s. Splits with lse_s = -inf (no visible key) are skipped; all of them: out 0, lse -inf.
template <typename T>
__global__ void __launch_bounds__(128) flash_decode_combine(const FlashDecodeParams p) {
  using namespace decode;
  pdl_wait();  // launched as a programmatic dependent of the split kernel on sm_90+: its partials
  const long long L = p.seqlen_q, R = p.batch * p.num_heads * L;
  const long long row = blockIdx.x;
  const int Ev = static_cast<int>(p.head_dim_v), n = static_cast<int>(p.num_splits);
  float m = neg_inf();
  for (int s = 0; s < n; ++s) m = fmaxf(m, p.lse_part[s * R + row]);
  float denom = 0.f;
  if (m != neg_inf())
    for (int s = 0; s < n; ++s) denom += __expf(p.lse_part[s * R + row] - m);  // exp(-inf) = 0
  const float lse = m == neg_inf() ? neg_inf() : m + __logf(denom);
  const long long b = row / (p.num_heads * L), h = (row / L) % p.num_heads, i = row % L;
  T* out = static_cast<T*>(p.out) + b * p.out_stride_b + h * p.out_stride_h + i * p.out_stride_l;
  for (int c = threadIdx.x; c < Ev; c += blockDim.x) {
    float o = 0.f;
    if (m != neg_inf()) {
      for (int s = 0; s < n; ++s) {
        const float ls = p.lse_part[s * R + row];
        if (ls != neg_inf()) o += __expf(ls - lse) * p.o_part[(s * R + row) * Ev + c];
      }
    }
    out[c] = from_float<T>(o);
  }
  if (threadIdx.x == 0 && p.lse) p.lse[b * p.lse_stride_b + h * p.lse_stride_h + i * p.lse_stride_l] = lse;
}

}  // namespace cupy_attn
