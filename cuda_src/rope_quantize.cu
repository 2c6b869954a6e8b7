// RoPE from a cos/sin table and fp8 quantization of q and k in one launch (rope_quantize_fp8),
// and with APPEND the quantized k (and v) written into a paged cache in the same launch
// (rope_quantize_fp8_append_paged_kv_cache).
//   q and k come split: rotary parts [nnz, H, ROPE_DIM], the rest [nnz, H, NOPE_DIM].
//   c, s = cos_sin_cache[pos][:R/2], cos_sin_cache[pos][R/2:]  (float32 [max_pos, R], R = ROPE_DIM)
//   non-interleaved: x'[i] = x[i] c[i] - x[i + R/2] s[i],  x'[i + R/2] = x[i + R/2] c[i] + x[i] s[i]
//   interleaved:     x'[2i] = x[2i] c[i] - x[2i + 1] s[i], x'[2i + 1] = x[2i + 1] c[i] + x[2i] s[i]
//   out = fp8(scale * x'), rounded to nearest and saturated to the type's finite range (NaN
//   stays NaN); scale_q for q's parts, scale_kv for k's and v's.
//   APPEND: token t of request b = batch_indices[t] at position p = positions[t] goes to page
//   kv_indices[kv_indptr[b] + p / page_size], slot p % page_size: its k rotary part to the
//   rotary cache and the rest to the other (GQA: one K cache row, rotary dims first; MLA: kpe
//   and ckv caches), v (WITH_V) to the V cache. A token with b < 0 or p < 0 is padding: its q
//   rows are written as zeros and nothing else.
//   Bad entries are reported (bad_index.cuh) and not followed: a position outside the table
//   (its rotary dims are quantized unrotated); with APPEND, b >= B, a page past its request's,
//   a kv_indptr entry leading outside kv_indices or a page outside the cache (its k and v are
//   not written).
// Mapping: one thread per unit of VEC elements of a row segment; grid (nnz, unit blocks): a
// token's units are its q heads' (rotary units, then the rest), its k heads' (likewise), then
// its v heads'. The partner half of a non-interleaved pair is a second load of the row.
// Prelude: T (q, k, v), OT (the fp8 out type), POS_T (pos_ids), ROW_IDX (batch_indices,
// positions), IDX (kv_indices, kv_indptr), ROPE_DIM, NOPE_DIM, VEC, THREADS, INTERLEAVE,
// APPEND, WITH_V, the BadIndex enum.
#include "bad_index.cuh"

constexpr int HALF = ROPE_DIM / 2;
constexpr int ROPE_UNITS = ROPE_DIM / VEC, NOPE_UNITS = NOPE_DIM / VEC;
constexpr int HEAD_UNITS = ROPE_UNITS + NOPE_UNITS;  // a q or k head's units
constexpr int V_UNITS = WITH_V ? (ROPE_DIM + NOPE_DIM) / VEC : 0;
static_assert(ROPE_DIM % 2 == 0 && ROPE_DIM % VEC == 0 && NOPE_DIM % VEC == 0, "whole units");
static_assert(INTERLEAVE ? VEC % 2 == 0 : HALF % VEC == 0, "a unit never straddles a pair's halves");
static_assert(is_fp8<OT>(), "the outputs are fp8");
static_assert(!WITH_V || APPEND, "v goes to a cache only");

using TVec = Vec<T, VEC>;
// VEC fp8 bytes as one store (VEC 1 to 16)
using OutWord = Conditional<VEC == 16, uint4, Conditional<VEC == 8, uint2, Conditional<VEC == 4,
                uint32_t, Conditional<VEC == 2, uint16_t, uint8_t>>>>;

