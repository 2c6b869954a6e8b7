"""The prefill planner without a GPU: which work items it makes, and a NumPy execution of the
plan that must reproduce the float64 reference (split and whole plans, causal, window)."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer.plan.prefill import (
    WAVE_GAIN,
    choose_tile_rows,
    fills_gpu,
    plan_prefill,
    tile_counts,
)

from . import reference_attention as aref
from .prefill_executor import execute_prefill_plan

AWKWARD = [0, 1, 17, 127, 128, 129, 1000]


def batch(rng, qo_lens, kv_extra, num_kv_heads=2, group=4, d=16):
    qo = np.asarray(qo_lens)
    kv = qo + np.asarray(kv_extra)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)])
    kv_indptr = np.concatenate([[0], np.cumsum(kv)])
    q = rng.standard_normal((int(qo_indptr[-1]), num_kv_heads * group, d))
    k = rng.standard_normal((int(kv_indptr[-1]), num_kv_heads, d))
    v = rng.standard_normal((int(kv_indptr[-1]), num_kv_heads, d))
    return q, k, v, qo_indptr, kv_indptr, kv


def reference(q, k, v, qo_indptr, kv_indptr, **features):
    outs = [
        aref.attention_ref(q[qo_indptr[b] : qo_indptr[b + 1]], k[kv_indptr[b] : kv_indptr[b + 1]],
                          v[kv_indptr[b] : kv_indptr[b + 1]], **features)
        for b in range(len(qo_indptr) - 1)
    ]  # fmt: skip
    return np.concatenate([o for o, _ in outs]), np.concatenate([s for _, s in outs])


def coverage(plan, causal, window_left):
    """Per request, how many work items cover each visible (packed row, key) pair."""
    g = plan.group_size
    counts = [np.zeros((int(q) * g, int(k)), np.int64) for q, k in zip(plan.qo_len, plan.kv_len,
                                                                     strict=True)]  # fmt: skip
    for w in range(plan.num_work):
        t = plan.work_tile[w]
        b = int(plan.tile_request[t])
        rows = np.arange(plan.tile_row[t], min(plan.tile_row[t] + plan.tile_rows,
                                               counts[b].shape[0]))  # fmt: skip
        keys = np.arange(plan.work_kv_begin[w], plan.work_kv_end[w])
        counts[b][np.ix_(rows, keys)] += visible(plan, b, rows, keys, causal, window_left)
    return counts


def visible(plan, b, rows, keys, causal, window_left) -> np.ndarray:
    qpos = (rows // plan.group_size + int(plan.kv_len[b]) - int(plan.qo_len[b]))[:, None]
    mask = np.ones((len(rows), len(keys)), dtype=bool)
    if causal:
        mask &= keys[None, :] <= qpos
    if window_left >= 0:
        mask &= keys[None, :] >= qpos - window_left
    return mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window_left", [-1, 0, 37])
@pytest.mark.parametrize("split", ["whole", "auto", "fixed"])
def test_items_cover_every_visible_pair_once(causal, window_left, split):
    rng = np.random.default_rng(3)
    qo = [int(x) for x in rng.permutation(AWKWARD)]
    kv = [q + int(e) for q, e in zip(qo, rng.integers(0, 300, len(qo)), strict=True)]
    kwargs = dict(num_sms=132, ctas_per_sm=2, causal=causal, window_left=window_left,
                  min_chunk_tokens=64)  # fmt: skip
    if split == "whole":
        kwargs["disable_split_kv"] = True
    elif split == "fixed":
        kwargs["fixed_split_size"] = 100
    else:
        kwargs.update(num_sms=200)
    plan = plan_prefill(np.concatenate([[0], np.cumsum(qo)]), kv, 3, 2, 128, **kwargs)
    for b, count in enumerate(coverage(plan, causal, window_left)):
        rows, keys = np.arange(count.shape[0]), np.arange(count.shape[1])
        np.testing.assert_array_equal(count, visible(plan, b, rows, keys, causal, window_left))
    rows = {(int(plan.tile_request[t]), r) for t in range(plan.num_tiles)
            for r in range(plan.tile_row[t], plan.tile_row[t] + plan.tile_rows)
            if r < plan.qo_len[plan.tile_request[t]] * 3}  # fmt: skip
    assert rows == {(b, r) for b, q in enumerate(qo) for r in range(q * 3)}
    if split == "whole":
        assert not plan.split_kv and plan.num_work == plan.num_tiles


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window_left", [-1, 20])
@pytest.mark.parametrize("split", [False, True])
def test_executing_the_plan_reproduces_the_reference(causal, window_left, split):
    rng = np.random.default_rng(int(causal) * 2 + (window_left > 0) * 4 + split)
    qo = [0, 1, 17, 40, 3, 129]
    extra = [5, 0, 300, 0, 0, 64]  # zero keys for a request with zero queries; append batches
    q, k, v, qo_indptr, kv_indptr, kv = batch(rng, qo, extra)
    features = dict(causal=causal, window_left=window_left, logits_soft_cap=0.0)
    plan = plan_prefill(qo_indptr, kv, 4, 2, 16, num_sms=100 if split else 1, ctas_per_sm=2,
                        min_chunk_tokens=32, causal=causal, window_left=window_left)  # fmt: skip
    assert plan.split_kv == split
    o, lse = execute_prefill_plan(plan, q, k, v, qo_indptr, kv_indptr, sm_scale=0.25,
                                  **features)  # fmt: skip
    o_ref, lse_ref = reference(q, k, v, qo_indptr, kv_indptr, sm_scale=0.25, **features)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)


def test_more_queries_than_keys_hide_the_early_queries_under_causal():
    rng = np.random.default_rng(0)
    q, k, v, qo_indptr, kv_indptr, kv = batch(rng, [10], [-4])  # 10 queries over 6 keys
    plan = plan_prefill(qo_indptr, kv, 4, 2, 16, num_sms=132, ctas_per_sm=2, causal=True)
    o, lse = execute_prefill_plan(plan, q, k, v, qo_indptr, kv_indptr, sm_scale=0.25,
                                  causal=True)  # fmt: skip
    assert np.isneginf(lse[:4]).all() and (o[:4] == 0).all()  # queries before key 0
    o_ref, lse_ref = reference(q, k, v, qo_indptr, kv_indptr, sm_scale=0.25, causal=True)
    np.testing.assert_allclose(o, o_ref, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))


def test_the_split_fills_the_gpu_without_overfilling_it():
    qo_indptr = [0, 16, 32]  # two requests of 16 queries (64 packed rows) over long prompts
    plan = plan_prefill(qo_indptr, [20000, 9000], 4, 8, 128, num_sms=132, ctas_per_sm=2)
    assert plan.split_kv and plan.num_work * 8 <= 264
    assert plan.num_work * 8 > 264 // 2  # it uses the room it has
    assert plan.chunk_tokens % 1 == 0 and plan.chunk_tokens >= 256


def test_a_full_gpu_is_not_split():
    qo = np.full(64, 128)
    plan = plan_prefill(np.concatenate([[0], np.cumsum(qo)]), qo, 4, 8, 128, num_sms=132,
                        ctas_per_sm=2, causal=True)  # fmt: skip
    assert not plan.split_kv and plan.num_work == plan.num_tiles == 64 * 4


@pytest.mark.parametrize("batch, ctas, chunk", [(64, 3, 1408), (48, 2, 2048), (64, 2, 4096),
                                                 (256, 2, 1024)])  # fmt: skip
def test_equal_tiles_past_the_slots_are_cut_to_fill_the_last_wave(batch, ctas, chunk):
    """More equal tiles than slots: one item a tile leaves the last wave part empty (64 of 49
    slots a head: two waves for 1.3 of work), so a chunk of 1/k of the keys is taken where
    its waves cost less by WAVE_GAIN (64 on 33 slots: 1.94 waves, and 256 x 1024 on 33:
    7.8 waves, stay whole)."""
    kv = np.full(batch, 4096 if batch <= 64 else 1024)
    plan = plan_prefill(np.arange(batch + 1), kv, 4, 8, 128, num_sms=132, ctas_per_sm=ctas,
                        page_size=16, tile_rows=16, kv_tile=128)  # fmt: skip
    assert plan.chunk_tokens == chunk and chunk % 128 == 0
    slots = 132 * ctas // 8
    whole = -(-batch // slots) * (kv[0] + 256)
    cut = -(-plan.num_work // slots) * (min(chunk, kv[0]) + 256)
    assert cut <= whole * (1 - WAVE_GAIN) or chunk == kv[0]
    tiles = tile_counts(np.arange(batch + 1), kv, 4, 16)  # the wrapper's device-items test
    assert fills_gpu(tiles, 8, num_sms=132, ctas_per_sm=ctas, page_size=16,
                     kv_tile=128) == (chunk == kv[0])  # fmt: skip


@pytest.mark.parametrize(
    "qo, kv",
    [
        ([1] * 64, [4000] + [4096] * 63),  # another length
        ([5] * 64, [4096] * 64),
    ],
)  # two 16-row tiles a request
def test_unlike_requests_past_the_slots_stay_whole(qo, kv):
    plan = plan_prefill(np.cumsum([0, *qo]), kv, 4, 8, 128, num_sms=132, ctas_per_sm=3,
                        page_size=16, tile_rows=16, kv_tile=128)  # fmt: skip
    assert not plan.split_kv and plan.num_work == plan.num_tiles


@pytest.mark.parametrize("qo, kv, causal, window_left", [(16, 16, True, -1), (1, 4096, False, 100),
                                                        (1, 4096, False, -1)])  # fmt: skip
def test_fills_gpu_agrees_with_the_wave_cut(qo, kv, causal, window_left):
    """The wrapper expands one item a tile on the device only where plan_prefill would give one
    item a tile: short causal prompts (no chunk shorter than their keys) and a window of 101
    keys stay whole, 4096 keys are cut."""
    indptr, kv_len = np.arange(65) * qo, np.full(64, kv)
    gpu = dict(num_sms=132, ctas_per_sm=3)
    shape = dict(causal=causal, window_left=window_left, page_size=16, kv_tile=128)
    plan = plan_prefill(indptr, kv_len, 4, 8, 128, tile_rows=16, **gpu, **shape)
    tiles = tile_counts(indptr, kv_len, 4, 16)
    assert fills_gpu(tiles, 8, **gpu, **shape) == (not plan.split_kv)
    assert plan.split_kv == (window_left < 0 and kv == 4096)


@pytest.mark.parametrize("seed", range(40))
def test_fills_gpu_only_where_plan_prefill_keeps_every_tile_whole(seed):
    """Small batches too: where fills_gpu says one item a tile (the device expands them),
    plan_prefill gives exactly that; batches whose keys fit the least chunk (min_chunk_tokens)
    are never split, so they take the device's items."""
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, 12))
    qo = rng.integers(0, 40, b)
    kv = qo + rng.choice([0, 3, 60, 190, 250, 260, 700], b)
    indptr = np.concatenate([[0], np.cumsum(qo)])
    page, kv_tile = int(rng.choice([1, 16, 64])), int(rng.choice([64, 128]))
    rows = int(rng.choice([16, 64]))
    least = int(rng.choice([16, 256, 1024]))  # min_chunk_tokens, as both take it
    gpu = dict(num_sms=132, ctas_per_sm=2)
    shape = dict(causal=bool(seed % 2), window_left=-1, page_size=page, kv_tile=kv_tile,
                 min_chunk_tokens=least)  # fmt: skip
    plan = plan_prefill(indptr, kv, 4, 8, 128, tile_rows=rows, **gpu, **shape)
    fills = fills_gpu(tile_counts(indptr, kv, 4, rows), 8, **gpu, **shape)
    if fills:
        assert plan.num_work == plan.num_tiles and not plan.split_kv
    if int(kv.max()) <= least and least % page == 0 and least % kv_tile == 0:
        assert fills


