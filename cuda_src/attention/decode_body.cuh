// The attention math of the decode kernel (decode.cu), one piece per step of a work item:
// the query side, one K/V tile, the epilogue, the split merge. One CTA holds the query
// heads of its kv head (GQA group, padded to HEADS = 8 * HEAD_TILES; larger groups split into
// sub-groups of HEADS) as the N side of mma.m16n8k16: S^T = K Q^T (16 tokens x 8 heads),
// O^T += V^T P^T. Four warps; warp w takes rows [w * WARP_TOKENS, +WARP_TOKENS) of every K/V
// tile with its own softmax state, and the four states merge through shared memory per item.
//   s_j = q . k_j * qk_scale (+ ALiBi slope * (j - q_pos)) (soft cap: cap * tanh(s / cap))
//   o = softmax(s) @ V * v_scale;  lse = log2(sum_j e^(s_j)); empty: o = 0, lse = -inf
// fp8 KV: ldmatrix moves fp8 pairs as 16-bit units, so inside every 16-wide head_dim block the
// thread's values are d = 4t..4t+3 (K: a permuted contraction order, the same for q) and V's
// rows come out as d = 2g (logical row g) and 2g + 1 (row g + 8); cvt makes them fp16.
// Prelude: QT, KVT, OT, HEAD_DIM, HEAD_TILES, POS_ENCODING (PosEncoding), SOFT_CAP, STAGES,
// TOKEN_GROUPS, LOOKAHEAD (0: STAGES - 1), SMEM_BYTES.
#pragma once
#include "mma.cuh"
#include "attention_state.cuh"
#include "paged_kv.cuh"
#include "variant.cuh"

constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr bool FP8 = IsSame<KVT, __nv_fp8_e4m3>::value || IsSame<KVT, __nv_fp8_e5m2>::value;
constexpr bool ROPE = POS_ENCODING == PosEncoding::ROPE_LLAMA;
constexpr bool ALIBI = POS_ENCODING == PosEncoding::ALIBI;
constexpr int ROW_BYTES = HEAD_DIM * (FP8 ? 1 : 2);
constexpr int WARP_TOKENS = 16 * TOKEN_GROUPS;
constexpr int TILE = WARPS * WARP_TOKENS;
constexpr int BLOCKS = HEAD_DIM / 16;  // 16-wide head_dim blocks: k-steps of K Q^T, m-tiles of V^T P^T
constexpr int HEADS = 8 * HEAD_TILES;  // query heads per CTA, padded
constexpr int Q_STRIDE = HEAD_DIM + 16;  // q row in shared memory (elements): conflict-free reads
constexpr int HEADER_INTS = 4 + HEAD_DIM;  // plan: num_work, 3 spare, RoPE frequencies (hi, lo)
constexpr int VECS = HEAD_DIM / 4;  // float4 pieces of an output row
constexpr __nv_fp8_interpretation_t FP8_KIND = fp8_kind<KVT>();
using MT = Conditional<FP8, half, KVT>;  // tensor-core input type

constexpr int TILE_BYTES = TILE * ROW_BYTES;
constexpr int RING_BYTES = STAGES * 2 * TILE_BYTES;
constexpr int Q_BYTES = HEADS * Q_STRIDE * 2;
constexpr int FREQ_BYTES = ROPE ? HEAD_DIM / 2 * 8 : 0;
constexpr int STATE_BYTES = 2 * WARPS * HEADS * 4 + 16;
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head_dim 64, 128 or 256");
static_assert(HEAD_TILES == 1 || HEAD_TILES == 2, "8 or 16 query heads per CTA");
static_assert(BLOCKS * HEAD_TILES <= 16, "q fragments and accumulators fit in registers");
static_assert(STAGES >= 2, "at least double buffering");
static_assert(FP8 || IsSame<QT, KVT>::value, "16-bit KV must match q's dtype");

using Loader = PagedTileLoader<TILE, ROW_BYTES, THREADS>;
using State = AttentionState<2 * BLOCKS>;  // one query head: rows g, g + 8 of every d block

#include "decode_fragments.cuh"

// The query side of one work item: q rows in shared memory (RoPE'd at q_pos, zero rows for
// the padding heads) and, without RoPE, its Q^T B fragments in registers.
struct QuerySide {
  uint32_t qf[ROPE ? 1 : BLOCKS][HEAD_TILES][2];

