"""The sampling references and the NumPy model of the sampling kernels, on the CPU."""

from __future__ import annotations

import os

import numpy as np
import pytest

from rtcinfer.sampling.philox import Generator, resolve
from tests import reference_sampling as sref
from tests import sampling_cluster_model as cluster_model
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
    return sref.softmax_ref(logits[None])[0].astype(np.float32)


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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_calls_without_a_seed_draw_fresh_ones_also_in_forked_children():
    """Without seed= or generator=, each call draws a new 64-bit seed (offset 0); a forked
    child (a serving engine's worker) draws its own, not the parent's next ones."""
    seeds = [resolve(None, None, None) for _ in range(64)]
    assert all(offset == 0 and 0 <= seed < 2**64 for seed, offset in seeds)
    assert len({seed for seed, _ in seeds}) == 64
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next seed, to the parent
        os.write(write, resolve(None, None, None)[0].to_bytes(8, "little"))
        os._exit(0)
    os.waitpid(pid, 0)
    child = int.from_bytes(os.read(read, 8), "little")
    os.close(read)
    os.close(write)
    assert child != resolve(None, None, None)[0]


# --- references --------------------------------------------------------------------------------


def test_reference_kept_sets_on_hand_examples():
    p = np.array([0.3, 0.2, 0.2, 0.2, 0.1])
    assert sref.top_k_keep_ref(p, 2)[0].tolist() == [True, True, True, True, False]  # ties stay
    assert sref.top_k_keep_ref(p, 1)[0].tolist() == [True, False, False, False, False]
    assert sref.top_k_keep_ref(p, 0)[0].all() and sref.top_k_keep_ref(p, 5)[0].all()
    q = np.array([0.5, 0.3, 0.2])
    assert sref.top_p_keep_ref(q, 0.5)[0].tolist() == [True, False, False]
    assert sref.top_p_keep_ref(q, 0.6)[0].tolist() == [True, True, False]
    assert sref.top_p_keep_ref(q, 1e-9)[0].tolist() == [True, False, False]  # the max stays
    assert sref.top_p_keep_ref(q, 1.0)[0].all()
    assert sref.min_p_keep_ref(q, 0.5)[0].tolist() == [True, True, False]
    assert sref.min_p_keep_ref(q, 0.0)[0].all()
    # top_k_first renormalizes over the top k first: above 0.3 lies 0.5 / 0.8 = 0.625 >= 0.6
    first = sref.sampling_keep_ref(q, "top_k_first", top_k=2, top_p=0.6)[0]
    joint = sref.sampling_keep_ref(q, "top_k_top_p", top_k=2, top_p=0.6)[0]
    assert first.tolist() == [True, False, False] and joint.tolist() == [True, True, False]
    assert not sref.sampling_keep_ref(np.array([0.0, 1.0]), "plain")[0, 0]


def test_reference_renorm_and_mask():
    p = np.array([[0.1, 0.4, 0.2, 0.3]])
    np.testing.assert_allclose(sref.top_k_renorm_probs_ref(p, 2), [[0, 4 / 7, 0, 3 / 7]])
    np.testing.assert_allclose(sref.top_p_renorm_probs_ref(p, 0.5), [[0, 4 / 7, 0, 3 / 7]])
    x = np.array([[1.0, np.nan, 3.0, -np.inf, 2.0]])
    assert sref.top_k_mask_logits_ref(x, 2).tolist() == [[-np.inf, -np.inf, 3.0, -np.inf, 2.0]]
    np.testing.assert_allclose(
        sref.softmax_ref(np.array([[0.0, np.log(3.0)]]), 1.0), [[0.25, 0.75]]
    )
    assert sref.softmax_ref(np.full((1, 3), -np.inf)).tolist() == [[0.0, 0.0, 0.0]]


