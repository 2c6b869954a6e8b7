"""Calls that differ from a prepared one only in their row (token) count are made from it
(prepared.with_rows) without the op's validation, and launch exactly what a fresh preparation
launches: the norms (plain, a given output, fused, fp8 out), the gated activations, RoPE
(positions, ragged, a cos/sin cache), the paged append (a 5-D cache, a pair), the merges of
attention states and RoPE with fp8 outputs (alone and appended to a paged cache), on CuPy
arrays at made-up addresses
(the launches recorded, never made). Row counts that disagree between the row slots, and
calls of fewer than two rows, are prepared (and refused) as before."""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import pytest

import rtcinfer
from rtcinfer import launch, rope_quantize
from rtcinfer.interop import prepared

from .fakes import FakeRecords, cupy_without_a_gpu, fake_gpu

cupy = pytest.importorskip("cupy")

_OPS = (rtcinfer.norm._PLAIN, rtcinfer.norm._FUSED, rtcinfer.norm._QUANT,
        rtcinfer.activation._OP, rtcinfer.rope._POS_IDS, rtcinfer.rope._RAGGED,
        rtcinfer.rope._CACHE, rtcinfer.attention.page._APPEND, rtcinfer.attention.page._APPEND_PAIR,
        *(getattr(rtcinfer.attention.cascade, n) for n in ("_STATES", "_MERGE", "_IN_PLACE",
                                                          "_SINKS")),
        rope_quantize._QUANTIZE, rope_quantize._APPEND)  # fmt: skip


@pytest.fixture
def empty(monkeypatch):
    fake_gpu(monkeypatch)
    FakeRecords(monkeypatch)
    monkeypatch.setattr(rtcinfer.jit, "sm_count", lambda device: 132)  # RoPE's grid
    monkeypatch.setattr(launch.Kernel, "occupancy", lambda self, device, threads: 4)
    for op in _OPS:
        monkeypatch.setattr(op, "cache", {})
    with cupy_without_a_gpu(monkeypatch) as ndarray:
        yield ndarray


