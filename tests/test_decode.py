"""Batch and single decode against the float64 references (GPU).

Every batch mixes the lengths 1, page_size - 1, page_size, page_size + 1, 513, 37 and two
empty requests over a shuffled page table; with 8 requests the planner splits the long ones,
so the in-kernel merge runs in every case. Tolerances: tests/checks.TOL for o (output
rounding plus p rounded to the MMA dtype), 1e-3 relative for the fp32 LSE.
"""

from __future__ import annotations

import zlib
from dataclasses import replace

import numpy as np
import pytest

import rtcinfer
from rtcinfer.attention.decode_kernel import kernel
from rtcinfer.interop.dtypes import FP8_DTYPES

from . import reference_attention as aref
from .checks import assert_close, to_host
from .gpu_decode import (
    check_attention,
    make_batch,
    poisoned_cache,
    random_values,
    run_batch,
    standard_lengths,
    to_gpu,
)

pytestmark = pytest.mark.gpu

BASE = dict(page_size=16, num_kv_heads=2, group_size=4, head_dim=128, q_dtype="bfloat16")
CASES = {
    "group1": dict(group_size=1, num_kv_heads=4),
    "group2": dict(group_size=2),
    "group4": {},
    "group5_fp16": dict(group_size=5, q_dtype="float16"),
    "group8": dict(group_size=8),
    "group16": dict(group_size=16, num_kv_heads=1),
    "group32": dict(group_size=32, num_kv_heads=1),  # two CTAs per kv head
    "d64": dict(head_dim=64, group_size=8),
    "d64_group16": dict(head_dim=64, group_size=16, q_dtype="float16"),
    "d256": dict(head_dim=256, group_size=2, q_dtype="float16"),
    "d256_group12": dict(head_dim=256, group_size=12),  # 8 query heads per CTA at d256
    "page1": dict(page_size=1, group_size=8),
    "page5": dict(page_size=5),
    "page128": dict(page_size=128),
    "hnd": dict(layout="HND"),
    "hnd_tuple_fp16": dict(layout="HND", form="tuple", q_dtype="float16"),
    "nhd_tuple": dict(form="tuple"),
    "nhd_strided": dict(form="strided"),
    "hnd_strided_tuple": dict(layout="HND", form="strided_tuple", group_size=5),
}


