// Batch prefill / append attention over a paged (or ragged) KV cache on tensor cores, one work
// item (plan/prefill.py) per CTA row of the grid:
//   o[i, h] = softmax_j(transform(q[i, h] . k[j, h / g])) @ V,  lse = log2(sum_j e^(s_j))
//   query i of a request sits at key position i + kv_len - qo_len (bottom-right alignment);
//   key j is visible to it when j <= its position (CAUSAL) and within the window; with
//   CUSTOM_MASK, when bit i * kv_len + j of the request's packed mask is set (and within the
//   window; CAUSAL is then off).
// Grid: blockIdx.x = kv head, blockIdx.y = work item: a tile of TILE_ROWS packed query rows
// (row r = query r / group_size, head r % group_size of the kv head's group) over the keys
// [kv_begin, kv_end) of one KV chunk. Items past the plan's count exit at once.
// Block: TILE_ROWS / WARP_ROWS row warps; row warp w owns rows WARP_ROWS w.. in blocks of 16
// (ROW_BLOCKS of them: each K/V fragment a warp loads feeds that many MMAs) and keeps, per
// thread, the softmax state of rows g and g + 8 of each block (FA2 style). An 8- or 16-row
// tile (decode-like batches) has four warps on its rows instead, each taking a quarter of
// every K/V tile's keys; their states merge through shared memory at the end (KV_WARPS); an
// 8-row tile puts the keys on the MMAs' M side (KEY_MAJOR, prefill_key_major.cuh: thread rows
// 2t and 2t + 1). In each warp: S = Q K^T and O += P V by mma.m16n8k16,
// operands through ldmatrix from swizzled tiles (prefill_fragments.cuh), P rounded to the
// 16-bit type. K/V tiles of KV_TILE keys stream through a STAGES-deep cp.async ring, starting
// at the KV_TILE-aligned key below kv_begin (a row's reduction order depends on its own keys
// only). Shared memory: the Q tile (at the end, o's rows on their way out in 16-byte pieces),
// the ring, a flag; SMEM_BYTES in all.
// A tile with several items writes fp32 partials (o, lse) to its slots; the last of its CTAs
// (an atomic counter per (tile, kv head), reset by it) merges them in chunk order.
// fp8 KV (KVT e4m3 / e5m2) lands in the ring as bytes and is widened exactly: to QT into a
// staging tile as each tile lands, or (FP8_DIRECT) to fp16 in registers as the MMAs load it;
// k_scale folds into qk_scale, v_scale into the output.
// Prelude: QT, KVT (QT or fp8), OT, HEAD_DIM (q's and k's), HEAD_DIM_VO (v's and o's: HEAD_DIM,
// or fewer, as DeepSeek's 192 / 128, with 16-bit KV, without RoPE), TILE_ROWS, KV_TILE,
// STAGES, CAUSAL, CUSTOM_MASK, POS_ENCODING (PosEncoding: NONE, ROPE_LLAMA or ALIBI), SOFT_CAP,
// SMEM_BYTES, RAGGED (K/V rows of a request contiguous from its one page id: paged_kv.cuh's
// ONE_PAGE), WARP_ROWS (16 or 32),
// WGMMA (sm_90a: each warpgroup's 64 rows multiply by wgmma, S = Q K^T with Q and K from
// shared memory and O += P V with P from registers; the Q, K and V tiles then use wgmma's
// canonical layout, wgmma.cuh; 16-row warps, 64-key tiles, 16-bit KV, no in-kernel RoPE),
// MIN_CTAS (the launch bounds' CTAs per SM, registers then capped at 64K / (MIN_CTAS THREADS);
// 0: no cap asked), FP8_DIRECT (below), MLA (below).
// MLA (DeepSeek's latent attention, the absorbed form: one latent KV head shared by all Hq
// heads, group_size = Hq): q's rows are q (MLA_CKV dims) then q_pe (64), K's rows ckv (MLA_CKV,
// from k_cache) then kpe (64, from kpe_cache), V = ckv = the first MLA_CKV dims of the K tile
// (no V in the ring). DIM_WARPS = 4 warps share each row warp's 16 rows (16- or 32-row tiles):
// they split S's keys, pool
// the softmax through shared memory and each accumulates its quarter of O's HEAD_DIM_VO =
// MLA_CKV dims (WARP_DIMS; prefill_mla.cuh), writing them (warp 0 of the four the LSE).
// ROPE_LLAMA rotates the Q tile once and each K tile as it lands, in shared memory (16-bit
// results): dims d and d + HEAD_DIM / 2 of a row at position x turn by 2 pi x f_d, f from the
// plan's header (query positions as above, key j at j).
#include "mma.cuh"
#include "attention_state.cuh"
#include "paged_kv.cuh"
#include "paged_rows.cuh"
#include "variant.cuh"
#include "wgmma.cuh"

