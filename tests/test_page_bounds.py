"""append_paged_kv_cache on the GPU with bad entries in its device arrays: nothing is written
outside the cache (guard regions on both sides of it keep their values), the good rows are
written, and the bad ones are raised as BadIndexError by the next call, by check_errors(), or
under RTCINFER_CHECK=1 by the call itself."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import rtcinfer

from . import reference_attention as aref
from .checks import to_host

pytestmark = pytest.mark.gpu

PAGES, PAGE, HEADS, DIM = 8, 16, 2, 128
GUARD_PAGES = 2  # on each side: a page id in [-2, -1] or [PAGES, PAGES + 1] would land there
SENTINEL = 7.0
LENGTHS = [20, 5, 33]  # after the append of one token each: pages 2, 1, 3


NAMES = ("kv_indices", "kv_indptr", "kv_last_page_len", "batch_indices", "positions")


def _table(changes=()) -> list[np.ndarray]:
    """The arrays of NAMES: three requests on shuffled pages, one new token each at its last
    position; `changes`: (name, entry, value) to write into them."""
    table = dict(
        kv_indices=np.array([5, 0, 3, 7, 1, 6], np.int32),
        kv_indptr=np.array([0, 2, 3, 6], np.int32),
        kv_last_page_len=np.array([4, 5, 1], np.int32),
        batch_indices=np.arange(3, dtype=np.int32),
        positions=np.array(LENGTHS, np.int32) - 1,
    )
    for name, entry, value in changes:
        table[name][entry] = value
    return [table[name] for name in NAMES]


# Each case: (its changes of the table, the token whose row they make bad, the message).
CASES = {
    "page id past the cache": ([("kv_indices", 2, PAGES)], 1,
                               rf"kv_indices\[2\] = {PAGES} is not a page of the cache \(0 <= "
                               rf"page < {PAGES}\)"),
    "page id two past the cache": ([("kv_indices", 2, PAGES + 1)], 1,
                                   rf"kv_indices\[2\] = {PAGES + 1} is not a page"),
    "negative page id": ([("kv_indices", 5, -1)], 2,
                         r"kv_indices\[5\] = -1 is not a page of the cache"),
    "position past the pages": ([("positions", 1, 16)], 1,
                                r"positions\[1\] = 16 is past the end of its request, 5 tokens"),
    "position past the last page length": ([("positions", 1, 9)], 1,
                                           r"positions\[1\] = 9 is past the end of its request, "
                                           r"5 tokens by kv_indptr and kv_last_page_len"),
    "batch index past the table": ([("batch_indices", 0, 3)], 0,
                                   r"batch_indices\[0\] = 3 is not a request of the table "
                                   r"\(0 <= b < 3\)"),
    "kv_indptr past kv_indices": ([("kv_indptr", 3, 12), ("positions", 2, 100)], 2,
                                  r"kv_indptr: request 2 reads kv_indices\[9\], outside its 6 "
                                  r"entries"),
}  # fmt: skip


def _guarded_cache():
    """(the whole allocation, the [PAGES, 2, PAGE, HEADS, DIM] float16 cache in its middle):
    the cache starts at zero, the guard pages before and after it hold SENTINEL."""
    import cupy

    page = 2 * PAGE * HEADS * DIM
    whole = cupy.full((PAGES + 2 * GUARD_PAGES) * page, SENTINEL, dtype=cupy.float16)
    cache = whole[GUARD_PAGES * page : (GUARD_PAGES + PAGES) * page]
    cache[:] = 0
    return whole, cache.reshape(PAGES, 2, PAGE, HEADS, DIM)


def _rows(rng, n):
    return [rng.standard_normal((n, HEADS, DIM)).astype(np.float16) for _ in range(2)]


def _append(keys, values, table, cache):
    import cupy

    indices, indptr, last, bi, pos = (cupy.asarray(x) for x in table)
    return rtcinfer.append_paged_kv_cache(cupy.asarray(keys), cupy.asarray(values), bi, pos,
                                          cache, indices, indptr, last)  # fmt: skip


def _guards_untouched(whole):
    page = 2 * PAGE * HEADS * DIM
    host = to_host(whole)
    before, after = host[: GUARD_PAGES * page], host[(GUARD_PAGES + PAGES) * page :]
    assert (before == SENTINEL).all() and (after == SENTINEL).all(), "a guard was written"


def _expected(cache_before, keys, values, table, bad_token):
    """The reference append with the bad token's row skipped (as padding)."""
    indices, indptr, last, bi, pos = (np.array(x) for x in table)
    bi[bad_token] = -1
    return aref.append_paged_kv_cache_ref(keys, values, bi, pos, cache_before, indices, indptr,
                                         last)  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_entry_is_skipped_and_raised_by_the_next_call(case):
    import cupy

    with contextlib.suppress(rtcinfer.BadIndexError):  # nothing left from earlier tests
        rtcinfer.check_errors()
    rng = np.random.default_rng(0)
    changes, bad_token, message = CASES[case]
    whole, cache = _guarded_cache()
    table = _table(changes)
    keys, values = _rows(rng, 3)
    _append(keys, values, table, cache)
    cupy.cuda.Device().synchronize()  # the kernel has run: its report is on the host
    _guards_untouched(whole)
    expected = _expected(np.zeros(cache.shape), keys, values, table, bad_token)
    np.testing.assert_array_equal(to_host(cache), expected)

    good = _table()
    more_keys, more_values = _rows(rng, 3)
    with pytest.raises(rtcinfer.BadIndexError, match="^append_paged_kv_cache: " + message):
        _append(more_keys, more_values, good, cache)
    np.testing.assert_array_equal(to_host(cache), expected)  # the raising call wrote nothing
    _append(more_keys, more_values, good, cache)  # cleared: later calls run
    after = aref.append_paged_kv_cache_ref(more_keys, more_values, good[3], good[4], expected,
                                          *good[:3])  # fmt: skip
    np.testing.assert_array_equal(to_host(cache), after)
    assert rtcinfer.check_errors() is None
    _guards_untouched(whole)


