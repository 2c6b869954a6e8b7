// Sorting-free sampling from probabilities, one CTA per output row (token ~ p restricted to the
// kept set, renormalized; values <= 0 or NaN are never drawn):
//   plain        kept = all
//   top_k        kept = {j : #{i : p_i > p_j} < k}            (ties with the k-th value stay)
//   top_p        kept = {j : sum(p_i > p_j) < top_p * sum(p)} (the maximum always stays)
//   min_p        kept = {j : p_j >= min(min_p, 1) * max(p)}
//   top_k_top_p  kept_k and kept_p (FlashInfer's "joint")
//   top_k_first  top_p applied to the top-k renormalized distribution
// Dual-pivot rejection sampling (FlashInfer's blog, 2025): low lies below every kept value and
// high = max(p) is kept. Each round draws j among the values > low by inverse transform, then
// counts values and mass above pivot1 = p_j and pivot2 = (p_j + high) / 2 in one pass:
//   pivot1 kept -> return j;  pivot2 kept -> low = pivot1, high = pivot2;  else low = pivot2.
// Each round at least halves high - low; after MAX_ROUNDS the first maximum (always kept) is
// returned. top_k_first first finds the exact k-th value by radix select (no rejection needed
// for the top-k part); min_p's threshold is exact, so it draws once.
// Pass 0 streams the row once (sum, maximum, block maxima); a floor at or below every kept value
// comes from the block maxima, and when the values >= floor fit the candidate list
// (row_scan.cuh) the rounds run in shared memory, else they stream the row again (from L2).
// A top-p floor that the list's mass does not prove (mass < P) still helps: every value on the
// list is then kept, so round 0 draws with the list first (sample_from_part) and streams the
// row only when the draw falls below the floor.
// Grid: blockIdx.x = output row b, reading probability row indices[b] (or b). Block: THREADS.
// Shared memory: list_memory (dynamic, 96 bytes per thread) + RowShared.
// Prelude: OP (SampleOp), T, OUT_T, VEC, THREADS, CAP.
#include "philox.cuh"
#include "row_select.cuh"
#include "sample_common.cuh"

static_assert(VEC * sizeof(T) <= 16, "one 16-byte load per vector");

struct Filter {
  bool use_k, use_p, use_min_p;
  int k;
  float top_p, P;  // P = top_p * (mass the fraction refers to)
  float t;         // min-p threshold
  // Whether the values above a pivot keep it: count and mass of the values above it.
  RTC_DEVICE bool kept(int count_above, float mass_above) const {
    return (!use_k || count_above < k) && (!use_p || count_above == 0 || mass_above < P);
  }
};

// radix_select<Src, false, true> (the k-th largest value > low and the mass of the values
// >= it) on a candidate list of at most THREADS entries, by counting: entry i (thread i) is
// the k-th when fewer than k entries exceed it and at least k reach it. The same Threshold, a
// few block barriers instead of four histogram levels. False (nothing done) for a longer list
// or a streamed row.
template <class Src>
RTC_DEVICE bool small_list_kth(const Src&, float, int, double, RowShared&, Threshold&) {
  return false;
}

RTC_DEVICE bool small_list_kth(const ListSource<ProbPolicy>& list, float low, int k,
                               double scale, RowShared& sh, Threshold& th) {
  int n = 0;
  for (int s = 0; s < WARPS; ++s) n += sh.list_n[s];
  if (n > THREADS) return false;
  __syncthreads();  // earlier readers of sh.i are done
  if (threadIdx.x == 0) sh.i[0] = -1, sh.kept_lo = sh.kept_hi = 0u;
  int s = 0, pos = threadIdx.x;  // this thread's entry: region s, position pos
  while (s < WARPS && pos >= sh.list_n[s]) pos -= sh.list_n[s++];
  const float v = threadIdx.x < n ? list.value(s, pos) : 0.f;
  const bool mine = threadIdx.x < n && v > low;
  int above = 0, at_least = 0;
  for (int r = 0; r < WARPS; ++r) {
    for (int j = 0; j < sh.list_n[r]; ++j) {
      const float y = list.value(r, j);
      above += y > low && y > v;
      at_least += y > low && y >= v;
    }
  }
  __syncthreads();
  if (mine && above < k && k <= at_least) sh.i[0] = int(__float_as_uint(v));  // ties: same key
  __syncthreads();
  const int key = sh.i[0];
  th.all = key == -1;  // fewer than k values above low
  th.key = uint32_t(key);
  const bool kept = mine && !th.all && v >= __uint_as_float(th.key);
  unsigned long long m = kept ? fixed_mass(v, scale) : 0ull;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m += __shfl_xor_sync(FULL, m, o);
  if (lane_id() == 0 && m) add_mass(&sh.kept_lo, &sh.kept_hi, m);
  __syncthreads();
  th.kept = words(sh.kept_lo, sh.kept_hi);
  __syncthreads();
  return true;
}

