// Rotary position embedding on q and k in one launch.
//   angle(pos, i) = pos * inv_freq[i], inv_freq[i] = theta^(-2i/R) / rope_scale (Llama 3.1:
//   the low-frequency band is divided by rope_scale with a smooth ramp), or cos/sin read from a
//   [max_pos, R] cache (cos in [:, :R/2], sin in [:, R/2:]); a position outside [0, max_pos)
//   reads no row: its token passes through unrotated, reported (bad_index.cuh).
//   Non-interleaved: (x[i], x[i + R/2]) rotate by angle i; interleaved: (x[2i], x[2i+1]).
//   Elements in [R, HEAD_DIM) pass through.
// Mapping: a work item is (token, a chunk of rows_per_item head rows; q heads then k heads). A
// group of GROUP lanes (a power of two <= 32) owns one item; lane l owns elements
// [l * VEC, (l + 1) * VEC) of each of its rows. It computes its cos/sin once per item and
// streams the rows with UNROLL 16-byte loads in flight; the partner half of a non-interleaved
// pair comes from another lane by warp shuffle, so in-place needs no barrier. CTAs stride over
// items; the host makes rows_per_item the whole token unless tokens are too few to fill the GPU.
// Angles are exact to fp32 rounding for positions below 2^24 (a position is taken as a float,
// as in FlashInfer): the frequency in turns per position is a double-float (hi, lo) computed in
// fp64 on the host (rtcinfer/rope_table.py) and passed in the parameter block, copied to shared
// memory once per CTA while its first item's position and rows are loading (pairs past the
// table's 128, of heads wider than 256, are computed here in fp64); the product pos * f is split
// with an FMA and reduced to [-1/2, 1/2] turns before the sine and cosine (cos_sin).
// Prelude: T, POS_T, HEAD_DIM, ROTARY_DIM, VEC, THREADS, UNROLL, INTERLEAVE, MODE
// (RopeMode), POS_FROM (PositionSource), INPLACE, the BadIndex enum.
#include "bad_index.cuh"

constexpr int HALF = ROTARY_DIM / 2;
constexpr int LANES = HEAD_DIM / VEC;
constexpr int GROUP = LANES <= 1 ? 1 : LANES <= 2 ? 2 : LANES <= 4 ? 4 : LANES <= 8 ? 8
                    : LANES <= 16 ? 16 : 32;
constexpr int GROUPS = THREADS / GROUP;
constexpr int PAIRS = INTERLEAVE ? VEC / 2 : VEC;  // distinct frequencies per lane
static_assert(HEAD_DIM % VEC == 0 && LANES <= 32, "a row fits one warp");
static_assert(ROTARY_DIM % 2 == 0 && ROTARY_DIM <= HEAD_DIM, "rotary dims");
static_assert(INTERLEAVE ? ROTARY_DIM % VEC == 0 && VEC % 2 == 0 : HALF % VEC == 0,
              "a vector never straddles the rotary boundaries");

using TVec = Vec<T, VEC>;

// The kernel's parameters, declared before the helpers: turns_per_position reads the frequency
// scalars (the five before the table).
struct RopeParams {
  const T* q;                  // [nnz, num_q_heads, HEAD_DIM] strides (q_tok, q_head, 1)
  const T* k;                  // [nnz, num_k_heads, HEAD_DIM] strides (k_tok, k_head, 1)
  T* q_out;                    // like q, strides (qo_tok, qo_head, 1); INPLACE: == q
  T* k_out;                    // like k, strides (ko_tok, ko_head, 1); INPLACE: == k
  const POS_T* pos_ids;        // [nnz] (POS_IDS)
  const POS_T* indptr;         // [batch_size + 1] (INDPTR_OFFSETS)
  const POS_T* offsets;        // [batch_size] (INDPTR_OFFSETS)
  const float* cos_sin_cache;  // [max_pos, ROTARY_DIM] (COS_SIN_CACHE)
  BadIndexRecord* bad;         // COS_SIN_CACHE: this device's record of bad entries
  BadIndexRecord* bad_host;    // its host copy (pinned host memory, mapped)
  int64_t q_tok, q_head, k_tok, k_head, qo_tok, qo_head, ko_tok, ko_head;
  int nnz, num_q_heads, num_k_heads, batch_size, rows_per_item, max_pos;
  float rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len;
  float freq[256];  // [min(ROTARY_DIM / 2, 128)][2]: pair i's turns per position (hi, lo)
};
constexpr int TABLE_PAIRS = sizeof(RopeParams::freq) / (2 * sizeof(float));

