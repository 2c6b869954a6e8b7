// One CTA per vocabulary row: how a row is read, and the candidate list in shared memory.
//
// A row of n values is cut into WARPS segments of `seg` consecutive elements (a multiple of the
// vector width); warp w owns segment w and reads it in steps of 32 lanes x VEC elements, so
// warp-level passes need no block barrier and block-level sums add the segments in order.
//
// Pass 0 (scan_row) streams the row once: sum, maximum, and the maximum of every block of
// `group` steps (one __reduce_max_sync per step), at most BLOCKS_W blocks per warp. From the
// block maxima comes a "floor" at or below every kept value: the k-th largest block maximum
// (<= the k-th largest value), min-p's exact threshold, or for top-p the top-p cut of the block
// maxima, which holds once the values >= it are found to carry mass >= P (every value below
// then has mass >= P above it). `gather` re-reads only the blocks whose maximum reaches the
// floor and copies their values >= floor, with token ids, into the warp's region of CAP_W
// slots, in token order: the candidate list holds exactly the row's values >= floor, and the
// selection continues in shared memory. A region that overflows sends the row back to
// streaming passes (from L2).
//
// Prelude: THREADS, CAP (list slots of the block). Dynamic shared memory (list_memory): CAP
// values, CAP token ids, WARPS * BLOCKS_W block maxima (rtcinfer.layout.row_smem_bytes).
#pragma once

constexpr int WARPS = THREADS / 32;
constexpr int CAP_W = CAP / WARPS;  // list slots per warp
constexpr int BLOCKS_W = 256;       // block maxima per warp
constexpr unsigned FULL = 0xffffffffu;
constexpr int NONE = 0x7fffffff;  // "no position" in block-wide minima
static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps");
static_assert(CAP % WARPS == 0 && CAP_W % 4 == 0 && CAP_W >= 64, "regions of float4 groups");

// Where the list and the block maxima live in dynamic shared memory.
struct ListMemory {
  float* vals;  // [CAP]
  int* ids;     // [CAP]
  float* bmax;  // [WARPS * BLOCKS_W]
};

RTC_DEVICE ListMemory list_memory(void* smem) {
  float* vals = static_cast<float*>(smem);
  int* ids = reinterpret_cast<int*>(vals + CAP);
  return {vals, ids, reinterpret_cast<float*>(ids + CAP)};
}

RTC_DEVICE int lane_id() { return threadIdx.x % 32; }
RTC_DEVICE int warp_id() { return threadIdx.x / 32; }
RTC_DEVICE float infinity() { return __int_as_float(0x7f800000); }

// Probabilities: valid values are > 0. NaN and negatives read as 0 (never drawn).
struct ProbPolicy {
  static constexpr bool MASS = true;
  RTC_DEVICE static float lowest() { return 0.f; }
  RTC_DEVICE static float clean(float v) { return v > 0.f ? v : 0.f; }  // -0 -> +0 too
  RTC_DEVICE static bool bad(float v) { return !(v >= 0.f && v < infinity()); }
  // Order-preserving for cleaned values; the sign bit is dropped so that a -0 (which max()
  // may return for a row of zeros) cannot outrank positive values.
  RTC_DEVICE static uint32_t key(float v) { return __float_as_uint(v) & 0x7fffffffu; }
  RTC_DEVICE static float from_key(uint32_t k) { return __uint_as_float(k); }
};

// Logits: valid values are > -inf. NaN reads as -inf.
struct LogitPolicy {
  static constexpr bool MASS = false;
  RTC_DEVICE static float lowest() { return -infinity(); }
  RTC_DEVICE static float clean(float v) { return isnan(v) ? -infinity() : v; }
  RTC_DEVICE static bool bad(float v) { return isnan(v) || v == infinity(); }
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
  float seg_max[WARPS];  // pass-0 maximum of each segment
  float scan[WARPS + 1];
  uint32_t hist_cnt[256];
  uint32_t hist_lo[256], hist_hi[256];  // fixed-point masses as two words (add_mass)
  float f[4];
  int i[4];
  unsigned long long u[2];
  uint32_t kept_lo, kept_hi;  // a fixed-point mass as two words (add_mass)
  int hit, last, first;
};

// Adds the fixed-point mass m to the 64-bit sum held in the words *lo, *hi. A 64-bit atomic
// add on shared memory compiles to a compare-and-swap spin (sm_80, sm_90), which the few hot
// bins of a histogram turn into long waits; these are two native 32-bit adds, the low word's
// returning its old value so that exactly the add that wraps it carries into the high word.
// The sum is exact and independent of the order of the adds.
RTC_DEVICE void add_mass(uint32_t* lo, uint32_t* hi, unsigned long long m) {
  const uint32_t a = uint32_t(m), old = atomicAdd(lo, a);
  const uint32_t up = uint32_t(m >> 32) + (old + a < old ? 1u : 0u);
  if (up) atomicAdd(hi, up);
}