def test_reference_inverse_transform_and_speculative():
    assert sref.inverse_transform_ref(np.array([0.0, 0.5, 0.5]), 0.0).tolist() == [1]
    assert sref.inverse_transform_ref(np.array([0.2, 0.3, 0.5]), 0.5).tolist() == [2]
    rng = np.random.default_rng(0)
    q = rng.random((3, 2, 5))
    q /= q.sum(-1, keepdims=True)
    ids = np.array([[1, 2], [3, 4], [0, 0]])
    target = np.zeros((3, 3, 5))
    target[np.arange(3)[:, None], np.arange(2)[None], ids] = 1.0
    target[:, 2, 4] = 1.0
    tokens, acc, emitted = sref.chain_speculative_sampling_ref(q, ids, target, rng.random((3, 3)))
    assert tokens.tolist() == [[1, 2, 4], [3, 4, 4], [0, 0, 4]]
    assert acc.tolist() == [2, 2, 2] and emitted.tolist() == [2, 2, 2]
    target[0, 0] = 0.0
    target[0, 0, 3] = 1.0  # the first draft token can never pass
    tokens, acc, emitted = sref.chain_speculative_sampling_ref(q, ids, target, rng.random((3, 3)))
    assert tokens[0].tolist() == [3, -1, -1] and emitted[0] == 0 and acc[0] == 1


# --- pass 0, the floor, the candidate list and the radix select --------------------------------


GEOMETRIES = [(111, 32, 1), (4096, 512, 4), (32000, 1024, 4), (32000, 256, 4), (151936, 256, 4),
              (60002, 32, 2)]  # fmt: skip


