// The prefill kernel's epilogue (included by prefill.cu after its constants, Rows, State and
// the parameter structs): the states of warps sharing rows merged (combine_warps), each row's
// result written to o / lse or to its item's fp32 partial slot (finish_rows), and a split
// tile's partials merged by its last CTA (merge_tile).
#pragma once

// KV_WARPS > 1: the states of the warps sharing rows merged into the first one's, lane by lane
// (lane L of every warp holds the same rows and dims; d is still per thread, so the partial
// sums merge as they are and finish_rows reduces them). `scratch`: shared memory no longer in
// use, [KV_WARPS - 1][FIELDS][32] floats.
constexpr int STATE_FLOATS = 2 + O_FLOATS;  // m, d, o of one row
constexpr int COMBINE_BYTES = KV_WARPS > 1 ? (KV_WARPS - 1) * 2 * STATE_FLOATS * 32 * 4 : 0;
static_assert(COMBINE_BYTES <= RING_BYTES, "the exchange fits in the ring");
static_assert(KV_WARPS == 1 || ROWS == 2, "warps split the keys of 8- and 16-row tiles only");

RTC_DEVICE void combine_warps(State (&st)[ROWS], float* scratch, int kv_warp, int lane) {
  constexpr int FIELDS = 2 * STATE_FLOATS;
  if (kv_warp > 0) {
    float* mine = scratch + (kv_warp - 1) * FIELDS * 32 + lane;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float* row = mine + i * STATE_FLOATS * 32;
      row[0] = st[i].m, row[32] = st[i].d;
#pragma unroll
      for (int e = 0; e < O_FLOATS; ++e) row[(2 + e) * 32] = st[i].o[e];
    }
  }
  __syncthreads();
  if (kv_warp == 0) {
#pragma unroll 1
    for (int w = 1; w < KV_WARPS; ++w)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float* row = scratch + ((w - 1) * FIELDS + i * STATE_FLOATS) * 32 + lane;
        State other;
        other.m = row[0], other.d = row[32];
#pragma unroll
        for (int e = 0; e < O_FLOATS; ++e) other.o[e] = row[(2 + e) * 32];
        st[i].merge(other);
      }
  }
}

// A row's state closed: the partial sums of its threads added (the four of a lane group;
// KEY_MAJOR: the eight lanes of one t), o normalized; its lse.
RTC_DEVICE float close_row(State& s) {
  if constexpr (KEY_MAJOR) {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) s.d += __shfl_xor_sync(0xffffffffu, s.d, off);
  } else {
    s.d += __shfl_xor_sync(0xffffffffu, s.d, 1);
    s.d += __shfl_xor_sync(0xffffffffu, s.d, 2);
  }
  const float lse = s.lse();
  s.normalize();
  return lse;
}

// The rows' results (the tile's only item, KV_WARPS == 1), normalized, through shared memory
// to o: each warp writes its rows' fragments into its own rows of `o_tile` (the Q tile's bytes,
// free once every warp is past its last MMA: the caller's barrier; a warp's pieces of o's rows,
// O_ROW_BYTES, in its own region: DIM_WARPS of them fit), swizzled by 16-byte chunk,
// then stores whole rows in 16-byte pieces. (Straight from the fragments, a store instruction
// puts 4 bytes into each of 8 rows: 8 of every 32 bytes the L2 receives are used.) lse from
// the fragments. o's rows are 16-byte aligned (checked on the host).
static_assert(sizeof(OT) == 2 && DIM_WARPS * O_ROW_BYTES <= ROW_BYTES,
              "the warps' 16-bit pieces of an o row fit a Q row");
