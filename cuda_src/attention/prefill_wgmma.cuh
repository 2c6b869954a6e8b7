// The warpgroup-MMA halves of prefill.cu's attend_tile (included after its constants, State
// and the fragment helpers; instantiated by WGMMA kernels only): S = Q K^T and O += P V of a
// warpgroup's 64 rows, operands in wgmma's canonical layout (wgmma.cuh).
#pragma once

// WGMMA: S = Q K^T of warpgroup `group`'s 64 rows and the tile's KV_TILE keys, s[n] the C
// layout of key n-tile n (as mma.m16n8k16 leaves it). K-step c reads dims 16c..16c + 15:
// column block c / 4 of the canonical tiles, 32 (c % 4) bytes into its swizzled rows.
template <int N>  // KEY_TILES (a template: instantiated by WGMMA kernels only)
RTC_DEVICE void qk_wgmma(float (&s)[N][4], uint32_t q_tile, uint32_t k_tile, int group) {
  constexpr uint32_t GROUP8 = 8 * 128;  // bytes between 8-row groups
  const uint64_t q = wgmma_desc(q_tile + group * 64 * 128, 16, GROUP8);
  const uint64_t k = wgmma_desc(k_tile, 16, GROUP8);
  wgmma_fence();
#pragma unroll
  for (int c = 0; c < K_STEPS; ++c) {  // descriptor addresses count 16-byte units
    const uint32_t at = (c % 4) * 2;
    wgmma_ss_n64<MT>(s, q + (c / 4) * (TILE_ROWS * 8) + at, k + (c / 4) * (KV_TILE * 8) + at,
                     c > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_hold(s);
}

// WGMMA: O += P V for the warpgroup's rows, P from s (rounded to MT), V MN-major: key step j
// reads keys 16j..16j + 15 (2048 bytes on), column blocks of 64 dims KV_TILE * 128 bytes apart.
template <int N>  // KEY_TILES
RTC_DEVICE void pv_wgmma(State (&st)[ROWS], const float (&s)[N][4], uint32_t v_tile) {
  uint32_t a[KV_TILE / 16][4];
#pragma unroll
  for (int j = 0; j < KV_TILE / 16; ++j) p_fragment<MT>(a[j], s[2 * j], s[2 * j + 1]);
  const uint64_t v = wgmma_desc(v_tile, KV_TILE * 128, 8 * 128);
  wgmma_fence();  // after the writes of a and of the rescaled o
#pragma unroll
  for (int j = 0; j < KV_TILE / 16; ++j)
    wgmma_rs<MT, HEAD_DIM_VO>(st[0].o, st[1].o, a[j], v + j * 128);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_hold(st[0].o);
  wgmma_hold(st[1].o);
}
