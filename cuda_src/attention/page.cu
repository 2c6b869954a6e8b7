// Paged KV-cache bookkeeping on the device.
//   append:  b = batch_indices[t], p = positions[t], page = kv_indices[kv_indptr[b] + p / ps]
//            K[page, p % ps, h] = append_key[t, h]; V likewise       (a byte copy of each row)
//            rows with b < 0 or p < 0 (the padding written below) are skipped; so are rows with
//            b >= B, p >= seq_len[b], an entry of kv_indices outside the array or a page id
//            outside the cache, which are reported (bad_index.cuh) instead of written
//   seq_lens[b] = max(kv_indptr[b+1] - kv_indptr[b] - 1, 0) * page_size + kv_last_page_len[b]
//   batch_indices[t], positions[t] = b, seq_lens[b] - append_indptr[b+1] + t  (-1 past the end)
// append grid: one thread per 16-byte unit (VEC bytes when not aligned) of the rows (token,
// head) of K and of V; the new rows are read once (evict-first loads). One unit per thread, many
// small CTAs, measured best: more units per thread (all loads before the stores) held more
// registers and fewer copies in flight per SM.
// The page id is two dependent reads behind batch_indices[t] (kv_indptr[b], then kv_indices),
// and in a small append they, not the bytes, are the gap to a same-size copy (256 x 1 tokens:
// ~1 us over a 4.2 us copy, ~0.1 us without them). Two ways around the chain were measured and
// left out (bench/RESULTS.md, 2026-12-01): reading kv_indptr speculatively at the request of a
// uniform append, which the compiler folded back into kv_indptr[b]; and, forcing that read and
// the K/V reads ahead of everything, a kernel whose CTAs resolve each token's page once in
// shared memory (two dependent reads instead of three): equal times.
// Prelude: ROW_BYTES (head_dim * itemsize of K), V_ROW_BYTES (V's: ROW_BYTES, or another where
// a (k, v) pair's head dims differ, as MLA's ckv and kpe: a row of units covers the longer, each
// copying what it holds of K's and of V's), VEC (bytes per unit), THREADS (per CTA), IDX (the
// page table's and the index kernels' arrays: int32_t or int64_t, as the caller gives them),
// ROW_IDX (append's batch_indices and positions, likewise), the BadIndex enum. 64-bit entries
// are checked in 64 bits before they narrow.
#include "bad_index.cuh"
#include "paged_kv.cuh"

// A copy unit as one machine word of VEC bytes (a struct of chars would live in VEC registers).
using Unit = Conditional<VEC == 16, uint4, Conditional<VEC == 8, uint2, Conditional<VEC == 4,
             uint32_t, Conditional<VEC == 2, uint16_t, uint8_t>>>>;
constexpr int UNIT_ROW_BYTES = ROW_BYTES > V_ROW_BYTES ? ROW_BYTES : V_ROW_BYTES;
constexpr int UNITS = UNIT_ROW_BYTES / VEC;  // units per (token, head) row
constexpr bool EVERY_K = ROW_BYTES == UNIT_ROW_BYTES, EVERY_V = V_ROW_BYTES == UNIT_ROW_BYTES;
static_assert(ROW_BYTES % VEC == 0 && V_ROW_BYTES % VEC == 0, "whole units per row");

struct AppendParams {
  const char* key;              // [nnz, H, D] at t * key_token + h * key_head (bytes)
  const char* value;            // [nnz, H, D] at t * value_token + h * value_head (bytes)
  const ROW_IDX* batch_indices;  // [nnz]
  const ROW_IDX* positions;      // [nnz]
  char* k_cache;                // page, slot, head at page * kp + slot * kt + head * kh bytes
  char* v_cache;                // page, slot, head at page * vp + slot * vt + head * vh bytes
  const IDX* kv_indices;        // [num_indices]
  const IDX* kv_indptr;         // [B + 1]
  const IDX* kv_last_page_len;  // [B]
  BadIndexRecord* bad;          // this device's record of bad entries (device memory)
  BadIndexRecord* bad_host;     // its host copy (pinned host memory, mapped)
  int64_t key_token, key_head, value_token, value_head;
  int64_t kp, kt, kh, vp, vt, vh;
  int64_t units;  // nnz * H * UNITS: one per thread
  int num_heads, head_shift, page_size, page_shift;
  uint32_t head_magic, page_magic;
  int batch_size, num_indices, num_pages;  // B, entries of kv_indices, pages of the cache
};

