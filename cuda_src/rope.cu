// Rotary position embedding on q and k in one launch.
//   angle(pos, i) = pos * inv_freq[i], inv_freq[i] = theta^(-2i/R) / rope_scale (Llama 3.1:
//   the low-frequency band is divided by rope_scale with a smooth ramp), or cos/sin read from a
//   [max_pos, R] cache (cos in [:, :R/2], sin in [:, R/2:]).
//   Non-interleaved: (x[i], x[i + R/2]) rotate by angle i; interleaved: (x[2i], x[2i+1]).
//   Elements in [R, HEAD_DIM) pass through.
// Grid: CTAs stride over tokens. Per token the CTA builds cos/sin of its position in shared
// memory, then rows (token, head) go ROWS at a time: thread = (row, lane), lane = VEC elements.
// Angles are exact to fp32 rounding at any position: the frequency in turns per position is a
// double-float (hi, lo) computed once per CTA in fp64, the product pos * f is split with an FMA
// and reduced to [-1/2, 1/2] turns before sincospif.
// Prelude: T, POS_T, HEAD_DIM, ROTARY_DIM, VEC, ROWS, INTERLEAVE, MODE (RopeMode), POS_FROM
// (PositionSource), INPLACE.

enum RopeMode { THETA = 0, LLAMA31 = 1, COS_SIN_CACHE = 2 };
enum PositionSource { POS_IDS = 0, INDPTR_OFFSETS = 1 };

constexpr int HALF = ROTARY_DIM / 2;
constexpr int LANES = HEAD_DIM / VEC;
constexpr int THREADS = LANES * ROWS;
static_assert(HEAD_DIM % VEC == 0 && ROTARY_DIM % 2 == 0 && ROTARY_DIM <= HEAD_DIM, "shapes");
static_assert(INTERLEAVE ? ROTARY_DIM % VEC == 0 && VEC % 2 == 0 : HALF % VEC == 0,
              "a vector never straddles the rotary boundaries");

using TVec = Vec<T, VEC>;

struct RopeParams {
  float rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len;
};

// Frequency of pair i in turns per position, as (hi, lo) floats: f = hi + lo to ~2^-48.
RTC_DEVICE float2 turns_per_position(int i, const RopeParams& p) {
  double inv = pow(double(p.rope_theta), -2.0 * i / ROTARY_DIM);
  if constexpr (MODE == LLAMA31) {
    const double pi = 3.141592653589793;
    const double a = p.old_context_len / (2 * pi * (p.high_freq_factor - p.low_freq_factor));
    const double b = -1.0 / (p.high_freq_factor / p.low_freq_factor - 1.0);
    const double smooth = fmin(fmax(inv * a + b, 0.0), 1.0);
    inv = (1 - smooth) * inv / p.rope_scale + smooth * inv;
  } else {
    inv /= p.rope_scale;
  }
  const double f = inv * 0.15915494309189535;  // / (2 pi)
  const float hi = float(f);
  return make_float2(hi, float(f - hi));
}

// (cos, sin) of 2 pi * pos * f without losing the fractional turn to rounding.
RTC_DEVICE float2 cos_sin(float pos, float2 f) {
  const float p = pos * f.x;
  const float err = fmaf(pos, f.x, -p);
  const float turns = (p - rintf(p)) + fmaf(pos, f.y, err);
  float s, c;
  sincospif(2.f * turns, &s, &c);
  return make_float2(c, s);
}

RTC_DEVICE int64_t token_position(int t, const POS_T* pos_ids, const POS_T* indptr,
                                  const POS_T* offsets, int batch_size) {
  if constexpr (POS_FROM == POS_IDS) {
    return int64_t(pos_ids[t]);
  } else {
    int lo = 0, hi = batch_size - 1;  // last request with indptr[b] <= t
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (int64_t(indptr[mid]) <= t) lo = mid; else hi = mid - 1;
    }
    return int64_t(offsets[lo]) + t - int64_t(indptr[lo]);
  }
}

