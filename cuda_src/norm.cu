// Row norms: RMSNorm, Gemma RMSNorm, fused residual add + RMSNorm, LayerNorm.
//   rms:   y = x * rsqrt(mean(x^2) + eps) * w            (gemma: * (1 + w))
//   fused: r = round(x + r); x = rms(r)                   (the norm sees the stored residual)
//   layer: y = (x - mean(x)) * rsqrt(var(x) + eps) * gamma + beta
// Grid: blockIdx.x = row. Block: THREADS threads; thread t holds vectors t, t + THREADS, ...
// of VEC elements, so the whole row sits in registers: one HBM read and one write per element.
// Row r sits at (r / n1) * s0 + (r % n1) * s1 elements: 2-D and 3-D strided views.
// Prelude: OP (NormOp), T (activation type), W (weight type), HIDDEN, VEC, THREADS, MIN_CTAS
// (resident CTAs per SM the register allocation must allow).

enum NormOp { RMS = 0, GEMMA_RMS = 1, FUSED_ADD_RMS = 2, GEMMA_FUSED_ADD_RMS = 3, LAYER = 4 };

static_assert(HIDDEN % VEC == 0, "VEC divides HIDDEN");
constexpr int NVEC = HIDDEN / VEC;
constexpr int ITEMS = (NVEC + THREADS - 1) / THREADS;
constexpr bool FUSED = OP == FUSED_ADD_RMS || OP == GEMMA_FUSED_ADD_RMS;
constexpr bool GEMMA = OP == GEMMA_RMS || OP == GEMMA_FUSED_ADD_RMS;

// Element offset of row `row` in a view with leading dims [n0, n1] and strides (s0, s1).
RTC_DEVICE int64_t row_offset(int row, int n1, int64_t s0, int64_t s1) {
  return int64_t(row / n1) * s0 + int64_t(row % n1) * s1;
}

using TVec = Vec<T, VEC>;
using WVec = Vec<W, VEC>;

RTC_DEVICE bool owns(int item) { return ITEMS * THREADS == NVEC || item * THREADS + threadIdx.x < NVEC; }
RTC_DEVICE int col(int item) { return (item * THREADS + threadIdx.x) * VEC; }

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS) norm_kernel(
    T* x,                            // [n0, n1, HIDDEN] strides (xs0, xs1, 1); fused: in/out
    int64_t xs0, int64_t xs1,
    T* residual,                     // [n0, n1, HIDDEN] fused ops only: updated in place
    int64_t rs0, int64_t rs1,
    T* out,                          // [n0, n1, HIDDEN] output (fused ops: == x)
    int64_t os0, int64_t os1,
    const W* __restrict__ weight,    // [HIDDEN] (layernorm: gamma)
    const W* __restrict__ bias,      // [HIDDEN] layernorm beta, else unused
    int n1,                          // size of the inner leading dimension (1 for 2-D)
    float eps) {
  __shared__ float scratch[32];
  const int row = blockIdx.x;
  T* x_row = x + row_offset(row, n1, xs0, xs1);

  TVec v[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i)
    if (owns(i)) v[i].load_stream(x_row + col(i));

  if constexpr (FUSED) {
    T* r_row = residual + row_offset(row, n1, rs0, rs1);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!owns(i)) continue;
      TVec r;
      r.load_stream(r_row + col(i));
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[i][j] = from_float<T>(to_float(v[i][j]) + to_float(r[j]));
      v[i].store(r_row + col(i));
    }
  }

  float shift = 0.f;  // the mean, for layernorm
  if constexpr (OP == LAYER) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
      if (owns(i))
#pragma unroll
        for (int j = 0; j < VEC; ++j) s += to_float(v[i][j]);
    shift = block_sum<THREADS>(s, scratch) * (1.f / HIDDEN);
  }
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i)
    if (owns(i))
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = to_float(v[i][j]) - shift;
        sq += d * d;
      }
  const float inv_rms = rsqrtf(block_sum<THREADS>(sq, scratch) * (1.f / HIDDEN) + eps);

  T* o_row = out + row_offset(row, n1, os0, os1);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (!owns(i)) continue;
    WVec w;
    w.load(weight + col(i));
    WVec b;
    if constexpr (OP == LAYER) b.load(bias + col(i));
    TVec y;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float scale = to_float(w[j]);
      if constexpr (GEMMA) scale += 1.f;
      float r = (to_float(v[i][j]) - shift) * inv_rms * scale;
      if constexpr (OP == LAYER) r += to_float(b[j]);
      y[j] = from_float<T>(r);
    }
    y.store(o_row + col(i));
  }
}
