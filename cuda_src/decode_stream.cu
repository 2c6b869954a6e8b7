// Batch decode with persistent CTAs: gridDim.y CTAs per kv head (x sub-group) pull work items
// from that column's queue, so CTAs on faster SMs take more of them (the plan puts big pieces
// first and small ones last, plan/stream.py). The math and its layout are in decode_body.cuh.
// Within a CTA, the K/V tiles of consecutive items form one stream through the STAGES-deep
// cp.async ring: the producer (every thread, at the top of each tile step) issues tile n +
// STAGES - 1 while tile n is consumed, crossing into the next item when the current one has no
// tiles left, so the ring never drains at an item boundary. The next item is prepared one step
// at a time while the current one streams: its queue ticket (thread 0's atomic), its record,
// the page ids of its first tile; its q rows are prefetched into L2.
// Every item holds at least one tile (the planner cuts pieces inside the window). An item ends
// with the epilogue of decode_body.cuh through its own shared-memory region (the ring is busy
// with the next item's tiles), in EPI_PASSES passes over head_dim, then as in decode.cu: a direct
// output, or a partial in its slot and, for the last piece of a request to arrive, the merge.
// The last CTA of a column to finish resets the column's queue and exit counters.
#include "decode_body.cuh"

constexpr int EPI_PASSES = 2;
constexpr int EPI_BYTES = WARPS * HEADS * (HEAD_DIM / EPI_PASSES + 4) * 4;
constexpr int RECORDS = 4;  // item records between producer and consumer
constexpr int RECORD_BYTES = RECORDS * 32 + 16;  // + the ticket mailbox
static_assert(RECORDS > STAGES, "the producer runs at most STAGES - 1 tiles (items) ahead");
static_assert(RING_BYTES + Q_BYTES + FREQ_BYTES + STATE_BYTES + EPI_BYTES + RECORD_BYTES ==
                  SMEM_BYTES,
              "host layout");

