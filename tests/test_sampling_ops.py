"""Threshold ops (renorm, mask) against the float64 reference and the NumPy model, and the
samplers with PyTorch / JAX / CuPy inputs (softmax and speculative sampling:
test_softmax_speculative.py)."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from rtcinfer import jit
from rtcinfer.interop.dtypes import numpy_dtype
from tests import reference_sampling as sref
from tests import sampling_model as model
from tests.checks import assert_close, to_host
from tests.test_sampling import cupy, probs_rows

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1), (3, 111), (7, 32000), (4, 128256), (2, 151936)]


def top_p_margin(p, top_p):
    """Per row: the distance, relative to the row's mass, from top_p * mass to the nearest mass
    above a value (where the top-p cut would move); rows near 0 are decided by rounding."""
    margins = []
    for row, tp in zip(p, np.broadcast_to(top_p, (len(p),)), strict=True):
        if not 0 < tp < 1:  # keeps only the maximum, or everything
            margins.append(np.inf)
            continue
        vals, counts = np.unique(row, return_counts=True)
        above = np.cumsum((vals * counts)[::-1]) - (vals * counts)[::-1]  # descending values
        margins.append(np.min(np.abs(above - tp * row.sum())) / row.sum())
    return np.array(margins)


def check_threshold_op(out, expect, dtype, floor, loose_rows=()):
    """Kept sets and values (within the dtype's tolerance) equal, except rows whose cut lies
    within rounding of a boundary (loose_rows), which are only checked for sanity."""
    got = to_host(out)
    tight = np.setdiff1d(np.arange(expect.shape[0]), loose_rows)
    np.testing.assert_array_equal(got[tight] > floor, expect[tight] > floor)
    finite = np.isfinite(expect[tight]) & np.isfinite(got[tight])
    assert_close(got[tight][finite], expect[tight][finite], dtype, "values")
    assert np.isfinite(got[np.asarray(loose_rows, int)]).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("per_row", [False, True])
def test_top_k_renorm_probs(rng, shape, dtype, per_row):
    cp = cupy()
    rows, vocab = shape
    host = probs_rows(rng, rows, vocab, 2.0, zeros=0.1).astype(numpy_dtype(dtype))
    k = rng.integers(1, 300, rows) if per_row else 50
    if vocab > 100:
        host[0, :3] = host[0].max()  # a tie at the top
    out = rtcinfer.top_k_renorm_probs(cp.asarray(host), cp.asarray(k) if per_row else k)
    assert out.dtype == host.dtype and out.shape == shape
    check_threshold_op(out, sref.top_k_renorm_probs_ref(host, k), dtype, 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("top_p", [0.0, 0.3, 0.9, 0.99, 1.0, "per_row"])
def test_top_p_renorm_probs(rng, shape, dtype, top_p):
    cp = cupy()
    rows, vocab = shape
    host = probs_rows(rng, rows, vocab, 3.0, zeros=0.1).astype(numpy_dtype(dtype))
    p = rng.uniform(0, 1, rows).astype(np.float32) if top_p == "per_row" else top_p
    out = rtcinfer.top_p_renorm_probs(cp.asarray(host), cp.asarray(p) if top_p == "per_row" else p)
    loose = np.flatnonzero(top_p_margin(host.astype(np.float64), p) < 1e-5)
    check_threshold_op(out, sref.top_p_renorm_probs_ref(host, p), dtype, 0, loose)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_top_k_mask_logits(rng, shape, dtype):
    cp = cupy()
    rows, vocab = shape
    x = (rng.standard_normal(shape) * 4).astype(numpy_dtype(dtype))
    x[rng.random(shape) < 0.05] = -np.inf
    x[rng.random(shape) < 0.01] = np.nan
    for k in (1, 10, 100, vocab, rng.integers(1, 400, rows)):
        arg = cp.asarray(k) if isinstance(k, np.ndarray) else int(k)
        out = rtcinfer.top_k_mask_logits(cp.asarray(x), arg)
        assert out.dtype == x.dtype
        expect = sref.top_k_mask_logits_ref(x, k)
        np.testing.assert_array_equal(np.isfinite(to_host(out)), np.isfinite(expect))
        finite = np.isfinite(expect)
        np.testing.assert_array_equal(to_host(out)[finite], expect[finite])


@pytest.mark.parametrize("vocab,rows", [(4000, 16), (60000, 16), (4000, 272)])
def test_threshold_ops_match_the_model_bit_for_bit(rng, vocab, rows):
    """272 rows: over 2 x 132 SMs (the H200), where top-k's cuts run 256-thread blocks."""
    cp = cupy()
    host = probs_rows(rng, rows, vocab, 3.0, zeros=0.1)
    block = model.block_for(vocab, rows, jit.sm_count(cp.cuda.Device().id), op="top_k_renorm")
    out = rtcinfer.top_k_renorm_probs(cp.asarray(host), 37).get()
    want = np.stack([model.renorm_row(host[r], "top_k_renorm", 37, block) for r in range(rows)])
    np.testing.assert_array_equal(out, want)
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    out = rtcinfer.top_k_mask_logits(cp.asarray(logits), 500).get()
    want = np.stack([model.renorm_row(logits[r], "top_k_mask", 500, block) for r in range(rows)])
    np.testing.assert_array_equal(out, want)


def test_threshold_op_errors(rng):
    cp = cupy()
    probs = cp.asarray(probs_rows(rng, 4, 100))
    with pytest.raises(ValueError, match=r"top_k: expected a scalar or a int32/int64 array"):
        rtcinfer.top_k_renorm_probs(probs, cp.zeros(3, cp.int32))
    with pytest.raises(TypeError, match="probs: dtype must be one of"):
        rtcinfer.top_p_renorm_probs(probs.astype(cp.int32), 0.5)
    with pytest.raises(ValueError, match="logits: the last dimension must be contiguous"):
        rtcinfer.top_k_mask_logits(cp.asfortranarray(probs), 3)


# --- frameworks ---------------------------------------------------------------------------------


def test_torch_tensors_and_generator(rng):
    torch = pytest.importorskip("torch")
    host = probs_rows(rng, 32, 32000, 2.0)
    probs = torch.from_numpy(host).cuda()
    g = torch.Generator(device="cuda").manual_seed(5)
    tokens = rtcinfer.top_k_top_p_sampling_from_probs(probs, 20, 0.9, generator=g)
    assert isinstance(tokens, torch.Tensor) and tokens.dtype == torch.int32
    assert tokens.device == probs.device
    keep = sref.sampling_keep_ref(host, "top_k_first", top_k=20, top_p=0.9)
    assert keep[np.arange(32), tokens.cpu().numpy()].all()
    again = rtcinfer.top_k_top_p_sampling_from_probs(probs, 20, 0.9, generator=g)
    assert not torch.equal(tokens, again)  # the generator advanced
    k = torch.full((32,), 5, dtype=torch.int64, device="cuda")
    renorm = rtcinfer.top_k_renorm_probs(probs, k)
    assert isinstance(renorm, torch.Tensor) and renorm.dtype == torch.float32
    assert_close(renorm, sref.top_k_renorm_probs_ref(host, 5), "float32")
    s = rtcinfer.softmax(torch.from_numpy(host).cuda().log(), temperature=1.0)
    assert_close(s, sref.softmax_ref(np.log(host.astype(np.float64))), "float32")


def test_jax_arrays_and_jit(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    host = probs_rows(rng, 16, 4000, 2.0)
    probs = jnp.asarray(host)
    tokens = rtcinfer.top_p_sampling_from_probs(probs, 0.8, seed=3, offset=1)
    assert isinstance(tokens, jax.Array) and tokens.dtype == jnp.int32
    keep = sref.sampling_keep_ref(host, "top_p", top_p=0.8)
    assert keep[np.arange(16), np.asarray(tokens)].all()

    @jax.jit
    def step(p, offset):
        return rtcinfer.top_k_sampling_from_probs(p, 10, seed=jnp.array([[3, 0]], jnp.uint32),
                                                  offset=offset)  # fmt: skip

    a = step(probs, jnp.array([[1, 0]], jnp.uint32))
    b = step(probs, jnp.array([[1, 0]], jnp.uint32))
    assert (np.asarray(a) == np.asarray(b)).all()
    keep = sref.sampling_keep_ref(host, "top_k", top_k=10)
    assert keep[np.arange(16), np.asarray(a)].all()
    eager = rtcinfer.top_k_sampling_from_probs(probs, 10, seed=3, offset=1)
    assert (np.asarray(eager) == np.asarray(a)).all()  # (lo, hi) words are the same 64 bits
    out = rtcinfer.top_k_mask_logits(jnp.asarray(np.log(host)), 7)
    assert isinstance(out, jax.Array)


def test_a_strided_out_is_refused(rng):
    cp = cupy()
    probs = cp.asarray(probs_rows(rng, 4, 100))
    out = cp.empty((4, 2), np.int32)[:, 0]
    with pytest.raises(ValueError, match="out: must be contiguous"):
        rtcinfer.sampling_from_probs(probs, seed=1, out=out)


def test_host_arrays_are_refused(rng):
    with pytest.raises(TypeError, match="host numpy.ndarray"):
        rtcinfer.sampling_from_probs(probs_rows(rng, 2, 10))
