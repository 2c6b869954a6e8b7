// Softmax with temperature, fp32 out, one CTA per row:
//   out = exp(x / t - max(x / t)) / sum(exp(x / t - max(x / t)))
// One pass keeps an online (max, sum) state per thread in the log2 domain (y = x * log2(e) / t),
// the states merge across the block, and a second pass writes. Rows of -inf give zeros; a NaN
// logit makes its row NaN.
// Grid: blockIdx.x = row. Block: THREADS; thread i holds vectors i, i + THREADS, ..., and
// loads UNROLL of them before using the first (a lone row is latency-bound, not byte-bound).
// Prelude: T, VEC, THREADS.

static_assert(VEC * sizeof(T) <= 16 && THREADS % 32 == 0, "one 16-byte load per vector");
constexpr int SOFTMAX_WARPS = THREADS / 32;
constexpr int STRIDE = THREADS * VEC;  // elements between a thread's vectors
constexpr int UNROLL = VEC >= 8 ? 4 : 8;  // vectors a thread loads before using them

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

struct SoftmaxParams {
  const T* logits;               // [rows, vocab], rows `in_stride` elements apart
  float* probs;                  // [rows, vocab], rows `out_stride` elements apart
  const float* temperature_arr;  // [rows], or null: temperature_val for every row
  int64_t in_stride, out_stride;
  int vocab;
  float temperature_val;
};

extern "C" __global__ void __launch_bounds__(THREADS)
    softmax_kernel(const __grid_constant__ SoftmaxParams p) {
  const T* __restrict__ logits = p.logits;
  float* __restrict__ probs = p.probs;
  const float* __restrict__ temperature_arr = p.temperature_arr;
  const int64_t in_stride = p.in_stride, out_stride = p.out_stride;
  const int vocab = p.vocab;
  const float temperature_val = p.temperature_val;
  __shared__ float part_m[SOFTMAX_WARPS], part_d[SOFTMAX_WARPS];
  const int r = blockIdx.x, lane = threadIdx.x % 32, w = threadIdx.x / 32;
  const float t = temperature_arr ? temperature_arr[r] : temperature_val;
  const float scale = LOG2E / t;
  const T* x_row = logits + r * in_stride;

  Softmax s;
  int nan = 0;
  for (int base = int(threadIdx.x) * VEC; base < vocab; base += UNROLL * STRIDE) {
    Vec<T, VEC> x[UNROLL];  // UNROLL loads in flight before the first is used
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (base + u * STRIDE < vocab) x[u].load(x_row + base + u * STRIDE);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (base + u * STRIDE >= vocab) break;
      float y[VEC], vmax = -__int_as_float(0x7f800000);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        y[j] = to_float(x[u][j]) * scale;
        vmax = fmaxf(vmax, y[j]);  // ignores NaN
        nan |= isnan(y[j]);
      }
      if (vmax == -__int_as_float(0x7f800000)) continue;  // nothing but -inf (or NaN)
      float vsum = 0.f;
#pragma unroll
      for (int j = 0; j < VEC; ++j) vsum += exp2f(y[j] - vmax);
      s.merge(vmax, vsum);
    }
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
  for (int base = int(threadIdx.x) * VEC; base < vocab; base += UNROLL * STRIDE) {
    Vec<T, VEC> x[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (base + u * STRIDE < vocab) x[u].load(x_row + base + u * STRIDE);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (base + u * STRIDE >= vocab) break;
      Vec<float, VEC> p;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        p[j] = empty && !nan ? 0.f : exp2f(to_float(x[u][j]) * scale - total.m) * inv;
      }
      p.store(p_row + base + u * STRIDE);
    }
  }
}
