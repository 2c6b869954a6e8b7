// Chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023), one CTA per request b:
//   draft token d_i (i < n) passes when u_i * q_i(d_i) < p_i(d_i), u_i = philox draw i;
//   j = the first position that fails (n when none): out[:j] = d[:j], out[j] ~ max(p_j - q_j, 0)
//   renormalized (j < n) or ~ p_n (the bonus token, j = n), out[j+1:] = -1 (philox draw n);
//   accepted = #{i : u_i q_i < p_i} over all i (how well the models agree), emitted = j.
// A residual with no positive mass (the models agree exactly) falls back to p_j.
// Grid: blockIdx.x = b. Block: THREADS; the final draw is the sampler's (row_select.cuh).
// Prelude: T, VEC, THREADS, CAP.
#include "philox.cuh"
#include "row_select.cuh"

static_assert(VEC * sizeof(T) <= 16, "one 16-byte load per vector");

struct SpeculativeParams {
  const T* draft_probs;        // [batch, n, vocab]
  const int32_t* draft_ids;    // [batch, n], or null (then draft_ids64)
  const int64_t* draft_ids64;  // [batch, n], or null (then draft_ids)
  const T* target_probs;       // [batch, n + 1, vocab]
  int32_t* out_tokens;         // [batch, n + 1]
  int32_t* accepted;           // [batch]
  int32_t* emitted;            // [batch]
  const uint64_t* seed_arr;    // [seed_len] (1 or batch), or null: seed_val
  const uint64_t* offset_arr;  // [offset_len] (1 or batch), or null: offset_val
  uint64_t seed_val, offset_val;
  int n, vocab;
  int accumulate;              // add to the counters instead of writing them
  int seed_len, offset_len;
};

extern "C" __global__ void __launch_bounds__(THREADS, 1024 / THREADS)
    chain_speculative_kernel(const __grid_constant__ SpeculativeParams p) {
  wait_for_previous_grid();
  const T* __restrict__ draft_probs = p.draft_probs;
  const int32_t* __restrict__ draft_ids = p.draft_ids;
  const int64_t* __restrict__ draft_ids64 = p.draft_ids64;
  const T* __restrict__ target_probs = p.target_probs;
  int32_t* __restrict__ out_tokens = p.out_tokens;
  int32_t* __restrict__ accepted = p.accepted;
  int32_t* __restrict__ emitted = p.emitted;
  const int n = p.n, vocab = p.vocab, accumulate = p.accumulate;
  __shared__ RowShared sh;
  const int b = blockIdx.x;
  const Philox rng = make_philox(p.seed_arr, p.seed_val, p.seed_len, p.offset_arr, p.offset_val,
                                 p.offset_len, b);
  const T* draft = draft_probs + int64_t(b) * n * vocab;
  const T* target = target_probs + int64_t(b) * (n + 1) * vocab;

  int passed = 0, first_fail = n;
  for (int i = 0; i < n; ++i) {  // every thread: n scalar reads and philox draws
    const long long id = draft_ids ? draft_ids[int64_t(b) * n + i] : draft_ids64[int64_t(b) * n + i];
    bool ok = false;
    if (id >= 0 && id < vocab) {
      const float q = to_float(draft[int64_t(i) * vocab + id]);
      const float p = to_float(target[int64_t(i) * vocab + id]);
      ok = rng.uniform(i) * q < p;
    }
    passed += ok;
    if (!ok && first_fail == n) first_fail = i;
  }

  const int j = first_fail;
  const float u = rng.uniform(n);
  const int seg = (vocab / VEC + WARPS - 1) / WARPS * VEC;
  const T* p_row = target + int64_t(j) * vocab;
  int token = -1;
  if (j < n) {
    const ResidualSource<T, VEC> residual{p_row, draft + int64_t(j) * vocab, vocab, seg};
    pivot_stats(residual, 0.f, 0.f, sh, 0, 0);
    token = draw(residual, 0.f, sh.seg[0], u, sh).token;
  }
  if (token < 0) {
    const RowSource<T, VEC, ProbPolicy> rows{p_row, vocab, seg};
    pivot_stats(rows, 0.f, 0.f, sh, 1, 1);
    token = max(draw(rows, 0.f, sh.seg[1], u, sh).token, 0);
  }

  if (threadIdx.x == 0) {
    int32_t* o = out_tokens + int64_t(b) * (n + 1);
    for (int i = 0; i <= n; ++i) {
      const long long id = i < j ? (draft_ids ? draft_ids[int64_t(b) * n + i]
                                              : draft_ids64[int64_t(b) * n + i])
                                 : i == j ? token : -1;
      o[i] = int32_t(id);
    }
    accepted[b] = passed + (accumulate ? accepted[b] : 0);
    emitted[b] = j + (accumulate ? emitted[b] : 0);
  }
}
