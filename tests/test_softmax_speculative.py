"""Softmax (every path: per-row temperature, clusters, NaN rows) against the float64
reference, and chain speculative sampling against the reference algorithm (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from rtcinfer import jit
from rtcinfer.interop.dtypes import numpy_dtype
from tests import reference_sampling as sref
from tests import sampling_model as model
from tests.checks import assert_close
from tests.test_sampling import cupy, probs_rows
from tests.test_sampling_ops import SHAPES

pytestmark = pytest.mark.gpu

# --- softmax -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("temperature", [None, 0.7, "per_row"])
def test_softmax(rng, shape, dtype, temperature):
    cp = cupy()
    x = (rng.standard_normal(shape) * 5).astype(numpy_dtype(dtype))
    x[rng.random(shape) < 0.1] = -np.inf
    if shape[0] > 1:
        x[1] = -np.inf  # a row with no finite logit gives zeros
    t = (
        rng.uniform(0.3, 2.0, shape[0]).astype(np.float32)
        if temperature == "per_row"
        else temperature
    )
    arg = cp.asarray(t) if temperature == "per_row" else t
    out = rtcinfer.softmax(cp.asarray(x), arg)
    assert out.dtype == np.float32 and out.shape == shape
    assert_close(out, sref.softmax_ref(x, t), "float32", tol=3e-5)  # fp32 exponents


def test_softmax_nan_row_is_nan(rng):
    cp = cupy()
    x = rng.standard_normal((2, 1000)).astype(np.float32)
    x[0, 5] = np.nan
    out = rtcinfer.softmax(cp.asarray(x)).get()
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


@pytest.mark.parametrize("batch", [1, 20, 40, 100, 200])
@pytest.mark.parametrize("vocab,dtype", [(32000, "float32"), (4098, "float16"),
                                         (50000, "bfloat16")])  # fmt: skip
def test_softmax_on_every_path(rng, batch, vocab, dtype):
    """Clusters of 8, 4 and 2 CTAs a row (sm_90+: softmax_cluster) and one CTA a row, at
    vocabularies whose slices are uneven; a row of -inf gives zeros, a NaN makes its row NaN."""
    from rtcinfer.sampling.softmax import softmax_cluster

    cp = cupy()
    dev = cp.cuda.Device()
    cluster = softmax_cluster(batch, vocab, jit.sm_count(dev.id), int(dev.compute_capability))
    x = (rng.standard_normal((batch, vocab)) * 4).astype(numpy_dtype(dtype))
    x[rng.random(x.shape) < 0.05] = -np.inf
    rows = slice(None)
    if batch > 1:
        x[0, -1] = np.nan
        x[-1] = -np.inf
        rows = slice(1, None)
    t = rng.uniform(0.5, 1.5, batch).astype(np.float32)
    out = rtcinfer.softmax(cp.asarray(x), cp.asarray(t)).get()
    assert batch == 1 or np.isnan(out[0]).all(), f"cluster {cluster}"
    assert_close(out[rows], sref.softmax_ref(x[rows], t[rows]), "float32", tol=3e-5)


# --- chain speculative sampling -----------------------------------------------------------------


def spec_inputs(rng, batch, n, vocab, scale=1.0):
    draft = probs_rows(rng, batch * n, vocab, scale).reshape(batch, n, vocab)
    target = probs_rows(rng, batch * (n + 1), vocab, scale).reshape(batch, n + 1, vocab)
    ids = np.stack([[rng.choice(vocab, p=draft[b, i] / draft[b, i].sum()) for i in range(n)]
                    for b in range(batch)]).astype(np.int32)  # fmt: skip
    return draft, ids, target


@pytest.mark.parametrize("batch,n,vocab", [(256, 1, 111), (256, 4, 1000), (32, 7, 32000)])
def test_speculative_matches_the_reference_algorithm(rng, batch, n, vocab):
    cp = cupy()
    draft, ids, target = spec_inputs(rng, batch, n, vocab, 2.0)
    tokens, accepted, emitted = rtcinfer.chain_speculative_sampling(
        cp.asarray(draft), cp.asarray(ids), cp.asarray(target), seed=17, offset=4
    )
    u = model.uniform(17, 4, np.arange(batch)[:, None], np.arange(n + 1)[None, :])
    want, want_acc, want_emit = sref.chain_speculative_sampling_ref(draft, ids, target, u)
    tokens = tokens.get()
    np.testing.assert_array_equal(accepted.get(), want_acc)
    np.testing.assert_array_equal(emitted.get(), want_emit)
    for b in range(batch):
        j = want_emit[b]
        assert (tokens[b, :j] == ids[b, :j]).all() and (tokens[b, j + 1 :] == -1).all()
        dist = np.maximum(target[b, j] - draft[b, j], 0) if j < n else target[b, n]
        assert dist[tokens[b, j]] > 0 or not dist.any()
    assert (tokens == want).mean() > 0.99  # final draws: fp32 sums vs float64


def test_speculative_first_token_follows_the_target(rng):
    """The speculative-sampling guarantee: the first emitted token is distributed as p_0."""
    cp = cupy()
    vocab, batch, n = 50, 1 << 17, 3
    draft, ids, target = spec_inputs(rng, 1, n, vocab, 1.5)
    d = cp.asarray(np.broadcast_to(draft, (batch, n, vocab)).copy())
    t = cp.asarray(np.broadcast_to(target, (batch, n + 1, vocab)).copy())
    draft_ids = np.stack([rng.choice(vocab, batch, p=draft[0, i]) for i in range(n)], axis=1)
    tokens, _, emitted = rtcinfer.chain_speculative_sampling(
        d, cp.asarray(draft_ids.astype(np.int64)), t, seed=3
    )
    first = tokens[:, 0].get()
    freq = np.bincount(first, minlength=vocab) / batch
    cos = freq @ target[0, 0] / np.linalg.norm(freq) / np.linalg.norm(target[0, 0])
    assert cos > 0.999 and (first >= 0).all()
    assert 0 < emitted.get().mean() < n


def test_speculative_one_hot_target_and_counters(rng):
    cp = cupy()
    batch, n, vocab = 64, 5, 2000
    draft, ids, _ = spec_inputs(rng, batch, n, vocab)
    want = rng.integers(0, vocab, (batch, n + 1))
    want[:, :n] = ids
    target = np.zeros((batch, n + 1, vocab), np.float32)
    target[np.arange(batch)[:, None], np.arange(n + 1)[None, :], want] = 1.0
    acc, emit = cp.full(batch, 5, cp.int32), cp.full(batch, 7, cp.int32)
    tokens, acc_out, emit_out = rtcinfer.chain_speculative_sampling(
        cp.asarray(draft), cp.asarray(ids), cp.asarray(target), acc, emit, seed=1
    )
    assert acc_out is acc and emit_out is emit
    np.testing.assert_array_equal(tokens.get(), want)
    assert (acc.get() == 5 + n).all() and (emit.get() == 7 + n).all()
