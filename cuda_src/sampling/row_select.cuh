// Block-level selections over a row source (row_scan.cuh): counts and masses above two pivots,
// an inverse-transform draw, an exact radix select, and the first position of a value.
// Every result is deterministic: sums run in a fixed order and integer atomics commute.
#pragma once
#include "row_scan.cuh"

// Exclusive prefix of x over the block, and the block total. Uses sh.scan.
RTC_DEVICE void block_exclusive_sum(float x, float& excl, float& total, RowShared& sh) {
  const int lane = lane_id(), w = warp_id();
  float incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(FULL, incl, o);
    if (lane >= o) incl += y;
  }
  const float before = __shfl_up_sync(FULL, incl, 1);
  if (lane == 31) sh.scan[w] = incl;
  __syncthreads();
  if (w == 0) {
    const float t = lane < WARPS ? sh.scan[lane] : 0.f;
    float ti = t;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(FULL, ti, o);
      if (lane >= o) ti += y;
    }
    const float tb = __shfl_up_sync(FULL, ti, 1);
    if (lane < WARPS) sh.scan[lane] = lane == 0 ? 0.f : tb;
    if (lane == WARPS - 1) sh.scan[WARPS] = ti;
  }
  __syncthreads();
  excl = sh.scan[w] + (lane == 0 ? 0.f : before);
  total = sh.scan[WARPS];
}

struct PivotStats {
  int c1, c2;    // values above x1, above x2
  float m1, m2;  // their masses
};

// Counts and masses of the values above x1 and above x2. Segment masses go to sh.seg[a1] and
// sh.seg[a2] (the inputs of the next draw); totals add the segments in order, as `draw` does.
template <class Src>
RTC_DEVICE PivotStats pivot_stats(const Src& src, float x1, float x2, RowShared& sh, int a1,
                                  int a2) {
  using P = typename Src::Policy;
  constexpr int V = Src::VEC, STEP = 32 * V, U = LoadUnroll<V>::U;
  const int lane = lane_id(), w = warp_id(), size = src.size(w);
  int c1 = 0, c2 = 0;
  float m1 = 0.f, m2 = 0.f;
  for (int base = 0; base < size; base += U * STEP) {
    float v[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) src.load(w, base + u * STEP + lane * V, v[u]);
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float c = P::clean(v[u][j]);
        if (c > x1) {
          ++c1;
          m1 += c;
        }
        if (c > x2) {
          ++c2;
          m2 += c;
        }
      }
    }
  }
  c1 = warp_sum_int(c1);
  c2 = warp_sum_int(c2);
  m1 = warp_sum(m1);
  m2 = warp_sum(m2);
  if (lane == 0) {
    sh.seg[a1][w] = m1;
    sh.seg[a2][w] = m2;
    sh.cnt[0][w] = c1;
    sh.cnt[1][w] = c2;
  }
  __syncthreads();
  if (threadIdx.x < 2) {
    int c = 0;
#pragma unroll 1
    for (int s = 0; s < WARPS; ++s) c += sh.cnt[threadIdx.x][s];
    sh.i[threadIdx.x] = c;
  } else if (threadIdx.x < 4) {
    const float* seg = sh.seg[threadIdx.x == 2 ? a1 : a2];
    float m = 0.f;
#pragma unroll 1
    for (int s = 0; s < WARPS; ++s) m += seg[s];
    sh.f[threadIdx.x - 2] = m;
  }
  __syncthreads();
  return {sh.i[0], sh.i[1], sh.f[0], sh.f[1]};
}

struct Drawn {
  int token;    // -1: no value above low
  float value;  // its (cleaned) value
};

