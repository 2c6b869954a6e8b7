"""A NumPy model of the prefill kernel's warp-level index math, checked without a GPU.

The fragment loaders of cuda_src/attention/prefill_fragments.cuh (load_a_rows, load_k_pair,
load_v_pair, p_fragment), transcribed below, run on the PTX fragment models of ldmatrix and
mma.m16n8k16 from test_decode_layout: one warp's S = Q K^T over a key tile and O = P V must
come out exactly (the products of 16-bit values summed in float64).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from .test_decode_layout import LANES, G, T, halves, ldmatrix_x4, mma, pack, tile_offset


def load_a_rows(smem, row0, c, row_bytes):
    i = LANES // 8
    row = row0 + (i % 2) * 8 + LANES % 8
    return ldmatrix_x4(smem, tile_offset(row, 2 * c + i // 2, row_bytes))


def load_k_pair(smem, key0, c, row_bytes):
    i = LANES // 8
    row = key0 + (i // 2) * 8 + LANES % 8
    r = ldmatrix_x4(smem, tile_offset(row, 2 * c + i % 2, row_bytes))
    return [[r[0], r[1]], [r[2], r[3]]]


def load_v_pair(smem, j, c, row_bytes):
    i = LANES // 8
    row = 16 * j + (i % 2) * 8 + LANES % 8
    r = ldmatrix_x4(smem, tile_offset(row, 2 * c + i // 2, row_bytes), trans=True)
    return [[r[0], r[1]], [r[2], r[3]]]


def p_fragment(s0, s1, dtype):
    return [pack(s0[0], s0[1], dtype), pack(s0[2], s0[3], dtype), pack(s1[0], s1[1], dtype),
            pack(s1[2], s1[3], dtype)]  # fmt: skip


def swizzled(x: np.ndarray) -> np.ndarray:
    """A [rows, D] 16-bit tile laid out as the kernel's cp.async copies it (tile_offset)."""
    rows, d = x.shape
    row_bytes = 2 * d
    raw = np.ascontiguousarray(x).view(np.uint8).reshape(rows, row_bytes)
    smem = np.zeros(rows * row_bytes, dtype=np.uint8)
    for r in range(rows):
        for chunk in range(row_bytes // 16):
            at = tile_offset(r, chunk, row_bytes)
            smem[at : at + 16] = raw[r, 16 * chunk : 16 * chunk + 16]
    return smem


@pytest.mark.parametrize("head_dim, head_dim_vo", [(64, 64), (128, 128), (256, 256), (192, 128)])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
def test_one_warp_computes_s_and_o_exactly(head_dim, head_dim_vo, dtype):
    """(192, 128): Q and K rows of 24 chunks (swizzled within each 8-chunk group), V's of 16."""
    rng = np.random.default_rng(head_dim)
    tile_rows, keys, warp = 64, 32, 2  # the warp's rows: 32..47 of the Q tile
    q = rng.standard_normal((tile_rows, head_dim)).astype(dtype)
    k = rng.standard_normal((keys, head_dim)).astype(dtype)
    v = rng.standard_normal((keys, head_dim_vo)).astype(dtype)
    q_s, k_s, v_s = swizzled(q), swizzled(k), swizzled(v)
    row_bytes, v_row_bytes = 2 * head_dim, 2 * head_dim_vo

    # S = Q K^T: n-tile n holds keys 8n..8n+7 (C layout: rows g, g + 8; keys 2t, 2t + 1)
    s = [np.zeros((4, 32)) for _ in range(keys // 8)]
    for c in range(head_dim // 16):
        a = load_a_rows(q_s, 16 * warp, c, row_bytes)
        for n in range(0, keys // 8, 2):
            b = load_k_pair(k_s, 8 * n, c, row_bytes)
            s[n] = mma(s[n], a, b[0], dtype)
            s[n + 1] = mma(s[n + 1], a, b[1], dtype)
    expect = q[16 * warp : 16 * warp + 16].astype(np.float64) @ k.astype(np.float64).T
    for n in range(keys // 8):
        for r in range(4):
            got_rows, got_keys = G + 8 * (r // 2), 8 * n + 2 * T + r % 2
            np.testing.assert_allclose(s[n][r], expect[got_rows, got_keys], rtol=1e-12)

    # O = P V with P = S rounded to the 16-bit type, through p_fragment and load_v_pair
    o = [np.zeros((4, 32)) for _ in range(head_dim_vo // 8)]
    for j in range(keys // 16):
        a = p_fragment(s[2 * j], s[2 * j + 1], dtype)
        for c in range(head_dim_vo // 16):
            b = load_v_pair(v_s, j, c, v_row_bytes)
            for h in range(2):
                o[2 * c + h] = mma(o[2 * c + h], a, b[h], dtype)
    p = expect.astype(dtype).astype(np.float64)
    expect_o = p @ v.astype(np.float64)
    for n in range(head_dim_vo // 8):
        for r in range(4):
            rows, dims = G + 8 * (r // 2), 8 * n + 2 * T + r % 2
            np.testing.assert_allclose(o[n][r], expect_o[rows, dims], rtol=1e-10, atol=1e-10)


def warp_row(i: int, g):
    """prefill.cu's warp_row: the warp's row of the thread's row i (i = 2 block + half)."""
    return 16 * (i // 2) + g + 8 * (i % 2)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_warp_of_two_row_blocks_shares_each_fragment(head_dim):
    """attend_tile with WARP_ROWS = 32 (ROW_BLOCKS = 2), its loops transcribed: Q fragments of
    each block at WARP_ROWS * warp + 16 b, one K fragment pair feeding both blocks' MMAs into
    s[b], one V fragment feeding the PV MMAs into the states st[2b] (row g of block b) and
    st[2b + 1] (row g + 8); finish_rows' rows (warp_row) then hold the right outputs."""
    dtype = ml_dtypes.bfloat16
    rng = np.random.default_rng(head_dim + 32)
    tile_rows, keys, warp, warp_rows, blocks = 128, 32, 3, 32, 2  # the warp: rows 96..127
    q = rng.standard_normal((tile_rows, head_dim)).astype(dtype)
    k = rng.standard_normal((keys, head_dim)).astype(dtype)
    v = rng.standard_normal((keys, head_dim)).astype(dtype)
    q_s, k_s, v_s = swizzled(q), swizzled(k), swizzled(v)
    row_bytes = 2 * head_dim
    key_tiles = keys // 8

    s = [[np.zeros((4, 32)) for _ in range(key_tiles)] for _ in range(blocks)]
    for c in range(head_dim // 16):
        a = [load_a_rows(q_s, warp_rows * warp + 16 * b, c, row_bytes) for b in range(blocks)]
        for n in range(0, key_tiles, 2):
            kb = load_k_pair(k_s, 8 * n, c, row_bytes)
            for b in range(blocks):
                s[b][n] = mma(s[b][n], a[b], kb[0], dtype)
                s[b][n + 1] = mma(s[b][n + 1], a[b], kb[1], dtype)
    o = [[np.zeros(32) for _ in range(2 * head_dim // 8)] for _ in range(2 * blocks)]  # st[i]
    for j in range(keys // 16):
        a = [p_fragment(s[b][2 * j], s[b][2 * j + 1], dtype) for b in range(blocks)]
        for c in range(head_dim // 16):
            vb = load_v_pair(v_s, j, c, row_bytes)
            for b in range(blocks):
                for h in range(2):
                    n = 2 * c + h
                    acc = np.stack([o[2 * b][2 * n], o[2 * b][2 * n + 1],
                                    o[2 * b + 1][2 * n], o[2 * b + 1][2 * n + 1]])  # fmt: skip
                    acc = mma(acc, a[b], vb[h], dtype)
                    o[2 * b][2 * n], o[2 * b][2 * n + 1] = acc[0], acc[1]
                    o[2 * b + 1][2 * n], o[2 * b + 1][2 * n + 1] = acc[2], acc[3]
    rows = slice(warp_rows * warp, warp_rows * warp + warp_rows)
    expect_s = q[rows].astype(np.float64) @ k.astype(np.float64).T
    expect_o = expect_s.astype(dtype).astype(np.float64) @ v.astype(np.float64)
    for i in range(2 * blocks):  # the thread's rows as finish_rows writes them
        row = warp_row(i, G)
        for n in range(head_dim // 8):
            for e in range(2):
                dims = 8 * n + 2 * T + e
                np.testing.assert_allclose(o[i][2 * n + e], expect_o[row, dims], rtol=1e-10,
                                           atol=1e-10)  # fmt: skip
        b, h = i // 2, i % 2
        for n in range(key_tiles):
            for e in range(2):
                np.testing.assert_allclose(s[b][n][2 * h + e], expect_s[row, 8 * n + 2 * T + e],
                                           rtol=1e-12)  # fmt: skip


def test_the_p_fragment_is_the_a_layout_of_s():
    """p_fragment repacks C-layout accumulators of n-tiles 2j, 2j + 1 into the A layout of
    the 16 keys they hold: a0 (g, 2t), a1 (g + 8, 2t), a2 (g, 2t + 8), a3 (g + 8, 2t + 8)."""
    dtype = np.float16
    value = lambda row, key: row * 100.0 + key  # noqa: E731 - exact in fp16 for these ranges
    s0 = np.stack([value(G, 2 * T), value(G, 2 * T + 1), value(G + 8, 2 * T),
                   value(G + 8, 2 * T + 1)])  # fmt: skip
    s1 = np.stack([value(G, 8 + 2 * T), value(G, 9 + 2 * T), value(G + 8, 8 + 2 * T),
                   value(G + 8, 9 + 2 * T)])  # fmt: skip
    a = p_fragment(s0, s1, dtype)
    for r in range(4):
        row, col = G + 8 * (r % 2), 2 * T + 8 * (r // 2)
        lo, hi = halves(a[r], dtype)
        np.testing.assert_array_equal(lo, value(row, col))
        np.testing.assert_array_equal(hi, value(row, col + 1))


@pytest.mark.parametrize("warp_keys", [16, 32])  # 64- and 128-key tiles
def test_warps_sharing_rows_split_the_keys_and_merge(warp_keys):
    """A 16-row tile: four warps take keys w * WARP_KEYS.. of a K/V tile (load_k_pair at
    key_w + 8n, load_v_pair at blocks key_w / 16 + j), keep online-softmax states, and
    combine_warps merges them lane by lane before the quad reduction of d; the result is
    softmax(Q K^T * scale) V up to the 16-bit rounding of P."""
    dtype, head_dim, kv_warps = np.float16, 128, 4
    rng = np.random.default_rng(3)
    q = rng.standard_normal((16, head_dim)).astype(dtype)
    k = rng.standard_normal((kv_warps * warp_keys, head_dim)).astype(dtype)
    v = rng.standard_normal((kv_warps * warp_keys, head_dim)).astype(dtype)
    q_s, k_s, v_s = swizzled(q), swizzled(k), swizzled(v)
    row_bytes, scale = 2 * head_dim, 0.125 * np.log2(np.e)
    states = []
    for kv_warp in range(kv_warps):
        key_w = kv_warp * warp_keys
        s = [np.zeros((4, 32)) for _ in range(warp_keys // 8)]
        for c in range(head_dim // 16):
            a = load_a_rows(q_s, 0, c, row_bytes)
            for n in range(0, warp_keys // 8, 2):
                b = load_k_pair(k_s, key_w + 8 * n, c, row_bytes)
                s[n], s[n + 1] = mma(s[n], a, b[0], dtype), mma(s[n + 1], a, b[1], dtype)
        x = [sn * scale for sn in s]
        m, d = np.zeros((2, 32)), np.zeros((2, 32))
        for i in range(2):  # rows G + 8i: registers 2i, 2i + 1 of every n-tile
            lane_max = np.max([xn[2 * i + e] for xn in x for e in range(2)], axis=0)
            m[i] = lane_max.reshape(8, 4).max(axis=1).repeat(4)  # the quad's max
            for xn in x:
                for e in range(2):
                    xn[2 * i + e] = np.exp2(xn[2 * i + e] - m[i])
                    d[i] += xn[2 * i + e]
        o = [np.zeros((4, 32)) for _ in range(head_dim // 8)]
        for j in range(warp_keys // 16):
            a = p_fragment(x[2 * j], x[2 * j + 1], dtype)
            for c in range(head_dim // 16):
                b = load_v_pair(v_s, key_w // 16 + j, c, row_bytes)
                for h in range(2):
                    o[2 * c + h] = mma(o[2 * c + h], a, b[h], dtype)
        states.append((m, d, o))
    big_m = np.max([st[0] for st in states], axis=0)
    d = sum(st[1] * np.exp2(st[0] - big_m) for st in states)
    d = d.reshape(2, 8, 4).sum(axis=2).repeat(4, axis=1)  # finish_rows' quad reduction
    logits = q.astype(np.float64) @ k.astype(np.float64).T * 0.125
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    expect = (p / p.sum(axis=1, keepdims=True)) @ v.astype(np.float64)
    for n in range(head_dim // 8):
        for r in range(4):
            i = r // 2
            merged = sum(st[2][n][r] * np.exp2(st[0][i] - big_m[i]) for st in states)
            rows, dims = G + 8 * i, 8 * n + 2 * T + r % 2
            np.testing.assert_allclose(merged / d[i], expect[rows, dims], rtol=0, atol=3e-3)


@pytest.mark.parametrize("kind", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_tiles_widen_into_the_16_bit_swizzle(kind, head_dim):  # 64- and 128-row tiles
    """widen_tiles: ring chunk c of an fp8 row (16 values, tile_offset of head_dim-byte rows)
    becomes chunks 2c, 2c + 1 of the 16-bit row: the staging tile is the swizzled 16-bit tile
    of the same values."""
    rng = np.random.default_rng(head_dim)
    rows = 64
    x = rng.standard_normal((rows, head_dim)).astype(kind)
    ring = np.zeros(rows * head_dim, np.uint8)
    raw = x.view(np.uint8)
    for r in range(rows):
        for c in range(head_dim // 16):
            at = tile_offset(r, c, head_dim)
            ring[at : at + 16] = raw[r, 16 * c : 16 * c + 16]
    staging = np.zeros(rows * 2 * head_dim, np.uint8)
    for r in range(rows):
        for c in range(head_dim // 16):
            at = tile_offset(r, c, head_dim)
            values = ring[at : at + 16].view(kind).astype(np.float16).view(np.uint8)
            for half in range(2):
                dst = tile_offset(r, 2 * c + half, 2 * head_dim)
                staging[dst : dst + 16] = values[16 * half : 16 * half + 16]
    np.testing.assert_array_equal(staging, swizzled(x.astype(np.float16)))


def fp8_ring(x: np.ndarray) -> np.ndarray:
    """A [rows, D] fp8 tile laid out in the ring (tile_offset of D-byte rows)."""
    rows, d = x.shape
    raw, ring = x.view(np.uint8), np.zeros(rows * d, np.uint8)
    for r in range(rows):
        for c in range(d // 16):
            at = tile_offset(r, c, d)
            ring[at : at + 16] = raw[r, 16 * c : 16 * c + 16]
    return ring


def to_pair(bits16, kind, dtype):
    """fp8x2_to_pair: two fp8 values (low byte first) -> two `dtype` values."""
    b = np.stack([bits16 & 0xFF, bits16 >> 8]).astype(np.uint8).view(kind)
    return pack(b[0].astype(np.float32), b[1].astype(np.float32), dtype)


def byte_perm(x, selector):
    """__byte_perm(x, 0, selector) for selectors naming bytes of x only."""
    out = np.zeros_like(x)
    for i in range(4):
        out |= ((x >> (8 * ((selector >> (4 * i)) & 0xF))) & 0xFF) << (8 * i)
    return out


def load_q_permuted(smem, row0, c, row_bytes):
    """load_q with FP8_DIRECT: a[h], a[2 + h] = dims 4t..4t+1, 4t+2..4t+3 of row g + 8h."""
    a = [None] * 4
    for h in range(2):
        at = [tile_offset(row0 + g + 8 * h, 2 * c + t // 2, row_bytes) + 8 * (t % 2)
              for g, t in zip(G, T, strict=True)]  # fmt: skip
        words = np.stack([smem[x : x + 8].view(np.uint32) for x in at])
        a[h], a[2 + h] = words[:, 0], words[:, 1]
    return a


def load_k_pair_fp8(ring, key0, c, d, kind, dtype):
    row = key0 + (LANES // 8 % 2) * 8 + LANES % 8
    r = ldmatrix_x4(ring, tile_offset(row, c, d))[:2]  # x2: the matrices of lanes 0-15
    return [[to_pair(r[n] & 0xFFFF, kind, dtype), to_pair(r[n] >> 16, kind, dtype)]
            for n in range(2)]  # fmt: skip


def load_v_pair_fp8(ring, j, c, d, kind, dtype):
    row = 16 * j + (LANES // 8 % 2) * 8 + LANES % 8
    r = ldmatrix_x4(ring, tile_offset(row, c, d), trans=True)[:2]
    return [[to_pair(byte_perm(r[k], sel) & 0xFFFF, kind, dtype) for k in range(2)]
            for sel in (0x0020, 0x0031)]  # fmt: skip


def unpermute_dims(o):
    """unpermute_dims on one row's o[2 D / 8][lane] (shuffles within each quad)."""
    quad, odd = LANES - T, T % 2 == 1
    lo, hi = quad + T // 2, quad + 2 + T // 2
    out = [x.copy() for x in o]
    for d in range(len(o) // 4):
        src = o[4 * d : 4 * d + 4]
        out[4 * d] = np.where(odd, src[1][lo], src[0][lo])
        out[4 * d + 1] = np.where(odd, src[3][lo], src[2][lo])
        out[4 * d + 2] = np.where(odd, src[1][hi], src[0][hi])
        out[4 * d + 3] = np.where(odd, src[3][hi], src[2][hi])
    return out


@pytest.mark.parametrize("kind", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
def test_fp8_read_from_the_ring_gives_s_and_o_exactly(kind, head_dim, dtype):
    """FP8_DIRECT (16-row tiles): four warps take keys 16w.. of a 64-key tile; Q's permuted
    fragments (load_q) against K's from the fp8 ring (load_k_pair_fp8) give S exactly, P V with
    V's even- and odd-dim fragments (load_v_pair_fp8) into n-tiles 2c and 2c + 1, then
    unpermute_dims, gives O in the standard layout (o[2n + e]: dims 8n + 2t + e)."""
    rng = np.random.default_rng(head_dim)
    keys, warp_keys = 64, 16
    q = rng.standard_normal((16, head_dim)).astype(dtype)
    k = (rng.standard_normal((keys, head_dim)) * 2).astype(kind)
    v = (rng.standard_normal((keys, head_dim)) * 2).astype(kind)
    q_s, k_ring, v_ring = swizzled(q), fp8_ring(k), fp8_ring(v)
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    for kv_warp in range(keys // warp_keys):
        key_w = kv_warp * warp_keys
        s = [np.zeros((4, 32)) for _ in range(warp_keys // 8)]
        for c in range(head_dim // 16):
            a = load_q_permuted(q_s, 0, c, 2 * head_dim)
            b = load_k_pair_fp8(k_ring, key_w, c, head_dim, kind, dtype)
            s[0], s[1] = mma(s[0], a, b[0], dtype), mma(s[1], a, b[1], dtype)
        expect = q.astype(np.float64) @ k64[key_w : key_w + warp_keys].T
        for n in range(2):
            for r in range(4):
                rows, cols = G + 8 * (r // 2), 8 * n + 2 * T + r % 2
                np.testing.assert_allclose(s[n][r], expect[rows, cols], rtol=1e-12)
        a = p_fragment(s[0], s[1], dtype)
        o = [np.zeros((4, 32)) for _ in range(head_dim // 8)]
        for c in range(head_dim // 16):
            b = load_v_pair_fp8(v_ring, key_w // 16, c, head_dim, kind, dtype)
            for h in range(2):
                o[2 * c + h] = mma(o[2 * c + h], a, b[h], dtype)
        p = expect.astype(dtype).astype(np.float64)
        expect_o = p @ v64[key_w : key_w + warp_keys]
        for i in range(2):  # the state of row g + 8i: registers 2i, 2i + 1 of every n-tile
            row = unpermute_dims([o[n][2 * i + e] for n in range(head_dim // 8) for e in range(2)])
            for n in range(head_dim // 8):
                for e in range(2):
                    dims = 8 * n + 2 * T + e
                    np.testing.assert_allclose(row[2 * n + e], expect_o[G + 8 * i, dims],
                                               rtol=1e-10, atol=1e-10)  # fmt: skip


def rows_of_warp(tile_row, warp, group, qo_len, kv_len):
    """Rows.init's positions: the valid rows' positions and (pos_first, pos_last)."""
    packed = tile_row + 16 * warp + np.arange(16)
    valid = packed < qo_len * group
    pos = packed // group + kv_len - qo_len
    first, rows_in = tile_row + 16 * warp, qo_len * group
    last = min(first + 15, max(rows_in - 1, first))
    return pos[valid], first // group + kv_len - qo_len, last // group + kv_len - qo_len


def test_blocks_that_skip_the_masks_are_wholly_visible():
    """Rows.all_see (a warp-uniform test on a block of keys [lo, hi]) implies Rows.sees for
    every valid row and key of the block: causal and windowed, bottom-right aligned."""
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(20000):
        group = int(rng.integers(1, 9))
        qo_len = int(rng.integers(1, 300))
        kv_len = int(rng.integers(0, 600))
        tile_row = 16 * int(rng.integers(0, -(-qo_len * group // 16)))
        warp = int(rng.integers(0, 8))
        causal = bool(rng.integers(2))
        window = int(rng.integers(-1, 100))
        begin = int(rng.integers(0, kv_len + 1))
        end = int(rng.integers(begin, kv_len + 1))
        lo = int(rng.integers(0, max(kv_len, 1)))
        hi = lo + 15
        pos, pos_first, pos_last = rows_of_warp(tile_row, warp, group, qo_len, kv_len)
        all_see = lo >= begin and hi < end
        if causal:
            all_see = all_see and hi <= pos_first
        if window >= 0:
            all_see = all_see and lo >= pos_last - window
        if not all_see or pos.size == 0:
            continue
        keys = np.arange(lo, hi + 1)
        sees = np.repeat((keys[None] >= begin) & (keys[None] < end), pos.size, axis=0)
        if causal:
            sees &= keys[None] <= pos[:, None]
        if window >= 0:
            sees &= keys[None] >= pos[:, None] - window
        assert sees.all(), (group, qo_len, kv_len, tile_row, warp, causal, window, lo)
        checked += 1
    assert checked > 500  # blocks that skip the masks were met often enough to mean something


def mla_tiles(q, k_tiles, dtype, groups):
    """prefill_mla.cuh's mla_tile transcribed for the four warps of a 16-row tile over the K
    tiles in turn (scale 1, no mask): S of each warp's key group from the fragments, the
    groups' row maxima pooled (shared memory: here the groups' values), the running state
    rescaled alike in every warp, P written to a swizzled [16][KV_TILE] byte tile as the
    kernel stores it, the sums pooled, O += P V from that tile and the K tile's first 512 dims,
    each warp its 128. Returns (m, d, o) per warp: m [2][32], d [2][32] (a quad's first lane
    holds the row's sum), o [2][32 n-tiles x 2][32] as State's o of rows g, g + 8."""
    kv_tile = groups * 16
    row_bytes, p_row_bytes = 2 * q.shape[1], 2 * kv_tile
    q_s = swizzled(q)
    warps = [dict(m=np.full((2, 32), -np.inf), d=np.zeros((2, 32)), o=np.zeros((2, 32, 32)))
             for _ in range(4)]  # fmt: skip
    for k in k_tiles:
        k_s = swizzled(k)
        s_of, maxima, sums = {}, {}, {}
        for dw in range(4):
            group = dw % groups
            s = [np.zeros((4, 32)) for _ in range(2)]
            for c in range(q.shape[1] // 16):
                a = load_a_rows(q_s, 0, c, row_bytes)
                b = load_k_pair(k_s, 16 * group, c, row_bytes)
                s[0], s[1] = mma(s[0], a, b[0], dtype), mma(s[1], a, b[1], dtype)
            s_of[dw] = s
            part = [np.maximum.reduce([s[n][r] for n in range(2) for r in (2 * i, 2 * i + 1)])
                    for i in range(2)]  # fmt: skip
            for i in range(2):  # the quad's max: lanes 4g..4g + 3
                part[i] = part[i].reshape(8, 4).max(axis=1).repeat(4)
            if dw < groups:
                maxima[group] = part
        p_smem = np.zeros(16 * p_row_bytes, np.uint8)
        for dw in range(4):
            st, s, group = warps[dw], s_of[dw], dw % groups
            base = np.zeros((2, 32))
            for i in range(2):
                tile_max = np.maximum.reduce([maxima[gr][i] for gr in range(groups)])
                m_new = np.maximum(st["m"][i], tile_max)
                off = np.where(np.isneginf(m_new), 0, m_new)
                scale = np.exp2(st["m"][i] - off)
                st["d"][i] *= scale
                st["o"][i] *= scale
                st["m"][i], base[i] = m_new, off
            e = [np.stack([np.exp2(s[n][r] - base[r // 2]) for r in range(4)]) for n in range(2)]
            s_of[dw] = e
            if dw < groups:
                sums[group] = [(e[0][2 * i] + e[0][2 * i + 1] + e[1][2 * i] + e[1][2 * i + 1])
                               .reshape(8, 4).sum(axis=1).repeat(4) for i in range(2)]  # fmt: skip
                for n in range(2):
                    for i in range(2):
                        key = 16 * group + 8 * n + 2 * T
                        words = pack(e[n][2 * i], e[n][2 * i + 1], dtype)
                        for lane in range(32):
                            at = tile_offset(G[lane] + 8 * i, key[lane] // 8, p_row_bytes)
                            at += 2 * (key[lane] % 8)
                            p_smem[at : at + 4] = np.frombuffer(
                                np.uint32(words[lane]).tobytes(), np.uint8)  # fmt: skip
        for dw in range(4):
            st = warps[dw]
            for i in range(2):
                total = sum(sums[gr][i] for gr in range(groups))
                st["d"][i] += np.where(T == 0, total, 0.0)
            for j in range(groups):
                a = load_a_rows(p_smem, 0, j, p_row_bytes)
                for c in range(128 // 16):
                    b = load_v_pair(k_s, j, c + dw * 8, row_bytes)
                    for h in range(2):
                        n = 2 * c + h
                        acc = np.stack([st["o"][0][2 * n], st["o"][0][2 * n + 1],
                                        st["o"][1][2 * n], st["o"][1][2 * n + 1]])  # fmt: skip
                        acc = mma(acc, a, b[h], dtype)
                        st["o"][0][2 * n], st["o"][0][2 * n + 1] = acc[0], acc[1]
                        st["o"][1][2 * n], st["o"][1][2 * n + 1] = acc[2], acc[3]
    return warps


@pytest.mark.parametrize("groups", [4, 2])  # 64- and 32-key K tiles
def test_mla_tiles_pool_the_softmax_across_the_four_warps(groups):
    """Four warps, two K tiles of 576-dim rows: each warp's (m, d, o) after the tiles is the
    online softmax of S = Q K^T over all keys with o = P V over its 128 dims of the ckv part,
    P rounded to 16 bits as the kernel rounds it (exact up to that rounding)."""
    dtype = ml_dtypes.bfloat16
    rng = np.random.default_rng(groups)
    q = (rng.standard_normal((16, 576)) * 0.2).astype(dtype)
    k_tiles = [(rng.standard_normal((16 * groups, 576)) * 0.2).astype(dtype) for _ in range(2)]
    warps = mla_tiles(q, k_tiles, dtype, groups)
    k_all = np.concatenate(k_tiles).astype(np.float64)
    s = q.astype(np.float64) @ k_all.T  # [16, keys]
    m = s.max(axis=1)
    p = np.exp2(s - m[:, None])
    o_ref = p @ k_all[:, :512]
    rows, atol = [G, G + 8], 2e-2 * np.abs(o_ref).max()
    for dw, st in enumerate(warps):
        for i in range(2):
            np.testing.assert_allclose(st["m"][i], m[rows[i]], rtol=1e-12)
            d = st["d"][i].reshape(8, 4).sum(axis=1)  # close_row: the quad's sum
            np.testing.assert_allclose(d, p.sum(axis=1)[rows[i][::4]], rtol=1e-9)
            for n in range(16):  # dims 128 dw + 8n + 2t, + 1
                for e in range(2):
                    dims = 128 * dw + 8 * n + 2 * T + e
                    np.testing.assert_allclose(st["o"][i][2 * n + e], o_ref[rows[i], dims],
                                               rtol=2e-2, atol=atol)  # fmt: skip


def load_q_key_major(q_s, c, row_bytes, fp8):
    """load_q_key_major: Q^T's B fragment of k-step c from the 8-row Q tile, row g: dims
    16c + 2t.. and 16c + 8 + 2t.., or (FP8_DIRECT) K's permuted order, 16c + 4t.. and 4t + 2.."""
    if fp8:
        at = [tile_offset(g, 2 * c + t // 2, row_bytes) + 8 * (t % 2)
              for g, t in zip(G, T, strict=True)]  # fmt: skip
        words = np.stack([q_s[x : x + 8].view(np.uint32) for x in at])
        return [words[:, 0], words[:, 1]]
    return [np.array([q_s[x : x + 4].view(np.uint32)[0]
                      for x in tile_offset(G, 2 * c + h, row_bytes) + 4 * T])
            for h in range(2)]  # fmt: skip


@pytest.mark.parametrize("kv", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_an_8_row_tile_puts_keys_on_the_m_side(kv, head_dim):
    """KEY_MAJOR (prefill_key_major.cuh): four warps take keys 16w.. of a 64-key tile; S^T =
    K Q^T from K's A fragments (load_k_rows, decode's, over the K tile: 16-bit, or the fp8
    ring read directly) and Q^T's B fragments from the swizzled 8-row Q tile
    (load_q_key_major), then O^T += V^T P^T with P^T by movmatrix: lane (g, t) holds S^T of
    keys g, g + 8 for rows 2t, 2t + 1, and row 2t + i's o[2c + e] at dim o_dim_of(c, g, e), as
    finish_rows_key_major writes it."""
    from .test_decode_layout import Model, fill_tile, movmatrix_trans, storage

    rng = np.random.default_rng(head_dim)
    fp8 = kv.startswith("float8")
    m = Model(head_dim, kv)  # load_k / load_v: load_k_rows / load_vt_rows; m.mt: MT
    keys, warp_keys = 64, 16
    q = rng.standard_normal((8, head_dim)).astype(m.mt)  # FP8_DIRECT's Q tile is fp16 (Q_HALF)
    k = (rng.standard_normal((keys, head_dim)) * (2 if fp8 else 1)).astype(storage(kv))
    v = (rng.standard_normal((keys, head_dim)) * (2 if fp8 else 1)).astype(storage(kv))
    q_s, k_s, v_s = swizzled(q), fill_tile(k, m.row_bytes), fill_tile(v, m.row_bytes)
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    for kv_warp in range(keys // warp_keys):
        key_w = kv_warp * warp_keys
        s = np.zeros((4, 32))
        for c in range(0, head_dim // 16, 2):
            a = m.load_k(k_s, key_w, c)
            for h in range(2):
                s = mma(s, a[h], load_q_key_major(q_s, c + h, 2 * head_dim, fp8), m.mt)
        expect = k64[key_w : key_w + warp_keys] @ q.astype(np.float64).T  # S^T [16, 8]
        for r in range(4):
            np.testing.assert_allclose(s[r], expect[G + 8 * (r // 2), 2 * T + r % 2], rtol=1e-12)
        p0 = movmatrix_trans(pack(s[0], s[1], m.mt))
        p1 = movmatrix_trans(pack(s[2], s[3], m.mt))
        o = [[np.zeros(32) for _ in range(head_dim // 8)] for _ in range(2)]  # st[i].o[e]
        for c in range(0, head_dim // 16, 2):
            a = m.load_v(v_s, key_w, c)
            for h in range(2):
                e = 2 * (c + h)
                acc = mma(np.stack([o[0][e], o[1][e], o[0][e + 1], o[1][e + 1]]), a[h],
                          [p0, p1], m.mt)  # fmt: skip
                o[0][e], o[1][e], o[0][e + 1], o[1][e + 1] = acc
        p = expect.astype(m.mt).astype(np.float64)  # P rounded to MT
        expect_o = v64[key_w : key_w + warp_keys].T @ p  # O^T [D, 8]
        for i in range(2):
            for e in range(head_dim // 8):
                c, hi = e // 2, e % 2
                dims = 16 * c + (2 * G + hi if fp8 else G + 8 * hi)  # o_dim_of
                np.testing.assert_allclose(o[i][e], expect_o[dims, 2 * T + i], rtol=1e-10,
                                           atol=1e-10)  # fmt: skip