// An 8-row tile (KEY_MAJOR: decode, a query row per head of a GQA group of up to 8) puts the
// keys on the MMAs' M side and its rows on their N side, S^T = K Q^T and O^T += V^T P^T (16 keys
// x 8 rows, prefill_key_major.cuh), where a 16-row tile would multiply padding rows: a thread
// then holds rows 2t and 2t + 1 (not g and g + 8).
constexpr bool KEY_MAJOR = TILE_ROWS == 8;
constexpr int ROW_BLOCKS = KEY_MAJOR ? 1 : WARP_ROWS / 16;  // 16-row MMA blocks of a warp
constexpr int ROWS = 2 * ROW_BLOCKS;               // rows of a thread (g and g + 8 of each block)
constexpr int ROW_WARPS = TILE_ROWS / WARP_ROWS;   // warps along the rows
constexpr int DIM_WARPS = MLA ? 4 : 1;  // warps on the same rows and keys, splitting O's dims
constexpr int KV_WARPS = TILE_ROWS <= 16 && !MLA ? 4 : 1;  // on the same rows, splitting keys
constexpr int WARPS = ROW_WARPS * KV_WARPS * DIM_WARPS;
constexpr int THREADS = 32 * WARPS;
constexpr int WARP_KEYS = KV_TILE / KV_WARPS;      // keys of each K/V tile a warp takes
constexpr bool ALIBI = POS_ENCODING == PosEncoding::ALIBI;
constexpr bool ROPE = POS_ENCODING == PosEncoding::ROPE_LLAMA;
constexpr bool FP8 = is_fp8<KVT>();
constexpr __nv_fp8_interpretation_t FP8_KIND = fp8_kind<KVT>();
// fp8 in a 16-row tile without RoPE, whose warps each read only their own keys: with
// FP8_DIRECT the MMAs read K and V straight from the ring, widened in registers
// (prefill_fp8_fragments.cuh); the other fp8 tiles are widened whole into staging tiles
// between barriers (STAGED).
static_assert(!FP8_DIRECT || (FP8 && KV_WARPS > 1 && !ROPE),
              "FP8_DIRECT: fp8 KV in 16-row tiles, no RoPE");