// Inverse-transform draw among the values above `low` (and below `ceil` when CEILED), in token
// order: the first value whose running sum exceeds `target` (u * Z for a draw of uniform u,
// Z = the sum of seg[], the segment masses of those values). The segment is found from seg[],
// then one segment is scanned by the whole block. The running sums are floating point and need
// not be monotone, so a scan that never passes the target falls back to the last such value of
// that segment; a value outside (low, ceil) is never returned.
template <class Src, bool CEILED = false>
RTC_DEVICE Drawn draw_at(const Src& src, float low, const float* seg, float target, RowShared& sh,
                         float ceil = 0.f) {
  using P = typename Src::Policy;
  constexpr int V = Src::VEC, TILE = THREADS * V;
  int pick = -1, last = -1;
  float cum = 0.f, before = 0.f, before_last = 0.f;
#pragma unroll 1
  for (int s = 0; s < WARPS; ++s) {
    const float next = cum + seg[s];
    if (seg[s] > 0.f) {
      last = s;
      before_last = cum;
    }
    if (pick < 0 && next > target) {
      pick = s;
      before = cum;
    }
    cum = next;
  }
  if (pick < 0 || seg[pick] <= 0.f) {
    pick = last;
    before = before_last;
  }
  if (pick < 0) return {-1, 0.f};

  if (threadIdx.x == 0) {
    sh.hit = NONE;
    sh.last = -1;
  }
  __syncthreads();
  const int size = src.size(pick);
  float base = before;
  for (int t0 = 0; t0 < size; t0 += TILE) {
    const int pos = t0 + int(threadIdx.x) * V;
    float v[V];
    src.load(pick, pos, v);
    float part = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      v[j] = P::clean(v[j]);
      v[j] = v[j] > low && (!CEILED || v[j] < ceil) ? v[j] : 0.f;
      part += v[j];
    }
    float excl, total;
    block_exclusive_sum(part, excl, total, sh);
    float run = base + excl;
    int hit = NONE, valid = -1;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (v[j] > 0.f) {
        valid = pos + j;
        run += v[j];
        if (hit == NONE && run > target) hit = pos + j;
      }
    }
    hit = warp_min_int(hit);
    valid = warp_max_int(valid);
    if (lane_id() == 0) {
      if (hit != NONE) atomicMin(&sh.hit, hit);
      if (valid >= 0) atomicMax(&sh.last, valid);
    }
    __syncthreads();
    if (sh.hit != NONE) break;
    base += total;
  }
  const int at = sh.hit != NONE ? sh.hit : sh.last;
  __syncthreads();  // all have read hit/last before the next draw resets them
  if (at < 0) return {-1, 0.f};
  return {src.token(pick, at), src.value(pick, at)};
}

// A draw of uniform u among the values above `low` (seg[]: their segment masses).
template <class Src>
RTC_DEVICE Drawn draw(const Src& src, float low, const float* seg, float u, RowShared& sh) {
  float z = 0.f;
#pragma unroll 1
  for (int s = 0; s < WARPS; ++s) z += seg[s];
  return draw_at(src, low, seg, u * z, sh);
}

// Smallest token whose cleaned value equals `target` (NONE when none).
template <class Src>
RTC_DEVICE int first_index_of(const Src& src, float target, RowShared& sh) {
  using P = typename Src::Policy;
  constexpr int V = Src::VEC, STEP = 32 * V;
  const int lane = lane_id(), w = warp_id(), size = src.size(w);
  if (threadIdx.x == 0) sh.first = NONE;
  __syncthreads();
  int best = NONE;
  for (int pos = lane * V; pos < size && best == NONE; pos += STEP) {
    float v[V];
    src.load(w, pos, v);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (best == NONE && P::clean(v[j]) == target) best = src.token(w, pos + j);
    }
  }
  best = warp_min_int(best);
  if (lane == 0 && best != NONE) atomicMin(&sh.first, best);
  __syncthreads();
  const int r = sh.first;
  __syncthreads();
  return r;
}

struct Threshold {
  uint32_t key;                 // key of the threshold value
  unsigned long long kept;      // fixed-point mass of the values >= it
  bool all;                     // no threshold: every value is kept
};

RTC_DEVICE unsigned long long fixed_mass(float v, double scale) {
  return __double2ull_rn(double(v) * scale);
}

