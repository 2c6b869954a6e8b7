"""BlockSparseAttentionWrapper without a GPU: the paged prefill batch it plans (block rows as
requests, kept column blocks as full pages), evaluated by the paged wrapper's documented
semantics in float64, equals attention over the dense matrix of kept entries; k and v reach
the paged wrapper as page views; bad patterns are refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer.attention.block_sparse import BlockSparseAttentionWrapper

from . import reference_attention as aref


class _PagedRecorder:
    """Stands for the paged prefill wrapper: records what plan() and run() are given."""

    def plan(self, *args, **kwargs):
        self.planned = (args, kwargs)

    def run(self, q, pages, **kwargs):
        self.ran = (q, pages, kwargs)
        return "o"


def _wrapper() -> BlockSparseAttentionWrapper:
    w = BlockSparseAttentionWrapper.__new__(BlockSparseAttentionWrapper)
    w._prefill = _PagedRecorder()
    w.M = w.N = w.R = w.C = None
    return w


def _paged_semantics(planned, q, k_pages, v_pages, sm_scale):
    """What the paged wrapper computes for this plan (its docstring's contract, FlashInfer's):
    request b's queries over the first kv_len_b tokens of its pages, the custom mask's block
    of each request read back to back."""
    (qo, indptr, indices, last, *_), kw = planned
    o = np.zeros((q.shape[0], q.shape[1], v_pages.shape[-1]))
    lse = np.full(q.shape[:2], -np.inf)
    bits = 0
    for b in range(len(qo) - 1):
        rows = np.arange(qo[b], qo[b + 1])
        pages = indices[indptr[b] : indptr[b + 1]]
        page_size = k_pages.shape[1]
        kv_len = (len(pages) - 1) * page_size + last[b] if len(pages) else 0
        keys = aref.gather_pages_ref(k_pages, pages, "NHD", kv_len)
        values = aref.gather_pages_ref(v_pages, pages, "NHD", kv_len)
        seen = None
        if kw.get("custom_mask") is not None:
            seen = kw["custom_mask"][bits : bits + rows.size * kv_len].reshape(rows.size, kv_len)
            bits += rows.size * kv_len
        o[rows], lse[rows] = aref.attention_ref(q[rows], keys, values, sm_scale=sm_scale,
                                                causal=kw["causal"], mask=seen)  # fmt: skip
    return o, lse


@pytest.mark.parametrize("R,C,M,N", [(3, 4, 10, 20), (1, 1, 7, 5), (16, 8, 40, 64)])
@pytest.mark.parametrize("masked", [False, True])
def test_the_planned_paged_batch_is_the_dense_block_sparse_attention(R, C, M, N, masked):
    rng = np.random.default_rng(R * 100 + C)
    MB, NB = -(-M // R), N // C
    keep = rng.random((MB, NB)) < 0.5
    keep[1] = False  # a block row that keeps nothing: its queries get o = 0, lse = -inf
    indptr = np.concatenate([[0], np.cumsum(keep.sum(1))]).astype(np.int32)
    indices = np.concatenate([rng.permutation(np.flatnonzero(r)) for r in keep]).astype(np.int32)
    mask = rng.random((indices.size, R, C)) < 0.7 if masked else None
    q = rng.standard_normal((M, 4, 16))
    k, v = rng.standard_normal((N, 2, 16)), rng.standard_normal((N, 2, 16))
    w = _wrapper()
    w.plan(indptr, indices, M, N, R, C, 4, 2, 16, mask=mask, q_data_type="bfloat16")
    args, kw = w._prefill.planned
    assert args[4:8] == (4, 2, 16, C) and kw["o_data_type"] == "float16"  # FlashInfer's default
    assert (w.M, w.N, w.R, w.C) == (M, N, R, C)
    got = _paged_semantics(w._prefill.planned, q, k.reshape(NB, C, 2, 16),
                           v.reshape(NB, C, 2, 16), 0.25)  # fmt: skip
    dense = aref.block_sparse_dense_mask(M, N, indptr, indices, R, C, mask)
    want = aref.attention_ref(q, k, v, sm_scale=0.25, mask=dense)
    by_rows = aref.block_sparse_ref(q, k, v, indptr, indices, R, C, sm_scale=0.25, mask=mask)
    for a, b, c in zip(got, want, by_rows, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(c, b, rtol=1e-12, atol=1e-12)
    assert np.isneginf(got[1][R : 2 * R]).all() and (got[0][R : 2 * R] == 0).all()


def test_run_hands_k_and_v_over_as_page_views():
    w = _wrapper()
    w.plan(np.array([0, 1]), np.array([1]), 4, 8, 4, 4, 2, 1, 8)
    k, v = np.zeros((8, 1, 8)), np.ones((8, 1, 8))
    assert w.run("q", k, v, return_lse=True) == "o"
    q, (kp, vp), options = w._prefill.ran
    assert kp.shape == vp.shape == (2, 4, 1, 8) and np.shares_memory(kp, k)
    assert options == {"out": None, "lse": None, "return_lse": True}
    with pytest.raises(ValueError, match=r"k: expected shape \(8, num_kv_heads, head_dim\)"):
        w.run("q", k[:4], v)
    with pytest.raises(ValueError, match="not supported: scale_q"):
        w.run("q", k, v, scale_q=np.ones(2))


def test_bad_patterns_are_refused_by_name():
    w = _wrapper()
    ok = dict(indptr=np.array([0, 1, 2]), indices=np.array([0, 1]), M=8, N=8, R=4, C=4,
              num_qo_heads=2, num_kv_heads=1, head_dim=8)  # fmt: skip
    w.plan(**ok)
    cases = [
        (dict(N=10), ValueError, r"N \(10\) must be a multiple of the block columns C \(4\)"),
        (dict(M=12), ValueError, r"indptr: expected ceil\(M / R\) \+ 1 = 4 entries"),
        (dict(indices=np.array([0, 2])), ValueError, "column block 2 is outside 0..1"),
        (dict(indices=np.array([0, -1])), ValueError, r"indices\[1\] \(-1\) is not a valid"),
        (dict(indices=np.array([0])), ValueError, r"indices must have at least indptr\[-1\] \(2\)"),
        (dict(R=0), ValueError, "R must be >= 1, got 0"),
        (dict(M=8.0), TypeError, "M must be an integer, got 8.0"),
        (dict(mask=np.ones((2, 4, 3), bool)), ValueError, r"mask: expected bool \[2, 4, 4\]"),
    ]
    for change, error, match in cases:
        with pytest.raises(error, match=match):
            w.plan(**{**ok, **change})
    with pytest.raises(RuntimeError, match="plan"):
        _wrapper().run("q", np.zeros((8, 1, 8)), np.zeros((8, 1, 8)))


@pytest.mark.parametrize("seed", range(30))
def test_random_patterns_and_options(seed):
    """Random block sizes (1 x 1 up to ones larger than the matrix's rows), sparse and dense
    patterns, masks, causal: the planned batch, by the paged wrapper's contract, is the block-
    sparse attention by block rows (and, without causal, the dense matrix of kept entries)."""
    rng = np.random.default_rng(1000 + seed)
    R, C = int(rng.integers(1, 9)), int(rng.integers(1, 9))
    M, N = int(rng.integers(0, 40)), C * int(rng.integers(1, 7))
    MB, NB = -(-M // R), N // C
    keep = rng.random((MB, NB)) < rng.choice([0.0, 0.3, 1.0])
    indptr = np.concatenate([[0], np.cumsum(keep.sum(1))]).astype(np.int64)
    indices = np.concatenate([rng.permutation(np.flatnonzero(r)) for r in keep] +
                             [np.zeros(0, np.int64)]).astype(np.int32)  # fmt: skip
    mask = rng.random((indices.size, R, C)) < 0.6 if rng.random() < 0.5 else None
    causal = bool(rng.random() < 0.5) and mask is None  # a custom mask replaces causal
    q = rng.standard_normal((M, 2, 8))
    k, v = rng.standard_normal((N, 1, 8)), rng.standard_normal((N, 1, 8))
    w = _wrapper()
    w.plan(indptr, indices, M, N, R, C, 2, 1, 8, mask=mask, causal=causal)
    got = _paged_semantics(w._prefill.planned, q, k.reshape(NB, C, 1, 8), v.reshape(NB, C, 1, 8),
                           0.5)  # fmt: skip
    want = aref.block_sparse_ref(q, k, v, indptr, indices, R, C, sm_scale=0.5, mask=mask,
                                 causal=causal)  # fmt: skip
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    if not causal:
        dense = aref.block_sparse_dense_mask(M, N, indptr, indices, R, C, mask)
        o_dense, _ = aref.attention_ref(q, k, v, sm_scale=0.5, mask=dense)
        np.testing.assert_allclose(got[0], o_dense, atol=1e-12)
