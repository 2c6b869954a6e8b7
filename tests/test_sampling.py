"""Samplers on the GPU: distributions (>= 1M draws a case), kept sets and edge cases,
determinism, the NumPy model of the kernels token for token, and the Philox generator.
Threshold ops, softmax, speculative sampling and frameworks: tests/test_sampling_ops.py."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from rtcinfer import jit
from tests import reference_sampling as sref
from tests import sampling_model as model

pytestmark = pytest.mark.gpu

DRAWS = 1 << 20


def cupy():
    import cupy

    return cupy


def probs_rows(rng, rows, vocab, scale=1.0, zeros=0.0):
    """softmax(scale * N(0, 1)) rows in fp32; a fraction `zeros` of the tokens at probability 0."""
    logits = rng.standard_normal((rows, vocab)) * scale
    logits[rng.random((rows, vocab)) < zeros] = -np.inf
    logits[:, 0] = np.where(np.isinf(logits).all(axis=1), 0.0, logits[:, 0])  # no empty rows
    return sref.softmax_ref(logits).astype(np.float32)


def sample(op, probs, indices=None, params=None, **kw):
    """One sampler call by op name (SAMPLE_OPS); params: top_k / top_p / min_p."""
    params = params or {}
    if op == "plain":
        return rtcinfer.sampling_from_probs(probs, indices, **kw)
    if op == "top_k":
        return rtcinfer.top_k_sampling_from_probs(probs, params["top_k"], indices, **kw)
    if op == "top_p":
        return rtcinfer.top_p_sampling_from_probs(probs, params["top_p"], indices, **kw)
    if op == "min_p":
        return rtcinfer.min_p_sampling_from_probs(probs, params["min_p"], indices, **kw)
    order = "joint" if op == "top_k_top_p" else "top_k_first"
    return rtcinfer.top_k_top_p_sampling_from_probs(
        probs, params["top_k"], params["top_p"], indices, filter_apply_order=order, **kw
    )


def check_frequencies(counts, expected, what=""):
    """counts [rows, vocab] of draws from rows of `expected` (renormalized distributions)."""
    bad = (counts > 0) & (expected <= 0)
    if bad.any():
        r, t = np.argwhere(bad)[0]
        raise AssertionError(
            f"{what}: {int(counts[bad].sum())} draws of tokens outside the kept set, e.g. row "
            f"{r} token {t} ({int(counts[r, t])} draws, p = {expected[r, t]})"
        )
    freq = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    cos = (freq * expected).sum() / np.linalg.norm(freq) / np.linalg.norm(expected)
    assert cos > 0.99, f"{what}: cosine(frequencies, expected) = {cos:.5f}"


# (op, params, vocab, distinct rows, logit scale): every sampler over vocabularies 1 to 151936
# and 1 to 512 distinct rows, 2^20 draws each. The two largest rows cost most of the file's time.
DISTRIBUTIONS = [
    ("plain", {}, 1, 1, 1.0),
    ("top_k", {"top_k": 1}, 1, 1, 1.0),
    ("plain", {}, 2, 8, 1.0),
    ("top_p", {"top_p": 0.9}, 2, 8, 1.0),
    ("min_p", {"min_p": 0.5}, 2, 8, 1.0),
    ("plain", {}, 111, 64, 1.0),
    ("top_k", {"top_k": 10}, 111, 256, 1.0),
    ("top_p", {"top_p": 0.8}, 111, 128, 1.0),
    ("min_p", {"min_p": 0.1}, 111, 64, 1.0),
    ("top_k_top_p", {"top_k": 20, "top_p": 0.9}, 111, 512, 2.0),
    ("top_k_first", {"top_k": 20, "top_p": 0.8}, 111, 256, 1.0),
    ("top_p", {"top_p": 0.9}, 32000, 4, 3.0),
    ("min_p", {"min_p": 0.05}, 32000, 8, 3.0),
    ("top_k_top_p", {"top_k": 50, "top_p": 0.9}, 128256, 2, 2.0),
    ("top_k_first", {"top_k": 50, "top_p": 0.9}, 151936, 1, 1.0),
]


@pytest.mark.parametrize("op,params,vocab,rows,scale", DISTRIBUTIONS,
                         ids=[f"{c[0]}-vocab{c[2]}-rows{c[3]}" for c in DISTRIBUTIONS])  # fmt: skip
def test_distribution(rng, op, params, vocab, rows, scale):
    cp = cupy()
    host = probs_rows(rng, rows, vocab, scale, zeros=0.1 if vocab > 2 else 0.0)
    probs = cp.asarray(host)
    reps = 4
    per = DRAWS // reps // rows * rows
    idx = cp.arange(per, dtype=cp.int32) % rows
    counts = cp.zeros(rows * vocab, cp.int64)
    for r in range(reps):  # rows x repeats x offsets
        tokens = sample(op, probs, idx, params, seed=1234, offset=r)
        assert tokens.dtype == np.int32 and tokens.shape == (per,)
        assert bool(((tokens >= 0) & (tokens < vocab)).all()), "token id out of range"
        counts += cp.bincount(idx.astype(cp.int64) * vocab + tokens, minlength=rows * vocab)
    expected = sref.sampling_dist_ref(host, op, **params)
    check_frequencies(counts.get().reshape(rows, vocab), expected, f"{op} {params}")


@pytest.mark.parametrize("order", ["joint", "top_k_first", None])
def test_distribution_from_logits(rng, order):
    cp = cupy()
    rows, vocab = 64, 111
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    logits[rng.random((rows, vocab)) < 0.1] = -np.inf
    idx = cp.arange(DRAWS, dtype=cp.int32) % rows
    x = cp.asarray(logits)
    if order is None:
        tokens = rtcinfer.sampling_from_logits(x, idx, seed=9, offset=0)
        expected = sref.softmax_ref(logits)
    else:
        tokens = rtcinfer.top_k_top_p_sampling_from_logits(
            x, 15, 0.85, idx, filter_apply_order=order, seed=9, offset=0
        )
        op = "top_k_top_p" if order == "joint" else "top_k_first"
        expected = sref.sampling_dist_ref(sref.softmax_ref(logits), op, top_k=15, top_p=0.85)
    counts = cp.bincount(idx.astype(cp.int64) * vocab + tokens, minlength=rows * vocab)
    check_frequencies(counts.get().reshape(rows, vocab), expected, f"logits {order}")


def test_logits_samplers_equal_probs_samplers_on_our_softmax(rng):
    cp = cupy()
    logits = cp.asarray(rng.standard_normal((300, 32000)).astype(np.float32) * 3)
    probs = rtcinfer.softmax(logits)
    a = rtcinfer.sampling_from_logits(logits, seed=5, offset=7)
    b = rtcinfer.sampling_from_probs(probs, seed=5, offset=7)
    assert bool((a == b).all())
    for order in ("joint", "top_k_first"):
        a = rtcinfer.top_k_top_p_sampling_from_logits(logits, 40, 0.9, filter_apply_order=order,
                                                      seed=5, offset=8)  # fmt: skip
        b = rtcinfer.top_k_top_p_sampling_from_probs(probs, 40, 0.9, filter_apply_order=order,
                                                     seed=5, offset=8)  # fmt: skip
        assert bool((a == b).all())


def test_logits_samplers_in_one_call_take_out_indices_and_check_nan(rng):
    """The fused softmax + sampler call: out= is written and returned, int64 indices give int64
    tokens, check_nan sees a NaN logit (through its NaN probabilities) and a clean batch passes."""
    cp = cupy()
    logits = cp.asarray(rng.standard_normal((8, 1000)).astype(np.float32))
    idx = cp.asarray(np.array([7, 0, 3, 3, 5], np.int64))
    out = cp.full(5, -7, dtype=cp.int64)
    got = rtcinfer.top_k_top_p_sampling_from_logits(logits, 20, 0.8, idx, seed=2, offset=3,
                                                    out=out, check_nan=True)  # fmt: skip
    assert got.dtype == cp.int64 and int(got.data.ptr) == int(out.data.ptr)
    want = rtcinfer.top_k_top_p_sampling_from_probs(rtcinfer.softmax(logits), 20, 0.8, idx,
                                                    seed=2, offset=3)  # fmt: skip
    assert bool((out == want).all())
    logits[4, 17] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        rtcinfer.sampling_from_logits(logits, seed=1, check_nan=True)


# --- kept sets and edge cases -------------------------------------------------------------------

OPS = [
    ("plain", {}),
    ("top_k", {"top_k": 7}),
    ("top_p", {"top_p": 0.7}),
    ("min_p", {"min_p": 0.2}),
    ("top_k_top_p", {"top_k": 30, "top_p": 0.8}),
    ("top_k_first", {"top_k": 30, "top_p": 0.8}),
]


def draws_of(op, host, params, repeats, seed=3):
    """tokens [repeats, rows] for `repeats` offsets."""
    cp = cupy()
    probs = cp.asarray(host)
    out = [sample(op, probs, None, params, seed=seed, offset=r) for r in range(repeats)]
    return cp.stack(out).get()


@pytest.mark.parametrize("op,params", OPS)
@pytest.mark.parametrize("vocab,rows", [(111, 512), (32000, 64), (128256, 8), (151936, 4)])
def test_never_a_filtered_or_zero_token(rng, op, params, vocab, rows):
    host = probs_rows(rng, rows, vocab, 2.0, zeros=0.3)
    tokens = draws_of(op, host, params, repeats=max(4, 8192 // rows))
    keep = sref.sampling_keep_ref(host, op, **params)
    assert keep[np.arange(rows)[None, :], tokens].all()


@pytest.mark.parametrize("vocab", [111, 32000])
def test_inactive_filters_draw_like_plain(rng, vocab):
    host = probs_rows(rng, 256, vocab, 1.0)
    plain = draws_of("plain", host, {}, 8)
    for op, params in [("top_k", {"top_k": vocab}), ("top_k", {"top_k": vocab + 7}),
                       ("top_k", {"top_k": 0}), ("top_p", {"top_p": 1.0}),
                       ("min_p", {"min_p": 0.0}),
                       ("top_k_top_p", {"top_k": vocab, "top_p": 1.0}),
                       ("top_k_first", {"top_k": vocab, "top_p": 1.0})]:  # fmt: skip
        other = draws_of(op, host, params, 8)
        # the same draw; sums taken in another order may move a token across a boundary
        assert (other == plain).mean() > 0.99, (op, params)


def test_top_k_one_and_tiny_top_p_are_greedy(rng):
    host = probs_rows(rng, 128, 32000, 1.0)
    greedy = host.argmax(axis=1)
    for op, params in [("top_k", {"top_k": 1}), ("top_p", {"top_p": 1e-7}),
                       ("min_p", {"min_p": 1.0}), ("top_k_top_p", {"top_k": 1, "top_p": 0.5}),
                       ("top_k_first", {"top_k": 5, "top_p": 1e-7}),
                       ("top_p", {"top_p": 0.0})]:  # fmt: skip
        assert (draws_of(op, host, params, 4) == greedy).all(), (op, params)


@pytest.mark.parametrize("op,params", OPS)
def test_all_mass_on_one_token(op, params):
    host = np.zeros((6, 5000), np.float32)
    hot = np.array([0, 1, 777, 2500, 4998, 4999])
    host[np.arange(6), hot] = 1.0
    host[3, :100] = 1e-30  # tiny tails
    host[3, 2500] = 1.0
    assert (draws_of(op, host, params, 16) == hot).all()


def test_ties_are_kept_and_drawn_evenly(rng):
    cp = cupy()
    host = probs_rows(rng, 1, 4000, 1.0)
    top = rng.choice(4000, 8, replace=False)
    host[0, top] = host.max() * 2  # 8 tokens tie for the largest probability
    host /= host.sum()
    idx = cp.zeros(1 << 16, cp.int32)
    for op, params in [("top_k", {"top_k": 3}), ("top_k_first", {"top_k": 2, "top_p": 0.9}),
                       ("top_p", {"top_p": 0.01})]:  # fmt: skip
        tokens = sample(op, cp.asarray(host), idx, params, seed=1, offset=0).get()
        counts = np.bincount(tokens, minlength=4000)
        assert set(np.flatnonzero(counts)) == set(top.tolist()), op
        assert counts[top].min() > 0.8 * len(tokens) / 8, op


def test_per_row_parameters(rng):
    cp = cupy()
    rows, vocab = 64, 32000
    host = probs_rows(rng, rows, vocab, 2.0, zeros=0.1)
    k = rng.integers(0, 200, rows)
    p = rng.uniform(0.0, 1.2, rows).astype(np.float32)
    m = rng.uniform(0.0, 0.5, rows).astype(np.float32)
    probs = cp.asarray(host)
    for op, args in [("top_k", (cp.asarray(k),)), ("top_k", (cp.asarray(k.astype(np.int32)),)),
                     ("top_p", (cp.asarray(p),)), ("min_p", (cp.asarray(m),)),
                     ("top_k_top_p", (cp.asarray(k), cp.asarray(p)))]:  # fmt: skip
        for r in range(16):
            if op == "top_k":
                tokens = rtcinfer.top_k_sampling_from_probs(probs, *args, seed=2, offset=r)
                keep = sref.sampling_keep_ref(host, op, top_k=k)
            elif op == "top_p":
                tokens = rtcinfer.top_p_sampling_from_probs(probs, *args, seed=2, offset=r)
                keep = sref.sampling_keep_ref(host, op, top_p=p)
            elif op == "min_p":
                tokens = rtcinfer.min_p_sampling_from_probs(probs, *args, seed=2, offset=r)
                keep = sref.sampling_keep_ref(host, op, min_p=m)
            else:
                tokens = rtcinfer.top_k_top_p_sampling_from_probs(
                    probs, *args, filter_apply_order="joint", seed=2, offset=r
                )
                keep = sref.sampling_keep_ref(host, op, top_k=k, top_p=p)
            assert keep[np.arange(rows), tokens.get()].all(), op


def test_parameter_arrays_of_other_dtypes_are_converted(rng):
    """As FlashInfer: a min_p or top_p tensor of ints (torch.full((B,), 1) is int64) counts as
    float32, a float top_k as int32; the draws equal those with the scalar (same seed)."""
    torch = pytest.importorskip("torch")
    rows, vocab = 32, 5000
    probs = torch.from_numpy(probs_rows(rng, rows, vocab, 2.0)).cuda()
    draw = dict(seed=4, offset=0)
    ones = torch.full((rows,), 1, device="cuda")  # int64
    assert ones.dtype == torch.int64
    for got, want in [
        (rtcinfer.top_p_sampling_from_probs(probs, ones, **draw),
         rtcinfer.top_p_sampling_from_probs(probs, 1.0, **draw)),
        (rtcinfer.min_p_sampling_from_probs(probs, torch.zeros(rows, dtype=torch.int32,
                                                               device="cuda"), **draw),
         rtcinfer.min_p_sampling_from_probs(probs, 0.0, **draw)),
        (rtcinfer.top_k_sampling_from_probs(probs, torch.full((rows,), 7.0, device="cuda"),
                                            **draw),
         rtcinfer.top_k_sampling_from_probs(probs, 7, **draw)),
        (rtcinfer.top_k_renorm_probs(probs, torch.full((rows,), 9.0, device="cuda")),
         rtcinfer.top_k_renorm_probs(probs, 9)),
    ]:  # fmt: skip
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"top_p: .* got a rank-2 float32 array of shape "
                                         r"\(32, 1\)"):  # fmt: skip
        rtcinfer.top_p_sampling_from_probs(probs, torch.ones((rows, 1), device="cuda"), **draw)


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_indices_map_outputs_to_rows_and_set_the_dtype(rng, index_dtype):
    cp = cupy()
    host = probs_rows(rng, 5, 2000, 2.0, zeros=0.5)
    idx = rng.integers(0, 5, 3000).astype(index_dtype)
    tokens = rtcinfer.top_k_sampling_from_probs(cp.asarray(host), 20, cp.asarray(idx), seed=4)
    assert tokens.dtype == index_dtype and tokens.shape == (3000,)
    keep = sref.sampling_keep_ref(host, "top_k", top_k=20)
    assert keep[idx, tokens.get()].all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_probs(rng, dtype):
    cp = cupy()
    from rtcinfer.interop.dtypes import numpy_dtype

    host = probs_rows(rng, 4, 32000, 3.0, zeros=0.2).astype(numpy_dtype(dtype))
    rounded = host.astype(np.float64)
    idx = cp.arange(1 << 18, dtype=cp.int32) % 4
    probs = cp.asarray(host)
    for op, params in OPS:
        tokens = sample(op, probs, idx, params, seed=6, offset=0)
        counts = cp.bincount(idx.astype(cp.int64) * 32000 + tokens, minlength=4 * 32000)
        expected = sref.sampling_dist_ref(rounded, op, **params)
        check_frequencies(counts.get().reshape(4, 32000), expected, f"{dtype} {op}")


def test_strided_unaligned_and_tiny_rows(rng):
    cp = cupy()
    wide = probs_rows(rng, 16, 3001, 2.0)
    strided = cp.asarray(wide)[:, 1:]  # rows 3000 long, 4-byte aligned only
    host = wide[:, 1:]
    for op, params in OPS:
        tokens = sample(op, strided, None, params, seed=1).get()
        assert sref.sampling_keep_ref(host, op, **params)[np.arange(16), tokens].all(), op
    for vocab in (1, 2, 3, 111):
        small = probs_rows(rng, 33, vocab, 1.0)
        for op, params in OPS:
            tokens = sample(op, cp.asarray(small), None, params, seed=1).get()
            assert sref.sampling_keep_ref(small, op, **params)[np.arange(33), tokens].all()


def test_rows_without_mass_and_bad_values(rng):
    cp = cupy()
    host = probs_rows(rng, 4, 1000, 1.0)
    host[1] = 0.0  # no positive probability: token 0
    host[2, 10] = np.nan
    host[3, 20] = -0.5
    probs = cp.asarray(host)
    for op, params in OPS:
        tokens = sample(op, probs, None, params, seed=1).get()
        assert tokens[1] == 0 and ((0 <= tokens) & (tokens < 1000)).all()
        assert tokens[2] != 10 and tokens[3] != 20  # never a NaN or negative entry
        with pytest.raises(ValueError, match="NaN, negative or infinite"):
            sample(op, probs, None, params, seed=1, check_nan=True)
    clean = probs_rows(rng, 4, 1000, 1.0)
    sample("top_p", cp.asarray(clean), None, {"top_p": 0.5}, check_nan=True)  # no error


def test_out_argument(rng):
    cp = cupy()
    probs = cp.asarray(probs_rows(rng, 8, 500))
    out = cp.full(8, -1, cp.int32)
    assert rtcinfer.top_p_sampling_from_probs(probs, 0.9, seed=1, out=out) is out
    assert bool((out >= 0).all())


# --- randomness ---------------------------------------------------------------------------------


def test_philox_kernel_matches_the_model():
    cp = cupy()
    from rtcinfer.launch import Kernel, Launch
    from rtcinfer.sampling import SampleSpec

    counters = np.random.default_rng(1).integers(0, 2**32, (1000, 4), dtype=np.uint64)
    counters[:3] = [[0, 0, 0, 0], [2**32 - 1] * 4, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]]
    keys = [(0, 0), (0xFFFFFFFF, 0xFFFFFFFF), (0xA4093822, 0x299F31D0)]
    spec = SampleSpec("plain", "float32", "int32", 4, 1024)
    launch = Launch(Kernel(spec, "philox_kernel", "PhiloxParams"), (4, 1, 1), (256, 1, 1))
    for k0, k1 in keys:
        c = cp.asarray(counters.astype(np.uint32))
        out = cp.empty_like(c)
        p = launch.params
        p.counters, p.out, p.n, p.k0, p.k1 = c.data.ptr, out.data.ptr, 1000, k0, k1
        launch(cp.cuda.get_current_stream().ptr, cp.cuda.Device().id)
        expect = model.philox4x32_10(counters.astype(np.uint32), np.array([k0, k1], np.uint32))
        np.testing.assert_array_equal(out.get(), expect)


def test_same_seed_and_offset_same_tokens(rng):
    cp = cupy()
    probs = cp.asarray(probs_rows(rng, 512, 32000, 1.0))
    for op, params in OPS:
        a = sample(op, probs, None, params, seed=77, offset=5)
        b = sample(op, probs, None, params, seed=77, offset=5)
        c = sample(op, probs, None, params, seed=77, offset=6)
        assert bool((a == b).all()), op
        assert float((a != c).mean()) > 0.5, op


def test_generator_and_device_seeds(rng):
    cp = cupy()
    probs = cp.asarray(probs_rows(rng, 256, 4000, 1.0))
    g = rtcinfer.Generator(seed=11)
    first = rtcinfer.top_k_sampling_from_probs(probs, 50, generator=g)
    second = rtcinfer.top_k_sampling_from_probs(probs, 50, generator=g)
    assert g.offset == 2 and float((first != second).mean()) > 0.5
    again = rtcinfer.top_k_sampling_from_probs(probs, 50, generator=rtcinfer.Generator(seed=11))
    assert bool((again == first).all())
    scalar = rtcinfer.top_k_sampling_from_probs(probs, 50, seed=11, offset=1)
    assert bool((scalar == second).all())
    seed, offset = cp.asarray([11], cp.uint64), cp.asarray([1], cp.int64)
    arrays = rtcinfer.top_k_sampling_from_probs(probs, 50, seed=seed, offset=offset)
    assert bool((arrays == second).all())
    per_row = cp.full(256, 1, cp.uint64)
    per_row[7] = 2
    rows = rtcinfer.top_k_sampling_from_probs(probs, 50, seed=seed, offset=per_row)
    same = cp.ones(256, bool)
    same[7] = False
    assert bool((rows == second)[same].all())
    with pytest.raises(ValueError, match="offset"):
        rtcinfer.sampling_from_probs(probs, seed=seed, offset=cp.zeros(3, cp.int64))


@pytest.mark.parametrize("op,params", OPS)
@pytest.mark.parametrize("vocab,scale", [(3000, 2.0), (60000, 3.0)])
def test_tokens_match_the_model(rng, op, params, vocab, scale):
    """Over 2 x SMs rows: top-k's samplers run 256-thread blocks there, the others 512."""
    cp = cupy()
    sms = jit.sm_count(cp.cuda.Device().id)
    rows = 2 * sms + 8
    host = probs_rows(rng, rows, vocab, scale, zeros=0.1)
    tokens = sample(op, cp.asarray(host), None, params, seed=21, offset=3).get()
    block = model.block_for(vocab, rows, sms, op=op)
    want = np.array([model.sample_row(host[b], op, seed=21, offset=3, b=b, block=block,
                                      **params).token for b in range(rows)])  # fmt: skip
    match = (tokens == want).mean()
    # the model sums in float64 where the kernel sums fp32: a draw within rounding of a
    # boundary may land on the neighbouring token
    assert match > 0.97, f"{op}: {match:.3f} of the tokens match the model"


def test_top_p_tokens_match_the_model_where_the_list_does_not_prove_the_floor(rng):
    """The batch of bench_sampling's top-p rows: on many rows the values >= the floor carry
    less than P, and round 0 draws with that list first (sampling.cu, sample_from_part)."""
    cp = cupy()
    rows, vocab = 512, 32000
    host = probs_rows(rng, rows, vocab, 3.0)
    tokens = sample("top_p", cp.asarray(host), None, {"top_p": 0.9}, seed=4, offset=9).get()
    block = model.block_for(vocab, rows, jit.sm_count(cp.cuda.Device().id), op="top_p")
    draws = [model.sample_row(host[b], "top_p", top_p=0.9, seed=4, offset=9, b=b, block=block)
             for b in range(rows)]  # fmt: skip
    part = np.array([d.part for d in draws])
    assert 0.2 < part.mean() < 0.8, part.mean()  # both kinds of row
    match = (tokens == np.array([d.token for d in draws])).mean()
    assert match > 0.97, f"{match:.3f} of the tokens match the model"
    keep = sref.sampling_keep_ref(host, "top_p", top_p=0.9)
    assert keep[np.arange(rows), tokens].all()
