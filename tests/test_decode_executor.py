"""The NumPy executor of split-KV plans against the unsplit batch-decode reference."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rtcinfer.plan.decode import plan_decode

from .decode_executor import execute_decode_plan
from .paged_batch import page_table_for, random_paged_cache
from .reference_attention import batch_decode_paged_ref

PAGE_SIZE = 16
LENGTHS = [1, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1, 513, 0]
NUM_KV_HEADS, HEAD_DIM = 2, 16

FEATURES = {
    "plain": {},
    "soft_cap": {"logits_soft_cap": 7.0},
    "window": {"window_left": 40},
    "alibi": {"pos_encoding_mode": "ALIBI"},
    "rope": {"pos_encoding_mode": "ROPE_LLAMA", "rope_scale": 2.0, "rope_theta": 500.0},
    "all": {
        "pos_encoding_mode": "ROPE_LLAMA",
        "logits_soft_cap": 3.0,
        "window_left": 100,
        "sm_scale": 0.2,
        "q_scale": 1.5,
        "k_scale": 0.7,
        "v_scale": 2.0,
    },
}

PLANS = {  # planner keyword arguments, and whether the plan must split
    "auto_split": (dict(num_sms=132, ctas_per_sm=2, min_chunk_tokens=16), True),
    "fixed_split": (dict(num_sms=1, ctas_per_sm=1, fixed_split_size=3), True),
    "fills_gpu": (dict(num_sms=2, ctas_per_sm=2, min_chunk_tokens=4096), False),
    "straggler": (dict(num_sms=2, ctas_per_sm=2), True),  # fills the GPU, its longest cut
    "disabled": (dict(num_sms=132, ctas_per_sm=2, disable_split_kv=True), False),
}


def assert_same_attention(o, lse, o_ref, lse_ref):
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[finite], lse_ref[finite], rtol=1e-12, atol=1e-12)
    assert not np.isnan(o).any() and not np.isnan(lse).any()


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("group_size", [1, 4, 5])
@pytest.mark.parametrize("kv_layout, as_tuple", [("NHD", False), ("HND", True)])
def test_executor_matches_reference(kv_layout, as_tuple, group_size, feature, plan_name):
    rng = np.random.default_rng(zlib.crc32(f"{kv_layout}{group_size}{feature}{plan_name}".encode()))
    indptr, indices, last, num_pages = page_table_for(LENGTHS, PAGE_SIZE, rng)
    cache = random_paged_cache(
        rng, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, kv_layout, as_tuple
    )
    q = rng.standard_normal((len(LENGTHS), NUM_KV_HEADS * group_size, HEAD_DIM))
    plan_kw, must_split = PLANS[plan_name]
    plan = plan_decode(indptr, last, PAGE_SIZE, NUM_KV_HEADS, **plan_kw)
    assert plan.split_kv == must_split
    kw = dict(kv_layout=kv_layout, **FEATURES[feature])
    o_ref, lse_ref = batch_decode_paged_ref(q, cache, indptr, indices, last, return_lse=True, **kw)
    o, lse = execute_decode_plan(plan, q, cache, indptr, indices, last, **kw)
    assert_same_attention(o, lse, o_ref, lse_ref)
    assert (o_ref[-1] == 0).all() and (lse_ref[-1] == -np.inf).all()  # the empty request


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 90), min_size=1, max_size=6),
    page_size=st.sampled_from([1, 3, 8]),
    num_kv_heads=st.sampled_from([1, 2]),
    group_size=st.sampled_from([1, 3]),
    min_chunk_tokens=st.integers(1, 40),
    window_left=st.sampled_from([-1, 0, 5, 33]),
    mode=st.sampled_from(["NONE", "ALIBI", "ROPE_LLAMA"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_executor_matches_reference_random(
    lengths, page_size, num_kv_heads, group_size, min_chunk_tokens, window_left, mode, seed
):
    rng = np.random.default_rng(seed)
    indptr, indices, last, num_pages = page_table_for(lengths, page_size, rng)
    cache = random_paged_cache(rng, num_pages, page_size, num_kv_heads, 8)
    q = rng.standard_normal((len(lengths), num_kv_heads * group_size, 8))
    plan = plan_decode(
        indptr,
        last,
        page_size,
        num_kv_heads,
        num_sms=64,
        ctas_per_sm=1,
        min_chunk_tokens=min_chunk_tokens,
    )
    kw = dict(window_left=window_left, pos_encoding_mode=mode)
    o_ref, lse_ref = batch_decode_paged_ref(q, cache, indptr, indices, last, return_lse=True, **kw)
    o, lse = execute_decode_plan(plan, q, cache, indptr, indices, last, **kw)
    assert_same_attention(o, lse, o_ref, lse_ref)


def test_executor_rejects_a_plan_for_another_batch():
    rng = np.random.default_rng(0)
    indptr, indices, last, num_pages = page_table_for([5, 9], 4, rng)
    cache = random_paged_cache(rng, num_pages, 4, 1, 8)
    q = rng.standard_normal((2, 1, 8))
    longer_indptr, _, longer_last, _ = page_table_for([5, 10], 4, rng)
    other = plan_decode(longer_indptr, longer_last, 4, 1, num_sms=8, ctas_per_sm=1)
    with pytest.raises(ValueError, match="plan.kv_len does not match"):
        execute_decode_plan(other, q, cache, indptr, indices, last)
    wrong_page = plan_decode(indptr, last, 8, 1, num_sms=8, ctas_per_sm=1)
    with pytest.raises(ValueError, match=r"plan.page_size \(8\) != cache page_size \(4\)"):
        execute_decode_plan(wrong_page, q, cache, indptr, indices, last)
