// The prefill kernel's step over one K/V tile in an 8-row tile (KEY_MAJOR; included by
// prefill.cu after prefill_attend.cuh): keys on the MMAs' M side, the tile's 8 query rows on
// their N side, as decode.cu multiplies (key_major_fragments.cuh):
//   S^T = K Q^T  (16 keys x 8 rows, Q^T's B fragments from the Q tile),
//   O^T += V^T P^T  (16 dims x 8 rows, P^T's B fragments from S^T by movmatrix).
// A decode query of a GQA group of up to 8 heads fills as many of the 8 columns, where a 16-row
// tile computes 16 rows of MMAs for them: half the MMAs, half O's registers. Lane (g, t) holds
// rows 2t and 2t + 1 (Rows, warp_row), the keys g and g + 8 of each 16-key block of S^T, and
// o[2c + e] at dim o_dim_of(c, g, e) of each 16-dim block c. Each of the four warps takes a
// quarter of every K/V tile's keys (KV_WARPS), as in the 16-row tile.
#pragma once

#include "key_major_fragments.cuh"

// The K and V rows the MMAs read: the ring's fp8 rows (FP8_DIRECT) or 16-bit tiles.
constexpr int KM_K_ROW_BYTES = FP8_DIRECT ? KV_ROW_BYTES : ROW_BYTES;
constexpr int KM_V_ROW_BYTES = FP8_DIRECT ? KV_ROW_BYTES : V_ROW_BYTES;
static_assert(!KEY_MAJOR || (K_STEPS % 2 == 0 && HEAD_DIM_VO % 32 == 0),
              "K and V^T fragments two 16-dim blocks at a time");

// Q^T's B fragment of k-step c (b[0], b[1]; b[2..3] unused): row g, dims 16c + 2t.. and
// 16c + 8 + 2t.. of the Q tile, or (FP8_DIRECT) in K's permuted order, dims 16c + 4t.. and
// 16c + 4t + 2.. (one 8-byte load).
RTC_DEVICE void load_q_key_major(uint32_t (&b)[4], uint32_t tile, int c, int lane) {
  const int g = lane / 4, t = lane % 4;
  if constexpr (FP8_DIRECT) {
    const uint32_t at = tile + tile_offset<ROW_BYTES>(g, 2 * c + t / 2) + 8 * (t % 2);
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(b[0]), "=r"(b[1]) : "r"(at));
  } else {
    asm volatile("ld.shared.u32 %0, [%1];\n"
                 : "=r"(b[0])
                 : "r"(tile + tile_offset<ROW_BYTES>(g, 2 * c) + 4 * t));
    asm volatile("ld.shared.u32 %0, [%1];\n"
                 : "=r"(b[1])
                 : "r"(tile + tile_offset<ROW_BYTES>(g, 2 * c + 1) + 4 * t));
  }
}

// One K/V tile (keys key0..key0 + KV_TILE - 1) into the thread's two rows. s[j]: S^T of the
// warp's 16-key block j, (key g, rows 2t, 2t + 1), (key g + 8, rows 2t, 2t + 1): element r is
// row i = r % 2, key 16j + g + 8 (r / 2).
RTC_DEVICE void attend_tile_key_major(State (&st)[ROWS],
                                      const uint32_t (&qf)[Q_IN_REGS ? K_STEPS : 1][4],
                                      uint32_t q_tile, uint32_t k_tile, uint32_t v_tile,
                                      int key0, const Rows& rows, const PrefillWorkItem& w,
                                      const LogitTransform<ALIBI, SOFT_CAP>& transform,
                                      int window_left, const uint8_t* mask, int kv_warp,
                                      int lane) {
  constexpr int BLOCKS = WARP_KEYS / 16;  // the warp's 16-key blocks of the tile
  const int g = lane / 4, key_w = kv_warp * WARP_KEYS;
  float s[BLOCKS][4];
#pragma unroll
  for (int j = 0; j < BLOCKS; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
  for (int c = 0; c < K_STEPS; c += 2) {
    uint32_t b[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (Q_IN_REGS) {
#pragma unroll
        for (int r = 0; r < 2; ++r) b[h][r] = qf[c + h][r];
      } else {
        load_q_key_major(b[h], q_tile, c + h, lane);
      }
    }
#pragma unroll
    for (int j = 0; j < BLOCKS; ++j) {
      uint32_t a[2][4];
      load_k_rows<KM_K_ROW_BYTES, FP8_DIRECT, FP8_KIND>(a, k_tile, key_w + 16 * j, c, lane);
#pragma unroll
      for (int h = 0; h < 2; ++h)
        mma_16816<MT>(s[j][0], s[j][1], s[j][2], s[j][3], a[h], b[h][0], b[h][1]);
    }
  }

  // Logit transform and masks (as attend_tile's), the row maxima over the thread's keys and
  // then across the 8 lanes of its t.
  float part_max[ROWS] = {neg_inf(), neg_inf()};
  const int lo = key0 + key_w;
  auto scores = [&](auto masked) {
#pragma unroll
    for (int j = 0; j < BLOCKS; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = r % 2, key = lo + 16 * j + g + 8 * (r / 2);
        const float v = row_logit<decltype(masked)::value>(
            s[j][r], rows, i, key, w, transform, window_left, mask);
        s[j][r] = v;
        part_max[i] = fmaxf(part_max[i], v);
      }
  };
  if (rows.all_see(lo, lo + WARP_KEYS - 1, w.kv_begin, w.kv_end, window_left))
    scores(Bool<false>{});
  else
    scores(Bool<true>{});
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    float row_max = part_max[i];
#pragma unroll
    for (int off = 4; off < 32; off <<= 1)
      row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, off));
    if constexpr (FOLD) row_max *= transform.scale;  // > 0: the scaled logits' max
    // uniform across the warp, as attend_tile's: a row pair keeping its max skips the rescale
    const bool same = __all_sync(0xffffffffu, !(row_max > st[i].m));
    const float base = same ? st[i].offset() : st[i].rescale(row_max);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < BLOCKS; ++j)
#pragma unroll
      for (int r = i; r < 4; r += 2) {
        if constexpr (FOLD)
          s[j][r] = fast_exp2(fmaf(s[j][r], transform.scale, -base));
        else
          s[j][r] = fast_exp2(s[j][r] - base);
        sum += s[j][r];
      }
    st[i].d += sum;
  }

  // O^T += V^T P^T, 16 keys at a time: P^T's B fragment (keys 2t.., row g) from S^T's
  // (key g, rows 2t..) by one 8x8 transpose per 8 keys.
#pragma unroll
  for (int j = 0; j < BLOCKS; ++j) {
    const uint32_t p0 = movmatrix_trans(pack2<MT>(s[j][0], s[j][1]));
    const uint32_t p1 = movmatrix_trans(pack2<MT>(s[j][2], s[j][3]));
#pragma unroll
    for (int c = 0; c < HEAD_DIM_VO / 16; c += 2) {
      uint32_t a[2][4];
      load_vt_rows<KM_V_ROW_BYTES, FP8_DIRECT, FP8_KIND>(a, v_tile, key_w + 16 * j, c, lane);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int e = 2 * (c + h);
        mma_16816<MT>(st[0].o[e], st[1].o[e], st[0].o[e + 1], st[1].o[e + 1], a[h], p0, p1);
      }
    }
  }
}
