// The prefill kernel's step over one K/V tile (included by prefill.cu after its constants,
// Rows, State, the fragment loaders and the tile transforms): S = Q K^T on mma.sync or
// wgmma, the logit transform and masks, the online softmax, O += P V. MLA's tile is
// prefill_mla.cuh's.
#pragma once

// One K/V tile (keys key0..key0 + KV_TILE - 1) into the warp's rows. s[b][n]: S of row block
// b, key n-tile n; row i = 2b + h of the thread is element 2h, 2h + 1 of s[b][n].
RTC_DEVICE void attend_tile(State (&st)[ROWS], const uint32_t (&qf)[Q_IN_REGS ? K_STEPS : 1][4],
                            uint32_t q_tile, uint32_t k_tile, uint32_t v_tile, int key0,
                            const Rows& rows, const PrefillWorkItem& w,
                            const LogitTransform<ALIBI, SOFT_CAP>& transform, int window_left,
                            const uint8_t* mask, int row_warp, int kv_warp, int lane, int t) {
  const int key_w = kv_warp * WARP_KEYS;  // this warp's first key in the tile
  float s[ROW_BLOCKS][KEY_TILES][4];
  if constexpr (WGMMA) {
    qk_wgmma(s[0], q_tile, k_tile, row_warp / 4);
  } else {
#pragma unroll
    for (int b = 0; b < ROW_BLOCKS; ++b)
#pragma unroll
      for (int n = 0; n < KEY_TILES; ++n) s[b][n][0] = s[b][n][1] = s[b][n][2] = s[b][n][3] = 0.f;
#pragma unroll
    for (int c = 0; c < K_STEPS; ++c) {
      uint32_t a[ROW_BLOCKS][4];
      if constexpr (Q_IN_REGS) {
#pragma unroll
        for (int r = 0; r < 4; ++r) a[0][r] = qf[c][r];
      } else {
#pragma unroll
        for (int b = 0; b < ROW_BLOCKS; ++b)
          load_q(a[b], q_tile, WARP_ROWS * row_warp + 16 * b, c, lane);
      }
#pragma unroll
      for (int n = 0; n < KEY_TILES; n += 2) {
        uint32_t kb[2][2];
        if constexpr (FP8_DIRECT)
          load_k_pair_fp8(kb, k_tile, key_w + 8 * n, c, lane);
        else
          load_k_pair<ROW_BYTES>(kb, k_tile, key_w + 8 * n, c, lane);
#pragma unroll
        for (int b = 0; b < ROW_BLOCKS; ++b) {
          mma_16816<MT>(s[b][n][0], s[b][n][1], s[b][n][2], s[b][n][3], a[b], kb[0][0], kb[0][1]);
          mma_16816<MT>(s[b][n + 1][0], s[b][n + 1][1], s[b][n + 1][2], s[b][n + 1][3], a[b],
                        kb[1][0], kb[1][1]);
        }
      }
  }
  }

  // Logit transform (variant.cuh; FOLD: none yet, see below) and masks: element r of n-tile n
  // of block b is row i = 2b + r / 2, key key0 + key_w + 8n + 2t + r % 2. Blocks that every
  // row sees whole (all but the diagonal and edge blocks of a long prompt) skip the
  // per-element visibility tests.
  // The row maxima and sums run as PARTS independent chains per row (short dependency chains:
  // a warp here has few neighbours on its scheduler to hide latency behind).
  constexpr int PARTS = KEY_TILES >= 4 ? 4 : 2;
  static_assert(KEY_TILES >= PARTS, "a partial per chain");
  float part_max[ROWS][PARTS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i)
#pragma unroll
    for (int k = 0; k < PARTS; ++k) part_max[i][k] = neg_inf();
  const int lo = key0 + key_w;
  auto scores = [&](auto masked) {  // transform (and, masked, the visibility tests)
#pragma unroll
    for (int b = 0; b < ROW_BLOCKS; ++b)
#pragma unroll
      for (int n = 0; n < KEY_TILES; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 2 * b + r / 2, key = lo + 8 * n + 2 * t + r % 2;
          const float v = row_logit<decltype(masked)::value>(
              s[b][n][r], rows, i, key, w, transform, window_left, mask);
          s[b][n][r] = v;
          float& m = part_max[i][(2 * n + r % 2) % PARTS];
          m = fmaxf(m, v);
        }
  };
  if (rows.all_see(lo, lo + WARP_KEYS - 1, w.kv_begin, w.kv_end, window_left))
    scores(Bool<false>{});
  else
    scores(Bool<true>{});
  // A row slot i whose rows (one per lane group: 8 rows of the warp) keep their running max
  // skips its rescale (by exactly 1): decided per slot for the whole warp, so the branch is
  // uniform, and far more often than for all the warp's rows at once.
  float row_max[ROWS];
  bool same[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    row_max[i] = part_max[i][0];
#pragma unroll
    for (int k = 1; k < PARTS; ++k) row_max[i] = fmaxf(row_max[i], part_max[i][k]);
    row_max[i] = fmaxf(row_max[i], __shfl_xor_sync(0xffffffffu, row_max[i], 1));
    row_max[i] = fmaxf(row_max[i], __shfl_xor_sync(0xffffffffu, row_max[i], 2));
    if constexpr (FOLD) row_max[i] *= transform.scale;  // > 0: the scaled logits' max
    same[i] = __all_sync(0xffffffffu, !(row_max[i] > st[i].m));
  }
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int b = i / 2, h = i % 2;
    const float base = same[i] ? st[i].offset() : st[i].rescale(row_max[i]);
    float part_sum[PARTS];
#pragma unroll
    for (int n = 0; n < KEY_TILES; ++n) {
      if constexpr (FOLD) {
        s[b][n][2 * h] = fast_exp2(fmaf(s[b][n][2 * h], transform.scale, -base));
        s[b][n][2 * h + 1] = fast_exp2(fmaf(s[b][n][2 * h + 1], transform.scale, -base));
      } else {
        s[b][n][2 * h] = fast_exp2(s[b][n][2 * h] - base);
        s[b][n][2 * h + 1] = fast_exp2(s[b][n][2 * h + 1] - base);
      }
      const float pair = s[b][n][2 * h] + s[b][n][2 * h + 1];
      part_sum[n % PARTS] = n < PARTS ? pair : part_sum[n % PARTS] + pair;
    }
    float sum = part_sum[0];
#pragma unroll
    for (int k = 1; k < PARTS; ++k) sum += part_sum[k];
    st[i].d += sum;
  }

  // O += P V, 16 keys at a time; each V fragment feeds every row block.
  if constexpr (WGMMA) {
    pv_wgmma(st, s[0], v_tile);
  } else {
#pragma unroll
    for (int j = 0; j < WARP_KEYS / 16; ++j) {
      uint32_t a[ROW_BLOCKS][4];
#pragma unroll
      for (int b = 0; b < ROW_BLOCKS; ++b) p_fragment<MT>(a[b], s[b][2 * j], s[b][2 * j + 1]);
#pragma unroll
      for (int c = 0; c < WARP_DIMS / 16; ++c) {
        uint32_t vb[2][2];
        if constexpr (FP8_DIRECT)  // vb[0]: the chunk's even dims, vb[1]: its odd ones
          load_v_pair_fp8(vb, v_tile, key_w / 16 + j, c, lane);
        else
          load_v_pair<V_ROW_BYTES>(vb, v_tile, key_w / 16 + j, c, lane);
#pragma unroll
        for (int b = 0; b < ROW_BLOCKS; ++b)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int n = 2 * c + h;  // dims 8n..8n + 7
            mma_16816<MT>(st[2 * b].o[2 * n], st[2 * b].o[2 * n + 1], st[2 * b + 1].o[2 * n],
                          st[2 * b + 1].o[2 * n + 1], a[b], vb[h][0], vb[h][1]);
          }
      }
    }
  }
}
