// The rows of prefill.cu's query tile (included after PrefillParams): a packed row's query
// and head (unpack_row), a thread's rows in its warp (warp_row), and what each of its rows
// needs to read, mask and write (Rows).
#pragma once

// A packed row's query (row / group_size, by the plan's magic number: a division by a runtime
// value takes ~20 instructions, and the Q load and the epilogue need one per 16-byte piece) and
// its head within the kv head's group.
struct PackedRow {
  int query, head;
};
RTC_DEVICE PackedRow unpack_row(int packed, const PrefillParams& p) {
  const int query = FastDiv{p.group_magic, p.group_shift}.div(packed);
  return {query, packed - query * p.group_size};
}

// This warp's share of O's dims among the DIM_WARPS on its rows (MLA), o's first dim of it,
// and whether it writes its rows' LSE (the first of them: the others hold the same). MLA's
// one kv head takes all Hq heads (a packed row's head is its q / o head, where it is kv_head *
// group_size + its index elsewhere).
RTC_DEVICE int dim_warp() { return DIM_WARPS > 1 ? threadIdx.x / 32 % DIM_WARPS : 0; }
RTC_DEVICE int o_dim0() { return dim_warp() * WARP_DIMS; }
RTC_DEVICE bool writes_lse() { return dim_warp() == 0; }

// The warp's row of this thread's row i (g, g + 8 of each 16-row block: i = 2 block + half;
// KEY_MAJOR: 2t + i).
RTC_DEVICE int warp_row(int i, int g, int t) {
  return KEY_MAJOR ? 2 * t + i : 16 * (i / 2) + g + 8 * (i % 2);
}

// This thread's ROWS rows: where they read and write, their query position and ALiBi slope;
// rows past the request are inert.
struct Rows {
  bool valid[ROWS];
  int query[ROWS], head[ROWS], pos[ROWS];
  float slope[ROWS];
  int64_t mask_bit[ROWS];  // CUSTOM_MASK: the bit of (the row's query, key 0)
  int pos_first, pos_last;  // positions of the warp's first and last rows in the request

  RTC_DEVICE void init(const PrefillWorkItem& w, const PrefillParams& p, int kv_head, int warp,
                       int g, int t) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const int packed = w.tile_row + WARP_ROWS * warp + warp_row(i, g, t);
      const PackedRow r = unpack_row(packed, p);
      valid[i] = packed < w.qo_len * p.group_size;
      query[i] = r.query;
      head[i] = MLA ? r.head : kv_head * p.group_size + r.head;  // (MLA: above)
      pos[i] = query[i] + w.kv_len - w.qo_len;
      slope[i] = ALIBI ? alibi_slope(head[i], p.num_qo_heads) : 0.f;
      mask_bit[i] = 8 * static_cast<int64_t>(w.mask_byte) +
                    static_cast<int64_t>(query[i]) * w.kv_len;
    }
    const int first = w.tile_row + WARP_ROWS * warp, rows_in = w.qo_len * p.group_size;
    const int last = min(first + WARP_ROWS - 1, max(rows_in - 1, first));
    pos_first = unpack_row(first, p).query + w.kv_len - w.qo_len;
    pos_last = unpack_row(last, p).query + w.kv_len - w.qo_len;
  }

  // Whether every row of the warp sees every key of [lo, hi] (the item's range, the causal
  // bound and the window): such a block of keys skips the per-element masks.
  RTC_DEVICE bool all_see(int lo, int hi, int begin, int end, int window_left) const {
    bool ok = !CUSTOM_MASK && lo >= begin && hi < end;
    if constexpr (CAUSAL) ok = ok && hi <= pos_first;
    return window_left >= 0 ? ok && lo >= pos_last - window_left : ok;
  }

  // Whether key `key` is visible to row i within the item's keys [begin, end).
  RTC_DEVICE bool sees(int i, int key, int begin, int end, int window_left,
                       const uint8_t* mask) const {
    bool ok = key >= begin && key < end;
    if constexpr (CAUSAL) ok = ok && key <= pos[i];
    if constexpr (CUSTOM_MASK) {
      const int64_t bit = mask_bit[i] + key;
      ok = ok && valid[i] && (__ldg(mask + (bit >> 3)) >> (bit & 7) & 1);
    }
    return window_left >= 0 ? ok && key >= pos[i] - window_left : ok;
  }
};

// Row i's score at key `key`: the logit transform (variant.cuh; FOLD: applied later, in the
// exp2) and, MASKED, the visibility tests (-inf where hidden). The per-element step of every
// tile's scores (attend_tile, the 8-row and MLA tiles).
template <bool MASKED>
RTC_DEVICE float row_logit(float v, const Rows& rows, int i, int key, const PrefillWorkItem& w,
                           const LogitTransform<ALIBI, SOFT_CAP>& transform, int window_left,
                           const uint8_t* mask) {
  if constexpr (!FOLD) v = transform(v, rows.slope[i], key - rows.pos[i]);
  if constexpr (MASKED)
    v = rows.sees(i, key, w.kv_begin, w.kv_end, window_left, mask) ? v : neg_inf();
  return v;
}