constexpr bool STAGED = FP8 && !FP8_DIRECT;
// A plain logit (no ALiBi, no soft cap) is x = s * scale: the scale folds into the exp2 (one
// FFMA, exp2(s * scale - m)) and the row maxima are taken of the raw scores, with scale > 0
// (a negative qk_scale negates the Q tile instead: see fold_scale()). Not at head_dim 64,
// where it tips ptxas into a 128-register allocation that spills on sm_80.
constexpr bool FOLD = !ALIBI && !SOFT_CAP && HEAD_DIM >= 128;
constexpr int ROW_BYTES = HEAD_DIM * 2;      // a 16-bit Q or K row (as the MMAs read them)
constexpr int WARP_DIMS = HEAD_DIM_VO / DIM_WARPS;  // O's dims a warp accumulates
constexpr int O_ROW_BYTES = WARP_DIMS * 2;  // a warp's piece of an o row on its way out
// the V tile's rows as the MMAs read them (MLA: the K tile's); a V row in the ring (MLA: none)
constexpr int V_ROW_BYTES = MLA ? HEAD_DIM * 2 : HEAD_DIM_VO * 2;
constexpr int KV_ROW_BYTES = HEAD_DIM * sizeof(KVT);  // a K row in the ring (and V's, fp8)
constexpr int V_RING_ROW_BYTES = MLA ? 0 : HEAD_DIM_VO * sizeof(KVT);
constexpr int CHUNKS = ROW_BYTES / 16;       // 16-byte pieces of a Q or K row
constexpr int K_STEPS = HEAD_DIM / 16;       // k-steps of Q K^T
constexpr int DIM_TILES = WARP_DIMS / 8;     // n-tiles of O a warp holds
constexpr int KEY_TILES = WARP_KEYS / 8;     // n-tiles of S per warp
constexpr int HEADER_INTS = 4;               // plan: num_work, 3 spare, then RoPE frequencies
constexpr int ITEMS_AT = HEADER_INTS + HEAD_DIM;  // (hi, lo) float pairs, then the work items
// Q fragments held in registers for the whole item, or re-read from shared memory per k-step
constexpr bool Q_IN_REGS = HEAD_DIM <= 128 && ROW_BLOCKS == 1 && !WGMMA;
constexpr int Q_BYTES = TILE_ROWS * ROW_BYTES;
constexpr int TILE_BYTES = KV_TILE * ROW_BYTES;          // a 16-bit K tile (V's, fp8)
constexpr int RING_TILE_BYTES = KV_TILE * KV_ROW_BYTES;  // a K tile in the ring
constexpr int STAGE_BYTES = RING_TILE_BYTES + KV_TILE * V_RING_ROW_BYTES;  // K, then V
constexpr int RING_BYTES = STAGES * STAGE_BYTES;
constexpr int STAGING_BYTES = STAGED ? 2 * TILE_BYTES : 0;  // the widened K and V
// MLA's exchange (prefill_mla.cuh): P [16][KV_TILE] 16-bit, then the key groups' row maxima
// and sums
constexpr int MLA_GROUPS = KV_TILE / 16;
constexpr int P_ROW_BYTES = KV_TILE * 2;
constexpr int MLA_WARP_XCHG = 16 * P_ROW_BYTES + 2 * MLA_GROUPS * 16 * 4;  // a row warp's
constexpr int MLA_XCHG_BYTES = MLA ? ROW_WARPS * MLA_WARP_XCHG : 0;
constexpr int FREQ_BYTES = ROPE ? HEAD_DIM / 2 * 8 : 0;
constexpr int MLA_CKV = 512;  // MLA: the latent (ckv) dims of q and k; the rest are RoPE's
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 192 || HEAD_DIM == 256 ||
                  (MLA && HEAD_DIM == MLA_CKV + 64),
              "head_dim 64, 128, 192 or 256; MLA 512 + 64");
static_assert(!MLA || (HEAD_DIM_VO == MLA_CKV && WARP_ROWS == 16 && !FP8 && !ROPE && !ALIBI &&
                       !WGMMA && !RAGGED && !CUSTOM_MASK),
              "MLA: V = ckv, 16-row warps, 16-bit KV, a paged cache, mma.sync, no ALiBi or mask");
static_assert(HEAD_DIM_VO == HEAD_DIM ||
                  (HEAD_DIM_VO % 64 == 0 && HEAD_DIM_VO < HEAD_DIM && !FP8 && !ROPE),
              "v's head_dim: q's, or fewer (whole 64s) with 16-bit KV, no RoPE");
static_assert(TILE_ROWS == 8 || TILE_ROWS == 16 || TILE_ROWS == 64 || TILE_ROWS == 128 ||
                  (MLA && TILE_ROWS == 32),
              "8, 16, 64 or 128 rows (MLA: 16 or 32)");
