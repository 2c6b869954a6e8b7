"""Hand-checked values for the float64 decode, merge and paged-cache references."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from rtcinfer.plan.page import get_batch_indices_positions, get_seq_lens

from .paged_batch import page_table_for, random_paged_cache
from .reference_attention import (
    LOG2E,
    alibi_slopes,
    append_paged_kv_cache_ref,
    attention_ref,
    batch_decode_paged_ref,
    merge_state_ref,
    merge_states_ref,
    rope_ref_llama,
    single_decode_ref,
)

RNG = np.random.default_rng(2024)


def one_head(q, k, v, **kw):
    """attention_ref for a single query row and head: q [D], k/v [n, D]."""
    kw.setdefault("sm_scale", 1.0)
    o, lse = attention_ref(np.reshape(q, (1, 1, -1)), np.asarray(k)[:, None], v[:, None], **kw)
    return o[0, 0], lse[0, 0]


def test_uniform_keys_average_the_values():
    v = RNG.standard_normal((6, 4))
    o, lse = one_head([1.0, 2.0], np.tile([0.5, 0.25], (6, 1)), v)  # every logit is 1.0
    np.testing.assert_allclose(o, v.mean(axis=0), rtol=1e-14)
    assert lse == pytest.approx(1.0 * LOG2E + math.log2(6), rel=1e-14)


def test_one_key_returns_its_value():
    v = np.array([[3.0, -1.0, 7.0]])
    o, lse = one_head([2.0, 1.0], [[1.5, -4.0]], v, sm_scale=0.5)  # logit (3 - 4) * 0.5
    np.testing.assert_allclose(o, v[0], rtol=1e-15)
    assert lse == pytest.approx(-0.5 * LOG2E, rel=1e-14)


def test_lse_of_two_equal_logits():
    o, lse = one_head([1.0], [[3.0], [3.0]], np.array([[1.0], [5.0]]))
    assert lse == pytest.approx(3.0 * LOG2E + 1.0, rel=1e-14)
    np.testing.assert_allclose(o, [3.0])


def test_soft_cap_applies_after_scaling():
    # raw q.k = [8, 2], sm_scale 0.5 -> [4, 1], capped at 2: 2 * tanh([2, 0.5])
    v = np.array([[1.0, 0.0], [0.0, 1.0]])
    o, lse = one_head([2.0], [[4.0], [1.0]], v, sm_scale=0.5, logits_soft_cap=2.0)
    s = 2.0 * np.tanh(np.array([2.0, 0.5]))
    p = np.exp(s) / np.exp(s).sum()
    np.testing.assert_allclose(o, p, rtol=1e-14)
    assert lse == pytest.approx(np.log2(np.exp(s).sum()), rel=1e-14)
    _, lse_nocap = one_head([2.0], [[4.0], [1.0]], v, sm_scale=0.5)
    _, lse_hugecap = one_head([2.0], [[4.0], [1.0]], v, sm_scale=0.5, logits_soft_cap=1e6)
    assert lse_hugecap == pytest.approx(lse_nocap, rel=1e-9)


def test_sliding_window_keeps_the_last_window_left_plus_one_keys():
    v = np.arange(10.0).reshape(5, 2)
    k = np.ones((5, 1))
    o, _ = one_head([1.0], k, v, window_left=1)  # q at position 4 sees keys 3 and 4
    np.testing.assert_allclose(o, v[3:].mean(axis=0))
    o, lse = one_head([1.0], k, v, window_left=0)
    np.testing.assert_allclose(o, v[4])
    assert lse == pytest.approx(LOG2E)
    o, _ = one_head([1.0], k, v, window_left=4)
    np.testing.assert_allclose(o, v.mean(axis=0))


def test_empty_and_fully_masked_rows_give_zero_and_minus_inf():
    o, lse = one_head([1.0, 2.0], np.zeros((0, 2)), np.zeros((0, 3)))
    assert (o == 0).all() and o.shape == (3,) and lse == -np.inf
    # keys at positions 0..2, query at position 10 with a window of 3: nothing visible
    k, v = RNG.standard_normal((3, 2)), RNG.standard_normal((3, 3))
    with np.errstate(all="raise"):
        o, lse = one_head([1.0, 2.0], k, v, window_left=3, q_positions=[10])
    assert (o == 0).all() and lse == -np.inf


def test_a_sink_is_one_more_key_of_value_zero():
    """With sinks, softmax over the keys and the sink (logit sinks[h], value 0): o scales by
    the keys' share of the mass, the LSE adds the sink's e^sink, rows without keys give
    o = 0, lse = sink * log2(e), and a -inf sink changes nothing."""
    q, k, v = (
        RNG.standard_normal((3, 4, 8)),
        RNG.standard_normal((5, 2, 8)),
        RNG.standard_normal((5, 2, 6)),
    )
    sinks = np.array([0.5, -2.0, 3.0, -np.inf])
    o, lse = attention_ref(q, k, v, sm_scale=0.4, causal=True)
    o_s, lse_s = attention_ref(q, k, v, sm_scale=0.4, causal=True, sinks=sinks)
    mass, sink = 2.0**lse, np.exp(sinks)[None, :]
    np.testing.assert_allclose(lse_s, np.log2(mass + sink))
    np.testing.assert_allclose(o_s, o * (mass / (mass + sink))[..., None], atol=1e-12)
    o0, lse0 = attention_ref(q, k[:0], v[:0], sm_scale=0.4, sinks=sinks)
    assert (o0 == 0).all()
    np.testing.assert_allclose(lse0, np.broadcast_to(sinks * LOG2E, (3, 4)))
    hidden, lse_h = attention_ref(q, k, v, sm_scale=0.4, window_left=0, q_positions=[9, 9, 9],
                                  sinks=sinks)  # fmt: skip
    assert (hidden == 0).all() and np.allclose(lse_h[:, :3], sinks[:3] * LOG2E)


def test_causal_hides_future_keys():
    k, v = np.ones((4, 1)), np.arange(4.0)[:, None]
    o, lse = attention_ref(np.ones((2, 1, 1)), k[:, None], v[:, None], sm_scale=1.0, causal=True)
    # bottom-right alignment: the two queries sit at positions 2 and 3
    np.testing.assert_allclose(o[:, 0, 0], [1.0, 1.5])
    np.testing.assert_allclose(lse[:, 0], [LOG2E + math.log2(3), LOG2E + 2.0])


def test_alibi_slopes_known_values():
    np.testing.assert_allclose(alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    np.testing.assert_allclose(alibi_slopes(1), [2.0**-8])
    expected_12 = np.concatenate([2.0 ** -np.arange(1, 9), 2.0 ** -np.array([0.5, 1.5, 2.5, 3.5])])
    np.testing.assert_allclose(alibi_slopes(12), expected_12)


def test_alibi_biases_by_distance_to_the_query():
    v = np.array([[1.0], [0.0], [0.0]])
    slope = 0.25
    o, lse = one_head([0.0], np.zeros((3, 1)), v, alibi_slopes=[slope])
    s = slope * np.array([-2.0, -1.0, 0.0])  # k_pos - q_pos with q at position 2
    np.testing.assert_allclose(o, [np.exp(s[0]) / np.exp(s).sum()], rtol=1e-14)
    assert lse == pytest.approx(np.log2(np.exp(s).sum()), rel=1e-14)


def test_gqa_query_heads_share_their_group_kv_head():
    q = np.ones((1, 6, 2))
    k = np.ones((1, 2, 2))
    v = np.array([[[10.0, 11.0], [20.0, 21.0]]])  # one key, two kv heads
    o, _ = attention_ref(q, k, v, sm_scale=1.0)
    np.testing.assert_allclose(o[0, :, 0], [10, 10, 10, 20, 20, 20])
    with pytest.raises(ValueError, match=r"num_qo_heads \(30\) must be a multiple of .* \(8\)"):
        attention_ref(np.ones((1, 30, 2)), np.ones((1, 8, 2)), np.ones((1, 8, 2)), sm_scale=1.0)


def test_k_scale_and_v_scale():
    q, k, v = RNG.standard_normal((1, 2, 4)), RNG.standard_normal((5, 1, 4)), RNG.random((5, 1, 3))
    o, lse = attention_ref(q, k, v, sm_scale=0.3, k_scale=2.0, v_scale=0.5)
    o2, lse2 = attention_ref(q, k, v, sm_scale=0.6)
    np.testing.assert_allclose(o, 0.5 * o2, rtol=1e-14)
    np.testing.assert_allclose(lse, lse2, rtol=1e-14)


def test_rope_llama_known_values():
    x = np.array([[[1.0, 0.0]], [[1.0, 0.0]], [[0.0, 1.0]]])
    out = rope_ref_llama(x, [0, 1, 1], rope_scale=2.0, rope_theta=1e4)  # D = 2: freq = 1 / 2
    np.testing.assert_allclose(out[0, 0], [1.0, 0.0])
    np.testing.assert_allclose(out[1, 0], [np.cos(0.5), np.sin(0.5)])
    np.testing.assert_allclose(out[2, 0], [-np.sin(0.5), np.cos(0.5)])
    # D = 4 pairs dims (0, 2) and (1, 3); the second pair turns at theta ** (-1 / 2)
    y = rope_ref_llama(np.array([[0.0, 1.0, 0.0, 0.0]]), [3], rope_theta=100.0)
    np.testing.assert_allclose(y[0], [0.0, np.cos(0.3), 0.0, np.sin(0.3)], atol=1e-15)


def test_rope_dot_products_depend_on_relative_position_only():
    q, k = RNG.standard_normal((1, 8)), RNG.standard_normal((1, 8))
    pairs = [(5, 2), (103, 100), (3, 0)]
    dots = [(rope_ref_llama(q, [m]) @ rope_ref_llama(k, [n]).T).item() for m, n in pairs]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-12)
    assert dots[0] != pytest.approx((q @ k.T).item(), rel=1e-3)  # the rotation did something


def test_merge_with_an_empty_state_is_identity():
    v, s = RNG.standard_normal((3, 2, 4)), RNG.standard_normal((3, 2))
    empty_v, empty_s = np.full_like(v, np.nan), np.full_like(s, -np.inf)
    for args in [(v, s, empty_v, empty_s), (empty_v, empty_s, v, s)]:
        mv, ms = merge_state_ref(*args)
        np.testing.assert_array_equal(mv, v)
        np.testing.assert_array_equal(ms, s)
    mv, ms = merge_state_ref(empty_v, empty_s, empty_v, empty_s)
    assert (mv == 0).all() and (ms == -np.inf).all()
    mv, ms = merge_states_ref(np.zeros((2, 0, 3, 4)), np.zeros((2, 0, 3)))
    assert mv.shape == (2, 3, 4) and (mv == 0).all() and (ms == -np.inf).all()


def test_merging_chunk_states_equals_unsplit_attention():
    q = RNG.standard_normal((1, 4, 8))
    k, v = RNG.standard_normal((50, 2, 8)), RNG.standard_normal((50, 2, 8))
    kw = dict(sm_scale=0.35, logits_soft_cap=3.0, window_left=30, alibi_slopes=alibi_slopes(4))
    o, lse = attention_ref(q, k, v, **kw)
    bounds = [0, 7, 19, 20, 50]  # chunk [0, 7) lies outside the window: an empty state
    parts = [
        attention_ref(q, k[a:b], v[a:b], q_positions=[49], k_positions=np.arange(a, b), **kw)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    assert parts[0][1].max() == -np.inf
    mv, ms = merge_states_ref(
        np.stack([p[0] for p in parts], 1), np.stack([p[1] for p in parts], 1)
    )
    np.testing.assert_allclose(mv, o, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(ms, lse, rtol=1e-12)
    fold_v, fold_s = parts[0]
    for pv, ps in parts[1:]:
        fold_v, fold_s = merge_state_ref(fold_v, fold_s, pv, ps)
    np.testing.assert_allclose(fold_v, o, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(fold_s, lse, rtol=1e-12)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_single_decode_matches_attention(kv_layout):
    q, k, v = RNG.standard_normal((8, 16)), RNG.standard_normal((9, 2, 16)), RNG.random((9, 2, 16))
    kk, vv = (k, v) if kv_layout == "NHD" else (k.transpose(1, 0, 2), v.transpose(1, 0, 2))
    o, lse = single_decode_ref(q, kk, vv, kv_layout=kv_layout, return_lse=True)
    o2, lse2 = attention_ref(q[None], k, v, sm_scale=0.25)
    np.testing.assert_allclose(o, o2[0], rtol=1e-14)
    np.testing.assert_allclose(lse, lse2[0], rtol=1e-14)
    rope = single_decode_ref(q, kk, vv, kv_layout=kv_layout, pos_encoding_mode="ROPE_LLAMA")
    kr = rope_ref_llama(k, np.arange(9))
    o3, _ = attention_ref(rope_ref_llama(q[None], [8]), kr, v, sm_scale=0.25)
    np.testing.assert_allclose(rope, o3[0], rtol=1e-12)
    with pytest.raises(ValueError, match=r"pos_encoding_mode must be one of .* got 'ROPE'"):
        single_decode_ref(q, kk, vv, kv_layout=kv_layout, pos_encoding_mode="ROPE")


@pytest.mark.parametrize(
    "dtype", [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]
)
@pytest.mark.parametrize("kv_layout, as_tuple", [("NHD", False), ("HND", True)])
def test_batch_decode_low_precision_inputs_are_upcast(dtype, kv_layout, as_tuple):
    lengths, ps = [5, 0, 12, 1], 4
    indptr, indices, last, num_pages = page_table_for(lengths, ps, RNG)
    cache = random_paged_cache(RNG, num_pages, ps, 2, 8, kv_layout, as_tuple, dtype)
    q = RNG.standard_normal((4, 4, 8)).astype(dtype)
    o, lse = batch_decode_paged_ref(
        q, cache, indptr, indices, last, kv_layout=kv_layout, k_scale=0.5, return_lse=True
    )
    cache64 = tuple(c.astype(np.float64) for c in cache) if as_tuple else cache.astype(np.float64)
    o64, lse64 = batch_decode_paged_ref(
        q.astype(np.float64),
        cache64,
        indptr,
        indices,
        last,
        kv_layout=kv_layout,
        k_scale=0.5,
        return_lse=True,
    )
    np.testing.assert_array_equal(o, o64)
    np.testing.assert_array_equal(lse, lse64)
    assert (o[1] == 0).all() and (lse[1] == -np.inf).all() and np.isfinite(o).all()


def test_append_known_slots_and_copy_semantics():
    cache = np.zeros((4, 2, 3, 1, 2))  # 4 pages of 3 tokens, NHD, one head
    indptr, indices, last = [0, 2, 3], [3, 1, 0], [2, 1]  # request 0: 5 tokens, request 1: 1
    keys = np.arange(1.0, 7.0).reshape(3, 1, 2)
    out = append_paged_kv_cache_ref(keys, -keys, [0, 0, 1], [3, 4, 0], cache, indices, indptr, last)
    assert (cache == 0).all()  # the input is left alone
    np.testing.assert_array_equal(out[1, 0, 0, 0], [1.0, 2.0])  # position 3 -> page 1, slot 0
    np.testing.assert_array_equal(out[1, 1, 1, 0], [-3.0, -4.0])  # position 4 -> slot 1
    np.testing.assert_array_equal(out[0, 0, 0, 0], [5.0, 6.0])  # request 1 -> page 0
    assert np.count_nonzero(out) == 12
    padded = append_paged_kv_cache_ref(
        keys, -keys, [0, -1, 1], [3, -1, 0], cache, indices, indptr, last
    )  # a padding row (-1, -1) writes nothing
    assert np.count_nonzero(padded) == 8 and (padded[1, :, 1] == 0).all()  # slot 1 of page 1
    with pytest.raises(ValueError, match=r"positions\[0\] \(5\) is outside request 0 \(seq_len 5"):
        append_paged_kv_cache_ref(keys[:1], keys[:1], [0], [5], cache, indices, indptr, last)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("as_tuple", [False, True])
def test_append_then_decode_sees_the_new_tokens(kv_layout, as_tuple):
    ps, old, new = 4, np.array([3, 0, 8]), np.array([2, 5, 1])
    indptr, indices, last, num_pages = page_table_for(old + new, ps, RNG)
    cache = random_paged_cache(RNG, num_pages, ps, 2, 8, kv_layout, as_tuple, np.float16)
    append_indptr = np.concatenate([[0], np.cumsum(new)])
    seq_lens = get_seq_lens(indptr, last, ps)
    batch, pos = get_batch_indices_positions(append_indptr, seq_lens, int(new.sum()))
    keys, values = RNG.standard_normal((2, new.sum(), 2, 8)).astype(np.float16)
    out = append_paged_kv_cache_ref(
        keys, values, batch, pos, cache, indices, indptr, last, kv_layout
    )
    assert isinstance(out, tuple) == as_tuple and (out[0] if as_tuple else out).dtype == np.float16
    q = RNG.standard_normal((3, 4, 8))
    o = batch_decode_paged_ref(q, out, indptr, indices, last, kv_layout=kv_layout)
    # the last new token is the only one visible with window_left = 0
    o_win = batch_decode_paged_ref(
        q, out, indptr, indices, last, kv_layout=kv_layout, window_left=0
    )
    last_new = append_indptr[1:] - 1
    np.testing.assert_allclose(o_win, np.repeat(values[last_new].astype(np.float64), 2, axis=1))
    assert np.isfinite(o).all()