extern "C" __global__ void __launch_bounds__(THREADS)
    append_kernel(const __grid_constant__ AppendParams params) {
  wait_for_previous_grid();
  const char* __restrict__ key = params.key;
  const char* __restrict__ value = params.value;
  const ROW_IDX* __restrict__ batch_indices = params.batch_indices;
  const ROW_IDX* __restrict__ positions = params.positions;
  char* __restrict__ k_cache = params.k_cache;
  char* __restrict__ v_cache = params.v_cache;
  const IDX* __restrict__ kv_indices = params.kv_indices;
  const IDX* __restrict__ kv_indptr = params.kv_indptr;
  const IDX* __restrict__ kv_last_page_len = params.kv_last_page_len;
  const int64_t key_token = params.key_token, key_head = params.key_head;
  const int64_t value_token = params.value_token, value_head = params.value_head;
  const int64_t kp = params.kp, kt = params.kt, kh = params.kh;
  const int64_t vp = params.vp, vt = params.vt, vh = params.vh;
  const int64_t units = params.units;
  const int num_heads = params.num_heads, page_size = params.page_size;
  const uint32_t head_magic = params.head_magic, page_magic = params.page_magic;
  const int head_shift = params.head_shift, page_shift = params.page_shift;
  const FastDiv head_div{head_magic, head_shift}, page_div{page_magic, page_shift};
  const int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (u >= units) return;
  const int64_t row = u / UNITS;
  const int byte = int(u - row * UNITS) * VEC;
  const int t = head_div.div(int(row)), h = int(row) - t * num_heads;
  const bool has_k = EVERY_K || byte < ROW_BYTES, has_v = EVERY_V || byte < V_ROW_BYTES;
  Unit k, v;
  if (has_k) k = __ldcs(reinterpret_cast<const Unit*>(key + t * key_token + h * key_head + byte));
  if (has_v)
    v = __ldcs(reinterpret_cast<const Unit*>(value + t * value_token + h * value_head + byte));
  const ROW_IDX b_entry = __ldg(batch_indices + t), p_entry = __ldg(positions + t);
  if (b_entry < 0 || p_entry < 0) return;  // padding
  // Every thread of a bad row skips it; its first unit's thread reports it (once per row).
  const bool reporter = h == 0 && byte == 0;
  if (b_entry >= params.batch_size) {
    if (reporter) {
      report_bad_index(params.bad, params.bad_host, BadIndex::BATCH_INDICES, t,
                       saturate_int(b_entry), params.batch_size);
    }
    return;
  }
  const int b = int(b_entry);
  // Three independent reads: the bounds of request b cost no extra step in the chain to the
  // page id.
  const IDX begin = __ldg(kv_indptr + b), end = __ldg(kv_indptr + b + 1);
  const IDX last = __ldg(kv_last_page_len + b);
  const bool narrow = sizeof(ROW_IDX) == 4 || p_entry <= 0x7fffffff;  // FastDiv takes 31 bits
  const int p = int(narrow ? p_entry : 0x7fffffff);
  const int page_in_request = page_div.div(p);
  const int64_t pages = int64_t(end) - int64_t(begin);
  const int64_t seq_len = (pages > 1 ? pages - 1 : 0) * page_size + int64_t(last);
  if (!narrow || page_in_request >= pages || p >= seq_len) {
    if (reporter) {
      report_bad_index(params.bad, params.bad_host, BadIndex::POSITIONS, t,
                       saturate_int(p_entry), saturate_int(seq_len < 0 ? 0 : seq_len));
    }
    return;
  }
  const int64_t entry = int64_t(begin) + page_in_request;  // of kv_indices
  if (begin < 0 || entry >= params.num_indices) {
    if (reporter) {
      report_bad_index(params.bad, params.bad_host, BadIndex::KV_INDPTR, b, saturate_int(entry),
                       params.num_indices);
    }
    return;
  }
  const IDX page = __ldg(kv_indices + entry);
  if (page < 0 || page >= params.num_pages) {
    if (reporter) {
      report_bad_index(params.bad, params.bad_host, BadIndex::KV_INDICES, int(entry),
                       saturate_int(page), params.num_pages);
    }
    return;
  }
  const int slot = p - page_in_request * page_size;
  if (has_k) *reinterpret_cast<Unit*>(k_cache + int64_t(page) * kp + slot * kt + h * kh + byte) = k;
  if (has_v) *reinterpret_cast<Unit*>(v_cache + int64_t(page) * vp + slot * vt + h * vh + byte) = v;
}

struct SeqLensParams {
  const IDX* kv_indptr;  // [B + 1]
  const IDX* last;       // [B]
  IDX* seq_lens;         // [B]
  int batch_size, page_size;
};

extern "C" __global__ void seq_lens_kernel(const __grid_constant__ SeqLensParams params) {
  wait_for_previous_grid();
  const IDX* __restrict__ kv_indptr = params.kv_indptr;
  const IDX* __restrict__ last = params.last;
  IDX* __restrict__ seq_lens = params.seq_lens;
  const int batch_size = params.batch_size, page_size = params.page_size;
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch_size) return;
  const IDX pages = kv_indptr[b + 1] - kv_indptr[b];
  seq_lens[b] = (pages > 1 ? pages - 1 : IDX(0)) * page_size + last[b];
}

struct BatchIndicesPositionsParams {
  const IDX* append_indptr;  // [B + 1]
  const IDX* seq_lens;       // [B]
  int* batch_indices;        // [nnz]
  int* positions;            // [nnz]
  int batch_size, nnz;
};

extern "C" __global__ void batch_indices_positions_kernel(
    const __grid_constant__ BatchIndicesPositionsParams params) {
  wait_for_previous_grid();
  const IDX* __restrict__ append_indptr = params.append_indptr;
  const IDX* __restrict__ seq_lens = params.seq_lens;
  int* __restrict__ batch_indices = params.batch_indices;
  int* __restrict__ positions = params.positions;
  const int batch_size = params.batch_size, nnz = params.nnz;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= nnz) return;
  if (batch_size == 0 || t >= append_indptr[batch_size]) {
    batch_indices[t] = positions[t] = -1;
    return;
  }
  int lo = 0, hi = batch_size - 1;  // the last request whose tokens start at or before t
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (append_indptr[mid] <= t) lo = mid; else hi = mid - 1;
  }
  batch_indices[t] = lo;
  positions[t] = int(seq_lens[lo] - append_indptr[lo + 1] + t);
}
