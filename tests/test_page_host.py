"""append_paged_kv_cache argument checks that run before any device work (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer


def _table():
    indices = np.arange(3, dtype=np.int32)
    indptr = np.array([0, 2, 3], dtype=np.int32)
    last = np.array([5, 1], dtype=np.int32)
    return indices, indptr, last


@pytest.mark.parametrize(
    "v_cache",
    [
        np.zeros((3, 16, 2, 64), np.float16),  # another head_dim
        np.zeros((1, 16, 2, 128), np.float16),  # fewer pages
        np.zeros((3, 16, 2, 128), np.float32),  # another dtype
        np.zeros((3, 2, 16, 2, 128), np.float16),  # a 5-D cache in a pair
    ],
)  # fmt: skip
def test_a_kv_pair_must_match(v_cache):
    keys = np.zeros((2, 2, 128), np.float16)
    idx = np.zeros(2, np.int32)
    k_cache = np.zeros((3, 16, 2, 128), np.float16)
    with pytest.raises(ValueError, match="pair must be two .* of one shape and dtype"):
        rtcinfer.append_paged_kv_cache(keys, keys, idx, idx, (k_cache, v_cache), *_table())


def test_the_table_shapes_must_match():
    keys = np.zeros((2, 2, 128), np.float16)
    idx = np.zeros(2, np.int32)
    cache = np.zeros((3, 2, 16, 2, 128), np.float16)
    indices, indptr, last = _table()
    with pytest.raises(ValueError, match=r"kv_indptr must have shape \(2,\), got \(3,\)"):
        rtcinfer.append_paged_kv_cache(keys, keys, idx, idx, cache, indices, indptr, last[:1])
