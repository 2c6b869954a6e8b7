// The building blocks of cuda_src/sampling/sampling_cluster.cu: what each CTA publishes to its cluster,
// block scratch, and the cluster-wide passes over the CTA's slice (pivot statistics, a draw,
// the k-th largest value) plus rank 0's finish on a candidate list. The including file defines
// WARPS and FULL, includes sample_common.cuh, and has the prelude's THREADS, CLUSTER, OUT_T.
#pragma once

RTC_DEVICE uint64_t fixed_mass(float v, float scale) { return __float2ull_rn(__fmul_rn(v, scale)); }

// 2^(40 - E) for M in [2^E, 2^(E+1)), at most 2^127.
RTC_DEVICE float mass_scale(float M) {
  const int E = int(__float_as_uint(M) >> 23) - 127;
  return __uint_as_float(uint32_t(min(127 + 40 - E, 254)) << 23);
}

// What a CTA shows the rest of its cluster. Each field is written in one phase and read by the
// other CTAs only between the next two cluster barriers, so no read races a rewrite.
struct Published {
  float max;
  float warp_max[WARPS];
  uint32_t bad;
  uint64_t total;           // sum of f over the slice ("joint" top-p base)
  uint64_t mass;            // draw: sum of f over the slice's values > low
  int token;                // draw: the token, when the target fell in this slice
  float value;
  uint32_t count[2];        // pivot stats: count and mass of the values > pivot 1, pivot 2
  uint64_t pivot_mass[2];
  int first_max;            // fallback: smallest token with v == M in the slice
  uint32_t hist[2][256];    // radix select, alternate levels
  uint32_t list_n;          // rank 0: the candidate list, appended to by every CTA
  float list_v[THREADS];
  int list_t[THREADS];
};

// Block-level scratch: warp partials and results broadcast after a __syncthreads.
struct Scratch {
  uint64_t u[WARPS][2];
  uint32_t c[WARPS][2];
  float f[WARPS];
  uint64_t total, offset, out_u[2];
  uint64_t rank_mass[2][CLUSTER];  // each slice's mass above pivot 1, pivot 2
  uint32_t out_c[2];
  int rank, digit;
  uint32_t greater;
  float M, floor, value;
  int token;
  float warp_max[CLUSTER * WARPS];
  float sorted_v[THREADS];  // rank 0: the candidate list in token order
  int sorted_t[THREADS];
};

RTC_DEVICE uint64_t shfl_xor_u64(uint64_t x, int m) { return __shfl_xor_sync(FULL, x, m); }

RTC_DEVICE uint64_t warp_sum_u64(uint64_t x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x += shfl_xor_u64(x, m);
  return x;
}

RTC_DEVICE uint32_t warp_sum_u32(uint32_t x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(FULL, x, m);
  return x;
}

// The CTA's slice in shared memory as float4 groups: thread t visits groups t, t + THREADS, ...
struct Slice {
  const float4* q;
  int quads;  // float4 groups (the tail past the valid elements holds zeros)
  int base;   // token of element 0

  template <class F>
  RTC_DEVICE void for_each(F&& f) const {
#pragma unroll 2
    for (int i = threadIdx.x; i < quads; i += THREADS) {
      const float4 x = q[i];
      f(i * 4 + 0, x.x);
      f(i * 4 + 1, x.y);
      f(i * 4 + 2, x.z);
      f(i * 4 + 3, x.w);
    }
  }
};

// pub.total = the slice's mass (sum of f over all its values); "joint" top-p refers to the row's.
RTC_DEVICE void publish_slice_mass(const Slice& s, float scale, Published& pub, Scratch& sc) {
  uint64_t mine = 0;
  s.for_each([&](int, float v) { mine += fixed_mass(v, scale); });
  mine = warp_sum_u64(mine);
  if (threadIdx.x % 32 == 0) sc.u[threadIdx.x / 32][0] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t t = 0;
    for (int i = 0; i < WARPS; ++i) t += sc.u[i][0];
    pub.total = t;
  }
}

