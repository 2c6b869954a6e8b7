// One CTA per vocabulary row: how a row is read, and the candidate list kept in shared memory.
//
// A row of n values is cut into WARPS segments of `seg` consecutive elements (a multiple of the
// vector width); warp w owns segment w. Warp-level passes therefore need no block barrier, and
// every block-level quantity is a sum over segments taken in segment order.
//
// Candidate list: while streaming its segment once, warp w copies the values above a rising
// "bar" (with their token ids, in token order) into its own region of CAP_W slots of shared
// memory. The bar starts below every valid value and is raised only when the region would
// overflow: bar(m, d) = m * 2^-d (probabilities) or m - 2^(d-12) (logits), with m the warp's
// running maximum and d lowered by a binary search so that at most CAP_W/2 entries stay. The bar
// only rises, so at the end the region holds every value of the segment above the warp's final
// bar. With low0 = the largest final bar over warps, the list holds exactly the row's values
// above low0 (after dropping the rest), in token order. Selections whose kept set lies above
// low0 then run from shared memory; low0 == lowest() means the list holds the whole row.
//
// Prelude: THREADS, CAP (list slots of the block; 8 bytes each, in dynamic shared memory).
#pragma once

constexpr int WARPS = THREADS / 32;
constexpr int CAP_W = CAP / WARPS;  // list slots per warp
constexpr unsigned FULL = 0xffffffffu;
constexpr int NO_BAR = 255;      // bar step before the first overflow: every valid value enters
constexpr int MAX_BAR_STEP = 24;  // the first bar is at most 2^24 below the running maximum
constexpr int NONE = 0x7fffffff;  // "no position" in block-wide minima
static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps");
static_assert(CAP % WARPS == 0 && CAP_W % 4 == 0 && CAP_W >= 64, "regions of float4 groups");

RTC_DEVICE int lane_id() { return threadIdx.x % 32; }
RTC_DEVICE int warp_id() { return threadIdx.x / 32; }
RTC_DEVICE float infinity() { return __int_as_float(0x7f800000); }
RTC_DEVICE float pow2i(int e) { return __uint_as_float(uint32_t(127 + e) << 23); }  // |e| < 127

// Probabilities: valid values are > 0. NaN and negatives read as 0 (never drawn).
struct ProbPolicy {
  static constexpr bool MASS = true;
  RTC_DEVICE static float lowest() { return 0.f; }
  RTC_DEVICE static float clean(float v) { return fmaxf(v, 0.f); }
  RTC_DEVICE static bool bad(float v) { return !(v >= 0.f && v < infinity()); }
  RTC_DEVICE static float bar(float m, int d) { return d == NO_BAR ? 0.f : __fmul_rn(m, pow2i(-d)); }
  RTC_DEVICE static uint32_t key(float v) { return __float_as_uint(v); }
  RTC_DEVICE static float from_key(uint32_t k) { return __uint_as_float(k); }
};

// Logits: valid values are > -inf. NaN reads as -inf.
struct LogitPolicy {
  static constexpr bool MASS = false;
  RTC_DEVICE static float lowest() { return -infinity(); }
  RTC_DEVICE static float clean(float v) { return isnan(v) ? -infinity() : v; }
  RTC_DEVICE static bool bad(float v) { return isnan(v) || v == infinity(); }
  RTC_DEVICE static float bar(float m, int d) {
    return d == NO_BAR ? -infinity() : d == 0 ? m : __fsub_rn(m, pow2i(d - 12));
  }
  // Order-preserving map of floats to unsigned keys.
  RTC_DEVICE static uint32_t key(float v) {
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  }
  RTC_DEVICE static float from_key(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
  }
};

// Row of a [rows, n] array; segment s = elements [s * seg, min((s + 1) * seg, n)).
template <typename T, int V, class P>
struct RowSource {
  using Policy = P;
  static constexpr int VEC = V;
  const T* __restrict__ row;
  int n;
  int seg;

