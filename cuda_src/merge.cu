// Merging attention states (v, s): v normalized partial outputs, s their base-2 LSE.
//   m = max_k s_k;  w_k = 2^(s_k - m);  s = m + log2(sum_k w_k);  v = sum_k w_k v_k / sum_k w_k
// Empty states (s = -inf) add nothing; a row of only empty states gives v = 0, s = -inf.
// Sources: NUM_A states of array a (state stride a_sv / a_ss), then one state of array b when
// HAS_B. Outputs may alias a (merge_state_in_place); MASK skips rows whose mask byte is 0.
// Grid: one warp per row (n, h); lane l merges vectors l, l + 32, ... of VEC elements. Every
// lane has read the row's s values before lane 0 writes the new s (in place: same address).
// Prelude: T (v dtype), VEC, HAS_B, MASK.
#include "attention_state.cuh"

using TVec = Vec<T, VEC>;

RTC_DEVICE void add_state(AttentionState<VEC>& acc, const T* v, float s) {
  TVec x;
  x.load(v);
  float vals[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) vals[i] = to_float(x[i]);
  AttentionState<VEC> part;
  part.set_normalized(vals, s);
  acc.merge(part);
}

extern "C" __global__ void merge_kernel(
    const T* a_v, int64_t a_vn, int64_t a_vs, int64_t a_vh,  // [n, S, h, D] (S = num_a)
    const float* a_s, int64_t a_sn, int64_t a_ss, int64_t a_sh,  // [n, S, h]
    const T* b_v, int64_t b_vn, int64_t b_vh,                // [n, h, D] (HAS_B)
    const float* b_s, int64_t b_sn, int64_t b_sh,            // [n, h]
    T* o_v, int64_t o_vn, int64_t o_vh,                      // [n, h, D]
    float* o_s, int64_t o_sn, int64_t o_sh,                  // [n, h]
    const uint8_t* mask,                                     // [n] (MASK)
    int rows, int num_heads, int head_dim, int num_a) {
  const int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t n = row / num_heads;
  const int h = row - int(n) * num_heads;
  if constexpr (MASK)
    if (!mask[n]) return;
  float lse = 0.f;
  for (int d = lane * VEC; d < head_dim; d += 32 * VEC) {
    AttentionState<VEC> acc;
    acc.init();
    for (int k = 0; k < num_a; ++k)
      add_state(acc, a_v + n * a_vn + k * a_vs + h * a_vh + d, a_s[n * a_sn + k * a_ss + h * a_sh]);
    if constexpr (HAS_B) add_state(acc, b_v + n * b_vn + h * b_vh + d, b_s[n * b_sn + h * b_sh]);
    acc.normalize();
    TVec y;
#pragma unroll
    for (int i = 0; i < VEC; ++i) y[i] = from_float<T>(acc.o[i]);
    y.store(o_v + n * o_vn + h * o_vh + d);
    lse = acc.lse();
  }
  __syncwarp();
  if (lane == 0) o_s[n * o_sn + h * o_sh] = lse;
}