static_assert(KEY_MAJOR ? WARP_ROWS == 8 && !MLA && !WGMMA
                        : (WARP_ROWS == 16 || WARP_ROWS == 32) && TILE_ROWS % WARP_ROWS == 0 &&
                              (TILE_ROWS > 16 || WARP_ROWS == 16),
              "8 rows a warp in 8-row tiles, else 16 or 32; four warps at 16");
static_assert(WARP_KEYS % 16 == 0 && STAGES >= 2, "whole 16-key steps, double buffering");
static_assert(STAGES <= 3, "the row table's two buffers cover two tiles ahead");
static_assert(FP8 || IsSame<QT, KVT>::value, "16-bit KV must match q's dtype");
static_assert(!(CAUSAL && CUSTOM_MASK), "a custom mask replaces the causal one");
static_assert(!WGMMA || (WARP_ROWS == 16 && TILE_ROWS % 64 == 0 && KV_TILE == 64 && !FP8 && !ROPE),
              "wgmma: warpgroups of 64 rows, 64-key tiles, 16-bit KV, RoPE outside the kernel");

// Byte offset of chunk `chunk` of row `row` in a [ROWS][ROW_BYTES] Q, K or V tile as the MMAs
// read it: XOR-swizzled rows for ldmatrix, or wgmma's canonical layout.
template <int ROWS>
RTC_DEVICE uint32_t mma_tile_offset(int row, int chunk) {
  if constexpr (WGMMA)
    return wgmma_tile_offset<ROWS, ROW_BYTES>(row, chunk);
  else
    return tile_offset<ROW_BYTES>(row, chunk);
}

// The MMAs' input type: QT, or fp16 where they read fp8 K/V from the ring (one cvt widens a
// pair; a bf16 Q tile is made fp16 once an item: Q_HALF).
using MT = Conditional<FP8_DIRECT, half, QT>;
constexpr bool Q_HALF = FP8_DIRECT && IsBf16<QT>::value;
// The K/V rows' stream: a table of row offsets over a paged cache, rows from one start ragged.
template <bool R>
struct KvRowsOf {
  using type = PagedRowTable<KV_TILE, KV_ROW_BYTES, V_RING_ROW_BYTES, THREADS, WGMMA,
                             MLA ? MLA_CKV * 2 : 0>;
};
template <>
struct KvRowsOf<true> {
  using type = RaggedRows<KV_TILE, KV_ROW_BYTES, V_RING_ROW_BYTES, THREADS, WGMMA>;
};
using KvRows = typename KvRowsOf<RAGGED>::type;
constexpr int TABLE_BYTES = KvRows::BYTES;
static_assert(Q_BYTES + RING_BYTES + STAGING_BYTES + FREQ_BYTES + TABLE_BYTES + MLA_XCHG_BYTES +
                      16 ==
                  SMEM_BYTES,
              "layout");
// o of one row in a thread: dims 8n + 2t, 8n + 2t + 1 of n-tile n; KEY_MAJOR: o_dim_of(c, g, e)
// at o[2c + e] for each 16-dim block c
constexpr int O_FLOATS = KEY_MAJOR ? DIM_TILES : 2 * DIM_TILES;
using State = AttentionState<O_FLOATS>;

#include "prefill_fragments.cuh"

#include "prefill_fp8_fragments.cuh"

#include "prefill_item.cuh"

