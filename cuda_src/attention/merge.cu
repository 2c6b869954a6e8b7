// Merging attention states (v, s): v normalized partial outputs, s their base-2 LSE.
//   m = max_k s_k;  w_k = 2^(s_k - m);  s = m + log2(sum_k w_k);  v = sum_k w_k v_k / sum_k w_k
// Empty states (s = -inf) add nothing; a row of only empty states gives v = 0, s = -inf.
// Sources: num_a states of array a (state strides a_vs / a_ss), then one state of array b when
// HAS_B, or, when SINK, the sink of the row's head: a key of logit sinks[h] (natural units)
// and value 0, the state (v = 0, s = sinks[h] * log2(e)). Outputs may alias a
// (merge_state_in_place, merge_sinks_in_place); MASK skips rows whose mask byte is 0.
// Grid: one warp per row (n, h); lane l merges vectors l, l + 32, ... of VEC elements. Every
// lane has read the row's s values before lane 0 writes the new s (in place: same address).
// Prelude: T (v dtype), VEC, HAS_B, MASK, SINK.
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

struct MergeParams {
  const T* a_v;         // [n, S, h, D] strides (a_vn, a_vs, a_vh, 1), S = num_a
  const float* a_s;     // [n, S, h] strides (a_sn, a_ss, a_sh)
  const T* b_v;         // [n, h, D] strides (b_vn, b_vh, 1) (HAS_B)
  const float* b_s;     // [n, h] strides (b_sn, b_sh) (HAS_B)
  T* o_v;               // [n, h, D] strides (o_vn, o_vh, 1); in place: == a_v
  float* o_s;           // [n, h] strides (o_sn, o_sh); in place: == a_s
  const uint8_t* mask;  // [n] dense (MASK)
  const float* sinks;   // [h] stride sinks_h (SINK)
  int64_t sinks_h;
  int64_t a_vn, a_vs, a_vh, a_sn, a_ss, a_sh;
  int64_t b_vn, b_vh, b_sn, b_sh;
  int64_t o_vn, o_vh, o_sn, o_sh;
  int rows, num_heads, head_dim, num_a;
};

extern "C" __global__ void merge_kernel(const __grid_constant__ MergeParams p) {
  wait_for_previous_grid();
  const T* a_v = p.a_v;
  const float* a_s = p.a_s;
  const T* b_v = p.b_v;
  const float* b_s = p.b_s;
  T* o_v = p.o_v;
  float* o_s = p.o_s;
  const uint8_t* mask = p.mask;
  const int64_t a_vn = p.a_vn, a_vs = p.a_vs, a_vh = p.a_vh;
  const int64_t a_sn = p.a_sn, a_ss = p.a_ss, a_sh = p.a_sh;
  const int64_t b_vn = p.b_vn, b_vh = p.b_vh, b_sn = p.b_sn, b_sh = p.b_sh;
  const int64_t o_vn = p.o_vn, o_vh = p.o_vh, o_sn = p.o_sn, o_sh = p.o_sh;
  const int rows = p.rows, num_heads = p.num_heads, head_dim = p.head_dim, num_a = p.num_a;
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
    if constexpr (SINK) {
      const float zero[VEC] = {};
      AttentionState<VEC> sink;
      sink.set_normalized(zero, p.sinks[h * p.sinks_h] * LOG2E);  // -inf: no sink
      acc.merge(sink);
    }
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