def _calls(empty):
    """name -> call(rows) of each op (arrays of `rows` rows, the rest fixed)."""
    f16, u8, i32 = np.float16, np.uint8, np.int32
    w = empty((256,), f16)
    big = empty((64, 512), f16)  # row-strided views of it
    res = empty((64, 256), f16)
    scale = empty((1,), np.float32)
    table = empty((100, 32), np.float32)
    caches = (empty((20, 16, 2, 64), u8), empty((20, 16, 2, 64), u8))
    indices, indptr = empty((20,), i32), empty((5,), i32)
    kv5 = empty((20, 2, 16, 2, 64), f16)
    kv_pair = (empty((20, 16, 2, 64), f16), empty((20, 16, 2, 64), f16))

    def rq(rows, **kw):
        q, k = empty((rows, 4, 32), f16), empty((rows, 2, 32), f16)
        qn, kn = empty((rows, 4, 32), f16), empty((rows, 2, 32), f16)
        return rtcinfer.rope_quantize_fp8(q, k, qn, kn, table, empty((rows,), i32),
                                          quantize_dtype="float8_e4m3fn", **kw)  # fmt: skip

    def append(rows):
        q, k, v = empty((rows, 4, 32), f16), empty((rows, 2, 32), f16), empty((rows, 2, 64), f16)
        qn, kn = empty((rows, 4, 32), f16), empty((rows, 2, 32), f16)
        ints = empty((rows,), i32)
        return rtcinfer.rope_quantize_fp8_append_paged_kv_cache(
            q, k, qn, kn, v, table, ints, caches, indices, indptr, ints, ints,
            quantize_dtype="float8_e4m3fn", page_size=16)  # fmt: skip

    return {
        "rmsnorm": lambda rows: rtcinfer.rmsnorm(big[:rows, :256], w),
        "rmsnorm, out given": lambda rows: rtcinfer.rmsnorm(big[:rows, :256], w,
                                                            out=empty((rows, 256), f16)),
        "rmsnorm, 3-d": lambda rows: rtcinfer.rmsnorm(empty((rows, 3, 256), f16), w),
        "fused_add_rmsnorm": lambda rows: rtcinfer.fused_add_rmsnorm(big[:rows, 256:],
                                                                     res[:rows], w),
        "rmsnorm_quant": lambda rows: rtcinfer.rmsnorm_quant(
            empty((rows, 256), u8), big[:rows, :256], w, scale, out_dtype="float8_e4m3fn"),
        "layernorm_quant": lambda rows: rtcinfer.layernorm_quant(
            empty((rows, 256), u8), big[:rows, :256], w, w, 0.5, out_dtype="float8_e5m2"),
        "silu_and_mul": lambda rows: rtcinfer.silu_and_mul(big[:rows]),
        "apply_rope_pos_ids_inplace": lambda rows: rtcinfer.apply_rope_pos_ids_inplace(
            empty((rows, 4, 64), f16), empty((rows, 2, 64), f16), empty((rows,), i32)),
        "apply_rope (ragged, new arrays)": lambda rows: rtcinfer.apply_rope(
            empty((rows, 4, 64), f16), empty((rows, 2, 64), f16), indptr, indptr[:4]),
        "apply_rope_with_cos_sin_cache": lambda rows: rtcinfer.apply_rope_with_cos_sin_cache(
            empty((rows,), i32), empty((rows, 4 * 64), f16), empty((rows, 2 * 64), f16), 64,
            empty((100, 64), np.float32)),
        "append_paged_kv_cache": lambda rows: rtcinfer.append_paged_kv_cache(
            empty((rows, 2, 64), f16), empty((rows, 2, 64), f16), empty((rows,), i32),
            empty((rows,), i32), kv5, indices, indptr, indptr[:4]),
        "append_paged_kv_cache, (k, v)": lambda rows: rtcinfer.append_paged_kv_cache(
            empty((rows, 2, 64), f16), empty((rows, 2, 64), f16), empty((rows,), i32),
            empty((rows,), i32), kv_pair, indices, indptr, indptr[:4]),
        "merge_state": lambda rows: rtcinfer.merge_state(
            empty((rows, 4, 64), f16), empty((rows, 4), np.float32), empty((rows, 4, 64), f16),
            empty((rows, 4), np.float32)),
        "merge_states": lambda rows: rtcinfer.merge_states(
            empty((rows, 3, 4, 64), f16), empty((rows, 3, 4), np.float32)),
        "merge_state_in_place, masked": lambda rows: rtcinfer.merge_state_in_place(
            empty((rows, 4, 64), f16), empty((rows, 4), np.float32), empty((rows, 4, 64), f16),
            empty((rows, 4), np.float32), empty((rows,), np.bool_)),
        "merge_sinks_in_place": lambda rows: rtcinfer.merge_sinks_in_place(
            empty((rows, 4, 64), f16), empty((rows, 4), np.float32), empty((4,), np.float32)),
        "rope_quantize_fp8": rq,
        "rope_quantize_fp8_append_paged_kv_cache": append,
    }  # fmt: skip


def _blanked(record) -> tuple:
    """A recorded launch's geometry and parameter fields by name, the pointers left out (the
    made-up arrays' addresses differ from call to call): what the signature fixes."""
    params = record.kernel.params_type.from_buffer_copy(record.params)
    fields = {}
    for name, kind, *_ in params._fields_:
        if kind is not ctypes.c_void_p:
            value = getattr(params, name)
            fields[name] = list(value) if isinstance(value, ctypes.Array) else value
    return record.kernel.name, record.grid, record.block, fields


NAMES = [
    "rmsnorm",
    "rmsnorm, out given",
    "rmsnorm, 3-d",
    "fused_add_rmsnorm",
    "rmsnorm_quant",
    "layernorm_quant",
    "silu_and_mul",
    "apply_rope_pos_ids_inplace",
    "apply_rope (ragged, new arrays)",
    "apply_rope_with_cos_sin_cache",
    "append_paged_kv_cache",
    "append_paged_kv_cache, (k, v)",
    "merge_state",
    "merge_states",
    "merge_state_in_place, masked",
    "merge_sinks_in_place",
    "rope_quantize_fp8",
    "rope_quantize_fp8_append_paged_kv_cache",
]


