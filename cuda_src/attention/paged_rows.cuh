// Streaming one kv head of one request into shared-memory tiles for the prefill kernel.
// PagedRowTable (a paged cache): the first TILE threads, one per row of a tile ("makers"), turn
// the tokens of the next tile into byte offsets (the page id from the plan, page and slot by
// FastDiv, the strides) and store them in a table in shared memory, one tile ahead; every
// thread's cp.async chunks then read their rows' offsets from it (a broadcast read). A row's page
// arithmetic is done once, where PagedTileLoader (paged_kv.cuh) redoes it in every thread that
// copies a 16-byte piece of the row (CHUNKS times), and the page ids in flight take one register
// a thread, not one per copy pass.
//   prefetch(t0)           makers: the page id of their row of the tile starting at token t0
//   prepare(t0, b, p)      makers: that tile's offsets into table buffer b; prefetch(t0 + TILE)
//   issue(t0, b, k, v)     everyone: cp.async of their chunks, the offsets from buffer b
// Buffer b is written by prepare and read by issue on opposite sides of a CTA barrier, and
// written again only after a barrier that follows its last issue (the caller's schedule).
// RaggedRows (ragged K/V, PagedTileLoader's ONE_PAGE form) has the same calls; its rows need no
// table.
// K rows of ROW_BYTES, V rows of V_ROW_BYTES: equal, thread i moves chunk i % CHUNKS of K's and
// V's rows i / CHUNKS + pass * ROWS_PER_PASS; fewer V bytes (head_dim_vo < head_dim_qk), each
// tile is walked on its own (issue_rows); V_ROW_BYTES 0: no V stream (MLA reads V from the K
// tile). SPLIT > 0 (a paged table only; MLA): a K row's first SPLIT bytes come from k_base +
// the row's first offset, the rest from k2_base + its second offset.
#pragma once

// cp.async of the rows [0, TILE) of a tile whose row r's 16-byte chunk c is at source(r, c),
// rows from `rows_in` on zero-filled (from `base`): thread i moves chunk i % CHUNKS of row
// i / CHUNKS, THREADS pieces apart (whatever ROW_BYTES / 16 is: 24 chunks at head_dim 192).
template <int TILE, int ROW_BYTES, int THREADS, bool CANONICAL, typename Source>
RTC_DEVICE void issue_rows(uint32_t tile, const char* base, int rows_in, Source source) {
  constexpr int CHUNKS = ROW_BYTES / 16;
#pragma unroll
  for (int i = threadIdx.x; i < TILE * CHUNKS; i += THREADS) {
    const int row = i / CHUNKS, chunk = i % CHUNKS;
    const bool valid = row < rows_in;
    uint32_t dst;
    if constexpr (CANONICAL)
      dst = wgmma_tile_offset<TILE, ROW_BYTES>(row, chunk);
    else
      dst = tile_offset<ROW_BYTES>(row, chunk);
    cp_async_16(tile + dst, valid ? source(row, chunk) : base, valid);
  }
}

template <int TILE, int ROW_BYTES, int V_ROW_BYTES, int THREADS, bool CANONICAL, int SPLIT = 0>
struct PagedRowTable {
  static constexpr bool SAME = ROW_BYTES == V_ROW_BYTES;
  static constexpr int CHUNKS = ROW_BYTES / 16;
  static constexpr int ROWS_PER_PASS = THREADS / CHUNKS;  // SAME's passes
  static constexpr int PASSES = SAME ? TILE / ROWS_PER_PASS : 0;
  static constexpr int BYTES = 2 * TILE * 16;  // [2 buffers][TILE] (K, V) int64 offset pairs
  static_assert(!SAME || (THREADS % CHUNKS == 0 && TILE % ROWS_PER_PASS == 0),
                "whole rows per pass");
  static_assert(THREADS >= TILE, "a maker thread per row");
  static_assert(SPLIT % 16 == 0 && SPLIT < ROW_BYTES && (SPLIT == 0 || !SAME), "whole chunks");

  const char* k_base;  // K of this kv head at page 0, slot 0, plus this thread's chunk (SAME)
  const char* v_base;
  const char* k2_base;   // SPLIT: the second part of K's rows
  longlong2* table;      // shared memory, BYTES
  const int* page_ids;   // this request's page list
  FastDiv page_div;
  int page_size;
  int token_end;  // tokens >= token_end are not read (zero-filled)
  int page;       // a maker's prefetched page id

  // kv head `kv_head` of work item w's request; `t`: the table (shared memory)
  template <typename Params, typename Item>
  RTC_DEVICE void init(const Params& p, const Item& w, int kv_head, longlong2* t) {
    const int chunk = SAME ? threadIdx.x % CHUNKS : 0;
    k_base = p.k_cache + kv_head * p.k_head + chunk * 16;
    v_base = p.v_cache + kv_head * p.v_head + chunk * 16;
    table = t, page_ids = p.plan + w.page_ids, page_div = FastDiv{p.div_magic, p.div_shift};
    page_size = p.page_size, token_end = w.kv_end;
    if constexpr (SPLIT > 0) k2_base = p.kpe_cache;
  }

