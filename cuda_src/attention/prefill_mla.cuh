// MLA's K tile (prefill.cu's MLA; included after attend_tile's helpers, instantiated by MLA
// kernels only): the DIM_WARPS warps on a row warp's 16 rows split the keys for S = Q K^T (a
// 16-key group each: GROUPS of them, warps past GROUPS repeating one), pool their row maxima in
// shared memory into one running max that every warp then holds alike, write P (16-bit) to a
// shared [16][KV_TILE] tile with their row sums, and each accumulates O += P V over all the
// tile's keys for its WARP_DIMS dims of V (the K tile's first MLA_CKV dims). Each warp's d
// holds a row's whole sum in its quad's first thread (close_row adds the quad).
//   xchg (the row warp's): [16][KV_TILE] P (tile_offset rows), then float maxima [GROUPS][16],
//   sums [GROUPS][16]
#pragma once

static_assert(!MLA || (MLA_GROUPS <= DIM_WARPS && P_ROW_BYTES % 64 == 0),
              "MLA: a 16-key group of S per warp at most, whole P rows");

template <int N>  // the tile's 16-key groups (a template: instantiated by MLA kernels only)
RTC_DEVICE void mla_tile(State (&st)[ROWS], uint32_t q_tile, uint32_t k_tile,
                         unsigned char* xchg, int key0, const Rows& rows,
                         const PrefillWorkItem& w,
                         const LogitTransform<ALIBI, SOFT_CAP>& transform, int window_left,
                         int row_warp, int lane) {
  const int g = lane / 4, t = lane % 4, dw = dim_warp(), group = dw % N;
  const bool writer = dw < N;  // the first warp of each key group shares its results
  float* maxima = reinterpret_cast<float*>(xchg + 16 * P_ROW_BYTES);
  float* sums = maxima + N * 16;

  // S of the warp's 16 keys: s[n][r] is row g + 8 (r / 2), key 16 group + 8n + 2t + r % 2.
  float s[2][4] = {};
#pragma unroll
  for (int c = 0; c < K_STEPS; ++c) {
    uint32_t a[4], kb[2][2];
    load_q(a, q_tile, 16 * row_warp, c, lane);
    load_k_pair<ROW_BYTES>(kb, k_tile, 16 * group, c, lane);
    mma_16816<MT>(s[0][0], s[0][1], s[0][2], s[0][3], a, kb[0][0], kb[0][1]);
    mma_16816<MT>(s[1][0], s[1][1], s[1][2], s[1][3], a, kb[1][0], kb[1][1]);
  }
  const int lo = key0 + 16 * group;
  float part[2] = {neg_inf(), neg_inf()};  // rows g, g + 8
  auto scores = [&](auto masked) {
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = r / 2, key = lo + 8 * n + 2 * t + r % 2;
        const float v = row_logit<decltype(masked)::value>(
            s[n][r], rows, i, key, w, transform, window_left, nullptr);
        s[n][r] = v;
        part[i] = fmaxf(part[i], v);
      }
  };
  if (rows.all_see(lo, lo + 15, w.kv_begin, w.kv_end, window_left))
    scores(Bool<false>{});
  else
    scores(Bool<true>{});
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    part[i] = fmaxf(part[i], __shfl_xor_sync(0xffffffffu, part[i], 1));
    part[i] = fmaxf(part[i], __shfl_xor_sync(0xffffffffu, part[i], 2));
    if constexpr (FOLD) part[i] *= transform.scale;  // > 0: the scaled logits' max
    if (writer && t == 0) maxima[group * 16 + g + 8 * i] = part[i];
  }
  __syncthreads();  // the groups' maxima (every warp of the CTA takes this step)
  float base[2], sum[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float tile_max = maxima[g + 8 * i];
#pragma unroll
    for (int k = 1; k < N; ++k) tile_max = fmaxf(tile_max, maxima[k * 16 + g + 8 * i]);
    base[i] = st[i].rescale(tile_max);  // alike in every warp: the same maxima, in one order
  }
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = r / 2;
      s[n][r] = FOLD ? fast_exp2(fmaf(s[n][r], transform.scale, -base[i]))
                     : fast_exp2(s[n][r] - base[i]);
      sum[i] += s[n][r];
    }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 1);
    sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 2);
    if (writer && t == 0) sums[group * 16 + g + 8 * i] = sum[i];
  }
  if (writer) {  // P rounded to MT, rows g and g + 8, keys 16 group + 8n + 2t, + 1
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int key = 16 * group + 8 * n + 2 * t;
        *reinterpret_cast<uint32_t*>(xchg + tile_offset<P_ROW_BYTES>(g + 8 * i, key / 8) +
                                     2 * (key % 8)) = pack2<MT>(s[n][2 * i], s[n][2 * i + 1]);
      }
  }
  __syncthreads();  // P and the sums
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float total = sums[g + 8 * i];
#pragma unroll
    for (int k = 1; k < N; ++k) total += sums[k * 16 + g + 8 * i];
    st[i].d += t == 0 ? total : 0.f;  // the quad's first thread: close_row adds the quad
  }

  // O += P V over the tile's keys, this warp's dims of V (the K tile's ckv part).
  const uint32_t p_tile = smem_addr(xchg);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    uint32_t a[4];
    load_a_rows<P_ROW_BYTES>(a, p_tile, 0, j, lane);
#pragma unroll
    for (int c = 0; c < WARP_DIMS / 16; ++c) {
      uint32_t vb[2][2];
      load_v_pair<ROW_BYTES>(vb, k_tile, j, c + dw * (WARP_DIMS / 16), lane);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = 2 * c + h;  // dims 8n..8n + 7 of the warp's
        mma_16816<MT>(st[0].o[2 * n], st[0].o[2 * n + 1], st[1].o[2 * n], st[1].o[2 * n + 1],
                      a, vb[h][0], vb[h][1]);
      }
    }
  }
}
