"""rope_quantize_fp8, mla_rope_quantize_fp8 and rope_quantize_fp8_append_paged_kv_cache without
a GPU: the argument checks, and each call's launch (its grid and parameter block, as issued)
executed by a Python transcription of the kernel (tests/rope_quantize_model.py) over host
memory behind the arrays, against the float64 reference: GQA and MLA, neox and interleaved,
the nope parts or none, e4m3 and e5m2, strided inputs, given outputs, NHD and HND caches with
permuted pages, padding tokens and the bad entries reported."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import rtcinfer
from rtcinfer import launch, rope_quantize
from rtcinfer.interop.dtypes import numpy_dtype

from . import reference as ref
from . import rope_quantize_model as model
from .checks import assert_fp8
from .fakes import FakeRecords, cupy_without_a_gpu, fake_gpu, torch_as_cuda
from .gpu import cos_sin_table, fp8_cache_shapes

FP8 = ("float8_e4m3fn", "float8_e5m2")


class Host:
    """Arrays in host memory standing in for device 0's (PyTorch CPU tensors, or CuPy arrays
    over a host buffer, fp8 ones as uint8 storage), and the launches issued on them, each run
    by the model when `run` is called."""

    def __init__(self, framework, new, fp8_storage):
        self.framework, self._new, self._fp8_storage = framework, new, fp8_storage
        self.issued, self.types = [], {}

    def empty(self, shape, dtype):
        a = self._new(shape, "uint8" if self._fp8_storage and dtype in FP8 else dtype)
        self.types[model.span(a)[0]] = dtype
        _raw(a)[...] = 0
        return a

    def array(self, values, dtype):
        a = self.empty(np.shape(values), dtype)
        _raw(a)[...] = np.ascontiguousarray(np.asarray(values).astype(numpy_dtype(dtype))).view(
            np.uint8).ravel()  # fmt: skip
        return a

    def get(self, a, dtype: str | None = None) -> np.ndarray:
        """a's values (float64), read through its strides; `dtype`: what uint8 storage holds."""
        address = a.data_ptr() if hasattr(a, "data_ptr") else a.data.ptr
        dtype = dtype or self.types.get(address) or _dtype(a)
        item = np.dtype(numpy_dtype(dtype)).itemsize
        strides = a.stride() if hasattr(a, "stride") else tuple(s // a.itemsize for s in a.strides)
        extent = 1 + sum((n - 1) * s for n, s in zip(a.shape, strides, strict=True)) if all(
            a.shape) else 0  # fmt: skip
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * (extent * item)).from_address(address))
        bits = raw.view(f"u{item}")  # (as_strided takes no ml_dtypes types)
        view = np.lib.stride_tricks.as_strided(bits, tuple(a.shape),
                                               tuple(s * item for s in strides))  # fmt: skip
        return view.copy().view(numpy_dtype(dtype)).astype(np.float64)

    def run(self, arrays) -> list:
        """Run the launches issued since the last run over `arrays` (inputs and outputs); the
        bad entries they reported."""
        memory = model.Memory(arrays)
        reports = []
        for spec, grid, fields in self.issued:
            reports += model.launch(fields, grid, spec, memory)
        self.issued.clear()
        return reports


def _dtype(a) -> str:
    return str(a.dtype).removeprefix("torch.")


def _raw(a) -> np.ndarray:
    address, size = model.span(a)
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))


@pytest.fixture(params=["torch", "cupy", "torch, 32-byte units"])
def host(request, monkeypatch):
    """The framework, and a unit's input bytes at most (rope_quantize.UNIT_BYTES)."""
    FakeRecords(monkeypatch)
    for op in (rope_quantize._QUANTIZE, rope_quantize._APPEND):
        monkeypatch.setattr(op, "cache", {})
    monkeypatch.setattr(rope_quantize, "UNIT_BYTES", 32 if "32-byte" in request.param else 16)
    if request.param.startswith("torch"):
        torch = pytest.importorskip("torch")
        torch_as_cuda(monkeypatch)
        h = Host("torch", lambda shape, d: torch.zeros(shape, dtype=getattr(torch, d)), False)
        _record(monkeypatch, h)
        yield h
    else:
        cupy = pytest.importorskip("cupy")
        fake_gpu(monkeypatch)
        backing = np.zeros(1 << 24, np.uint8)
        with cupy_without_a_gpu(monkeypatch, backing):
            h = Host("cupy", lambda shape, d: cupy.ndarray(shape, d), True)
            _record(monkeypatch, h)
            yield h