// The token of output row b, drawn from `src` (all kept values lie above `low`; sh.seg[cur]
// holds the segment masses above low). The filter and the generator live in shared memory, so
// the rounds keep few registers. `round0`, when its token is not NOT_DRAWN, is round 0's draw,
// made by the caller.
constexpr int NOT_DRAWN = -2;

template <class Src>
RTC_DEVICE int select_token(const Src& src, float low, int cur, Filter& f, float M,
                            const Philox& rng, RowShared& sh, Drawn round0 = {NOT_DRAWN, 0.f}) {
  if constexpr (OP == SampleOp::MIN_P) {
    if (f.use_min_p && below(f.t) > low) {  // streaming: restrict to values >= t
      low = below(f.t);
      cur = (cur + 1) % 3;
      pivot_stats(src, low, low, sh, cur, cur);
    }
  }
  if constexpr (OP == SampleOp::TOP_K_FIRST) {
    if (f.use_k && M > 0.f) {
      const double scale = 1099511627776.0 / double(M);  // 2^40 / max: fixed-point masses
      Threshold th;
      if (!small_list_kth(src, low, f.k, scale, sh, th))
        th = radix_select<Src, false, true>(src, low, f.k, 0ull, scale, sh);
      if (!th.all) {
        low = below(__uint_as_float(th.key));
        if (threadIdx.x == 0) f.P = f.top_p * float(double(th.kept) / scale);
        cur = (cur + 1) % 3;
        pivot_stats(src, low, low, sh, cur, cur);  // its barriers publish f.P
      }
    }
  }
  const bool rejecting = (f.use_k && OP != SampleOp::TOP_K_FIRST) || f.use_p;
  float high = M;
  for (int round = 0; round < MAX_ROUNDS; ++round) {
    const Drawn d = round == 0 && round0.token != NOT_DRAWN
                        ? round0
                        : draw(src, low, sh.seg[cur], rng.uniform(round), sh);
    if (d.token < 0) break;  // no value above low: an empty row
    if (!rejecting) return d.token;
    const int s1 = (cur + 1) % 3, s2 = (cur + 2) % 3;
    const float x1 = d.value, x2 = __fmul_rn(__fadd_rn(d.value, high), 0.5f);
    const PivotStats st = pivot_stats(src, x1, x2, sh, s1, s2);
    if (f.kept(st.c1, st.m1)) return d.token;  // (top_k_first: f.use_k is cleared by then)
    if (f.kept(st.c2, st.m2)) {
      low = x1;
      high = x2;
      cur = s1;
    } else {
      low = x2;
      cur = s2;
    }
  }
  if (!(M > 0.f)) return 0;
  const int first = first_index_of(src, M, sh);
  return first == NONE ? 0 : first;
}

