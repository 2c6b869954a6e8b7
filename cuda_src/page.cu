// Paged KV-cache bookkeeping on the device.
//   append:  b = batch_indices[t], p = positions[t], page = kv_indices[kv_indptr[b] + p / ps]
//            K[page, p % ps, h] = append_key[t, h]; V likewise       (a byte copy of each row)
//            rows with b < 0 or p < 0 (the padding written below) are skipped
//   seq_lens[b] = max(kv_indptr[b+1] - kv_indptr[b] - 1, 0) * page_size + kv_last_page_len[b]
//   batch_indices[t], positions[t] = b, seq_lens[b] - append_indptr[b+1] + t  (-1 past the end)
// append grid: one thread per 16-byte unit (VEC bytes when not aligned) of the rows (token,
// head) of K and of V; the new rows are read once (evict-first loads). One unit per thread, many
// small CTAs, measured best: more units per thread (all loads before the stores) held more
// registers and fewer copies in flight per SM.
// The page id is two dependent reads behind batch_indices[t] (kv_indptr[b], then kv_indices);
// without them a small append takes a same-size copy's time. The reads are split by role:
// every thread issues its K and V reads first, waiting for nothing, while thread i of the CTA
// resolves the CTA's i-th token to (page, slot) in shared memory; after one barrier each thread
// stores its unit. kv_indptr is read speculatively at the request a uniform append (the same
// number of tokens per request) puts token t in, beside batch_indices[t], as volatile asm and
// without branches: as a plain read the compiler folded it into kv_indptr[b] (the same address
// when the guess is right, so a read that waits for b), and it sank the K/V reads below the
// padding test. Against that kernel (three dependent reads before the stores, now two) the
// outputs are identical and the times equal within 1-2% (256 x 1 tokens 5.2 us, 16 x 1024
// 35.7 vs 36.0): the order of the reads is not where the gap to a copy comes from.
// Prelude: ROW_BYTES (head_dim * itemsize), VEC (bytes per unit), THREADS (per CTA).
#include "paged_kv.cuh"

// A copy unit as one machine word of VEC bytes (a struct of chars would live in VEC registers).
using Unit = Conditional<VEC == 16, uint4, Conditional<VEC == 8, uint2, Conditional<VEC == 4,
             uint32_t, Conditional<VEC == 2, uint16_t, uint8_t>>>>;
constexpr int UNITS = ROW_BYTES / VEC;  // units per (token, head) row
static_assert(ROW_BYTES % VEC == 0, "whole units per row");

// A read the compiler may neither move nor merge with another read of the same array.
RTC_DEVICE int load_index_now(const int* p) {
  int x;
  asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(x) : "l"(p));
  return x;
}

extern "C" __global__ void __launch_bounds__(THREADS) append_kernel(
    const char* __restrict__ key,    // [nnz, H, D] at t * key_token + h * key_head (bytes)
    int64_t key_token, int64_t key_head,
    const char* __restrict__ value,  // [nnz, H, D]
    int64_t value_token, int64_t value_head,
    const int* __restrict__ batch_indices,  // [nnz]
    const int* __restrict__ positions,      // [nnz]
    char* __restrict__ k_cache,  // page, slot, head at page * kp + slot * kt + head * kh bytes
    int64_t kp, int64_t kt, int64_t kh,
    char* __restrict__ v_cache, int64_t vp, int64_t vt, int64_t vh,
    const int* __restrict__ kv_indices,  // [pages]
    const int* __restrict__ kv_indptr,   // [B + 1]
    int64_t units, int num_heads, uint32_t head_magic, int head_shift, int page_size,
    uint32_t page_magic, int page_shift,
    uint32_t guess_magic, int guess_shift,  // t / max(nnz / B, 1): token t's request if uniform
    int last_request) {                     // max(B - 1, 0), where the guess is clamped
  // The CTA's tokens [t_first, t_last] (at most THREADS: a unit of every row is in the CTA):
  // page_s[i], slot_s[i] for token t_first + i, page -1 for padding.
  __shared__ int64_t page_s[THREADS];
  __shared__ int slot_s[THREADS];
  const FastDiv head_div{head_magic, head_shift}, page_div{page_magic, page_shift};
  const FastDiv guess_div{guess_magic, guess_shift};
  const int64_t u0 = blockIdx.x * int64_t(THREADS), u = u0 + threadIdx.x;
  const bool mine = u < units;  // this thread has a unit (the last CTA may be partly empty)
  const int64_t row = (mine ? u : u0) / UNITS;
  const int byte = int((mine ? u : u0) - row * UNITS) * VEC;
  const int t = head_div.div(int(row)), h = int(row) - t * num_heads;
  Unit k = {}, v = {};
  if (mine) {
    k = __ldcs(reinterpret_cast<const Unit*>(key + t * key_token + h * key_head + byte));
    v = __ldcs(reinterpret_cast<const Unit*>(value + t * value_token + h * value_head + byte));
  }
  const int t_first = head_div.div(int(u0 / UNITS));
  const int t_last = head_div.div(int((min(u0 + THREADS, units) - 1) / UNITS));
  if (threadIdx.x <= t_last - t_first) {
    const int token = t_first + threadIdx.x;
    const int b = __ldg(batch_indices + token), p = __ldg(positions + token);
    const int guess = min(guess_div.div(token), last_request);
    const int first_if_guessed = load_index_now(kv_indptr + guess);
    // Without branches (the compiler would sink the speculative read below one); padding
    // (b < 0 or p < 0) reads no more and gets page -1.
    const bool live = b >= 0 && p >= 0;
    const int first = b == guess || !live ? first_if_guessed : __ldg(kv_indptr + b);
    const int page_in_request = page_div.div(max(p, 0));
    page_s[threadIdx.x] = live ? __ldg(kv_indices + first + page_in_request) : int64_t(-1);
    slot_s[threadIdx.x] = p - page_in_request * page_size;
  }
  __syncthreads();
  if (!mine) return;
  const int64_t page = page_s[t - t_first];
  const int slot = slot_s[t - t_first];
  if (page < 0) return;
  *reinterpret_cast<Unit*>(k_cache + page * kp + slot * kt + h * kh + byte) = k;
  *reinterpret_cast<Unit*>(v_cache + page * vp + slot * vt + h * vh + byte) = v;
}

extern "C" __global__ void seq_lens_kernel(const int* __restrict__ kv_indptr,  // [B + 1]
                                           const int* __restrict__ last,       // [B]
                                           int* __restrict__ seq_lens,         // [B]
                                           int batch_size, int page_size) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch_size) return;
  const int pages = kv_indptr[b + 1] - kv_indptr[b];
  seq_lens[b] = max(pages - 1, 0) * page_size + last[b];
}

extern "C" __global__ void batch_indices_positions_kernel(
    const int* __restrict__ append_indptr,  // [B + 1]
    const int* __restrict__ seq_lens,       // [B]
    int* __restrict__ batch_indices,        // [nnz]
    int* __restrict__ positions,            // [nnz]
    int batch_size, int nnz) {
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
  positions[t] = seq_lens[lo] - append_indptr[lo + 1] + t;
}