// Cluster-wide sums of (count, mass) pairs over the values above pivots x[0], x[1]; each
// slice's masses are kept in sc.rank_mass (the next draw's slice masses above its new low).
RTC_DEVICE void pivot_stats(const Slice& s, float x1, float x2, float scale, Published& pub,
                            Scratch& sc, uint32_t c[2], uint64_t m[2]) {
  uint32_t c1 = 0, c2 = 0;
  uint64_t m1 = 0, m2 = 0;
  s.for_each([&](int, float v) {
    if (v > x1) {
      const uint64_t f = fixed_mass(v, scale);
      c1 += 1;
      m1 += f;
      if (v > x2) {
        c2 += 1;
        m2 += f;
      }
    }
  });
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  c1 = warp_sum_u32(c1), c2 = warp_sum_u32(c2), m1 = warp_sum_u64(m1), m2 = warp_sum_u64(m2);
  if (lane == 0) sc.c[w][0] = c1, sc.c[w][1] = c2, sc.u[w][0] = m1, sc.u[w][1] = m2;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t a = 0, b = 0;
    uint64_t x = 0, y = 0;
    for (int i = 0; i < WARPS; ++i)
      a += sc.c[i][0], b += sc.c[i][1], x += sc.u[i][0], y += sc.u[i][1];
    pub.count[0] = a, pub.count[1] = b, pub.pivot_mass[0] = x, pub.pivot_mass[1] = y;
  }
  cluster_sync();
  if (w == 0) {
    uint32_t a = 0, b = 0;
    uint64_t x = 0, y = 0;
    if (lane < CLUSTER) {
      a = load_remote_u32(remote(&pub.count[0], lane));
      b = load_remote_u32(remote(&pub.count[1], lane));
      x = load_remote_u64(remote(&pub.pivot_mass[0], lane));
      y = load_remote_u64(remote(&pub.pivot_mass[1], lane));
    }
    if (lane < CLUSTER) sc.rank_mass[0][lane] = x, sc.rank_mass[1][lane] = y;
    a = warp_sum_u32(a), b = warp_sum_u32(b), x = warp_sum_u64(x), y = warp_sum_u64(y);
    if (lane == 0) sc.out_c[0] = a, sc.out_c[1] = b, sc.out_u[0] = x, sc.out_u[1] = y;
  }
  __syncthreads();
  c[0] = sc.out_c[0], c[1] = sc.out_c[1], m[0] = sc.out_u[0], m[1] = sc.out_u[1];
}

// One draw among the values > low (order and target in the header). Returns the token (-1 when
// no value is above low); with `publish`, every thread also gets the token's value and the
// total mass T, else only the thread that found the token knows it (and writes out[]).
// `rank_mass`: every slice's mass above low when already known (from pivot_stats), which saves
// publishing them and one cluster barrier; null to compute them.
struct Drawn {
  bool any;  // some value lies above low (the same in every thread of the cluster)
  int token;
  float value;
  uint64_t total;
};

RTC_DEVICE Drawn draw(const Slice& s, float low, float scale, float u, bool publish,
                      const uint64_t* rank_mass, Published& pub, Scratch& sc, uint32_t rank,
                      OUT_T* out) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  uint64_t mine = 0;
  s.for_each([&](int, float v) {
    if (v > low) mine += fixed_mass(v, scale);
  });
  uint64_t incl = mine;  // inclusive warp scan
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const uint64_t y = __shfl_up_sync(FULL, incl, d);
    if (lane >= d) incl += y;
  }
  if (lane == 31) sc.u[w][0] = incl;
  __syncthreads();
  uint64_t before = incl - mine, cta = 0;
  for (int i = 0; i < WARPS; ++i) {
    const uint64_t x = sc.u[i][0];
    if (i < w) before += x;
    cta += x;
  }
  if (!rank_mass) {
    if (threadIdx.x == 0) pub.mass = cta;
    cluster_sync();  // (1) every slice's mass is published
  }
  if (w == 0) {
    uint64_t x = 0;
    if (lane < CLUSTER) x = rank_mass ? rank_mass[lane] : load_remote_u64(remote(&pub.mass, lane));
    uint64_t excl = x;  // inclusive scan, then exclusive
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const uint64_t y = __shfl_up_sync(FULL, excl, d);
      if (lane >= d) excl += y;
    }
    const uint64_t total = __shfl_sync(FULL, excl, 31);
    excl -= x;
    uint64_t target = __double2ull_rd(double(u) * double(total));
    if (total > 0 && target >= total) target = total - 1;
    const bool here = lane < CLUSTER && x > 0 && target >= excl && target - excl < x;
    const unsigned who = __ballot_sync(FULL, here);
    if (lane == 0) {
      sc.total = total;
      sc.rank = who ? __ffs(who) - 1 : -1;
      sc.offset = target;
    }
    if (lane == int(rank)) sc.u[0][1] = excl;  // this slice's offset
  }
  __syncthreads();
  const uint64_t total = sc.total, target = sc.offset;
  const int found_rank = sc.rank;
  int token = -1;
  float value = 0.f;
  if (found_rank == int(rank)) {
    const uint64_t start = sc.u[0][1] + before;
    if (target >= start && target - start < mine) {
      uint64_t acc = start;
      bool done = false;
      s.for_each([&](int i, float v) {
        if (done || !(v > low)) return;
        const uint64_t f = fixed_mass(v, scale);
        if (target - acc < f) {
          done = true;
          token = s.base + i;
          value = v;
        }
        acc += f;
      });
      if (publish) {
        pub.token = token;
        pub.value = value;
      } else {
        out[0] = OUT_T(token);
      }
    }
  }
  if (!publish || found_rank < 0) return {found_rank >= 0, token, value, total};
  cluster_sync();  // (2) the token is published by its slice
  token = int(load_remote_u32(remote(reinterpret_cast<uint32_t*>(&pub.token), found_rank)));
  value = load_remote_f32(remote(reinterpret_cast<uint32_t*>(&pub.value), found_rank));
  return {true, token, value, total};
}

