"""Work items expanded from the requests table (prefill_items.py) against pack_plan of
plan_prefill's plan, the reference: its NumPy twin on the CPU, the kernel on the GPU, over
batches with empty requests, qo_len > kv_len, windows, causal or not, every tile height."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer.attention.prefill_items import (
    ItemsLayout,
    expand_items,
    expand_items_host,
    pack_requests,
    requests_ints,
)
from rtcinfer.attention.prefill_plan import ITEM_INTS, pack_plan
from rtcinfer.plan.prefill import TILE_ROWS, fills_gpu, plan_prefill, tile_counts

HEAD_DIM = 128


def plan_prefill_tiles(qo_indptr, kv, group, num_kv_heads, *, tile_rows, **gpu):
    """plan_launch's choice: the batch's tiles when they give one item a tile, else None."""
    tiles = tile_counts(qo_indptr, kv, group, tile_rows)
    return tiles if fills_gpu(tiles, num_kv_heads, **gpu) else None


def _batches():
    """(seed, group size, tile rows, causal, window_left): a spread of shapes."""
    cases = []
    for seed in range(6):
        for tile_rows in TILE_ROWS:
            cases.append(
                (seed, (1, 4, 7)[seed % 3], tile_rows, seed % 2 == 0, (-1, 0, 37)[seed % 3])
            )
    return cases


def _batch(seed: int):
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, 40))
    qo = rng.choice([0, 1, 5, 17, 128, 129, 300], b)
    kv = qo + rng.choice([0, 0, 3, 200], b)
    kv[rng.random(b) < 0.1] = 0  # no keys (qo_len > kv_len)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int64)
    first_page = np.concatenate([[0], np.cumsum(kv // 16 + 1)[:-1]]).astype(np.int64)
    page_ids = rng.permutation(int(first_page[-1] + kv[-1] // 16 + 1)).astype(np.int32)
    mask_byte = rng.integers(0, 1000, b)
    return qo_indptr, kv.astype(np.int64), first_page, page_ids, mask_byte


def _reference_and_table(seed, group, tile_rows, causal, window_left):
    """(pack_plan's buffer, the table's buffer with its ints, the layout) of one batch."""
    qo_indptr, kv, first_page, page_ids, mask_byte = _batch(seed)
    tiles = plan_prefill_tiles(qo_indptr, kv, group, 8, num_sms=1, ctas_per_sm=1,
                               tile_rows=tile_rows, disable_split_kv=True)  # fmt: skip
    ref_plan = plan_prefill(qo_indptr, kv, group, 8, HEAD_DIM, num_sms=1, ctas_per_sm=1,
                            causal=causal, window_left=window_left, tile_rows=tile_rows,
                            disable_split_kv=True)  # fmt: skip
    assert tiles.num_work == ref_plan.num_work
    ref = np.full(1 << 16, -7, np.int32)
    n_ref = pack_plan(ref, ref_plan, qo_indptr, first_page, page_ids, HEAD_DIM,
                      mask_byte=mask_byte)  # fmt: skip
    requests_at = n_ref + 5
    buf = np.full(1 << 16, -7, np.int32)
    n = pack_requests(buf, tiles, qo_indptr, first_page, page_ids, HEAD_DIM, requests_at,
                      mask_byte=mask_byte)  # fmt: skip
    assert n == requests_at + requests_ints(tiles.batch_size)
    layout = ItemsLayout(tiles.batch_size, tile_rows, group, 4 + HEAD_DIM, requests_at, causal,
                         window_left)  # fmt: skip
    return ref[:n_ref], buf, n, layout


@pytest.mark.parametrize("seed, group, tile_rows, causal, window_left", _batches())
def test_host_twin_writes_pack_plans_items(seed, group, tile_rows, causal, window_left):
    ref, buf, _, layout = _reference_and_table(seed, group, tile_rows, causal, window_left)
    expand_items_host(buf, layout)
    np.testing.assert_array_equal(buf[: ref.shape[0]], ref)


def test_a_split_batch_is_left_to_plan_prefill():
    qo_indptr = np.array([0, 100], np.int64)
    kv = np.array([100_000], np.int64)
    assert plan_prefill_tiles(qo_indptr, kv, 4, 8, num_sms=132, ctas_per_sm=2,
                              tile_rows=128) is None  # fmt: skip
    assert plan_prefill_tiles(qo_indptr, kv, 4, 8, num_sms=132, ctas_per_sm=2, tile_rows=128,
                              fixed_split_size=1000, disable_split_kv=False) is None  # fmt: skip
    whole = plan_prefill_tiles(qo_indptr, kv, 4, 8, num_sms=132, ctas_per_sm=2, tile_rows=128,
                               disable_split_kv=True)  # fmt: skip
    assert whole.num_work == 4 and list(whole.tile_indptr) == [0, 4]
    with pytest.raises(ValueError, match="kv_len"):
        plan_prefill_tiles(qo_indptr, np.array([-1]), 4, 8, num_sms=1, ctas_per_sm=1,
                           tile_rows=128)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("seed, group, tile_rows, causal, window_left", _batches())
def test_device_expansion_writes_pack_plans_items(seed, group, tile_rows, causal, window_left):
    import cupy

    ref, buf, n, layout = _reference_and_table(seed, group, tile_rows, causal, window_left)
    device = cupy.asarray(buf[:n])
    stream = cupy.cuda.get_current_stream()
    expand_items(int(device.data.ptr), stream.ptr, cupy.cuda.Device().id, layout)
    got = device.get()
    items = slice(layout.items_at, layout.items_at + ITEM_INTS * int(ref[0]))
    np.testing.assert_array_equal(got[items], ref[items])
    np.testing.assert_array_equal(got[: ref.shape[0]], ref)


def test_tile_plans_are_plan_prefills_unsplit_plans():
    """Over random batches, GPU sizes, fixed split sizes, graph capacities and windows: a
    TilePlan comes back only where plan_prefill's plan has one item per tile, and then its
    expanded items are pack_plan's (where plan_prefill refuses the batch, so does it)."""
    rng = np.random.default_rng(5)
    taken = 0
    for trial in range(300):
        qo_indptr, kv, first_page, page_ids, _ = _batch(trial)
        group = int(rng.choice([1, 4, 8]))
        tile_rows = int(rng.choice(TILE_ROWS))
        sms, ctas = int(rng.integers(1, 140)), int(rng.integers(1, 4))
        fixed = None if rng.random() < 0.7 else int(rng.integers(1, 64))
        disable = bool(rng.random() < 0.2)
        max_work = None if rng.random() < 0.7 else int(rng.integers(1, 400))
        causal, window = bool(rng.random() < 0.5), int(rng.choice([-1, 0, 50]))
        kw = dict(num_sms=sms, ctas_per_sm=ctas, tile_rows=tile_rows, fixed_split_size=fixed,
                  disable_split_kv=disable, max_work=max_work)  # fmt: skip
        tiles = plan_prefill_tiles(qo_indptr, kv, group, 8, **kw)
        try:
            ref_plan = plan_prefill(qo_indptr, kv, group, 8, HEAD_DIM, causal=causal,
                                    window_left=window, page_size=16, **kw)  # fmt: skip
        except ValueError:  # more tiles or items than the capacity: no TilePlan either
            assert tiles is None
            continue
        one_each = not ref_plan.split_kv and ref_plan.num_work == ref_plan.num_tiles
        if tiles is None:
            continue  # a plan that may split (the NumPy planner's, whatever it chose)
        assert one_each, trial
        taken += 1
        ref = np.full(1 << 16, -7, np.int32)
        n_ref = pack_plan(ref, ref_plan, qo_indptr, first_page, page_ids, HEAD_DIM)
        buf = np.full(1 << 16, -7, np.int32)
        n = pack_requests(buf, tiles, qo_indptr, first_page, page_ids, HEAD_DIM, n_ref + 3)
        layout = ItemsLayout(tiles.batch_size, tile_rows, group, 4 + HEAD_DIM, n_ref + 3, causal,
                             window)  # fmt: skip
        expand_items_host(buf, layout)
        np.testing.assert_array_equal(buf[:n_ref], ref[:n_ref], err_msg=f"trial {trial}")
        assert n > n_ref
    assert taken > 50
