// Softmax pieces shared by the one-CTA kernel (softmax.cu) and the cluster kernel
// (softmax_cluster.cu): the online (max, sum) state, the parameters, a block's pass over a range
// of a row, and the writing pass.
// Prelude: T, VEC, THREADS.
#pragma once

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

// Vectors base, base + STRIDE, ... (UNROLL of them, those before `end`) of row x: all loads in
// flight before the first is used.
RTC_DEVICE void load_vectors(Vec<T, VEC> (&x)[UNROLL], const T* __restrict__ x_row, int base,
                             int end) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    if (base + u * STRIDE < end) x[u].load(x_row + base + u * STRIDE);
  }
}

// The block's (max, sum) state of row elements [begin, end) (multiples of VEC), in the log2
// domain (y = x * scale), and whether any of them is NaN. Thread i reads vectors i, i + THREADS,
// ..., UNROLL of them before using the first. Contains block barriers.
RTC_DEVICE Softmax block_softmax(const T* __restrict__ x_row, int begin, int end, float scale,
                                 bool& any_nan) {
  __shared__ float part_m[SOFTMAX_WARPS], part_d[SOFTMAX_WARPS];
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  Softmax s;
  int nan = 0;
  for (int base = begin + int(threadIdx.x) * VEC; base < end; base += UNROLL * STRIDE) {
    Vec<T, VEC> x[UNROLL];
    load_vectors(x, x_row, base, end);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (base + u * STRIDE >= end) break;
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
  any_nan = __syncthreads_or(nan) != 0;
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
  return total;
}

// probs[i] = 2^(x[i] * scale - total.m) / total.d for i in [begin, end); zeros for a row of
// -inf, NaN for a row holding a NaN.
RTC_DEVICE void write_probs(const T* __restrict__ x_row, float* __restrict__ p_row, int begin,
                            int end, float scale, const Softmax& total, bool nan) {
  const bool empty = total.m == -__int_as_float(0x7f800000);
  const float inv = nan ? __int_as_float(0x7fffffff) : empty ? 0.f : 1.f / total.d;
  for (int base = begin + int(threadIdx.x) * VEC; base < end; base += UNROLL * STRIDE) {
    Vec<T, VEC> x[UNROLL];
    load_vectors(x, x_row, base, end);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (base + u * STRIDE >= end) break;
      Vec<float, VEC> p;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        p[j] = empty && !nan ? 0.f : exp2f(to_float(x[u][j]) * scale - total.m) * inv;
      }
      p.store(p_row + base + u * STRIDE);
    }
  }
}
