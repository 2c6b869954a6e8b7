// Sorting-free sampling of one row by a cluster of CLUSTER CTAs (sm_90+), for batches too small
// to fill the GPU with one CTA per row. The same samplers as sampling.cu; each CTA keeps its
// slice of the row in shared memory, so the row is read from memory once and every later pass
// runs on shared memory, with cluster barriers and distributed shared memory between passes.
//
// With v = max(p, 0) (NaN -> 0), M = max(v) in [2^E, 2^(E+1)) and the fixed-point masses
//   f_j = rint(v_j * 2^(40 - E))   (fp32 product, exact but for underflow; u64 sums below are
//                                   exact, so results are independent of the summation order
//                                   and a prefix sum is monotone; M < 2^-87 scales by 2^127)
// the kept set is {v_j > low} refined by rejection rounds:
//   top_k (0 < k < vocab): low = below(k-th largest v), found by radix select (8-bit digits)
//                          over the values >= the k-th largest warp maximum (when k <= warps)
//   min_p (min_p > 0):     low = below(min(min_p, 1) * M)
//   top_p (top_p < 1):     P = rint(top_p * F) with F = sum(f) ("joint": over the whole row;
//                          top_k_first: over the top-k set); a value x stays when
//                          count(v > x) == 0 or sum(f_i : v_i > x) < P
// A draw takes u = uniform(round) and target = min(floor(u * T), T - 1) with T = sum(f_j : v_j >
// low), and returns the element where the inclusive prefix of those f_j passes target, in the
// order (CTA, thread, float4 group, element). Top-p then tests pivot1 = the drawn value and
// pivot2 = (pivot1 + high) / 2 (high starts at M) as sampling.cu does:
//   pivot1 stays -> return it;  pivot2 stays -> low = pivot1, high = pivot2;  else low = pivot2.
// Top-k rows usually finish on rank 0 alone: the values >= the k-th largest warp maximum (about
// k of them, at most THREADS) are gathered into its shared memory, and the k-th value, the draws
// (in token order) and the top-p rounds run there without further cluster barriers.
// A row with M <= 0 gives token 0; after MAX_ROUNDS the first maximum is returned.
//
// Grid: CLUSTER CTAs per output row b = cluster index, reading probability row indices[b] (or
// b); CTA r owns elements [r * seg, (r + 1) * seg) with seg = ceil(vocab / CLUSTER) rounded up
// to a multiple of max(4, VEC). Dynamic shared memory: seg floats.
// Prelude: OP (SampleOp), T, OUT_T, VEC, THREADS, CLUSTER. Building blocks: cluster_select.cuh.
#include "philox.cuh"
#include "cluster.cuh"
#include "sample_common.cuh"

constexpr int WARPS = THREADS / 32;
constexpr int SEG_ALIGN = VEC > 4 ? VEC : 4;
constexpr unsigned FULL = 0xffffffffu;
static_assert(THREADS % 32 == 0 && WARPS >= 8 && WARPS <= 32, "8 to 32 warps");
static_assert(CLUSTER >= 1 && CLUSTER <= 8, "portable cluster sizes");

