"""append_paged_kv_cache without a GPU: the argument checks that run before any device work,
and the launch step on fake arrays."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer

from .fakes import FakeArray


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


def _append_with_fakes(monkeypatch, cache_strides=None):
    """The append launch step on fake arrays (6 tokens of 3 requests, bf16, 2 heads, d 128,
    pages of 16); returns the recorded kernel arguments."""
    nnz, batch = 6, 3
    from rtcinfer import jit, page

    calls = []
    monkeypatch.setattr(jit, "get_function", lambda spec, name: lambda *a, **k: calls.append(a))
    key, value = FakeArray((nnz, 2, 128), 2), FakeArray((nnz, 2, 128), 2)
    index = [FakeArray((nnz,), 4), FakeArray((nnz,), 4)]
    cache = FakeArray((10, 2, 16, 2, 128), 2, cache_strides)
    table = [FakeArray((10,), 4), FakeArray((batch + 1,), 4)]
    page._append_launch(None, [key, value, *index, cache, *table], [cache], kv_layout="NHD",
                        row_bytes=256)  # fmt: skip
    return calls[0][2]


def test_append_launch_refuses_a_cache_with_a_strided_head_dim(monkeypatch):
    strides = (2 * 16 * 2 * 256 * 2, 16 * 2 * 256 * 2, 2 * 256 * 2, 256 * 2, 4)
    with pytest.raises(ValueError, match="paged_kv_cache: head_dim must be contiguous"):
        _append_with_fakes(monkeypatch, cache_strides=strides)


def test_nnz_is_any_integral_value():
    from rtcinfer.plan._checks import as_int

    def count(value):
        return as_int("nnz", value, minimum=0)

    assert count(7) == 7 and count(np.int64(3)) == 3
    assert count(np.array(5)) == 5  # a 0-d integer array, as a tensor's [-1] gives
    with pytest.raises(TypeError, match="nnz must be an integer, got 5.7"):
        count(5.7)
    with pytest.raises(ValueError, match="nnz must be >= 0, got -1"):
        count(-1)
