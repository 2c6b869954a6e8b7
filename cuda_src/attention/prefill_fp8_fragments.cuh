// Fragment loaders of prefill.cu's 16-row tiles over fp8 K/V (FP8_DIRECT; included after its
// constants and prefill_fragments.cuh): the MMAs read K and V straight from the ring, each
// fragment widened to MT in registers (no staging tile, no barrier). A 16-bit unit of ldmatrix
// is two fp8 values, so an 8x8 matrix covers 8 K/V rows x 16 dims (one 16-byte ring chunk):
//   K: ldmatrix.x2 of keys k0..k0+15, dims 16c..16c+15; lane (g, t) gets dims 4t..4t+3 of key
//      k0 + g (and k0 + 8 + g). S = Q K^T then sums each 16-dim step in a permuted order,
//      k index 2t + e <-> dim 4t + e and 2t + 8 + e <-> dim 4t + 2 + e, and Q's A fragments
//      are loaded in that order too (load_q).
//   V: ldmatrix.x2.trans of keys 16j..16j+15, dims 16c..16c+15; lane (g, t) gets keys 2t, 2t+1
//      at dims 2g, 2g+1: the B fragment of the even dims (n = g <-> dim 2g) and that of the
//      odd dims. O's n-tile 2c holds the chunk's even dims (lane t: 4t, 4t + 2), 2c + 1 its odd
//      ones (4t + 1, 4t + 3); unpermute_dims restores the standard layout before the epilogue.
// Checked against the PTX fragment layouts by the NumPy model in tests/test_prefill_layout.py.
#pragma once

// Q's A fragment of rows row0.. for k-step c: ldmatrix, or (FP8_DIRECT) the permuted dims,
// a0 = (g, 4t..4t+1), a2 = (g, 4t+2..4t+3), a1 and a3 the same of row g + 8, one 8-byte load
// each row.
RTC_DEVICE void load_q(uint32_t (&a)[4], uint32_t tile, int row0, int c, int lane) {
  if constexpr (FP8_DIRECT) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // dims 16c + 4t.. are bytes 32c + 8t.. of the 16-bit row
      const uint32_t at = tile + tile_offset<ROW_BYTES>(row0 + g + 8 * h, 2 * c + t / 2) +
                          8 * (t % 2);
      asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(a[h]), "=r"(a[2 + h]) : "r"(at));
    }
  } else {
    load_a_rows<ROW_BYTES>(a, tile, row0, c, lane);
  }
}

// B fragments of key n-tiles k0.. and k0 + 8.. for k-step c from the fp8 K ring tile: b[n][0]
// dims 4t, 4t + 1, b[n][1] dims 4t + 2, 4t + 3 of key g of the n-tile.
RTC_DEVICE void load_k_pair_fp8(uint32_t (&b)[2][2], uint32_t tile, int key0, int c, int lane) {
  const int row = key0 + (lane / 8 % 2) * 8 + lane % 8;  // lanes 0-7: keys 0-7; 8-15: 8-15
  uint32_t r[2];
  ldmatrix_x2(r, tile + tile_offset<KV_ROW_BYTES>(row, c));
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    b[n][0] = fp8x2_to_pair<MT, FP8_KIND>(r[n] & 0xffff);
    b[n][1] = fp8x2_to_pair<MT, FP8_KIND>(r[n] >> 16);
  }
}

// B fragments of keys 16j..16j+15 at dims 16c..16c+15 from the fp8 V ring tile: b[0] the even
// dims (n = g <-> dim 16c + 2g), b[1] the odd ones; b[.][0] keys 2t, 2t + 1, b[.][1] 2t + 8..
RTC_DEVICE void load_v_pair_fp8(uint32_t (&b)[2][2], uint32_t tile, int j, int c, int lane) {
  const int row = 16 * j + (lane / 8 % 2) * 8 + lane % 8;
  uint32_t r[2];
  ldmatrix_x2_trans(r, tile + tile_offset<KV_ROW_BYTES>(row, c));
#pragma unroll
  for (int k = 0; k < 2; ++k) {  // bytes: (key 2t: dim 2g, 2g + 1), (key 2t + 1: dim 2g, 2g + 1)
    b[0][k] = fp8x2_to_pair<MT, FP8_KIND>(__byte_perm(r[k], 0, 0x0020));
    b[1][k] = fp8x2_to_pair<MT, FP8_KIND>(__byte_perm(r[k], 0, 0x0031));
  }
}

// O's dims back in the standard layout (o[4d], o[4d + 1]: dims 16d + 2t, +1; o[4d + 2],
// o[4d + 3]: 16d + 8 + 2t, +1) from P V's over fp8 (lane t holds 16d + 4t.. : o[4d] 4t,
// o[4d + 1] 4t + 2, o[4d + 2] 4t + 1, o[4d + 3] 4t + 3), by shuffles within each quad: dims
// 2t, 2t + 1 come from lane t / 2 of the quad, 8 + 2t, 9 + 2t from lane 2 + t / 2.
RTC_DEVICE void unpermute_dims(State (&st)[ROWS], int lane) {
  const int t = lane % 4, quad = lane - t;
  const int lo = quad + t / 2, hi = quad + 2 + t / 2;
  const bool odd = t % 2;
#pragma unroll
  for (int i = 0; i < ROWS; ++i)
#pragma unroll
    for (int d = 0; d < HEAD_DIM_VO / 16; ++d) {
      float* o = st[i].o + 4 * d;
      float from_lo[4], from_hi[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        from_lo[k] = __shfl_sync(0xffffffffu, o[k], lo);
        from_hi[k] = __shfl_sync(0xffffffffu, o[k], hi);
      }
      // a source lane s holds dims 4s, 4s + 2 (o[0], o[1]) and 4s + 1, 4s + 3 (o[2], o[3])
      o[0] = odd ? from_lo[1] : from_lo[0];
      o[1] = odd ? from_lo[3] : from_lo[2];
      o[2] = odd ? from_hi[1] : from_hi[0];
      o[3] = odd ? from_hi[3] : from_hi[2];
    }
}
