// Fragment loaders and per-element helpers of decode.cu (included after its constants):
// K and V^T A fragments of 16 tile rows via ldmatrix (fp8 converted to fp16 on the way), the Q^T
// B fragments, RoPE applied to K fragments in registers (rope_cos_sin: variant.cuh), and the
// head_dim index of every fragment element (a permutation inside each 16-wide block for fp8,
// see decode.cu).
// Checked against the PTX fragment layouts by the NumPy model in tests/test_decode_layout.py.
#pragma once
#include "key_major_fragments.cuh"

// Head-dim index of element e (0, 1) of A-fragment register r of K block c (its first half).
RTC_DEVICE int k_dim(int c, int r, int e, int t) {
  const int base = FP8 ? 4 * t + (r >= 2 ? 2 : 0) : 2 * t + (r >= 2 ? 8 : 0);
  return 16 * c + base + e;
}

// Head-dim index of O^T accumulator row (g, or g + 8 when hi) of V block c.
RTC_DEVICE int o_dim(int c, int g, bool hi) { return o_dim_of<FP8>(c, g, hi); }

// A fragments of K for blocks c, c + 1 over the 16 tile rows starting at `row`.
RTC_DEVICE void load_k(uint32_t (&a)[2][4], uint32_t tile, int row, int c, int lane) {
  load_k_rows<ROW_BYTES, FP8, FP8_KIND>(a, tile, row, c, lane);
}

// A fragments of V^T for blocks c, c + 1 over the 16 tile rows starting at `row`.
RTC_DEVICE void load_v(uint32_t (&a)[2][4], uint32_t tile, int row, int c, int lane) {
  load_vt_rows<ROW_BYTES, FP8, FP8_KIND>(a, tile, row, c, lane);
}

// Rotate the K fragment x (block c) with its partner y (block c + BLOCKS / 2) to the positions
// of its tokens: first + g and first + g + 8.
RTC_DEVICE void rope_k(uint32_t (&x)[4], uint32_t (&y)[4], int c, int first, int g, int t,
                       const float2* freq) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const float2 a = unpack2<MT>(x[r]), b = unpack2<MT>(y[r]);
    const int pos = first + g + 8 * (r % 2);
    const float2 c0 = rope_cos_sin(pos, freq[k_dim(c, r, 0, t)]);
    const float2 c1 = rope_cos_sin(pos, freq[k_dim(c, r, 1, t)]);
    x[r] = pack2<MT>(a.x * c0.x - b.x * c0.y, a.y * c1.x - b.y * c1.y);
    y[r] = pack2<MT>(b.x * c0.x + a.x * c0.y, b.y * c1.x + a.y * c1.y);
  }
}

// Q^T B fragment of block c, head tile nt, from the padded q rows in shared memory.
RTC_DEVICE void q_frag(uint32_t (&b)[2], const MT* q_s, int c, int nt, int g, int t) {
  const MT* row = q_s + (8 * nt + g) * Q_STRIDE + 16 * c;
  b[0] = *reinterpret_cast<const uint32_t*>(row + (FP8 ? 4 * t : 2 * t));
  b[1] = *reinterpret_cast<const uint32_t*>(row + (FP8 ? 4 * t + 2 : 2 * t + 8));
}
