// Exact threshold ops, one CTA per row (ties with the threshold are kept, as in FlashInfer):
//   top_k_renorm  out = p >= v ? p / sum(p >= v) : 0,  v = the k-th largest p
//   top_p_renorm  out = p >= v ? p / sum(p >= v) : 0,  v = min{p_j : sum(p > p_j) < top_p sum(p)}
//                 (the maximum is always kept)
//   top_k_mask    out = x >= v ? x : -inf,             v = the k-th largest logit (NaN -> -inf)
// Pass 0 streams the row once (maximum, sum, candidate list, row_scan.cuh); the threshold is a
// radix select (row_select.cuh) over the list when it provably holds the kept set, else over
// the row; a last pass writes the output. The renormalizing sum is the select's fixed-point mass
// (p * 2^40 / max p, integer sums): deterministic, within 2^-24 relative of the exact sum.
// Grid: blockIdx.x = row. Block: THREADS. Shared: CAP * 8 bytes dynamic + RowShared.
// Prelude: OP (RenormOp), T, VEC, THREADS, CAP.
#include "row_select.cuh"

enum RenormOp { TOP_K_RENORM = 0, TOP_P_RENORM = 1, TOP_K_MASK = 2 };

template <bool B, class X, class Y>
struct Choose {
  using type = X;
};
template <class X, class Y>
struct Choose<false, X, Y> {
  using type = Y;
};
using Policy = typename Choose<OP == TOP_K_MASK, LogitPolicy, ProbPolicy>::type;
constexpr bool BY_MASS = OP == TOP_P_RENORM, NEED_MASS = OP != TOP_K_MASK;
static_assert(VEC * sizeof(T) <= 16, "one 16-byte load per vector");

extern "C" __global__ void __launch_bounds__(THREADS, 1024 / THREADS) renorm_kernel(
    const T* __restrict__ in,   // [rows, vocab], rows `in_stride` elements apart
    int64_t in_stride,
    T* __restrict__ out,        // [rows, vocab], rows `out_stride` elements apart
    int64_t out_stride, int vocab,
    const int32_t* __restrict__ top_k_arr,    // [rows] or null
    const int64_t* __restrict__ top_k_arr64,  // [rows] or null
    int top_k_val,
    const float* __restrict__ top_p_arr,      // [rows] or null
    float top_p_val) {
  extern __shared__ float4 list_mem[];
  __shared__ RowShared sh;
  float* vals = reinterpret_cast<float*>(list_mem);
  int* ids = reinterpret_cast<int*>(vals + CAP);
  const int r = blockIdx.x, lane = lane_id(), w = warp_id();
  const int seg = (vocab / VEC + WARPS - 1) / WARPS * VEC;
  const RowSource<T, VEC, Policy> rows{in + r * in_stride, vocab, seg};

  const Collected col = collect_candidates(rows, vals, ids, false);
  if (lane == 0) {
    sh.seg_max[w] = col.max;
    sh.seg_bar[w] = col.bar;
    sh.seg[0][w] = col.sum;
    sh.list_n[w] = col.n;
  }
  __syncthreads();
  if (w == 0) {
    const float m = warp_max(lane < WARPS ? sh.seg_max[lane] : Policy::lowest());
    const float floor = warp_max(lane < WARPS ? sh.seg_bar[lane] : Policy::lowest());
    if (lane == 0) {
      float s = 0.f;
#pragma unroll 1
      for (int i = 0; i < WARPS; ++i) s += sh.seg[0][i];
      sh.f[0] = m;
      sh.f[1] = floor;
      sh.f[2] = s;
    }
  }
  __syncthreads();
  const float M = sh.f[0], low0 = sh.f[1], S = sh.f[2];
  const int n_w = sh.list_n[w];
  const int kept_n = keep_above(vals + w * CAP_W, ids + w * CAP_W, n_w, low0);
  if (lane == 0) sh.list_n[w] = kept_n;
  __syncthreads();
  const ListSource<Policy> list{vals, ids, sh.list_n};
  const PivotStats in_list = pivot_stats(list, low0, low0, sh, 1, 1);

  int k = 0;
  float top_p = 1.f;
  bool keep_all;
  if constexpr (BY_MASS) {
    top_p = top_p_arr ? top_p_arr[r] : top_p_val;
    keep_all = !(top_p < 1.f);
  } else {
    const long long kk = top_k_arr ? top_k_arr[r] : top_k_arr64 ? top_k_arr64[r] : top_k_val;
    keep_all = kk <= 0 || kk >= vocab;
    k = keep_all ? vocab : int(kk);
  }
  const double scale = NEED_MASS && M > 0.f ? 1099511627776.0 / double(M) : 0.0;  // 2^40 / max
  Threshold th{0u, 0ull, true};
  if (!keep_all) {
    const float P = fmaxf(top_p, 0.f) * S;
    const unsigned long long p_fixed = __double2ull_rn(double(P) * scale);
    const bool on_list =
        low0 == Policy::lowest() || (BY_MASS ? in_list.c1 > 0 && in_list.m1 >= P : in_list.c1 >= k);
    th = on_list ? radix_select<ListSource<Policy>, BY_MASS, NEED_MASS>(list, low0, k, p_fixed,
                                                                        scale, sh)
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
  T* y_row = out + r * out_stride;
  for (int i = int(threadIdx.x) * VEC; i < vocab; i += THREADS * VEC) {
    Vec<T, VEC> x, y;
    x.load_stream(x_row + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float a = to_float(x[j]);
      if constexpr (OP == TOP_K_MASK) {
        y[j] = !isnan(a) && a >= v ? x[j] : from_float<T>(-infinity());
      } else {
        const float c = Policy::clean(a);
        y[j] = from_float<T>(c >= v ? c * inv : 0.f);
      }
    }
    y.store(y_row + i);
  }
}
