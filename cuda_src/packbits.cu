// Bit packing of boolean arrays, FlashInfer's packbits / segment_packbits:
//   y[start_s + b] = sum_i [x[begin_s + 8b + i] != 0] << (LITTLE ? i : 7 - i),
//   i < 8 and begin_s + 8b + i < end_s (missing bits are 0),
// where segment s is x[begin_s:end_s] (indptr; the whole array without one) and its bytes
// start after the whole bytes of the segments before it: start_s = sum_{t<s} ceil(len_t / 8).
// Grid: CTAs stride over segments; each sums its start (a block reduction over the lengths
// before it: O(segments) reads, small next to a mask of qo_len x kv_len bits per segment),
// writes indptr_out[s + 1] and packs its bytes, one per thread.
// Prelude: LITTLE (bool), IDX (the indptr's type), THREADS.
#include "common.cuh"

struct PackbitsParams {
  const uint8_t* x;   // [n] booleans (any nonzero byte is true)
  uint8_t* y;         // [sum_s ceil(len_s / 8)] packed bytes
  const IDX* indptr;  // [segments + 1] segment s = x[indptr[s]:indptr[s + 1]]; null: x[0:n)
  IDX* indptr_out;    // [segments + 1] segment s's bytes: y[indptr_out[s]:indptr_out[s + 1]]
  int64_t n;
  int segments;
};

RTC_DEVICE int64_t whole_bytes(int64_t bits) { return (bits + 7) / 8; }

// The sum of x over the block (every thread gets it); scratch: one slot per warp.
RTC_DEVICE int64_t block_sum_i64(int64_t x, int64_t* scratch) {
#pragma unroll
  for (int m = 16; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  int64_t total = 0;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) total += scratch[w];
  return total;
}

extern "C" __global__ void __launch_bounds__(THREADS)
    packbits_kernel(const __grid_constant__ PackbitsParams p) {
  wait_for_previous_grid();
  __shared__ int64_t scratch[THREADS / 32];
  if (p.indptr_out != nullptr && blockIdx.x == 0 && threadIdx.x == 0) p.indptr_out[0] = 0;
  for (int s = blockIdx.x; s < p.segments; s += gridDim.x) {
    int64_t begin = 0, end = p.n, start = 0;
    if (p.indptr != nullptr) {
      begin = p.indptr[s], end = p.indptr[s + 1];
      for (int t = threadIdx.x; t < s; t += THREADS)
        start += whole_bytes(static_cast<int64_t>(p.indptr[t + 1]) - p.indptr[t]);
      start = block_sum_i64(start, scratch);
    }
    const int64_t bytes = whole_bytes(end - begin);
    if (p.indptr_out != nullptr && threadIdx.x == 0)
      p.indptr_out[s + 1] = static_cast<IDX>(start + bytes);
    for (int64_t b = threadIdx.x; b < bytes; b += THREADS) {
      unsigned byte = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int64_t at = begin + 8 * b + i;
        if (at < end && p.x[at] != 0) byte |= LITTLE ? 1u << i : 0x80u >> i;
      }
      p.y[start + b] = static_cast<uint8_t>(byte);
    }
  }
}
