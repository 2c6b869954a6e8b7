// Row norms: RMSNorm, Gemma RMSNorm, fused residual add + RMSNorm, LayerNorm.
//   rms:   y = x * rsqrt(mean(x^2) + eps) * w            (gemma: * (1 + w))
//   fused: r = round(x + r); x = rms(r)                   (the norm sees the stored residual)
//   layer: y = (x - mean(x)) * rsqrt(var(x) + eps) * gamma + beta
// QUANT (OT fp8): y is written as fp8(y / scale), saturated to the type's finite range (NaN
// stays NaN), to `out` (the fused ops then leave x as it is); scale = scale[0] from device
// memory, or scale_value where the pointer is null.
// Grid: blockIdx.x = row. Block: THREADS threads; thread t owns vectors t, t + THREADS, ... of
// VEC elements. The row is staged in shared memory with cp.async, so the bytes in flight cost
// no registers (more rows resident per SM): one HBM read and one write per element.
// Each thread reads back only what it copied itself, so only the reductions need barriers; the
// weight is read into registers alongside (W_AHEAD), where they allow.
// Row r sits at (r / n1) * s0 + (r % n1) * s1 elements: 2-D and 3-D strided views.
// Shared memory: HIDDEN * sizeof(T), twice for the fused ops (x and residual).
// VEC and THREADS fix the arithmetic (which thread sums which elements, in which order); global
// memory moves in LOAD_VEC pieces (VEC unless the arrays' alignment or strides allow less), so a
// strided or misaligned view gives the bits of the same rows made contiguous.
// Prelude: OP (NormOp), T (activation type), W (weight type), OT (out's type: T, or fp8 with
// QUANT), QUANT, HIDDEN, VEC, LOAD_VEC, THREADS.

static_assert(HIDDEN % VEC == 0 && VEC % LOAD_VEC == 0, "VEC divides HIDDEN, LOAD_VEC VEC");
static_assert(QUANT == is_fp8<OT>() && (QUANT || IsSame<OT, T>::value),
              "out: T, or fp8 with QUANT");
constexpr int NVEC = HIDDEN / VEC;
constexpr int ITEMS = (NVEC + THREADS - 1) / THREADS;
constexpr bool FUSED = OP == NormOp::FUSED_ADD_RMS || OP == NormOp::GEMMA_FUSED_ADD_RMS;
constexpr bool GEMMA = OP == NormOp::GEMMA_RMS || OP == NormOp::GEMMA_FUSED_ADD_RMS;
constexpr bool LAYER = OP == NormOp::LAYER;

// Element offset of row `row` in a view with leading dims [n0, n1] and strides (s0, s1).
RTC_DEVICE int64_t row_offset(int row, int n1, int64_t s0, int64_t s1) {
  return int64_t(row / n1) * s0 + int64_t(row % n1) * s1;
}

using TVec = Vec<T, VEC>;
using OVec = Vec<OT, VEC>;
using WVec = Vec<W, VEC>;
// The weight (and LayerNorm's bias) held in registers from the start: up to 32 of them.
constexpr bool W_AHEAD = ITEMS * (LAYER ? 2 : 1) * sizeof(WVec) <= 128;
constexpr int PIECES = VEC / LOAD_VEC;  // global accesses per vector

// A vector of VEC elements to or from global memory in PIECES accesses of LOAD_VEC elements.
template <typename E>
RTC_DEVICE void load_vec(Vec<E, VEC>& v, const E* src) {
  using Piece = Vec<E, LOAD_VEC>;
#pragma unroll
  for (int k = 0; k < PIECES; ++k) reinterpret_cast<Piece*>(&v)[k].load(src + k * LOAD_VEC);
}
template <typename E>
RTC_DEVICE void store_vec(const Vec<E, VEC>& v, E* dst) {
  using Piece = Vec<E, LOAD_VEC>;
#pragma unroll
  for (int k = 0; k < PIECES; ++k) reinterpret_cast<const Piece*>(&v)[k].store(dst + k * LOAD_VEC);
}
// ... and from global into shared memory (cp.async where a piece has 4, 8 or 16 bytes).
RTC_DEVICE void copy_vec_async(TVec* dst, const T* src) {
  using Piece = Vec<T, LOAD_VEC>;
#pragma unroll
  for (int k = 0; k < PIECES; ++k)
    copy_async(reinterpret_cast<Piece*>(dst) + k, reinterpret_cast<const Piece*>(src) + k);
}

RTC_DEVICE int item(int i) { return i * THREADS + threadIdx.x; }  // this thread's i-th vector
RTC_DEVICE bool owns(int i) { return ITEMS * THREADS == NVEC || item(i) < NVEC; }
RTC_DEVICE int col(int i) { return item(i) * VEC; }

