"""RoPE against the float64 reference (GPU): ragged and pos_ids forms, Llama 3.1, cos/sin cache."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from tests import reference as ref
from tests.checks import assert_close, to_host
from tests.gpu import randn, upload

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16", "float32"]


def ragged(rng, lengths):
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    offsets = rng.integers(0, 40000, len(lengths)).astype(np.int32)
    return indptr, offsets


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_dim,rotary_dim", [(128, 128), (64, 32), (256, 256), (96, 96), (512, 512)]
)
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rope(rng, dtype, head_dim, rotary_dim, interleave, inplace):
    indptr, offsets = ragged(rng, [1, 0, 17, 300, 5])
    nnz = int(indptr[-1])
    q, k = randn(rng, (nnz, 6, head_dim), dtype), randn(rng, (nnz, 2, head_dim), dtype)
    qd, kd = upload(q), upload(k)
    kwargs = dict(rotary_dim=rotary_dim, interleave=interleave, rope_scale=2.0, rope_theta=5e5)
    fn = rtcinfer.apply_rope_inplace if inplace else rtcinfer.apply_rope
    q_out, k_out = fn(qd, kd, upload(indptr), upload(offsets), **kwargs)
    assert (q_out is qd) == inplace
    pos = ref.positions_from_indptr(indptr, offsets)
    inv = ref.rope_inv_freq(rotary_dim, 2.0, 5e5)
    assert_close(q_out, ref.rope_ref(q, pos, rotary_dim, interleave, inv), dtype, "q")
    assert_close(k_out, ref.rope_ref(k, pos, rotary_dim, interleave, inv), dtype, "k")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pos_dtype", ["int32", "int64"])
@pytest.mark.parametrize("llama31", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rope_pos_ids(rng, dtype, pos_dtype, llama31, inplace):
    nnz = 1000
    pos = rng.integers(0, 131072, nnz).astype(pos_dtype)  # angles far beyond 2 pi
    q_full = randn(rng, (nnz, 8, 2 * 128), dtype)
    q, k = q_full[:, :, :128], randn(rng, (nnz, 1, 128), dtype)
    qd, kd = upload(q_full)[:, :, :128], upload(k)  # q strided per token and per head
    name = ("apply_llama31_rope_pos_ids" if llama31 else "apply_rope_pos_ids") + (
        "_inplace" if inplace else ""
    )
    q_out, k_out = getattr(rtcinfer, name)(qd, kd, upload(pos))
    inv = ref.llama31_inv_freq(128) if llama31 else ref.rope_inv_freq(128)
    assert_close(q_out, ref.rope_ref(q, pos, 128, False, inv), dtype, "q")
    assert_close(k_out, ref.rope_ref(k, pos, 128, False, inv), dtype, "k")


def test_apply_llama31_rope_ragged(rng):
    indptr, offsets = ragged(rng, [5, 1, 1000])
    nnz = int(indptr[-1])
    q, k = randn(rng, (nnz, 4, 128), "bfloat16"), randn(rng, (nnz, 4, 128), "bfloat16")
    params = dict(rope_scale=32.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
                  old_context_len=8192)  # fmt: skip
    q_out, k_out = rtcinfer.apply_llama31_rope(
        upload(q), upload(k), upload(indptr), upload(offsets), **params
    )
    pos = ref.positions_from_indptr(indptr, offsets)
    inv = ref.llama31_inv_freq(128, **params)
    assert_close(q_out, ref.rope_ref(q, pos, 128, False, inv), "bfloat16", "q")
    assert_close(k_out, ref.rope_ref(k, pos, 128, False, inv), "bfloat16", "k")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("rotary_dim", [128, 64])
def test_cos_sin_cache(rng, dtype, is_neox, inplace, rotary_dim):
    nnz, hq, hk, d = 77, 8, 2, 128
    cache = rng.standard_normal((4096, rotary_dim)).astype(np.float32)
    pos = rng.integers(0, 4096, nnz).astype(np.int64)
    q, k = randn(rng, (nnz, hq * d), dtype), randn(rng, (nnz, hk * d), dtype)
    fn = (
        rtcinfer.apply_rope_with_cos_sin_cache_inplace
        if inplace
        else rtcinfer.apply_rope_with_cos_sin_cache
    )
    q_out, k_out = fn(upload(pos), upload(q), upload(k), d, upload(cache), is_neox=is_neox)
    expect_q = ref.rope_cos_sin_cache_ref(q.reshape(nnz, hq, d), pos, cache, not is_neox)
    expect_k = ref.rope_cos_sin_cache_ref(k.reshape(nnz, hk, d), pos, cache, not is_neox)
    assert_close(q_out, expect_q.reshape(nnz, hq * d), dtype, "q")
    assert_close(k_out, expect_k.reshape(nnz, hk * d), dtype, "k")


@pytest.mark.parametrize("inplace", [False, True])
def test_a_position_outside_the_cos_sin_cache_reads_no_row(rng, inplace):
    """Positions past the table or negative: those tokens pass through unrotated while the
    others rotate, no row past the table is read (rows of NaN follow it in memory), and the
    next call raises BadIndexError naming the first; then nothing is left to raise."""
    import contextlib

    import cupy

    with contextlib.suppress(rtcinfer.BadIndexError):  # nothing left from earlier tests
        rtcinfer.check_errors()
    max_pos, d = 64, 128
    table = rng.standard_normal((max_pos, d)).astype(np.float32)
    whole = cupy.full((max_pos + 8, d), np.nan, dtype=cupy.float32)
    whole[:max_pos] = upload(table)
    pos = np.array([0, 5, max_pos, 63, -1, max_pos + 7, 2**40], np.int64)
    good = (pos >= 0) & (pos < max_pos)
    q, k = randn(rng, (len(pos), 4, d), "float32"), randn(rng, (len(pos), 1, d), "float32")
    fn = (rtcinfer.apply_rope_with_cos_sin_cache_inplace if inplace
          else rtcinfer.apply_rope_with_cos_sin_cache)  # fmt: skip
    q_out, k_out = fn(upload(pos), upload(q), upload(k), d, whole[:max_pos])
    cupy.cuda.Device().synchronize()
    for got, x in ((q_out, q), (k_out, k)):
        expect = ref.rope_cos_sin_cache_ref(x[good], pos[good], table)
        assert_close(to_host(got)[good], expect, "float32")
        np.testing.assert_array_equal(to_host(got)[~good], x[~good])  # unrotated, not NaN
    shown = np.clip(pos, -(2**31), 2**31 - 1)  # the record holds ints
    first = r"positions\[(" + "|".join(rf"{i}\] = {shown[i]}" for i in np.flatnonzero(~good))
    first += r") is not a row "
    with pytest.raises(rtcinfer.BadIndexError, match=r"^apply_rope_with_cos_sin_cache: " + first +
                       r"of cos_sin_cache \(0 <= position < 64\); its token passed through "
                       r"unrotated, no row read$"):  # fmt: skip
        fn(upload(pos[good]), upload(q[good]), upload(k[good]), d, whole[:max_pos])
    assert rtcinfer.check_errors() is None


def test_out_arrays_are_written(rng):
    from tests.gpu import poisoned

    pos = rng.integers(0, 5000, 50).astype(np.int64)
    q, k = randn(rng, (50, 4, 64), "float16"), randn(rng, (50, 1, 64), "float16")
    outs = (poisoned((50, 4, 64), "float16"), poisoned((50, 1, 64), "float16"))
    got = rtcinfer.apply_rope_pos_ids(upload(q), upload(k), upload(pos), out=outs)
    assert got[0] is outs[0] and got[1] is outs[1]
    inv = ref.rope_inv_freq(64)
    assert_close(outs[0], ref.rope_ref(q, pos, 64, False, inv), "float16", "q")
    assert_close(outs[1], ref.rope_ref(k, pos, 64, False, inv), "float16", "k")


def test_large_batch(rng):
    nnz = 16384
    pos = np.arange(nnz, dtype=np.int32)
    q, k = randn(rng, (nnz, 32, 128), "bfloat16"), randn(rng, (nnz, 8, 128), "bfloat16")
    q_out, k_out = rtcinfer.apply_rope_pos_ids(upload(q), upload(k), upload(pos))
    inv = ref.rope_inv_freq(128)
    assert_close(q_out, ref.rope_ref(q, pos, 128, False, inv), "bfloat16", "q")
    assert_close(k_out, ref.rope_ref(k, pos, 128, False, inv), "bfloat16", "k")


def test_strided_positions_and_cache(rng):
    """pos_ids, indptr / offsets and the cos/sin table are read as dense arrays: strided views
    of them are made dense first."""
    nnz, d = 40, 64
    q, k = randn(rng, (nnz, 2, d), "float16"), randn(rng, (nnz, 1, d), "float16")
    pos = rng.integers(0, 1000, (nnz, 2)).astype(np.int32)  # column 0 is the positions
    q_out, k_out = rtcinfer.apply_rope_pos_ids(upload(q), upload(k), upload(pos)[:, 0])
    inv = ref.rope_inv_freq(d)
    assert_close(q_out, ref.rope_ref(q, pos[:, 0], d, False, inv), "float16", "q")
    assert_close(k_out, ref.rope_ref(k, pos[:, 0], d, False, inv), "float16", "k")
    wide = rng.standard_normal((1000, 2 * d)).astype(np.float32)  # the table is wide[:, :d]
    q_out, _ = rtcinfer.apply_rope_with_cos_sin_cache(
        upload(pos)[:, 0], upload(q), upload(k), d, upload(wide)[:, :d]
    )
    assert_close(q_out, ref.rope_cos_sin_cache_ref(q, pos[:, 0], wide[:, :d]), "float16", "q")
    indptr = upload(np.array([0, -1, 15, -1, 40], np.int32))[::2]  # [0, 15, 40], strided
    offsets = upload(np.array([7, -1, 100], np.int32))[::2]  # [7, 100]
    q_out, _ = rtcinfer.apply_rope(upload(q), upload(k), indptr, offsets)
    ragged = np.concatenate([7 + np.arange(15), 100 + np.arange(25)])
    assert_close(q_out, ref.rope_ref(q, ragged, d, False, inv), "float16", "q")


def test_errors(rng):
    q, k = upload(randn(rng, (4, 2, 64), "bfloat16")), upload(randn(rng, (4, 2, 64), "bfloat16"))
    with pytest.raises(ValueError, match="rotary_dim"):
        rtcinfer.apply_rope_pos_ids(q, k, upload(np.arange(4, dtype=np.int32)), rotary_dim=66)
    with pytest.raises(TypeError, match="int32 or int64"):
        rtcinfer.apply_rope_pos_ids(q, k, upload(np.arange(4, dtype=np.float32)))