struct RopeQuantParams {
  const T* q_rope;             // [nnz, Hq, ROPE_DIM] strides (q_rope_tok, q_rope_head, 1)
  const T* k_rope;             // [nnz, Hk, ROPE_DIM] (MLA: Hk = 1, k_rope_head 0)
  const T* q_nope;             // [nnz, Hq, NOPE_DIM] (NOPE_DIM > 0)
  const T* k_nope;             // [nnz, Hk, NOPE_DIM]
  const T* v;                  // WITH_V: [nnz, Hk, ROPE_DIM + NOPE_DIM]
  OT* q_rope_out;              // [nnz, Hq, ROPE_DIM] strides (qr_out_tok, qr_out_head, 1)
  OT* q_nope_out;              // [nnz, Hq, NOPE_DIM] strides (qn_out_tok, qn_out_head, 1)
  OT* k_rope_out;              // k's rotary part: [nnz, Hk, ROPE_DIM] at t * kr_tok + h *
                               // kr_head; APPEND: the cache at page * kr_page + slot * kr_tok
                               // + h * kr_head (elements: one byte each)
  OT* k_nope_out;              // the rest, likewise (kn_*)
  OT* v_out;                   // WITH_V: the V cache at page * v_page + slot * v_slot + h * v_hd
  const float* cos_sin_cache;  // [max_pos, ROPE_DIM], dense
  const POS_T* pos_ids;        // [nnz]
  const ROW_IDX* batch_indices;  // APPEND: [nnz]
  const ROW_IDX* positions;      // APPEND: [nnz]
  const IDX* kv_indices;         // APPEND: [num_indices]
  const IDX* kv_indptr;          // APPEND: [B + 1]
  BadIndexRecord* bad;           // this device's record of bad entries
  BadIndexRecord* bad_host;      // its host copy (pinned host memory, mapped)
  int64_t q_rope_tok, q_rope_head, q_nope_tok, q_nope_head;
  int64_t k_rope_tok, k_rope_head, k_nope_tok, k_nope_head, v_tok, v_head;
  int64_t qr_out_tok, qr_out_head, qn_out_tok, qn_out_head;
  int64_t kr_tok, kr_head, kn_tok, kn_head, kr_page, kn_page, v_page, v_slot, v_hd;
  int num_q_heads, num_k_heads, max_pos;
  int page_size, batch_size, num_indices, num_pages;
  float scale_q, scale_kv;
};

// scale * x as VEC fp8 bytes, stored at dst (VEC-byte aligned).
RTC_DEVICE void store_fp8(OT* dst, const float (&x)[VEC], float scale) {
  union {
    OutWord word;
    OT e[VEC];
  } out;
#pragma unroll
  for (int j = 0; j < VEC; ++j) out.e[j] = from_float<OT>(x[j] * scale);
  *reinterpret_cast<OutWord*>(dst) = out.word;
}

RTC_DEVICE void widen(float (&x)[VEC], const TVec& in) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) x[j] = to_float(in[j]);
}

// Elements [e0, e0 + VEC) of a rotary row `row` rotated by table row `cs` (null: unrotated).
RTC_DEVICE void rotate(float (&x)[VEC], const T* row, int e0, const float* cs) {
  TVec own;
  own.load(row + e0);
  widen(x, own);
  if (cs == nullptr) return;
  if constexpr (INTERLEAVE) {
#pragma unroll
    for (int j = 0; j < VEC / 2; ++j) {
      const float c = cs[e0 / 2 + j], s = cs[HALF + e0 / 2 + j];
      const float a = x[2 * j], b = x[2 * j + 1];
      x[2 * j] = a * c - b * s;
      x[2 * j + 1] = b * c + a * s;
    }
  } else {
    const bool first = e0 < HALF;
    const int i0 = first ? e0 : e0 - HALF;  // the pair's index
    TVec partner;
    partner.load(row + (first ? e0 + HALF : e0 - HALF));
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float c = cs[i0 + j], s = cs[HALF + i0 + j], y = to_float(partner[j]);
      x[j] = first ? x[j] * c - y * s : x[j] * c + y * s;
    }
  }
}

// APPEND: the token's (page, slot) in the cache, or page -1 where nothing is to be written
// (padding: silently; a bad entry: reported by `reporter`).
struct Slot {
  int64_t page;
  int slot;
};

RTC_DEVICE Slot cache_slot(const RopeQuantParams& p, int t, bool reporter) {
  const ROW_IDX b_entry = p.batch_indices[t], p_entry = p.positions[t];
  if (b_entry < 0 || p_entry < 0) return {-1, 0};  // padding
  if (b_entry >= p.batch_size) {
    if (reporter) {
      report_bad_index(p.bad, p.bad_host, BadIndex::QUANT_BATCH_INDICES, t,
                       saturate_int(b_entry), p.batch_size);
    }
    return {-1, 0};
  }
  const int b = int(b_entry);
  const int64_t begin = int64_t(p.kv_indptr[b]), end = int64_t(p.kv_indptr[b + 1]);
  const int64_t page_in_request = int64_t(p_entry) / p.page_size;
  const int64_t pages = end - begin;
  if (page_in_request >= pages) {
    if (reporter) {
      const int64_t limit = (pages > 0 ? pages : 0) * p.page_size;
      report_bad_index(p.bad, p.bad_host, BadIndex::QUANT_POSITIONS, t, saturate_int(p_entry),
                       saturate_int(limit));
    }
    return {-1, 0};
  }
  const int64_t entry = begin + page_in_request;  // of kv_indices
  if (begin < 0 || entry >= p.num_indices) {
    if (reporter) {
      report_bad_index(p.bad, p.bad_host, BadIndex::QUANT_KV_INDPTR, b, saturate_int(entry),
                       p.num_indices);
    }
    return {-1, 0};
  }
  const IDX page = p.kv_indices[entry];
  if (page < 0 || page >= p.num_pages) {
    if (reporter) {
      report_bad_index(p.bad, p.bad_host, BadIndex::QUANT_KV_INDICES, saturate_int(entry),
                       saturate_int(page), p.num_pages);
    }
    return {-1, 0};
  }
  return {int64_t(page), int(int64_t(p_entry) - page_in_request * p.page_size)};
}