// The k-th largest of the cluster's warp maxima when k <= CLUSTER * WARPS, else 0: at or below
// the k-th largest value (the k warps above it hold k values >= it), and usually about k values
// reach it.
RTC_DEVICE float warp_floor(uint32_t k, Published& pub, Scratch& sc) {
  constexpr int MAXIMA = CLUSTER * WARPS;
  if (k > uint32_t(MAXIMA)) return 0.f;
  const int t = threadIdx.x;
  if (t < MAXIMA) sc.warp_max[t] = load_remote_f32(remote(&pub.warp_max[t % WARPS], t / WARPS));
  __syncthreads();
  // Rank by value, ties by position (each rank is held by one maximum): warp w ranks maxima
  // w, w + WARPS, ..., its lanes splitting the comparisons.
  const int lane = t % 32;
  for (int i = t / 32; i < MAXIMA; i += WARPS) {
    const float x = sc.warp_max[i];
    uint32_t above = 0;
    for (int j = lane; j < MAXIMA; j += 32) {
      const float y = sc.warp_max[j];
      above += y > x || (y == x && j < i);
    }
    if (warp_sum_u32(above) == k - 1 && lane == 0) sc.floor = x;
  }
  __syncthreads();
  return sc.floor;
}

// The k-th largest value (1 <= k < count of values) of the cluster's row: radix select over the
// float bits, 8 bits a level, counting the values >= floor (at or below the answer) into a
// shared histogram merged over the cluster.
RTC_DEVICE float kth_largest(const Slice& s, uint32_t k, float floor, Published& pub,
                             Scratch& sc) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  uint32_t prefix = 0, greater = 0;
#pragma unroll 1
  for (int level = 0; level < 4; ++level) {
    const int shift = 24 - 8 * level;
    uint32_t* h = pub.hist[level & 1];
    for (int i = threadIdx.x; i < 256; i += THREADS) h[i] = 0;
    __syncthreads();
    s.for_each([&](int, float v) {
      const uint32_t key = __float_as_uint(v);
      if (v >= floor && (level == 0 || (key >> (shift + 8)) == prefix))
        atomicAdd(&h[(key >> shift) & 255u], 1u);
    });
    cluster_sync();  // every slice's histogram is complete
    // Thread t < 256 takes digit 255 - t: an inclusive scan over t is the count of values whose
    // digit is >= 255 - t. The digit is the largest d with greater + count(digit >= d) >= k.
    uint32_t cnt = 0;
    if (threadIdx.x < 256) {
#pragma unroll
      for (int r = 0; r < CLUSTER; ++r) cnt += load_remote_u32(remote(&h[255 - threadIdx.x], r));
    }
    uint32_t incl = cnt;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const uint32_t y = __shfl_up_sync(FULL, incl, d);
      if (lane >= d) incl += y;
    }
    if (lane == 31 && w < 8) sc.c[w][0] = incl;
    __syncthreads();
    if (threadIdx.x < 256) {
      for (int i = 0; i < w; ++i) incl += sc.c[i][0];
      const bool reach = greater + incl >= k, reach_before = greater + incl - cnt >= k;
      if (reach && !reach_before) {
        sc.digit = 255 - threadIdx.x;
        sc.greater = greater + incl - cnt;
      }
    }
    __syncthreads();
    prefix = (prefix << 8) | uint32_t(sc.digit);
    greater = sc.greater;
  }
  return __uint_as_float(prefix);
}

