// What the two samplers share: sampling.cu (one CTA per row) and sampling_cluster.cu (a cluster
// of CTAs per row) take the same kernel parameters, so the host passes one argument tuple to
// either, and read the per-row parameters the same way.
// Prelude: OP (SampleOp), T (probs), OUT_T (token ids).
#pragma once

enum SampleOp { PLAIN = 0, TOP_K = 1, TOP_P = 2, MIN_P = 3, TOP_K_TOP_P = 4, TOP_K_FIRST = 5 };
constexpr int MAX_ROUNDS = 64;
constexpr bool HAS_K = OP == TOP_K || OP == TOP_K_TOP_P || OP == TOP_K_FIRST;
constexpr bool HAS_P = OP == TOP_P || OP == TOP_K_TOP_P || OP == TOP_K_FIRST;

// The parameters of sample_kernel and cluster_sample_kernel.
#define SAMPLE_KERNEL_PARAMS                                                                    \
  const T* __restrict__ probs,             /* [rows, vocab], rows `row_stride` elements apart */ \
      int64_t row_stride, int vocab,                                                            \
      const OUT_T* __restrict__ indices,   /* [batch] probability row of each output, or null */ \
      OUT_T* __restrict__ out,             /* [batch] sampled token ids */                       \
      const int32_t* __restrict__ top_k_arr,    /* [batch] or null */                           \
      const int64_t* __restrict__ top_k_arr64,  /* [batch] or null */                           \
      int top_k_val,                                                                            \
      const float* __restrict__ top_p_arr, /* [batch] or null */                                \
      float top_p_val,                                                                          \
      const float* __restrict__ min_p_arr, /* [batch] or null */                                \
      float min_p_val,                                                                          \
      const uint64_t* __restrict__ seed_arr,    /* [1] or [batch], or null */                   \
      uint64_t seed_val, int seed_len,                                                          \
      const uint64_t* __restrict__ offset_arr,  /* [1] or [batch], or null */                   \
      uint64_t offset_val, int offset_len,                                                      \
      int* __restrict__ error_flag /* [1] set to 1 on NaN, negative or inf; null: no check */

// A per-row parameter: its array's entry for output row b, or the scalar.
RTC_DEVICE long long row_top_k(const int32_t* arr, const int64_t* arr64, int value, int b) {
  return arr ? arr[b] : arr64 ? arr64[b] : value;
}

RTC_DEVICE float row_param(const float* arr, float value, int b) { return arr ? arr[b] : value; }

RTC_DEVICE float below(float t) {  // the largest float < t (0 for t <= 0)
  return t > 0.f ? __uint_as_float(__float_as_uint(t) - 1u) : 0.f;
}
