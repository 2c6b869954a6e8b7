"""append_paged_kv_cache, get_seq_lens and get_batch_indices_positions (GPU), and decode after
an append equals decode over the concatenated sequences."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import rtcinfer
from rtcinfer.plan import page as host_page

from . import reference_attention as aref
from .checks import to_host
from .gpu_decode import check_attention, make_batch, random_values, run_batch, to_gpu

pytestmark = pytest.mark.gpu


def test_seq_lens_and_positions_match_numpy(rng):
    indptr = np.array([0, 3, 3, 7, 8], dtype=np.int32)
    last = np.array([5, 0, 16, 1], dtype=np.int32)
    seq_lens = rtcinfer.get_seq_lens(to_gpu(indptr), to_gpu(last), 16)
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        rtcinfer.get_seq_lens(to_gpu(indptr), to_gpu(last), 0)
    want = host_page.get_seq_lens(indptr, last, 16)
    np.testing.assert_array_equal(to_host(seq_lens), want)
    strided = to_gpu(np.stack([last, -last], axis=1))[:, 0]  # every other int: made dense
    np.testing.assert_array_equal(to_host(rtcinfer.get_seq_lens(to_gpu(indptr), strided, 16)),
                                  want)  # fmt: skip
    assert isinstance(rtcinfer.get_seq_lens(indptr, last, 16), np.ndarray)  # host path
    append_indptr = np.array([0, 2, 2, 7, 8], dtype=np.int32)
    nnz = 11  # padded: 3 entries past append_indptr[-1]
    bi, pos = rtcinfer.get_batch_indices_positions(to_gpu(append_indptr), seq_lens, nnz)
    want_bi, want_pos = host_page.get_batch_indices_positions(append_indptr, want, nnz)
    np.testing.assert_array_equal(to_host(bi), want_bi)
    np.testing.assert_array_equal(to_host(pos), want_pos)
    # the caller's buffers (FlashInfer's preallocated outputs): written and returned
    given = to_gpu(np.full(nnz, 99, np.int32)), to_gpu(np.full(nnz, 99, np.int32))
    bi, pos = rtcinfer.get_batch_indices_positions(to_gpu(append_indptr), seq_lens, nnz, *given)
    assert bi is given[0] and pos is given[1]
    np.testing.assert_array_equal(to_host(bi), want_bi)
    np.testing.assert_array_equal(to_host(pos), want_pos)
    with pytest.raises(ValueError, match=r"batch_indices: expected a contiguous int32 array of "
                                         r"shape \(11,\), got int32 of shape \(10,\)"):  # fmt: skip
        rtcinfer.get_batch_indices_positions(to_gpu(append_indptr), seq_lens, nnz,
                                             to_gpu(np.zeros(10, np.int32)))  # fmt: skip


CASES = [
    dict(layout="NHD", form="5d"),
    dict(layout="HND", form="tuple"),
    dict(layout="NHD", form="strided", kv_dtype="float8_e4m3fn"),
    dict(layout="HND", form="strided_tuple", head_dim=64, page_size=1),
    dict(layout="NHD", form="5d", head_dim=256, page_size=128, q_dtype="float16"),
]


@pytest.mark.parametrize(
    "case", range(len(CASES)), ids=lambda i: "-".join(map(str, CASES[i].values()))
)
def test_append_then_decode(case):
    """Append 0-16 tokens to requests of awkward lengths, then decode: the cache must equal the
    reference append (bit for bit) and decode must equal decode over the longer sequences."""
    kwargs = CASES[case]
    rng = np.random.default_rng(case)
    page_size = kwargs.get("page_size", 16)
    before = [0, 1, page_size - 1, page_size, 513, 40]
    added = [3, 1, 1, 16, 1, 0]
    after = [b + a for b, a in zip(before, added, strict=True)]
    batch = make_batch(rng, after, **kwargs)
    append_indptr = np.concatenate([[0], np.cumsum(added)]).astype(np.int32)
    nnz = int(append_indptr[-1])
    seq_lens = rtcinfer.get_seq_lens(to_gpu(batch.indptr), to_gpu(batch.last), page_size)
    bi, pos = rtcinfer.get_batch_indices_positions(to_gpu(append_indptr), seq_lens, nnz)
    heads, dim, dtype = batch.num_kv_heads, batch.head_dim, batch.kv_dtype
    keys, values = (random_values(rng, (nnz, heads, dim), dtype) for _ in range(2))
    expected = aref.append_paged_kv_cache_ref(
        keys, values, to_host(bi).astype(np.int32), to_host(pos).astype(np.int32), batch.cache,
        batch.indices, batch.indptr, batch.last, batch.layout,
    )  # fmt: skip
    table = [to_gpu(x) for x in (batch.indices, batch.indptr, batch.last)]
    result = rtcinfer.append_paged_kv_cache(
        to_gpu(keys), to_gpu(values), bi, pos, batch.cache_dev, *table, kv_layout=batch.layout
    )
    pairs = [(batch.cache_dev, expected)]
    if isinstance(expected, tuple):
        assert all(r is c for r, c in zip(result, batch.cache_dev, strict=True))
        pairs = list(zip(batch.cache_dev, expected, strict=True))
    else:
        assert result is batch.cache_dev
    for got, want in pairs:  # fp8 travels as its bytes on the CuPy side
        want = want.view(np.uint8) if dtype.startswith("float8") else want
        np.testing.assert_array_equal(to_host(got), want.astype(np.float64))
    after_batch = dataclasses.replace(batch, cache=expected)
    o, lse = run_batch(after_batch)
    check_attention(o, lse, *after_batch.reference(), batch.q_dtype)


def _append_matches_reference(batch, keys, values, bi, pos):
    """append_paged_kv_cache of host rows into the batch's device cache (NHD, 5-D) equals the
    float64 reference append, bit for bit."""
    expected = aref.append_paged_kv_cache_ref(
        keys, values, bi, pos, batch.cache, batch.indices, batch.indptr, batch.last
    )
    table = [to_gpu(x) for x in (batch.indices, batch.indptr, batch.last)]
    rtcinfer.append_paged_kv_cache(to_gpu(keys), to_gpu(values), to_gpu(bi), to_gpu(pos),
                                   batch.cache_dev, *table)  # fmt: skip
    np.testing.assert_array_equal(to_host(batch.cache_dev), expected.astype(np.float64))


def test_append_bandwidth_shapes_run(rng):
    """The bench shapes (256 x 1 and 16 x 1024 tokens) run and write the right rows."""
    for lengths, added in (([100] * 256, 1), ([1100] * 16, 1024)):
        batch = make_batch(rng, lengths, num_kv_heads=8, group_size=1)
        append_indptr = np.arange(len(lengths) + 1, dtype=np.int32) * added
        bi, pos = host_page.get_batch_indices_positions(append_indptr, lengths, append_indptr[-1])
        keys = random_values(rng, (int(append_indptr[-1]), 8, 128), "bfloat16")
        _append_matches_reference(batch, keys, keys, bi, pos)


@pytest.mark.parametrize("added", [1, 3])
def test_append_skips_padding_and_takes_tokens_in_any_order(rng, added):
    """Uniform appends in order, shuffled and padded past append_indptr[-1] with (-1, -1) rows,
    which write nothing: the cache equals the reference append bit for bit every time."""
    lengths = [37, 16, 5, 64, 1 + added, 300]
    append_indptr = np.arange(len(lengths) + 1, dtype=np.int32) * added
    nnz = int(append_indptr[-1])
    for order in ("in order", "shuffled", "padded"):
        batch = make_batch(rng, lengths)
        rows = nnz + 5 if order == "padded" else nnz
        bi, pos = host_page.get_batch_indices_positions(append_indptr, lengths, rows)
        keys, values = (random_values(rng, (rows, 2, 128), "bfloat16") for _ in range(2))
        if order == "shuffled":
            perm = rng.permutation(rows)
            bi, pos, keys, values = bi[perm], pos[perm], keys[perm], values[perm]
        assert (bi[nnz:] == -1).all() and (pos[nnz:] == -1).all()
        _append_matches_reference(batch, keys, values, bi, pos)


@pytest.mark.parametrize("table_dtype, rows_dtype",
                         [("int64", "int32"), ("int32", "int64"), ("int64", "int64")])  # fmt: skip
def test_int64_index_arrays(rng, table_dtype, rows_dtype):
    """int64 page tables (PyTorch's default integer) and int64 batch_indices / positions, each
    group of one type, as FlashInfer takes them: the index ops and the append equal the int32
    results and the reference append bit for bit, padding rows included."""
    lengths, added = [37, 16, 5, 64, 300], 3
    append_indptr = np.arange(len(lengths) + 1) * added
    nnz = int(append_indptr[-1]) + 4  # padded
    batch = make_batch(rng, lengths)
    seq_lens = rtcinfer.get_seq_lens(to_gpu(batch.indptr.astype(table_dtype)),
                                     to_gpu(batch.last.astype(table_dtype)), 16)  # fmt: skip
    assert to_host(seq_lens).tolist() == lengths
    assert str(seq_lens.dtype) == table_dtype
    bi, pos = rtcinfer.get_batch_indices_positions(to_gpu(append_indptr.astype(table_dtype)),
                                                   seq_lens, nnz)  # fmt: skip
    want_bi, want_pos = host_page.get_batch_indices_positions(append_indptr, lengths, nnz)
    np.testing.assert_array_equal(to_host(bi), want_bi)
    np.testing.assert_array_equal(to_host(pos), want_pos)
    keys, values = (random_values(rng, (nnz, 2, 128), "bfloat16") for _ in range(2))
    expected = aref.append_paged_kv_cache_ref(
        keys, values, want_bi, want_pos, batch.cache, batch.indices, batch.indptr, batch.last
    )
    table = [to_gpu(x.astype(table_dtype)) for x in (batch.indices, batch.indptr, batch.last)]
    rtcinfer.append_paged_kv_cache(to_gpu(keys), to_gpu(values),
                                   to_gpu(want_bi.astype(rows_dtype)),
                                   to_gpu(want_pos.astype(rows_dtype)), batch.cache_dev,
                                   *table)  # fmt: skip
    np.testing.assert_array_equal(to_host(batch.cache_dev), expected.astype(np.float64))
    with pytest.raises(TypeError, match="batch_indices and positions must be both int32"):
        rtcinfer.append_paged_kv_cache(to_gpu(keys), to_gpu(values),
                                       to_gpu(want_bi.astype(np.int64)),
                                       to_gpu(want_pos.astype(np.int32)), batch.cache_dev,
                                       *table)  # fmt: skip


def test_append_rejects_mismatched_rows(rng):
    batch = make_batch(rng, [10, 3])
    keys = to_gpu(random_values(rng, (2, 2, 128), "bfloat16"))
    idx = to_gpu(np.zeros(2, np.int32))
    table = [to_gpu(x) for x in (batch.indices, batch.indptr, batch.last)]
    with pytest.raises(ValueError, match="append_key: expected"):
        rtcinfer.append_paged_kv_cache(keys[:, :, :64], keys, idx, idx, batch.cache_dev, *table)
    with pytest.raises(TypeError, match="int32"):
        rtcinfer.append_paged_kv_cache(keys, keys, idx.astype(np.int64), idx, batch.cache_dev,
                                       *table)  # fmt: skip
    with pytest.raises(ValueError, match=r"kv_indptr must have shape \(3,\), got \(2,\)"):
        rtcinfer.append_paged_kv_cache(keys, keys, idx, idx, batch.cache_dev, table[0],
                                       table[1][:2], table[2])  # fmt: skip
    import cupy

    wide = cupy.zeros(batch.cache_dev.shape[:-1] + (256,), dtype=batch.cache_dev.dtype)
    with pytest.raises(ValueError, match="paged_kv_cache: head_dim must be contiguous"):
        rtcinfer.append_paged_kv_cache(keys, keys, idx, idx, wide[..., ::2], *table)
    k_cache, v_cache = batch.cache_dev[:, 0], batch.cache_dev[:, 1]
    with pytest.raises(ValueError, match="pair must be two"):
        rtcinfer.append_paged_kv_cache(keys, keys, idx, idx, (k_cache, v_cache[:1, ..., :64]),
                                       *table)  # fmt: skip