@pytest.mark.parametrize("vocab,threads,vec", GEOMETRIES)
def test_block_maxima_and_gather(rng, vocab, threads, vec):
    row = probs_row(rng, vocab, 3.0, zeros=0.2)
    block = model.Block(threads, vec)
    scan = model.scan_row(row, block)
    steps, group, blocks = block.steps(vocab)
    assert blocks <= model.BLOCKS_W and scan.bmax.shape == (block.warps, blocks)
    seg, width = block.seg(vocab), 32 * vec * group
    for w in range(block.warps):
        for blk in range(blocks):
            lo, hi = w * seg + blk * width, min(w * seg + (blk + 1) * width, (w + 1) * seg, vocab)
            assert scan.bmax[w, blk] == (row[lo:hi].max() if hi > lo else 0)
    assert scan.M == row.max() and np.isclose(scan.S, row.astype(np.float64).sum())
    for floor in np.sort(row)[::-1][[0, 5, 40, 100]]:
        ids = model.gather(scan, block, floor)
        want = np.flatnonzero((row >= floor) & (row > 0))
        per_warp = np.bincount(want // seg, minlength=block.warps)
        if per_warp.max() > block.cap_w:
            assert ids is None
        else:
            np.testing.assert_array_equal(ids, want)
    if vocab <= 8 * threads:  # the whole row fits
        np.testing.assert_array_equal(model.gather(scan, block, 0), np.flatnonzero(row > 0))


def test_gather_logits_and_flat_rows(rng):
    x = (rng.standard_normal(40000) * 4).astype(np.float32)
    x[rng.random(40000) < 0.1] = -np.inf
    block = model.Block(256, 4)
    scan = model.scan_row(x, block, model.Logits)
    floor = np.sort(x)[::-1][30]
    ids = model.gather(scan, block, floor, model.Logits)
    np.testing.assert_array_equal(ids, np.flatnonzero(x >= floor))
    flat = np.full(50000, 1 / 50000, np.float32)
    scan = model.scan_row(flat, block)
    assert model.gather(scan, block, flat[0]) is None  # every value reaches the floor


@pytest.mark.parametrize("op,params", [("top_k", {"top_k": 1}), ("top_k", {"top_k": 50}),
                                       ("top_k", {"top_k": 200}), ("top_p", {"top_p": 0.5}),
                                       ("top_p", {"top_p": 0.95}), ("top_p", {"top_p": 0.0}),
                                       ("min_p", {"min_p": 0.1})])  # fmt: skip
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_floor_lies_below_every_kept_value(rng, op, params, scale):
    row = probs_row(rng, 30000, scale, zeros=0.1)
    row[100:110] = row.max()  # ties at the top
    block = model.Block(1024, 4)
    scan = model.scan_row(row, block)
    k, p, m = params.get("top_k", 0), params.get("top_p", 1.0), params.get("min_p", 0.0)
    P = np.float32(p) * np.float32(scan.S)
    t = np.float32(m) * scan.M
    floor, need_mass = model.sample_floor(scan, op, k > 0, k, p < 1, P, m > 0, t)
    keep = sref.sampling_keep_ref(row, op, **params)[0]
    assert need_mass == (op == "top_p")
    proved = row[row >= floor].astype(np.float64).sum() >= P
    if not need_mass or proved:
        assert floor <= row[keep].min()
    if op != "top_p" or scale > 1:
        assert floor > 0 and (not need_mass or proved)  # a useful floor


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


def test_radix_select_by_mass_of_values_lighter_than_p_is_their_smallest(rng):
    """What light_block_maxima (row_select.cuh) relies on: when the fixed-point masses of all
    the values add up to less than p_fixed, the top-p cut is the smallest value."""
    vals = probs_row(rng, 256, 3.0)
    M = np.float32(8 * vals.max())  # the row's maximum: the block maxima are a part of the row
    total = model.fixed_mass(vals, M).sum()
    for p_fixed in (total + np.uint64(1), 2 * total):
        v, _ = model.radix_select(vals, model.Probs, p_fixed=p_fixed, M=M)
        assert v == vals.min()
    heavy = total - model.fixed_mass(vals.min(), M)  # the mass above the smallest value
    v, _ = model.radix_select(vals, model.Probs, p_fixed=heavy, M=M)
    assert v > vals.min()


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


def check_model_draws(row, tokens, op, params):
    """Model draws from `row`: never outside the kept set, frequencies near the reference's."""
    expected = sref.sampling_dist_ref(row, op, **params)[0]
    assert expected[tokens].min() > 0, "drew a token outside the kept set"
    freq = np.bincount(tokens, minlength=len(row)) / len(tokens)
    cos = freq @ expected / np.linalg.norm(freq) / np.linalg.norm(expected)
    assert cos > 0.99, cos
    bound = 4 * np.sqrt(np.count_nonzero(expected) / len(tokens))
    assert np.abs(freq - expected).sum() / 2 < bound


@pytest.mark.parametrize("vocab,scale,threads", [(7, 1.0, 32), (111, 2.0, 32), (3000, 3.0, 64)])
@pytest.mark.parametrize("op,params", CASES)
def test_model_sampler_distribution(rng, op, params, vocab, scale, threads):
    row = probs_row(rng, vocab, scale, zeros=0.2)
    row[3] = row[2]  # a tie
    block = model.Block(threads, 1)
    scan = model.scan_row(row, block)
    draws = 6000
    tokens = np.array([model.sample_row(row, op, seed=5, offset=i, block=block, scan=scan,
                                        **params).token for i in range(draws)])  # fmt: skip
    check_model_draws(row, tokens, op, params)


@pytest.mark.parametrize("op,params", CASES)
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_model_sampler_on_a_large_row(rng, op, params, scale):
    row = probs_row(rng, 40000, scale, zeros=0.1)
    block = model.Block(256, 4)
    scan = model.scan_row(row, block)
    keep = sref.sampling_keep_ref(row, op, **params)[0]
    draws = [model.sample_row(row, op, seed=1, offset=i, block=block, scan=scan, **params)
             for i in range(200)]  # fmt: skip
    assert all(keep[d.token] for d in draws)
    if op in ("top_k", "top_k_top_p", "top_k_first") or (op != "plain" and scale > 1):
        assert all(d.on_list for d in draws)  # the kept set was gathered into shared memory
    assert max(d.rounds for d in draws) <= 24


def test_model_sampler_draws_from_an_unproved_list_first(rng):
    """A top-p floor whose listed values carry less than P: round 0 draws the list first (all of
    it kept), then the values below the floor; the tokens still follow the kept distribution."""
    block = model.Block(64, 1)
    for _ in range(50):  # a row whose floor the list's mass does not prove (most of this kind)
        row = probs_row(rng, 3000, 2.0, zeros=0.2)
        scan = model.scan_row(row, block)
        P = np.float32(0.9) * np.float32(scan.S)
        floor, _ = model.sample_floor(scan, "top_p", False, 0, True, P, False, 0)
        ids = model.gather(scan, block, floor)
        if ids is not None and row[ids].astype(np.float64).sum() < P:
            break
    else:
        pytest.fail("no row of softmax(2 N) left its top-p floor unproved")
    draws = [model.sample_row(row, "top_p", top_p=0.9, seed=5, offset=i, block=block, scan=scan)
             for i in range(20000)]  # fmt: skip
    assert all(d.part and not d.on_list for d in draws)  # hundreds kept: cos > 0.99 needs 20K
    tokens = np.array([d.token for d in draws])
    assert 0 < np.count_nonzero(row[tokens] < floor) < len(tokens) // 2  # both parts drawn
    check_model_draws(row, tokens, "top_p", {"top_p": 0.9})


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
        expect = sref.top_k_mask_logits_ref(row, param)[0]
    else:
        row = probs_row(rng, vocab, 3.0, zeros=0.1)
        fn = sref.top_k_renorm_probs_ref if op == "top_k_renorm" else sref.top_p_renorm_probs_ref
        expect = fn(row, param)[0]
    out = model.renorm_row(row, op, param, model.Block(threads, 4))  # list or streamed
    floor = -np.inf if op == "top_k_mask" else 0
    np.testing.assert_array_equal(out > floor, expect > floor)
    finite = np.isfinite(expect)
    np.testing.assert_allclose(out[finite], expect[finite], rtol=2e-6, atol=0)


# --- argument checks (raised on the host, before any device work) -----------------------------


def prepare(op, static, *arrays):
    """An op's prepare on host arrays described as the call path describes device arrays: its
    checks run before any device query, so their errors need no GPU."""
    from rtcinfer.interop import ArrayInfo
    from rtcinfer.interop.dtypes import normalize

    infos = [None if a is None else ArrayInfo(a.shape, tuple(s // a.itemsize for s in a.strides),
                                              normalize(a.dtype), 0) for a in arrays]  # fmt: skip
    return op.prepare(infos, 16, static)


def test_argument_errors_name_what_they_received():
    import rtcinfer
    from rtcinfer.sampling.renorm import _OPS as renorm_ops
    from rtcinfer.sampling.samplers import _OP as sample_op
    from rtcinfer.sampling.softmax import _OP as softmax_op
    from rtcinfer.sampling.speculative import _OP as speculative_op

    probs = np.full((4, 10), 0.1, np.float32)

    def sample(op, probs, indices=None, top_k=None, top_p=None, seed=None, out=None):
        arrays = (probs, indices, top_k, top_p, None, seed, None, out)
        return prepare(sample_op, (op, False), *arrays)

    with pytest.raises(ValueError, match=r"top_k: expected a scalar or a int32/int64 array of "
                                         r"shape \(4,\), got a rank-1 float32 array of shape "
                                         r"\(4,\)"):  # fmt: skip
        sample("top_k", probs, top_k=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"top_p: .* shape \(4,\), got a rank-1 float32 array of "
                                         r"shape \(3,\)"):  # fmt: skip
        sample("top_p", probs, top_p=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"top_p: .* shape \(4,\), got a rank-2 float32 array of "
                                         r"shape \(4, 1\)"):  # fmt: skip
        sample("top_p", probs, top_p=np.zeros((4, 1), np.float32))
    with pytest.raises(ValueError, match="filter_apply_order must be 'top_k_first' or 'joint'"):
        rtcinfer.top_k_top_p_sampling_from_probs(probs, 3, 0.5, filter_apply_order="both")
    with pytest.raises(ValueError, match=r"probs: expected shape \(batch, vocab\)"):
        sample("plain", np.zeros(5, np.float32))
    with pytest.raises(TypeError, match="probs: dtype must be one of"):
        sample("plain", np.zeros((2, 5), np.int32))
    with pytest.raises(ValueError, match=r"indices: expected a 1-D int32 or int64 array"):
        sample("plain", probs, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"seed: expected int64/uint64 of shape \(1,\) or \(4,\)"):
        sample("plain", probs, seed=np.zeros(3, np.int64))
    with pytest.raises(ValueError, match=r"out: expected shape \(4,\) and dtype int32"):
        sample("plain", probs, out=np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="out: must be contiguous"):
        sample("plain", probs, out=np.zeros((4, 2), np.int32)[:, 0])
    with pytest.raises(ValueError, match="offset= needs seed="):
        rtcinfer.sampling_from_probs(probs, offset=3)
    with pytest.raises(ValueError, match=r"top_k: expected a scalar or a int32/int64 array"):
        prepare(renorm_ops["top_k_mask"], ("top_k_mask",), probs, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match=r"temperature: expected a float or a float32 array"):
        prepare(softmax_op, (), probs, np.ones(4, np.float64))
    draft, ids = np.zeros((2, 3, 5), np.float32), np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match="expected draft_probs"):
        prepare(speculative_op, (), draft, ids, draft, None, None, None, None)
    with pytest.raises(ValueError, match="pass both counters"):
        prepare(speculative_op, (), draft, ids, np.zeros((2, 4, 5), np.float32),
                np.zeros(2, np.int32), None, None, None)  # fmt: skip
    with pytest.raises(TypeError, match="host numpy.ndarray"):
        rtcinfer.sampling_from_probs(probs)


def test_row_kernels_fit_an_a100_block():
    from rtcinfer.layout import row_smem_bytes, row_threads

    assert row_smem_bytes(1024) + 5 * 1024 <= 163 * 1024  # dynamic + static (RowShared)
    assert row_threads(111, 1, 132) == 32 and row_threads(4096, 1, 132) == 512
    assert row_threads(151936, 1, 132) == 1024 and row_threads(151936, 512, 132) == 512
    assert row_threads(151936, 100000, 132) == 256
    # top-k's cuts take 256-thread blocks from 2 x SMs rows on (one wave at four a SM)
    assert row_threads(32000, 265, 132) == 512 and row_threads(32000, 265, 132, True) == 256
    assert row_threads(32000, 264, 132, True) == 512 and row_threads(1000, 265, 132, True) == 128


@pytest.mark.parametrize("vocab,cluster,vec", [(1, 8, 1), (111, 8, 1), (3000, 8, 4),
                                               (3000, 2, 8), (70001, 4, 1)])  # fmt: skip
def test_cluster_draw_order_is_a_permutation(vocab, cluster, vec):
    order = cluster_model.draw_order(vocab, cluster, vec)
    assert sorted(order.tolist()) == list(range(vocab))


@pytest.mark.parametrize("vocab,scale,cluster", [(7, 1.0, 8), (111, 2.0, 8), (3000, 3.0, 4)])
@pytest.mark.parametrize("op,params", CASES)
def test_cluster_model_distribution(rng, op, params, vocab, scale, cluster):
    row = probs_row(rng, vocab, scale, zeros=0.2)
    row[3] = row[2]  # a tie
    draws = 4000
    draw = cluster_model.sample_row
    tokens = np.array([draw(row, op, seed=5, offset=i, cluster=cluster, vec=1, **params)
                       for i in range(draws)])  # fmt: skip
    check_model_draws(row, tokens, op, params)


def test_cluster_model_edge_rows():
    zero = np.zeros(50, np.float32)
    assert cluster_model.sample_row(zero, "top_p", top_p=0.5) == 0
    one_hot = np.zeros(300, np.float32)
    one_hot[123] = 1.0
    for op, params in CASES:
        assert cluster_model.sample_row(one_hot, op, seed=3, **params) == 123
    assert cluster_model.sample_row(np.ones(1, np.float32), "top_k", top_k=1) == 0
    # top_k beyond the positive values keeps exactly those (the zeros are never drawn)
    row = np.zeros(40, np.float32)
    row[[5, 9]] = 0.5
    assert {cluster_model.sample_row(row, "top_k", top_k=10, offset=i) for i in range(50)} == {5, 9}


def test_cluster_candidate_list_is_taken_for_typical_rows_only(rng):
    row = probs_row(rng, 128256, 3.0)
    assert cluster_model.on_list(row, 50, 8, 4)
    assert not cluster_model.on_list(row, 129, 8, 4)  # k beyond the 128 warp maxima
    assert not cluster_model.on_list(np.full(128256, 1e-5, np.float32), 50, 8, 4)


def test_softmax_path_selection():
    from rtcinfer.sampling.softmax import (
        cluster_choices,
        cluster_softmax_spec,
        softmax_cluster,
        specs_for,
    )

    assert softmax_cluster(1, 32000, 132, 80) == 0  # no clusters before sm_90
    assert softmax_cluster(1, 32000, 132, 90) == 8 and softmax_cluster(16, 32000, 132, 90) == 8
    assert softmax_cluster(17, 32000, 132, 90) == 4 and softmax_cluster(34, 32000, 132, 90) == 2
    assert softmax_cluster(67, 32000, 132, 90) == 0  # one CTA a row fills the GPU
    assert softmax_cluster(1, 8192, 132, 90) == 4  # slices of at least MIN_SLICE elements
    assert softmax_cluster(1, 4095, 132, 90) == 0 and softmax_cluster(1, 4096, 132, 90) == 2
    assert cluster_choices(32000, 90) == (8, 4, 2) and cluster_choices(6000, 90) == (2,)
    assert cluster_choices(32000, 89) == ()
    spec = cluster_softmax_spec("float32", 32000, 8)  # slices of 4000: 128 threads
    assert (spec.vec, spec.threads, spec.cluster, spec.min_sm) == (4, 128, 8, 90)
    assert len(specs_for(32000, ("float32", "bfloat16"), (8, 2))) == 6


def test_cluster_path_selection():
    from rtcinfer.sampling.cluster import SLICE_BYTES, cluster_size, slice_elements

    assert cluster_size(1, 128256, 4, 132, 80) == 0  # no clusters before sm_90
    assert cluster_size(1, 128256, 4, 188, 120, 99 * 1024) == 0  # too little shared memory
    assert cluster_size(1, 128256, 4, 132, 90) == 8
    assert cluster_size(16, 151936, 4, 132, 90) == 8
    assert cluster_size(17, 32000, 4, 132, 90) == 4 and cluster_size(33, 32000, 4, 132, 90) == 4
    assert cluster_size(34, 32000, 4, 132, 90) == 2 and cluster_size(66, 32000, 4, 132, 90) == 2
    # up to the SM count, two CTAs a row in two waves at most, where two slices fit one SM
    assert cluster_size(67, 32000, 4, 132, 90) == 2 and cluster_size(132, 32000, 4, 132, 90) == 2
    assert cluster_size(133, 32000, 4, 132, 90) == 0
    assert cluster_size(100, 32000, 4, 132, 90, 150 * 1024) == 0  # two slices do not fit
    assert cluster_size(40, 128256, 4, 132, 90) == 0  # a slice of 64128 floats does not fit
    for vocab, cluster, vec in [(1, 8, 1), (111, 8, 1), (128256, 8, 4), (50000, 4, 8)]:
        seg = slice_elements(vocab, cluster, vec)
        per_cta = -(-vocab // cluster)
        assert seg % max(4, vec) == 0 and per_cta <= seg < per_cta + max(4, vec)
    assert 4 * slice_elements(400_000, 8, 4) <= SLICE_BYTES
