// The work items of a prefill plan without split KV, expanded on the device from its requests:
// request b's tiles t = 0 .. tiles_b - 1 become items tile_indptr[b] + t (one a tile), so the
// host uploads a few ints a request instead of 12 an item.
//   tile_row = t TILE_ROWS; keys [kv_begin, kv_end) of the tile (plan/prefill.py's _key_ranges):
//     offset = kv_len - qo_len (the key position of query 0)
//     kv_end = causal ? max(0, offset + ceil(min(tile_row + TILE_ROWS, qo_len g) / g)) : kv_len
//     kv_begin = window_left >= 0 ? min(max(0, offset + tile_row / g - window_left), kv_end) : 0
//   slot = merge_slot = -1, merge_count = 1, tile = the item's index.
// The requests' table (int32, in the plan region at requests_at): tile_indptr[batch + 1], then
// qo_start, qo_len, kv_len, page_ids (where the request's page ids start in the plan) and
// mask_byte, [batch] each. Grid: one warp per request, 4 a block; lane l writes tiles l, l + 32..
#include "prefill_item.cuh"

struct PrefillItemsParams {
  int* plan;             // the plan region (int32), items at items_at
  const int* requests;   // [5 batch + batch + 1] the requests' table above
  int batch;             // requests
  int tile_rows;         // packed query rows a tile
  int group_size;        // query heads a kv head
  int items_at;          // where the items start in the plan (ints)
  int causal;            // 1: the causal mask bounds each tile's keys
  int window_left;       // -1: no sliding window
};

extern "C" __global__ void __launch_bounds__(128) prefill_items_kernel(
    const __grid_constant__ PrefillItemsParams p) {
  wait_for_previous_grid();
  const int b = blockIdx.x * 4 + threadIdx.x / 32;
  if (b >= p.batch) return;
  const int* tile_indptr = p.requests;
  const int* rest = p.requests + p.batch + 1;
  const int first = tile_indptr[b], tiles = tile_indptr[b + 1] - first;
  const int qo_start = rest[b], qo_len = rest[p.batch + b], kv_len = rest[2 * p.batch + b];
  const int page_ids = rest[3 * p.batch + b], mask_byte = rest[4 * p.batch + b];
  const int g = p.group_size, offset = kv_len - qo_len;
  const long long rows = static_cast<long long>(qo_len) * g;
  PrefillWorkItem* items = reinterpret_cast<PrefillWorkItem*>(p.plan + p.items_at);
  for (int t = threadIdx.x % 32; t < tiles; t += 32) {
    const int tile_row = t * p.tile_rows;
    int kv_end = kv_len;
    if (p.causal) {
      const long long last = min(static_cast<long long>(tile_row) + p.tile_rows, rows);
      kv_end = max(0, offset + static_cast<int>((last + g - 1) / g));
    }
    int kv_begin = 0;
    if (p.window_left >= 0) kv_begin = min(max(0, offset + tile_row / g - p.window_left), kv_end);
    PrefillWorkItem w;
    w.qo_start = qo_start;
    w.qo_len = qo_len;
    w.kv_len = kv_len;
    w.page_ids = page_ids;
    w.tile_row = tile_row;
    w.kv_begin = kv_begin;
    w.kv_end = kv_end;
    w.slot = -1;
    w.tile = first + t;
    w.merge_slot = -1;
    w.merge_count = 1;
    w.mask_byte = mask_byte;
    items[first + t] = w;  // three 16-byte stores (the struct is 16-byte aligned)
  }
}
