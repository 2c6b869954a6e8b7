"""The prefill kernel's control flow transcribed in NumPy (prefill_flow: the loops of
prefill.cu reading the packed plan and run()'s strides as the kernel does) against float64
attention, over paged and ragged caches, with and without custom masks, without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer.attention.prefill_plan import (
    ITEM_INTS,
    WORK_ITEM,
    items_at,
)

from . import test_prefill_host as host
from .test_prefill_host import info, mask_in_plan


@pytest.fixture
def wrappers(monkeypatch):
    """test_prefill_host's: the prefill module, its wrappers planning without a GPU, and the
    packed plans they upload."""
    return host.wrappers.__wrapped__(monkeypatch)


def fast_div(n, magic, shift):
    """FastDiv::div of paged_kv.cuh: (umulhi(n, magic) + n) >> shift."""
    return ((n * magic >> 32) + n) >> shift


def prefill_flow(buf, p, fields, spec, q, k_flat, v_flat, mask_bits=None, kpe_flat=None):
    """prefill_kernel's control flow in float64 (no ALiBi, RoPE or soft cap): items read from
    the packed plan, rows of GQA-packed queries, KV tiles from the aligned key below kv_begin
    split between the warps sharing rows, K/V rows addressed through the page ids, the
    strides and FastDiv exactly as the loader does, blocks that skip the masks (all_see),
    online softmax, the warps' merge, then the direct write or the partials merged by the
    last arrival in chunk order; a warp's rows (the mask-skip test's unit) are spec.warp_rows
    of them; a ragged kernel addresses row page_ids[0] + token. k_flat, v_flat: the caches'
    elements, addressed by the byte strides over itemsize 2; v's rows (and o's) have
    spec.dim_vo elements, k's spec.head_dim. MLA (spec.mla): q is q_nope | q_pe along its last
    axis, [nnz, Hq, 576]; one kv head; K's rows are ckv's 512 (k_flat at the k_* strides) then
    kpe's 64 (kpe_flat at the v_* strides), V's their ckv part (o [nnz, Hq, 512]; the four
    warps a row warp each take a quarter of its dims, the same sums as one)."""
    d, dv = spec.head_dim, spec.dim_vo
    items = buf[items_at(d) : items_at(d) + ITEM_INTS * int(buf[0])].view(WORK_ITEM)
    num_kv_heads = q.shape[1] // p.group_size
    group, rows_n, kv_tile = p.group_size, spec.tile_rows, spec.kv_tile
    kv_warps = 4 if rows_n <= 16 and not spec.mla else 1
    warp_keys = kv_tile // kv_warps
    wr = spec.warp_rows
    o = np.full((*q.shape[:2], dv), np.nan)
    lse = np.full(q.shape[:2], np.nan)
    partials, arrivals = {}, {}
    log2e = 1 / np.log(2)

    def kv_row(flat, base_head, page_stride, token_stride, w, token, dims):
        if token >= w["kv_end"]:
            return np.zeros(dims)  # zero-filled past the item's keys
        if spec.ragged:  # paged_kv.cuh's ONE_PAGE
            at = ((int(buf[w["page_ids"]]) + token) * token_stride + base_head) // 2
            return flat[at : at + dims]
        div = fast_div(token, p.div_magic, p.div_shift)
        page = int(buf[w["page_ids"] + div])
        at = (page * page_stride + (token - div * p.page_size) * token_stride + base_head) // 2
        return flat[at : at + dims]

    for kv_head in range(num_kv_heads):
        for w in items:
            packed = w["tile_row"] + np.arange(rows_n)
            valid = packed < w["qo_len"] * group
            query = packed // group
            head = kv_head * group + packed % group
            pos = query + w["kv_len"] - w["qo_len"]
            qrows = np.where(valid[:, None], q[w["qo_start"] + np.where(valid, query, 0),
                                               np.where(valid, head, 0)], 0)  # fmt: skip
            key_first = w["kv_begin"] - w["kv_begin"] % kv_tile
            tiles = -(-(w["kv_end"] - key_first) // kv_tile) if w["kv_begin"] < w["kv_end"] else 0
            st = [(np.full(rows_n, -np.inf), np.zeros(rows_n), np.zeros((rows_n, dv)))
                  for _ in range(kv_warps)]  # fmt: skip
            for tile in range(tiles):
                for kw in range(kv_warps):
                    lo = key_first + tile * kv_tile + kw * warp_keys
                    keys = lo + np.arange(warp_keys)

                    def rows(flat, head_bytes, strides, dims, w=w, keys=keys):
                        page, token = (fields[f"{strides}_page"], fields[f"{strides}_token"])
                        return np.stack([kv_row(flat, head_bytes, page, token, w, t, dims)
                                         for t in keys])  # fmt: skip

                    if spec.mla:  # ckv | kpe; V: the ckv part
                        v = rows(k_flat, 0, "k", dv)
                        k = np.concatenate([v, rows(kpe_flat, 0, "v", 64)], axis=1)
                    else:
                        k = rows(k_flat, kv_head * fields["k_head"], "k", d)
                        v = rows(v_flat, kv_head * fields["v_head"], "v", dv)
                    x = qrows @ k.T * p.qk_scale * log2e
                    for rw in range(rows_n // wr):  # a row warp's rows
                        r = slice(wr * rw, wr * rw + wr)
                        first = w["tile_row"] + wr * rw
                        rows_in = w["qo_len"] * group
                        last = min(first + wr - 1, max(rows_in - 1, first))
                        pos_first = first // group + w["kv_len"] - w["qo_len"]
                        pos_last = last // group + w["kv_len"] - w["qo_len"]
                        all_see = mask_bits is None and lo >= w["kv_begin"] and (
                            lo + warp_keys - 1 < w["kv_end"])  # fmt: skip
                        if spec.causal:
                            all_see = all_see and lo + warp_keys - 1 <= pos_first
                        if p.window_left >= 0:
                            all_see = all_see and lo >= pos_last - p.window_left
                        if all_see:
                            continue
                        sees = (keys[None] >= w["kv_begin"]) & (keys[None] < w["kv_end"])
                        sees = np.repeat(sees, wr, axis=0)
                        if spec.causal:
                            sees &= keys[None] <= pos[r, None]
                        if p.window_left >= 0:
                            sees &= keys[None] >= pos[r, None] - p.window_left
                        if mask_bits is not None:
                            bit = 8 * w["mask_byte"] + query[r, None] * w["kv_len"] + keys[None]
                            ok = valid[r, None] & (keys[None] < w["kv_len"])
                            got = mask_bits[np.where(ok, bit, 0)]
                            sees &= ok & got
                        x[r] = np.where(sees, x[r], -np.inf)
                    m, dd, acc = st[kw]
                    m_new = np.maximum(m, x.max(axis=1))
                    off = np.where(np.isneginf(m_new), 0, m_new)
                    pr = np.exp2(x - off[:, None])
                    scale = np.exp2(m - off)
                    st[kw] = (m_new, dd * scale + pr.sum(1), acc * scale[:, None] + pr @ v)
            m = np.max([s[0] for s in st], axis=0)
            off = np.where(np.isneginf(m), 0, m)
            dd = sum(s[1] * np.exp2(s[0] - off) for s in st)
            acc = sum(s[2] * np.exp2(s[0] - off)[:, None] for s in st)
            out = np.where(dd[:, None] > 0, acc / np.where(dd > 0, dd, 1)[:, None], 0)
            out = out * p.v_scale
            state = np.where(dd > 0, m + np.log2(np.where(dd > 0, dd, 1)), -np.inf)
            rows_q, rows_h = w["qo_start"] + query[valid], head[valid]
            if w["slot"] < 0:
                o[rows_q, rows_h], lse[rows_q, rows_h] = out[valid], state[valid]
                continue
            partials[(w["slot"], kv_head)] = (out, state)
            key = (w["tile"], kv_head)
            arrivals[key] = arrivals.get(key, 0) + 1
            if arrivals[key] < w["merge_count"]:
                continue
            parts = [partials[(w["merge_slot"] + i, kv_head)] for i in range(w["merge_count"])]
            mm = np.max([s for _, s in parts], axis=0)
            off = np.where(np.isneginf(mm), 0, mm)
            wts = [np.where(np.isneginf(s), 0, np.exp2(s - off)) for _, s in parts]
            total = sum(wts)
            merged = sum(wt[:, None] * po for wt, (po, _) in zip(wts, parts, strict=True))
            merged = merged / np.where(total > 0, total, 1)[:, None]
            o[rows_q, rows_h] = merged[valid]
            lse[rows_q, rows_h] = np.where(total > 0, mm + np.log2(np.where(total > 0, total, 1)),
                                           -np.inf)[valid]  # fmt: skip
    return o, lse


FLOWS = {
    "causal_split": dict(causal=True, fixed_split_size=3),
    "causal_whole": dict(causal=True, disable_split_kv=True),
    "window": dict(causal=False, window_left=37, fixed_split_size=5),
    "mask": dict(custom_mask=True, fixed_split_size=4),
}


@pytest.mark.parametrize("flow", list(FLOWS))
@pytest.mark.parametrize("qo, extra, group", [
    ([0, 1, 17, 130, 5], [40, 0, 100, 0, -5], 4),    # 64-row tiles, a zero-key request
    ([1, 2, 1, 3], [300, 64, 0, 31], 4),             # decode-like: 8-row tiles, 4 warps
    ([3, 2, 4, 3], [300, 64, 0, 31], 4),             # 16-row tiles, 4 warps
    ([200, 90], [20, 500], 1),                       # 128-row tiles (MHA)
    ([200, 90], [20, 500], -32),                     # 128-row tiles, 32 rows a warp
])  # fmt: skip
def test_the_kernels_flow_reproduces_attention(wrappers, monkeypatch, flow, qo, extra, group):
    """The paged wrapper's real plan, packed plan and run() strides, read by prefill_flow as
    the kernel reads them, give float64 attention over each request's keys (group -32: MHA
    with the 32-row-warp kernel forced)."""
    from rtcinfer.attention import prefill_launch
    from rtcinfer.attention.paged_kv import cache_views

    from . import reference_attention as aref

    prefill, packed = wrappers
    rng = np.random.default_rng(len(qo) + abs(group))
    kw = dict(FLOWS[flow])
    if group < 0:  # warp_rows=-group where the kernel allows it
        spec_of, warp_rows, group = prefill_launch.prefill_spec, -group, 1
        if "custom_mask" in kw:  # refused: the kernel would spill
            with pytest.raises(ValueError, match="up to head_dim 128 without a custom mask"):
                spec_of("bfloat16", "bfloat16", 64, 128, custom_mask=True, warp_rows=warp_rows)
            return
        monkeypatch.setattr(prefill_launch, "prefill_spec", lambda *a, **k: spec_of(
            *a, **k, warp_rows=warp_rows if a[3] == 128 else 16))  # fmt: skip
        monkeypatch.setattr(prefill_launch, "pick_tile_rows", lambda cfg, qo_indptr, **_: 128)
    qo = np.array(qo)
    kv = qo + np.array(extra)
    hkv, d, page = 2, 64, 16
    pages = -(-kv // page)
    indptr = np.concatenate([[0], np.cumsum(pages)])
    indices = rng.permutation(int(indptr[-1]) + 3)[: indptr[-1]]
    last = np.where(pages > 0, kv - (pages - 1) * page, 0)
    num_pages = int(indptr[-1]) + 3
    cache = rng.standard_normal((num_pages, 2, page, hkv, d))  # NHD, 5-D
    qo_indptr = np.concatenate([[0], np.cumsum(qo)])
    q = rng.standard_normal((int(qo_indptr[-1]), hkv * group, d))
    masks = [rng.random((a, b)) < 0.7 for a, b in zip(qo, kv, strict=True)]
    bits = None
    if kw.pop("custom_mask", False):
        kw["custom_mask"] = np.concatenate([m.ravel() for m in masks])
    wrapper = prefill.BatchPrefillWithPagedKVCacheWrapper()
    wrapper.plan(qo_indptr, indptr, indices, last, hkv * group, hkv, d, page,
                 q_data_type="bfloat16", sm_scale=0.25, **kw)  # fmt: skip
    if "custom_mask" in kw:  # the packed bytes travel with the plan: read them from there
        nbytes = sum(-(-m.size // 8) for m in masks)
        in_plan = mask_in_plan(packed, wrapper._launch.launch, nbytes)
        bits = np.unpackbits(in_plan, bitorder="little").astype(bool)
    st = wrapper._launch
    p = st.launch.params
    p.qk_scale, p.v_scale = 0.25, 1.0  # exact in float32
    q_info = info(q.shape)
    cache_info = info(cache.shape)
    fields = wrapper._run_fields(q_info, cache_info, None, None, None, st.cfg)
    flat = cache.reshape(-1)
    v_offset = cache_views(cache_info, None, "NHD", 2)[1].offset  # V of the 5-D cache, bytes
    o, lse = prefill_flow(packed["plan"], p, fields, st.launch.kernel.spec, q, flat,
                          flat[v_offset // 2 :], bits)  # fmt: skip
    for b in range(len(qo)):
        qs = slice(qo_indptr[b], qo_indptr[b + 1])
        tokens = np.arange(kv[b])
        ids = indices[indptr[b] + tokens // page]
        k, v = cache[ids, 0, tokens % page], cache[ids, 1, tokens % page]
        o_ref, lse_ref = aref.attention_ref(
            q[qs], k, v, sm_scale=0.25, causal=bool(kw.get("causal")) and bits is None,
            window_left=kw.get("window_left", -1), mask=masks[b] if bits is not None else None,
        )  # fmt: skip
        np.testing.assert_allclose(o[qs], o_ref, rtol=1e-9, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(lse[qs]), np.isneginf(lse_ref))
        finite = np.isfinite(lse_ref)
        np.testing.assert_allclose(lse[qs][finite], lse_ref[finite], rtol=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_the_kernels_flow_over_a_ragged_cache(wrappers, causal):
    """The ragged form: one "page" of 2^30 slots per request at row kv_indptr[b] (FastDiv by
    2^30, page stride = token stride), split and whole."""
    from . import reference_attention as aref

    prefill, packed = wrappers
    rng = np.random.default_rng(causal)
    qo, kv = np.array([3, 0, 70, 9]), np.array([3, 12, 200, 40])
    hkv, group, d = 2, 3, 64
    qo_indptr = np.concatenate([[0], np.cumsum(qo)])
    kv_indptr = np.concatenate([[0], np.cumsum(kv)])
    q = rng.standard_normal((int(qo_indptr[-1]), hkv * group, d))
    k = rng.standard_normal((int(kv_indptr[-1]), hkv, d))
    v = rng.standard_normal(k.shape)
    for split in (dict(fixed_split_size=32), dict(disable_split_kv=True)):
        wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
        wrapper.plan(qo_indptr, kv_indptr, hkv * group, hkv, d, causal=causal, sm_scale=0.25,
                     q_data_type="bfloat16", **split)  # fmt: skip
        st = wrapper._launch
        p = st.launch.params
        p.qk_scale, p.v_scale = 0.25, 1.0
        fields = wrapper._run_fields(info(q.shape), info(k.shape), info(v.shape), None, None,
                                     st.cfg)  # fmt: skip
        o, lse = prefill_flow(packed["plan"], p, fields, st.launch.kernel.spec, q,
                              k.reshape(-1), v.reshape(-1))  # fmt: skip
        for b in range(len(qo)):
            qs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
            o_ref, lse_ref = aref.attention_ref(q[qs], k[ks], v[ks], sm_scale=0.25, causal=causal)
            np.testing.assert_allclose(o[qs], o_ref, rtol=1e-9, atol=1e-12)
            np.testing.assert_array_equal(np.isneginf(lse[qs]), np.isneginf(lse_ref))


@pytest.mark.parametrize("form", ["ragged", "NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_kernels_flow_with_fewer_value_dims(wrappers, form, causal):
    """head_dim_qk 192 over head_dim_vo 128 (DeepSeek's prefill): k rows of 192 elements, v
    rows and o rows of 128, through the real plans (split and whole; ragged, and a paged
    (k_cache, v_cache) pair in either layout, v with a padded token stride of its own)."""
    from . import reference_attention as aref

    prefill, packed = wrappers
    rng = np.random.default_rng(7 + causal)
    qo, kv = np.array([5, 0, 90, 17]), np.array([40, 9, 150, 17])
    hkv, group, d, dv, page = 2, 2, 192, 128, 16
    qo_indptr = np.concatenate([[0], np.cumsum(qo)])
    q = rng.standard_normal((int(qo_indptr[-1]), hkv * group, d))
    for split in (dict(fixed_split_size=2), dict(disable_split_kv=True)):
        if form == "ragged":
            kv_indptr = np.concatenate([[0], np.cumsum(kv)])
            k = rng.standard_normal((int(kv_indptr[-1]), hkv, d))
            v_wide = rng.standard_normal((int(kv_indptr[-1]), hkv, dv + 64))
            v = v_wide[:, :, :dv]  # a view: token stride of dv + 64 elements
            wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
            wrapper.plan(qo_indptr, kv_indptr, hkv * group, hkv, d, dv, causal=causal,
                         sm_scale=0.25, q_data_type="bfloat16",
                         **dict(split, fixed_split_size=32) if "fixed_split_size" in split
                         else split)  # fmt: skip
            k_info, v_info = info(k.shape), info(v_wide.shape)
            v_info = type(v_info)(v.shape, v_info.strides, v_info.dtype, v_info.offset)
            keys = [(k[a:b], v[a:b]) for a, b in zip(kv_indptr[:-1], kv_indptr[1:], strict=True)]
            k_flat, v_flat = k.reshape(-1), v_wide.reshape(-1)
        else:
            pages = -(-kv // page)
            indptr = np.concatenate([[0], np.cumsum(pages)])
            num_pages = int(indptr[-1]) + 2
            indices = rng.permutation(num_pages)[: indptr[-1]]
            last = np.where(pages > 0, kv - (pages - 1) * page, 0)
            shape_k, shape_v = (num_pages, page, hkv, d), (num_pages, page, hkv, dv)
            if form == "HND":
                shape_k, shape_v = (num_pages, hkv, page, d), (num_pages, hkv, page, dv)
            k_cache, v_cache = rng.standard_normal(shape_k), rng.standard_normal(shape_v)
            wrapper = prefill.BatchPrefillWithPagedKVCacheWrapper(kv_layout=form)
            wrapper.plan(qo_indptr, indptr, indices, last, hkv * group, hkv, d, page,
                         head_dim_vo=dv, causal=causal, sm_scale=0.25, q_data_type="bfloat16",
                         **split)  # fmt: skip
            k_info, v_info = info(shape_k), info(shape_v)
            keys = []
            for b in range(len(qo)):
                tokens = np.arange(kv[b])
                ids = indices[indptr[b] + tokens // page]
                if form == "NHD":
                    keys.append((k_cache[ids, tokens % page], v_cache[ids, tokens % page]))
                else:
                    keys.append((k_cache[ids, :, tokens % page], v_cache[ids, :, tokens % page]))
            k_flat, v_flat = k_cache.reshape(-1), v_cache.reshape(-1)
        st = wrapper._launch
        spec = st.launch.kernel.spec
        assert (spec.head_dim, spec.dim_vo) == (d, dv)  # (either kernel: the same flow)
        assert (getattr(st.plan, "num_slots", 0) > 0) == ("fixed_split_size" in split)
        p = st.launch.params
        p.qk_scale, p.v_scale = 0.25, 1.0
        fields = wrapper._run_fields(info(q.shape), k_info, v_info, None, None, st.cfg)
        o, lse = prefill_flow(packed["plan"], p, fields, spec, q, k_flat, v_flat)
        assert o.shape == (q.shape[0], hkv * group, dv)
        for b in range(len(qo)):
            qs = slice(qo_indptr[b], qo_indptr[b + 1])
            o_ref, lse_ref = aref.attention_ref(q[qs], *keys[b], sm_scale=0.25, causal=causal)
            np.testing.assert_allclose(o[qs], o_ref, rtol=1e-9, atol=1e-12)
            np.testing.assert_array_equal(np.isneginf(lse[qs]), np.isneginf(lse_ref))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, qo, extra, page", [
    (16, [1, 1, 1, 1, 1], [0, 300, 40, 999, 16], 16),  # decode: a query a 16-row tile
    (8, [3, 40, 0, 7], [5, 100, 9, 0], 1),             # 32-row tiles of 4 queries, 1-token pages
    (128, [1, 2], [700, 33], 16),                      # 32-row tiles: 4 a query
])  # fmt: skip
def test_the_kernels_flow_over_mla(wrappers, causal, heads, qo, extra, page):
    """BatchMLAPagedAttentionWrapper's plan and run() fields read by prefill_flow as the MLA
    kernel reads them (K from ckv and kpe, V their ckv part, one kv head of all the heads)
    give float64 MLA: softmax((q_nope . ckv + q_pe . kpe) sm_scale) @ ckv over each request's
    pages."""
    from rtcinfer.attention import mla

    from . import reference_attention as aref

    prefill, packed = wrappers
    rng = np.random.default_rng(heads + causal)
    qo, kv = np.array(qo), np.array(qo) + np.array(extra)
    pages = np.maximum(-(-kv // page), 1)  # a request with no keys keeps a page listed
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    num_pages = int(indptr[-1]) + 2
    indices = rng.permutation(num_pages)[: indptr[-1]].astype(np.int32)
    ckv = rng.standard_normal((num_pages, page, 512))
    kpe = rng.standard_normal((num_pages, page, 64))
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    q_nope = rng.standard_normal((int(qo_indptr[-1]), heads, 512))
    q_pe = rng.standard_normal((int(qo_indptr[-1]), heads, 64))
    wrapper = mla.BatchMLAPagedAttentionWrapper()
    wrapper.plan(qo_indptr, indptr, indices, kv.astype(np.int32), heads, 512, 64, page, causal,
                 0.0625, "bfloat16", "bfloat16")  # fmt: skip
    st = wrapper._launch
    spec = st.launch.kernel.spec
    assert spec.mla and (spec.head_dim, spec.dim_vo) == (576, 512)
    assert spec.tile_rows == (16 if heads == 16 else 32)
    if heads == 16:  # long keys, few tiles: split, the partials merged
        assert getattr(st.plan, "num_slots", 0) > 0
    p = st.launch.params
    p.qk_scale, p.v_scale = 0.0625, 1.0
    infos = [info(x.shape) for x in (q_nope, q_pe, ckv, kpe)]
    fields = mla._run_fields(*infos, None, None, (q_nope.shape[0], heads, 512))
    o, lse = prefill_flow(packed["plan"], p, fields, spec, np.concatenate([q_nope, q_pe], -1),
                          ckv.reshape(-1), None, kpe_flat=kpe.reshape(-1))  # fmt: skip
    for b in range(len(qo)):
        qs = slice(qo_indptr[b], qo_indptr[b + 1])
        tokens = np.arange(kv[b])
        ids = indices[indptr[b] + tokens // page]
        k = np.concatenate([ckv[ids, tokens % page], kpe[ids, tokens % page]], -1)[:, None]
        v = ckv[ids, tokens % page][:, None]
        o_ref, lse_ref = aref.attention_ref(np.concatenate([q_nope[qs], q_pe[qs]], -1), k, v,
                                            sm_scale=0.0625, causal=causal)  # fmt: skip
        np.testing.assert_allclose(o[qs], o_ref, rtol=1e-9, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(lse[qs]), np.isneginf(lse_ref))
        finite = np.isfinite(lse_ref)
        np.testing.assert_allclose(lse[qs][finite], lse_ref[finite], rtol=1e-9)
