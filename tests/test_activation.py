"""Gated activations against the float64 references (GPU)."""

from __future__ import annotations

import pytest

import rtcinfer
from tests import reference as ref
from tests.checks import assert_close
from tests.gpu import poisoned, randn, upload

pytestmark = pytest.mark.gpu

OPS = ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(1, 2), (3, 2 * 1001), (17, 2 * 14336), (2, 5, 2 * 4096)])
@pytest.mark.parametrize("op", OPS)
def test_act_and_mul(rng, op, shape, dtype):
    x = randn(rng, shape, dtype, 3.0)
    out = poisoned((*shape[:-1], shape[-1] // 2), dtype)
    assert getattr(rtcinfer, op)(upload(x), out=out) is out
    assert_close(out, getattr(ref, f"{op}_ref")(x), dtype)


def test_large_batch_and_strided_input(rng):
    x = randn(rng, (4096, 3 * 1024), "bfloat16")
    view = upload(x)[:, 1024:]  # rows of 2 * 1024 with a row stride of 3 * 1024
    assert_close(rtcinfer.silu_and_mul(view), ref.silu_and_mul_ref(x[:, 1024:]), "bfloat16")


def test_strided_input_with_a_dense_out_and_the_reverse(rng):
    """Input and out fold their leading dims differently; the kernel's one row split must fit
    both."""
    big = randn(rng, (2, 4, 2 * 512), "float16")
    y = rtcinfer.gelu_and_mul(upload(big)[:, :3])
    assert_close(y, ref.gelu_and_mul_ref(big[:, :3]), "float16")
    out = poisoned((2, 4, 512), "float16")
    rtcinfer.silu_and_mul(upload(big[:, :3].copy()), out=out[:, 1:])
    assert_close(out[:, 1:], ref.silu_and_mul_ref(big[:, :3]), "float16")


def test_errors(rng):
    with pytest.raises(ValueError, match="must be even"):
        rtcinfer.silu_and_mul(upload(randn(rng, (4, 7), "bfloat16")))
    with pytest.raises(TypeError, match="dtype must be one of"):
        rtcinfer.silu_and_mul(upload(randn(rng, (4, 8), "float64")))