  // Every thread: write the rows, then a barrier, then read the fragments.
  RTC_DEVICE void load(MT* q_s, const QT* q, int64_t q_stride_n, int64_t q_stride_h,
                       int request, int head0, int heads, int q_pos, const float2* freq,
                       int g, int t) {
    for (int i = threadIdx.x; i < HEADS * HEAD_DIM / 2; i += THREADS) {
      const int h = i / (HEAD_DIM / 2), d = i % (HEAD_DIM / 2);
      float x0 = 0.f, x1 = 0.f;
      if (h < heads) {
        const QT* row = q + request * q_stride_n + (head0 + h) * q_stride_h;
        x0 = to_float(row[d]);
        x1 = to_float(row[d + HEAD_DIM / 2]);
        if constexpr (ROPE) {
          const float2 cs = rope_cos_sin(q_pos, __ldg(freq + d));
          const float y0 = x0 * cs.x - x1 * cs.y, y1 = x1 * cs.x + x0 * cs.y;
          x0 = y0, x1 = y1;
        }
      }
      q_s[h * Q_STRIDE + d] = from_float<MT>(x0);
      q_s[h * Q_STRIDE + d + HEAD_DIM / 2] = from_float<MT>(x1);
    }
    __syncthreads();
    // Q^T B fragments live in registers for the whole item, except with RoPE: its rolled K
    // loop reads them from shared memory (registers go to the rotation instead).
    if constexpr (!ROPE)
#pragma unroll
      for (int c = 0; c < BLOCKS; ++c)
#pragma unroll
        for (int nt = 0; nt < HEAD_TILES; ++nt) q_frag(qf[c][nt], q_s, c, nt, g, t);
  }
};

// Per-thread constants of the logit transform (variant.cuh): the ALiBi slopes of the heads
// 8 nt + 2t + j of the CTA's group that this thread's fragments hold.
struct LogitHook {
  LogitTransform<ALIBI, SOFT_CAP> transform;
  float slope[HEAD_TILES][2];

  RTC_DEVICE void init(float qk_scale, float cap, int head0, int num_qo_heads, int t) {
    transform.init(qk_scale, cap);
#pragma unroll
    for (int nt = 0; nt < HEAD_TILES; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        slope[nt][j] = ALIBI ? alibi_slope(head0 + 8 * nt + 2 * t + j, num_qo_heads) : 0.f;
  }
};

RTC_DEVICE void init_states(State (&st)[HEAD_TILES][2]) {
#pragma unroll
  for (int nt = 0; nt < HEAD_TILES; ++nt) st[nt][0].init(), st[nt][1].init();
}

// One K/V tile (tokens [tile_begin, tile_begin + TILE), masked at `end`) into the warp's states.
RTC_DEVICE void attend_tile(State (&st)[HEAD_TILES][2], const QuerySide& qs, const MT* q_s,
                            const float2* freq_s, const LogitHook& hook, uint32_t kt,
                            uint32_t vt, int tile_begin, int end, int q_pos, int warp, int lane,
                            int g, int t) {
  float x[TOKEN_GROUPS][HEAD_TILES][4];  // S^T: (token g | g + 8) x (head 2t | 2t + 1)
#pragma unroll
  for (int tg = 0; tg < TOKEN_GROUPS; ++tg) {
    const int row = warp * WARP_TOKENS + 16 * tg;
#pragma unroll
    for (int nt = 0; nt < HEAD_TILES; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) x[tg][nt][r] = 0.f;
    if constexpr (ROPE) {  // blocks c and c + BLOCKS / 2 rotate together
#pragma unroll 1
      for (int c = 0; c < BLOCKS / 2; c += 2) {
        uint32_t a[2][2][4];
        load_k(a[0], kt, row, c, lane);
        load_k(a[1], kt, row, c + BLOCKS / 2, lane);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          rope_k(a[0][i], a[1][i], c + i, tile_begin + row, g, t, freq_s);
#pragma unroll
          for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int nt = 0; nt < HEAD_TILES; ++nt) {
              uint32_t b[2];
              q_frag(b, q_s, c + i + half * BLOCKS / 2, nt, g, t);
              float* s = x[tg][nt];
              mma_16816<MT>(s[0], s[1], s[2], s[3], a[half][i], b[0], b[1]);
            }
        }
      }
    } else {
#pragma unroll
      for (int c = 0; c < BLOCKS; c += 2) {
        uint32_t a[2][4];
        load_k(a, kt, row, c, lane);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int nt = 0; nt < HEAD_TILES; ++nt) {
            float* s = x[tg][nt];
            mma_16816<MT>(s[0], s[1], s[2], s[3], a[i], qs.qf[c + i][nt][0],
                          qs.qf[c + i][nt][1]);
          }
      }
    }
    // Logit hook: scale, ALiBi, soft cap, base 2; tokens past the range are masked.
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int pos = tile_begin + row + g + 8 * (r / 2);
#pragma unroll
      for (int nt = 0; nt < HEAD_TILES; ++nt) {
        const float v = hook.transform(x[tg][nt][r], hook.slope[nt][r % 2], pos - q_pos);
        x[tg][nt][r] = pos < end ? v : neg_inf();
      }
    }
  }

  // Online softmax over the warp's tokens of this tile, then P^T fragments (movmatrix).
  uint32_t p[TOKEN_GROUPS][HEAD_TILES][2];