def _record(monkeypatch, h: Host) -> None:
    """Launches issue nothing: each is kept (spec, grid, its block's fields at issue time)."""

    def snapshot_issuer(self, device, dependent):
        def issue(stream):
            fields = {f: getattr(self.params, f) for f, *_ in self.params._fields_}
            fields = {f: 0 if v is None else v for f, v in fields.items()}
            h.issued.append((self.kernel.spec, self.grid, fields))
            return 0

        return issue

    monkeypatch.setattr(launch.Launch, "_issuer", snapshot_issuer)


def _strided(h: Host, values, dtype):
    """values in every other row of a wider array: token strides twice the dense ones."""
    nnz = values.shape[0]
    wide = h.array(np.concatenate([values, values], axis=-1), dtype)
    return wide[..., : values.shape[-1]] if nnz else wide


CASES = [  # (name, Hq, Hk (None: MLA), R, N (None: no nope parts), neox, out type, scales)
    ("gqa", 4, 2, 16, 8, True, "float8_e4m3fn", (1.0, 1.0)),
    ("gqa interleaved, e5m2, scaled", 3, 1, 8, 8, False, "float8_e5m2", (0.5, 40.0)),
    ("rotary only", 2, 2, 16, None, True, "float8_e4m3fn", (2.0, 0.25)),
    ("mla", 4, None, 8, 32, True, "float8_e4m3fn", (1.0, 300.0)),
    ("mla interleaved", 2, None, 16, 16, False, "float8_e5m2", (1.0, 1.0)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("strided", [False, True])
def test_rope_quantize_fp8_against_the_reference(host, rng, case, strided):
    _, hq, hk, rope_dim, nope, neox, out_type, (sq, skv) = case
    nnz, max_pos = 5, 40
    k_lead = (nnz,) if hk is None else (nnz, hk)
    values = {"q_rope": rng.uniform(-3, 3, (nnz, hq, rope_dim)),
              "k_rope": rng.uniform(-3, 3, (*k_lead, rope_dim))}  # fmt: skip
    if nope is not None:
        values["q_nope"] = rng.uniform(-3, 3, (nnz, hq, nope))
        values["k_nope"] = rng.uniform(-3, 3, (*k_lead, nope))
    make = (lambda v: _strided(host, v, "bfloat16")) if strided else (
        lambda v: host.array(v, "bfloat16"))  # fmt: skip
    arrays = {name: make(v) for name, v in values.items()}
    table = cos_sin_table(rng, max_pos, rope_dim)
    pos = rng.integers(0, max_pos, nnz).astype(np.int32)
    cache, pos_d = host.array(table, "float32"), host.array(pos, "int32")
    fn = rtcinfer.rope_quantize_fp8 if hk is not None else rtcinfer.mla_rope_quantize_fp8
    outs = fn(arrays["q_rope"], arrays["k_rope"], arrays.get("q_nope"), arrays.get("k_nope"),
              cache, pos_d, is_neox=neox, quantize_dtype=out_type, quant_scale_q=sq,
              quant_scale_kv=skv)  # fmt: skip
    assert len(host.issued) == 1
    assert host.run([*arrays.values(), cache, pos_d, *outs]) == []
    rounded = {name: ref.round_to(v, "bfloat16") for name, v in values.items()}
    expect = ref.rope_quantize_ref(rounded["q_rope"], rounded["k_rope"], rounded.get("q_nope"),
                                   rounded.get("k_nope"), table, pos, not neox, sq, skv,
                                   out_type)  # fmt: skip
    for name, out, exact in zip(("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out"), outs,
                                expect, strict=True):  # fmt: skip
        assert tuple(out.shape) == exact.shape, name
        assert_fp8(host.get(out, out_type).astype(numpy_dtype(out_type)), exact, out_type, name)


def test_given_outputs_are_written_and_returned(host, rng):
    nnz, hq, hk, rope_dim, nope = 3, 2, 1, 8, 8
    q, k = host.array(rng.uniform(-1, 1, (nnz, hq, rope_dim)), "float16"), host.array(
        rng.uniform(-1, 1, (nnz, hk, rope_dim)), "float16")  # fmt: skip
    qn, kn = host.array(rng.uniform(-1, 1, (nnz, hq, nope)), "float16"), host.array(
        rng.uniform(-1, 1, (nnz, hk, nope)), "float16")  # fmt: skip
    table = cos_sin_table(rng, 8, rope_dim)
    cache, pos = host.array(table, "float32"), host.array(np.arange(nnz), "int64")
    given = [host.empty(s, "float8_e5m2") for s in ((nnz, hq, rope_dim), (nnz, hk, rope_dim),
                                                     (nnz, hq, nope), (nnz, hk, nope))]  # fmt: skip
    outs = rtcinfer.rope_quantize_fp8(q, k, qn, kn, cache, pos, q_rope_out=given[0],
                                      k_rope_out=given[1], q_nope_out=given[2],
                                      k_nope_out=given[3],
                                      quantize_dtype="float8_e5m2")  # fmt: skip
    assert all(o is g for o, g in zip(outs, given, strict=True))
    assert host.run([q, k, qn, kn, cache, pos, *given]) == []
    expect = ref.rope_quantize_ref(host.get(q), host.get(k), host.get(qn), host.get(kn), table,
                                   np.arange(nnz), False, 1.0, 1.0, "float8_e5m2")  # fmt: skip
    for out, exact in zip(given, expect, strict=True):
        assert_fp8(host.get(out).astype(numpy_dtype("float8_e5m2")), exact, "float8_e5m2")


def test_a_position_outside_the_table_is_quantized_unrotated_and_reported(host, rng):
    nnz, rope_dim = 4, 8
    q = host.array(rng.uniform(-1, 1, (nnz, 2, rope_dim)), "bfloat16")
    k = host.array(rng.uniform(-1, 1, (nnz, 1, rope_dim)), "bfloat16")
    table = cos_sin_table(rng, 6, rope_dim)
    pos_values = np.array([1, 6, -2, 5])
    cache, pos = host.array(table, "float32"), host.array(pos_values, "int32")
    outs = rtcinfer.rope_quantize_fp8(q, k, None, None, cache, pos)
    reports = host.run([q, k, cache, pos, *outs])
    assert reports == [("QUANT_COS_SIN_POSITIONS", 1, 6, 6), ("QUANT_COS_SIN_POSITIONS", 2, -2, 6)]
    expect = ref.rope_quantize_ref(host.get(q), host.get(k), None, None, table, pos_values,
                                   False, 1.0, 1.0, "float8_e4m3fn")  # fmt: skip
    e4m3 = "float8_e4m3fn"
    assert_fp8(host.get(outs[0], e4m3).astype(numpy_dtype(e4m3)), expect[0], e4m3)
    assert tuple(outs[2].shape) == (nnz, 2, 0) and tuple(outs[3].shape) == (nnz, 1, 0)


def _append_case(host, rng, mla, kv_layout, page_size, neox, out_type, scales, wide=False):
    """Three requests over permuted pages (a gap of unused pages between them), 7 tokens:
    appended at the requests' ends, one padding token (-1). `wide`: heads and dims of a model
    (a token's units span several CTAs: GQA's q and k units fill one, its v units the next)."""
    hq, hk, rope_dim, nope = 3, (1 if mla else 2), 8, (16 if mla else 8)
    if wide:
        hq, hk, rope_dim, nope = 12, (1 if mla else 4), 32, (128 if mla else 32)
    num_pages, max_pos = 9, 64
    pages_of = [[5, 2], [7], [0, 8, 3]]
    kv_indptr = np.array([0, 2, 3, 6], np.int32)
    kv_indices = np.array([p for ps in pages_of for p in ps], np.int32)
    batch = np.array([0, 0, 2, 1, -1, 2, 2], np.int32)
    positions = np.array([page_size + 1, page_size + 2, 2 * page_size, 0, -1, 2 * page_size + 1,
                          2], np.int32)  # fmt: skip
    nnz = batch.shape[0]
    k_lead = (nnz,) if mla else (nnz, hk)
    vals = {"q_rope": rng.uniform(-2, 2, (nnz, hq, rope_dim)),
            "k_rope": rng.uniform(-2, 2, (*k_lead, rope_dim)),
            "q_nope": rng.uniform(-2, 2, (nnz, hq, nope)),
            "k_nope": rng.uniform(-2, 2, (*k_lead, nope))}  # fmt: skip
    if not mla:
        vals["v"] = rng.uniform(-2, 2, (nnz, hk, rope_dim + nope))
    vals = {n: ref.round_to(v, "bfloat16") for n, v in vals.items()}
    arrays = {n: host.array(v, "bfloat16") for n, v in vals.items()}
    shapes = fp8_cache_shapes(mla, kv_layout, num_pages, page_size, hk, rope_dim, nope)
    old = [ref.round_to(rng.uniform(-1, 1, s), out_type) for s in shapes]
    caches = [host.array(o, out_type) for o in old]
    table = cos_sin_table(rng, max_pos, rope_dim)
    pos_ids = rng.integers(0, max_pos, nnz).astype(np.int64)
    d = dict(cache=host.array(table, "float32"), pos=host.array(pos_ids, "int64"),
             kv_indices=host.array(kv_indices, "int32"),
             kv_indptr=host.array(kv_indptr, "int32"), batch=host.array(batch, "int32"),
             positions=host.array(positions, "int32"))  # fmt: skip
    outs = rtcinfer.rope_quantize_fp8_append_paged_kv_cache(
        arrays["q_rope"], arrays["k_rope"], arrays["q_nope"], arrays["k_nope"], arrays.get("v"),
        d["cache"], d["pos"], tuple(caches), d["kv_indices"], d["kv_indptr"], d["batch"],
        d["positions"], is_neox=neox, quantize_dtype=out_type, quant_scale_q=scales[0],
        quant_scale_kv=scales[1], page_size=page_size, kv_layout=kv_layout,
    )  # fmt: skip
    reports = host.run([*arrays.values(), *caches, *d.values(), *outs])
    expect = ref.rope_quantize_append_ref(
        vals["q_rope"], vals["k_rope"], vals["q_nope"], vals["k_nope"], vals.get("v"), table,
        pos_ids, old, kv_indices, kv_indptr, batch, positions, not neox, scales[0], scales[1],
        out_type, page_size, kv_layout,
    )  # fmt: skip
    return outs, caches, expect, reports


@pytest.mark.parametrize(
    "mla, kv_layout, page_size, neox, out_type, scales, wide",
    [(False, "NHD", 4, True, "float8_e4m3fn", (1.0, 1.0), False),
     (False, "HND", 8, False, "float8_e5m2", (0.5, 8.0), False),
     (True, "NHD", 4, True, "float8_e4m3fn", (2.0, 100.0), False),
     (True, "NHD", 16, False, "float8_e4m3fn", (1.0, 1.0), False),
     (False, "HND", 16, True, "float8_e4m3fn", (1.0, 1.0), True),
     (True, "NHD", 4, True, "float8_e5m2", (1.0, 1.0), True)],
)  # fmt: skip
def test_rope_quantize_fp8_append_against_the_reference(host, rng, mla, kv_layout, page_size,
                                                        neox, out_type, scales, wide):  # fmt: skip
    outs, caches, expect, reports = _append_case(host, rng, mla, kv_layout, page_size, neox,
                                                 out_type, scales, wide)  # fmt: skip
    assert reports == []
    assert len(outs) == 2
    names = ("q_rope_out", "q_nope_out", "cache_0", "cache_1")
    for name, got, exact in zip(names, (*outs, *caches), expect, strict=True):
        assert_fp8(host.get(got, out_type).astype(numpy_dtype(out_type)), exact, out_type, name)


def test_argument_checks(host, rng):
    q = host.array(rng.uniform(-1, 1, (3, 2, 8)), "bfloat16")
    k = host.array(rng.uniform(-1, 1, (3, 1, 8)), "bfloat16")
    table = host.array(cos_sin_table(rng, 4, 8), "float32")
    pos = host.array(np.arange(3), "int32")
    fn = rtcinfer.rope_quantize_fp8
    with pytest.raises(ValueError, match=r"cos_sin_cache: expected float32 \[max_pos, 8\]"):
        fn(q, k, None, None, host.array(cos_sin_table(rng, 4, 16), "float32"), pos)
    with pytest.raises(ValueError, match="k_nope is None but q_nope has 8 dims"):
        fn(q, k, q, None, table, pos)
    with pytest.raises(TypeError, match="k_rope: expected q_rope's dtype bfloat16"):
        fn(q, host.array(np.zeros((3, 1, 8)), "float16"), None, None, table, pos)
    with pytest.raises(ValueError, match=r"pos_ids: expected int32 or int64 \[3\]"):
        fn(q, k, None, None, table, host.array(np.arange(4), "int32"))
    with pytest.raises(TypeError, match="quantize_dtype: expected one of"):
        fn(q, k, None, None, table, pos, quantize_dtype="bfloat16")
    with pytest.raises(ValueError, match="backend: only 'cuda'"):
        fn(q, k, None, None, table, pos, backend="cutile")
    with pytest.raises(ValueError, match=r"q_rope_out: expected shape \(3, 2, 8\)"):
        fn(q, k, None, None, table, pos, q_rope_out=host.empty((3, 2, 4), "float8_e4m3fn"))
    odd = host.array(rng.uniform(-1, 1, (3, 2, 7)), "bfloat16")
    with pytest.raises(ValueError, match="must be even"):
        fn(odd, host.array(np.zeros((3, 1, 7)), "bfloat16"), None, None,
           host.array(cos_sin_table(rng, 4, 7)[:, :7], "float32"), pos)  # fmt: skip
    append = rtcinfer.rope_quantize_fp8_append_paged_kv_cache
    idx = host.array(np.arange(2), "int32")
    caches = tuple(host.empty((2, 4, 1, 8), "float8_e4m3fn") for _ in range(2))
    with pytest.raises(ValueError, match="needs v"):
        append(q, k, None, None, None, table, pos, caches, idx, idx, pos, pos, page_size=4)
    with pytest.raises(ValueError, match="paged_kv_cache must be a tuple of 2"):
        append(q, k, None, None, q, table, pos, caches[0], idx, idx, pos, pos, page_size=4)
    v = host.array(np.zeros((3, 1, 8)), "bfloat16")
    with pytest.raises(ValueError, match="k_cache: expected .* with page_size 8"):
        append(q, k, None, None, v, table, pos, caches, idx, idx, pos, pos, page_size=8)
    with pytest.raises(TypeError, match="batch_indices and positions: expected 1-D arrays"):
        append(q, k, None, None, v, table, pos, caches, idx, idx, pos,
               host.array(np.arange(3), "int64"), page_size=4)  # fmt: skip
    mla_k = host.array(np.zeros((3, 8)), "bfloat16")
    with pytest.raises(ValueError, match="MLA .* takes no v"):
        append(q, mla_k, None, None, v, table, pos, caches, idx, idx, pos, pos, page_size=4)


def test_bad_entries_are_reported_and_their_k_and_v_not_appended(host, rng):
    """b >= B, a position past its request's pages and a page id outside the cache: those
    tokens' k and v are skipped (their q written), each reported once."""
    nnz, hq, hk, rope_dim, page_size, num_pages = 4, 2, 1, 8, 4, 3
    q = host.array(rng.uniform(-1, 1, (nnz, hq, rope_dim)), "bfloat16")
    k = host.array(rng.uniform(-1, 1, (nnz, hk, rope_dim)), "bfloat16")
    v = host.array(rng.uniform(-1, 1, (nnz, hk, rope_dim)), "bfloat16")
    table = cos_sin_table(rng, 8, rope_dim)
    old = [ref.round_to(rng.uniform(-1, 1, (num_pages, page_size, hk, rope_dim)), "float8_e4m3fn")
           for _ in range(2)]  # fmt: skip
    caches = tuple(host.array(o, "float8_e4m3fn") for o in old)
    kv_indices, kv_indptr = np.array([1, 7, 0], np.int32), np.array([0, 1, 3], np.int32)
    batch, positions = np.array([0, 2, 0, 1], np.int32), np.array([1, 0, 4, 2], np.int32)
    arrays = [host.array(x, "int32") for x in (kv_indices, kv_indptr, batch, positions)]
    cache, pos = host.array(table, "float32"), host.array(np.arange(nnz), "int32")
    outs = rtcinfer.rope_quantize_fp8_append_paged_kv_cache(
        q, k, None, None, v, cache, pos, caches, *arrays, page_size=page_size
    )
    reports = host.run([q, k, v, cache, pos, *caches, *arrays, *outs])
    assert reports == [("QUANT_BATCH_INDICES", 1, 2, 2), ("QUANT_POSITIONS", 2, 4, 4),
                       ("QUANT_KV_INDICES", 1, 7, 3)]  # fmt: skip
    good = np.array([True, False, False, False])
    expect = ref.rope_quantize_append_ref(
        host.get(q), host.get(k), None, None, host.get(v), table, np.arange(nnz), old,
        kv_indices, kv_indptr, np.where(good, batch, -1), np.where(good, positions, -1), False,
        1.0, 1.0, "float8_e4m3fn", page_size)  # fmt: skip
    e4m3 = "float8_e4m3fn"
    for got, exact in zip(caches, expect[2:], strict=True):
        assert_fp8(host.get(got, e4m3).astype(numpy_dtype(e4m3)), exact, e4m3)
    full = ref.rope_quantize_ref(host.get(q), host.get(k), None, None, table, np.arange(nnz),
                                 False, 1.0, 1.0, e4m3)  # fmt: skip
    assert_fp8(host.get(outs[0], e4m3).astype(numpy_dtype(e4m3)), full[0], e4m3)


def test_no_tokens_launch_nothing(host, rng):
    q, k = host.empty((0, 2, 8), "bfloat16"), host.empty((0, 1, 8), "bfloat16")
    table = host.array(cos_sin_table(rng, 4, 8), "float32")
    pos = host.empty((0,), "int32")
    outs = rtcinfer.rope_quantize_fp8(q, k, None, None, table, pos)
    assert [tuple(o.shape) for o in outs] == [(0, 2, 8), (0, 1, 8), (0, 2, 0), (0, 1, 0)]
    caches = tuple(host.empty((2, 4, 1, 8), "float8_e4m3fn") for _ in range(2))
    ints = host.empty((0,), "int32")
    v = host.empty((0, 1, 8), "bfloat16")
    appended = rtcinfer.rope_quantize_fp8_append_paged_kv_cache(
        q, k, None, None, v, table, pos, caches, host.array(np.arange(2), "int32"),
        host.array(np.array([0, 2]), "int32"), ints, ints, page_size=4,
    )  # fmt: skip
    assert [tuple(o.shape) for o in appended] == [(0, 2, 8), (0, 2, 0)]
    assert host.issued == []