RTC_DEVICE void store_rows(State (&st)[ROWS], const PrefillWorkItem& w, const PrefillParams& p,
                           unsigned char* o_tile, int kv_head, int warp, int lane) {
  const int g = lane / 4, t = lane % 4;
  const int rows_in = w.qo_len * p.group_size, first = w.tile_row + WARP_ROWS * warp;
  if constexpr (DIM_WARPS > 1) o_tile += dim_warp() * TILE_ROWS * O_ROW_BYTES;
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const float lse = close_row(st[i]);
    const int row = WARP_ROWS * warp + warp_row(i, g, t);
#pragma unroll
    for (int n = 0; n < DIM_TILES; ++n)
      *reinterpret_cast<uint32_t*>(o_tile + tile_offset<O_ROW_BYTES>(row, n) + 4 * t) =
          pack2<OT>(st[i].o[2 * n] * p.v_scale, st[i].o[2 * n + 1] * p.v_scale);
    const int packed = first + warp_row(i, g, t);
    if (p.lse != nullptr && t == 0 && packed < rows_in && writes_lse()) {
      const PackedRow r = unpack_row(packed, p);
      if constexpr (MLA)
        p.lse[(w.qo_start + r.query) * p.lse_stride_n + r.head] = lse;
      else
        p.lse[(w.qo_start + r.query) * p.lse_stride_n + kv_head * p.group_size + r.head] = lse;
    }
  }
  __syncwarp();
  constexpr int O_CHUNKS = O_ROW_BYTES / 16;
  constexpr int PIECES = WARP_ROWS * O_CHUNKS;  // 16-byte pieces of the warp's rows
#pragma unroll
  for (int k = lane; k < PIECES; k += 32) {
    const int r = k / O_CHUNKS, c = k % O_CHUNKS, packed = first + r;
    if (packed >= rows_in) continue;
    const uint4 piece = *reinterpret_cast<const uint4*>(
        o_tile + tile_offset<O_ROW_BYTES>(WARP_ROWS * warp + r, c));
    const PackedRow rw = unpack_row(packed, p);
    OT* o = p.o + (w.qo_start + rw.query) * p.o_stride_n +
            (kv_head * p.group_size + rw.head) * p.o_stride_h;
    if constexpr (MLA)  // the one kv head takes all heads; this warp writes its dims
      o = p.o + (w.qo_start + rw.query) * p.o_stride_n + rw.head * p.o_stride_h + o_dim0();
    *reinterpret_cast<uint4*>(o + 8 * c) = piece;
  }
}

// The rows' results: normalized and written to o / lse (the tile's only item, KV_WARPS > 1) or
// as fp32 partials to the item's slot (KEY_MAJOR: finish_rows_key_major).
RTC_DEVICE void finish_rows(State (&st)[ROWS], const Rows& rows, const PrefillWorkItem& w,
                            const PrefillParams& p, int kv_head, int warp, int g, int t) {
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const float lse = close_row(st[i]);
    if (!rows.valid[i]) continue;
    if (w.slot < 0) {
      OT* o = p.o + (w.qo_start + rows.query[i]) * p.o_stride_n + rows.head[i] * p.o_stride_h;
      if constexpr (MLA) o += o_dim0();
#pragma unroll
      for (int n = 0; n < DIM_TILES; ++n) {
        o[8 * n + 2 * t] = from_float<OT>(st[i].o[2 * n] * p.v_scale);
        o[8 * n + 2 * t + 1] = from_float<OT>(st[i].o[2 * n + 1] * p.v_scale);
      }
      if (p.lse != nullptr && t == 0 && writes_lse())
        p.lse[(w.qo_start + rows.query[i]) * p.lse_stride_n + rows.head[i]] = lse;
    } else {
      const int row = WARP_ROWS * warp + warp_row(i, g, t);
      const int64_t at = (static_cast<int64_t>(w.slot) * gridDim.x + kv_head) * TILE_ROWS + row;
      float* o = p.partial_o + at * HEAD_DIM_VO;
      if constexpr (MLA) o += o_dim0();
#pragma unroll
      for (int n = 0; n < DIM_TILES; ++n)
        *reinterpret_cast<float2*>(o + 8 * n + 2 * t) =
            make_float2(st[i].o[2 * n] * p.v_scale, st[i].o[2 * n + 1] * p.v_scale);
      if (t == 0 && writes_lse()) p.partial_lse[at] = lse;
    }
  }
}

