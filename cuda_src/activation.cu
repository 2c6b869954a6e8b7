// Gated activations: out[..., i] = act(x[..., i]) * x[..., d + i] for i < d, fp32 math.
//   silu(a) = a / (1 + exp(-a));  gelu(a) = a/2 (1 + erf(a / sqrt 2));
//   gelu_tanh(a) = a/2 (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))
// Grid: blockIdx.x = row, blockIdx.y = column tile of THREADS * VEC * UNROLL outputs.
// Each thread issues 2 * UNROLL independent 16-byte loads before the first use.
// Prelude: ACT (Activation), T, VEC, THREADS, UNROLL.

RTC_DEVICE float activate(float a) {
  if constexpr (ACT == Activation::SILU) {
    return a / (1.f + expf(-a));
  } else if constexpr (ACT == Activation::GELU) {
    return 0.5f * a * (1.f + erff(a * 0.70710678118654752f));
  } else {
    const float inner = 0.7978845608028654f * (a + 0.044715f * a * a * a);
    return 0.5f * a * (1.f + tanhf(inner));
  }
}

using TVec = Vec<T, VEC>;

struct ActivationParams {
  const T* x;  // [n0, n1, 2 * d], row strides (xs0, xs1)
  T* out;      // [n0, n1, d], row strides (os0, os1)
  int64_t xs0, xs1, os0, os1;
  int n1, d;
};

extern "C" __global__ void __launch_bounds__(THREADS)
    act_and_mul_kernel(const __grid_constant__ ActivationParams p) {
  wait_for_previous_grid();
  const T* __restrict__ x = p.x;
  T* __restrict__ out = p.out;
  const int n1 = p.n1, d = p.d;
  const int64_t xs0 = p.xs0, xs1 = p.xs1, os0 = p.os0, os1 = p.os1;
  const int row = blockIdx.x;
  const T* gate = x + int64_t(row / n1) * xs0 + int64_t(row % n1) * xs1;
  const T* up = gate + d;
  T* o = out + int64_t(row / n1) * os0 + int64_t(row % n1) * os1;
  const int base = (blockIdx.y * UNROLL * THREADS + threadIdx.x) * VEC;

  TVec g[UNROLL], u[UNROLL];
#pragma unroll
  for (int k = 0; k < UNROLL; ++k) {
    const int c = base + k * THREADS * VEC;
    if (c < d) {
      g[k].load_stream(gate + c);
      u[k].load_stream(up + c);
    }
  }
#pragma unroll
  for (int k = 0; k < UNROLL; ++k) {
    const int c = base + k * THREADS * VEC;
    if (c >= d) continue;
    TVec y;
#pragma unroll
    for (int j = 0; j < VEC; ++j) y[j] = from_float<T>(activate(to_float(g[k][j])) * to_float(u[k][j]));
    y.store(o + c);
  }
}
