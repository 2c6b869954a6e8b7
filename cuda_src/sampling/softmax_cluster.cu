// Softmax with temperature over a cluster of CLUSTER CTAs per row (sm_90+), for batches too
// small to fill the GPU with one CTA per row: CTA c of a row's cluster takes the c-th of
// CLUSTER equal slices (whole vectors) of the row, computes its block's (max, sum) state
// (softmax_common.cuh), publishes it in shared memory, and after a cluster barrier merges the
// CLUSTER states in rank order through distributed shared memory (every CTA the same total),
// then writes its slice. The result is softmax.cu's up to the order of the merges.
// Grid: CLUSTER CTAs per row (__cluster_dims__); cluster index = row. Block: THREADS.
// Prelude: T, VEC, THREADS, CLUSTER.
#include "cluster.cuh"
#include "softmax_common.cuh"

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS)
    cluster_softmax_kernel(const __grid_constant__ SoftmaxParams p) {
  wait_for_previous_grid();
  __shared__ float state[3];            // this CTA's slice: m, d, NaN seen (0 or 1)
  __shared__ float states[CLUSTER][3];  // every CTA's, gathered
  const int r = int(cluster_index()), rank = int(cluster_rank());
  const float t = p.temperature_arr ? p.temperature_arr[r] : p.temperature_val;
  const float scale = LOG2E / t;
  const int vectors = p.vocab / VEC, per_cta = (vectors + CLUSTER - 1) / CLUSTER;
  const int begin = min(rank * per_cta, vectors) * VEC;
  const int end = min((rank + 1) * per_cta, vectors) * VEC;
  const T* x_row = p.logits + r * p.in_stride;
  bool nan;
  const Softmax mine = block_softmax(x_row, begin, end, scale, nan);
  if (threadIdx.x == 0) {
    state[0] = mine.m;
    state[1] = mine.d;
    state[2] = nan ? 1.f : 0.f;
  }
  cluster_sync();
  if (threadIdx.x < CLUSTER * 3) {
    const int c = threadIdx.x / 3, f = threadIdx.x % 3;
    states[c][f] = load_remote_f32(remote(&state[f], uint32_t(c)));
  }
  __syncthreads();
  Softmax total;
  bool any_nan = false;
#pragma unroll
  for (int c = 0; c < CLUSTER; ++c) {
    total.merge(states[c][0], states[c][1]);
    any_nan |= states[c][2] != 0.f;
  }
  write_probs(x_row, p.probs + r * p.out_stride, begin, end, scale, total, any_nan);
  cluster_sync();  // no CTA leaves while another may still read its state
}
