"""The sampling references and the NumPy model of the sampling kernels, on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer.philox import Generator, resolve
from tests import reference as ref
from tests import sampling_model as model

# Random123's known-answer vectors for Philox4x32-10.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]  # fmt: skip


def probs_row(rng, vocab, scale=1.0, zeros=0.0):
    """softmax(scale * N(0, 1)) in fp32, a fraction `zeros` of the tokens set to 0."""
    logits = rng.standard_normal(vocab) * scale
    logits[rng.random(vocab) < zeros] = -np.inf
    return ref.softmax_ref(logits[None])[0].astype(np.float32)


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    out = model.philox4x32_10(np.array(counter, np.uint32), np.array(key, np.uint32))
    assert tuple(int(v) for v in out) == expected


def test_uniforms_are_uniform_and_keyed_by_every_counter_word():
    u = model.uniform(7, 3, np.arange(1000)[:, None], np.arange(100)[None, :])
    assert u.dtype == np.float32 and u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    base = model.uniform(7, 3, 5, 9)
    big = 1 << 32
    for seed, offset, row, draw in [(8, 3, 5, 9), (7, 4, 5, 9), (7, 3, 6, 9), (7, 3, 5, 10),
                                    (7, 3 + big, 5, 9), (7 + big, 3, 5, 9)]:  # fmt: skip
        assert model.uniform(seed, offset, row, draw) != base


def test_generator_advances_and_resolve_rules():
    g = Generator(seed=11, offset=5)
    assert g.next() == (11, 5) and g.next() == (11, 6) and g.offset == 7
    assert resolve(g, None, None) == (11, 7)
    assert resolve(None, 3, None) == (3, 0) and resolve(g, 3, 9) == (3, 9)
    with pytest.raises(ValueError, match="offset= needs seed="):
        resolve(None, None, 4)
    with pytest.raises(TypeError, match="generator"):
        resolve(object(), None, None)


# --- references --------------------------------------------------------------------------------


def test_reference_kept_sets_on_hand_examples():
    p = np.array([0.3, 0.2, 0.2, 0.2, 0.1])
    assert ref.top_k_keep_ref(p, 2)[0].tolist() == [True, True, True, True, False]  # ties stay
    assert ref.top_k_keep_ref(p, 1)[0].tolist() == [True, False, False, False, False]
    assert ref.top_k_keep_ref(p, 0)[0].all() and ref.top_k_keep_ref(p, 5)[0].all()
    q = np.array([0.5, 0.3, 0.2])
    assert ref.top_p_keep_ref(q, 0.5)[0].tolist() == [True, False, False]
    assert ref.top_p_keep_ref(q, 0.6)[0].tolist() == [True, True, False]
    assert ref.top_p_keep_ref(q, 1e-9)[0].tolist() == [True, False, False]  # the max stays
    assert ref.top_p_keep_ref(q, 1.0)[0].all()
    assert ref.min_p_keep_ref(q, 0.5)[0].tolist() == [True, True, False]
    assert ref.min_p_keep_ref(q, 0.0)[0].all()
    # top_k_first renormalizes over the top k first: above 0.3 lies 0.5 / 0.8 = 0.625 >= 0.6
    first = ref.sampling_keep_ref(q, "top_k_first", top_k=2, top_p=0.6)[0]
    joint = ref.sampling_keep_ref(q, "top_k_top_p", top_k=2, top_p=0.6)[0]
    assert first.tolist() == [True, False, False] and joint.tolist() == [True, True, False]
    assert not ref.sampling_keep_ref(np.array([0.0, 1.0]), "plain")[0, 0]


def test_reference_renorm_and_mask():
    p = np.array([[0.1, 0.4, 0.2, 0.3]])
    np.testing.assert_allclose(ref.top_k_renorm_probs_ref(p, 2), [[0, 4 / 7, 0, 3 / 7]])
    np.testing.assert_allclose(ref.top_p_renorm_probs_ref(p, 0.5), [[0, 4 / 7, 0, 3 / 7]])
    x = np.array([[1.0, np.nan, 3.0, -np.inf, 2.0]])
    assert ref.top_k_mask_logits_ref(x, 2).tolist() == [[-np.inf, -np.inf, 3.0, -np.inf, 2.0]]
    np.testing.assert_allclose(ref.softmax_ref(np.array([[0.0, np.log(3.0)]]), 1.0), [[0.25, 0.75]])
    assert ref.softmax_ref(np.full((1, 3), -np.inf)).tolist() == [[0.0, 0.0, 0.0]]


def test_reference_inverse_transform_and_speculative():
    assert ref.inverse_transform_ref(np.array([0.0, 0.5, 0.5]), 0.0).tolist() == [1]
    assert ref.inverse_transform_ref(np.array([0.2, 0.3, 0.5]), 0.5).tolist() == [2]
    rng = np.random.default_rng(0)
    q = rng.random((3, 2, 5))
    q /= q.sum(-1, keepdims=True)
    ids = np.array([[1, 2], [3, 4], [0, 0]])
    target = np.zeros((3, 3, 5))
    target[np.arange(3)[:, None], np.arange(2)[None], ids] = 1.0
    target[:, 2, 4] = 1.0
    tokens, acc, emitted = ref.chain_speculative_sampling_ref(q, ids, target, rng.random((3, 3)))
    assert tokens.tolist() == [[1, 2, 4], [3, 4, 4], [0, 0, 4]]
    assert acc.tolist() == [2, 2, 2] and emitted.tolist() == [2, 2, 2]
    target[0, 0] = 0.0
    target[0, 0, 3] = 1.0  # the first draft token can never pass
    tokens, acc, emitted = ref.chain_speculative_sampling_ref(q, ids, target, rng.random((3, 3)))
    assert tokens[0].tolist() == [3, -1, -1] and emitted[0] == 0 and acc[0] == 1


# --- pass 0 and the radix select ---------------------------------------------------------------


@pytest.mark.parametrize("vocab,threads", [(111, 32), (4096, 256), (32000, 1024), (32000, 256),
                                           (60000, 256)])  # fmt: skip
@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
def test_pass0_list_holds_exactly_the_values_above_its_floor(rng, vocab, threads, scale):
    row = probs_row(rng, vocab, scale, zeros=0.2)
    block = model.Block(threads, model.block_for(vocab).vec)
    p0 = model.pass0(row, block)
    np.testing.assert_array_equal(p0.list_ids, np.flatnonzero(row > p0.low0))
    assert p0.M == row.max() and np.isclose(p0.S, row.astype(np.float64).sum())
    if vocab <= 16 * threads:
        assert p0.low0 == 0 and p0.evictions == 0  # the whole row fits
    else:
        assert p0.evictions > 0 and len(p0.list_ids) <= 16 * threads


def test_pass0_with_logits_and_flat_rows(rng):
    x = (rng.standard_normal(40000) * 4).astype(np.float32)
    x[rng.random(40000) < 0.1] = -np.inf
    p0 = model.pass0(x, model.Block(256, 4), model.Logits)
    np.testing.assert_array_equal(p0.list_ids, np.flatnonzero(x > p0.low0))
    flat = np.full(50000, 1 / 50000, np.float32)
    p0 = model.pass0(flat, model.Block(256, 4))
    assert p0.low0 == flat[0] and len(p0.list_ids) == 0  # nothing above the floor


@pytest.mark.parametrize("k", [1, 2, 7, 50, 999, 1000])
def test_radix_select_by_count_is_the_kth_largest(rng, k):
    vals = np.round(rng.random(1000), 3).astype(np.float32) + np.float32(1e-3)  # many ties
    v, kept = model.radix_select(vals, model.Probs, k=k, M=vals.max())
    assert v == np.sort(vals)[::-1][k - 1]
    assert kept == model.fixed_mass(vals[vals >= v], vals.max()).sum()
    assert model.radix_select(vals, model.Probs, k=1001, M=vals.max()) is None
    logits = np.concatenate([rng.standard_normal(600), -rng.random(400) * 1e-30, [0.0, -0.0]])
    logits = logits.astype(np.float32)  # signed values, tiny negatives, both zeros
    v, _ = model.radix_select(logits, model.Logits, k=k)
    assert v == np.sort(logits)[::-1][k - 1]


@pytest.mark.parametrize("top_p", [0.0, 1e-6, 0.1, 0.5, 0.9, 0.999])
def test_radix_select_by_mass_is_the_top_p_cut(rng, top_p):
    vals = probs_row(rng, 3000, 2.0)
    vals[:40] = vals[40]  # a tie block
    fixed = model.fixed_mass(vals, vals.max())
    p_fixed = np.uint64(np.rint(top_p * float(fixed.sum())))
    v, kept = model.radix_select(vals, model.Probs, p_fixed=p_fixed, M=vals.max())
    order = np.argsort(-vals, kind="stable")
    above = np.cumsum(fixed[order]) - fixed[order]  # mass before each in descending order
    firsts = np.unique(vals[order], return_index=True)[1]  # first of each tie run
    mass_greater = dict(zip(vals[order][firsts], above[firsts], strict=True))
    keep = [x for x, m in mass_greater.items() if m < p_fixed or m == 0]
    assert v == min(keep)
    assert kept == fixed[vals >= v].sum()


# --- the sampler model against the references --------------------------------------------------

CASES = [
    ("plain", {}),
    ("top_k", {"top_k": 5}),
    ("top_k", {"top_k": 1}),
    ("top_p", {"top_p": 0.6}),
    ("top_p", {"top_p": 1e-7}),
    ("min_p", {"min_p": 0.2}),
    ("top_k_top_p", {"top_k": 10, "top_p": 0.7}),
    ("top_k_first", {"top_k": 10, "top_p": 0.7}),
]


@pytest.mark.parametrize("vocab,scale,threads", [(7, 1.0, 32), (111, 2.0, 32), (3000, 3.0, 64)])
@pytest.mark.parametrize("op,params", CASES)
def test_model_sampler_distribution(rng, op, params, vocab, scale, threads):
    row = probs_row(rng, vocab, scale, zeros=0.2)
    row[3] = row[2]  # a tie
    block = model.Block(threads, 1)
    p0 = model.pass0(row, block)
    draws = 6000
    tokens = np.array([model.sample_row(row, op, seed=5, offset=i, block=block, p0=p0, **params)
                       .token for i in range(draws)])  # fmt: skip
    expected = ref.sampling_dist_ref(row, op, **params)[0]
    assert expected[tokens].min() > 0, "drew a token outside the kept set"
    freq = np.bincount(tokens, minlength=vocab) / draws
    cos = freq @ expected / np.linalg.norm(freq) / np.linalg.norm(expected)
    assert cos > 0.99, cos
    assert np.abs(freq - expected).sum() / 2 < 4 * np.sqrt(np.count_nonzero(expected) / draws)


@pytest.mark.parametrize("op,params", CASES)
def test_model_sampler_with_an_evicting_candidate_list(rng, op, params):
    row = probs_row(rng, 20000, 4.0, zeros=0.1)
    block = model.Block(128, 4)  # 2 KB of list for a 20000-token row: the bars rise
    p0 = model.pass0(row, block)
    assert p0.evictions > 0
    keep = ref.sampling_keep_ref(row, op, **params)[0]
    draws = [model.sample_row(row, op, seed=1, offset=i, block=block, p0=p0, **params)
             for i in range(300)]  # fmt: skip
    assert all(keep[d.token] for d in draws)
    if op in ("top_k", "top_k_top_p", "top_k_first", "min_p"):
        assert all(d.on_list for d in draws)
    assert max(d.rounds for d in draws) <= 20


def test_model_sampler_edge_rows():
    zero = np.zeros(50, np.float32)
    assert model.sample_row(zero, "top_p", top_p=0.5).token == 0
    one_hot = np.zeros(300, np.float32)
    one_hot[123] = 1.0
    for op, params in CASES:
        assert model.sample_row(one_hot, op, seed=3, **params).token == 123
    assert model.sample_row(np.ones(1, np.float32), "top_k", top_k=1).token == 0


@pytest.mark.parametrize("op,param", [("top_k_renorm", 1), ("top_k_renorm", 37),
                                      ("top_k_renorm", 0), ("top_p_renorm", 0.3),
                                      ("top_p_renorm", 0.95), ("top_p_renorm", 0.0),
                                      ("top_k_mask", 5), ("top_k_mask", 4000)])  # fmt: skip
@pytest.mark.parametrize("threads", [64, 1024])
def test_model_threshold_ops_match_the_reference(rng, op, param, threads):
    vocab = 20000
    if op == "top_k_mask":
        row = (rng.standard_normal(vocab) * 3).astype(np.float32)
        row[rng.random(vocab) < 0.05] = -np.inf
        expect = ref.top_k_mask_logits_ref(row, param)[0]
    else:
        row = probs_row(rng, vocab, 3.0, zeros=0.1)
        fn = ref.top_k_renorm_probs_ref if op == "top_k_renorm" else ref.top_p_renorm_probs_ref
        expect = fn(row, param)[0]
    out = model.renorm_row(row, op, param, model.Block(threads, 4))
    floor = -np.inf if op == "top_k_mask" else 0
    np.testing.assert_array_equal(out > floor, expect > floor)
    finite = np.isfinite(expect)
    np.testing.assert_allclose(out[finite], expect[finite], rtol=2e-6, atol=0)