// Block-wide exclusive scan of one u64 per thread: (exclusive prefix, total).
RTC_DEVICE void block_scan_u64(uint64_t mine, Scratch& sc, uint64_t& excl, uint64_t& total) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  uint64_t incl = mine;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const uint64_t y = __shfl_up_sync(FULL, incl, d);
    if (lane >= d) incl += y;
  }
  __syncthreads();  // earlier readers of sc.u are done
  if (lane == 31) sc.u[w][0] = incl;
  __syncthreads();
  excl = incl - mine;
  total = 0;
  for (int i = 0; i < WARPS; ++i) {
    const uint64_t x = sc.u[i][0];
    if (i < w) excl += x;
    total += x;
  }
}

// Rank 0 finishes a row whose values >= floor (n <= THREADS of them, in pub.list_* in arrival
// order) hold the top-k set: the list in token order, the k-th largest value, then the draws
// and top-p rounds of the header on the list alone (every value above a pivot is on it), one
// entry per thread. `row_mass`: the whole row's mass for "joint", else 0.
RTC_DEVICE int finish_on_list(int n, uint32_t k, float top_p, bool rejecting, uint64_t row_mass,
                              float M, float scale, const Philox& rng, Published& pub,
                              Scratch& sc) {
  const int t = threadIdx.x, lane = t % 32, w = t / 32;
  // Warp w places entries w, w + WARPS, ...: its position in token order and whether it is the
  // k-th largest value (ties write the same value), the lanes splitting the comparisons.
  for (int i = w; i < n; i += WARPS) {
    const float v = pub.list_v[i];
    const int id = pub.list_t[i];
    uint32_t pos = 0, above = 0, at_least = 0;
    for (int j = lane; j < n; j += 32) {
      const float y = pub.list_v[j];
      pos += pub.list_t[j] < id;
      above += y > v;
      at_least += y >= v;
    }
    pos = warp_sum_u32(pos), above = warp_sum_u32(above), at_least = warp_sum_u32(at_least);
    if (lane == 0) {
      sc.sorted_v[pos] = v;
      sc.sorted_t[pos] = id;
      if (above < k && k <= at_least) sc.floor = v;
    }
  }
  __syncthreads();
  float low = below(sc.floor), high = M;
  const float x = t < n ? sc.sorted_v[t] : 0.f;
  const int id = t < n ? sc.sorted_t[t] : 0;
  const uint64_t f = t < n ? fixed_mass(x, scale) : 0ull;
  uint64_t P = 0;
#pragma unroll 1
  for (int round = 0; round < MAX_ROUNDS; ++round) {
    uint64_t excl, total;
    const uint64_t mine = x > low ? f : 0ull;
    block_scan_u64(mine, sc, excl, total);
    if (total == 0) break;
    uint64_t target = __double2ull_rd(double(rng.uniform(round)) * double(total));
    if (target >= total) target = total - 1;
    if (mine > 0 && target >= excl && target - excl < mine) sc.token = id, sc.value = x;
    __syncthreads();
    const int token = sc.token;
    const float x1 = sc.value, x2 = __fmul_rn(__fadd_rn(x1, high), 0.5f);
    if (!rejecting) return token;
    if (round == 0) P = __double2ull_rn(double(top_p) * double(row_mass ? row_mass : total));
    uint32_t c1 = t < n && x > x1, c2 = t < n && x > x2;
    uint64_t m1 = c1 ? f : 0ull, m2 = c2 ? f : 0ull;
    c1 = warp_sum_u32(c1), c2 = warp_sum_u32(c2), m1 = warp_sum_u64(m1), m2 = warp_sum_u64(m2);
    if (lane == 0) sc.c[w][0] = c1, sc.c[w][1] = c2, sc.u[w][0] = m1, sc.u[w][1] = m2;
    __syncthreads();
    c1 = c2 = 0, m1 = m2 = 0;
    for (int i = 0; i < WARPS; ++i)
      c1 += sc.c[i][0], c2 += sc.c[i][1], m1 += sc.u[i][0], m2 += sc.u[i][1];
    if (c1 == 0 || m1 < P) return token;
    if (c2 == 0 || m2 < P) {
      low = x1;
      high = x2;
    } else {
      low = x2;
    }
  }
  int first = t < n && x == M ? id : 0x7fffffff;  // out of rounds: the first maximum
  for (int m = 16; m > 0; m >>= 1) first = min(first, __shfl_xor_sync(FULL, first, m));
  __syncthreads();
  if (lane == 0) sc.c[w][1] = uint32_t(first);
  __syncthreads();
  for (int i = 0; i < WARPS; ++i) first = min(first, int(sc.c[i][1]));
  return first == 0x7fffffff ? 0 : first;
}
