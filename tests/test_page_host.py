"""append_paged_kv_cache and the index ops without a GPU: the argument checks of each call
signature (the ops' prepare step, on host arrays taken as device ones), the launch each
signature prepares, and how bad entries the device reports are raised (the device's record
faked in host memory)."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from rtcinfer import errors
from rtcinfer.attention import page
from rtcinfer.errors import BadIndex
from rtcinfer.interop import ArrayInfo
from rtcinfer.interop.dtypes import normalize

from .fakes import FakeRecords, fake_gpu, launched


@pytest.fixture(autouse=True)
def records(monkeypatch):
    """The devices' records of bad entries, in host memory."""
    return FakeRecords(monkeypatch)


def info(x) -> ArrayInfo:
    """A host array as prepare sees a device array (strides in elements)."""
    return ArrayInfo(x.shape, tuple(s // x.itemsize for s in x.strides), normalize(x.dtype), 0)


def prepare(op, arrays, static, align=16):
    """What call() does for a new signature, with host arrays seen as device arrays whose
    addresses are all aligned to `align` bytes (at most 16)."""
    infos = [x if isinstance(x, ArrayInfo) or x is None else info(x) for x in arrays]
    infos = [i if i is None else i._replace(offset=align % 16) for i in infos]
    return op.prepare(infos, align, static)


def _table():
    indices = np.arange(3, dtype=np.int32)
    indptr = np.array([0, 2, 3], dtype=np.int32)
    last = np.array([5, 1], dtype=np.int32)
    return indices, indptr, last


@pytest.mark.parametrize(
    "v_cache",
    [
        np.zeros((1, 16, 2, 128), np.float16),  # fewer pages
        np.zeros((3, 16, 2, 128), np.float32),  # another dtype
        np.zeros((3, 2, 16, 2, 128), np.float16),  # a 5-D cache in a pair
    ],
)  # fmt: skip
def test_a_kv_pair_must_match(v_cache):
    keys = np.zeros((2, 2, 128), np.float16)
    idx = np.zeros(2, np.int32)
    k_cache = np.zeros((3, 16, 2, 128), np.float16)
    with pytest.raises(ValueError, match="pair must be two .* of one dtype and shape but for"):
        prepare(page._APPEND_PAIR, (keys, keys, idx, idx, k_cache, v_cache, *_table()), ("NHD",))


def test_a_kv_pair_is_two_arrays():
    """Checked by the public function itself, before any array is looked at as a device one."""
    keys = np.zeros((2, 2, 128), np.float16)
    idx = np.zeros(2, np.int32)
    k_cache = np.zeros((3, 16, 2, 128), np.float16)
    with pytest.raises(ValueError, match=r"pair must be .* got \[\(\(3, 16, 2, 128\), 'float16'"):
        rtcinfer.append_paged_kv_cache(keys, keys, idx, idx, [k_cache] * 3, *_table())
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        rtcinfer.append_paged_kv_cache(keys, keys, idx, idx, [k_cache], *_table(), kv_layout="X")


def test_the_table_shapes_must_match():
    keys = np.zeros((2, 2, 128), np.float16)
    idx = np.zeros(2, np.int32)
    cache = np.zeros((3, 2, 16, 2, 128), np.float16)
    indices, indptr, last = _table()
    with pytest.raises(ValueError, match=r"kv_indptr must have shape \(2,\), got \(3,\)"):
        prepare(page._APPEND, (keys, keys, idx, idx, cache, indices, indptr, last[:1]), ("NHD",))
    with pytest.raises(
        TypeError,
        match="batch_indices and positions must be both int32 or both "
        "int64 .*, got batch_indices int64, positions int32",
    ):
        prepare(page._APPEND, (keys, keys, idx.astype(np.int64), idx, cache, *_table()), ("NHD",))
    with pytest.raises(TypeError, match=r"kv_indices, kv_indptr and kv_last_page_len must be all "
                                        r"int32 or all int64 \(device index arrays\), got "
                                        r"kv_indices int32, kv_indptr int16"):  # fmt: skip
        prepare(page._APPEND, (keys, keys, idx, idx, cache, indices, indptr.astype(np.int16),
                               last), ("NHD",))  # fmt: skip


def test_index_arrays_of_int64_pick_their_kernel(monkeypatch):
    """int64 page tables and int64 batch_indices / positions (each group of one type; the
    positions get_batch_indices_positions gives are int32) select kernels compiled for them;
    the index ops take int64 too, get_seq_lens keeping the dtype."""
    keys = np.zeros((2, 2, 128), np.float16)
    cache = np.zeros((3, 2, 16, 2, 128), np.float16)
    table32 = _table()
    table64 = [x.astype(np.int64) for x in table32]
    for rows, table in [(np.int32, table64), (np.int64, table32), (np.int64, table64)]:
        idx = np.zeros(2, rows)
        prep = prepare(page._APPEND, (keys, keys, idx, idx, cache, *table), ("NHD",))
        launch, _ = launched(monkeypatch, prep, [0x100 * (i + 1) for i in range(8)] + [0x10000])
        spec = launch.kernel.spec
        assert (spec.index_dtype, spec.row_index_dtype) == (table[0].dtype.name, idx.dtype.name)
    indptr, last = table64[1], table64[2]
    prep = prepare(page._SEQ_LENS, (indptr, last), ())
    assert prep.outs[0].dtype == "int64"
    prep = prepare(page._POSITIONS, (indptr, last, None, None), (5,))
    assert [o.dtype for o in prep.outs] == ["int32", "int32"]


def _append_5d(cache, kv_layout="NHD", key_dtype=None):
    """The prepared append of 6 tokens (2 heads, d 128) into a 5-D cache, the table of 3
    requests."""
    nnz, batch = 6, 3
    key = ArrayInfo((nnz, 2, 128), (256, 128, 1), key_dtype or cache.dtype, 0)
    index = ArrayInfo((nnz,), (1,), "int32", 0)
    table = [ArrayInfo((10,), (1,), "int32", 0), ArrayInfo((batch + 1,), (1,), "int32", 0)]
    last = ArrayInfo((batch,), (1,), "int32", 0)
    return prepare(page._APPEND, (key, key, index, index, cache, *table, last), (kv_layout,))


def test_append_refuses_a_cache_with_a_strided_head_dim():
    strides = (2 * 16 * 2 * 256, 16 * 2 * 256, 2 * 256, 256, 2)  # every other element of d
    cache = ArrayInfo((10, 2, 16, 2, 128), strides, "bfloat16", 0)
    got = r"strides \(32768, 16384, 1024, 512, 4\) \(bytes\)"
    with pytest.raises(ValueError, match="paged_kv_cache: head_dim must be contiguous, got " + got):
        _append_5d(cache)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_append_into_a_5d_cache(monkeypatch, kv_layout):
    """K and V of one [pages, 2, ...] cache: V is one step of dim 1 past K, strides in bytes,
    the index arrays made dense first, the cache updated through the output pointer."""
    if kv_layout == "NHD":
        cache = ArrayInfo((10, 2, 16, 2, 128), (8192, 4096, 256, 128, 1), "bfloat16", 0)
    else:
        cache = ArrayInfo((10, 2, 2, 16, 128), (8192, 4096, 2048, 128, 1), "bfloat16", 0)
    prep = _append_5d(cache, kv_layout)
    assert [(o.source, o.alias) for o in prep.outs] == [(4, True)]
    assert prep.dense == ()  # contiguous index arrays: nothing to copy
    launch, p = launched(monkeypatch, prep, [0x100 * (i + 1) for i in range(8)] + [0x10000])
    assert (p["key"], p["value"]) == (0x100, 0x200)
    assert (p["batch_indices"], p["positions"]) == (0x300, 0x400)
    assert (p["kv_indices"], p["kv_indptr"], p["kv_last_page_len"]) == (0x600, 0x700, 0x800)
    assert (p["k_cache"], p["v_cache"]) == (0x10000, 0x10000 + 4096 * 2)
    assert (p["batch_size"], p["num_indices"], p["num_pages"]) == (3, 10, 10)  # the bounds
    rec = errors.record(0)
    assert (p["bad"], p["bad_host"]) == (rec.device_ptr, rec.host_ptr)
    token, head = (512, 256) if kv_layout == "NHD" else (256, 4096)
    assert (p["kp"], p["kt"], p["kh"]) == (p["vp"], p["vt"], p["vh"]) == (16384, token, head)
    assert (p["key_token"], p["key_head"]) == (p["value_token"], p["value_head"]) == (512, 256)
    assert launch.kernel.spec == page.PageSpec(256, 16) and p["units"] == 6 * 2 * 16
    assert (p["num_heads"], p["page_size"]) == (2, 16)
    assert launch.grid == (1, 1, 1)


def test_fp8_caches_as_their_bytes_or_by_name():
    """CuPy holds fp8 as uint8 storage; PyTorch and JAX name the fp8 dtype: both append, and
    the rows must come in the cache's own dtype."""
    for dtype in ("uint8", "float8_e4m3fn"):
        cache = ArrayInfo((10, 2, 16, 2, 128), (8192, 4096, 256, 128, 1), dtype, 0)
        assert _append_5d(cache).outs[0].dtype == dtype
    with pytest.raises(ValueError, match="append_key: expected .* of dtype float8_e4m3fn"):
        _append_5d(cache, key_dtype="uint8")


def test_append_into_a_pair_and_the_vector_width(monkeypatch):
    keys = np.zeros((4, 2, 64), np.float16)
    idx = np.zeros(4, np.int32)
    k_cache = np.zeros((3, 16, 2, 64), np.float16)
    arrays = (keys, keys, idx, idx, k_cache, k_cache, *_table())
    for align, vec in [(16, 16), (4, 4)]:  # align: the pointers' common alignment
        prep = prepare(page._APPEND_PAIR, arrays, ("NHD",), align)
        assert [o.source for o in prep.outs] == [4, 5] and prep.dense == ()  # contiguous
        launch, p = launched(monkeypatch, prep, [0x100 * (i + 1) for i in range(11)])
        assert (p["k_cache"], p["v_cache"], p["kv_indices"]) == (0xA00, 0xB00, 0x700)
        assert launch.kernel.spec == page.PageSpec(128, vec) and p["units"] == 4 * 2 * 128 // vec
    arrays = (keys[:0], keys[:0], idx[:0], idx[:0], k_cache, k_cache, *_table())
    empty = prepare(page._APPEND_PAIR, arrays, ("NHD",))
    assert launched(monkeypatch, empty, [0] * 11)[0].empty


def test_append_into_a_pair_of_two_head_dims(monkeypatch):
    """A pair whose head dims differ (DeepSeek's K 192 / V 128; MLA's ckv 512 / kpe 64): each
    row's units cover the longer, the kernel copying what each holds; the value rows checked
    against V's head_dim."""
    idx = np.zeros(4, np.int32)
    for dk, dv in ((192, 128), (64, 512)):
        keys, values = np.zeros((4, 2, dk), np.float16), np.zeros((4, 2, dv), np.float16)
        k_cache = np.zeros((3, 16, 2, dk), np.float16)
        v_cache = np.zeros((3, 16, 2, dv), np.float16)
        prep = prepare(page._APPEND_PAIR, (keys, values, idx, idx, k_cache, v_cache, *_table()),
                       ("NHD",))  # fmt: skip
        launch, p = launched(monkeypatch, prep, [0x100 * (i + 1) for i in range(11)])
        assert launch.kernel.spec == page.PageSpec(2 * dk, 16, "int32", "int32", 2 * dv)
        assert p["units"] == 4 * 2 * 2 * max(dk, dv) // 16
        assert (p["kt"], p["vt"], p["value_token"]) == (4 * dk, 4 * dv, 4 * dv)
        assert f"V_ROW_BYTES = {2 * dv};" in launch.kernel.spec.prelude()
        with pytest.raises(ValueError, match=rf"append_value: expected \[nnz, 2, {dv}\]"):
            prepare(page._APPEND_PAIR, (keys, keys, idx, idx, k_cache, v_cache, *_table()),
                    ("NHD",))  # fmt: skip
    same = page._append_kernel(256, 256, 16, ("int32", "int32")).spec
    assert same == page.PageSpec(256, 16) and "V_ROW_BYTES = 256;" in same.prelude()


def test_mla_append_is_a_pair_of_one_head(monkeypatch):
    """append_paged_mla_kv_cache hands append_paged_kv_cache views with a head dim of one
    (the caller's arrays, written in place) and returns the caches; wrong ranks raise first."""
    calls = []
    monkeypatch.setattr(page, "append_paged_kv_cache", lambda *a, **k: calls.append(a) or a[4])
    ckv, kpe = np.zeros((3, 512), np.float16), np.zeros((3, 64), np.float16)
    ckv_cache, kpe_cache = np.zeros((5, 16, 512), np.float16), np.zeros((5, 16, 64), np.float16)
    idx = np.zeros(3, np.int32)
    out = page.append_paged_mla_kv_cache(ckv, kpe, idx, idx, ckv_cache, kpe_cache, *_table())
    assert out[0] is ckv_cache and out[1] is kpe_cache
    ((key, value, _, _, (k_cache, v_cache), *_),) = calls
    assert key.shape == (3, 1, 512) and value.shape == (3, 1, 64)
    assert k_cache.shape == (5, 16, 1, 512) and v_cache.shape == (5, 16, 1, 64)
    assert np.shares_memory(k_cache, ckv_cache) and np.shares_memory(v_cache, kpe_cache)
    with pytest.raises(ValueError, match=r"append_ckv: expected 2 dims"):
        page.append_paged_mla_kv_cache(ckv[None], kpe, idx, idx, ckv_cache, kpe_cache, *_table())


def test_index_ops(monkeypatch):
    indptr, last = np.array([0, 3, 3, 7], np.int32), np.array([5, 0, 16], np.int32)
    prep = prepare(page._SEQ_LENS, (indptr, last), ())
    assert prep.outs[0].shape == (3,) and prep.dense == ()  # contiguous
    _, p = launched(monkeypatch, prep, [0x100, 0x200, 0x300], (16,))
    assert (p["kv_indptr"], p["last"], p["seq_lens"]) == (0x100, 0x200, 0x300)
    assert (p["batch_size"], p["page_size"]) == (3, 16)
    with pytest.raises(TypeError, match="kv_indptr and kv_last_page_len must be both int32 or "
                                        "both int64"):  # fmt: skip
        prepare(page._SEQ_LENS, (indptr, last.astype(np.int64)), ())
    prep = prepare(page._POSITIONS, (indptr, last, None, None), (11,))
    assert [o.shape for o in prep.outs] == [(11,), (11,)] and prep.dense == ()  # contiguous
    assert [o.source for o in prep.outs] == [None, None]  # allocated
    _, p = launched(monkeypatch, prep, [0x100, 0x200, 0, 0, 0x500, 0x600])
    assert (p["batch_indices"], p["positions"], p["batch_size"], p["nnz"]) == (0x500, 0x600, 3, 11)
    given = np.zeros(11, np.int32)
    prep = prepare(page._POSITIONS, (indptr, last, given, given), (11,))
    assert [o.source for o in prep.outs] == [2, 3]  # the caller's buffers
    with pytest.raises(ValueError, match=r"append_indptr must have shape \(4,\), got \(3,\)"):
        prepare(page._POSITIONS, (indptr[:3], last, None, None), (11,))
    with pytest.raises(ValueError, match=r"positions: expected a contiguous int32 array of "
                                         r"shape \(11,\), got int64 of shape \(11,\)"):  # fmt: skip
        prepare(page._POSITIONS, (indptr, last, None, given.astype(np.int64)), (11,))


def test_nnz_is_any_integral_value():
    from rtcinfer.plan._checks import as_int

    def count(value):
        return as_int("nnz", value, minimum=0)

    assert count(7) == 7 and count(np.int64(3)) == 3
    assert count(np.array(5)) == 5  # a 0-d integer array, as a tensor's [-1] gives
    with pytest.raises(TypeError, match="nnz must be an integer, got 5.7"):
        count(5.7)
    with pytest.raises(ValueError, match="nnz must be >= 0, got -1"):
        count(-1)


def _append_run(monkeypatch, report=None):
    """The prepared append of _append_5d and a run of it: its launches are recorded, and
    `report` (if given) is what the kernel reports while it runs."""
    cache = ArrayInfo((10, 2, 16, 2, 128), (8192, 4096, 256, 128, 1), "bfloat16", 0)
    prep = _append_5d(cache)
    launches = []

    def launch(self, stream, device):
        launches.append(stream)
        if report is not None:
            report()

    monkeypatch.setattr(page.Launch, "__call__", launch)

    def run(stream=5):
        prep.run(stream, 0, [0x100 * (i + 1) for i in range(8)] + [0x10000], ())

    return run, launches


@pytest.mark.parametrize(
    "code, index, value, limit, message",
    [
        (BadIndex.BATCH_INDICES, 4, 7, 3, r"batch_indices\[4\] = 7 is not a request of the table "
         r"\(0 <= b < 3\)"),
        (BadIndex.POSITIONS, 2, 40, 33, r"positions\[2\] = 40 is past the end of its request, 33 "
         r"tokens by kv_indptr and kv_last_page_len"),
        (BadIndex.KV_INDPTR, 1, 12, 10, r"kv_indptr: request 1 reads kv_indices\[12\], outside "
         r"its 10 entries"),
        (BadIndex.KV_INDICES, 5, 1000, 10, r"kv_indices\[5\] = 1000 is not a page of the cache "
         r"\(0 <= page < 10\)"),
    ],
)  # fmt: skip
def test_the_next_call_raises_what_the_device_reported(monkeypatch, records, code, index, value,
                                                       limit, message):  # fmt: skip
    """Without a synchronization: the host copy names the array and the entry; the call
    launches nothing, clears both records (the device's on its stream), and the next call
    runs."""
    run, launches = _append_run(monkeypatch)
    run()
    records.report(0, code, index, value, limit, count=3)
    with pytest.raises(rtcinfer.BadIndexError, match="^append_paged_kv_cache: " + message +
                       "; its row was skipped, nothing written$"):  # fmt: skip
        run(stream=9)
    assert launches == [5] and records.log == [("clear", 0, 9)]
    assert records.host_row(0)["count"] == records.device_row(0)["count"] == 0
    run()
    assert launches == [5, 5]
    assert rtcinfer.check_errors() is None


def test_check_errors_waits_counts_and_clears(monkeypatch, records):
    run, _ = _append_run(monkeypatch)
    run()
    assert rtcinfer.check_errors() is None and records.log == [("sync", 0)]
    records.report(0, BadIndex.KV_INDICES, 5, 1000, 10, count=3)
    counted = "; its row was skipped, nothing written; 3 bad entries in all since the last report$"
    with pytest.raises(rtcinfer.BadIndexError, match=r"kv_indices\[5\] = 1000 .*" + counted):
        rtcinfer.check_errors()
    assert records.log[1:] == [("sync", 0), ("clear", 0, None)]
    assert records.host_row(0)["count"] == records.device_row(0)["count"] == 0
    assert rtcinfer.check_errors() is None
    run()  # nothing left to raise


def test_check_errors_without_any_record_touches_no_device(records):
    assert rtcinfer.check_errors() is None and records.log == []


@pytest.mark.parametrize("capturing", [False, True])
def test_rtcinfer_check_raises_at_the_call_that_found_it(monkeypatch, records, capturing):
    """RTCINFER_CHECK=1: the call waits for its stream after the launch and raises what its own
    kernel reported (one bad row here); not while its stream is captured into a CUDA graph."""
    runtime = fake_gpu(monkeypatch)
    monkeypatch.setattr(errors, "is_capturing", lambda stream: capturing)
    monkeypatch.setenv("RTCINFER_CHECK", "1")
    bad = (BadIndex.POSITIONS, 0, 16, 16)
    run, launches = _append_run(monkeypatch, report=lambda: records.report(0, *bad))
    if capturing:
        run(stream=7)
        assert runtime.synchronized == [] and records.host_row(0)["count"] == 1
        return
    with pytest.raises(rtcinfer.BadIndexError, match=r"positions\[0\] = 16 is past the end .* "
                       "16 tokens .*; 1 bad entry in all since the last report$"):  # fmt: skip
        run(stream=7)
    assert launches == [7] and runtime.synchronized == [7]
    assert records.host_row(0)["count"] == records.device_row(0)["count"] == 0


def test_without_rtcinfer_check_a_call_does_not_wait(monkeypatch, records):
    runtime = fake_gpu(monkeypatch)
    monkeypatch.delenv("RTCINFER_CHECK", raising=False)
    run, launches = _append_run(monkeypatch, report=lambda: records.report(0, 4, 3, 12, 10))
    run(stream=7)
    assert launches == [7] and runtime.synchronized == []
    with pytest.raises(rtcinfer.BadIndexError, match=r"kv_indices\[3\] = 12 is not a page"):
        run(stream=7)
