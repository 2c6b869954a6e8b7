// What the two samplers share: sampling.cu (one CTA per row) and sampling_cluster.cu (a cluster
// of CTAs per row) take the same parameter struct, so the host fills one block for either, and
// read the per-row parameters the same way.
// Prelude: OP (SampleOp), T (probs), OUT_T (token ids), BadIndex.
#pragma once

#include "bad_index.cuh"

constexpr int MAX_ROUNDS = 64;
constexpr bool HAS_K = OP == SampleOp::TOP_K || OP == SampleOp::TOP_K_TOP_P ||
                       OP == SampleOp::TOP_K_FIRST;
constexpr bool HAS_P = OP == SampleOp::TOP_P || OP == SampleOp::TOP_K_TOP_P ||
                       OP == SampleOp::TOP_K_FIRST;

// The parameters of sample_kernel and cluster_sample_kernel. A per-row parameter is its array
// when given (null otherwise), else its scalar.
struct SampleParams {
  const T* probs;              // [rows, vocab], rows `row_stride` elements apart
  const OUT_T* indices;        // [batch] probability row of each output, or null
  OUT_T* out;                  // [batch] sampled token ids
  const int32_t* top_k_arr;    // [batch] or null
  const int64_t* top_k_arr64;  // [batch] or null
  const float* top_p_arr;      // [batch] or null
  const float* min_p_arr;      // [batch] or null
  const uint64_t* seed_arr;    // [seed_len] (1 or batch), or null
  const uint64_t* offset_arr;  // [offset_len] (1 or batch), or null
  int* error_flag;             // [1] set to 1 on NaN, negative or inf; null: no check
  BadIndexRecord* bad;         // this device's record of bad entries (bad_index.cuh)
  BadIndexRecord* bad_host;    // its host copy (pinned host memory, mapped)
  int64_t row_stride;
  int num_rows;                // rows of probs: indices[b] must lie in [0, num_rows)
  uint64_t seed_val, offset_val;
  int vocab, top_k_val, seed_len, offset_len;
  float top_p_val, min_p_val;
};

// A per-row parameter: its array's entry for output row b, or the scalar.
RTC_DEVICE long long row_top_k(const int32_t* arr, const int64_t* arr64, int value, int b) {
  return arr ? arr[b] : arr64 ? arr64[b] : value;
}

RTC_DEVICE float row_param(const float* arr, float value, int b) { return arr ? arr[b] : value; }

// Whether output row b reads a row of probs; if indices[b] is out of range, thread 0 of the
// row's first CTA (`first`) writes -1 as its token and reports the entry (bad_index.cuh).
RTC_DEVICE bool row_in_range(const SampleParams& p, int b, int64_t row, bool first) {
  if (p.indices == nullptr || (row >= 0 && row < p.num_rows)) return true;
  if (first && threadIdx.x == 0) {
    p.out[b] = OUT_T(-1);
    report_bad_index(p.bad, p.bad_host, BadIndex::SAMPLE_INDICES, b, saturate_int(row),
                     p.num_rows);
  }
  return false;
}

RTC_DEVICE float below(float t) {  // the largest float < t (0 for t <= 0)
  return t > 0.f ? __uint_as_float(__float_as_uint(t) - 1u) : 0.f;
}