RTC_DEVICE void rotate(TVec& y, const TVec& x, const TVec& partner, int e0, const float2* cs) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const int e = e0 + j;
    const float a = to_float(x[j]);
    float r;
    if constexpr (INTERLEAVE) {
      const float2 c = cs[e / 2];
      const float b = to_float(x[j ^ 1]);
      r = (j % 2 == 0) ? a * c.x - b * c.y : a * c.x + b * c.y;
    } else {
      const bool first = e < HALF;
      const float2 c = cs[first ? e : e - HALF];
      const float b = to_float(partner[j]);
      r = first ? a * c.x - b * c.y : a * c.x + b * c.y;
    }
    y[j] = from_float<T>(r);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) rope_kernel(
    const T* q, int64_t q_tok, int64_t q_head,     // [nnz, Hq, HEAD_DIM] strides in elements
    const T* k, int64_t k_tok, int64_t k_head,     // [nnz, Hk, HEAD_DIM]
    T* q_out, int64_t qo_tok, int64_t qo_head,     // [nnz, Hq, HEAD_DIM] (INPLACE: == q)
    T* k_out, int64_t ko_tok, int64_t ko_head,     // [nnz, Hk, HEAD_DIM] (INPLACE: == k)
    const POS_T* pos_ids,                          // [nnz]  (POS_IDS)
    const POS_T* indptr, const POS_T* offsets,     // [B + 1], [B]  (INDPTR_OFFSETS)
    const float* cos_sin_cache,                    // [max_pos, ROTARY_DIM]  (COS_SIN_CACHE)
    int nnz, int num_q_heads, int num_k_heads, int batch_size,
    float rope_scale, float rope_theta, float low_freq_factor, float high_freq_factor,
    float old_context_len) {
  const RopeParams params{rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                          old_context_len};
  __shared__ float2 freq[HALF > 0 ? HALF : 1];
  __shared__ float2 cs[HALF > 0 ? HALF : 1];
  if constexpr (MODE != COS_SIN_CACHE)
    for (int i = threadIdx.x; i < HALF; i += THREADS) freq[i] = turns_per_position(i, params);

  const int lane = threadIdx.x % LANES, row_in_round = threadIdx.x / LANES;
  const int e0 = lane * VEC;
  const bool rotary = e0 < ROTARY_DIM;
  const int partner_e = INTERLEAVE ? e0 : (e0 < HALF ? e0 + HALF : e0 - HALF);
  const int rows = num_q_heads + num_k_heads;

  for (int t = blockIdx.x; t < nnz; t += gridDim.x) {
    const int64_t pos = token_position(t, pos_ids, indptr, offsets, batch_size);
    __syncthreads();  // freq ready; the previous token's cs no longer read
    for (int i = threadIdx.x; i < HALF; i += THREADS) {
      if constexpr (MODE == COS_SIN_CACHE) {
        const float* c = cos_sin_cache + pos * ROTARY_DIM;
        cs[i] = make_float2(c[i], c[HALF + i]);
      } else {
        cs[i] = cos_sin(float(pos), freq[i]);
      }
    }
    __syncthreads();
    for (int r0 = 0; r0 < rows; r0 += ROWS) {
      const int row = r0 + row_in_round;
      const bool active = row < rows;
      const bool is_q = row < num_q_heads;
      const int h = is_q ? row : row - num_q_heads;
      const T* src = is_q ? q + t * q_tok + h * q_head : k + t * k_tok + h * k_head;
      T* dst = is_q ? q_out + t * qo_tok + h * qo_head : k_out + t * ko_tok + h * ko_head;
      TVec x, partner;
      if (active) {
        x.load(src + e0);
        if (!INTERLEAVE && rotary) partner.load(src + partner_e);
      }
      if constexpr (INPLACE) __syncthreads();  // every partner read before any row is written
      if (!active || (INPLACE && !rotary)) continue;
      TVec y = x;
      if (rotary) rotate(y, x, partner, e0, cs);
      y.store(dst + e0);
    }
  }
}