struct PrefillParams {
  const QT* q;            // [nnz_q, Hq, HEAD_DIM], strides (q_stride_n, q_stride_h, 1)
  const char* k_cache;    // K(page, slot, head) at page * k_page + slot * k_token
  const char* v_cache;    //   + head * k_head bytes (NHD/HND; ragged: pages of one token row)
  OT* o;                  // [nnz_q, Hq, HEAD_DIM_VO], strides (o_stride_n, o_stride_h, 1)
  float* lse;             // [nnz_q, Hq], strides (lse_stride_n, 1); may be null
  const int* plan;        // [ITEMS_AT] + PrefillWorkItem[capacity] + page ids
  float* partial_o;       // [slots, Hkv, TILE_ROWS, HEAD_DIM_VO]
  float* partial_lse;     // [slots, Hkv, TILE_ROWS]
  int* counters;          // [tiles, Hkv], zero between launches
  const uint8_t* mask;    // CUSTOM_MASK: packed bits, little-endian within a byte: (query i,
                          //   key j) of a request at bit 8 * mask_byte + i * kv_len + j
  int64_t q_stride_n, q_stride_h, o_stride_n, o_stride_h, lse_stride_n;
  int64_t k_page, k_token, k_head, v_page, v_token, v_head;
  int num_qo_heads, group_size, page_size;
  uint32_t div_magic;     // n / page_size == (umulhi(n, div_magic) + n) >> div_shift
  int div_shift;
  uint32_t group_magic;   // n / group_size, the same way
  int group_shift;
  int window_left;        // keys before position - window_left are hidden; -1: no window
  float qk_scale;         // sm_scale * q_scale * k_scale
  float soft_cap;         // 0: none
  float v_scale;
  // MLA: q_pe [nnz_q, Hq, 64], strides (qpe_stride_n, qpe_stride_h, 1); kpe rows at kpe_cache +
  // page * v_page + slot * v_token (the v_* strides are kpe's: V, ckv's part of K, is not
  // loaded apart); k_cache = ckv, k_head = 0
  const QT* q_pe;
  const char* kpe_cache;
  int64_t qpe_stride_n, qpe_stride_h;
};

#include "prefill_rows.cuh"

// Q rows of the tile into shared memory (zero rows past the request), one commit group.
RTC_DEVICE void load_q_tile(uint32_t q_tile, const PrefillWorkItem& w, const PrefillParams& p,
                            int kv_head) {
  for (int i = threadIdx.x; i < TILE_ROWS * CHUNKS; i += THREADS) {
    const int row = i / CHUNKS, chunk = i % CHUNKS;
    const int packed = w.tile_row + row;
    const bool valid = packed < w.qo_len * p.group_size;
    const PackedRow r = unpack_row(packed, p);
    const QT* src;
    if constexpr (MLA)  // every head; q_pe's dims past the latent ones
      src = chunk < MLA_CKV / 8
                ? p.q + (w.qo_start + r.query) * p.q_stride_n + r.head * p.q_stride_h + chunk * 8
                : p.q_pe + (w.qo_start + r.query) * p.qpe_stride_n + r.head * p.qpe_stride_h +
                      (chunk - MLA_CKV / 8) * 8;
    else
      src = p.q + (w.qo_start + r.query) * p.q_stride_n +
            (kv_head * p.group_size + r.head) * p.q_stride_h + chunk * 8;
    cp_async_16(q_tile + mma_tile_offset<TILE_ROWS>(row, chunk), valid ? src : p.q, valid);
  }
  cp_async_commit();
}

#include "prefill_tiles.cuh"

#include "prefill_wgmma.cuh"

#include "prefill_mla.cuh"

#include "prefill_attend.cuh"

#include "prefill_key_major.cuh"