extern "C" __global__ void __launch_bounds__(THREADS, 2) decode_kernel(
    const QT* __restrict__ q,        // [B, Hq, HEAD_DIM], strides (q_stride_n, q_stride_h, 1)
    int64_t q_stride_n, int64_t q_stride_h,
    const char* __restrict__ k_cache,  // K(page, slot, head) at page * k_page + slot * k_token
    int64_t k_page, int64_t k_token, int64_t k_head,  //   + head * k_head bytes (NHD/HND)
    const char* __restrict__ v_cache,  // V, likewise
    int64_t v_page, int64_t v_token, int64_t v_head,
    OT* __restrict__ o,              // [B, Hq, HEAD_DIM], strides (o_stride_n, o_stride_h, 1)
    int64_t o_stride_n, int64_t o_stride_h,
    float* __restrict__ lse,         // [B, Hq], strides (lse_stride_n, 1); may be null
    int64_t lse_stride_n,
    const int* __restrict__ plan,    // [HEADER_INTS] + [capacity][8] work items (queue order)
    float* __restrict__ partial_o,   // [Hq * slots, HEAD_DIM] (rows as in decode.cu)
    float* __restrict__ partial_lse,  // [Hq * slots]
    int* __restrict__ counters,      // [2 + max_batch, gridDim.x]: queue heads, exits, arrivals
    int slots, int num_qo_heads, int group_size, int page_size, uint32_t div_magic,
    int div_shift, int window_left, float qk_scale, float soft_cap, float v_scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* ring = smem;
  MT* q_s = reinterpret_cast<MT*>(smem + RING_BYTES);
  float2* freq_s = reinterpret_cast<float2*>(smem + RING_BYTES + Q_BYTES);
  float* m_s = reinterpret_cast<float*>(smem + RING_BYTES + Q_BYTES + FREQ_BYTES);
  float* d_s = m_s + WARPS * HEADS;
  int* last_s = reinterpret_cast<int*>(d_s + WARPS * HEADS);
  unsigned char* epi_s = smem + RING_BYTES + Q_BYTES + FREQ_BYTES + STATE_BYTES;
  int4* record_s = reinterpret_cast<int4*>(epi_s + EPI_BYTES);  // [RECORDS][2]
  int* mail_s = reinterpret_cast<int*>(record_s + 2 * RECORDS);
  const uint32_t ring_addr = smem_addr(ring);
  auto k_tile = [&](int stage) { return ring_addr + stage * 2 * TILE_BYTES; };
  auto v_tile = [&](int stage) { return ring_addr + stage * 2 * TILE_BYTES + TILE_BYTES; };

  const int subgroups = (group_size + HEADS - 1) / HEADS;
  const int kv_head = blockIdx.x / subgroups, sub = blockIdx.x % subgroups;
  const int head0 = kv_head * group_size + sub * HEADS;  // first query head of this CTA
  const int heads = min(HEADS, group_size - sub * HEADS);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int num_work = __ldg(plan);
  const int4* items = reinterpret_cast<const int4*>(plan + HEADER_INTS);
  int* queue = counters + blockIdx.x;
  int* exits = counters + gridDim.x + blockIdx.x;
  auto first_token = [&](int4 w0) {
    return window_left >= 0 ? max(w0.y, w0.w - 1 - window_left) : w0.y;
  };
  auto tiles_of = [&](int4 w0) { return max(1, (w0.z - first_token(w0) + TILE - 1) / TILE); };

  if (threadIdx.x == 0) *mail_s = atomicAdd(queue, 1);
  const float2* freq = reinterpret_cast<const float2*>(plan + 4);
  if constexpr (ROPE)
    for (int i = threadIdx.x; i < HEAD_DIM / 2; i += THREADS) freq_s[i] = __ldg(freq + i);
  __syncthreads();

  // Producer: the item whose tiles it issues, the next tile's page ids, the next item's state.
  int p_idx = *mail_s;
  int4 pw0 = make_int4(0, 0, 0, 0), pw1 = pw0;
  int p_begin = 0, p_tiles = 0, p_tile = 0, p_seq = 0, produced = 0;
  bool p_done = p_idx >= num_work;
  Loader loader;
  int pages[Loader::PASSES] = {};
  int ticket = 0;  // thread 0: the queue ticket of the item after the current one
  int prep = 0;    // the next item's preparation: 0 ticket asked, 1 mailed, 2 record, 3 pages
  int n_idx = num_work;
  int4 nw0 = pw0, nw1 = pw0;
  int n_pages[Loader::PASSES] = {};

  auto prefetch_q = [&](int request) {  // the q rows of a coming item into L2
    constexpr int LINES = HEAD_DIM * sizeof(QT) / 128;
    if (threadIdx.x < heads * LINES) {
      const QT* row = q + request * q_stride_n + (head0 + threadIdx.x / LINES) * q_stride_h;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(row + threadIdx.x % LINES * (128 / sizeof(QT))));
    }
  };
  auto record = [&](int seq, int4 w0, int4 w1) {
    if (threadIdx.x == 0) record_s[2 * (seq % RECORDS)] = w0, record_s[2 * (seq % RECORDS) + 1] = w1;
  };
  auto begin_item = [&](int4 w0, int4 w1) {
    pw0 = w0, pw1 = w1;
    p_begin = first_token(w0), p_tiles = tiles_of(w0), p_tile = 0;
    record(p_seq, w0, w1);
    if (threadIdx.x == 0) ticket = atomicAdd(queue, 1);
    prep = 0;
  };
  // One step of the next item's preparation per tile (each step's loads land meanwhile);
  // `sync` completes it at once (a barrier between the mailbox write and its reads).
  auto prepare = [&](bool sync) {
    if (prep == 0) {
      if (threadIdx.x == 0) *mail_s = ticket;
      prep = 1;
      if (!sync) return;
      __syncthreads();
    }
    if (prep == 1) {
      n_idx = *mail_s;
      if (n_idx < num_work) {
        nw0 = __ldg(items + 2 * n_idx), nw1 = __ldg(items + 2 * n_idx + 1);
        prefetch_q(nw0.x);
      }
      prep = 2;
      if (!sync) return;
    }
    if (prep == 2) {
      if (n_idx < num_work) loader.fetch_pages(n_pages, first_token(nw0), plan + nw1.x, nw0.z);
      prep = 3;
    }
  };
  // Issue the stream's next tile into `stage` (an empty commit group once the queue is dry);
  // `step`: advance the preparation (only where a barrier separates consecutive calls).
  auto produce = [&](int stage, bool step) {
    if (!p_done && p_tile == p_tiles) {  // the current item is issued: move to the next one
      prepare(true);
      p_done = n_idx >= num_work;
      if (!p_done) {
        ++p_seq;
        begin_item(nw0, nw1);
        loader.retarget(plan + pw1.x, pw0.z);
#pragma unroll
        for (int i = 0; i < Loader::PASSES; ++i) pages[i] = n_pages[i];
      }
    } else if (!p_done && step) {
      prepare(false);
    }
    if (!p_done) {
      loader.issue(pages, p_begin + p_tile * TILE, k_tile(stage), v_tile(stage));
      ++produced;
      if (++p_tile < p_tiles) loader.fetch_pages(pages, p_begin + p_tile * TILE);
    }
    cp_async_commit();
  };

  if (!p_done) {
    const int4 w0 = __ldg(items + 2 * p_idx), w1 = __ldg(items + 2 * p_idx + 1);
    loader.init(k_cache + kv_head * k_head, k_page, k_token, v_cache + kv_head * v_head, v_page,
                v_token, plan + w1.x, FastDiv{div_magic, div_shift}, page_size, w0.z);
    begin_item(w0, w1);
    loader.fetch_pages(pages, p_begin);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) produce(s, false);
  }

  // Consumer: the item whose tiles it attends to.
  LogitHook hook;
  hook.init(qk_scale, soft_cap, head0, num_qo_heads, t);
  QuerySide qs;
  State st[HEAD_TILES][2];
  int c_seq = 0, c_tile = 0, c_tiles = 0, consumed = 0;
  int4 cw0, cw1;
  auto start_item = [&]() {
    __syncthreads();  // the record is written
    cw0 = record_s[2 * (c_seq % RECORDS)], cw1 = record_s[2 * (c_seq % RECORDS) + 1];
    c_tile = 0, c_tiles = tiles_of(cw0);
    qs.load(q_s, q, q_stride_n, q_stride_h, cw0.x, head0, heads, cw0.w - 1, freq, g, t);
    init_states(st);
  };
  if (produced > 0) start_item();

  while (consumed < produced) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile landed for everyone; the stage refilled below is no longer read
    produce((consumed + STAGES - 1) % STAGES, true);
    attend_tile(st, qs, q_s, freq_s, hook, k_tile(consumed % STAGES), v_tile(consumed % STAGES),
                first_token(cw0) + c_tile * TILE, cw0.z, cw0.w - 1, warp, lane, g, t);
    ++consumed;
    if (++c_tile < c_tiles) continue;

    // Item done: output or partial, then (split) the arrival count and maybe the merge.
    const int request = cw0.x, merge_begin = cw1.y, merge_count = cw1.z;
    const bool direct = merge_count == 1;
    const int64_t partial_row = static_cast<int64_t>(head0) * slots;
    const int64_t at = partial_row + static_cast<int64_t>(cw1.w) * heads;
    OT* o_row = o + request * o_stride_n + head0 * o_stride_h;
    float* lse_row = lse != nullptr ? lse + request * lse_stride_n + head0 : nullptr;
    const ItemSink sink{o_row, o_stride_h, lse_row,
                        direct ? nullptr : partial_o + at * HEAD_DIM, partial_lse + at};
    finish_item<EPI_PASSES>(st, reinterpret_cast<float*>(epi_s), m_s, d_s, sink, heads, v_scale,
                            warp, g, t);
    if (!direct) {  // ordering as in decode.cu: barrier, then thread 0's acq_rel arrival
      if (threadIdx.x == 0) {
        int* counter = counters + (2 + request) * gridDim.x + blockIdx.x;
        const bool last = atomic_add_acq_rel(counter, 1) == merge_count - 1;
        if (last) atomicExch(counter, 0);  // ready for the next launch
        *last_s = last;
      }
      __syncthreads();
      if (*last_s)
        merge_partials<EPI_BYTES>(epi_s, partial_o, partial_lse,
                                  partial_row + static_cast<int64_t>(merge_begin) * heads,
                                  merge_count, heads, o_row, o_stride_h, lse_row);
    }
    ++c_seq;
    if (consumed < produced) start_item();
  }
  cp_async_wait<0>();

  if (threadIdx.x == 0 && atomicAdd(exits, 1) == static_cast<int>(gridDim.y) - 1) {
    atomicExch(queue, 0);  // every CTA of the column is past its last ticket
    atomicExch(exits, 0);
  }
}
