// Exact threshold ops, one CTA per row (ties with the threshold are kept, as in FlashInfer):
//   top_k_renorm  out = p >= v ? p / sum(p >= v) : 0,  v = the k-th largest p
//   top_p_renorm  out = p >= v ? p / sum(p >= v) : 0,  v = min{p_j : sum(p > p_j) < top_p sum(p)}
//                 (the maximum is always kept)
//   top_k_mask    out = x >= v ? x : -inf,             v = the k-th largest logit (NaN -> -inf)
//   top_k_select  the k largest values of the row and their indices (FlashInfer's top_k): every
//                 x > v, then the ties x == v of the smallest indices (ties_last: the largest),
//                 k in all, each group in index order (NaN counts as -inf); values_out,
//                 indices_out [rows, k]
// Pass 0 streams the row once (sum, maximum, block maxima); a floor at or below the threshold
// comes from the block maxima, the values >= floor go to the candidate list (row_scan.cuh), the
// exact threshold is a radix select (row_select.cuh) over the list (over the row when the list
// overflows), and a last pass writes the output. The renormalizing sum is the select's fixed-point mass
// (p * 2^40 / max p, integer sums): deterministic, within 2^-24 relative of the exact sum.
// Grid: blockIdx.x = row. Block: THREADS. Shared: list_memory (dynamic) + RowShared.
// Prelude: OP (RenormOp), T, VEC, THREADS, CAP.
#include "row_select.cuh"

constexpr bool SELECT = OP == RenormOp::TOP_K_SELECT;
using Policy = Conditional<OP == RenormOp::TOP_K_MASK || SELECT, LogitPolicy, ProbPolicy>;
constexpr bool BY_MASS = OP == RenormOp::TOP_P_RENORM;
constexpr bool NEED_MASS = OP == RenormOp::TOP_K_RENORM || OP == RenormOp::TOP_P_RENORM;
static_assert(VEC * sizeof(T) <= 16, "one 16-byte load per vector");

// A per-row parameter is its array when given (null otherwise), else its scalar.
struct RenormParams {
  const T* input;              // [rows, vocab], rows `in_stride` elements apart
  T* out;                      // [rows, vocab], rows `out_stride` elements apart
  const int32_t* top_k_arr;    // [rows] or null
  const int64_t* top_k_arr64;  // [rows] or null
  const float* top_p_arr;      // [rows] or null
  T* values_out;               // top_k_select: [rows, top_k_val]; else unused
  int64_t* indices_out;        // top_k_select: [rows, top_k_val] (or indices32_out); else unused
  int32_t* indices32_out;      // top_k_select: int32 indices instead (JAX without x64)
  int64_t in_stride, out_stride;
  int vocab, top_k_val;
  int ties_last;               // top_k_select: take the ties of the largest indices
  float top_p_val;
};

// Exclusive block scan of one u64 a thread: (this thread's prefix, the block's total). Ends
// with a barrier, so the next call may reuse `warps`.
RTC_DEVICE void block_scan(unsigned long long mine, unsigned long long (&warps)[WARPS],
                           unsigned long long& excl, unsigned long long& total) {
  const int lane = lane_id(), w = warp_id();
  unsigned long long incl = mine;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned long long up = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += up;
  }
  if (lane == 31) warps[w] = incl;
  __syncthreads();
  unsigned long long before = 0;
  total = 0;
#pragma unroll 1
  for (int i = 0; i < WARPS; ++i) {
    if (i < w) before += warps[i];
    total += warps[i];
  }
  excl = before + incl - mine;
  __syncthreads();
}

// Index `value` at `slot` of whichever index output is given.
RTC_DEVICE void put_index(int64_t* indices, int32_t* indices32, unsigned int slot, int value) {
  if (indices32 != nullptr) {
    indices32[slot] = value;
  } else {
    indices[slot] = value;
  }
}

