"""CPU tests of the split-KV decode planner (rtcinfer.plan.decode)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rtcinfer.plan.decode import (
    MIN_CHUNK_TOKENS,
    STRAGGLER_CUTS,
    STRAGGLER_SHARE,
    STRAGGLER_SKEW,
    DecodePlan,
    plan_decode,
    validate_page_table,
)
from rtcinfer.plan.page import get_batch_indices_positions, get_seq_lens

from .paged_batch import page_table_for


def header(lengths, page_size):
    """(kv_indptr, kv_last_page_len) for requests of the given token lengths."""
    indptr, _, last, _ = page_table_for(lengths, page_size, np.random.default_rng(0))
    return indptr, last


def work_items_needed(pages, chunk):
    return int(np.maximum(1, -(-np.asarray(pages) // chunk)).sum())


def check_invariants(plan: DecodePlan, lengths, page_size):
    """Structural properties every plan must have, whatever rule chose the chunk size."""
    lengths = np.asarray(lengths, dtype=np.int64)
    pages = -(-lengths // page_size)
    b, w = len(lengths), plan.num_work
    for arr, shape in [
        (plan.kv_len, (b,)),
        (plan.work_request, (w,)),
        (plan.work_chunk, (w,)),
        (plan.merge_indptr, (b + 1,)),
    ]:
        assert arr.dtype == np.int32 and arr.shape == shape and not arr.flags.writeable
    assert plan.batch_size == b and plan.page_size == page_size and plan.chunk_pages >= 1
    np.testing.assert_array_equal(plan.kv_len, lengths)
    # merge_indptr: every request owns >= 1 item, items grouped by request in order
    per_request = np.diff(plan.merge_indptr)
    assert plan.merge_indptr[0] == 0 and plan.merge_indptr[-1] == w
    assert (per_request >= 1).all()
    np.testing.assert_array_equal(plan.work_request, np.repeat(np.arange(b), per_request))
    expected_chunks = np.concatenate([np.arange(n) for n in per_request] or [[]])
    np.testing.assert_array_equal(plan.work_chunk, expected_chunks)
    np.testing.assert_array_equal(per_request, np.maximum(1, -(-pages // plan.chunk_pages)))
    assert plan.split_kv == (w > b)
    # chunks stay inside their request and cover each token exactly once
    start, end = plan.work_token_bounds()
    covered = [np.zeros(n, dtype=np.int64) for n in lengths]
    for i in range(w):
        r, c = plan.work_request[i], plan.work_chunk[i]
        first_page = c * plan.chunk_pages
        assert first_page < max(pages[r], 1)
        assert start[i] == first_page * page_size and start[i] <= end[i] <= lengths[r]
        assert end[i] > start[i] or lengths[r] == 0
        covered[r][start[i] : end[i]] += 1
    assert all((cov == 1).all() for cov in covered)


@st.composite
def planner_inputs(draw):
    page_size = draw(st.sampled_from([1, 2, 3, 4, 16]))
    lengths = draw(st.lists(st.integers(0, 300), min_size=0, max_size=24))
    kwargs = dict(
        num_kv_heads=draw(st.integers(1, 8)),
        num_sms=draw(st.integers(1, 40)),
        ctas_per_sm=draw(st.integers(1, 4)),
        min_chunk_tokens=draw(st.integers(1, 128)),
        fixed_split_size=draw(st.none() | st.integers(1, 12)),
        disable_split_kv=draw(st.booleans()),
        max_work=draw(st.none() | st.integers(1, 80)),
    )
    return lengths, page_size, kwargs


@settings(max_examples=300, deadline=None)
@given(planner_inputs())
def test_plan_properties(inputs):
    lengths, page_size, kw = inputs
    indptr, last = header(lengths, page_size)
    pages = np.diff(indptr)
    b, h, max_work = len(lengths), kw["num_kv_heads"], kw["max_work"]
    slots = kw["num_sms"] * kw["ctas_per_sm"]
    fixed = None if kw["disable_split_kv"] else kw["fixed_split_size"]
    if max_work is not None and (
        b > max_work or (fixed is not None and work_items_needed(pages, fixed) > max_work)
    ):
        with pytest.raises(ValueError, match=f"max_work \\({max_work}\\)"):
            plan_decode(indptr, last, page_size, **kw)
        return
    plan = plan_decode(indptr, last, page_size, **kw)
    check_invariants(plan, lengths, page_size)
    assert max_work is None or plan.num_work <= max_work
    if kw["disable_split_kv"]:
        assert plan.num_work == b
    elif fixed is not None:
        assert plan.chunk_pages == fixed
    else:  # the smallest chunk that fits (by a scan), or a straggler's cut
        assert plan.chunk_pages == expected_chunk(pages, page_size, h, slots, kw)


def expected_chunk(pages, page_size: int, h: int, slots: int, kw) -> int:
    """plan_decode's automatic chunk, by scanning every chunk: one item per request when the
    batch fills the GPU, else the smallest chunk of at least the floor whose items fit the
    slots; when the batch fills the GPU and its longest request is a straggler, a quarter of
    it (raised to sum(pages) / (max_work - B), which fits max_work)."""
    b, max_work = len(pages), kw["max_work"]
    most = max(int(pages.max()) if b else 0, 1)
    floor = min(-(-kw["min_chunk_tokens"] // page_size), most)
    chunk = most
    if b and b * h < slots:
        budget = min(slots // h, max_work or slots)
        chunk = next(c for c in range(floor, most + 1) if work_items_needed(pages, c) <= budget)
    total = int(pages.sum())
    if (
        b * h >= slots
        and b
        and most * b >= STRAGGLER_SKEW * total
        and most * kw["num_sms"] >= (STRAGGLER_SHARE * total * h)
    ):
        cut = max(floor, -(-most // STRAGGLER_CUTS))
        if max_work is not None:  # raised to a chunk whose items fit: sum(pages) / room
            room = max_work - b
            cut = max(cut, -(-total // room)) if room > 0 else most
        chunk = min(chunk, cut)
        assert max_work is None or work_items_needed(pages, chunk) <= max_work
    return chunk


def test_chunk_search_finds_the_smallest_fitting_chunk():
    """_search_chunk against a scan of every chunk, on small random batches (whose sums often
    equal B times one length), repeated and uniform lengths (the closed form) and long ones."""
    from rtcinfer.plan.decode import _search_chunk

    rng = np.random.default_rng(7)
    for case in range(3000):
        top = (8, 60, 600)[case % 3]
        pm1 = rng.integers(0, top + 1, int(rng.integers(1, 7)))
        if case % 5 == 0:
            pm1[:] = pm1[0]  # one length
        pm1 = np.tile(pm1, int(rng.integers(1, 4)))
        hi = int(pm1.max()) + 1
        lo = min(int(rng.integers(1, 4)), hi) if case % 2 else int(rng.integers(1, hi + 1))
        budget = pm1.shape[0] + int(rng.integers(0, 3 * top // 2 + 2))
        fits = [c for c in range(lo, hi + 1) if pm1.shape[0] + int((pm1 // c).sum()) <= budget]
        assert _search_chunk(pm1, lo, hi, budget) == fits[0], (pm1, lo, budget)


def test_chunk_search_on_lengths_whose_sum_matches_a_uniform_batch():
    from rtcinfer.plan.decode import _search_chunk

    pm1 = np.array([5, 3, 7], dtype=np.int64)  # sum 15 = 3 * pm1[0], not uniform
    fits = [c for c in range(1, 9) if 3 + int((pm1 // c).sum()) <= 4]
    assert _search_chunk(pm1, 1, 8, 4) == fits[0] == 6


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 400), min_size=1, max_size=12),
    st.lists(st.integers(0, 400), max_size=12),
    st.integers(1, 10),
    st.sampled_from([1, 4, 16]),
)
def test_fixed_split_size_is_batch_invariant(mine, others, fixed, page_size):
    """A request's chunking depends on its own length only, in pages of fixed_split_size."""
    kw = dict(num_sms=132, ctas_per_sm=2, fixed_split_size=fixed)
    alone = plan_decode(*header(mine, page_size), page_size, 8, **kw)
    mixed = plan_decode(*header(others + mine, page_size), page_size, 8, **kw)
    k = len(others)
    lo = mixed.merge_indptr[k]
    np.testing.assert_array_equal(mixed.work_request[lo:] - k, alone.work_request)
    np.testing.assert_array_equal(mixed.work_chunk[lo:], alone.work_chunk)
    assert alone.chunk_pages == fixed and alone.chunk_tokens == fixed * page_size