// Top-p with a list of every value >= floor whose mass L is below P (the floor is not proved).
// Each listed value has less than L < P above it, so all of them are kept. Round 0 draws among
// all the values with the list first: target u * S (S = the row's mass, sh.f[2]); below L it
// lands on a listed token, accepted at once; else it lands on a value below the floor (target
// u * S - L, the row's segment masses less the list's), and the rounds go on over the row. Each
// round still draws in proportion to p among the values above its `low`, so the token follows
// the kept distribution exactly; only round 0's map from u to tokens differs from token order.
template <class Rows>
RTC_DEVICE int sample_from_part(const Rows& rows, const ListSource<ProbPolicy>& list,
                                float floor, Filter& f, float M, const Philox& rng,
                                RowShared& sh) {
  const float S = sh.f[2];
  float L = 0.f;
#pragma unroll 1
  for (int s = 0; s < WARPS; ++s) L += sh.seg[1][s];
  const float target = rng.uniform(0) * S;
  if (target < L) return max(draw_at(list, below(floor), sh.seg[1], target, sh).token, 0);
  const int t = threadIdx.x;
  if (t < WARPS) sh.seg[2][t] = fmaxf(sh.seg[0][t] - sh.seg[1][t], 0.f);  // below the floor
  __syncthreads();
  const Drawn d = draw_at<Rows, true>(rows, 0.f, sh.seg[2], target - L, sh, floor);
  return select_token(rows, 0.f, 0, f, M, rng, sh, d);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1024 / THREADS)
    sample_kernel(const __grid_constant__ SampleParams p) {  // sample_common.cuh
  wait_for_previous_grid();
  const T* __restrict__ probs = p.probs;
  const OUT_T* __restrict__ indices = p.indices;
  OUT_T* __restrict__ out = p.out;
  int* __restrict__ error_flag = p.error_flag;
  const int64_t row_stride = p.row_stride;
  const int vocab = p.vocab;
  extern __shared__ float4 smem[];
  __shared__ RowShared sh;
  __shared__ Filter f;
  __shared__ Philox rng;
  const ListMemory mem = list_memory(smem);
  const int b = blockIdx.x, lane = lane_id(), w = warp_id();
  const int64_t row = indices ? int64_t(indices[b]) : int64_t(b);
  if (!row_in_range(p, b, row, true)) return;  // the whole block: row is uniform
  const int seg = (vocab / VEC + WARPS - 1) / WARPS * VEC;
  const Steps g(seg, VEC);
  const RowSource<T, VEC, ProbPolicy> rows{probs + row * row_stride, vocab, seg};

  const RowScan scan = scan_row(rows, g, mem.bmax, error_flag != nullptr);
  if (lane == 0) {
    sh.seg_max[w] = scan.max;
    sh.seg[0][w] = scan.sum;  // slot 0: segment masses above 0 (streaming rounds start here)
    if (scan.bad) *error_flag = 1;
  }
  __syncthreads();
  if (w == 0) {
    const float m = warp_max(lane < WARPS ? sh.seg_max[lane] : 0.f);
    if (lane == 0) {
      float s = 0.f;
#pragma unroll 1
      for (int i = 0; i < WARPS; ++i) s += sh.seg[0][i];
      sh.f[0] = m;
      sh.f[2] = s;  // the row's mass (sample_from_part; f[0..1] serve the rounds)
      Filter filter{};
      if constexpr (HAS_K) {
        const long long k = row_top_k(p.top_k_arr, p.top_k_arr64, p.top_k_val, b);
        filter.use_k = k > 0 && k < vocab;
        filter.k = filter.use_k ? int(k) : vocab;
      }
      if constexpr (HAS_P) {
        filter.top_p = row_param(p.top_p_arr, p.top_p_val, b);
        filter.use_p = filter.top_p < 1.f;
        filter.P = filter.top_p * s;
      }
      if constexpr (OP == SampleOp::MIN_P) {
        const float min_p = row_param(p.min_p_arr, p.min_p_val, b);
        filter.use_min_p = min_p > 0.f;
        filter.t = fminf(min_p, 1.f) * m;
      }
      f = filter;
      rng = make_philox(p.seed_arr, p.seed_val, p.seed_len, p.offset_arr, p.offset_val,
                        p.offset_len, b);
    }
  }
  __syncthreads();
  const float M = sh.f[0];

  // The floor: at or below every kept value, chosen from the block maxima (row_scan.cuh). For
  // top-k (and min-p) it is exact; a top-p floor is proved by the mass of the values >= it.
  float floor = 0.f;
  bool need_mass = false;
  const BlockMaxSource<ProbPolicy> blocks{mem.bmax, g.blocks};
  if constexpr (OP == SampleOp::MIN_P) floor = f.use_min_p ? f.t : 0.f;
  if (HAS_K && f.use_k) {
    const Threshold th = radix_select<BlockMaxSource<ProbPolicy>, false, false>(
        blocks, 0.f, f.k, 0ull, 0.0, sh);
    if (!th.all) floor = __uint_as_float(th.key);  // the k-th largest block maximum
  } else if (HAS_P && f.use_p && M > 0.f) {
    const double scale = 1099511627776.0 / double(M);  // 2^40 / max: fixed-point masses
    const unsigned long long p_fixed = __double2ull_rn(double(fmaxf(f.P, 0.f)) * scale);
    float smallest;  // the top-p cut of the block maxima alone
    if (light_block_maxima(blocks, scale, p_fixed, sh, smallest)) {
      floor = smallest;
    } else {
      const Threshold th = radix_select<BlockMaxSource<ProbPolicy>, true, true>(
          blocks, 0.f, 0, p_fixed, scale, sh);
      if (!th.all) floor = __uint_as_float(th.key);
    }
    need_mass = true;
  }
  bool on_list = false, part = false;
  if (OP != SampleOp::PLAIN && (floor > 0.f || vocab <= CAP)) {
    float list_mass;
    on_list = gather_list(rows, g, mem.bmax, floor, mem, sh, list_mass);
    // mass(p >= floor) >= P: every value below the floor has at least P above it
    if (need_mass && !(list_mass >= f.P)) {
      part = on_list;
      on_list = false;
    }
  }
  const ListSource<ProbPolicy> list{mem.vals, mem.ids, sh.list_n};
  const int token = on_list ? select_token(list, below(floor), 1, f, M, rng, sh)
                    : part  ? sample_from_part(rows, list, floor, f, M, rng, sh)
                            : select_token(rows, 0.f, 0, f, M, rng, sh);
  if (threadIdx.x == 0) out[b] = OUT_T(token);
}

// Raw Philox4x32-10 words for tests: out[i] = philox(counters[i], key (k0, k1)).
struct PhiloxParams {
  const uint4* counters;  // [n]
  uint4* out;             // [n]
  int n;
  uint32_t k0, k1;
};

extern "C" __global__ void philox_kernel(const __grid_constant__ PhiloxParams p) {
  wait_for_previous_grid();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.n) return;
  const uint4 c = p.counters[i];
  const Philox4 r = philox4x32_10(Philox4{c.x, c.y, c.z, c.w}, p.k0, p.k1);
  p.out[i] = make_uint4(r.x, r.y, r.z, r.w);
}
