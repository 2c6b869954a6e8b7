// Softmax with temperature, fp32 out, one CTA per row:
//   out = exp(x / t - max(x / t)) / sum(exp(x / t - max(x / t)))
// One pass keeps an online (max, sum) state per thread in the log2 domain (y = x * log2(e) / t),
// the states merge across the block, and a second pass writes. Rows of -inf give zeros; a NaN
// logit makes its row NaN.
// Grid: blockIdx.x = row. Block: THREADS; thread i holds vectors i, i + THREADS, ...
// Prelude: T, VEC, THREADS.

static_assert(VEC * sizeof(T) <= 16 && THREADS % 32 == 0, "one 16-byte load per vector");
constexpr int SOFTMAX_WARPS = THREADS / 32;

struct Softmax {
  float m = -__int_as_float(0x7f800000);  // running max (log2 domain)
  float d = 0.f;                          // sum of 2^(y - m)

  RTC_DEVICE void merge(float m2, float d2) {
    const float mm = fmaxf(m, m2);
    if (mm == -__int_as_float(0x7f800000)) return;  // both empty
    d = d * exp2f(m - mm) + d2 * exp2f(m2 - mm);
    m = mm;
  }
};

extern "C" __global__ void __launch_bounds__(THREADS) softmax_kernel(
    const T* __restrict__ logits,  // [rows, vocab], rows `in_stride` elements apart
    int64_t in_stride,
    float* __restrict__ probs,     // [rows, vocab], rows `out_stride` elements apart
    int64_t out_stride, int vocab,
    const float* __restrict__ temperature_arr,  // [rows] or null
    float temperature_val) {
  __shared__ float part_m[SOFTMAX_WARPS], part_d[SOFTMAX_WARPS];
  const int r = blockIdx.x, lane = threadIdx.x % 32, w = threadIdx.x / 32;
  const float t = temperature_arr ? temperature_arr[r] : temperature_val;
  const float scale = LOG2E / t;
  const T* x_row = logits + r * in_stride;

  Softmax s;
  int nan = 0;
  for (int i = int(threadIdx.x) * VEC; i < vocab; i += THREADS * VEC) {
    Vec<T, VEC> x;
    x.load(x_row + i);
    float y[VEC], vmax = -__int_as_float(0x7f800000);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      y[j] = to_float(x[j]) * scale;
      vmax = fmaxf(vmax, y[j]);  // ignores NaN
      nan |= isnan(y[j]);
    }
    if (vmax == -__int_as_float(0x7f800000)) continue;  // nothing but -inf (or NaN)
    float vsum = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) vsum += exp2f(y[j] - vmax);
    s.merge(vmax, vsum);
  }
  nan = __syncthreads_or(nan);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, s.m, o);
    const float d2 = __shfl_xor_sync(0xffffffffu, s.d, o);
    s.merge(m2, d2);
  }
  if (lane == 0) {
    part_m[w] = s.m;
    part_d[w] = s.d;
  }
  __syncthreads();
  Softmax total;
#pragma unroll 1
  for (int i = 0; i < SOFTMAX_WARPS; ++i) total.merge(part_m[i], part_d[i]);

  const bool empty = total.m == -__int_as_float(0x7f800000);
  const float inv = nan ? __int_as_float(0x7fffffff) : empty ? 0.f : 1.f / total.d;
  float* p_row = probs + r * out_stride;
  for (int i = int(threadIdx.x) * VEC; i < vocab; i += THREADS * VEC) {
    Vec<T, VEC> x;
    x.load(x_row + i);
    Vec<float, VEC> p;
#pragma unroll
    for (int j = 0; j < VEC; ++j) p[j] = empty && !nan ? 0.f : exp2f(to_float(x[j]) * scale - total.m) * inv;
    p.store(p_row + i);
  }
}