def test_deterministic_and_dtype_agnostic():
    lengths = [0, 1, 15, 16, 17, 513, 4000, 9]
    indptr, last = header(lengths, 16)
    kw = dict(num_sms=132, ctas_per_sm=2, min_chunk_tokens=64)
    plans = [
        plan_decode(indptr, last, 16, 2, **kw),
        plan_decode(indptr, last, 16, 2, **kw),
        plan_decode(indptr.tolist(), last.tolist(), 16, 2, **kw),
        plan_decode(indptr.astype(np.uint16), last.astype(np.int8), np.int64(16), 2, **kw),
    ]
    assert plans[0].split_kv
    for p in plans[1:]:
        for f in dataclasses.fields(DecodePlan):
            np.testing.assert_array_equal(getattr(p, f.name), getattr(plans[0], f.name))


def test_split_only_when_batch_underfills_gpu():
    long = [20000] * 8
    full = plan_decode(*header(long, 16), 16, 4, num_sms=16, ctas_per_sm=2)  # 8 * 4 == 32
    assert not full.split_kv and full.num_work == 8 and full.chunk_pages == 1250
    under = plan_decode(*header(long, 16), 16, 4, num_sms=17, ctas_per_sm=2)  # 32 < 34
    assert not under.split_kv  # one more item per request would need 64 > 34 slots
    roomy = plan_decode(*header(long, 16), 16, 4, num_sms=132, ctas_per_sm=2)
    assert roomy.split_kv and roomy.num_work * 4 <= 264
    assert roomy.num_work == 64 and roomy.chunk_pages == 157  # 8 chunks of <= 157 pages each


