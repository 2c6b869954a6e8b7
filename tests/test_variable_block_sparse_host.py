"""VariableBlockSparseAttentionWrapper without a GPU: the paged prefill batch it plans ((kv
head, row block) requests over one-token pages), evaluated with the queries and pages run()
hands over by the paged wrapper's documented semantics in float64, and brought back to
[Hq, L, D] by run(), is the variable block-sparse attention; bad patterns are refused."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer.attention.variable_block_sparse import VariableBlockSparseAttentionWrapper

from . import reference_attention as aref
from .test_block_sparse_host import _paged_semantics


class _PagedEvaluator:
    """Stands for the paged prefill wrapper: records plan(), and run() computes what the paged
    wrapper's contract says in float64."""

    def plan(self, *args, **kwargs):
        self.planned = (args, kwargs)

    def run(self, q, pages, return_lse=False):
        o, lse = _paged_semantics(self.planned, q, *pages, self.sm_scale)
        return (o, lse) if return_lse else o


def _wrapper(sm_scale):
    w = VariableBlockSparseAttentionWrapper.__new__(VariableBlockSparseAttentionWrapper)
    w._prefill = _PagedEvaluator()
    w._prefill.sm_scale = sm_scale
    w._shape = None
    return w


def _cut(rng, total: int, blocks: int) -> np.ndarray:
    """`blocks` sizes of at least 1 adding up to `total`."""
    cuts = np.sort(rng.choice(np.arange(1, total), blocks - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]]))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_plan_and_run_compute_the_variable_block_sparse_attention(hq, hkv, causal):
    rng = np.random.default_rng(hq * 10 + hkv + causal)
    L, Lk, d = 23, 30, 8
    rows = np.stack([_cut(rng, L, 4) for _ in range(hkv)])
    cols = np.stack([_cut(rng, Lk, 5) for _ in range(hkv)])
    keep = rng.random((hkv, rows.shape[1], cols.shape[1])) < 0.5
    keep[0, 0] = False  # a block row that keeps nothing: o = 0, lse = -inf
    q = rng.standard_normal((hq, L, d))
    k, v = rng.standard_normal((hkv, Lk, d)), rng.standard_normal((hkv, Lk, d))
    w = _wrapper(0.3)
    w.plan(keep, rows, cols, hq, hkv, d, causal=causal, q_data_type="bfloat16")
    args, kw = w._prefill.planned
    assert args[4:8] == (hq // hkv, 1, d, 1) and kw["causal"] is causal
    assert kw["o_data_type"] == "bfloat16"  # FlashInfer's: q's dtype
    o, lse = w.run(q, k, v, return_lse=True)
    o_ref, lse_ref = aref.variable_block_sparse_ref(q, k, v, keep, rows, cols, sm_scale=0.3,
                                                    causal=causal)  # fmt: skip
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
    assert np.isneginf(lse[: hq // hkv, : rows[0, 0]]).all()
    np.testing.assert_allclose(w.run(q, k, v), o_ref, rtol=1e-12, atol=1e-12)


def test_bad_patterns_and_options_are_refused():
    w = _wrapper(1.0)
    keep, rows, cols = np.ones((2, 2, 2), bool), np.full((2, 2), 4), np.full((2, 2), 3)
    cases = [
        ((keep, rows, cols, 3, 2, 8), ValueError, r"num_qo_heads \(3\) must be a multiple"),
        ((keep.astype(int), rows, cols, 4, 2, 8), ValueError, "block_mask_map: expected bool"),
        ((keep, rows[:, :1], cols, 4, 2, 8), ValueError, r"block_row_sz: expected .* \(2, 2\)"),
        ((keep, np.array([[4, 4], [4, 3]]), cols, 4, 2, 8), ValueError,
         r"block_row_sz: every kv head's blocks must add up .* \[8, 7\]"),
        ((keep, rows, -cols, 4, 2, 8), ValueError, "block_col_sz: expected non-negative"),
        ((keep, rows * 1.0, cols, 4, 2, 8), TypeError, "block_row_sz: expected integer sizes"),
    ]  # fmt: skip
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            w.plan(*args)
    with pytest.raises(RuntimeError, match="plan"):
        w.run(np.zeros((4, 8, 8)), np.zeros((2, 6, 8)), np.zeros((2, 6, 8)))
    w.plan(keep, rows, cols, 4, 2, 8)
    with pytest.raises(ValueError, match=r"q: expected shape \(4, 8, 8\)"):
        w.run(np.zeros((4, 7, 8)), np.zeros((2, 6, 8)), np.zeros((2, 6, 8)))
    with pytest.raises(ValueError, match="not supported: out"):
        w.run(np.zeros((4, 8, 8)), np.zeros((2, 6, 8)), np.zeros((2, 6, 8)), out=np.zeros(1))


def test_kept_keys_is_each_requests_columns_in_order():
    """The vectorized page list against a loop over (kv head, row block, column block), with
    empty blocks and empty requests among them."""
    from rtcinfer.attention.variable_block_sparse import _kept_keys

    rng = np.random.default_rng(3)
    hkv, mb, nb = 3, 5, 7
    cols = rng.integers(0, 4, (hkv, nb))
    cols[:, -1] += 20 - cols.sum(1)  # every head's columns add up to 20
    kept = rng.random((hkv, mb, nb)) < 0.4
    lengths, pages = _kept_keys(kept, cols, 20)
    want = []
    for h in range(hkv):
        starts = np.cumsum(cols[h]) - cols[h]
        for r in range(mb):
            keys = [h * 20 + s + i for c in range(nb) if kept[h, r, c]
                    for s in [starts[c]] for i in range(cols[h, c])]  # fmt: skip
            want.append(keys)
    assert lengths.tolist() == [len(k) for k in want]
    assert pages.tolist() == [p for k in want for p in k]
    assert _kept_keys(np.zeros((2, 2, 2), bool), np.ones((2, 2), int), 2)[1].size == 0