#pragma unroll
  for (int nt = 0; nt < HEAD_TILES; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float mx = neg_inf();
#pragma unroll
      for (int tg = 0; tg < TOKEN_GROUPS; ++tg) mx = fmaxf(mx, fmaxf(x[tg][nt][j], x[tg][nt][j + 2]));
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float base = st[nt][j].rescale(mx);
#pragma unroll
      for (int tg = 0; tg < TOKEN_GROUPS; ++tg) {
        x[tg][nt][j] = fast_exp2(x[tg][nt][j] - base);
        x[tg][nt][j + 2] = fast_exp2(x[tg][nt][j + 2] - base);
        st[nt][j].d += x[tg][nt][j] + x[tg][nt][j + 2];
      }
    }
#pragma unroll
    for (int tg = 0; tg < TOKEN_GROUPS; ++tg) {
      p[tg][nt][0] = movmatrix_trans(pack2<MT>(x[tg][nt][0], x[tg][nt][1]));
      p[tg][nt][1] = movmatrix_trans(pack2<MT>(x[tg][nt][2], x[tg][nt][3]));
    }
  }

  // O^T += V^T P^T over the warp's tokens.
#pragma unroll
  for (int tg = 0; tg < TOKEN_GROUPS; ++tg) {
    const int row = warp * WARP_TOKENS + 16 * tg;
#pragma unroll
    for (int c = 0; c < BLOCKS; c += 2) {
      uint32_t a[2][4];
      load_v(a, vt, row, c, lane);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int nt = 0; nt < HEAD_TILES; ++nt) {
          State& h0 = st[nt][0];
          State& h1 = st[nt][1];
          const int e = 2 * (c + i);
          mma_16816<MT>(h0.o[e], h1.o[e], h0.o[e + 1], h1.o[e + 1], a[i], p[tg][nt][0],
                        p[tg][nt][1]);
        }
    }
  }
}

// Where an item's result goes: the output row (merge_count == 1) or its partial rows.
struct ItemSink {
  OT* o;  // o + request * o_stride_n + head0 * o_stride_h
  int64_t o_stride_h;
  float* lse;  // lse + request * lse_stride_n + head0, or null
  float* partial_o;  // the item's partial rows (head 0 first, see decode.cu), or null
  float* partial_lse;
};

// Epilogue of an item: the four warps' states of each head merged through shared memory
// (o_s: [WARPS][HEADS][O_STRIDE] floats; m_s, d_s: [WARPS][HEADS]), normalized, scaled by
// v_scale and written to the sink. The caller makes o_s free (barrier) before the call; the
// call ends with a barrier.
constexpr int O_STRIDE = HEAD_DIM + 4;  // o row of the epilogue (floats)
RTC_DEVICE void finish_item(State (&st)[HEAD_TILES][2], float* o_s, float* m_s, float* d_s,
                            const ItemSink& sink, int heads, float v_scale, int warp, int g,
                            int t) {
#pragma unroll
  for (int nt = 0; nt < HEAD_TILES; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      State& s = st[nt][j];
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) s.d += __shfl_xor_sync(0xffffffffu, s.d, off);
      const int h = 8 * nt + 2 * t + j;
      if (g == 0) m_s[warp * HEADS + h] = s.m, d_s[warp * HEADS + h] = s.d;
      float* row = o_s + (warp * HEADS + h) * O_STRIDE;
#pragma unroll
      for (int c = 0; c < BLOCKS; ++c) {
        row[o_dim(c, g, false)] = s.o[2 * c];
        row[o_dim(c, g, true)] = s.o[2 * c + 1];
      }
    }
  __syncthreads();
  for (int i = threadIdx.x; i < heads * VECS; i += THREADS) {
    const int h = i / VECS, d = (i % VECS) * 4;
    AttentionState<4> acc;
    acc.init();
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      AttentionState<4> part;
      part.m = m_s[w * HEADS + h];
      part.d = d_s[w * HEADS + h];
      const float4 v = *reinterpret_cast<const float4*>(o_s + (w * HEADS + h) * O_STRIDE + d);
      part.o[0] = v.x, part.o[1] = v.y, part.o[2] = v.z, part.o[3] = v.w;
      acc.merge(part);
    }
    acc.normalize();
    const float4 out = make_float4(acc.o[0] * v_scale, acc.o[1] * v_scale, acc.o[2] * v_scale,
                                   acc.o[3] * v_scale);
    if (sink.partial_o == nullptr) {
      OT* dst = sink.o + h * sink.o_stride_h + d;
      dst[0] = from_float<OT>(out.x), dst[1] = from_float<OT>(out.y);
      dst[2] = from_float<OT>(out.z), dst[3] = from_float<OT>(out.w);
      if (sink.lse != nullptr && d == 0) sink.lse[h] = acc.lse();
    } else {
      *reinterpret_cast<float4*>(sink.partial_o + h * HEAD_DIM + d) = out;
      if (d == 0) sink.partial_lse[h] = acc.lse();
    }
  }
  __syncthreads();
}