// top_k_select's output: the k largest values of x_row (v: the k-th largest, NaN as -inf), the
// G values > v then k - G of the E ties, those of the smallest indices (ties_last: the
// largest), each group in index order. Pass 1 counts G and E; pass 2 takes the row a block at
// a time, a scan placing each thread's (greater, tie) values, and stops once both groups are
// full.
RTC_DEVICE void select_top_k(const T* x_row, int vocab, int k, float v, bool ties_last,
                             T* values, int64_t* indices, int32_t* indices32) {
  __shared__ unsigned long long warps[WARPS];
  unsigned long long mine = 0;  // (greater << 32) | ties
  for (int i = int(threadIdx.x) * VEC; i < vocab; i += THREADS * VEC) {
    Vec<T, VEC> x;
    x.load(x_row + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float a = LogitPolicy::clean(to_float(x[j]));
      mine += (static_cast<unsigned long long>(a > v) << 32) | (a == v);
    }
  }
  unsigned long long excl, total;
  block_scan(mine, warps, excl, total);
  const unsigned int greater = unsigned(total >> 32), ties = unsigned(k) - greater;
  const unsigned int skip = ties_last ? unsigned(total) - ties : 0;  // ties passed over first
  unsigned int g_base = 0, t_base = 0;  // seen so far (the same in every thread)
  for (int c = 0; c < vocab && (g_base < greater || t_base < skip + ties); c += THREADS * VEC) {
    const int i = c + int(threadIdx.x) * VEC;
    Vec<T, VEC> x;
    unsigned int gt = 0, eq = 0;
    if (i < vocab) {
      x.load(x_row + i);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float a = LogitPolicy::clean(to_float(x[j]));
        gt += a > v;
        eq += a == v;
      }
    }
    block_scan((static_cast<unsigned long long>(gt) << 32) | eq, warps, excl, total);
    unsigned int g_at = g_base + unsigned(excl >> 32), t_at = t_base + unsigned(excl);
    if (i < vocab) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float a = LogitPolicy::clean(to_float(x[j]));
        if (a > v) {
          values[g_at] = x[j];
          put_index(indices, indices32, g_at++, i + j);
        } else if (a == v) {
          if (t_at >= skip && t_at < skip + ties) {
            values[greater + t_at - skip] = x[j];
            put_index(indices, indices32, greater + t_at - skip, i + j);
          }
          ++t_at;
        }
      }
    }
    g_base += unsigned(total >> 32);
    t_base += unsigned(total);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1024 / THREADS)
    renorm_kernel(const __grid_constant__ RenormParams p) {
  wait_for_previous_grid();
  const T* __restrict__ in = p.input;
  T* __restrict__ out = p.out;
  const int32_t* __restrict__ top_k_arr = p.top_k_arr;
  const int64_t* __restrict__ top_k_arr64 = p.top_k_arr64;
  const float* __restrict__ top_p_arr = p.top_p_arr;
  const int64_t in_stride = p.in_stride, out_stride = p.out_stride;
  const int vocab = p.vocab, top_k_val = p.top_k_val;
  const float top_p_val = p.top_p_val;
  extern __shared__ float4 smem[];
  __shared__ RowShared sh;
  const ListMemory mem = list_memory(smem);
  const int r = blockIdx.x, lane = lane_id(), w = warp_id();
  const int seg = (vocab / VEC + WARPS - 1) / WARPS * VEC;
  const Steps g(seg, VEC);
  const RowSource<T, VEC, Policy> rows{in + r * in_stride, vocab, seg};

  const RowScan scan = scan_row(rows, g, mem.bmax, false);
  if (lane == 0) {
    sh.seg_max[w] = scan.max;
    sh.seg[0][w] = scan.sum;
  }
  __syncthreads();
  if (w == 0) {
    const float m = warp_max(lane < WARPS ? sh.seg_max[lane] : Policy::lowest());
    if (lane == 0) {
      float s = 0.f;
#pragma unroll 1
      for (int i = 0; i < WARPS; ++i) s += sh.seg[0][i];
      sh.f[0] = m;
      sh.f[2] = s;
    }
  }
  __syncthreads();
  const float M = sh.f[0], S = sh.f[2];

  int k = 0;
  float top_p = 1.f;
  bool keep_all;
  if constexpr (BY_MASS) {
    top_p = top_p_arr ? top_p_arr[r] : top_p_val;
    keep_all = !(top_p < 1.f) || !(M > 0.f);
  } else {
    const long long kk = top_k_arr ? top_k_arr[r] : top_k_arr64 ? top_k_arr64[r] : top_k_val;
    keep_all = kk <= 0 || kk >= vocab;
    k = keep_all ? vocab : int(kk);
  }
  const double scale = NEED_MASS && M > 0.f ? 1099511627776.0 / double(M) : 0.0;  // 2^40 / max
  Threshold th{0u, 0ull, true};
  if (!keep_all) {
    const unsigned long long p_fixed = __double2ull_rn(double(fmaxf(top_p, 0.f) * S) * scale);
    // The floor: at or below the threshold, chosen from the block maxima (row_scan.cuh); a
    // top-p floor is proved by the mass of the values >= it.
    const BlockMaxSource<Policy> blocks{mem.bmax, g.blocks};
    float floor;
    if (!BY_MASS || !light_block_maxima(blocks, scale, p_fixed, sh, floor)) {
      const Threshold bt = radix_select<BlockMaxSource<Policy>, BY_MASS, BY_MASS>(
          blocks, Policy::lowest(), k, p_fixed, scale, sh);
      floor = bt.all ? Policy::lowest() : Policy::from_key(bt.key);
    }
    bool on_list = false;
    if (floor > Policy::lowest() || vocab <= CAP) {
      float list_mass;
      on_list = gather_list(rows, g, mem.bmax, floor, mem, sh, list_mass);
      if (BY_MASS) on_list &= list_mass >= fmaxf(top_p, 0.f) * S;
    }
    const ListSource<Policy> list{mem.vals, mem.ids, sh.list_n};
    th = on_list ? radix_select<ListSource<Policy>, BY_MASS, NEED_MASS>(
                       list, Policy::lowest(), k, p_fixed, scale, sh)
                 : radix_select<RowSource<T, VEC, Policy>, BY_MASS, NEED_MASS>(
                       rows, Policy::lowest(), k, p_fixed, scale, sh);
  }
  const float v = th.all ? Policy::lowest() : Policy::from_key(th.key);
  float inv = 0.f;
  if constexpr (NEED_MASS) {
    const float z = th.all ? S : float(double(th.kept) / scale);
    inv = z > 0.f ? 1.f / z : 0.f;
  }

  const T* x_row = in + r * in_stride;
  if constexpr (SELECT) {
    const int64_t at = int64_t(r) * k;
    select_top_k(x_row, vocab, k, v, p.ties_last != 0, p.values_out + at,
                 p.indices32_out ? nullptr : p.indices_out + at,
                 p.indices32_out ? p.indices32_out + at : nullptr);
    return;
  }
  T* y_row = out + r * out_stride;
  for (int i = int(threadIdx.x) * VEC; i < vocab; i += THREADS * VEC) {
    Vec<T, VEC> x, y;
    x.load_stream(x_row + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float a = to_float(x[j]);
      if constexpr (OP == RenormOp::TOP_K_MASK) {
        y[j] = !isnan(a) && a >= v ? x[j] : from_float<T>(-infinity());
      } else {
        const float c = Policy::clean(a);
        y[j] = from_float<T>(c >= v ? c * inv : 0.f);
      }
    }
    y.store(y_row + i);
  }
}