def test_check_errors_waits_and_counts_the_bad_rows():
    """Two bad rows, one good: check_errors() raises once (the first found, and the count),
    then nothing is left to raise."""
    with contextlib.suppress(rtcinfer.BadIndexError):
        rtcinfer.check_errors()
    rng = np.random.default_rng(1)
    whole, cache = _guarded_cache()
    table = _table([("kv_indices", 2, PAGES), ("kv_indices", 5, -2)])  # requests 1 and 2
    keys, values = _rows(rng, 3)
    _append(keys, values, table, cache)
    with pytest.raises(rtcinfer.BadIndexError, match=r"is not a page of the cache .*; its row "
                       "was skipped, nothing written; 2 bad entries in all since the last "
                       "report$"):  # fmt: skip
        rtcinfer.check_errors()
    assert rtcinfer.check_errors() is None
    _guards_untouched(whole)
    expected = aref.append_paged_kv_cache_ref(keys[:1], values[:1], table[3][:1], table[4][:1],
                                             np.zeros(cache.shape), *table[:3])  # fmt: skip
    np.testing.assert_array_equal(to_host(cache), expected)


_CHECKED_CALL = """
import cupy, numpy as np, rtcinfer
cache = cupy.zeros((4, 2, 16, 2, 128), dtype=cupy.float16)
rows = cupy.ones((2, 2, 128), dtype=cupy.float16)
i32 = lambda *x: cupy.asarray(np.array(x, np.int32))
table = (i32(0, 9), i32(0, 1, 2), i32(3, 3))  # request 1's page id 9: the cache has 4 pages
try:
    rtcinfer.append_paged_kv_cache(rows, rows, i32(0, 1), i32(2, 2), cache, *table)
except rtcinfer.BadIndexError as e:
    print("raised by the call:", e)
print("written:", int((cache[0, :, 2] == 1).all()), int((cache[1:] == 0).all()))
"""


def test_rtcinfer_check_raises_at_the_call():
    env = {**os.environ, "RTCINFER_CHECK": "1"}
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", _CHECKED_CALL], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[0] == ("raised by the call: append_paged_kv_cache: kv_indices[1] = 9 is not a "
                        "page of the cache (0 <= page < 4); its row was skipped, nothing written; "
                        "1 bad entry in all since the last report")  # fmt: skip
    assert lines[1] == "written: 1 1"