// finish_rows of an 8-row tile: lane (g, t) holds dims o_dim_of(c, g, e) of rows 2t, 2t + 1
// (o[2c + e]); lane g = 0 of a row writes its lse.
RTC_DEVICE void finish_rows_key_major(State (&st)[ROWS], const Rows& rows,
                                      const PrefillWorkItem& w, const PrefillParams& p,
                                      int kv_head, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const float lse = close_row(st[i]);
    if (!rows.valid[i]) continue;
    if (w.slot < 0) {
      OT* o = p.o + (w.qo_start + rows.query[i]) * p.o_stride_n + rows.head[i] * p.o_stride_h;
#pragma unroll
      for (int e = 0; e < O_FLOATS; ++e)
        o[o_dim_of<FP8_DIRECT>(e / 2, g, e % 2)] = from_float<OT>(st[i].o[e] * p.v_scale);
      if (p.lse != nullptr && g == 0)
        p.lse[(w.qo_start + rows.query[i]) * p.lse_stride_n + rows.head[i]] = lse;
    } else {
      const int row = warp_row(i, g, t);
      const int64_t at = (static_cast<int64_t>(w.slot) * gridDim.x + kv_head) * TILE_ROWS + row;
      float* o = p.partial_o + at * HEAD_DIM_VO;
#pragma unroll
      for (int e = 0; e < O_FLOATS; ++e)
        o[o_dim_of<FP8_DIRECT>(e / 2, g, e % 2)] = st[i].o[e] * p.v_scale;
      if (g == 0) p.partial_lse[at] = lse;
    }
  }
}

// The tile's partials (merge_count slots from merge_slot, in chunk order) merged into o / lse,
// by the last CTA of the tile: thread (row, 4 dims) walks the slots. With M = max lse_k and
// w_k = 2^(lse_k - M): o = sum_k w_k o_k / sum_k w_k, lse = M + log2(sum_k w_k).
RTC_DEVICE void merge_tile(const PrefillWorkItem& w, const PrefillParams& p, int kv_head) {
  constexpr int VECS = HEAD_DIM_VO / 4;
  for (int i = threadIdx.x; i < TILE_ROWS * VECS; i += THREADS) {
    const int row = i / VECS, d = (i % VECS) * 4;
    const int packed = w.tile_row + row;
    if (packed >= w.qo_len * p.group_size) continue;
    const PackedRow r = unpack_row(packed, p);
    const int query = r.query, head = MLA ? r.head : kv_head * p.group_size + r.head;
    AttentionState<4> acc;
    acc.init();
    for (int k = 0; k < w.merge_count; ++k) {
      const int64_t at =
          (static_cast<int64_t>(w.merge_slot + k) * gridDim.x + kv_head) * TILE_ROWS + row;
      const float4 v =
          __ldcg(reinterpret_cast<const float4*>(p.partial_o + at * HEAD_DIM_VO + d));
      AttentionState<4> part;
      const float o4[4] = {v.x, v.y, v.z, v.w};
      part.set_normalized(o4, __ldcg(p.partial_lse + at));
      acc.merge(part);
    }
    acc.normalize();
    OT* o = p.o + (w.qo_start + query) * p.o_stride_n + head * p.o_stride_h + d;
    
    *reinterpret_cast<uint2*>(o) =  // 8 bytes at an 8-byte multiple of an aligned row
        make_uint2(pack2<OT>(acc.o[0], acc.o[1]), pack2<OT>(acc.o[2], acc.o[3]));
    if (p.lse != nullptr && d == 0)
      p.lse[(w.qo_start + query) * p.lse_stride_n + head] = acc.lse();
  }
}
