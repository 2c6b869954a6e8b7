// Batch decode attention over a paged KV cache in one launch (split-KV merged in-kernel); the
// math and its layout are in decode_body.cuh.
// Grid: blockIdx.x = kv head x sub-group, blockIdx.y = work item (a chunk of one request's
// tokens, from the plan): the CTAs of one item, reading neighbouring heads of the same pages,
// are dispatched together, and items past the plan's count (a grid sized for a capacity) come
// last and exit at once.
// K/V tiles of TILE tokens stream through a STAGES-deep cp.async ring, LOOK of them in flight
// ahead of the one computed (STAGES - 1, or the spec's LOOKAHEAD). Shared memory: the ring
// (the epilogue and the split merge reuse it), the padded q rows, RoPE frequencies, per-warp
// (m, d); the total is SMEM_BYTES.
// A split item writes an fp32 partial (o, lse); the partials of a CTA column (query heads
// head0 .. head0 + heads) are contiguous rows: item k, head h at row
// head0 * gridDim.y + k * heads + h, so the merge reads one block. The last CTA of its (request,
// kv head) - found with an atomic counter that it then resets - merges them in chunk order.
#include "decode_body.cuh"

static_assert(WARPS * HEADS * O_STRIDE * 4 <= RING_BYTES, "epilogue fits in the ring");
static_assert(RING_BYTES + Q_BYTES + FREQ_BYTES + STATE_BYTES == SMEM_BYTES, "host layout");
constexpr int LOOK = LOOKAHEAD > 0 ? LOOKAHEAD : STAGES - 1;
static_assert(LOOK >= 1 && LOOK <= STAGES - 1, "the ring holds the tiles in flight");

#include "decode_item.cuh"

struct DecodeParams {
  const QT* q;             // [B, Hq, HEAD_DIM], strides (q_stride_n, q_stride_h, 1)
  const char* k_cache;     // K(page, slot, head) at page * k_page + slot * k_token
  const char* v_cache;     //   + head * k_head bytes (NHD/HND); V likewise
  OT* o;                   // [B, Hq, HEAD_DIM], strides (o_stride_n, o_stride_h, 1)
  float* lse;              // [B, Hq], strides (lse_stride_n, 1); may be null
  const int* plan;         // [HEADER_INTS] + DecodeWorkItem[capacity] + page ids
  float* partial_o;        // [Hq * gridDim.y, HEAD_DIM] (rows: see above)
  float* partial_lse;      // [Hq * gridDim.y]
  int* counters;           // [max_batch, gridDim.x], zero between launches
  int64_t q_stride_n, q_stride_h, o_stride_n, o_stride_h, lse_stride_n;
  int64_t k_page, k_token, k_head, v_page, v_token, v_head;
  int num_qo_heads, group_size, page_size;
  int num_rows;            // rows of q and o: items of later requests (a plan for a larger
                           // batch, passed as an array) are skipped
  uint32_t div_magic;      // n / page_size == (umulhi(n, div_magic) + n) >> div_shift
  int div_shift;
  int window_left;         // keys older than q_pos - window_left are masked; -1: none
  float qk_scale;          // sm_scale * q_scale * k_scale
  float soft_cap;          // 0: none
  float v_scale;
};