def test_short_requests_are_not_over_split():
    lengths = [MIN_CHUNK_TOKENS] * 3 + [5000]
    plan = plan_decode(*header(lengths, 16), 16, 1, num_sms=132, ctas_per_sm=4)
    assert plan.chunk_pages == MIN_CHUNK_TOKENS // 16
    np.testing.assert_array_equal(np.diff(plan.merge_indptr), [1, 1, 1, 20])
    tiny = plan_decode(*header([3, 7, 1], 16), 16, 1, num_sms=132, ctas_per_sm=4)
    assert not tiny.split_kv and tiny.chunk_pages == 1


def test_disable_split_kv_gives_one_item_per_request():
    lengths = [0, 100000, 3]
    kw = dict(num_sms=132, ctas_per_sm=2)
    assert plan_decode(*header(lengths, 16), 16, 1, **kw).split_kv
    for extra in [{}, {"fixed_split_size": 4}]:
        plan = plan_decode(*header(lengths, 16), 16, 1, disable_split_kv=True, **kw, **extra)
        assert plan.num_work == 3 and not plan.split_kv and plan.chunk_pages == 6250


def test_empty_requests_and_empty_batch():
    plan = plan_decode([0, 0, 0], [0, 0], 16, 8, num_sms=4, ctas_per_sm=1)
    assert plan.num_work == 2 and plan.chunk_pages == 1
    np.testing.assert_array_equal(plan.kv_len, [0, 0])
    none = plan_decode([0], [], 16, 8, num_sms=4, ctas_per_sm=1)
    assert none.batch_size == 0 and none.num_work == 0 and list(none.merge_indptr) == [0]


