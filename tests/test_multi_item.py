"""Multi-item scoring in batch prefill without a GPU: the mask built at plan() equals
FlashInfer's rule taken element by element (the float64 reference), the plans hand it to the
custom-mask path with causal off, and bad arguments are refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer.attention import prefill
from rtcinfer.attention.multi_item import multi_item_mask

from .reference_attention import multi_item_visible_ref


def _token_pos(rng, n: int) -> np.ndarray:
    """Positions in items of n tokens after a prefix: a delimiter (0), then items of random
    lengths numbered from 1, each followed by its delimiter."""
    out = []
    while len(out) < n:
        out.append(0)
        out += range(1, int(rng.integers(1, 6)) + 1)
    return np.array(out[:n], np.uint16)


@pytest.mark.parametrize("seed", range(6))
def test_the_mask_is_flashinfer_rule_element_by_element(seed):
    rng = np.random.default_rng(seed)
    batch, width = 4, 64
    kv_len = rng.integers(0, 40, batch)
    qo_len = np.minimum(kv_len, rng.integers(0, 40, batch))  # append: queries are the last keys
    prefix = np.array([int(rng.integers(0, k + 1)) for k in kv_len])
    pos = np.zeros(batch * width, np.uint16)
    for b in range(batch):
        pos[b * width : b * width + kv_len[b] - prefix[b]] = _token_pos(rng, kv_len[b] - prefix[b])
    got = multi_item_mask(qo_len, kv_len, prefix, pos.astype(np.int64), width)
    want = [multi_item_visible_ref(int(qo_len[b]), int(kv_len[b]), int(prefix[b]),
                                   pos[b * width : (b + 1) * width]).reshape(-1)
            for b in range(batch)]  # fmt: skip
    np.testing.assert_array_equal(got, np.concatenate(want))


def test_an_item_sees_the_prefix_and_itself_only():
    """FlashInfer's example: items of 3, 2 and 4 tokens after a 2-token prefix."""
    pos = np.array([0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 0], np.uint16)
    mask = multi_item_mask(np.array([15]), np.array([15]), np.array([2]), pos, 13).reshape(15, 15)
    assert mask[0].tolist() == [True] + [False] * 14  # the prefix: causal
    assert np.flatnonzero(mask[5]).tolist() == [0, 1, 3, 4, 5]  # item 1's third token
    assert np.flatnonzero(mask[8]).tolist() == [0, 1, 7, 8]  # item 2's second token
    assert np.flatnonzero(mask[6]).tolist() == [0, 1]  # a delimiter sees the prefix only


def _planned(monkeypatch, cls):
    seen = {}
    monkeypatch.setattr(cls, "_plan", lambda self, *a: seen.update(args=a))
    return object.__new__(cls), seen


def test_plans_pass_the_mask_with_causal_off(monkeypatch):
    pos = np.array([0, 1, 2, 0, 1, 0, 0, 0], np.uint16)
    ragged, seen = _planned(monkeypatch, prefill.BatchPrefillWithRaggedKVCacheWrapper)
    ragged.plan([0, 3, 5], [0, 6, 10], 4, 2, 64, causal=True, prefix_len_ptr=np.array([3, 4]),
                token_pos_in_items_ptr=pos, token_pos_in_items_len=4,
                max_item_len_ptr=np.array([2, 1]))  # fmt: skip
    qo, kv_len, _, _, args, masks = seen["args"][:6]
    assert args[4] is False and masks[1] is None  # causal off: the mask is causal itself
    want = np.concatenate([multi_item_visible_ref(3, 6, 3, pos[:4]).reshape(-1),
                           multi_item_visible_ref(2, 4, 4, pos[4:]).reshape(-1)])  # fmt: skip
    np.testing.assert_array_equal(masks[0], want)
    paged, seen = _planned(monkeypatch, prefill.BatchPrefillWithPagedKVCacheWrapper)
    paged.plan([0, 2], [0, 1], [0], [5], 4, 2, 64, 16, prefix_len_ptr=np.array([1]),
               token_pos_in_items_ptr=pos[:4], token_pos_in_items_len=4)  # fmt: skip
    masks = seen["args"][5]
    np.testing.assert_array_equal(masks[0], multi_item_visible_ref(2, 5, 1, pos[:4]).reshape(-1))


def test_bad_arguments_are_refused_by_name(monkeypatch):
    wrapper, _ = _planned(monkeypatch, prefill.BatchPrefillWithRaggedKVCacheWrapper)
    base = ([0, 3], [0, 6], 4, 2, 64)
    pos = np.zeros(8, np.uint16)
    cases = [
        (dict(token_pos_in_items_ptr=pos, token_pos_in_items_len=8), "need prefix_len_ptr"),
        (dict(prefix_len_ptr=np.array([2]), token_pos_in_items_ptr=pos,
              token_pos_in_items_len=8, custom_mask=np.ones(18, bool)), "defines the mask"),
        (dict(prefix_len_ptr=np.array([2, 2]), token_pos_in_items_ptr=pos,
              token_pos_in_items_len=8), "expected 1 non-negative lengths"),
        (dict(prefix_len_ptr=np.array([2])), "needs token_pos_in_items_ptr"),
        (dict(prefix_len_ptr=np.array([2]), token_pos_in_items_ptr=pos[:2],
              token_pos_in_items_len=2), r"token_pos_in_items_len \(2\) is shorter"),
        (dict(prefix_len_ptr=np.array([2]), token_pos_in_items_ptr=pos[:3],
              token_pos_in_items_len=4), "expected 1 rows of token_pos_in_items_len = 4"),
    ]  # fmt: skip
    for options, match in cases:
        with pytest.raises(ValueError, match=match):
            wrapper.plan(*base, **options)