// Frequency of pair i in turns per position, as (hi, lo) floats: f = hi + lo to ~2^-48.
RTC_DEVICE float2 turns_per_position(int i, const RopeParams& p) {
  double inv = pow(double(p.rope_theta), -2.0 * i / ROTARY_DIM);
  if constexpr (MODE == RopeMode::LLAMA31) {
    const double pi = 3.141592653589793;
    const double a = p.old_context_len / (2 * pi * (p.high_freq_factor - p.low_freq_factor));
    const double b = -1.0 / (p.high_freq_factor / p.low_freq_factor - 1.0);
    const double smooth = fmin(fmax(inv * a + b, 0.0), 1.0);
    inv = (1 - smooth) * inv / p.rope_scale + smooth * inv;
  } else {
    inv /= p.rope_scale;
  }
  const double f = inv * 0.15915494309189535;  // / (2 pi)
  const float hi = float(f);
  return make_float2(hi, float(f - hi));
}

// (cos, sin) of 2 pi * pos * f without losing the fractional turn to rounding. The angle, in
// [-pi, pi], goes to the SFU's sine and cosine (absolute error below 2^-21, far under a 16-bit
// result's rounding) for 16-bit q and k, to the accurate sincospif for fp32 ones.
RTC_DEVICE float2 cos_sin(float pos, float2 f) {
  const float p = pos * f.x;
  const float err = fmaf(pos, f.x, -p);
  const float turns = (p - rintf(p)) + fmaf(pos, f.y, err);
  float s, c;
  if constexpr (sizeof(T) == 2)
    __sincosf(6.283185307179586f * turns, &s, &c);
  else
    sincospif(2.f * turns, &s, &c);
  return make_float2(c, s);
}

RTC_DEVICE int64_t token_position(int t, const POS_T* pos_ids, const POS_T* indptr,
                                  const POS_T* offsets, int batch_size) {
  if constexpr (POS_FROM == PositionSource::POS_IDS) {
    return int64_t(pos_ids[t]);
  } else {
    int lo = 0, hi = batch_size - 1;  // the last request with indptr[b] <= t
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (int64_t(indptr[mid]) <= t) lo = mid; else hi = mid - 1;
    }
    return int64_t(offsets[lo]) + t - int64_t(indptr[lo]);
  }
}

// Pair (frequency) index of element j of this lane's vector starting at element e0.
RTC_DEVICE int pair_of(int e0, int j) { return INTERLEAVE ? (e0 + j) / 2 : (e0 + j) % HALF; }

RTC_DEVICE TVec shuffle(const TVec& x, int src_lane) {
  static_assert(sizeof(TVec) % 4 == 0, "shuffled in 32-bit words");
  TVec y;
  const uint32_t* in = reinterpret_cast<const uint32_t*>(&x);
  uint32_t* out = reinterpret_cast<uint32_t*>(&y);
#pragma unroll
  for (int w = 0; w < int(sizeof(TVec) / 4); ++w) out[w] = __shfl_sync(0xffffffffu, in[w], src_lane);
  return y;
}

