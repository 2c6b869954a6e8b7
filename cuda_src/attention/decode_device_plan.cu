// The batch decode plan built on the device from the page table: the ints that plan() and then
// plan_array() give on the host for the same table (plan/decode.py's plan_decode chooses the
// chunk, attention/decode_plan.py's pack_plan lays the plan out: header | work items, room for
// max_work | page ids | zeros), for a wrapper of fixed capacity. A step captured in a CUDA graph
// or compiled by jax.jit then plans itself from the tables it already holds: nothing is
// computed or copied on the host. One launch:
//   CTA 0 checks the table, chooses the chunk of pages by plan_decode's rule (its integer and
//     float64 arithmetic, operation for operation), writes the header and the work items and
//     zeros the items' room past them;
//   CTAs 1.. copy the page ids (their place in the plan does not depend on the items), each
//     checked against the cache, and zero the rest.
// A bad table (kv_indptr not starting at 0, decreasing, or past kv_indices or the page
// capacity; a kv_last_page_len out of range; a request past MAX_KV_LEN tokens; a fixed split
// needing more work items than the capacity) is reported (bad_index.cuh) and planned as no work
// (num_work 0: run() writes nothing). A page id outside the cache is reported and page 0 read
// in its place.
// Prelude: PLAN_THREADS, MAX_KV_LEN and STRAGGLER_CUTS (plan/decode.py's), the BadIndex and
// PlanSplit enums.
#include "bad_index.cuh"
#include "decode_item.cuh"

constexpr int ITEM_INTS = sizeof(DecodeWorkItem) / 4;
constexpr int INT32_MAX_ = 0x7fffffff;

struct DecodePlanParams {
  const int* kv_indptr;         // [batch + 1]
  const int* kv_indices;        // [num_indices]
  const int* kv_last_page_len;  // [batch]
  int* plan;                    // [header_ints + ITEM_INTS * max_work + max_pages]
  BadIndexRecord* bad;          // the device's record and its pinned host copy
  BadIndexRecord* bad_host;
  int batch;                    // requests (at most the capacity's)
  int num_indices;              // entries of kv_indices
  int num_pages;                // the cache's: page ids lie in [0, num_pages)
  int max_work, max_pages;      // the capacity: work items, page ids
  int page_size;
  int kv_blocks;                // CTAs of one work item (plan_decode's num_kv_heads)
  int num_sms, slots;           // SMs; CTAs resident at once (num_sms * ctas_per_sm)
  int min_chunk;                // pages: ceil(min_chunk_tokens / page_size)
  int split;                    // a PlanSplit
  int fixed_chunk;              // pages of a chunk under PlanSplit::FIXED
  double straggler_skew;        // plan/decode.py's STRAGGLER_SKEW and STRAGGLER_SHARE
  double straggler_share;
  int header_ints;              // 4 + head_dim
  int freq[256];                // header ints 4 .. header_ints (RoPE frequencies or zeros)
};

constexpr int PLAN_WARPS = PLAN_THREADS / 32;

