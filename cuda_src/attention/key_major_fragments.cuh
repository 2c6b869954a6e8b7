// K and V^T as the A side of mma.m16n8k16, 16 tile rows (keys) at a time, for the kernels that
// put keys on the MMAs' M side and up to 8 query rows on their N side (decode.cu; prefill.cu's
// 8-row tiles):  S^T = K Q^T (16 keys x 8 rows),  O^T += V^T P^T (16 dims x 8 rows).
// Tiles are [rows][ROW_BYTES] in tile_offset's swizzle (paged_kv.cuh). fp8 rows (FP8):
// ldmatrix moves fp8 pairs as 16-bit units, so inside every 16-wide head_dim block a thread
// holds dims 4t..4t+3 of K (a permuted contraction order; q's B fragments follow it), and V^T's
// M rows g and g + 8 are dims 2g and 2g + 1 (o_dim_of); cvt widens them to fp16 exactly.
// Checked against the PTX fragment layouts by the NumPy model in tests/test_decode_layout.py.
#pragma once

// Head-dim index of O^T accumulator row (g, or g + 8 when hi) of V block c.
template <bool FP8>
RTC_DEVICE int o_dim_of(int c, int g, bool hi) {
  return FP8 ? 16 * c + 2 * g + hi : 16 * c + g + 8 * hi;
}

// A fragments of K for head_dim blocks c, c + 1 over the 16 tile rows starting at `row`.
template <int ROW_BYTES, bool FP8, __nv_fp8_interpretation_t KIND>
RTC_DEVICE void load_k_rows(uint32_t (&a)[2][4], uint32_t tile, int row, int c, int lane) {
  const int r = row + lane % 8 + 8 * (lane / 8 % 2);
  if constexpr (FP8) {
    uint32_t x[4];
    ldmatrix_x4(x, tile + tile_offset<ROW_BYTES>(r, c + lane / 16));
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // x[2i]: rows 0-7, x[2i+1]: rows 8-15 of block c + i
      a[i][0] = fp8x2_to_half2_bits<KIND>(x[2 * i] & 0xffff);
      a[i][1] = fp8x2_to_half2_bits<KIND>(x[2 * i + 1] & 0xffff);
      a[i][2] = fp8x2_to_half2_bits<KIND>(x[2 * i] >> 16);
      a[i][3] = fp8x2_to_half2_bits<KIND>(x[2 * i + 1] >> 16);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 2; ++i)
      ldmatrix_x4(a[i], tile + tile_offset<ROW_BYTES>(r, 2 * (c + i) + lane / 16));
  }
}

// A fragments of V^T for head_dim blocks c, c + 1 over the 16 tile rows starting at `row`.
template <int ROW_BYTES, bool FP8, __nv_fp8_interpretation_t KIND>
RTC_DEVICE void load_vt_rows(uint32_t (&a)[2][4], uint32_t tile, int row, int c, int lane) {
  if constexpr (FP8) {
    uint32_t x[4];
    const int r = row + lane % 8 + 8 * (lane / 8 % 2);
    ldmatrix_x4_trans(x, tile + tile_offset<ROW_BYTES>(r, c + lane / 16));
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // bytes (2t, 2g) (2t, 2g+1) (2t+1, 2g) (2t+1, 2g+1) -> rows
      const uint32_t lo = __byte_perm(x[2 * i], 0, 0x3120);
      const uint32_t hi = __byte_perm(x[2 * i + 1], 0, 0x3120);
      a[i][0] = fp8x2_to_half2_bits<KIND>(lo & 0xffff);
      a[i][1] = fp8x2_to_half2_bits<KIND>(lo >> 16);
      a[i][2] = fp8x2_to_half2_bits<KIND>(hi & 0xffff);
      a[i][3] = fp8x2_to_half2_bits<KIND>(hi >> 16);
    }
  } else {
    const int r = row + lane % 8 + 8 * (lane / 16);
#pragma unroll
    for (int i = 0; i < 2; ++i)
      ldmatrix_x4_trans(a[i], tile + tile_offset<ROW_BYTES>(r, 2 * (c + i) + lane / 8 % 2));
  }
}
