// Streaming one kv head of one request out of a paged KV cache into shared-memory tiles.
//   token j of the request lives in page page_ids[j / page_size], slot j % page_size, at byte
//   cache + page * page_stride + slot * token_stride  (+ head * head_stride, folded into cache)
// NHD and HND caches differ only in the strides, and so do non-contiguous views.
// A tile holds TILE consecutive tokens as [TILE][ROW_BYTES]; the 16-byte chunks of each row are
// XOR-swizzled (tile_offset) so that the 8 rows read by one ldmatrix phase fall in 8 different
// bank groups. Copy mapping: thread i moves chunk i % CHUNKS of rows i / CHUNKS + p * ROWS_PER_PASS
// (p < PASSES) with cp.async; rows past the end of the token range are zero-filled.
// ONE_PAGE (a ragged cache: request b's rows start at row page_ids[0] = kv_indptr[b]): token j
// is row page_ids[0] + j, at cache + row * token_stride; no page table is read per tile.
#pragma once

// n / d for a runtime d >= 1 and 0 <= n < 2^31: (umulhi(n, magic) + n) >> shift, with
// shift = ceil(log2 d) and magic = floor(2^32 (2^shift - d) / d) + 1 (set on the host).
struct FastDiv {
  uint32_t magic;
  int shift;
  RTC_DEVICE int div(int n) const {
    return static_cast<int>((__umulhi(static_cast<uint32_t>(n), magic) + n) >> shift);
  }
};

// p + a * b bytes, the product taken 32 x 32 -> 64 bits in one multiply-add (mad.wide.s32; a
// 64-bit product of sign-extended operands takes three).
RTC_DEVICE const char* offset_wide(const char* p, int a, int b) {
  const char* out;
  asm("mad.wide.s32 %0, %1, %2, %3;" : "=l"(out) : "r"(a), "r"(b), "l"(p));
  return out;
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][ROW_BYTES] tile.
template <int ROW_BYTES>
RTC_DEVICE uint32_t tile_offset(int row, int chunk) {
  constexpr int CHUNKS = ROW_BYTES / 16;
  constexpr int SPAN = CHUNKS < 8 ? CHUNKS : 8;       // chunks permuted within a 128-byte line
  constexpr int ROWS_PER_LINE = CHUNKS < 8 ? 8 / CHUNKS : 1;
  static_assert(ROW_BYTES % 64 == 0, "rows of at least 4 chunks, whole 64-byte units");
  const int phys = chunk ^ ((row / ROWS_PER_LINE) % SPAN);
  return static_cast<uint32_t>(row * ROW_BYTES + phys * 16);
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a [ROWS][ROW_BYTES] tile in the
// 128-byte-swizzled canonical layout (ROW_BYTES a multiple of 128; the tile 1024-byte aligned).
template <int ROWS, int ROW_BYTES>
RTC_DEVICE uint32_t wgmma_tile_offset(int row, int chunk) {
  static_assert(ROW_BYTES % 128 == 0 && ROWS % 8 == 0, "whole 128-byte blocks, 8-row groups");
  const int block = chunk / 8, phys = (chunk % 8) ^ (row % 8);
  return static_cast<uint32_t>(block * ROWS * 128 + row * 128 + phys * 16);
}

// CANONICAL: the tiles in wgmma's canonical layout (wgmma_tile_offset) instead.
template <int TILE, int ROW_BYTES, int THREADS, bool ONE_PAGE = false, bool CANONICAL = false>
struct PagedTileLoader {
  static constexpr int CHUNKS = ROW_BYTES / 16;
  static constexpr int ROWS_PER_PASS = THREADS / CHUNKS;
  static constexpr int PASSES = TILE / ROWS_PER_PASS;
  static_assert(THREADS % CHUNKS == 0 && TILE % ROWS_PER_PASS == 0, "whole rows per pass");

  const char* k_base;  // K of this kv head at page 0, slot 0, plus this thread's chunk
  const char* v_base;
  int k_page, k_token, v_page, v_token;  // byte strides (|stride| < 2^31: checked on the host)
  const int* page_ids;                   // this request's page list
  FastDiv page_div;
  int page_size;
  int token_end;  // tokens >= token_end are not read (zero-filled)
  int row0, chunk;
  int first_row;  // ONE_PAGE: the request's first row

  RTC_DEVICE void init(const char* k, int64_t kp, int64_t kt, const char* v, int64_t vp,
                       int64_t vt, const int* ids, FastDiv div, int ps, int end) {
    row0 = threadIdx.x / CHUNKS;
    chunk = threadIdx.x % CHUNKS;
    k_base = k + chunk * 16, v_base = v + chunk * 16;
    k_page = static_cast<int>(kp), k_token = static_cast<int>(kt);
    v_page = static_cast<int>(vp), v_token = static_cast<int>(vt);
    page_ids = ids, page_div = div, page_size = ps, token_end = end;
    first_row = ONE_PAGE ? __ldg(ids) : 0;
  }

  // Page ids of this thread's rows of the tile starting at token tile_begin (0 past the end).
  RTC_DEVICE void fetch_pages(int (&pages)[PASSES], int tile_begin) const {
    if constexpr (ONE_PAGE) return;
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
      const int token = tile_begin + row0 + p * ROWS_PER_PASS;
      pages[p] = token < token_end ? __ldg(page_ids + page_div.div(token)) : 0;
    }
  }

  // cp.async this thread's chunks of the tile into k_tile / v_tile (shared addresses).
  RTC_DEVICE void issue(const int (&pages)[PASSES], int tile_begin, uint32_t k_tile,
                        uint32_t v_tile) const {
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
      const int row = row0 + p * ROWS_PER_PASS;
      const int token = tile_begin + row;
      const bool valid = token < token_end;
      const char* k_src;
      const char* v_src;
      if constexpr (ONE_PAGE) {
        k_src = offset_wide(k_base, first_row + token, k_token);
        v_src = offset_wide(v_base, first_row + token, v_token);
      } else {
        const int slot = token - page_div.div(token) * page_size;
        const int page = pages[p];
        k_src = offset_wide(k_base, page, k_page) + slot * k_token;  // slot * stride: 32 bits
        v_src = offset_wide(v_base, page, v_page) + slot * v_token;
      }
      uint32_t dst;
      if constexpr (CANONICAL)
        dst = wgmma_tile_offset<TILE, ROW_BYTES>(row, chunk);
      else
        dst = tile_offset<ROW_BYTES>(row, chunk);
      cp_async_16(k_tile + dst, valid ? k_src : k_base, valid);
      cp_async_16(v_tile + dst, valid ? v_src : v_base, valid);
    }
  }
};
