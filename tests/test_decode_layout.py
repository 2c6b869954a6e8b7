"""A NumPy model of the decode kernel's warp-level index math, checked without a GPU.

ldmatrix, movmatrix and mma.m16n8k16 are modelled from their PTX ISA fragment layouts; the
kernel's own index functions (tile_offset, load_k, load_v, q_frag, rope_k, o_dim, the paged
loader) are transcribed from cuda_src/attention/decode_fragments.cuh and paged_kv.cuh. The model
must reproduce S^T = K Q^T and O^T = V^T P^T of a 16-token warp tile exactly, for 16-bit and fp8
KV; a tile-level model of the kernel's control flow must reproduce the float64 reference.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from rtcinfer.attention.decode_kernel import fast_div, rope_frequencies

LANES = np.arange(32)
G, T = LANES // 4, LANES % 4


def tile_offset(row, chunk, row_bytes):
    chunks = row_bytes // 16
    span = min(chunks, 8)
    rows_per_line = 8 // chunks if chunks < 8 else 1
    return row * row_bytes + (chunk ^ ((row // rows_per_line) % span)) * 16


def ldmatrix_x4(smem, addrs, trans=False):
    """regs[i][lane] (uint32) from the row addresses given by the 32 lanes."""
    regs = np.zeros((4, 32), dtype=np.uint32)
    for i in range(4):
        m = np.stack([smem[a : a + 16].view(np.uint16) for a in addrs[8 * i : 8 * i + 8]])
        lo = m[2 * T, G] if trans else m[G, 2 * T]
        hi = m[2 * T + 1, G] if trans else m[G, 2 * T + 1]
        regs[i] = lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)
    return regs


def movmatrix_trans(reg):
    m = np.zeros((8, 8), dtype=np.uint16)
    m[G, 2 * T], m[G, 2 * T + 1] = reg & 0xFFFF, reg >> 16
    return m[2 * T, G].astype(np.uint32) | (m[2 * T + 1, G].astype(np.uint32) << 16)


def halves(reg, dtype):
    """(lo, hi) float64 values of 16-bit pairs."""
    lo = (reg & 0xFFFF).astype(np.uint16).view(dtype).astype(np.float64)
    hi = (reg >> 16).astype(np.uint16).view(dtype).astype(np.float64)
    return lo, hi


def pack(lo, hi, dtype):
    lo = np.asarray(lo).astype(dtype).view(np.uint16).astype(np.uint32)
    return lo | (np.asarray(hi).astype(dtype).view(np.uint16).astype(np.uint32) << 16)


def mma(c, a, b, dtype):
    """c[4][lane] += A (a[4][lane]) @ B (b[2][lane]) with the m16n8k16 layouts."""
    am, bm = np.zeros((16, 16)), np.zeros((16, 8))
    for r in range(4):  # a0: (g, 2t), a1: (g + 8, 2t), a2: (g, 2t + 8), a3: (g + 8, 2t + 8)
        row, col = G + 8 * (r % 2), 2 * T + 8 * (r // 2)
        am[row, col], am[row, col + 1] = halves(a[r], dtype)
    for r in range(2):
        bm[2 * T + 8 * r, G], bm[2 * T + 8 * r + 1, G] = halves(b[r], dtype)
    cm = am @ bm
    return c + np.stack([cm[G, 2 * T], cm[G, 2 * T + 1], cm[G + 8, 2 * T], cm[G + 8, 2 * T + 1]])


def fp8_pair(bits16, kind):
    """cvt.rn.f16x2.{e4m3,e5m2}x2: low byte -> low half."""
    b = np.stack([bits16 & 0xFF, bits16 >> 8]).astype(np.uint8).view(kind).astype(np.float16)
    return pack(b[0], b[1], np.float16)


def byte_perm_3120(x):
    b = [(x >> (8 * i)) & 0xFF for i in range(4)]
    return b[0] | (b[2] << 8) | (b[1] << 16) | (b[3] << 24)


class Model:
    """One warp of the kernel on a tile held in `smem`; mirrors the device functions."""

    def __init__(self, head_dim, kv_dtype):
        self.fp8 = kv_dtype in ("float8_e4m3fn", "float8_e5m2")
        self.kind = getattr(ml_dtypes, kv_dtype) if self.fp8 else None
        self.mt = np.float16 if self.fp8 or kv_dtype == "float16" else ml_dtypes.bfloat16
        self.d, self.blocks = head_dim, head_dim // 16
        self.row_bytes = head_dim * (1 if self.fp8 else 2)

    def k_dim(self, c, r, e):
        base = 4 * T + (2 if r >= 2 else 0) if self.fp8 else 2 * T + (8 if r >= 2 else 0)
        return 16 * c + base + e

    def o_dim(self, c, hi):
        return 16 * c + 2 * G + hi if self.fp8 else 16 * c + G + 8 * hi

    def load_k(self, smem, row, c):
        r = row + LANES % 8 + 8 * (LANES // 8 % 2)
        if self.fp8:
            x = ldmatrix_x4(smem, tile_offset(r, c + LANES // 16, self.row_bytes))
            cv = lambda v: fp8_pair(v, self.kind)  # noqa: E731
            return [[cv(x[2 * i] & 0xFFFF), cv(x[2 * i + 1] & 0xFFFF), cv(x[2 * i] >> 16),
                     cv(x[2 * i + 1] >> 16)] for i in range(2)]  # fmt: skip
        return [ldmatrix_x4(smem, tile_offset(r, 2 * (c + i) + LANES // 16, self.row_bytes))
                for i in range(2)]  # fmt: skip

    def load_v(self, smem, row, c):
        if self.fp8:
            r = row + LANES % 8 + 8 * (LANES // 8 % 2)
            x = ldmatrix_x4(smem, tile_offset(r, c + LANES // 16, self.row_bytes), trans=True)
            out = []
            for i in range(2):
                lo, hi = byte_perm_3120(x[2 * i]), byte_perm_3120(x[2 * i + 1])
                out.append([fp8_pair(v, self.kind) for v in
                            (lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16)])  # fmt: skip
            return out
        r = row + LANES % 8 + 8 * (LANES // 16)
        return [ldmatrix_x4(smem, tile_offset(r, 2 * (c + i) + LANES // 8 % 2, self.row_bytes),
                            trans=True) for i in range(2)]  # fmt: skip

    def q_frag(self, q_s, c, nt):
        row = q_s[8 * nt + G]
        col = 16 * c + (4 * T if self.fp8 else 2 * T)
        step = 2 if self.fp8 else 8
        take = lambda k: pack(row[LANES, k], row[LANES, k + 1], self.mt)  # noqa: E731
        return [take(col), take(col + step)]

    def rope_k(self, x, y, c, first, freq):
        for r in range(4):
            (ax, ay), (bx, by) = halves(x[r], self.mt), halves(y[r], self.mt)
            pos = first + G + 8 * (r % 2)
            ang = [2 * np.pi * pos * freq[self.k_dim(c, r, e)] for e in range(2)]
            c0, s0, c1, s1 = np.cos(ang[0]), np.sin(ang[0]), np.cos(ang[1]), np.sin(ang[1])
            x[r] = pack(ax * c0 - bx * s0, ay * c1 - by * s1, self.mt)
            y[r] = pack(bx * c0 + ax * s0, by * c1 + ay * s1, self.mt)

    def scores(self, smem, row, q_s, nt, rope_first=None, freq=None):
        """S^T[16 tokens, 8 heads] of head tile nt, as the kernel's loop computes it."""
        s = np.zeros((4, 32))
        span = self.blocks // 2 if rope_first is not None else self.blocks
        for c in range(0, span, 2):
            a = [self.load_k(smem, row, c)]
            if rope_first is not None:
                a.append(self.load_k(smem, row, c + self.blocks // 2))
                for i in range(2):
                    self.rope_k(a[0][i], a[1][i], c + i, rope_first, freq)
            for half, frags in enumerate(a):
                for i in range(2):
                    blk = c + i + half * self.blocks // 2
                    s = mma(s, frags[i], self.q_frag(q_s, blk, nt), self.mt)
        out = np.zeros((16, 8))
        out[G, 2 * T], out[G, 2 * T + 1], out[G + 8, 2 * T], out[G + 8, 2 * T + 1] = s
        return out

    def values(self, smem, row, p):
        """O^T[D, 8 heads] = V^T P^T for P [16 tokens, 8 heads] in the accumulator layout."""
        x = [p[G, 2 * T], p[G, 2 * T + 1], p[G + 8, 2 * T], p[G + 8, 2 * T + 1]]
        b = [movmatrix_trans(pack(x[0], x[1], self.mt)), movmatrix_trans(pack(x[2], x[3], self.mt))]
        acc = np.zeros((self.blocks, 4, 32))
        for c in range(0, self.blocks, 2):
            a = self.load_v(smem, row, c)
            for i in range(2):
                acc[c + i] = mma(acc[c + i], a[i], b, self.mt)
        o = np.zeros((self.d, 8))
        for c in range(self.blocks):
            for hi in range(2):
                o[self.o_dim(c, hi), 2 * T] = acc[c][2 * hi]
                o[self.o_dim(c, hi), 2 * T + 1] = acc[c][2 * hi + 1]
        return o


def storage(kv_dtype):
    return np.dtype(getattr(ml_dtypes, kv_dtype) if kv_dtype != "float16" else np.float16)


def fill_tile(rows, row_bytes):
    """Shared-memory image of rows [n, D] (storage dtype) laid out with tile_offset."""
    raw = rows.view(np.uint8).reshape(rows.shape[0], row_bytes)
    smem = np.zeros(rows.shape[0] * row_bytes, dtype=np.uint8)
    for r in range(rows.shape[0]):
        for ch in range(row_bytes // 16):
            at = tile_offset(r, ch, row_bytes)
            smem[at : at + 16] = raw[r, 16 * ch : 16 * ch + 16]
    return smem


KV = ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("kv_dtype", KV)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_scores_and_values_match_the_math(kv_dtype, head_dim):
    rng = np.random.default_rng(head_dim)
    m = Model(head_dim, kv_dtype)
    k = (rng.standard_normal((48, head_dim))).astype(storage(kv_dtype))
    v = (rng.standard_normal((48, head_dim))).astype(storage(kv_dtype))
    q = rng.standard_normal((16, head_dim)).astype(m.mt)  # two head tiles
    ks, vs = fill_tile(k, m.row_bytes), fill_tile(v, m.row_bytes)
    row = 16  # a warp's 16 rows inside the tile
    for nt in range(2):
        got = m.scores(ks, row, q, nt)
        want = k[row : row + 16].astype(np.float64) @ q[8 * nt : 8 * nt + 8].astype(np.float64).T
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)
    p = rng.random((16, 8))
    got = m.values(vs, row, p)
    want = v[row : row + 16].astype(np.float64).T @ p.astype(m.mt).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_pairs_each_dim_with_its_partner(kv_dtype, head_dim):
    rng = np.random.default_rng(1)
    m = Model(head_dim, kv_dtype)
    k = rng.standard_normal((32, head_dim)).astype(storage(kv_dtype))
    q = rng.standard_normal((8, head_dim)).astype(m.mt)
    freq = rope_frequencies(head_dim, 1.0, 1e4).astype(np.float64).sum(axis=1)
    first = 1000 + 16  # tile row 0 is token 1000; the warp's rows start at tile row 16
    got = m.scores(fill_tile(k, m.row_bytes), 16, q, 0, rope_first=first, freq=freq)
    pos = first + np.arange(16)
    ang = 2 * np.pi * pos[:, None] * freq[None, :]
    kf = k[16:32].astype(np.float64)
    half = head_dim // 2
    lo, hi = kf[:, :half], kf[:, half:]
    rot = np.concatenate(
        [lo * np.cos(ang) - hi * np.sin(ang), hi * np.cos(ang) + lo * np.sin(ang)], 1
    )
    want = rot @ q.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=3e-2 * math.sqrt(head_dim))


@pytest.mark.parametrize("row_bytes", [64, 128, 256, 512])
def test_swizzle_is_a_permutation_and_ldmatrix_phases_are_conflict_free(row_bytes):
    rows = 64
    offsets = {tile_offset(r, c, row_bytes) for r in range(rows) for c in range(row_bytes // 16)}
    assert offsets == set(range(0, rows * row_bytes, 16))
    for r0 in range(0, rows, 8):  # 8 consecutive rows, one logical chunk: 8 bank groups
        for c in range(row_bytes // 16):
            groups = {tile_offset(r0 + r, c, row_bytes) // 16 % 8 for r in range(8)}
            assert len(groups) == 8


@pytest.mark.parametrize("page_size", [1, 5, 16, 128])
@pytest.mark.parametrize("row_bytes, tile", [(256, 64), (128, 128), (512, 64)])
def test_paged_loader_places_every_token(page_size, row_bytes, tile):
    """The copy mapping of PagedTileLoader: token tile_begin + row lands in row `row`."""
    rng = np.random.default_rng(page_size)
    threads, chunks = 128, row_bytes // 16
    rows_per_pass = threads // chunks
    begin, end = 37, 37 + tile - 11  # a last, partial tile
    num_pages = (end + page_size - 1) // page_size + 4
    page_ids = rng.permutation(num_pages)
    magic, shift = fast_div(page_size)
    div = lambda n: ((n * magic >> 32) + n) >> shift  # noqa: E731
    cache = rng.integers(0, 255, (num_pages * page_size, row_bytes), dtype=np.uint8)
    smem = np.full(tile * row_bytes, 7, dtype=np.uint8)
    for tid in range(threads):
        row0, chunk = tid // chunks, tid % chunks
        for p in range(tile // rows_per_pass):
            row = row0 + p * rows_per_pass
            token = begin + row
            at = tile_offset(row, chunk, row_bytes)
            if token < end:
                page = page_ids[div(token)]
                slot = token - div(token) * page_size
                src = cache[page * page_size + slot, 16 * chunk : 16 * chunk + 16]
                smem[at : at + 16] = src
            else:
                smem[at : at + 16] = 0
    for row in range(tile):
        token = begin + row
        want = np.zeros(row_bytes, np.uint8)
        if token < end:
            want = cache[page_ids[token // page_size] * page_size + token % page_size]
        got = np.concatenate([smem[tile_offset(row, c, row_bytes) :][:16] for c in range(chunks)])
        np.testing.assert_array_equal(got, want)


def kernel_flow(buf, batch_size, q, k_cache, v_cache, page_size, head_dim, group, feats):
    """The control flow of decode_kernel at tile level, in float64: items read from the
    packed plan, window start, 64-token tiles split 16 per warp, masks, online softmax per
    warp, warp merge, then the direct write or the split partials merged in chunk order."""
    hdr, log2e = 4 + head_dim, 1 / math.log(2)
    num_qo_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    o, lse = np.full((batch_size, num_qo_heads, head_dim), np.nan), np.full(q.shape[:2], np.nan)
    partial = {}
    for kv_head in range(num_kv_heads):
        for item in range(buf[0]):
            req, begin, end, kv_len, page_begin, merge_begin, merge_count, _ = buf[
                hdr + 8 * item : hdr + 8 * item + 8
            ]
            q_pos = kv_len - 1
            if feats["window_left"] >= 0:
                begin = max(begin, q_pos - feats["window_left"])
            heads = slice(kv_head * group, (kv_head + 1) * group)
            qh = q[req, heads].astype(np.float64)
            warps = [(np.full(group, -np.inf), np.zeros(group), np.zeros((group, head_dim)))
                     for _ in range(4)]  # fmt: skip
            for tile_begin in range(begin, end, 64):
                for w in range(4):
                    tokens = tile_begin + 16 * w + np.arange(16)
                    valid = tokens < end
                    ids = buf[page_begin + np.where(valid, tokens, 0) // page_size]
                    k = np.where(valid[:, None], k_cache[ids, tokens % page_size, kv_head], 0)
                    v = np.where(valid[:, None], v_cache[ids, tokens % page_size, kv_head], 0)
                    x = qh @ k.T * feats["scale"] * log2e
                    x = np.where(valid[None], x, -np.inf)
                    m, d, acc = warps[w]
                    m_new = np.maximum(m, x.max(axis=1))
                    off = np.where(np.isneginf(m_new), 0, m_new)
                    scale = np.exp2(m - off)
                    p = np.exp2(x - off[:, None])
                    warps[w] = (m_new, d * scale + p.sum(1), acc * scale[:, None] + p @ v)
            m = np.max([s[0] for s in warps], axis=0)
            off = np.where(np.isneginf(m), 0, m)
            d = sum(s[1] * np.exp2(s[0] - off) for s in warps)
            acc = sum(s[2] * np.exp2(s[0] - off)[:, None] for s in warps)
            out = np.where(d[:, None] > 0, acc / np.where(d > 0, d, 1)[:, None], 0)
            out *= feats["v_scale"]
            state = np.where(d > 0, m + np.log2(np.where(d > 0, d, 1)), -np.inf)
            if merge_count == 1:
                o[req, heads], lse[req, heads] = out, state
            else:
                partial[(item, kv_head)] = (out, state, req, merge_begin, merge_count)
    for (item, kv_head), (_, _, req, merge_begin, merge_count) in partial.items():
        if item != merge_begin + merge_count - 1:
            continue  # merge once per group (the kernel: whichever CTA arrives last)
        parts = [partial[(i, kv_head)] for i in range(merge_begin, merge_begin + merge_count)]
        m = np.max([p[1] for p in parts], axis=0)
        off = np.where(np.isneginf(m), 0, m)
        wts = [np.where(np.isneginf(p[1]), 0, np.exp2(p[1] - off)) for p in parts]
        total = sum(wts)
        heads = slice(kv_head * group, (kv_head + 1) * group)
        o[req, heads] = (
            sum(w[:, None] * p[0] for w, p in zip(wts, parts, strict=True))
            / np.where(total > 0, total, 1)[:, None]
        )
        lse[req, heads] = np.where(total > 0, m + np.log2(np.where(total > 0, total, 1)), -np.inf)
    return o, lse


@pytest.mark.parametrize("window_left", [-1, 0, 40])
@pytest.mark.parametrize(
    "split", [dict(num_sms=132, ctas_per_sm=2, min_chunk_tokens=16), dict(disable_split_kv=True)]
)
def test_kernel_flow_matches_the_reference(window_left, split):
    from rtcinfer.attention.decode_plan import pack_plan
    from rtcinfer.plan.decode import plan_decode

    from .paged_batch import page_table_for
    from .reference_attention import batch_decode_paged_ref

    rng = np.random.default_rng(window_left + 7)
    page_size, head_dim, group, num_kv_heads = 16, 64, 3, 2
    lengths = [0, 1, 15, 16, 17, 300, 0, 129]
    indptr, indices, last, num_pages = page_table_for(lengths, page_size, rng)
    cache = rng.standard_normal((num_pages, 2, page_size, num_kv_heads, head_dim))
    q = rng.standard_normal((len(lengths), group * num_kv_heads, head_dim))
    kwargs = {"num_sms": 132, "ctas_per_sm": 2, **split}
    plan = plan_decode(indptr, last, page_size, num_kv_heads, **kwargs)
    assert plan.split_kv == ("disable_split_kv" not in split)
    buf = np.zeros(4 + head_dim + 8 * plan.num_work + len(indices), dtype=np.int32)
    pack_plan(buf, plan, indptr.astype(np.int64), indices, head_dim, None)
    feats = {"window_left": window_left, "scale": 0.3, "v_scale": 1.5}
    o, lse = kernel_flow(buf, len(lengths), q, cache[:, 0], cache[:, 1], page_size, head_dim,
                         group, feats)  # fmt: skip
    o_ref, lse_ref = batch_decode_paged_ref(
        q, cache, indptr, indices, last, window_left=window_left, sm_scale=0.3, v_scale=1.5,
        return_lse=True,
    )  # fmt: skip
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[finite], lse_ref[finite], rtol=1e-10)