#include "prefill_epilogue.cuh"

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS)
    prefill_kernel(const __grid_constant__ PrefillParams p) {
  wait_for_previous_grid();
  extern __shared__ __align__(1024) unsigned char smem[];  // canonical tiles: 1024-aligned
  const int item = blockIdx.y;
  // Loaded before the count test so both loads overlap (padded slots are stale, unused).
  const PrefillWorkItem w = reinterpret_cast<const PrefillWorkItem*>(p.plan + ITEMS_AT)[item];
  if (item >= __ldg(p.plan)) return;
  const int kv_head = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row_warp = warp / (KV_WARPS * DIM_WARPS), kv_warp = warp / DIM_WARPS % KV_WARPS;
  const uint32_t q_tile = smem_addr(smem), ring = q_tile + Q_BYTES;
  unsigned char* staging = smem + Q_BYTES + RING_BYTES;
  float2* freq_s = reinterpret_cast<float2*>(staging + STAGING_BYTES);
  longlong2* table_s = reinterpret_cast<longlong2*>(staging + STAGING_BYTES + FREQ_BYTES);
  unsigned char* xchg = staging + STAGING_BYTES + FREQ_BYTES + TABLE_BYTES;  // MLA's exchange
  int* last_s = reinterpret_cast<int*>(xchg + MLA_XCHG_BYTES);
  if constexpr (ROPE)  // visible to all after the barrier below
    for (int i = threadIdx.x; i < HEAD_DIM / 2; i += THREADS)
      freq_s[i] = reinterpret_cast<const float2*>(p.plan + HEADER_INTS)[i];

  load_q_tile(q_tile, w, p, kv_head);
  constexpr int LOOK = STAGES - 1;
  const int key_first = w.kv_begin - w.kv_begin % KV_TILE;  // an aligned start: see the header
  const int num_tiles = w.kv_begin < w.kv_end ? (w.kv_end - key_first + KV_TILE - 1) / KV_TILE
                                              : 0;
  auto k_tile = [&](int stage) { return ring + stage * STAGE_BYTES; };
  auto v_tile = [&](int stage) { return ring + stage * STAGE_BYTES + RING_TILE_BYTES; };
  // The ring's first LOOK tiles; tile s's row offsets in table buffer s % 2 (paged_rows.cuh).
  KvRows kv;
  kv.init(p, w, kv_head, table_s);
  kv.prefetch(key_first);
#pragma unroll
  for (int s = 0; s < LOOK; ++s)
    if (s < num_tiles) kv.prepare(key_first + s * KV_TILE, s % 2, p);
  if constexpr (!RAGGED) __syncthreads();  // the tables written
#pragma unroll
  for (int s = 0; s < LOOK; ++s) {
    if (s < num_tiles) kv.issue(key_first + s * KV_TILE, s % 2, k_tile(s), v_tile(s));
    cp_async_commit();
  }
  if constexpr (!RAGGED) __syncthreads();  // the tables read: buffer LOOK % 2 is free
  if (LOOK < num_tiles) kv.prepare(key_first + LOOK * KV_TILE, LOOK % 2, p);

  cp_async_wait<LOOK>();  // the Q tile (the oldest group) landed
  if constexpr (WGMMA) fence_proxy_async();
  __syncthreads();
  if constexpr (ROPE) {
    const int shift = w.kv_len - w.qo_len, row0 = w.tile_row;
    rope_tile<TILE_ROWS>(smem, freq_s, [&](int r) { return unpack_row(row0 + r, p).query + shift; });
    __syncthreads();
  }
  LogitTransform<ALIBI, SOFT_CAP> transform;
  transform.init(p.qk_scale, p.soft_cap);
  if constexpr (FOLD) {
    transform.scale = fold_scale(p.qk_scale, smem);
    if (p.qk_scale < 0.f) {  // uniform: the negated tile is read below
      if constexpr (WGMMA) fence_proxy_async();
      __syncthreads();
    }
  }
  if constexpr (Q_HALF) {  // (after the negation, whose words each thread converts itself)
    q_tile_to_half(smem);
    __syncthreads();
  }
  uint32_t qf[Q_IN_REGS ? K_STEPS : 1][4];
  if constexpr (Q_IN_REGS)
#pragma unroll
    for (int c = 0; c < K_STEPS; ++c)
      if constexpr (KEY_MAJOR)
        load_q_key_major(qf[c], q_tile, c, lane);
      else
        load_q(qf[c], q_tile, WARP_ROWS * row_warp, c, lane);
  Rows rows;
  rows.init(w, p, kv_head, row_warp, g, t);
  State st[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) st[i].init();

  for (int tile = 0; tile < num_tiles; ++tile) {
    cp_async_wait<LOOK - 1>();
    if constexpr (WGMMA) fence_proxy_async();  // the tile, to the wgmma's async proxy
    __syncthreads();  // the tile landed for everyone; the stage refilled below is free
    const int next = tile + LOOK;
    if (next < num_tiles)
      kv.issue(key_first + next * KV_TILE, next % 2, k_tile(next % STAGES), v_tile(next % STAGES));
    cp_async_commit();
    // next + 1's offsets into the buffer next - 1 was issued from (before this barrier)
    if (next + 1 < num_tiles) kv.prepare(key_first + (next + 1) * KV_TILE, (next + 1) % 2, p);
    // The K and V the MMAs read: the ring's stage (16-bit, or fp8 read directly), or the
    // staging tiles the other fp8 tiles are widened into.
    unsigned char* ring_k = smem + Q_BYTES + (tile % STAGES) * STAGE_BYTES;
    unsigned char* k_mma = STAGED ? staging : ring_k;
    constexpr int V_AT = STAGED ? TILE_BYTES : MLA ? 0 : RING_TILE_BYTES;  // V after K (MLA: K)
    if constexpr (STAGED) {
      // (The barrier at the top of this iteration: the previous MMAs are done with it.)
      widen_tiles(staging, ring_k, ring_k + RING_TILE_BYTES);
      __syncthreads();
    }
    if constexpr (ROPE) {
      const int key0 = key_first + tile * KV_TILE;
      rope_tile<KV_TILE>(k_mma, freq_s, [&](int r) { return key0 + r; });
      __syncthreads();
    }
    if constexpr (MLA)
      mla_tile<MLA_GROUPS>(st, q_tile, smem_addr(k_mma), xchg + row_warp * MLA_WARP_XCHG,
                           key_first + tile * KV_TILE, rows, w, transform, p.window_left,
                           row_warp, lane);
    else if constexpr (KEY_MAJOR)
      attend_tile_key_major(st, qf, q_tile, smem_addr(k_mma), smem_addr(k_mma + V_AT),
                            key_first + tile * KV_TILE, rows, w, transform, p.window_left,
                            p.mask, kv_warp, lane);
    else
      attend_tile(st, qf, q_tile, smem_addr(k_mma), smem_addr(k_mma + V_AT),
                  key_first + tile * KV_TILE, rows, w, transform, p.window_left, p.mask,
                  row_warp, kv_warp, lane, t);
  }
  cp_async_wait<0>();
  if constexpr (KV_WARPS > 1) {
    __syncthreads();  // every warp is done with the ring: it holds the exchange
    combine_warps(st, reinterpret_cast<float*>(smem + Q_BYTES), kv_warp, lane);
  }
  if constexpr (KV_WARPS == 1) {
    if (w.slot < 0) {
      __syncthreads();  // every warp is past its last read of the Q tile, which stages o
      store_rows(st, w, p, smem, kv_head, row_warp, lane);
      return;
    }
  }
  if constexpr (FP8_DIRECT && !KEY_MAJOR)
    if (kv_warp == 0) unpermute_dims(st, lane);
  if constexpr (KEY_MAJOR) {
    if (kv_warp == 0) finish_rows_key_major(st, rows, w, p, kv_head, lane);
  } else {
    if (kv_warp == 0) finish_rows(st, rows, w, p, kv_head, row_warp, g, t);
  }
  if (w.slot < 0) return;

  // A split tile: the last of its items merges the partials. The barrier orders this CTA's
  // partial writes before thread 0's release; the last arrival's acquire orders every other
  // item's partials before the merge reads them (through L2: __ldcg).
  __syncthreads();
  if (threadIdx.x == 0) {
    int* counter = p.counters + w.tile * gridDim.x + kv_head;
    const bool last = atomic_add_acq_rel(counter, 1) == w.merge_count - 1;
    if (last) atomicExch(counter, 0);  // ready for the next launch
    *last_s = last;
  }
  __syncthreads();
  if (*last_s) merge_tile(w, p, kv_head);
}