extern "C" __global__ void __launch_bounds__(THREADS)
    rope_quantize_kernel(const __grid_constant__ RopeQuantParams p) {
  wait_for_previous_grid();
  const int t = blockIdx.x;
  const int q_units = p.num_q_heads * HEAD_UNITS, k_units = p.num_k_heads * HEAD_UNITS;
  const int u = blockIdx.y * THREADS + threadIdx.x;
  if (u >= q_units + k_units + p.num_k_heads * V_UNITS) return;
  const bool is_q = u < q_units, is_k = !is_q && u < q_units + k_units;
  const int r = is_q ? u : is_k ? u - q_units : u - q_units - k_units;
  const int h = is_q || is_k ? r / HEAD_UNITS : r / (V_UNITS > 0 ? V_UNITS : 1);
  const int c = is_q || is_k ? r - h * HEAD_UNITS : r - h * V_UNITS;  // unit within the head
  const bool rotary = (is_q || is_k) && c < ROPE_UNITS;
  const int e0 = (rotary || !(is_q || is_k) ? c : c - ROPE_UNITS) * VEC;  // within its part
  const bool reporter = u == 0;  // one thread a token reports its bad entries

  Slot dst{0, 0};
  if constexpr (APPEND) {
    if (p.batch_indices[t] < 0 || p.positions[t] < 0) {  // padding
      if (is_q) {  // q rows of a padding token: zeros
        float zero[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) zero[j] = 0.f;
        OT* out = rotary ? p.q_rope_out + t * p.qr_out_tok + h * p.qr_out_head + e0
                         : p.q_nope_out + t * p.qn_out_tok + h * p.qn_out_head + e0;
        store_fp8(out, zero, 1.f);
      }
      return;
    }
    if (!is_q || reporter) dst = cache_slot(p, t, reporter);
    if (!is_q && dst.page < 0) return;  // bad entries: k and v not written
  }

  float x[VEC];
  if (rotary) {
    const int64_t pos = int64_t(p.pos_ids[t]);
    const bool in_table = pos >= 0 && pos < p.max_pos;
    if (!in_table && reporter) {
      report_bad_index(p.bad, p.bad_host, BadIndex::QUANT_COS_SIN_POSITIONS, t, saturate_int(pos),
                       p.max_pos);
    }
    const float* cs = in_table ? p.cos_sin_cache + pos * ROPE_DIM : nullptr;
    const T* row = is_q ? p.q_rope + t * p.q_rope_tok + h * p.q_rope_head
                        : p.k_rope + t * p.k_rope_tok + h * p.k_rope_head;
    rotate(x, row, e0, cs);
  } else {
    const T* src = is_q ? p.q_nope + t * p.q_nope_tok + h * p.q_nope_head
                 : is_k ? p.k_nope + t * p.k_nope_tok + h * p.k_nope_head
                        : p.v + t * p.v_tok + h * p.v_head;
    TVec in;
    in.load(src + e0);
    widen(x, in);
  }

  OT* out;
  if (is_q) {
    out = rotary ? p.q_rope_out + t * p.qr_out_tok + h * p.qr_out_head
                 : p.q_nope_out + t * p.qn_out_tok + h * p.qn_out_head;
  } else if constexpr (APPEND) {
    out = !is_k ? p.v_out + dst.page * p.v_page + dst.slot * p.v_slot + h * p.v_hd
        : rotary ? p.k_rope_out + dst.page * p.kr_page + dst.slot * p.kr_tok + h * p.kr_head
                 : p.k_nope_out + dst.page * p.kn_page + dst.slot * p.kn_tok + h * p.kn_head;
  } else {
    out = rotary ? p.k_rope_out + t * p.kr_tok + h * p.kr_head
                 : p.k_nope_out + t * p.kn_tok + h * p.kn_head;
  }
  store_fp8(out + e0, x, is_q ? p.scale_q : p.scale_kv);
}
