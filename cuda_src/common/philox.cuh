// Philox4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"; Random123) and the attention
// dropout keep decision built on it. The definition lives in cupy_attn/philox.py (NumPy, the reference's and the tests'
// mask); this header reproduces it bit for bit:
//   key = (seed lo, seed hi), counter = (j >> 1, i >> 1, bh, offset lo), r = philox(counter, key)[2·(i & 1) + (j & 1)],
//   keep = r < threshold (threshold = round((1 − p)·2^32) clamped, computed once on the host: dropout_threshold).
// One Philox block decides a 2×2 tile of P (rows i, i^1; columns j, j^1), so kernels that hold adjacent pairs of one
// axis fetch the other pair from the lane that holds it (one shuffle) instead of drawing twice.
// Cost: 10 rounds of two 32×32→64 multiplies (IMAD.WIDE / IMAD.HI) and four XORs: ~60 integer instructions per block.
#pragma once

namespace cupy_attn {

constexpr unsigned kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr unsigned kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned k0, unsigned k1) {
  #pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    const unsigned hi0 = __umulhi(kPhiloxM0, c.x), lo0 = kPhiloxM0 * c.x;
    const unsigned hi1 = __umulhi(kPhiloxM1, c.z), lo1 = kPhiloxM1 * c.z;
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
  }
  return c;
}

// One call's dropout: the Philox key and counter word from its (seed, offset) pair (read from device memory, where a
// graph-safe draw of the caller's generator put them), and the keep threshold.
struct Dropout {
  unsigned k0, k1, offset, threshold;

  // rng: int64 {seed, offset} in device memory.
  __device__ __forceinline__ static Dropout load(const long long* rng, long long threshold) {
    const unsigned long long seed = static_cast<unsigned long long>(rng[0]);
    return Dropout{static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32),
                   static_cast<unsigned>(static_cast<unsigned long long>(rng[1])), static_cast<unsigned>(threshold)};
  }

  // Keep bits of the 2×2 tile at rows 2·i2, 2·i2 + 1 and columns 2·j2, 2·j2 + 1 of head bh: bit 2·(i & 1) + (j & 1).
  __device__ __forceinline__ unsigned keep_bits(unsigned bh, unsigned i2, unsigned j2) const {
    const uint4 r = philox4x32_10(make_uint4(j2, i2, bh, offset), k0, k1);
    return unsigned(r.x < threshold) | unsigned(r.y < threshold) << 1 | unsigned(r.z < threshold) << 2 |
           unsigned(r.w < threshold) << 3;
  }

  // Keep bits of columns c .. c + 3 of row i (c even): bit e for column c + e. Two blocks, this row's half of each
  // (the row-wise kernels of the split path, which hold 4 adjacent columns).
  __device__ __forceinline__ unsigned keep4(unsigned bh, long long i, long long c) const {
    const unsigned shift = 2 * static_cast<unsigned>(i & 1);
    const unsigned i2 = static_cast<unsigned>(i >> 1), j2 = static_cast<unsigned>(c >> 1);
    return ((keep_bits(bh, i2, j2) >> shift) & 3u) | ((keep_bits(bh, i2, j2 + 1) >> shift) & 3u) << 2;
  }
};

}  // namespace cupy_attn