#include "cluster_select.cuh"

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, 1)
    cluster_sample_kernel(const __grid_constant__ SampleParams p) {  // sample_common.cuh
  wait_for_previous_grid();
  const T* __restrict__ probs = p.probs;
  const OUT_T* __restrict__ indices = p.indices;
  OUT_T* __restrict__ out = p.out;
  int* __restrict__ error_flag = p.error_flag;
  const int64_t row_stride = p.row_stride;
  const int vocab = p.vocab;
  extern __shared__ float4 slice_memory[];
  __shared__ Published pub;
  __shared__ Scratch sc;
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  const uint32_t rank = cluster_rank();
  const int b = int(cluster_index());
  const int64_t row = indices ? int64_t(indices[b]) : int64_t(b);
  if (!row_in_range(p, b, row, rank == 0)) return;  // the whole cluster: row is uniform
  const int seg = ((vocab + CLUSTER - 1) / CLUSTER + SEG_ALIGN - 1) / SEG_ALIGN * SEG_ALIGN;
  const int base = int(rank) * seg;
  const int n = max(0, min(seg, vocab - base));  // a multiple of VEC
  const Slice s{slice_memory, (n + 3) / 4, base};

  // Load the slice, clean the values (NaN, negatives -> 0), zeros past the end. fp32 rows are
  // copied with cp.async (every load in flight at once) and cleaned in place.
  float* sv = reinterpret_cast<float*>(slice_memory);
  const T* src = probs + row * row_stride + base;
  const int vectors = n / VEC;
  float mx = 0.f;
  bool bad = false;
  using V = Vec<T, VEC>;
  if constexpr (sizeof(T) == 4) {
    for (int i = threadIdx.x; i < vectors; i += THREADS)
      copy_async(reinterpret_cast<V*>(sv) + i, reinterpret_cast<const V*>(src) + i);
    cp_async_wait_all();
    for (int i = threadIdx.x; i < vectors; i += THREADS) {  // the elements this thread copied
      V x = reinterpret_cast<V*>(sv)[i];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float v = to_float(x[e]);
        bad |= !(v >= 0.f && v < __int_as_float(0x7f800000));
        x[e] = v > 0.f ? v : 0.f;
        mx = fmaxf(mx, x[e]);
      }
      reinterpret_cast<V*>(sv)[i] = x;
    }
  } else {
    constexpr int BATCH = 8;  // vectors in flight per thread
    for (int v0 = threadIdx.x; v0 < vectors; v0 += BATCH * THREADS) {
      V x[BATCH];
#pragma unroll
      for (int j = 0; j < BATCH; ++j)
        if (v0 + j * THREADS < vectors) x[j].load_stream(src + (v0 + j * THREADS) * VEC);
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        if (v0 + j * THREADS >= vectors) break;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float v = to_float(x[j][e]);
          bad |= !(v >= 0.f && v < __int_as_float(0x7f800000));
          const float c = v > 0.f ? v : 0.f;
          mx = fmaxf(mx, c);
          sv[(v0 + j * THREADS) * VEC + e] = c;
        }
      }
    }
  }
  for (int i = n + threadIdx.x; i < s.quads * 4; i += THREADS) sv[i] = 0.f;
  mx = warp_max(mx);
  const bool warp_bad = __any_sync(FULL, bad);
  if (lane == 0) sc.f[w] = mx, sc.c[w][0] = warp_bad, pub.warp_max[w] = mx;
  if (threadIdx.x == 0) pub.list_n = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.f;
    uint32_t any = 0;
    for (int i = 0; i < WARPS; ++i) m = fmaxf(m, sc.f[i]), any |= sc.c[i][0];
    pub.max = m;
    pub.bad = any;
  }
  cluster_sync();  // slices loaded, maxima published
  if (w == 0) {
    const float m = warp_max(lane < CLUSTER ? load_remote_f32(remote(&pub.max, lane)) : 0.f);
    const bool any = __any_sync(FULL, lane < CLUSTER && load_remote_u32(remote(&pub.bad, lane)));
    if (lane == 0) {
      sc.M = m;
      if (any && error_flag && rank == 0) *error_flag = 1;
    }
  }
  __syncthreads();
  const float M = sc.M;

  if (M > 0.f) {
    const float scale = mass_scale(M);
    const Philox rng = make_philox(p.seed_arr, p.seed_val, p.seed_len, p.offset_arr,
                                   p.offset_val, p.offset_len, b);
    float low = 0.f, top_p = 1.f;
    if constexpr (HAS_P) top_p = row_param(p.top_p_arr, p.top_p_val, b);
    const bool rejecting = HAS_P && top_p < 1.f;
    bool use_k = false, listed = false;
    if constexpr (HAS_K) {
      const long long k = row_top_k(p.top_k_arr, p.top_k_arr64, p.top_k_val, b);
      use_k = k > 0 && k < vocab;
      const float floor = use_k ? warp_floor(uint32_t(k), pub, sc) : 0.f;
      if (floor > 0.f) {  // gather the values >= floor into rank 0's list
        const uint32_t count_at = remote(&pub.list_n, 0);
        s.for_each([&](int i, float v) {
          if (v < floor) return;
          const uint32_t slot = atomic_add_remote_u32(count_at, 1u);
          if (slot < THREADS) {
            uint32_t* vals = reinterpret_cast<uint32_t*>(pub.list_v);
            uint32_t* ids = reinterpret_cast<uint32_t*>(pub.list_t);
            store_remote_u32(remote(vals + slot, 0), __float_as_uint(v));
            store_remote_u32(remote(ids + slot, 0), uint32_t(s.base + i));
          }
        });
        if (OP == SampleOp::TOP_K_TOP_P && rejecting)  // "joint"
          publish_slice_mass(s, scale, pub, sc);
        cluster_sync();  // the list is complete
        const uint32_t n = load_remote_u32(count_at);
        listed = n <= uint32_t(THREADS);
        if (listed && rank == 0) {
          uint64_t row_mass = 0;
          if (OP == SampleOp::TOP_K_TOP_P && rejecting)
#pragma unroll
            for (int r = 0; r < CLUSTER; ++r) row_mass += load_remote_u64(remote(&pub.total, r));
          const int token = finish_on_list(int(n), uint32_t(k), top_p, rejecting, row_mass, M,
                                           scale, rng, pub, sc);
          if (threadIdx.x == 0) out[b] = OUT_T(token);
        }
      }
      if (use_k && !listed) low = below(kth_largest(s, uint32_t(k), floor, pub, sc));
    }
    if (!listed) {  // the row streams: threshold, draws and rounds over the cluster
      if constexpr (OP == SampleOp::MIN_P) {
        const float min_p = row_param(p.min_p_arr, p.min_p_val, b);
        if (min_p > 0.f) low = below(fminf(min_p, 1.f) * M);
      }
      uint64_t base_mass = 0;  // "joint" with a top-k cut: top-p refers to the whole row's mass
      if (OP == SampleOp::TOP_K_TOP_P && rejecting && use_k) {
        publish_slice_mass(s, scale, pub, sc);
        cluster_sync();
        uint64_t t = 0;
  #pragma unroll
        for (int r = 0; r < CLUSTER; ++r) t += load_remote_u64(remote(&pub.total, r));
        base_mass = t;
      }
      float high = M;
      uint64_t P = 0;
      int token = -2;  // -2: not decided yet
      const uint64_t* known = nullptr;  // the slices' masses above low, after a rejected round
  #pragma unroll 1
      for (int round = 0; round < MAX_ROUNDS; ++round) {
        const Drawn d = draw(s, low, scale, rng.uniform(round), rejecting, known, pub, sc, rank,
                             out + b);
        if (!d.any || !rejecting) {
          token = d.any ? -3 : -1;  // -3: written by the thread that found it
          break;
        }
        if (round == 0)
          P = __double2ull_rn(double(top_p) * double(base_mass ? base_mass : d.total));
        const float x1 = d.value, x2 = __fmul_rn(__fadd_rn(d.value, high), 0.5f);
        uint32_t c[2];
        uint64_t m[2];
        pivot_stats(s, x1, x2, scale, pub, sc, c, m);
        if (c[0] == 0 || m[0] < P) {
          token = d.token;
          break;
        }
        if (c[1] == 0 || m[1] < P) {
          low = x1;
          high = x2;
          known = sc.rank_mass[0];
        } else {
          low = x2;
          known = sc.rank_mass[1];
        }
      }
      if (token == -2 || token == -1) {  // out of rounds (or nothing above low): first maximum
        int first = 0x7fffffff;
        s.for_each([&](int i, float v) {
          if (v == M) first = min(first, s.base + i);
        });
        for (int m = 16; m > 0; m >>= 1) first = min(first, __shfl_xor_sync(FULL, first, m));
        if (lane == 0) sc.c[w][1] = uint32_t(first);
        __syncthreads();
        if (threadIdx.x == 0) {
          int f = 0x7fffffff;
          for (int i = 0; i < WARPS; ++i) f = min(f, int(sc.c[i][1]));
          pub.first_max = f;
        }
        cluster_sync();
        if (threadIdx.x == 0 && rank == 0) {
          int f = 0x7fffffff;
          for (int r = 0; r < CLUSTER; ++r)
            f = min(f, int(load_remote_u32(remote(reinterpret_cast<uint32_t*>(&pub.first_max),
                                                  r))));
          out[b] = OUT_T(f == 0x7fffffff ? 0 : f);
        }
      } else if (token >= 0 && threadIdx.x == 0 && rank == 0) {
        out[b] = OUT_T(token);
      }
    }
  } else if (threadIdx.x == 0 && rank == 0) {
    out[b] = OUT_T(0);
  }
  cluster_sync();  // no CTA leaves while another may still read its shared memory
}
