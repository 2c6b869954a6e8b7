"""top_k against the float64 reference (GPU): values and indices exactly, ties taken at the
smallest indices, NaN as -inf; sorted in each framework; strided rows."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from rtcinfer.interop.dtypes import numpy_dtype
from tests import reference_sampling as sref
from tests.checks import to_host
from tests.test_sampling import cupy

pytestmark = pytest.mark.gpu


def _logits(rng, shape, dtype):
    """Random logits with ties (a coarse grid), -inf and NaN entries."""
    x = np.round(rng.standard_normal(shape) * 8) / 4  # many equal values
    x[rng.random(shape) < 0.05] = -np.inf
    x[rng.random(shape) < 0.01] = np.nan
    return x.astype(numpy_dtype(dtype))


def _same(got, want):
    np.testing.assert_array_equal(np.isnan(to_host(got)), np.isnan(want.astype(np.float64)))
    np.testing.assert_array_equal(np.nan_to_num(to_host(got), nan=0.0),
                                  np.nan_to_num(want.astype(np.float64), nan=0.0))  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 111), (7, 32000), (2, 128256)], ids=str)
def test_top_k_against_the_reference(rng, shape, dtype):
    cp = cupy()
    rows, d = shape
    x = _logits(rng, shape, dtype)
    for k in sorted({1, min(10, d), min(256, d), d}):
        for tie_break in (0, 2):
            values, indices = rtcinfer.top_k(cp.asarray(x), k, tie_break=tie_break)
            want_v, want_i = sref.top_k_ref(x, k, ties_last=tie_break == 2)
            np.testing.assert_array_equal(to_host(indices), want_i, err_msg=f"k={k}")
            _same(values, want_v)


def test_sorted_in_each_framework(rng):
    x = _logits(rng, (4, 5000), "float32")
    want_v, want_i = sref.top_k_ref(x, 64)
    keys = np.where(np.isnan(want_v), -np.inf, want_v)
    order = np.argsort(-keys, axis=1, kind="stable")
    want_v, want_i = np.take_along_axis(want_v, order, 1), np.take_along_axis(want_i, order, 1)
    cp = cupy()
    v, i = rtcinfer.top_k(cp.asarray(x), 64, sorted=True)
    _same(v, want_v)
    np.testing.assert_array_equal(to_host(i), want_i)
    torch = pytest.importorskip("torch")
    v, i = rtcinfer.top_k(torch.from_numpy(x).cuda(), 64, sorted=True)
    assert i.dtype == torch.int64
    _same(v, want_v)
    np.testing.assert_array_equal(to_host(i), want_i)


def test_strided_rows_and_bfloat16_sorted(rng):
    x = _logits(rng, (3, 2 * 4096), "bfloat16")
    cp = cupy()
    view = cp.asarray(x)[:, 4096:]
    values, indices = rtcinfer.top_k(view, 100)
    want_v, want_i = sref.top_k_ref(x[:, 4096:], 100)
    np.testing.assert_array_equal(to_host(indices), want_i)
    _same(values, want_v)
    v, i = rtcinfer.top_k(view, 100, sorted=True)
    assert (np.diff(np.nan_to_num(to_host(v), nan=-np.inf), axis=1) <= 0).all()
    np.testing.assert_array_equal(np.sort(to_host(i), axis=1), np.sort(want_i, axis=1))


def test_jax_eager_and_inside_jit(jax_gpu, rng):
    """On JAX arrays, eager and inside jax.jit (k static), sorted or not."""
    jax = jax_gpu
    x = _logits(rng, (5, 3000), "float32")
    want_v, want_i = sref.top_k_ref(x, 40)
    xj = jax.numpy.asarray(x)
    for fn in (rtcinfer.top_k, jax.jit(rtcinfer.top_k, static_argnums=(1,))):
        values, indices = fn(xj, 40)
        _same(np.asarray(values), want_v)
        np.testing.assert_array_equal(np.asarray(indices), want_i)
    values, indices = jax.jit(lambda a: rtcinfer.top_k(a, 40, sorted=True))(xj)
    assert (np.diff(np.nan_to_num(np.asarray(values), nan=-np.inf), axis=1) <= 0).all()
    np.testing.assert_array_equal(np.sort(np.asarray(indices), 1), np.sort(want_i, 1))