template <typename T>
RTC_DEVICE T warp_total(T x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// x summed over the block; every thread gets the total. scratch: PLAN_WARPS entries.
RTC_DEVICE int64_t block_total(int64_t x, int64_t* scratch) {
  x = warp_total(x);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  x = warp_total(lane < PLAN_WARPS ? scratch[lane] : int64_t(0));
  __syncthreads();
  return x;
}

// The block's largest x; every thread gets it.
RTC_DEVICE int64_t block_largest(int64_t x, int64_t* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    x = max(x, static_cast<int64_t>(__shfl_xor_sync(0xffffffffu, x, offset)));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  x = lane < PLAN_WARPS ? scratch[lane] : int64_t(0);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    x = max(x, static_cast<int64_t>(__shfl_xor_sync(0xffffffffu, x, offset)));
  __syncthreads();
  return x;
}

// Exclusive prefix sum of x over the block in thread order; *total gets the block's sum.
RTC_DEVICE int block_exclusive(int x, int* scratch, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = x;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += y;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  int before = 0, sum = 0;
  for (int w = 0; w < PLAN_WARPS; ++w) {  // a few dozen shared-memory reads, broadcast
    const int s = scratch[w];
    before += w < warp ? s : 0;
    sum += s;
  }
  __syncthreads();
  *total = sum;
  return before + inclusive - x;
}

// a / b for 0 <= a < 2^32, 1 <= b < 2^32 (page and token counts of an int32 table): a 32-bit
// division, where a 64-bit one is a subroutine call whose saved registers spill.
RTC_DEVICE int64_t quotient(int64_t a, int64_t b) {
  return static_cast<unsigned>(a) / static_cast<unsigned>(b);
}

// What the plan needs of request b: its first page and pages less one where it has any
// (plan_decode's pm1: its items are 1 + pm1 / chunk), read from the (checked) table.
struct Request {
  int first_page;
  int64_t pm1;
  int64_t kv_len;
};

RTC_DEVICE Request read_request(const int* indptr, const int* last, int b, int page_size) {
  const int begin = indptr[b], end = indptr[b + 1];
  const int64_t pm1 = end > begin ? int64_t(end) - begin - 1 : 0;
  return {begin, pm1, pm1 * page_size + last[b]};
}

// A thread's requests: b = threadIdx.x + k PLAN_THREADS; the first one's fields are kept in
// registers (every request of a batch of at most PLAN_THREADS), the others read again.
struct Requests {
  const int* indptr;
  const int* last;
  int batch, page_size;
  Request first;

  RTC_DEVICE Request at(int b) const {
    return b == int(threadIdx.x) ? first : read_request(indptr, last, b, page_size);
  }
};

// The work items of chunk c beyond one a request: sum_b pm1_b / c, over the block.
RTC_DEVICE int64_t extra_items(const Requests& r, int64_t chunk, int64_t* scratch) {
  int64_t n = 0;
  for (int b = threadIdx.x; b < r.batch; b += PLAN_THREADS) n += quotient(r.at(b).pm1, chunk);
  return block_total(n, scratch);
}

// plan_decode's _straggler_chunk for a batch that fills the GPU (max_work given).
RTC_DEVICE int64_t straggler_chunk(const DecodePlanParams& p, int64_t total, int64_t max_pages,
                                   int64_t lo) {
  const int64_t batch = p.batch;
  const double skewed = __dmul_rn(p.straggler_skew, static_cast<double>(total));
  if (static_cast<double>(max_pages * batch) < skewed) return max_pages;
  const double share = __dmul_rn(__dmul_rn(p.straggler_share, static_cast<double>(total)),
                                 static_cast<double>(p.kv_blocks));
  if (static_cast<double>(max_pages * p.num_sms) < share) return max_pages;
  int64_t chunk = max(lo, (max_pages + STRAGGLER_CUTS - 1) / STRAGGLER_CUTS);
  const int64_t room = p.max_work - batch;
  chunk = room > 0 ? max(chunk, quotient(total + room - 1, room)) : max_pages;
  return min(chunk, max_pages);
}

// plan_decode's _search_chunk: the smallest chunk c in [lo, hi] with
// W(c) = batch + sum_b pm1_b / c <= budget, bisected over the range that must hold it.
RTC_DEVICE int64_t search_chunk(const Requests& r, int64_t pm1_total, int64_t lo, int64_t hi,
                                int64_t budget, int64_t* scratch) {
  const int64_t batch = r.batch;
  lo = min(max(lo, quotient(pm1_total, budget) + 1), hi);
  if (budget > batch) hi = max(lo, min(hi, quotient(pm1_total + budget - batch - 1, budget - batch)));
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (batch + extra_items(r, mid, scratch) <= budget) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// CTA 0: the header and the work items.
RTC_DEVICE void plan_items(const DecodePlanParams& p) {
  __shared__ int64_t scratch[PLAN_WARPS];
  __shared__ int scan[PLAN_WARPS];
  const int* __restrict__ indptr = p.kv_indptr;
  const int* __restrict__ last = p.kv_last_page_len;
  const int batch = p.batch, page_size = p.page_size;
  int* __restrict__ plan = p.plan;
  for (int i = threadIdx.x; i < p.header_ints; i += PLAN_THREADS)
    plan[i] = i >= 4 ? p.freq[i - 4] : 0;  // plan[0], num_work, is written last

  // The table: request b has pages = indptr[b + 1] - indptr[b] and kv_len tokens.
  bool bad = false;
  int64_t total = 0, pm1_total = 0, max_pages = 0;
  Request first{0, 0, 0};
  if (threadIdx.x == 0) {
    const int start = indptr[0], end = indptr[batch], limit = min(p.num_indices, p.max_pages);
    if (start != 0) {
      report_bad_index(p.bad, p.bad_host, BadIndex::PLAN_INDPTR, 0, start, 0);
      bad = true;
    } else if (end > limit) {
      report_bad_index(p.bad, p.bad_host, BadIndex::PLAN_PAGES, batch, end, limit);
      bad = true;
    }
  }
  for (int b = threadIdx.x; b < batch; b += PLAN_THREADS) {
    const int begin = indptr[b], end = indptr[b + 1], tail = last[b];
    const int64_t pages = int64_t(end) - begin;
    if (pages < 0) {
      report_bad_index(p.bad, p.bad_host, BadIndex::PLAN_INDPTR, b + 1, end, begin);
      bad = true;
      continue;
    }
    const int64_t has = pages > 0 ? 1 : 0;
    if (tail < has || tail > has * page_size) {
      report_bad_index(p.bad, p.bad_host, BadIndex::PLAN_LAST_PAGE_LEN, b, tail,
                       saturate_int(pages));
      bad = true;
    }
    const int64_t pm1 = pages - has;
    const int64_t kv_len = pm1 * page_size + tail;
    if (kv_len > MAX_KV_LEN) {
      report_bad_index(p.bad, p.bad_host, BadIndex::PLAN_KV_LEN, b, saturate_int(kv_len),
                       MAX_KV_LEN);
      bad = true;
    }
    if (b == int(threadIdx.x)) first = {begin, pm1, kv_len};
    total += pages;
    pm1_total += pm1;
    max_pages = max(max_pages, pages);
  }
  const int pages_at = p.header_ints + ITEM_INTS * p.max_work;
  bad = __syncthreads_or(bad);
  if (bad) {  // no work: zeros in the items' room
    for (int i = p.header_ints + threadIdx.x; i < pages_at; i += PLAN_THREADS) plan[i] = 0;
    return;
  }
  total = block_total(total, scratch);
  pm1_total = block_total(pm1_total, scratch);
  max_pages = max(block_largest(max_pages, scratch), int64_t(1));
  const Requests requests{indptr, last, batch, page_size, first};

  // The chunk of pages (plan_decode).
  const int64_t lo = min(static_cast<int64_t>(p.min_chunk), max_pages);
  int64_t chunk = max_pages;
  if (p.split == static_cast<int>(PlanSplit::FIXED)) {
    chunk = p.fixed_chunk;
    const int64_t work = batch + extra_items(requests, chunk, scratch);
    if (work > p.max_work) {
      if (threadIdx.x == 0) {
        report_bad_index(p.bad, p.bad_host, BadIndex::PLAN_WORK, 0, saturate_int(work),
                         p.max_work);
      }
      for (int i = p.header_ints + threadIdx.x; i < pages_at; i += PLAN_THREADS) plan[i] = 0;
      return;
    }
  } else if (p.split == static_cast<int>(PlanSplit::AUTO) && batch > 0) {
    if (int64_t(batch) * p.kv_blocks >= p.slots) {
      chunk = straggler_chunk(p, total, max_pages, lo);
    } else {
      const int64_t budget = min(static_cast<int64_t>(p.slots / p.kv_blocks),
                                 static_cast<int64_t>(p.max_work));
      chunk = search_chunk(requests, pm1_total, lo, max_pages, budget, scratch);
    }
  }

  // The work items, request by request in order, then zeros to the items' room.
  const bool whole = chunk >= max_pages;
  const int64_t chunk_tokens = min(chunk * page_size, static_cast<int64_t>(INT32_MAX_));
  DecodeWorkItem* items = reinterpret_cast<DecodeWorkItem*>(plan + p.header_ints);
  int carry = 0;
  for (int round = 0; round < batch; round += PLAN_THREADS) {
    const int b = round + threadIdx.x;
    Request r{0, 0, 0};
    int n = 0;
    if (b < batch) {
      r = requests.at(b);
      n = whole ? 1 : static_cast<int>(quotient(r.pm1, chunk)) + 1;
    }
    int round_total;
    const int merge_begin = carry + block_exclusive(n, scan, &round_total);
    carry += round_total;
    for (int j = 0; j < n; ++j) {
      DecodeWorkItem w;
      const int64_t begin = whole ? 0 : j * chunk_tokens;
      w.request = b;
      w.token_begin = static_cast<int>(begin);
      w.token_end = static_cast<int>(begin + min(r.kv_len - begin, chunk_tokens));
      w.kv_len = static_cast<int>(r.kv_len);
      w.page_ids = r.first_page + pages_at;
      w.merge_begin = merge_begin;
      w.merge_count = n;
      w.unused = 0;
      items[merge_begin + j] = w;
    }
  }
  for (int i = p.header_ints + ITEM_INTS * carry + threadIdx.x; i < pages_at; i += PLAN_THREADS)
    plan[i] = 0;
  if (threadIdx.x == 0) plan[0] = carry;
}

// CTAs 1..: the page ids behind the items' room, checked against the cache, then zeros.
RTC_DEVICE void copy_pages(const DecodePlanParams& p) {
  const int64_t pages_at = p.header_ints + int64_t(ITEM_INTS) * p.max_work;
  // CTA 0 reports a table whose kv_indptr leads outside kv_indices or the capacity.
  const int64_t pages = min(max(p.kv_indptr[p.batch], 0), min(p.num_indices, p.max_pages));
  const int64_t stride = int64_t(gridDim.x - 1) * PLAN_THREADS;
  for (int64_t j = (blockIdx.x - 1) * int64_t(PLAN_THREADS) + threadIdx.x; j < p.max_pages;
       j += stride) {
    int id = 0;
    if (j < pages) {
      id = p.kv_indices[j];
      if (id < 0 || id >= p.num_pages) {
        report_bad_index(p.bad, p.bad_host, BadIndex::PLAN_INDICES, static_cast<int>(j), id,
                         p.num_pages);
        id = 0;
      }
    }
    p.plan[pages_at + j] = id;
  }
}

extern "C" __global__ void __launch_bounds__(PLAN_THREADS)
    decode_plan_kernel(const __grid_constant__ DecodePlanParams p) {
  wait_for_previous_grid();
  if (blockIdx.x == 0) {
    plan_items(p);
  } else {
    copy_pages(p);
  }
}