def test_a_wave_cut_stays_inside_max_work():
    plan = plan_prefill(np.arange(65), np.full(64, 4096), 4, 8, 128, num_sms=132,
                        ctas_per_sm=3, page_size=16, tile_rows=16, kv_tile=128,
                        max_work=128)  # fmt: skip
    assert plan.num_work == 128 and plan.chunk_tokens == 2048


def test_a_skewed_batch_splits_the_long_prompt_only():
    qo = [8192] + [128] * 63
    indptr = np.concatenate([[0], np.cumsum(qo)])
    plan = plan_prefill(indptr, qo, 1, 8, 128, num_sms=132, ctas_per_sm=2, causal=True,
                        tile_rows=128)  # fmt: skip
    items_of = np.bincount(plan.tile_request[plan.work_tile], minlength=len(qo))
    tiles_of = np.bincount(plan.tile_request, minlength=len(qo))
    assert (items_of[1:] == tiles_of[1:]).all()  # the short prompts: one item per tile
    assert items_of[0] >= tiles_of[0]


def test_fixed_split_size_chunks_a_request_the_same_in_any_batch():
    """The grid is absolute and the tile height fixed: a request's work items (key ranges per
    tile) are the same alone and beside others."""
    alone = plan_prefill([0, 300], [2000], 4, 2, 128, num_sms=132, ctas_per_sm=2,
                         fixed_split_size=128, causal=True)  # fmt: skip
    beside = plan_prefill([0, 5, 305, 2305], [40, 2000, 2000], 4, 2, 128, num_sms=132,
                          ctas_per_sm=2, fixed_split_size=128, causal=True)  # fmt: skip

    def ranges(plan, b):
        items = np.flatnonzero(plan.tile_request[plan.work_tile] == b)
        return [(int(plan.tile_row[plan.work_tile[w]]), int(plan.work_kv_begin[w]),
                 int(plan.work_kv_end[w])) for w in items]  # fmt: skip

    assert ranges(alone, 0) == ranges(beside, 1)