struct NormParams {
  T* x;              // [n0, n1, HIDDEN] strides (xs0, xs1, 1); fused ops: read
  T* residual;       // [n0, n1, HIDDEN] strides (rs0, rs1, 1); fused ops: read
  OT* out;           // [n0, n1, HIDDEN] strides (os0, os1, 1); fused ops: x in place, or new
                     // (QUANT: the fp8 output, x only read)
  T* residual_out;   // [n0, n1, HIDDEN] strides (ros0, ros1, 1); fused ops: x + residual, in
                     // place (== residual) or new; else unused
  const W* weight;   // [HIDDEN] (layernorm: gamma)
  const W* bias;     // [HIDDEN] layernorm: beta; else unused
  const float* scale;  // [1] QUANT: out = fp8(y / scale[0]); null: scale_value
  float scale_value;
  int64_t xs0, xs1, rs0, rs1, os0, os1, ros0, ros1;
  int n1;            // size of the inner leading dimension (1 for 2-D)
  float eps;
};

extern "C" __global__ void __launch_bounds__(THREADS) norm_kernel(const __grid_constant__ NormParams p) {
  wait_for_previous_grid();
  T* x = p.x;
  T* residual = p.residual;
  OT* out = p.out;
  const W* __restrict__ weight = p.weight;
  const W* __restrict__ bias = p.bias;
  const int n1 = p.n1;
  extern __shared__ __align__(16) unsigned char smem[];
  TVec* xs = reinterpret_cast<TVec*>(smem);  // [NVEC] the row (fused: x + residual)
  TVec* rs = xs + NVEC;                      // [NVEC] fused ops: the residual row
  __shared__ float scratch[1][32];
  const int row = blockIdx.x;
  const T* x_row = x + row_offset(row, n1, p.xs0, p.xs1);
  const T* r_row = residual + row_offset(row, n1, p.rs0, p.rs1);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (!owns(i)) continue;
    copy_vec_async(&xs[item(i)], x_row + col(i));
    if constexpr (FUSED) copy_vec_async(&rs[item(i)], r_row + col(i));
  }
  // The weight (and bias) loads go out with the row's, so the reductions hide their latency,
  // where the registers allow (a cold weight read after the reduction cost 0.5-1 us a call at
  // 64-512 rows); wider rows load them after the reduction.
  WVec w_ahead[W_AHEAD ? ITEMS : 1], b_ahead[W_AHEAD && LAYER ? ITEMS : 1];
  if constexpr (W_AHEAD) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!owns(i)) continue;
      load_vec(w_ahead[i], weight + col(i));
      if constexpr (LAYER) load_vec(b_ahead[i], bias + col(i));
    }
  }
  // The fp8 output's scale, loaded beside the row (its reciprocal is taken after the sums).
  const float scale_in = !QUANT ? 1.f : p.scale != nullptr ? __ldg(p.scale) : p.scale_value;
  cp_async_wait_all();

  if constexpr (FUSED) {  // x + residual, rounded to T, stored as the new residual
    // (both rows are in shared memory already: the residual may be updated in place)
    T* ro_row = p.residual_out + row_offset(row, n1, p.ros0, p.ros1);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!owns(i)) continue;
      TVec v = xs[item(i)];
      const TVec r = rs[item(i)];
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] = from_float<T>(to_float(v[j]) + to_float(r[j]));
      xs[item(i)] = v;
      store_vec(v, ro_row + col(i));
    }
  }

  float shift = 0.f;  // the mean, for layernorm
  if constexpr (LAYER) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!owns(i)) continue;
      const TVec v = xs[item(i)];
#pragma unroll
      for (int j = 0; j < VEC; ++j) shift += to_float(v[j]);
    }
    shift = block_sum<THREADS>(shift, scratch) * (1.f / HIDDEN);
  }
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (!owns(i)) continue;
    const TVec v = xs[item(i)];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float d = to_float(v[j]) - shift;
      sq += d * d;
    }
  }
  const float inv_rms = rsqrtf(block_sum<THREADS>(sq, scratch) * (1.f / HIDDEN) + p.eps);
  const float out_scale = 1.f / scale_in;  // here, not at the load: no wait on it before

  OT* o_row = out + row_offset(row, n1, p.os0, p.os1);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (!owns(i)) continue;
    WVec w, b;
    if constexpr (W_AHEAD) {
      w = w_ahead[i];
      if constexpr (LAYER) b = b_ahead[i];
    } else {
      load_vec(w, weight + col(i));
      if constexpr (LAYER) load_vec(b, bias + col(i));
    }
    const TVec v = xs[item(i)];
    OVec y;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float scale = to_float(w[j]);
      if constexpr (GEMMA) scale += 1.f;
      float r = (to_float(v[j]) - shift) * inv_rms * scale;
      if constexpr (LAYER) r += to_float(b[j]);
      if constexpr (QUANT) r *= out_scale;  // from_float<fp8> saturates (satfinite)
      y[j] = from_float<OT>(r);
    }
    store_vec(y, o_row + col(i));
  }
}