RTC_DEVICE unsigned long long words(uint32_t lo, uint32_t hi) {
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

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

template <int V>
struct LoadUnroll {
  static constexpr int U = V >= 4 ? 16 / V : 4;  // vectors each lane loads before using them
};

// Row geometry of the warp-level passes: steps of 32 * V elements per segment, grouped into at
// most BLOCKS_W blocks of `group` steps.
struct Steps {
  int steps, group, blocks;

  RTC_DEVICE Steps(int seg, int v) {
    steps = (seg + 32 * v - 1) / (32 * v);
    group = (steps + BLOCKS_W - 1) / BLOCKS_W;
    group = group > 0 ? group : 1;
    blocks = (steps + group - 1) / group;
  }
};

// Block maxima as a source (for the radix select of the floor): segment s = warp s's blocks.
template <class P>
struct BlockMaxSource {
  using Policy = P;
  static constexpr int VEC = 1;
  const float* bmax;  // [WARPS * BLOCKS_W]
  int blocks;

  RTC_DEVICE int size(int) const { return blocks; }
  RTC_DEVICE int token(int s, int pos) const { return s * BLOCKS_W + pos; }
  RTC_DEVICE void load(int s, int pos, float (&v)[1]) const {
    v[0] = pos < blocks ? bmax[s * BLOCKS_W + pos] : P::lowest();
  }
  RTC_DEVICE float value(int s, int pos) const { return bmax[s * BLOCKS_W + pos]; }
};

struct RowScan {
  float sum, max;  // of the cleaned values of the warp's segment (sum: probabilities only)
  bool bad;        // NaN / negative / inf seen (only when asked)
};

// Pass 0: warp w streams segment w once; bmax[w * BLOCKS_W + b] = maximum of block b.
template <class Src>
RTC_DEVICE RowScan scan_row(const Src& src, const Steps& g, float* bmax, bool check) {
  using P = typename Src::Policy;
  constexpr int V = Src::VEC, STEP = 32 * V, U = LoadUnroll<V>::U;
  const int lane = lane_id(), w = warp_id();
  float* wb = bmax + w * BLOCKS_W;
  float sum = 0.f, m_lane = P::lowest();
  uint32_t block_key = P::key(P::lowest());
  int blk = 0, left = g.group;  // current block, its steps still to come
  bool bad = false;
  for (int s0 = 0; s0 < g.steps; s0 += U) {  // U steps per iteration
    float v[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) src.load(w, (s0 + u) * STEP + lane * V, v[u]);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u;
      if (s >= g.steps) break;
      float vmax = P::lowest();
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (check) bad |= P::bad(v[u][j]);
        const float c = P::clean(v[u][j]);
        vmax = fmaxf(vmax, c);
        if constexpr (P::MASS) sum += c;
      }
      m_lane = fmaxf(m_lane, vmax);
      block_key = max(block_key, __reduce_max_sync(FULL, P::key(vmax)));
      if (--left == 0 || s + 1 == g.steps) {
        if (lane == 0) wb[blk] = P::from_key(block_key);
        ++blk;
        left = g.group;
        block_key = P::key(P::lowest());
      }
    }
  }
  return {warp_sum(sum), warp_max(m_lane), __any_sync(FULL, bad) != 0};
}

// Copies the valid values >= floor of the blocks whose maximum reaches floor into warp w's
// region, in token order. Returns their count and sets `mass` to their sum; -1 when the region
// overflows (then the row must be streamed instead).
template <class Src>
RTC_DEVICE int gather(const Src& src, const Steps& g, const float* bmax, float floor,
                      const ListMemory& mem, float& mass) {
  using P = typename Src::Policy;
  constexpr int V = Src::VEC, STEP = 32 * V;
  const int lane = lane_id(), w = warp_id();
  const float* wb = bmax + w * BLOCKS_W;
  float* rv = mem.vals + w * CAP_W;
  int* ri = mem.ids + w * CAP_W;
  int n = 0;
  float part = 0.f;
  for (int blk = 0; blk < g.blocks; ++blk) {
    const float bm = wb[blk];
    if (!(bm >= floor && bm > P::lowest())) continue;
    const int last = min(g.steps, (blk + 1) * g.group);
    for (int s = blk * g.group; s < last; ++s) {
      const int pos = s * STEP + lane * V;
      float v[V];
      src.load(w, pos, v);
      int cnt = 0;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        v[j] = P::clean(v[j]);
        cnt += v[j] >= floor && v[j] > P::lowest();
      }
      const int excl = warp_exclusive_sum(cnt), total = __shfl_sync(FULL, excl + cnt, 31);
      if (n + total > CAP_W) {
        mass = 0.f;
        return -1;
      }
      int k = n + excl;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (v[j] >= floor && v[j] > P::lowest()) {
          rv[k] = v[j];
          ri[k] = src.token(w, pos + j);
          part += v[j];
          ++k;
        }
      }
      n += total;
    }
  }
  mass = warp_sum(part);
  return n;
}

// The block's candidate list: every warp gathers its values >= floor (gather above) and posts
// its count and mass to sh.list_n / sh.seg[1]. Returns whether every warp's region held its
// values (the list is the whole row above the floor) and sets `list_mass` to their sum.
// Contains a barrier.
template <class Src>
RTC_DEVICE bool gather_list(const Src& src, const Steps& g, const float* bmax, float floor,
                            const ListMemory& mem, RowShared& sh, float& list_mass) {
  float mass;
  const int n = gather(src, g, bmax, floor, mem, mass);
  if (lane_id() == 0) {
    sh.list_n[warp_id()] = n;
    sh.seg[1][warp_id()] = mass;  // slot 1: segment masses of the list
  }
  __syncthreads();
  bool complete = true;
  list_mass = 0.f;
#pragma unroll 1
  for (int i = 0; i < WARPS; ++i) {
    complete &= sh.list_n[i] >= 0;
    list_mass += sh.seg[1][i];
  }
  return complete;
}
