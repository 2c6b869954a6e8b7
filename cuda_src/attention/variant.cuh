// The attention variant, shared by the decode and prefill kernels: how a raw logit q . k becomes
// the base-2 logit the online softmax takes, and which keys a query sees.
//   s' = s * sm_scale (+ alibi_slope(h) * (key - query)) -> cap * tanh(s' / cap) -> * log2(e)
//   key visible iff first_visible_key(0, query, window_left) <= key < kv_len (decode: query is
//   the request's last position; prefill adds the causal bound key <= query)
// RoPE: rotation angles pos * f with f = hi + lo turns per position (the host computes f).
#pragma once

// (cos, sin) of 2 pi * pos * f, f = hi + lo in turns per position, exact to fp32 rounding.
RTC_DEVICE float2 rope_cos_sin(int pos, float2 f) {
  const float x = static_cast<float>(pos);
  const float p = x * f.x;
  const float turns = (p - rintf(p)) + fmaf(x, f.y, fmaf(x, f.x, -p));
  float s, c;
  __sincosf(6.283185307179586f * turns, &s, &c);
  return make_float2(c, s);
}

// ALiBi slope of a head: 2^(-8 (h + 1) / n) for h < n, else 2^(-4 (2 (h - n) + 1) / n), with
// n = 2^floor(log2 num_heads); 1 / n is the exact power of two 2^-k.
RTC_DEVICE float alibi_slope(int head, int num_heads) {
  const int k = 31 - __clz(num_heads), n = 1 << k;
  const float inv_n = __int_as_float((127 - k) << 23);
  return exp2f((head < n ? -8.f * (head + 1) : -4.f * (2 * (head - n) + 1)) * inv_n);
}

// The first key at or after `begin` that a query at position `query` sees: begin, or
// query - window_left with a sliding window (window_left >= 0) if that is later. (decode.cu
// spells it out inline: the same expression through this call compiles to other PTX.)
RTC_DEVICE int first_visible_key(int begin, int query, int window_left) {
  return window_left >= 0 ? max(begin, query - window_left) : begin;
}

// The logit transform of a kernel: ALiBi and the soft cap chosen at compile time.
template <bool ALIBI_BIAS, bool CAPPED>
struct LogitTransform {
  float scale;  // sm_scale, with log2(e) folded in when nothing follows the scaling
  float inv_cap, cap;

  RTC_DEVICE void init(float qk_scale, float soft_cap) {
    scale = (ALIBI_BIAS || CAPPED) ? qk_scale : qk_scale * LOG2E;
    inv_cap = CAPPED ? fast_rcp(soft_cap) : 0.f;
    cap = soft_cap;
  }

  // The base-2 logit of raw score s for a key `distance` positions after the query (negative
  // before it), with the head's ALiBi `slope`.
  RTC_DEVICE float operator()(float s, float slope, int distance) const {
    float v = s * scale;
    if constexpr (ALIBI_BIAS) v = fmaf(s, scale, slope * static_cast<float>(distance));
    if constexpr (CAPPED) v = cap * tanhf(v * inv_cap);
    if constexpr (ALIBI_BIAS || CAPPED) v *= LOG2E;
    return v;
  }
};