extern "C" __global__ void __launch_bounds__(THREADS, 2)
    decode_kernel(const __grid_constant__ DecodeParams p) {
  wait_for_previous_grid();
  const QT* __restrict__ q = p.q;
  const int* __restrict__ plan = p.plan;
  float* __restrict__ partial_o = p.partial_o;
  float* __restrict__ partial_lse = p.partial_lse;
  const int num_qo_heads = p.num_qo_heads, group_size = p.group_size, window_left = p.window_left;
  extern __shared__ __align__(128) unsigned char smem[];
  const int item = blockIdx.y;
  // The work item, loaded before the count test so both loads overlap: the plan region holds
  // an item for every CTA of the grid (padded slots are stale and unused).
  const DecodeWorkItem w = reinterpret_cast<const DecodeWorkItem*>(plan + HEADER_INTS)[item];
  if (item >= __ldg(plan) || w.request >= p.num_rows) return;
  const int subgroups = (group_size + HEADS - 1) / HEADS;
  const int kv_head = blockIdx.x / subgroups, sub = blockIdx.x % subgroups;
  const int head0 = kv_head * group_size + sub * HEADS;  // first query head of this CTA
  const int heads = min(HEADS, group_size - sub * HEADS);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  const int request = w.request, q_pos = w.kv_len - 1;
  const int begin = window_left >= 0 ? max(w.token_begin, q_pos - window_left) : w.token_begin;
  const int end = w.token_end;
  const int merge_begin = w.merge_begin, merge_count = w.merge_count;
  const int num_tiles = begin < end ? (end - begin + TILE - 1) / TILE : 0;

  unsigned char* ring = smem;
  MT* q_s = reinterpret_cast<MT*>(smem + RING_BYTES);
  float2* freq_s = reinterpret_cast<float2*>(smem + RING_BYTES + Q_BYTES);
  float* m_s = reinterpret_cast<float*>(smem + RING_BYTES + Q_BYTES + FREQ_BYTES);
  float* d_s = m_s + WARPS * HEADS;
  int* last_s = reinterpret_cast<int*>(d_s + WARPS * HEADS);
  const uint32_t ring_addr = smem_addr(ring);
  auto k_tile = [&](int stage) { return ring_addr + stage * 2 * TILE_BYTES; };
  auto v_tile = [&](int stage) { return ring_addr + stage * 2 * TILE_BYTES + TILE_BYTES; };

  // Prologue: page ids of the first LOOK tiles (loads in parallel), then their copies; a
  // commit group per stage either way, so the loop counts groups the same.
  Loader loader;
  loader.init(p.k_cache + kv_head * p.k_head, p.k_page, p.k_token,
              p.v_cache + kv_head * p.v_head, p.v_page, p.v_token, plan + w.page_ids,
              FastDiv{p.div_magic, p.div_shift}, p.page_size, end);
  {
    int pages[LOOK][Loader::PASSES];
#pragma unroll
    for (int s = 0; s < LOOK; ++s)
      if (s < num_tiles) loader.fetch_pages(pages[s], begin + s * TILE);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < LOOK && s < num_tiles) loader.issue(pages[s], begin + s * TILE, k_tile(s), v_tile(s));
      cp_async_commit();
    }
  }
  int pages[Loader::PASSES] = {};
  if (LOOK < num_tiles) loader.fetch_pages(pages, begin + LOOK * TILE);

  const float2* freq = reinterpret_cast<const float2*>(plan + 4);
  if constexpr (ROPE)
    for (int i = threadIdx.x; i < HEAD_DIM / 2; i += THREADS) freq_s[i] = __ldg(freq + i);
  QuerySide qs;
  qs.load(q_s, q, p.q_stride_n, p.q_stride_h, request, head0, heads, q_pos, freq, g, t);
  LogitHook hook;
  hook.init(p.qk_scale, p.soft_cap, head0, num_qo_heads, t);
  State st[HEAD_TILES][2];
  init_states(st);

  for (int tile = 0; tile < num_tiles; ++tile) {
    cp_async_wait<LOOK - 1>();  // the newer tiles' groups may still be in flight
    __syncthreads();  // tile landed for everyone; the stage refilled below is no longer read
    const int next = tile + LOOK;
    if (next < num_tiles)
      loader.issue(pages, begin + next * TILE, k_tile(next % STAGES), v_tile(next % STAGES));
    cp_async_commit();
    if (next + 1 < num_tiles) loader.fetch_pages(pages, begin + (next + 1) * TILE);
    attend_tile(st, qs, q_s, freq_s, hook, k_tile(tile % STAGES), v_tile(tile % STAGES),
                begin + tile * TILE, end, q_pos, warp, lane, g, t);
  }

  // Epilogue: the ring is free once every copy has landed and every warp is done with it.
  cp_async_wait<0>();
  __syncthreads();
  const bool direct = merge_count == 1;
  const int64_t partial_row = static_cast<int64_t>(head0) * gridDim.y;
  const int64_t at = partial_row + static_cast<int64_t>(item) * heads;
  OT* o_row = p.o + request * p.o_stride_n + head0 * p.o_stride_h;
  float* lse_row = p.lse != nullptr ? p.lse + request * p.lse_stride_n + head0 : nullptr;
  const ItemSink sink{o_row, p.o_stride_h, lse_row, direct ? nullptr : partial_o + at * HEAD_DIM,
                      partial_lse + at};
  finish_item(st, reinterpret_cast<float*>(ring), m_s, d_s, sink, heads, p.v_scale, warp, g, t);
  if (direct) return;

  // Split item: publish the partial; the last of the request's items merges them all. The
  // barrier (end of finish_item) orders the CTA's partial writes before thread 0's release
  // (acq_rel atomic); the last arrival's acquire orders every other item's partial before its
  // reads.
  if (threadIdx.x == 0) {
    int* counter = p.counters + request * gridDim.x + blockIdx.x;
    const bool last = atomic_add_acq_rel(counter, 1) == merge_count - 1;
    if (last) atomicExch(counter, 0);  // ready for the next launch
    *last_s = last;
  }
  __syncthreads();
  if (!*last_s) return;
  merge_partials(ring, partial_o, partial_lse,
                 partial_row + static_cast<int64_t>(merge_begin) * heads, merge_count, heads,
                 o_row, p.o_stride_h, lse_row);
}
