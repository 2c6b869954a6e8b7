"""merge_state, merge_state_in_place and merge_states against the float64 references (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer

from . import reference_attention as aref
from .checks import assert_close, to_host
from .gpu_decode import random_values, to_gpu

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16", "float32"]
SHAPES = [(7, 3, 128), (1, 32, 64), (33, 2, 256), (5, 1, 80)]


def states(rng, shape, dtype, empty=0.25):
    """(v, s): v normalized outputs, s LSE in [-10, 10]; a fraction of states is empty
    (s = -inf, v = NaN: an empty state must contribute nothing, whatever its v)."""
    v = random_values(rng, shape, dtype)
    s = (rng.random(shape[:-1]) * 20 - 10).astype(np.float32)
    gone = rng.random(shape[:-1]) < empty
    s[gone] = -np.inf
    v[gone] = np.nan
    return v, s


def check(v, s, v_ref, s_ref, dtype):
    assert not np.isnan(to_host(v)).any()
    assert_close(v, v_ref, dtype, "v")
    assert_close(s, s_ref, "float32", "s", tol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_merge_state(rng, dtype, shape):
    (v_a, s_a), (v_b, s_b) = states(rng, shape, dtype), states(rng, shape, dtype)
    s_a[0, 0] = s_b[0, 0] = -np.inf  # a row of two empty states: v = 0, s = -inf
    v, s = rtcinfer.merge_state(*(to_gpu(x) for x in (v_a, s_a, v_b, s_b)))
    v_ref, s_ref = aref.merge_state_ref(v_a, s_a, v_b, s_b)
    check(v, s, v_ref, s_ref, dtype)
    assert (to_host(v)[0, 0] == 0).all() and np.isneginf(to_host(s)[0, 0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", [False, True])
def test_merge_state_in_place(rng, dtype, masked):
    shape = (9, 4, 128)
    (v, s), (v_o, s_o) = states(rng, shape, dtype, empty=0), states(rng, shape, dtype)
    mask = rng.random(shape[0]) < 0.5
    v_dev, s_dev = to_gpu(v), to_gpu(s)
    out = rtcinfer.merge_state_in_place(
        v_dev, s_dev, to_gpu(v_o), to_gpu(s_o), mask=to_gpu(mask) if masked else None
    )
    assert out[0] is v_dev and out[1] is s_dev
    v_ref, s_ref = aref.merge_state_ref(v, s, v_o, s_o)
    if masked:  # rows outside the mask are untouched
        v_ref = np.where(mask[:, None, None], v_ref, v.astype(np.float64))
        s_ref = np.where(mask[:, None], s_ref, s.astype(np.float64))
    check(v_dev, s_dev, v_ref, s_ref, dtype)


def test_merge_state_in_place_with_a_strided_mask(rng):
    """The kernel reads the mask as a dense array: a strided view (every other row) is made
    dense first, so exactly its rows are merged."""
    shape = (6, 2, 64)
    (v, s), (v_o, s_o) = states(rng, shape, "float32", empty=0), states(rng, shape, "float32")
    full = np.array([1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0], dtype=bool)
    mask = full[::2]  # rows 0, 2, 4, 5 of the six
    v_dev, s_dev = to_gpu(v), to_gpu(s)
    rtcinfer.merge_state_in_place(v_dev, s_dev, to_gpu(v_o), to_gpu(s_o), mask=to_gpu(full)[::2])
    v_ref, s_ref = aref.merge_state_ref(v, s, v_o, s_o)
    v_ref = np.where(mask[:, None, None], v_ref, v.astype(np.float64))
    s_ref = np.where(mask[:, None], s_ref, s.astype(np.float64))
    check(v_dev, s_dev, v_ref, s_ref, "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_states", [0, 1, 5, 40])
def test_merge_states(rng, dtype, num_states):
    v, s = states(rng, (6, num_states, 3, 64), dtype)
    out_v, out_s = rtcinfer.merge_states(to_gpu(v), to_gpu(s))
    check(out_v, out_s, *aref.merge_states_ref(v, s), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_or_inf_state_gives_nan(rng, dtype):
    """A state with s = NaN or s = +inf (2^(inf - inf)), or a finite s with v = NaN, makes its
    row NaN as in the reference, never the empty state (s = -inf) that a later merge would
    drop; the other rows are unaffected."""
    v, s = states(rng, (5, 4, 2, 64), dtype, empty=0)
    s[0, 1, 0] = np.nan
    s[1, 2, 1] = np.inf
    s[2, :, 0] = -np.inf
    s[2, 3, 0] = np.nan  # NaN among empty states
    v[3, 0, 1, 7] = np.nan
    out_v, out_s = (to_host(x) for x in rtcinfer.merge_states(to_gpu(v), to_gpu(s)))
    v_ref, s_ref = aref.merge_states_ref(v, s)
    nan_rows = [(0, 0), (1, 1), (2, 0)]
    for n, h in nan_rows:
        assert np.isnan(s_ref[n, h]) and np.isnan(out_s[n, h]), (n, h, out_s[n, h])
        assert np.isnan(out_v[n, h]).all(), (n, h)
    assert np.isfinite(out_s[3, 1]) and np.isnan(out_v[3, 1, 7])
    assert np.isnan(v_ref[3, 1, 7])
    keep = np.ones((5, 2), dtype=bool)
    for n, h in [*nan_rows, (3, 1)]:
        keep[n, h] = False
    assert_close(out_v[keep], v_ref[keep], dtype, "v")
    assert_close(out_s[keep], s_ref[keep], "float32", "s", tol=1e-5)


def test_strided_states(rng):
    big_v, big_s = states(rng, (8, 2, 5, 2 * 128), "bfloat16")
    v, s = big_v[::2, :, 1:4, 128:], big_s[::2, :, 1:4]  # every dimension strided
    out_v, out_s = rtcinfer.merge_states(
        to_gpu(big_v)[::2, :, 1:4, 128:], to_gpu(big_s)[::2, :, 1:4]
    )
    check(out_v, out_s, *aref.merge_states_ref(v, s), "bfloat16")


def test_torch_arrays(rng):
    torch = pytest.importorskip("torch")
    (v_a, s_a), (v_b, s_b) = states(rng, (4, 2, 64), "float16"), states(rng, (4, 2, 64), "float16")
    args = [torch.from_dlpack(to_gpu(x)) for x in (v_a, s_a, v_b, s_b)]
    v, s = rtcinfer.merge_state(*args)
    assert isinstance(v, torch.Tensor) and v.dtype == torch.float16
    check(v, s, *aref.merge_state_ref(v_a, s_a, v_b, s_b), "float16")