@pytest.fixture
def made(monkeypatch) -> list:
    """The row counts calls are made for from a prepared call (prepared.with_rows), in turn."""
    seen, real = [], prepared.with_rows
    monkeypatch.setattr(
        sys.modules["rtcinfer.interop.call"], "with_rows",
        lambda *a: seen.append(a[1]) or real(*a),
    )  # fmt: skip
    return seen


@pytest.mark.parametrize("name", NAMES)
def test_new_row_counts_launch_what_a_fresh_preparation_launches(empty, made, name):
    call = _calls(empty)[name]
    rows = [2, 5, 3, 17, 5, 40, 5]
    with launch.recording() as steps:
        results = [call(n) for n in rows]
    assert made == [5, 3, 17, 40]  # every new count after the first, from its model
    fresh = []
    for n in rows:
        for op in _OPS:
            op.cache.clear()
        with launch.recording() as one:
            fresh.append(call(n))
        fresh_step = one[0]
        assert _blanked(steps[len(fresh) - 1]) == _blanked(fresh_step), (name, n)
    for got, want in zip(results, fresh, strict=True):
        got, want = (got if isinstance(got, tuple) else (got,)), (
            want if isinstance(want, tuple) else (want,))  # fmt: skip
        assert [(a.shape, a.dtype, a.strides) for a in got] == [
            (a.shape, a.dtype, a.strides) for a in want]  # fmt: skip


def test_rows_that_disagree_are_refused_and_one_row_prepares_alone(empty, made):
    w = empty((256,), np.float16)
    x, r = empty((8, 256), np.float16), empty((8, 256), np.float16)
    with launch.recording():
        rtcinfer.fused_add_rmsnorm(x[:4], r[:4], w)  # the model of the fused norm's row counts
        rtcinfer.rmsnorm(x[:4], w, out=empty((4, 256), np.float16))
        with pytest.raises(ValueError, match="residual: expected shape"):
            rtcinfer.fused_add_rmsnorm(x[:5], r[:6], w)  # not made from the model: refused
        with pytest.raises(ValueError, match="out: expected shape"):
            rtcinfer.rmsnorm(x[:3], w, out=empty((4, 256), np.float16))
    assert made == []  # (disagreeing rows: nothing made from a model)
    with launch.recording() as steps:
        rtcinfer.fused_add_rmsnorm(x[:1], r[:1], w)  # one row: prepared on its own
        rtcinfer.fused_add_rmsnorm(x[:7], r[:7], w)  # from the 4-row model
    assert made == [7] and [s.grid[0] for s in steps] == [1, 7]


def test_jax_signatures_are_prepared_whole(empty, made):
    """A JAX call's key ("jax", op, static, (shape, dtype) per slot) is prepared in full for
    every row count: nothing is made from a model (a new JAX shape is traced anew anyway)."""
    from rtcinfer.interop.call_jax import _jax_info

    call = sys.modules["rtcinfer.interop.call"]

    class Traced:  # what _jax_info reads of a JAX array
        def __init__(self, shape, dtype):
            self.shape, self.dtype = shape, np.dtype(dtype)

    op = rtcinfer.norm._PLAIN
    static = ("rmsnorm",)
    for rows in (2, 5, 3):
        arrays = [Traced((rows, 256), np.float16), Traced((256,), np.float16)]
        arrays += [None] * (len(op.slots) - len(arrays))
        key = ("jax", op, static, *((a.shape, a.dtype) if a else None for a in arrays))
        prep = call._prepare(op, key, arrays, _jax_info, (), static)
        assert prep.rows == rows and op.cache[key] is prep
    assert made == []


def test_a_shortcut_notes_a_count_seen_once_by_its_hash(empty, made):
    """A prefill's ever-new token counts: each is made from the model and kept, and the
    shortcut notes it by its hash (an int the garbage collector does not track)."""
    import gc

    op, w = rtcinfer.norm._PLAIN, empty((256,), np.float16)
    with launch.recording():
        for rows in range(2, 40):
            rtcinfer.rmsnorm(empty((rows, 256), np.float16), w)
    assert made == list(range(3, 40))
    kept = [k for k in op.cache if type(k) is tuple]
    assert len(kept) == 38 + 1  # each count's signature and the row-free model
    notes = [k for k in op.cache if type(k) is int]
    assert len(notes) == 38 and not any(gc.is_tracked(op.cache[k]) for k in notes)
