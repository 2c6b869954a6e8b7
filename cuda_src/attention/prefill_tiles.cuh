// The prefill kernel's transforms of whole tiles in shared memory (included by prefill.cu
// after its constants): fp8 K/V widened to the 16-bit type, RoPE on a tile's rows, and the
// Q tile negated for a negative softmax scale (fold_scale).
#pragma once

// fp8 K and V tiles of the ring widened to QT into the staging tiles (same swizzle, 16-bit
// rows): a thread converts 16 values (one ring chunk, two staging chunks) at a time.
RTC_DEVICE void widen_tiles(unsigned char* staging, const unsigned char* ring_k,
                            const unsigned char* ring_v) {
  constexpr int KV_CHUNKS = KV_ROW_BYTES / 16;
  for (int i = threadIdx.x; i < 2 * KV_TILE * KV_CHUNKS; i += THREADS) {
    const int which = i / (KV_TILE * KV_CHUNKS), row = i / KV_CHUNKS % KV_TILE;
    const int chunk = i % KV_CHUNKS;
    const unsigned char* src = (which ? ring_v : ring_k) + tile_offset<KV_ROW_BYTES>(row, chunk);
    unsigned char* dst = staging + which * TILE_BYTES;
    const uint4 bytes = *reinterpret_cast<const uint4*>(src);
    const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
    uint32_t out[8];
#pragma unroll
    for (int w = 0; w < 4; ++w)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        out[2 * w + h] = fp8x2_to_pair<QT, FP8_KIND>(words[w] >> (16 * h) & 0xffff);
    *reinterpret_cast<uint4*>(dst + tile_offset<ROW_BYTES>(row, 2 * chunk)) =
        make_uint4(out[0], out[1], out[2], out[3]);
    *reinterpret_cast<uint4*>(dst + tile_offset<ROW_BYTES>(row, 2 * chunk + 1)) =
        make_uint4(out[4], out[5], out[6], out[7]);
  }
}

// RoPE on the ROWS rows of a swizzled [ROWS][HEAD_DIM] tile in shared memory, in place: row r
// at position pos(r) (Q: its query's; K: its key's). A thread turns 8 dim pairs at a time.
template <int ROWS, typename Position>
RTC_DEVICE void rope_tile(unsigned char* tile, const float2* freq_s, Position pos) {
  constexpr int HALF = CHUNKS / 2;  // chunk c pairs with chunk c + HALF
  for (int i = threadIdx.x; i < ROWS * HALF; i += THREADS) {
    const int row = i / HALF, chunk = i % HALF;
    MT* lo_p = reinterpret_cast<MT*>(tile + tile_offset<ROW_BYTES>(row, chunk));
    MT* hi_p = reinterpret_cast<MT*>(tile + tile_offset<ROW_BYTES>(row, chunk + HALF));
    Vec<MT, 8> lo, hi;
    lo.load(lo_p), hi.load(hi_p);
    const int x = pos(row);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float2 cs = rope_cos_sin(x, freq_s[8 * chunk + e]);
      const float a = to_float(lo[e]), b = to_float(hi[e]);
      lo[e] = from_float<MT>(a * cs.x - b * cs.y);
      hi[e] = from_float<MT>(b * cs.x + a * cs.y);
    }
    lo.store(lo_p), hi.store(hi_p);
  }
}

// FOLD's scale: |qk_scale| log2(e), at least FLT_MIN (a zero scale then still gives every
// visible key the weight 2^0 and a masked one 2^-inf: exp2(s * FLT_MIN) is 1 to fp32 for any
// finite score, where -inf * 0 would be NaN). A negative qk_scale negates the Q tile in shared
// memory (the sign bits: exact) before its first read, so s * qk_scale = (-s) * |qk_scale|.
RTC_DEVICE float fold_scale(float qk_scale, unsigned char* q_tile) {
  if (qk_scale < 0.f) {
    for (int i = threadIdx.x; i < Q_BYTES / 16; i += THREADS) {
      uint4* word = reinterpret_cast<uint4*>(q_tile) + i;
      const uint4 x = *word;
      *word = make_uint4(x.x ^ 0x80008000u, x.y ^ 0x80008000u, x.z ^ 0x80008000u,
                         x.w ^ 0x80008000u);
    }
  }
  return fmaxf(fabsf(qk_scale) * LOG2E, 1.17549435e-38f);
}

// The Q tile's bf16 values as fp16, in place (Q_HALF: the MMAs over fp8 K/V take fp16, into
// which fp8 widens in one cvt, as in decode.cu). Exact for |q| in fp16's normal range; beyond
// 65504 a value becomes inf (bf16 reaches 3.4e38).
RTC_DEVICE void q_tile_to_half(unsigned char* q_tile) {
  for (int i = threadIdx.x; i < Q_BYTES / 16; i += THREADS) {
    uint4* word = reinterpret_cast<uint4*>(q_tile) + i;
    uint32_t x[4] = {word->x, word->y, word->z, word->w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = unpack2<__nv_bfloat16>(x[k]);
      x[k] = pack2<half>(f.x, f.y);
    }
    *word = make_uint4(x[0], x[1], x[2], x[3]);
  }
}
