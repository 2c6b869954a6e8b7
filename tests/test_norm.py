"""Norms against the float64 references (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from tests import reference as ref
from tests.checks import assert_close, to_host
from tests.gpu import poisoned, randn, upload

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16", "float32"]
SHAPES = [(1, 8), (7, 1001), (3, 4096), (129, 8192), (2, 16384), (4096, 128), (5, 6, 2048)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", ["rmsnorm", "gemma_rmsnorm"])
def test_rmsnorm(rng, op, shape, dtype):
    x, w = randn(rng, shape, dtype, 3.0), randn(rng, shape[-1:], dtype)
    out = poisoned(shape, dtype)
    result = getattr(rtcinfer, op)(upload(x), upload(w), 1e-6, out=out)
    assert result is out
    assert_close(out, getattr(ref, f"{op}_ref")(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_fp32_weight_and_strided_rows(rng, dtype):
    big = randn(rng, (6, 3, 2 * 4096), dtype)
    w = randn(rng, (4096,), "float32")
    x = upload(big)[:, :, 4096:]  # rows strided in two levels
    y = rtcinfer.rmsnorm(x, upload(w), eps=1e-5)
    assert_close(y, ref.rmsnorm_ref(big[:, :, 4096:], w, 1e-5), dtype)


def test_strided_weights_are_read_as_their_elements(rng):
    """A weight, gemma or beta that is a strided view (every other element of a buffer) gives
    the result of its elements (copied dense before the launch), for every norm family."""
    x, r = randn(rng, (5, 1024), "bfloat16"), randn(rng, (5, 1024), "bfloat16")
    wide = randn(rng, (2, 2048), "float32")
    w, b = wide[0, ::2], wide[1, ::2]
    wd = upload(wide)
    sw, sb = wd[0, ::2], wd[1, ::2]
    assert_close(rtcinfer.rmsnorm(upload(x), sw), ref.rmsnorm_ref(x, w, 1e-6), "bfloat16")
    assert_close(rtcinfer.layernorm(upload(x), sw, sb), ref.layernorm_ref(x, w, b, 1e-6),
                 "bfloat16")  # fmt: skip
    xd, rd = upload(x), upload(r)
    rtcinfer.fused_add_rmsnorm(xd, rd, sw)
    normed, residual = ref.fused_add_rmsnorm_ref(x, r, w, 1e-6, "bfloat16")
    assert_close(xd, normed, "bfloat16")
    np.testing.assert_array_equal(to_host(rd), residual)


def test_inputs_and_outputs_that_fold_differently(rng):
    """x = big[:, :3] folds into two levels, its dense out into one; the kernel takes one row
    split for both (a dense out once got rows at the input's offsets). The fused op with a
    strided residual writes only its own rows of the buffer around it."""
    big = randn(rng, (2, 4, 1024), "bfloat16")
    w = randn(rng, (1024,), "bfloat16")
    y = rtcinfer.rmsnorm(upload(big)[:, :3], upload(w))
    assert_close(y, ref.rmsnorm_ref(big[:, :3], w, 1e-6), "bfloat16")
    out = upload(np.zeros((2, 4, 1024), np.float32).astype(big.dtype))
    rtcinfer.rmsnorm(upload(big[:, :3].copy()), upload(w), out=out[:, 1:])
    assert_close(out[:, 1:], ref.rmsnorm_ref(big[:, :3], w, 1e-6), "bfloat16")
    assert (to_host(out[:, 0]) == 0).all()
    x, r = randn(rng, (2, 3, 1024), "bfloat16"), randn(rng, (2, 4, 1024), "bfloat16")
    rd = upload(r)
    xd = upload(x)
    rtcinfer.fused_add_rmsnorm(xd, rd[:, 1:], upload(w), 1e-6)
    expect_out, expect_res = ref.fused_add_rmsnorm_ref(x, r[:, 1:], w, 1e-6, "bfloat16")
    np.testing.assert_array_equal(to_host(rd[:, 1:]), expect_res)
    np.testing.assert_array_equal(to_host(rd[:, 0]), r[:, 0].astype(np.float64))
    assert_close(xd, expect_out, "bfloat16")


def test_misaligned_rows_fall_back_to_narrow_vectors(rng):
    big = randn(rng, (9, 4097), "bfloat16")
    x = upload(big)[:, 1:]  # 2-byte aligned rows of 4096
    w = randn(rng, (4096,), "bfloat16")
    assert_close(rtcinfer.rmsnorm(x, upload(w)), ref.rmsnorm_ref(big[:, 1:], w), "bfloat16")


@pytest.mark.parametrize("row_stride", [4097, 2**31 + 3])  # 2-byte aligned; past 2^31 elements
def test_strided_rows_give_the_contiguous_bits(rng, row_stride):
    """fused_add_rmsnorm, rmsnorm and layernorm on rows laid out with any stride (narrow
    accesses) give bit for bit what the same rows made contiguous give."""
    import cupy

    rows, hidden = 3, 4096
    x, r = randn(rng, (rows, hidden), "bfloat16"), randn(rng, (rows, hidden), "bfloat16")
    w = upload(randn(rng, (hidden,), "bfloat16"))
    wf = upload(randn(rng, (hidden,), "float32"))
    flat_x = cupy.zeros((rows - 1) * row_stride + hidden, dtype=upload(x).dtype)
    flat_r = cupy.zeros_like(flat_x)

    def strided(flat, values):
        item = flat.itemsize
        v = cupy.ndarray((rows, hidden), flat.dtype, flat.data, strides=(row_stride * item, item))
        v[...] = upload(values)
        return v

    xs, rs = strided(flat_x, x), strided(flat_r, r)
    xd, rd = upload(x), upload(r)
    rtcinfer.fused_add_rmsnorm(xs, rs, w, 1e-6)
    rtcinfer.fused_add_rmsnorm(xd, rd, w, 1e-6)
    assert (xs == xd).all() and (rs == rd).all()
    assert (rtcinfer.rmsnorm(xs, wf) == rtcinfer.rmsnorm(xd, wf)).all()
    assert (rtcinfer.layernorm(xs, wf, wf) == rtcinfer.layernorm(xd, wf, wf)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 1001), (129, 8192), (3, 16384)])
@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_rmsnorm(rng, gemma, shape, dtype):
    x, r = randn(rng, shape, dtype), randn(rng, shape, dtype, 300.0)  # large residuals
    w = randn(rng, shape[-1:], dtype)
    xd, rd = upload(x), upload(r)
    fn = rtcinfer.gemma_fused_add_rmsnorm if gemma else rtcinfer.fused_add_rmsnorm
    out, res = fn(xd, rd, upload(w), 1e-6)
    assert out is xd and res is rd
    ref_fn = ref.gemma_fused_add_rmsnorm_ref if gemma else ref.fused_add_rmsnorm_ref
    expect_out, expect_res = ref_fn(x, r, w, 1e-6, dtype)
    np.testing.assert_array_equal(to_host(rd), expect_res)  # the stored sum rounds exactly
    assert_close(xd, expect_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 1001), (129, 8192), (4, 16384)])
def test_layernorm(rng, shape, dtype):
    x = randn(rng, shape, dtype, 2.0) + 5  # a mean far from zero
    gamma, beta = randn(rng, shape[-1:], "float32"), randn(rng, shape[-1:], "float32")
    y = rtcinfer.layernorm(upload(x), upload(gamma), upload(beta), 1e-5)
    assert_close(y, ref.layernorm_ref(x, gamma, beta, 1e-5), dtype)


def test_empty_batch(rng):
    w = randn(rng, (64,), "bfloat16")
    y = rtcinfer.rmsnorm(upload(randn(rng, (0, 64), "bfloat16")), upload(w))
    assert y.shape == (0, 64)


def test_errors(rng):
    x = upload(randn(rng, (4, 64), "bfloat16"))
    with pytest.raises(ValueError, match=r"weight: expected shape \(64,\), got \(32,\)"):
        rtcinfer.rmsnorm(x, upload(randn(rng, (32,), "bfloat16")))
    with pytest.raises(TypeError, match="host numpy.ndarray"):
        rtcinfer.rmsnorm(randn(rng, (4, 64), "bfloat16"), upload(randn(rng, (64,), "bfloat16")))
    with pytest.raises(TypeError, match="weight: dtype must be bfloat16 or float32"):
        rtcinfer.rmsnorm(x, upload(randn(rng, (64,), "float16")))
    with pytest.raises(ValueError, match="out: expected shape"):
        rtcinfer.rmsnorm(
            x, upload(randn(rng, (64,), "bfloat16")), out=poisoned((4, 63), "bfloat16")
        )
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        rtcinfer.rmsnorm(x.T, upload(randn(rng, (4,), "bfloat16")))