def seeded(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


@pytest.mark.parametrize("case", list(CASES))
def test_batch_decode(case):
    rng = seeded(case)
    kwargs = {**BASE, **CASES[case]}
    batch = make_batch(rng, standard_lengths(kwargs["page_size"], rng), **kwargs)
    o, lse = run_batch(batch)
    check_attention(o, lse, *batch.reference(), batch.q_dtype)


FEATURES = {
    "soft_cap": dict(logits_soft_cap=2.0),
    "window": dict(window_left=40),
    "window0": dict(window_left=0),
    "rope": dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5),
    "alibi": dict(pos_encoding_mode="ALIBI"),
    "sm_scale": dict(sm_scale=0.3),
    "alibi_cap_window": dict(
        pos_encoding_mode="ALIBI", logits_soft_cap=5.0, window_left=100, sm_scale=0.2
    ),
    "rope_cap_window": dict(pos_encoding_mode="ROPE_LLAMA", logits_soft_cap=3.0, window_left=300),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("group_size, q_dtype", [(4, "bfloat16"), (5, "float16")])
def test_features(feature, group_size, q_dtype):
    rng = seeded(feature, group_size)
    batch = make_batch(rng, standard_lengths(16, rng), group_size=group_size, q_dtype=q_dtype)
    o, lse = run_batch(batch, **FEATURES.get(feature, {}))
    check_attention(o, lse, *batch.reference(**FEATURES[feature]), q_dtype)


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
@pytest.mark.parametrize(
    "head_dim, group_size, q_dtype, feature",
    [(128, 4, "bfloat16", None), (64, 8, "float16", "alibi_cap_window"),
     (256, 2, "bfloat16", "rope"), (128, 16, "float16", "rope_cap_window")],
)  # fmt: skip
def test_fp8_kv(kv_dtype, head_dim, group_size, q_dtype, feature):
    """fp8 caches with scales; the reference reads the same fp8 values (exactly)."""
    rng = seeded(kv_dtype, head_dim, group_size)
    batch = make_batch(rng, standard_lengths(16, rng), head_dim=head_dim, group_size=group_size,
                       q_dtype=q_dtype, kv_dtype=kv_dtype)  # fmt: skip
    features = FEATURES.get(feature, {})
    o, lse = run_batch(batch, k_scale=0.5, v_scale=2.0, **features)
    check_attention(o, lse, *batch.reference(k_scale=0.5, v_scale=2.0, **features), q_dtype)


def test_run_takes_flashinfer_run_arguments():
    """q_scale multiplies the logits like k_scale (fp8 and 16-bit KV); enable_pdl and the
    plan's own window_left are accepted; plan() takes non_blocking."""
    rng = seeded("run arguments")
    for kv_dtype in ("bfloat16", "float8_e4m3fn"):
        batch = make_batch(rng, [700, 1, 0, 33], kv_dtype=kv_dtype)
        features = FEATURES["alibi_cap_window"]
        run_kwargs = dict(q_scale=0.25, enable_pdl=True, window_left=features["window_left"])
        o, lse = run_batch(batch, k_scale=2.0, v_scale=0.5, run_kwargs=run_kwargs,
                           non_blocking=False, **features)  # fmt: skip
        expect = batch.reference(q_scale=0.25, k_scale=2.0, v_scale=0.5, **features)
        check_attention(o, lse, *expect, "bfloat16")


def test_long_request_with_short_and_empty_ones():
    rng = seeded("long")
    batch = make_batch(rng, [32768, 1, 0, 700, 16], group_size=4)
    o, lse = run_batch(batch)
    check_attention(o, lse, *batch.reference(), "bfloat16")


STALE_CASES = {  # kwargs of make_batch, features, plan options
    "bf16_split": (dict(num_kv_heads=2), {}, {}),
    "fp16_hnd_tuple_window_rope": (
        dict(layout="HND", form="tuple", q_dtype="float16", page_size=128),
        FEATURES["rope_cap_window"], {},
    ),
    "e4m3_window": (dict(kv_dtype="float8_e4m3fn"), FEATURES["window"], {}),
    "e5m2_hnd_whole_requests": (
        dict(kv_dtype="float8_e5m2", layout="HND", group_size=8), {},
        dict(disable_split_kv=True),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(STALE_CASES))
def test_stale_cache_slots_never_reach_the_output(case):
    """NaN in every slot no live token holds (a page's unused tail, unreferenced pages, tokens
    before the window): the kernel must neither read them nor multiply them by a zero
    probability, so the output matches the reference on the clean cache."""
    kwargs, features, options = STALE_CASES[case]
    rng = seeded("stale", case)
    page_size = kwargs.get("page_size", 16)
    lengths = [*standard_lengths(page_size, rng), 5000]
    batch = make_batch(rng, lengths, **kwargs)
    scales = dict(k_scale=0.5, v_scale=2.0) if "kv_dtype" in kwargs else {}
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(kv_layout=batch.layout)
    batch.plan(wrapper, **features, **options)
    cache = poisoned_cache(batch, features.get("window_left", -1))
    o, lse = wrapper.run(batch.q_dev, cache, return_lse=True, **scales)
    check_attention(o, lse, *batch.reference(**scales, **features), batch.q_dtype)


LOOKAHEAD_CASES = {  # pages of at least one tile and items of at least 64 tiles on average
    "bf16_page64": (dict(page_size=64), [9000, 8191, 4100, 0, 8257], None),
    "bf16_page128_hnd_window": (
        dict(page_size=128, layout="HND", group_size=8),
        [9000, 8191, 5000, 1, 8257],
        "window",
    ),
    "e4m3_page128_rope": (
        dict(page_size=128, kv_dtype="float8_e4m3fn"),
        [20000, 16385, 9000, 0, 8300],
        "rope",
    ),
}


@pytest.mark.parametrize("case", list(LOOKAHEAD_CASES))
def test_long_rows_with_one_tile_in_flight(case):
    """Whole long requests in pages of at least one tile: plan() picks the kernel compiled with
    one K/V tile in flight ahead of the one computed instead of its ring's depth - 1."""
    kwargs, lengths, feature = LOOKAHEAD_CASES[case]
    rng = seeded("lookahead", case)
    batch = make_batch(rng, lengths, **kwargs)
    features = FEATURES.get(feature, {})
    scales = dict(k_scale=0.5, v_scale=2.0) if "kv_dtype" in kwargs else {}
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(kv_layout=batch.layout)
    o, lse = run_batch(batch, wrapper, disable_split_kv=True, **scales, **features)
    spec = replace(wrapper._kernel[0], lookahead=1)
    assert wrapper._launch.launch.kernel is kernel(spec)
    check_attention(o, lse, *batch.reference(**scales, **features), batch.q_dtype)


HALF_TILE_CASES = {  # kwargs of make_batch, lengths, feature, plan options
    "e4m3_d128": (
        dict(kv_dtype="float8_e4m3fn"), [1, 15, 16, 17, 513, 0, 4000], None,
        dict(disable_split_kv=True),
    ),
    "e5m2_d64_hnd_group5": (
        dict(kv_dtype="float8_e5m2", head_dim=64, group_size=5, layout="HND", page_size=1),
        [300, 0, 257, 2, 1100], "alibi_cap_window", dict(disable_split_kv=True),
    ),
    "e4m3_auto_40_requests": (  # 40 requests x 8 kv heads fill the GPU, none a straggler
        dict(kv_dtype="float8_e4m3fn", num_kv_heads=8, group_size=4, page_size=16),
        [int(n) for n in np.random.default_rng(7).integers(1700, 3000, 40)], "window", {},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HALF_TILE_CASES))
def test_fp8_whole_requests_with_half_tiles(case):
    """fp8 KV in a plan of one item per request: plan() picks the kernel with tiles of half
    the tokens (decode_kernel.half_tiles), which must match the reference like the default."""
    from rtcinfer.attention.decode_kernel import half_tiles

    kwargs, lengths, feature, options = HALF_TILE_CASES[case]
    batch = make_batch(seeded("half", case), lengths, **kwargs)
    features = FEATURES.get(feature, {})
    scales = dict(k_scale=0.5, v_scale=2.0)
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(kv_layout=batch.layout)
    o, lse = run_batch(batch, wrapper, **options, **scales, **features)
    assert wrapper._launch.launch.grid[1] == len(lengths)  # one work item per request
    assert wrapper._launch.launch.kernel is kernel(half_tiles(wrapper._kernel[0]))
    check_attention(o, lse, *batch.reference(**scales, **features), batch.q_dtype)


def test_a_small_workspace_serves_plans_of_whole_requests():
    """A plan with one item per request writes no partials, so a caller's workspace needs room
    for the plan only: 256 KB serves 300 requests (their partials would take 2.4 MB), and a
    split plan that does not fit says so."""
    import cupy

    rng = seeded("small workspace")
    batch = make_batch(rng, [int(n) for n in rng.integers(0, 300, 300)], num_kv_heads=8,
                       head_dim=64)  # fmt: skip
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(cupy.empty(256 << 10, np.uint8))
    o, lse = run_batch(batch, wrapper)
    assert wrapper._launch.launch.grid[1] == 300  # one item per request
    check_attention(o, lse, *batch.reference(), "bfloat16")
    long = make_batch(rng, [20000], num_kv_heads=8)  # split: >= 16 partials of 32 x 128 floats
    with pytest.raises(ValueError, match="workspace: 262144 bytes .* is too small"):
        long.plan(wrapper)


@pytest.mark.parametrize("head_dim, group_size", [(128, 4), (128, 16), (256, 8), (64, 2)])
@pytest.mark.parametrize("feature", [None, "window"])
def test_merge_of_many_partials(head_dim, group_size, feature):
    """One page per work item: a request merges up to 188 partials, more than the kernel stages
    at once (11-47 per pass), and with a window most of them are empty (lse -inf)."""
    rng = seeded("many", head_dim, group_size, feature)
    batch = make_batch(rng, [3000, 1, 0, 700], head_dim=head_dim, group_size=group_size)
    features = FEATURES.get(feature, {})
    o, lse = run_batch(batch, fixed_split_size=1, **features)
    check_attention(o, lse, *batch.reference(**features), "bfloat16")


def _ulp_close(a, b, dtype_bits: int) -> None:
    """|a - b| <= one ulp of a dtype with `dtype_bits` mantissa bits, of the element or of the
    array's rms: P is rounded to 16 bits before the PV product, and split and unsplit runs round
    it against different running maxima, so small outputs may differ by an ulp of typical ones."""
    a, b = to_host(a), to_host(b)
    finite = np.isfinite(a)
    assert np.array_equal(finite, np.isfinite(b)) and np.array_equal(a[~finite], b[~finite])
    scale = np.sqrt(np.mean(a[finite] ** 2))
    bound = 2.0**-dtype_bits * (np.abs(a[finite]) + scale)
    np.testing.assert_array_less(np.abs(a - b)[finite], bound + 1e-30)


def test_split_on_and_off_agree_to_rounding():
    rng = seeded("split")
    batch = make_batch(rng, [5000, 3000, 1, 700, 0], q_dtype="float16")
    runs = [run_batch(batch), run_batch(batch, disable_split_kv=True)]
    runs.append(run_batch(batch, fixed_split_size=3))
    o_ref, lse_ref = batch.reference()
    for o, lse in runs:
        check_attention(o, lse, o_ref, lse_ref, "float16")
    for o, lse in runs[1:]:
        _ulp_close(o, runs[0][0], 10)
        _ulp_close(lse, runs[0][1], 18)


def test_fixed_split_size_is_bitwise_batch_invariant():
    rng = seeded("invariant")
    pool = make_batch(rng, [2000, 513, 77, 1500, 0, 4096], group_size=4)
    pages = [pool.indices[pool.indptr[b] : pool.indptr[b + 1]] for b in range(6)]

    def run(order):
        lens = np.diff(pool.indptr)[order]
        indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        indices = np.concatenate([pages[b] for b in order]).astype(np.int32)
        wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
        wrapper.plan(indptr, indices, pool.last[order], 8, 2, 128, 16,
                     q_data_type="bfloat16", fixed_split_size=5)  # fmt: skip
        q = to_gpu(np.ascontiguousarray(pool.q[order]))
        o, lse = wrapper.run(q, pool.cache_dev, return_lse=True)
        return {b: (to_host(o[i]), to_host(lse[i])) for i, b in enumerate(order)}

    first, second, again = run([0, 1, 2]), run([3, 2, 0, 4, 1, 5]), run([0, 1, 2])
    for b in (0, 1, 2):
        for x, y in zip(first[b], second[b], strict=True):
            np.testing.assert_array_equal(x, y)
        for x, y in zip(first[b], again[b], strict=True):
            np.testing.assert_array_equal(x, y)


def test_empty_requests_and_empty_batch():
    rng = seeded("empty")
    batch = make_batch(rng, [0, 0, 0])
    o, lse = run_batch(batch)
    assert (to_host(o) == 0).all() and np.isneginf(to_host(lse)).all()
    none = make_batch(rng, [])
    o, lse = run_batch(none)
    assert o.shape == (0, 8, 128) and lse.shape == (0, 8)


def test_out_and_lse_arguments_are_written_in_place():
    import cupy

    rng = seeded("out")
    batch = make_batch(rng, standard_lengths(16, rng))
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    batch.plan(wrapper)
    out = cupy.full((8, 8, 128), np.nan, dtype=batch.q.dtype)
    lse = cupy.full((8, 8), np.nan, dtype=np.float32)
    result = wrapper.run(batch.q_dev, batch.cache_dev, out=out, lse=lse, return_lse=True)
    assert result[0] is out and result[1] is lse
    check_attention(out, lse, *batch.reference(), "bfloat16")
    assert wrapper.run(batch.q_dev, batch.cache_dev) is not out  # o only


def test_one_wrapper_across_configurations():
    """plan() reuses its configuration only for identical arguments (1 and 1.0 differ)."""
    rng = seeded("reconfigure")
    batch = make_batch(rng, standard_lengths(16, rng))
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    for features in ({}, FEATURES["window"], {}, dict(sm_scale=1), dict(sm_scale=1.0)):
        o, lse = run_batch(batch, wrapper, **features)
        check_attention(o, lse, *batch.reference(**features), "bfloat16")
    with pytest.raises(TypeError):
        batch.plan(wrapper, sm_scale=np.array([1.0, 2.0]))


def test_run_validates_against_the_plan():
    import cupy

    rng = seeded("errors")
    batch = make_batch(rng, [20, 3])
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    with pytest.raises(RuntimeError, match="plan"):
        wrapper.run(batch.q_dev, batch.cache_dev)
    batch.plan(wrapper)
    with pytest.raises(ValueError, match="q: expected shape"):
        wrapper.run(batch.q_dev[:1], batch.cache_dev)
    with pytest.raises(ValueError, match="pages"):
        wrapper.run(batch.q_dev, batch.cache_dev[:2])  # page ids beyond the cache
    with pytest.raises(ValueError, match="dtype bfloat16"):  # a float16 view of the cache
        wrapper.run(batch.q_dev, batch.cache_dev.view(np.float16))
    shifted = cupy.zeros(batch.cache_dev.size + 1, dtype=batch.cache_dev.dtype)
    misaligned = shifted[1:].reshape(batch.cache_dev.shape)  # 2 bytes off a 16-byte boundary
    with pytest.raises(ValueError, match="16-byte aligned"):
        wrapper.run(batch.q_dev, misaligned)
    out = cupy.empty((2, 8, 256), dtype=batch.q_dev.dtype)[..., ::2]  # every other element
    with pytest.raises(ValueError, match="contiguous in their last dimension"):
        wrapper.run(batch.q_dev, batch.cache_dev, out=out)
    with pytest.raises(ValueError, match="contiguous in their last dimension"):
        wrapper.run(batch.q_dev, batch.cache_dev, out=cupy.empty_like(batch.q_dev)[..., ::-1])
    with pytest.raises(ValueError, match="must be a multiple of num_kv_heads"):
        wrapper.plan(batch.indptr, batch.indices, batch.last, 9, 2, 128, 16)
    with pytest.raises(ValueError, match=r"kv_last_page_len\[0\]"):
        wrapper.plan(batch.indptr, batch.indices, [17, 3], 8, 2, 128, 16)
    with pytest.raises(ValueError, match="indices must have"):
        wrapper.plan(batch.indptr, batch.indices[:-1], batch.last, 8, 2, 128, 16)


@pytest.mark.parametrize("kv_len", [0, 1, 100, 5000])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_single_decode(kv_len, kv_layout):
    rng = seeded("single", kv_len, kv_layout)
    shape = (kv_len, 2, 128) if kv_layout == "NHD" else (2, kv_len, 128)
    q = random_values(rng, (8, 128), "bfloat16")
    k, v = random_values(rng, shape, "bfloat16"), random_values(rng, shape, "bfloat16")
    o, lse = rtcinfer.single_decode_with_kv_cache(
        to_gpu(q), to_gpu(k), to_gpu(v), kv_layout=kv_layout, return_lse=True
    )
    o_ref, lse_ref = aref.single_decode_ref(q, k, v, kv_layout=kv_layout, return_lse=True)
    check_attention(o, lse, o_ref, lse_ref, "bfloat16")


def test_single_decode_without_lse_returns_o_when_nothing_splits():
    """A short cache (one page, one work item: no split scratch) without lse: the call returns
    o itself, [Hq, D] (a lone output once came back indexed by its first row)."""
    rng = seeded("single short")
    q = random_values(rng, (8, 128), "bfloat16")
    k, v = (random_values(rng, (20, 2, 128), "bfloat16") for _ in range(2))
    o = rtcinfer.single_decode_with_kv_cache(to_gpu(q), to_gpu(k), to_gpu(v))
    assert tuple(o.shape) == (8, 128)
    assert_close(o, aref.single_decode_ref(q, k, v), "bfloat16")


def test_single_decode_features():
    rng = seeded("single features")
    q = random_values(rng, (16, 64), "float16")
    k, v = (
        random_values(rng, (3000, 4, 64), "float16"),
        random_values(rng, (3000, 4, 64), "float16"),
    )
    kwargs = dict(pos_encoding_mode="ROPE_LLAMA", q_scale=1.5, k_scale=0.7, v_scale=2.0,
                  window_left=1000, logits_soft_cap=4.0, rope_theta=5e5)  # fmt: skip
    o = rtcinfer.single_decode_with_kv_cache(to_gpu(q), to_gpu(k), to_gpu(v), **kwargs)
    assert_close(o, aref.single_decode_ref(q, k, v, **kwargs), "float16")
    # q_scale 0 (not None): every logit is 0, so o is the mean of v over the window
    zero = dict(q_scale=0.0, window_left=99)
    o = rtcinfer.single_decode_with_kv_cache(to_gpu(q), to_gpu(k), to_gpu(v), **zero)
    assert_close(o, aref.single_decode_ref(q, k, v, **zero), "float16")
    mean = v[-100:].astype(np.float64).mean(axis=0).repeat(4, axis=0)  # 4 query heads per kv head
    assert_close(o, mean, "float16")


def test_memcheck_subset():
    """A small run of every code path (split merge, fp8, RoPE, ALiBi, page 1, HND tuple),
    sized for compute-sanitizer: pytest -m gpu -k memcheck."""
    rng = seeded("memcheck")
    for kwargs, features in [
        (dict(page_size=1, group_size=8), {}),
        (dict(layout="HND", form="strided_tuple", kv_dtype="float8_e4m3fn"), FEATURES["rope"]),
        (dict(head_dim=64, group_size=16), FEATURES["alibi_cap_window"]),
    ]:
        batch = make_batch(rng, [600, 1, 0, 17], **kwargs)
        o, lse = run_batch(batch, **features)
        check_attention(o, lse, *batch.reference(**features), "bfloat16")
