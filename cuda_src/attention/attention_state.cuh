// Online softmax in base 2: the running state of one attention row.
//   x_j = s_j * log2(e) (scaled logits),  m = max_j x_j,  d = sum_j 2^(x_j - m),
//   o = sum_j 2^(x_j - m) v_j;   output = o / d,   lse = m + log2(d) = log2(sum_j e^(s_j)).
// The empty state (no key seen: m = -inf, d = 0, o = 0) is the identity of merge, and every
// exponent is taken against offset() so that -inf - -inf never produces a NaN. A NaN (or a
// +inf logit or LSE, whose exponent is inf - inf) lands in d and stays there: such a row
// comes out as o = NaN, lse = NaN, never as the empty state (fmaxf alone would drop it).
// N is how many elements of the output row this thread holds (its share of the row).
#pragma once

RTC_DEVICE float neg_inf() { return __int_as_float(0xff800000u); }

template <int N>
struct AttentionState {
  float m;     // running max of the scaled logits (base 2)
  float d;     // sum of 2^(x - m) over the keys seen (by this thread, until reduced)
  float o[N];  // sum of 2^(x - m) v over the keys seen, not normalized

  RTC_DEVICE void init() {
    m = neg_inf();
    d = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] = 0.f;
  }

  // What to subtract from a logit before exp2: m, or 0 while the state is empty.
  RTC_DEVICE float offset() const { return m == neg_inf() ? 0.f : m; }

  // Raise the running max to cover a block of logits whose max is block_max: d and o are
  // rescaled to the new max. Returns offset() for the block's exp2.
  RTC_DEVICE float rescale(float block_max) {
    const float m_new = fmaxf(m, block_max);
    const float off = m_new == neg_inf() ? 0.f : m_new;
    const float scale = fast_exp2(m - off);  // 0 while empty: -inf - finite
    d *= scale;
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] *= scale;
    m = m_new;
    return off;
  }

  // this <- this (+) other: the state of the union of both key sets.
  RTC_DEVICE void merge(const AttentionState& other) {
    const float m_new = fmaxf(m, other.m);
    const float off = m_new == neg_inf() ? 0.f : m_new;
    const float a = fast_exp2(m - off), b = fast_exp2(other.m - off);
    d = d * a + other.d * b;
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] = o[i] * a + other.o[i] * b;
    m = m_new;
  }

  // The state of a normalized partial result (v = o / d, lse): m = lse, d = 1, o = v.
  // An empty partial (lse = -inf) contributes nothing, whatever v holds.
  RTC_DEVICE void set_normalized(const float* v, float lse) {
    const bool empty = lse == neg_inf();
    m = lse;
    d = empty ? 0.f : 1.f;
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] = empty ? 0.f : v[i];
  }

  // o <- o / d (0 for the empty state, NaN where d is NaN).
  RTC_DEVICE void normalize() {
    const float inv = d > 0.f ? fast_rcp(d) : d == 0.f ? 0.f : d;  // rcp.approx: no division
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] *= inv;
  }

  // m + log2(d): -inf for the empty state, NaN where d is NaN.
  RTC_DEVICE float lse() const { return d > 0.f ? m + log2f(d) : d == 0.f ? neg_inf() : d; }
};