// Merge `count` partials of this CTA's heads (contiguous rows from `first`: partial k, head h
// at row first + k * heads + h) in order and write the output row. With M = max_k lse_k and
// w_k = 2^(lse_k - M): o = sum_k w_k o_k / sum_k w_k, lse = M + log2(sum_k w_k); empty partials
// (lse = -inf) weigh 0. The partials pass through the ring (RING_BYTES) a group at a
// time, every copy of a group in flight at once; the weights are independent, so there is no
// chain of dependent merges. Barriers inside; the caller makes the ring free first.
RTC_DEVICE void merge_partials(unsigned char* ring, const float* partial_o,
                               const float* partial_lse, int64_t first, int count, int heads,
                               OT* o, int64_t o_stride_h, float* lse) {
  constexpr int ITEMS = (HEADS * VECS + THREADS - 1) / THREADS;  // (head, 4 dims) per thread
  static_assert(RING_BYTES >= HEADS * (HEAD_DIM + 1) * 4, "one partial fits in the ring");
  const int row_floats = heads * HEAD_DIM;  // one partial of this CTA's heads
  const int group = RING_BYTES / ((row_floats + heads) * 4);
  const uint32_t ring_addr = smem_addr(ring);
  const float* po_s = reinterpret_cast<const float*>(ring);  // [group][heads][HEAD_DIM]
  float* pl_s = reinterpret_cast<float*>(ring) + group * row_floats;  // [group][heads]
  AttentionState<4> acc[ITEMS];
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) acc[j].init();
  for (int k0 = 0; k0 < count; k0 += group) {
    const int n = min(group, count - k0);
    const int64_t at = first + static_cast<int64_t>(k0) * heads;
    const float* src = partial_o + at * HEAD_DIM;  // n partials, contiguous
    for (int c = threadIdx.x; c < n * row_floats / 4; c += THREADS)
      cp_async_16(ring_addr + 16 * c, src + 4 * c, true);
    cp_async_commit();
    for (int i = threadIdx.x; i < n * heads; i += THREADS) pl_s[i] = __ldcg(partial_lse + at + i);
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
      const int i = threadIdx.x + j * THREADS;
      if (i < heads * VECS) {
        const int h = i / VECS, d = (i % VECS) * 4;
        float group_max = neg_inf();
#pragma unroll 8
        for (int k = 0; k < n; ++k) group_max = fmaxf(group_max, pl_s[k * heads + h]);
        const float off = acc[j].rescale(group_max);
#pragma unroll 4
        for (int k = 0; k < n; ++k) {
          const float w = fast_exp2(pl_s[k * heads + h] - off);  // 0 for an empty partial
          const float4 v = *reinterpret_cast<const float4*>(po_s + (k * heads + h) * HEAD_DIM + d);
          acc[j].d += w;  // an empty partial's o is 0 (written so), so w * v adds nothing
          acc[j].o[0] = fmaf(w, v.x, acc[j].o[0]), acc[j].o[1] = fmaf(w, v.y, acc[j].o[1]);
          acc[j].o[2] = fmaf(w, v.z, acc[j].o[2]), acc[j].o[3] = fmaf(w, v.w, acc[j].o[3]);
        }
      }
    }
    __syncthreads();  // the next group overwrites the ring
  }
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = threadIdx.x + j * THREADS;
    if (i < heads * VECS) {
      const int h = i / VECS, d = (i % VECS) * 4;
      acc[j].normalize();
      OT* dst = o + h * o_stride_h + d;
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[e] = from_float<OT>(acc[j].o[e]);
      if (lse != nullptr && d == 0) lse[h] = acc[j].lse();
    }
  }
}
