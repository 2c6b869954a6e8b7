// Softmax with temperature, fp32 out, one CTA per row:
//   out = exp(x / t - max(x / t)) / sum(exp(x / t - max(x / t)))
// One pass keeps an online (max, sum) state per thread in the log2 domain (y = x * log2(e) / t),
// the states merge across the block, and a second pass writes. Rows of -inf give zeros; a NaN
// logit makes its row NaN. A batch too small to fill the GPU splits its rows over clusters
// instead (softmax_cluster.cu).
// Grid: blockIdx.x = row. Block: THREADS (softmax_common.cuh).
// Prelude: T, VEC, THREADS.
#include "softmax_common.cuh"

extern "C" __global__ void __launch_bounds__(THREADS)
    softmax_kernel(const __grid_constant__ SoftmaxParams p) {
  wait_for_previous_grid();
  const int r = blockIdx.x;
  const float t = p.temperature_arr ? p.temperature_arr[r] : p.temperature_val;
  const float scale = LOG2E / t;
  const T* x_row = p.logits + r * p.in_stride;
  bool nan;
  const Softmax total = block_softmax(x_row, 0, p.vocab, scale, nan);
  write_probs(x_row, p.probs + r * p.out_stride, 0, p.vocab, scale, total, nan);
}