extern "C" __global__ void __launch_bounds__(THREADS)
    rope_kernel(const __grid_constant__ RopeParams p) {
  wait_for_previous_grid();
  const T* q = p.q;  // INPLACE: q == q_out and k == k_out, hence no __restrict__
  const T* k = p.k;
  T* q_out = p.q_out;
  T* k_out = p.k_out;
  const POS_T* pos_ids = p.pos_ids;
  const POS_T* indptr = p.indptr;
  const POS_T* offsets = p.offsets;
  const float* cos_sin_cache = p.cos_sin_cache;
  const int64_t q_tok = p.q_tok, q_head = p.q_head, k_tok = p.k_tok, k_head = p.k_head;
  const int64_t qo_tok = p.qo_tok, qo_head = p.qo_head, ko_tok = p.ko_tok, ko_head = p.ko_head;
  const int nnz = p.nnz, num_q_heads = p.num_q_heads, num_k_heads = p.num_k_heads;
  const int batch_size = p.batch_size, rows_per_item = p.rows_per_item;
  const int lane = threadIdx.x % GROUP, group = threadIdx.x / GROUP;
  const int e0 = lane * VEC;
  const bool in_row = lane < LANES;
  const bool rotary = in_row && e0 < ROTARY_DIM;
  const bool first_half = e0 < HALF;
  const int partner = threadIdx.x % 32 + (first_half ? HALF / VEC : -(HALF / VEC));
  const int rows = num_q_heads + num_k_heads;
  const int chunks = (rows + rows_per_item - 1) / rows_per_item;
  const int items = nnz * chunks;

  __shared__ float2 freq[MODE == RopeMode::COS_SIN_CACHE ? 1 : HALF];
  bool table_built = MODE == RopeMode::COS_SIN_CACHE;
  if constexpr (MODE == RopeMode::COS_SIN_CACHE) {  // note the positions outside the table
    for (int t = blockIdx.x * THREADS + threadIdx.x; t < nnz; t += gridDim.x * THREADS) {
      const int64_t pos = int64_t(pos_ids[t]);
      if (pos < 0 || pos >= p.max_pos) {
        note_bad_index(p.bad, p.bad_host, BadIndex::COS_SIN_POSITIONS, t, saturate_int(pos),
                       p.max_pos);
      }
    }
  }

  for (int item0 = blockIdx.x * GROUPS; item0 < items; item0 += gridDim.x * GROUPS) {
    const int item = item0 + group;
    const bool active = item < items && in_row;
    const int t = item / chunks;
    const int row_begin = (item % chunks) * rows_per_item;
    const int row_end = min(rows, row_begin + rows_per_item);
    // Rows [row_begin + r0, + UNROLL) of token t: loaded, then rotated and stored.
    auto load_rows = [&](TVec (&x)[UNROLL], int r0) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int r = row_begin + r0 + u;
        const T* src = r < num_q_heads ? q + t * q_tok + r * q_head
                                       : k + t * k_tok + (r - num_q_heads) * k_head;
        if (active && r < row_end) x[u].load(src + e0);
      }
    };
    // The position and the first rows are in flight while the CTA builds its table.
    const int64_t pos = active && rotary
                            ? token_position(t, pos_ids, indptr, offsets, batch_size) : 0;
    TVec x[UNROLL];
    load_rows(x, 0);
    if (!table_built) {  // the CTA's first item (block-uniform)
      // A warp per pair, its lanes reading the same parameter words: one broadcast read each
      // (a read of the parameter block at an index that differs across the warp's lanes is
      // served one address at a time).
#pragma unroll 4
      for (int i = threadIdx.x / 32; i < HALF; i += THREADS / 32) {
        if (HALF <= TABLE_PAIRS || i < TABLE_PAIRS) {
          const float2 f = make_float2(p.freq[2 * i], p.freq[2 * i + 1]);
          if (threadIdx.x % 32 == 0) freq[i] = f;
        } else if (threadIdx.x % 32 == 0) {
          freq[i] = turns_per_position(i, p);
        }
      }
      __syncthreads();
      table_built = true;
    }
    float2 cs[PAIRS];
    if (active && rotary) {
      const bool in_cache = MODE != RopeMode::COS_SIN_CACHE || (pos >= 0 && pos < p.max_pos);
#pragma unroll
      for (int j = 0; j < PAIRS; ++j) {
        if constexpr (MODE == RopeMode::COS_SIN_CACHE) {
          const int i = pair_of(e0, INTERLEAVE ? 2 * j : j);
          if (in_cache) {
            const float* row = cos_sin_cache + pos * ROTARY_DIM;
            cs[j] = make_float2(row[i], row[HALF + i]);
          } else {
            cs[j] = make_float2(1.f, 0.f);  // cos 0, sin 0: the token passes through
          }
        } else {
          cs[j] = cos_sin(float(pos), freq[pair_of(e0, INTERLEAVE ? 2 * j : j)]);
        }
      }
    }
    for (int r0 = 0; r0 < rows_per_item; r0 += UNROLL) {  // uniform: every lane shuffles
      if (r0 > 0) load_rows(x, r0);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int r = row_begin + r0 + u;
        TVec other;
        if constexpr (!INTERLEAVE) other = shuffle(x[u], partner);
        if (!active || r >= row_end || (INPLACE && !rotary)) continue;
        TVec y = x[u];
        if (rotary) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float2 c = cs[INTERLEAVE ? j / 2 : j];
            const float a = to_float(x[u][j]);
            const float b = INTERLEAVE ? to_float(x[u][j ^ 1]) : to_float(other[j]);
            const bool minus = INTERLEAVE ? j % 2 == 0 : first_half;
            y[j] = from_float<T>(minus ? a * c.x - b * c.y : a * c.x + b * c.y);
          }
        }
        T* dst = r < num_q_heads ? q_out + t * qo_tok + r * qo_head
                                 : k_out + t * ko_tok + (r - num_q_heads) * ko_head;
        y.store(dst + e0);
      }
    }
  }
}
