// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a
// counter-based generator. Its output is a keyed bijection of a 128-bit counter, so every draw
// is evaluated on its own from (seed, offset, row, draw) and no state is carried anywhere.
//   key     = (seed low 32 bits, seed high 32 bits)
//   counter = (draw, row, offset low 32 bits, offset high 32 bits)
//   uniform = (first output word >> 8) * 2^-24, in [0, 1)
// tests/sampling_model.py holds the same generator in NumPy, checked against Random123's
// known-answer vectors.
#pragma once

struct Philox4 {
  uint32_t x, y, z, w;
};

RTC_DEVICE Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;  // round multipliers
  constexpr uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;  // key schedule (Weyl) increments
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
    const uint32_t hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
    c = Philox4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += W0;
    k1 += W1;
  }
  return c;
}

// The `draw`-th uniform of output row `row` for one call's (seed, offset).
RTC_DEVICE float philox_uniform(uint64_t seed, uint64_t offset, uint32_t row, uint32_t draw) {
  const Philox4 counter{draw, row, uint32_t(offset), uint32_t(offset >> 32)};
  const Philox4 r = philox4x32_10(counter, uint32_t(seed), uint32_t(seed >> 32));
  return float(r.x >> 8) * 0x1p-24f;
}

// The (seed, offset) of one output row: scalars, or device arrays of length 1 or batch whose
// values are read at run time (so a captured CUDA graph can be replayed with new ones).
struct Philox {
  uint64_t seed, offset;
  uint32_t row;

  RTC_DEVICE float uniform(int draw) const { return philox_uniform(seed, offset, row, draw); }
};

RTC_DEVICE Philox make_philox(const uint64_t* seed_arr, uint64_t seed_val, int seed_len,
                              const uint64_t* offset_arr, uint64_t offset_val, int offset_len,
                              int row) {
  return {seed_arr ? seed_arr[seed_len > 1 ? row : 0] : seed_val,
          offset_arr ? offset_arr[offset_len > 1 ? row : 0] : offset_val, uint32_t(row)};
}
