"""The cluster sampler (small batches on sm_90+) on the GPU: token for token against its NumPy
model (bit-exact), distributions with 2^20 draws, per-row parameters and dtypes."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from rtcinfer import jit
from rtcinfer.layout import widest_vec
from rtcinfer.sampling.cluster import cluster_size
from tests import reference_sampling as sref
from tests import sampling_cluster_model as model
from tests.test_sampling import DRAWS, OPS, check_frequencies, cupy, probs_rows, sample

pytestmark = pytest.mark.gpu


def cluster_for(batch: int, vocab: int, itemsize: int = 4) -> tuple[int, int]:
    """(CTAs per row, vector width) the launch picks on this GPU; skips a pre-sm_90 device."""
    dev = cupy().cuda.Device()
    if int(dev.compute_capability) < 90:
        pytest.skip("thread-block clusters need sm_90")
    vec = widest_vec(vocab, itemsize)
    cluster = cluster_size(batch, vocab, vec, jit.sm_count(dev.id), int(dev.compute_capability))
    assert cluster, f"batch {batch} x vocab {vocab} does not take the cluster path"
    return cluster, vec


@pytest.mark.parametrize("op,params", OPS)
@pytest.mark.parametrize("batch,vocab,scale", [(1, 151936, 1.0), (3, 111, 2.0),
                                               (16, 32000, 3.0), (12, 128256, 2.0)])  # fmt: skip
def test_tokens_equal_the_model(rng, op, params, batch, vocab, scale):
    cp = cupy()
    host = probs_rows(rng, batch, vocab, scale, zeros=0.1)
    cluster, vec = cluster_for(batch, vocab)
    probs = cp.asarray(host)
    for offset in range(3):
        tokens = sample(op, probs, None, params, seed=77, offset=offset).get()
        want = [model.sample_row(host[b], op, seed=77, offset=offset, b=b, cluster=cluster,
                                 vec=vec, **params) for b in range(batch)]  # fmt: skip
        assert tokens.tolist() == want, (op, params, offset)


def test_per_row_parameters_indices_and_half_precision(rng):
    cp = cupy()
    batch, vocab = 12, 50000
    host = probs_rows(rng, 4, vocab, 2.0, zeros=0.1).astype(np.float32)
    half = host.astype(np.float16)
    idx = rng.integers(0, 4, batch)
    top_k = rng.integers(1, 200, batch).astype(np.int64)
    top_p = rng.uniform(0.05, 1.0, batch).astype(np.float32)
    cluster, vec = cluster_for(batch, vocab, 2)
    tokens = rtcinfer.top_k_top_p_sampling_from_probs(
        cp.asarray(half), cp.asarray(top_k), cp.asarray(top_p), cp.asarray(idx),
        filter_apply_order="joint", seed=3, offset=4,
    ).get()  # fmt: skip
    assert tokens.dtype == np.int64
    rows = half.astype(np.float32)
    want = [model.sample_row(rows[idx[b]], "top_k_top_p", top_k=int(top_k[b]),
                             top_p=float(top_p[b]), seed=3, offset=4, b=b, cluster=cluster,
                             vec=vec) for b in range(batch)]  # fmt: skip
    assert tokens.tolist() == want


@pytest.mark.parametrize("op,params,vocab,batch", [
    ("top_k_first", {"top_k": 50, "top_p": 0.9}, 151936, 16),
    ("top_p", {"top_p": 0.9}, 32000, 33),
    ("min_p", {"min_p": 0.05}, 128256, 8),
])  # fmt: skip
def test_distribution_of_small_batches(rng, op, params, vocab, batch):
    cp = cupy()
    host = probs_rows(rng, 1, vocab, 3.0, zeros=0.1)
    cluster_for(batch, vocab)
    probs = cp.asarray(host)
    idx = cp.zeros(batch, cp.int32)
    calls = DRAWS // batch + 1
    tokens = cp.empty((calls, batch), cp.int32)
    for i in range(calls):
        sample(op, probs, idx, params, seed=5, offset=i, out=tokens[i])
    tokens = tokens.reshape(-1)
    assert bool(((tokens >= 0) & (tokens < vocab)).all())
    counts = cp.bincount(tokens, minlength=vocab).get()[None]
    check_frequencies(counts, sref.sampling_dist_ref(host, op, **params), f"{op} batch {batch}")


def test_edge_rows_through_clusters(rng):
    cp = cupy()
    vocab = 70000
    host = np.zeros((4, vocab), np.float32)
    host[0, 12345] = 1.0  # all mass on one token
    host[1, [7, 69999]] = 0.5  # a tie at both ends of the row
    host[2] = probs_rows(rng, 1, vocab)[0]
    cluster_for(4, vocab)
    probs = cp.asarray(host)
    for op, params in OPS:
        tokens = sample(op, probs, None, params, seed=2).get()
        assert tokens[0] == 12345 and tokens[1] in (7, 69999) and tokens[3] == 0, (op, tokens)
        assert sref.sampling_keep_ref(host[2:3], op, **params)[0, tokens[2]]
    ones = cp.ones((2, 1), cp.float32)
    assert sample("top_k", ones, None, {"top_k": 1}).get().tolist() == [0, 0]
    host[2, 99] = np.nan
    with pytest.raises(ValueError, match="NaN, negative or infinite"):
        sample("top_p", cp.asarray(host), None, {"top_p": 0.5}, check_nan=True)


@pytest.mark.parametrize("op,params", [
    ("top_k", {"top_k": 300}),  # more than the cluster's warps: radix select over the row
    ("top_k_first", {"top_k": 50, "top_p": 0.5}),
    ("top_k_top_p", {"top_k": 50, "top_p": 0.5}),
])  # fmt: skip
def test_tokens_equal_the_model_beyond_the_candidate_list(rng, op, params):
    cp = cupy()
    batch, vocab = 4, 40000
    host = probs_rows(rng, batch, vocab, 2.0, zeros=0.1)
    host[1] = np.float32(1 / vocab)  # a flat row: every value reaches the floor
    host[2, : vocab // 2] = host[2].max()  # half the row tied at the maximum
    cluster, vec = cluster_for(batch, vocab)
    listed = [model.on_list(model.Probs.clean(r), params["top_k"], cluster, vec) for r in host]
    assert listed[1:3] == [False, False]
    probs = cp.asarray(host)
    for offset in range(3):
        tokens = sample(op, probs, None, params, seed=8, offset=offset).get()
        want = [model.sample_row(host[b], op, seed=8, offset=offset, b=b, cluster=cluster,
                                 vec=vec, **params) for b in range(batch)]  # fmt: skip
        assert tokens.tolist() == want, (op, offset)
