// An in-place update's input moved into its output buffer, inside jax.jit (interop/xla_launch.py):
//   dst[i] = src[i] for i < count (16-byte words), when src != dst; nothing when they are one
//   buffer, as XLA normally makes an output aliased to its input.
// The update's own launch, next, writes through dst. Grid: CTAs stride over the words.
// Prelude: THREADS.
#include "common.cuh"

struct MoveParams {
  const int4* src;  // [count] the input
  int4* dst;        // [count] the output: the input's buffer, or one XLA gave it on its own
  int64_t count;    // 16-byte words
};

extern "C" __global__ void __launch_bounds__(THREADS)
    move_kernel(const __grid_constant__ MoveParams p) {
  wait_for_previous_grid();
  if (p.src == p.dst) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * THREADS;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; i < p.count;
       i += stride)
    p.dst[i] = p.src[i];
}