  RTC_DEVICE int size(int s) const { return max(0, min(seg, n - s * seg)); }
  RTC_DEVICE int token(int s, int pos) const { return s * seg + pos; }
  // Raw values at segment position pos (a multiple of V); past the end they read as lowest().
  RTC_DEVICE void load(int s, int pos, float (&v)[V]) const {
    if (pos < size(s)) {
      Vec<T, V> x;
      x.load_stream(row + s * seg + pos);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = to_float(x[j]);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = P::lowest();
    }
  }
  RTC_DEVICE float value(int s, int pos) const { return P::clean(to_float(row[s * seg + pos])); }
};

// Elementwise max(target - draft, 0) of two rows (the residual of speculative sampling).
template <typename T, int V>
struct ResidualSource {
  using Policy = ProbPolicy;
  static constexpr int VEC = V;
  const T* __restrict__ target;
  const T* __restrict__ draft;
  int n;
  int seg;

  RTC_DEVICE int size(int s) const { return max(0, min(seg, n - s * seg)); }
  RTC_DEVICE int token(int s, int pos) const { return s * seg + pos; }
  RTC_DEVICE void load(int s, int pos, float (&v)[V]) const {
    if (pos < size(s)) {
      Vec<T, V> t, q;
      t.load_stream(target + s * seg + pos);
      q.load_stream(draft + s * seg + pos);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = to_float(t[j]) - to_float(q[j]);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = 0.f;
    }
  }
  RTC_DEVICE float value(int s, int pos) const {
    const int i = s * seg + pos;
    return ProbPolicy::clean(to_float(target[i]) - to_float(draft[i]));
  }
};

// The candidate list: segment s = region s, slots [s * CAP_W, s * CAP_W + count[s]).
template <class P>
struct ListSource {
  using Policy = P;
  static constexpr int VEC = 4;
  const float* vals;  // [CAP] shared
  const int* ids;     // [CAP] shared
  const int* count;   // [WARPS] shared

  RTC_DEVICE int size(int s) const { return count[s]; }
  RTC_DEVICE int token(int s, int pos) const { return ids[s * CAP_W + pos]; }
  RTC_DEVICE void load(int s, int pos, float (&v)[4]) const {
    const int n = count[s];
    if (pos < n) {
      const float4 x = *reinterpret_cast<const float4*>(vals + s * CAP_W + pos);
      v[0] = x.x;
      v[1] = pos + 1 < n ? x.y : P::lowest();
      v[2] = pos + 2 < n ? x.z : P::lowest();
      v[3] = pos + 3 < n ? x.w : P::lowest();
    } else {
      v[0] = v[1] = v[2] = v[3] = P::lowest();
    }
  }
  RTC_DEVICE float value(int s, int pos) const { return vals[s * CAP_W + pos]; }
};

// Block-shared scratch of the row kernels (the list itself lives in dynamic shared memory).
struct RowShared {
  float seg[3][WARPS];  // per-segment masses above a threshold: rotating slots
  int cnt[2][WARPS];    // per-segment counts above the two pivots
  int list_n[WARPS];    // entries in each warp's region
  float seg_max[WARPS], seg_bar[WARPS];  // pass-0 maximum and final bar of each segment
  float scan[WARPS + 1];
  uint32_t hist_cnt[256];
  unsigned long long hist_mass[256];
  float f[4];
  int i[4];
  unsigned long long u[2];
  int hit, last, first;
};

// ---------------------------------------------------------------------------------------------
// Warp helpers

RTC_DEVICE int warp_sum_int(int x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL, x, o);
  return x;
}

RTC_DEVICE int warp_min_int(int x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = min(x, __shfl_xor_sync(FULL, x, o));
  return x;
}

RTC_DEVICE int warp_max_int(int x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = max(x, __shfl_xor_sync(FULL, x, o));
  return x;
}

RTC_DEVICE int warp_exclusive_sum(int x) {
  int incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(FULL, incl, o);
    if (lane_id() >= o) incl += y;
  }
  return incl - x;
}