def test_tile_height_follows_the_packed_query_length():
    assert choose_tile_rows(np.array([1, 1, 1]), 4, 128) == 8  # decode-like: rows on N
    assert choose_tile_rows(np.array([1, 1, 1]), 8, 128) == 8
    assert choose_tile_rows(np.array([3, 3, 3]), 4, 128) == 16
    assert choose_tile_rows(np.array([8, 8]), 4, 128) == 64
    assert choose_tile_rows(np.array([512]), 4, 128) == 128
    assert choose_tile_rows(np.array([512]), 4, 256) == 64
    assert choose_tile_rows(np.array([512]), 4, 256, wgmma=True) == 128  # warpgroup MMAs
    assert choose_tile_rows(np.array([], dtype=np.int64), 4, 128) == 8


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(qo_indptr=[1, 3], kv_len=[3]), ValueError, r"qo_indptr\[0\] must be 0"),
        (dict(qo_indptr=[0, 3, 2], kv_len=[3, 3]), ValueError, "non-decreasing"),
        (dict(qo_indptr=[0, 3], kv_len=[3, 4]), ValueError, r"kv_len must have shape \(1,\)"),
        (dict(qo_indptr=[0, 3], kv_len=[-1]), ValueError, r"kv_len\[0\] \(-1\)"),
        (dict(qo_indptr=[0, 3], kv_len=[3], tile_rows=48), ValueError, "tile_rows must be"),
        (dict(qo_indptr=[0, 3], kv_len=[3], causal=1), TypeError, "causal must be a bool"),
        (dict(qo_indptr=[0, 300], kv_len=[300], max_work=2), ValueError, "exceed max_work"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_by_name(kwargs, error, match):
    args = dict(group_size=4, num_kv_heads=2, head_dim=128, num_sms=132, ctas_per_sm=2)
    with pytest.raises(error, match=match):
        plan_prefill(**{**args, **kwargs})


def test_an_empty_batch_plans_nothing():
    plan = plan_prefill([0], [], 4, 2, 128, num_sms=132, ctas_per_sm=2)
    assert plan.num_work == plan.num_tiles == 0 and not plan.split_kv


@pytest.mark.parametrize("page_size, kv_tile", [(16, 64), (1, 64), (128, 64), (48, 64), (16, 1)])
def test_automatic_chunks_are_whole_pages_and_whole_kv_tiles(page_size, kv_tile):
    """A chunk starting inside a K/V tile would load that tile in two items: automatic chunks
    are multiples of both the page and the tile, the smallest such that fits the GPU (one
    decode-like request of 32768 keys: 63 pages of 16 without the tile, 64 with it)."""
    kv = [32768]
    plan = plan_prefill([0, 1], kv, 4, 8, 128, num_sms=132, ctas_per_sm=2, tile_rows=16,
                        page_size=page_size, kv_tile=kv_tile)  # fmt: skip
    step = page_size * kv_tile // np.gcd(page_size, kv_tile)
    assert plan.split_kv and plan.chunk_tokens % step == 0
    assert plan.num_work * 8 <= 264
    smaller = plan.chunk_tokens - step
    assert smaller < 256 or -(-32768 // smaller) * 8 > 264  # the smallest that fits
    if (page_size, kv_tile) == (16, 64):
        assert plan.chunk_tokens == 1024 and plan.num_work == 32
    if kv_tile == 1 and page_size == 16:
        assert plan.chunk_tokens == 1008  # 63 pages: 33 items


@pytest.mark.parametrize("seed", range(60))
def test_random_batches_cover_every_visible_pair_once(seed):
    """Random batches and options (group size, page and KV tile sizes, causal or not, window,
    automatic / fixed / no split, a GPU of any size): every visible (row, key) pair of every
    request is in exactly one work item, every query row in one tile, and without a mask an
    item's keys are whole pages of its request (but the request's last; the causal mask and
    a window clip items to the keys they leave visible)."""
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(1, 12))
    qo = rng.choice([0, 1, 2, 7, 16, 33, 128, 129, 300], n)
    kv = qo + rng.choice([0, 0, 1, 15, 64, 257, 1500], n)
    causal, group = bool(rng.integers(2)), int(rng.choice([1, 2, 4, 5, 8]))
    window_left = int(rng.choice([-1, -1, 0, 1, 63, 200]))
    page, kv_tile = int(rng.choice([1, 5, 16, 64])), int(rng.choice([1, 64, 128]))
    kwargs = dict(num_sms=int(rng.choice([1, 8, 132, 1000])), ctas_per_sm=int(rng.integers(1, 4)),
                  causal=causal, window_left=window_left, page_size=page, kv_tile=kv_tile,
                  min_chunk_tokens=int(rng.choice([1, 64, 256])))  # fmt: skip
    mode = int(rng.integers(3))
    if mode == 1:
        kwargs["disable_split_kv"] = True
    elif mode == 2:
        kwargs["fixed_split_size"] = int(rng.integers(1, 40))
    plan = plan_prefill(np.concatenate([[0], np.cumsum(qo)]), kv, group, 2, 128, **kwargs)
    for b, count in enumerate(coverage(plan, causal, window_left)):
        rows, keys = np.arange(count.shape[0]), np.arange(count.shape[1])
        np.testing.assert_array_equal(count, visible(plan, b, rows, keys, causal, window_left))
    rows = {(int(plan.tile_request[t]), r) for t in range(plan.num_tiles)
            for r in range(plan.tile_row[t], plan.tile_row[t] + plan.tile_rows)
            if r < plan.qo_len[plan.tile_request[t]] * group}  # fmt: skip
    assert rows == {(b, r) for b, q in enumerate(qo) for r in range(q * group)}
    for w in range(plan.num_work):
        b = int(plan.tile_request[plan.work_tile[w]])
        begin, end = int(plan.work_kv_begin[w]), int(plan.work_kv_end[w])
        assert 0 <= begin <= end <= kv[b]
        if not causal and window_left < 0:
            assert begin % page == 0 and (end % page == 0 or end == kv[b])


@pytest.mark.parametrize("seed", range(16))
def test_executing_random_plans_reproduces_the_reference(seed):
    """The NumPy execution of random batches' plans (split or not, any group size, causal or
    not, window, soft cap) equals the float64 reference, empty requests and rows included."""
    rng = np.random.default_rng(2000 + seed)
    n = int(rng.integers(1, 7))
    qo = [int(x) for x in rng.choice([0, 1, 5, 16, 40, 129], n)]
    extra = [int(x) for x in rng.choice([0, 3, 64, 200], n)]
    group = int(rng.choice([1, 3, 4]))
    q, k, v, qo_indptr, kv_indptr, kv = batch(rng, qo, extra, group=group)
    causal, window_left = bool(rng.integers(2)), int(rng.choice([-1, 0, 20]))
    cap = float(rng.choice([0.0, 5.0]))
    split = dict(fixed_split_size=int(rng.integers(1, 9))) if rng.integers(2) else {}
    plan = plan_prefill(qo_indptr, kv, group, 2, 16, num_sms=int(rng.choice([1, 64])),
                        ctas_per_sm=2, causal=causal, window_left=window_left,
                        page_size=int(rng.choice([1, 16])), min_chunk_tokens=16,
                        **split)  # fmt: skip
    features = dict(causal=causal, window_left=window_left, logits_soft_cap=cap)
    o, lse = execute_prefill_plan(plan, q, k, v, qo_indptr, kv_indptr, sm_scale=0.3,
                                  **features)  # fmt: skip
    o_ref, lse_ref = reference(q, k, v, qo_indptr, kv_indptr, sm_scale=0.3, **features)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