  RTC_DEVICE void prefetch(int t0) {
    const int token = t0 + static_cast<int>(threadIdx.x);
    if (threadIdx.x < TILE) page = token < token_end ? __ldg(page_ids + page_div.div(token)) : 0;
  }

  // The byte strides (and slot x stride) fit in 32 bits, checked on the host; page x stride
  // is taken 32 x 32 -> 64 bits.
  template <typename Params>
  RTC_DEVICE void prepare(int t0, int b, const Params& p) {
    if (threadIdx.x < TILE) {
      const int token = t0 + static_cast<int>(threadIdx.x);
      const int slot = token - page_div.div(token) * page_size;
      const int64_t k = static_cast<int64_t>(page) * static_cast<int>(p.k_page) +
                        slot * static_cast<int>(p.k_token);
      const int64_t v = static_cast<int64_t>(page) * static_cast<int>(p.v_page) +
                        slot * static_cast<int>(p.v_token);
      table[b * TILE + threadIdx.x] = make_longlong2(k, v);
    }
    prefetch(t0 + TILE);
  }

  RTC_DEVICE void issue(int t0, int b, uint32_t k_tile, uint32_t v_tile) const {
    if constexpr (!SAME) {
      const longlong2* rows = table + b * TILE;
      issue_rows<TILE, ROW_BYTES, THREADS, CANONICAL>(
          k_tile, k_base, token_end - t0, [&](int row, int chunk) {
            if constexpr (SPLIT > 0)
              if (chunk >= SPLIT / 16) return k2_base + rows[row].y + (chunk * 16 - SPLIT);
            return k_base + rows[row].x + chunk * 16;
          });
      if constexpr (V_ROW_BYTES > 0)
        issue_rows<TILE, V_ROW_BYTES, THREADS, CANONICAL>(
            v_tile, v_base, token_end - t0,
            [&](int row, int chunk) { return v_base + rows[row].y + chunk * 16; });
      return;
    }
    const int row0 = threadIdx.x / CHUNKS, chunk = threadIdx.x % CHUNKS;
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
      const int row = row0 + pass * ROWS_PER_PASS;
      const bool valid = t0 + row < token_end;
      const longlong2 off = table[b * TILE + row];  // one 16-byte read: K's and V's offsets
      uint32_t dst;
      if constexpr (CANONICAL)
        dst = wgmma_tile_offset<TILE, ROW_BYTES>(row, chunk);
      else
        dst = tile_offset<ROW_BYTES>(row, chunk);
      cp_async_16(k_tile + dst, valid ? k_base + off.x : k_base, valid);
      cp_async_16(v_tile + dst, valid ? v_base + off.y : v_base, valid);
    }
  }
};

template <int TILE, int ROW_BYTES, int V_ROW_BYTES, int THREADS, bool CANONICAL>
struct RaggedRows {
  static constexpr int BYTES = 0;
  static constexpr bool SAME = ROW_BYTES == V_ROW_BYTES;
  struct NoLoader {};
  using Loader =  // SAME: one loader for K and V; else issue_rows for each
      Conditional<SAME, PagedTileLoader<TILE, ROW_BYTES, THREADS, true, CANONICAL>, NoLoader>;
  Loader loader;
  const char* k;  // !SAME: this kv head's row 0 of K and V
  const char* v;
  int k_token, v_token, first_row, token_end;

  // request rows from the one page id (its first row), no table
  template <typename Params, typename Item>
  RTC_DEVICE void init(const Params& p, const Item& w, int kv_head, longlong2*) {
    if constexpr (SAME) {
      loader.init(p.k_cache + kv_head * p.k_head, 0, p.k_token, p.v_cache + kv_head * p.v_head,
                  0, p.v_token, p.plan + w.page_ids, FastDiv{1, 0}, 1, w.kv_end);
    } else {
      k = p.k_cache + kv_head * p.k_head, v = p.v_cache + kv_head * p.v_head;
      k_token = static_cast<int>(p.k_token), v_token = static_cast<int>(p.v_token);
      first_row = __ldg(p.plan + w.page_ids), token_end = w.kv_end;
    }
  }
  RTC_DEVICE void prefetch(int) {}
  template <typename Params>
  RTC_DEVICE void prepare(int, int, const Params&) {}
  RTC_DEVICE void issue(int t0, int, uint32_t k_tile, uint32_t v_tile) const {
    if constexpr (SAME) {
      const int none[Loader::PASSES] = {};
      loader.issue(none, t0, k_tile, v_tile);
    } else {
      const int row0 = first_row + t0;
      issue_rows<TILE, ROW_BYTES, THREADS, CANONICAL>(
          k_tile, k, token_end - t0,
          [&](int row, int chunk) { return offset_wide(k, row0 + row, k_token) + chunk * 16; });
      issue_rows<TILE, V_ROW_BYTES, THREADS, CANONICAL>(
          v_tile, v, token_end - t0,
          [&](int row, int chunk) { return offset_wide(v, row0 + row, v_token) + chunk * 16; });
    }
  }
};