def test_max_work_caps_the_search_and_errors_clearly():
    indptr, last = header([30000, 100, 0], 16)
    kw = dict(num_sms=132, ctas_per_sm=2, min_chunk_tokens=16)
    free = plan_decode(indptr, last, 16, 1, **kw)
    capped = plan_decode(indptr, last, 16, 1, max_work=10, **kw)
    assert free.num_work > 10 >= capped.num_work and capped.chunk_pages > free.chunk_pages
    assert plan_decode(indptr, last, 16, 1, max_work=3, **kw).num_work == 3
    with pytest.raises(ValueError, match=r"batch_size \(3\) exceeds max_work \(2\)"):
        plan_decode(indptr, last, 16, 1, max_work=2, **kw)
    with pytest.raises(ValueError, match=r"fixed_split_size \(1 pages\) gives 1883 work items"):
        plan_decode(indptr, last, 16, 1, max_work=50, fixed_split_size=1, **kw)


def test_plan_is_frozen():
    plan = plan_decode(*header([40, 2], 4), 4, 2, num_sms=8, ctas_per_sm=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.chunk_pages = 3
    with pytest.raises(ValueError):
        plan.work_chunk[0] = 5


KW = dict(num_sms=8, ctas_per_sm=1)


@pytest.mark.parametrize(
    "indptr, last, page_size, kw, exc, message",
    [
        ([0, 3, 2], [1, 1], 4, {}, ValueError, r"kv_indptr\[1\] = 3 > kv_indptr\[2\] = 2"),
        ([1, 3], [1], 4, {}, ValueError, r"kv_indptr\[0\] must be 0, got 1"),
        ([], [], 4, {}, ValueError, r"at least one entry"),
        ([[0, 1]], [1], 4, {}, ValueError, r"kv_indptr must be 1-D, got shape \(1, 2\)"),
        ([0, 2], [5], 4, {}, ValueError, r"kv_last_page_len\[0\] \(5\) must be in \[1, page_size"),
        ([0, 2, 3], [4, 0], 4, {}, ValueError, r"kv_last_page_len\[1\] \(0\) must be in \[1"),
        ([0, 2, 2], [4, 3], 4, {}, ValueError, r"kv_last_page_len\[1\] \(3\) must be 0"),
        ([0, 2, 2], [4, -1], 4, {}, ValueError, r"kv_last_page_len\[1\] \(-1\) must be 0"),
        ([0, 2, 2], [4, 4], 4, {}, ValueError, r"kv_last_page_len\[1\] \(4\) must be 0"),
        (  # NumPy int32 arrays take the fast path of the checks
            np.array([0, 3, 2], np.int32), np.array([1, 1], np.int32), 4, {}, ValueError,
            r"kv_indptr\[1\] = 3 > kv_indptr\[2\] = 2",
        ),
        (
            np.array([0, 2, 2], np.int32), np.array([4, 2], np.int32), 4, {}, ValueError,
            r"kv_last_page_len\[1\] \(2\) must be 0",
        ),
        ([0, 2], [1, 1], 4, {}, ValueError, r"must have shape \(1,\) .* got \(2,\)"),
        ([0.0, 2.0], [1], 4, {}, TypeError, r"kv_indptr must have an integer dtype, got float64"),
        (
            [0, 2],
            [True],
            4,
            {},
            TypeError,
            r"kv_last_page_len must have an integer dtype, got bool",
        ),
        ([0, 2], [1], 0, {}, ValueError, r"page_size must be >= 1, got 0"),
        ([0, 2], [1], 4.0, {}, TypeError, r"page_size must be an integer, got 4.0"),
        ([0, 2], [1], 4, {"num_kv_heads": 0}, ValueError, r"num_kv_heads must be >= 1, got 0"),
        ([0, 2], [1], 4, {"fixed_split_size": 0}, ValueError, r"fixed_split_size .* got 0"),
        ([0, 2], [1], 4, {"num_sms": 1.5}, TypeError, r"num_sms must be an integer, got 1.5"),
        ([0, 2], [1], 4, {"max_work": 0}, ValueError, r"max_work must be >= 1, got 0"),
        ([0, 2], [1], 4, {"disable_split_kv": 1}, TypeError, r"disable_split_kv must be a bool"),
        (  # 2^31 - 1 tokens: a last tile past the end would wrap in the kernel's int32
            [0, 1, 2**24], [3, 128], 128, {}, ValueError,
            r"request 1 has 2147483520 tokens; at most 2147418111",
        ),
    ],
)  # fmt: skip
def test_validation_errors_name_the_value(indptr, last, page_size, kw, exc, message):
    args = {"num_kv_heads": 2, **KW, **kw}
    with pytest.raises(exc, match=message):
        plan_decode(indptr, last, page_size, args.pop("num_kv_heads"), **args)


def test_validate_page_table():
    indptr, indices, last, num_pages = page_table_for([5, 0, 9], 4, np.random.default_rng(1))
    validate_page_table(indptr, indices, last, 4, num_pages)
    with pytest.raises(ValueError, match=r"must have at least kv_indptr\[-1\] \(5\) entries"):
        validate_page_table(indptr, indices[:-1], last, 4, num_pages)
    # a longer (preallocated) buffer is read only indptr[-1] entries far, as in FlashInfer
    validate_page_table(indptr, np.concatenate([indices, [-7, num_pages]]), last, 4, num_pages)
    bad = indices.copy()
    bad[3] = num_pages
    with pytest.raises(ValueError, match=rf"kv_indices\[3\] \({num_pages}\) is not a valid"):
        validate_page_table(indptr, bad, last, 4, num_pages)
    bad[3], bad[1] = 0, -2
    with pytest.raises(ValueError, match=r"kv_indices\[1\] \(-2\) is not a valid page id"):
        validate_page_table(indptr, bad, last, 4, num_pages)
    with pytest.raises(TypeError, match=r"kv_indices must have an integer dtype, got float32"):
        validate_page_table(indptr, indices.astype(np.float32), last, 4, num_pages)
    with pytest.raises(ValueError, match=r"kv_last_page_len\[2\] \(5\)"):
        validate_page_table(indptr, indices, [1, 0, 5], 4, num_pages)


def test_kv_len_matches_get_seq_lens():
    indptr, last = header([0, 1, 15, 16, 17, 200], 16)
    plan = plan_decode(indptr, last, 16, 1, num_sms=1, ctas_per_sm=1)
    np.testing.assert_array_equal(plan.kv_len, get_seq_lens(indptr, last, 16))


def test_get_seq_lens_known_values():
    # the page table of FlashInfer's BatchDecodeWithPagedKVCacheWrapper example
    indptr = np.array([0, 17, 29, 44, 48, 66, 100, 128], dtype=np.int32)
    last = np.array([1, 7, 14, 4, 3, 1, 16], dtype=np.int32)
    lens = get_seq_lens(indptr, last, 16)
    assert lens.dtype == np.int32
    np.testing.assert_array_equal(lens, [257, 183, 238, 52, 275, 529, 448])
    np.testing.assert_array_equal(get_seq_lens([0, 0, 1], [0, 1], 8), [0, 1])
    with pytest.raises(ValueError, match=r"kv_indptr\[1\] = 2 > kv_indptr\[2\] = 1"):
        get_seq_lens([0, 2, 1], [1, 1], 4)


def test_get_batch_indices_positions_known_values():
    batch, pos = get_batch_indices_positions([0, 1, 3, 6, 10], [5, 5, 5, 5], 10)
    assert batch.dtype == pos.dtype == np.int32
    np.testing.assert_array_equal(batch, [0, 1, 1, 2, 2, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(pos, [4, 3, 4, 2, 3, 4, 1, 2, 3, 4])
    # appending whole prompts: positions restart at 0 for every request
    append_indptr = np.array([0, 45, 53, 78, 100])
    batch, pos = get_batch_indices_positions(append_indptr, np.diff(append_indptr), 100)
    np.testing.assert_array_equal(np.bincount(batch), [45, 8, 25, 22])
    np.testing.assert_array_equal(pos[45:53], np.arange(8))
    # a padded output: entries past append_indptr[-1] are -1
    batch, pos = get_batch_indices_positions([0, 2, 2], [7, 3], 4)
    np.testing.assert_array_equal(batch, [0, 0, -1, -1])
    np.testing.assert_array_equal(pos, [5, 6, -1, -1])
    # the caller's buffers (FlashInfer's preallocated outputs), written whole and returned
    out_b, out_p = np.full(4, 99, np.int32), np.full(4, 99, np.int32)
    batch, pos = get_batch_indices_positions([0, 2, 2], [7, 3], 4, out_b, positions=out_p)
    assert batch is out_b and pos is out_p
    np.testing.assert_array_equal(out_b, [0, 0, -1, -1])
    np.testing.assert_array_equal(out_p, [5, 6, -1, -1])
    with pytest.raises(ValueError, match=r"positions: expected an int32 NumPy array of "
                                         r"shape \(4,\) like append_indptr, got ndarray "
                                         r"int64"):  # fmt: skip
        get_batch_indices_positions([0, 2, 2], [7, 3], 4, positions=np.zeros(4, np.int64))


def test_get_batch_indices_positions_errors():
    with pytest.raises(ValueError, match=r"nnz \(2\) must be >= append_indptr\[-1\] \(3\)"):
        get_batch_indices_positions([0, 3], [5], 2)
    with pytest.raises(ValueError, match=r"seq_lens\[1\] \(1\) is smaller than the 2 tokens"):
        get_batch_indices_positions([0, 1, 3], [4, 1], 3)
    with pytest.raises(TypeError, match=r"seq_lens must have an integer dtype, got float64"):
        get_batch_indices_positions([0, 1], [4.0], 1)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] \(2147483653\) does not fit in int32"):
        get_batch_indices_positions([0, 1, 2], [2**31 + 5, 3], 2)


def test_a_straggler_is_cut_in_a_batch_that_fills_the_gpu():
    """64 requests of 256-4096 tokens fill 132 SMs x 2 CTAs with 8 kv heads, but the longest
    would stream alone after the rest: cut at a quarter of it (bench_serving's batch; 6%
    faster on an H200). Uniform batches and many short waves stay whole, and a batch that
    leaves slots free keeps the split that fills them."""
    rng = np.random.default_rng(0)
    kw = dict(num_sms=132, ctas_per_sm=2)
    mixed = header(rng.integers(256, 4097, 64), 16)
    plan = plan_decode(*mixed, 16, 8, **kw)
    assert plan.split_kv and plan.chunk_pages == 64
    capped = plan_decode(*mixed, 16, 8, max_work=128, **kw)  # a CUDA graph's capacity
    assert capped.num_work <= 128 and 64 < capped.chunk_pages < 256
    assert not plan_decode(*header([4096] * 64, 16), 16, 8, **kw).split_kv
    many_waves = header(rng.integers(128, 2049, 256), 16)
    assert not plan_decode(*many_waves, 16, 8, **kw).split_kv
    few = plan_decode(*header(rng.integers(1000, 32001, 16), 16), 16, 8, **kw)
    assert few.split_kv and few.num_work * 8 <= 264