// Keeps the region's entries above b, in order; returns their number.
RTC_DEVICE int keep_above(float* vals, int* ids, int n, float b) {
  int out = 0;
  for (int i0 = 0; i0 < n; i0 += 32) {
    const int i = i0 + lane_id();
    float v = 0.f;
    int id = 0;
    if (i < n) {
      v = vals[i];
      id = ids[i];
    }
    __syncwarp();  // every lane has read chunk i0 before any lane overwrites it
    const bool keep = i < n && v > b;
    const unsigned ballot = __ballot_sync(FULL, keep);
    if (keep) {
      const int k = out + __popc(ballot & ((1u << lane_id()) - 1));
      vals[k] = v;
      ids[k] = id;
    }
    out += __popc(ballot);
  }
  __syncwarp();
  return out;
}

// The largest bar step d' < d (or <= MAX_BAR_STEP from NO_BAR) leaving at most CAP_W / 2
// entries above bar(m, d'); d' = 0 always qualifies, since no entry exceeds m.
template <class P>
RTC_DEVICE int lower_bar(const float* vals, int n, float m, int d) {
  int lo = 0, hi = d == NO_BAR ? MAX_BAR_STEP : max(d - 1, 0);
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    const float b = P::bar(m, mid);
    int above = 0;
    for (int i0 = 0; i0 < n; i0 += 32) {
      const int i = i0 + lane_id();
      above += __popc(__ballot_sync(FULL, i < n && vals[i] > b));
    }
    if (above <= CAP_W / 2) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

struct Collected {
  float max, bar, sum;  // warp maximum, final bar, sum of cleaned values (probabilities)
  int n;                // entries in the region
  bool bad;             // NaN / negative / inf seen (only when asked)
};

// Warp w streams segment w once: running max, sum, and the candidate region (see the top).
template <class Src>
RTC_DEVICE Collected collect_candidates(const Src& src, float* vals, int* ids, bool check) {
  using P = typename Src::Policy;
  constexpr int V = Src::VEC, STEP = 32 * V, U = V >= 4 ? 16 / V : 4;
  const int lane = lane_id(), w = warp_id(), size = src.size(w);
  float* rv = vals + w * CAP_W;
  int* ri = ids + w * CAP_W;
  float m_lane = P::lowest(), m_warp = P::lowest(), sum = 0.f;
  int d = NO_BAR, n = 0;
  bool bad = false;
  for (int base = 0; base < size; base += U * STEP) {
    float v[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) src.load(w, base + u * STEP + lane * V, v[u]);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int pos = base + u * STEP + lane * V;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (check) bad |= P::bad(v[u][j]);
        v[u][j] = P::clean(v[u][j]);
        m_lane = fmaxf(m_lane, v[u][j]);
        if constexpr (P::MASS) sum += v[u][j];
      }
      float b = P::bar(m_warp, d);
      int cnt = 0;
#pragma unroll
      for (int j = 0; j < V; ++j) cnt += v[u][j] > b;
      if (!__any_sync(FULL, cnt)) continue;
      int excl = warp_exclusive_sum(cnt), total = __shfl_sync(FULL, excl + cnt, 31);
      while (n + total > CAP_W) {  // raise the bar until this step fits
        m_warp = warp_max(m_lane);  // the bar may lag the maximum; it never passes it
        d = lower_bar<P>(rv, n, m_warp, d);
        b = P::bar(m_warp, d);
        n = keep_above(rv, ri, n, b);
        cnt = 0;
#pragma unroll
        for (int j = 0; j < V; ++j) cnt += v[u][j] > b;
        excl = warp_exclusive_sum(cnt);
        total = __shfl_sync(FULL, excl + cnt, 31);
      }
      int k = n + excl;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (v[u][j] > b) {
          rv[k] = v[u][j];
          ri[k] = src.token(w, pos + j);
          ++k;
        }
      }
      n += total;
    }
  }
  __syncwarp();
  const float m = warp_max(m_lane);
  return {m, P::bar(m, d), warp_sum(sum), n, __any_sync(FULL, bad) != 0};
}