// Exact threshold among the values above `low`, by a most-significant-digit radix select over
// 8-bit digits of their order-preserving keys (4 passes over the source):
//   BY_MASS false: the key of the k-th largest value (all: fewer than k values);
//   BY_MASS true:  the key of the smallest value v with mass(values > v) < p_fixed, or with
//                  nothing above it (the maximum is always kept).
// Masses are fixed point, v * scale rounded to an integer, so the histograms are built with
// integer atomics and the result is independent of their order. kept = mass of values >= key.
template <class Src, bool BY_MASS, bool NEED_MASS>
RTC_DEVICE Threshold radix_select(const Src& src, float low, int k, unsigned long long p_fixed,
                                  double scale, RowShared& sh) {
  using P = typename Src::Policy;
  constexpr int V = Src::VEC, STEP = 32 * V;
  const int lane = lane_id(), w = warp_id(), size = src.size(w);
  uint32_t prefix = 0;
  int greater = 0;
  unsigned long long greater_mass = 0, kept = 0;
  for (int level = 0; level < 4; ++level) {
    const int shift = 24 - 8 * level;
    for (int i = threadIdx.x; i < 256; i += THREADS) {
      sh.hist_cnt[i] = 0;
      if (NEED_MASS) sh.hist_lo[i] = sh.hist_hi[i] = 0;
    }
    __syncthreads();
    for (int pos = lane * V; pos < size; pos += STEP) {
      float v[V];
      src.load(w, pos, v);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float c = P::clean(v[j]);
        const uint32_t key = P::key(c);
        if (c > low && (level == 0 || (key >> (shift + 8)) == prefix)) {
          const uint32_t digit = (key >> shift) & 255u;
          atomicAdd(&sh.hist_cnt[digit], 1u);
          if (NEED_MASS) add_mass(&sh.hist_lo[digit], &sh.hist_hi[digit], fixed_mass(c, scale));
        }
      }
    }
    __syncthreads();
    if (w == 0) {  // the digit: lane l looks after bins 8l .. 8l + 7
      const uint32_t* hc = sh.hist_cnt + 8 * lane;
      const uint32_t *hl = sh.hist_lo + 8 * lane, *hh = sh.hist_hi + 8 * lane;
      int lane_cnt = 0;
      unsigned long long lane_mass = 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        lane_cnt += int(hc[b]);
        if (NEED_MASS) lane_mass += words(hl[b], hh[b]);
      }
      int suf_cnt = lane_cnt;  // lanes >= this one
      unsigned long long suf_mass = lane_mass;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int yc = __shfl_down_sync(FULL, suf_cnt, o);
        const unsigned long long ym = __shfl_down_sync(FULL, suf_mass, o);
        if (lane + o < 32) {
          suf_cnt += yc;
          suf_mass += ym;
        }
      }
      int run = greater + suf_cnt - lane_cnt;  // values above this lane's bins
      unsigned long long above = greater_mass + suf_mass - lane_mass;
      int pick = -1, pick_run = 0;
      unsigned long long pick_above = 0, pick_kept = 0;
      if constexpr (!BY_MASS) {
        const unsigned reach = __ballot_sync(FULL, greater + suf_cnt >= k);
        if (reach && lane == 31 - __clz(reach)) {
#pragma unroll 1
          for (int b = 7; b >= 0 && pick < 0; --b) {
            const int c = int(hc[b]);
            const unsigned long long m = NEED_MASS ? words(hl[b], hh[b]) : 0ull;
            if (run + c >= k) {
              pick = 8 * lane + b;
              pick_run = run;
              pick_above = above;
              pick_kept = above + m;
            }
            run += c;
            above += m;
          }
        }
      } else {
#pragma unroll 1
        for (int b = 7; b >= 0; --b) {
          const int c = int(hc[b]);
          const unsigned long long m = words(hl[b], hh[b]);
          if (c > 0 && (above < p_fixed || above == 0)) {
            pick = 8 * lane + b;
            pick_run = run;
            pick_above = above;
            pick_kept = above + m;
          }
          run += c;
          above += m;
        }
        const unsigned has = __ballot_sync(FULL, pick >= 0);
        if (!has || lane != __ffs(has) - 1) pick = -1;
      }
      const unsigned found = __ballot_sync(FULL, pick >= 0);
      if (pick >= 0) {
        sh.i[2] = pick;
        sh.i[3] = pick_run;
        sh.u[0] = pick_above;
        sh.u[1] = pick_kept;
      }
      if (!found && lane == 0) sh.i[2] = -1;
    }
    __syncthreads();
    const int digit = sh.i[2];
    if (digit < 0) return {0u, 0ull, true};  // uniform: every thread read the same value
    prefix = (prefix << 8) | uint32_t(digit);
    greater = sh.i[3];
    greater_mass = sh.u[0];
    kept = sh.u[1];
    __syncthreads();  // all have read before the next level writes
  }
  return {prefix, kept, false};
}

// radix_select<BlockMaxSource, true, ...>'s key when the block maxima's whole fixed-point mass
// is below p_fixed: each of them then has less than p_fixed above it, so the cut is the smallest
// (valid) one. One block reduction instead of four histogram passes: true and `smallest` set
// when the mass is below p_fixed, false (nothing decided) otherwise. Contains barriers.
template <class P>
RTC_DEVICE bool light_block_maxima(const BlockMaxSource<P>& blocks, double scale,
                                   unsigned long long p_fixed, RowShared& sh, float& smallest) {
  if (threadIdx.x == 0) {
    sh.kept_lo = sh.kept_hi = 0u;
    sh.i[0] = NONE;
  }
  __syncthreads();
  unsigned long long m = 0;
  int low = NONE;  // smallest valid block maximum, as a key (non-negative: int order)
  for (int i = threadIdx.x; i < WARPS * BLOCKS_W; i += THREADS) {
    const int s = i / BLOCKS_W, pos = i % BLOCKS_W;
    const float v = pos < blocks.blocks ? blocks.value(s, pos) : P::lowest();
    if (v > P::lowest()) {
      m += fixed_mass(v, scale);
      low = min(low, int(P::key(v)));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m += __shfl_xor_sync(FULL, m, o);
  low = warp_min_int(low);
  if (lane_id() == 0) {
    if (m) add_mass(&sh.kept_lo, &sh.kept_hi, m);
    if (low != NONE) atomicMin(&sh.i[0], low);
  }
  __syncthreads();
  const unsigned long long total = words(sh.kept_lo, sh.kept_hi);
  const int key = sh.i[0];
  __syncthreads();  // all have read before the words are used again
  smallest = P::from_key(uint32_t(key));
  return key != NONE && total < p_fixed;
}
