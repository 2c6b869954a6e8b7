// Fragment loaders of prefill.cu (included after its constants): a warp owns 16 packed query
// rows and computes S = Q K^T (16 rows x 8-key n-tiles) and O += P V (16 rows x 8-dim n-tiles)
// with mma.m16n8k16, operands from swizzled shared-memory tiles (paged_kv.cuh's tile_offset):
//   Q A fragments:   ldmatrix.x4 of rows r0..r0+15, dims 16c..16c+15
//   K B fragments:   ldmatrix.x4 of keys k0..k0+15, dims 16c..16c+15 -> n-tiles k0 and k0 + 8
//   V B fragments:   ldmatrix.x4.trans of keys 16j..16j+15, dims d0..d0+15 -> n-tiles d0, d0 + 8
//   P A fragments:   S accumulators of n-tiles 2j, 2j+1 repacked in registers (no shuffles)
// Checked against the PTX fragment layouts by the NumPy model in tests/test_prefill_layout.py.
#pragma once

// A fragment (16 x 16, row-major) of rows row0.. and dims 16c.. of a [rows][ROW] tile.
template <int ROW_BYTES>
RTC_DEVICE void load_a_rows(uint32_t (&a)[4], uint32_t tile, int row0, int c, int lane) {
  const int i = lane / 8;  // the 8x8 matrix this lane addresses: a0 a1 a2 a3
  const int row = row0 + (i % 2) * 8 + lane % 8;
  ldmatrix_x4(a, tile + tile_offset<ROW_BYTES>(row, 2 * c + i / 2));
}

// B fragments of two key n-tiles (keys key0.. and key0 + 8..) for dims 16c..: b[n][0..1].
template <int ROW_BYTES>
RTC_DEVICE void load_k_pair(uint32_t (&b)[2][2], uint32_t tile, int key0, int c, int lane) {
  const int i = lane / 8;  // matrices: (keys 0-7, dims 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15)
  const int row = key0 + (i / 2) * 8 + lane % 8;
  uint32_t r[4];
  ldmatrix_x4(r, tile + tile_offset<ROW_BYTES>(row, 2 * c + i % 2));
  b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
}

// B fragments of two dim n-tiles (dims d0.. and d0 + 8.., d0 = 16c) for keys 16j..16j+15.
template <int ROW_BYTES>
RTC_DEVICE void load_v_pair(uint32_t (&b)[2][2], uint32_t tile, int j, int c, int lane) {
  const int i = lane / 8;  // matrices: (keys 0-7, dims 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15)
  const int row = 16 * j + (i % 2) * 8 + lane % 8;
  uint32_t r[4];
  ldmatrix_x4_trans(r, tile + tile_offset<ROW_BYTES>(row, 2 * c + i / 2));
  b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
}

// The A fragment of keys 16j..16j+15 of P from S accumulators s[n] of key n-tiles 2j, 2j + 1
// (C layout: s[0..1] row g, keys 2t..2t+1; s[2..3] row g + 8), rounded to MT.
template <typename MT>
RTC_DEVICE void p_fragment(uint32_t (&a)[4], const float (&s0)[4], const float (&s1)[4]) {
  a[0] = pack2<MT>(s0[0], s0[1]);  // row g, keys 2t, 2t + 1
  a[1] = pack2<MT>(s0[2], s0[3]);  // row g + 8
  a[2] = pack2<MT>(s1[0], s1[1]);  // row g, keys 8 + 2t, 9 + 2t
  a[3] = pack2<MT>(s1[2], s1[3]);  // row g + 8
}
