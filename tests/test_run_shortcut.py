"""The plan()/run() wrappers' run shortcut (interop/shortcut.py with prepared.Planned) without a
GPU: a repeated run() on PyTorch tensors or CuPy arrays issues the block the function's own
path issues on the wrapper's current plan (decode over a 5-D cache or a (k, v) pair, ragged
and paged prefill, MLA; with and without the LSE, a given output), follows every later plan
(another batch, other lengths), and leaves to the function whatever it handles otherwise:
the scales, window_left, plan arrays, lists, a cache too small for the plan. The plans,
uploads and launches are faked (tests/fakes.py); arrays lie at made-up addresses."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from rtcinfer.interop import shortcut

from .fakes import (
    attention_without_a_gpu,
    cupy_without_a_gpu,
    issued_launches,
    noted,
    pointed,
    shortcut_entries,
)

STREAM = {"torch": 7, "cupy": 0}  # the current stream each framework's fake reports


@pytest.fixture(params=["torch", "cupy"])
def kit(request, monkeypatch):
    """(empty(shape, dtype name), address(array), issued launches) for one framework's arrays
    on a faked device 0, the wrappers' planning faked (attention_without_a_gpu)."""
    attention_without_a_gpu(monkeypatch)
    if request.param == "torch":
        torch = pytest.importorskip("torch")
        from .fakes import torch_as_cuda

        torch_as_cuda(monkeypatch)

        def empty(shape, dtype):
            return torch.zeros(shape, dtype=getattr(torch, dtype))

        issued = issued_launches(monkeypatch)
        yield request.param, empty, torch.Tensor.data_ptr, issued
    else:
        pytest.importorskip("cupy")
        with cupy_without_a_gpu(monkeypatch) as ndarray:
            issued = issued_launches(monkeypatch)
            yield request.param, lambda shape, dtype: ndarray(shape, dtype), _cupy_ptr, issued


def _cupy_ptr(a) -> int:
    return a.data.ptr


def _planned(wrapper, framework):
    """The wrapper with its uploads on the framework's current stream (no event order)."""
    wrapper._ws.stream_ptr = STREAM[framework]
    return wrapper


def _decode(empty, framework, batch=3, pages=12):
    w = _planned(rtcinfer.BatchDecodeWithPagedKVCacheWrapper(), framework)
    indptr = np.linspace(0, pages, batch + 1).astype(np.int32)
    w.plan(indptr, np.arange(pages, dtype=np.int32), np.full(batch, 5, np.int32), 8, 2, 128, 16,
           q_data_type="float16")  # fmt: skip
    return w, empty((batch, 8, 128), "float16"), empty((pages, 2, 16, 2, 128), "float16")


def _runs(empty, framework):
    """(name, wrapper, run's arguments, its keywords) of each case."""
    dec, q, cache = _decode(empty, framework)
    pair = (empty((12, 16, 2, 128), "float16"), empty((12, 16, 2, 128), "float16"))
    ragged = _planned(rtcinfer.BatchPrefillWithRaggedKVCacheWrapper(), framework)
    qo = np.array([0, 5, 9, 30], np.int32)
    ragged.plan(qo, qo * 2, 8, 2, 128, causal=True, q_data_type="float16")
    rq, rk = empty((30, 8, 128), "float16"), empty((60, 2, 128), "float16")
    paged = _planned(rtcinfer.BatchPrefillWithPagedKVCacheWrapper(), framework)
    paged.plan(qo, np.array([0, 2, 5, 12], np.int32), np.arange(12, dtype=np.int32),
               np.array([3, 16, 9], np.int32), 8, 2, 128, 16, causal=True,
               q_data_type="float16")  # fmt: skip
    mla = _planned(rtcinfer.BatchMLAPagedAttentionWrapper(), framework)
    mla.plan(np.arange(4, dtype=np.int32), np.array([0, 2, 3, 6], np.int32),
             np.arange(6, dtype=np.int32), np.array([20, 5, 40], np.int32), 16, 512, 64, 16,
             False, 0.1, "bfloat16", "bfloat16")  # fmt: skip
    m = [empty((3, 16, 512), "bfloat16"), empty((3, 16, 64), "bfloat16")]
    m += [empty((6, 16, 512), "bfloat16"), empty((6, 16, 64), "bfloat16")]
    return [
        ("decode", dec, (q, cache), {}),
        ("decode, lse", dec, (q, cache), {"return_lse": True}),
        ("decode, (k, v)", dec, (q, pair), {}),
        ("decode, out given", dec, (q, cache), {"out": empty((3, 8, 128), "float16")}),
        ("ragged", ragged, (rq, rk, rk), {}),
        ("ragged, lse", ragged, (rq, rk, rk), {"return_lse": True}),
        ("paged", paged, (rq, cache), {}),
        ("paged, (k, v), lse", paged, (rq, pair), {"return_lse": True}),
        ("mla", mla, tuple(m), {}),
        ("mla, lse", mla, tuple(m), {"return_lse": True}),
    ]


def _flat(x) -> list:
    if isinstance(x, (tuple, list)):
        return [a for item in x for a in _flat(item)]
    return [x] if hasattr(x, "shape") else []


def _issue_record(issue, args, kwargs, result, address):
    arrays = [*_flat(args), *_flat(list(kwargs.values())), *_flat(result)]
    return pointed(issue, arrays, address)


def _learnt(wrapper, framework) -> list:
    tag = shortcut.TAG if framework == "torch" else shortcut.CUPY_TAG
    return list(shortcut_entries(wrapper._op, tag).values())


@pytest.mark.parametrize("case", range(10))
def test_a_repeated_run_issues_what_the_function_issues(kit, case):
    framework, empty, address, issued = kit
    name, wrapper, args, kwargs = _runs(empty, framework)[case]
    function = type(wrapper).run.__wrapped__
    records, shapes = [], []
    for n in range(5):  # seen, learnt, the shortcut twice, the function itself
        run = function.__get__(wrapper) if n == 4 else wrapper.run
        result = run(*args, **kwargs)
        records.append(_issue_record(issued[n], args, kwargs, result, address))
        shapes.append([(tuple(a.shape), str(a.dtype)) for a in _flat(result)])
    assert len(issued) == 5 and {i[4] for i in issued} == {STREAM[framework]}, name
    assert records[1] == records[2] == records[3] == records[4] == records[0], name
    assert shapes[1] == shapes[2] == shapes[3] == shapes[0], name
    learnt = _learnt(wrapper, framework)
    assert len(learnt) == 1 and callable(learnt[0]), name
    if "out" in kwargs:
        assert result is kwargs["out"], name


def test_the_shortcut_follows_each_plan(kit):
    """A learnt signature launches on the latest plan: another batch is another signature
    (learnt in its turn), other lengths of the same batch the same one, each launch the
    function's block for that plan (its grid, its work)."""
    framework, empty, address, issued = kit
    w, q, cache = _decode(empty, framework)
    function = type(w).run.__wrapped__.__get__(w)
    records = []
    for pages, batch in ((12, 3), (6, 3), (12, 2), (3, 3)):
        indptr = np.linspace(0, pages, batch + 1).astype(np.int32)
        w.plan(indptr, np.arange(pages, dtype=np.int32)[::-1].copy(), np.full(batch, 9, np.int32),
               8, 2, 128, 16, q_data_type="float16", fixed_split_size=1)  # fmt: skip
        q = empty((batch, 8, 128), "float16")
        for run in (w.run, w.run, w.run, function):  # noted or hit, learnt or hit, hit
            result = run(q, cache)
            records.append(_issue_record(issued[-1], (q, cache), {}, result, address))
        assert records[-4] == records[-3] == records[-2] == records[-1], (pages, batch)
    assert len(issued) == 16
    assert len({r[1] for r in records}) > 1  # the plans' grids differ
    assert len(_learnt(w, framework)) == 2  # batches of 3 and 2


def test_a_cache_smaller_than_the_plan_takes_the_function_which_raises(kit):
    framework, empty, address, issued = kit
    w, q, cache = _decode(empty, framework)
    w.run(q, cache)
    w.run(q, cache)  # learnt, then the shortcut
    w.plan(np.array([0, 4, 8, 20], np.int32), np.arange(20, dtype=np.int32),
           np.full(3, 5, np.int32), 8, 2, 128, 16, q_data_type="float16")  # fmt: skip
    with pytest.raises(ValueError, match="page id 19, but the cache has 12 pages"):
        w.run(q, cache)
    assert len(issued) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"k_scale": 2.0},
        {"q_scale": 0.5, "v_scale": 3.0},
        {"window_left": -1},
        {"lse": "given"},
        {"return_lse": 1},
    ],
)
def test_runs_with_options_issue_what_the_function_issues(kit, kwargs):
    """Options the shortcut leaves to the function (scales, window_left, a given lse, a
    return_lse that is not a bool) give the function's launch, after the plain call learnt
    its signature."""
    framework, empty, address, issued = kit
    w, q, cache = _decode(empty, framework)
    if "lse" in kwargs:
        kwargs = {"lse": empty((3, 8), "float32")}
    w.run(q, cache)  # the plain signature, noted
    function = type(w).run.__wrapped__.__get__(w)
    result = w.run(q, cache, **kwargs)
    first = _issue_record(issued[-1], (q, cache), kwargs, result, address)
    result = function(q, cache, **kwargs)
    assert first == _issue_record(issued[-1], (q, cache), kwargs, result, address)
    assert _learnt(w, framework) == [] and noted(w._op) == 1  # only the plain call's


def test_a_list_cache_takes_the_function(kit):
    """A (k, v) list (kv_pair takes it) is no signature of the shortcut's: every call runs the
    function, which launches."""
    framework, empty, address, issued = kit
    w, q, cache = _decode(empty, framework)
    pair = [empty((12, 16, 2, 128), "float16"), empty((12, 16, 2, 128), "float16")]
    for _ in range(3):
        w.run(q, pair)
    assert len(issued) == 3 and _learnt(w, framework) == [] and noted(w._op) == 0
    w.run(q, cache)
    assert noted(w._op) == 1


def test_a_dropped_wrapper_is_collected_after_shortcut_runs(kit):
    import gc
    import weakref

    framework, empty, address, issued = kit
    w, q, cache = _decode(empty, framework)
    for _ in range(3):
        w.run(q, cache)
    assert len(_learnt(w, framework)) == 1
    ref = weakref.ref(w)
    del w
    gc.collect()
    assert ref() is None


def test_alternating_signatures_write_their_own_fields(kit):
    """Two learnt signatures on one plan (o alone, then o and lse; a (k, v) pair of other
    strides) take turns: each shortcut launch writes its own fields (the lse pointer 0, the
    pair's strides) where the other filled the launch last."""
    framework, empty, address, issued = kit
    w, q, cache = _decode(empty, framework)
    pair = (empty((12, 16, 2, 128), "float16"), empty((12, 16, 2, 128), "float16"))
    function = type(w).run.__wrapped__.__get__(w)
    calls = [((q, cache), {}), ((q, cache), {"return_lse": True}), ((q, pair), {})]
    for args, kwargs in calls * 3:  # noted, learnt, then the shortcuts in turn
        w.run(*args, **kwargs)
    got = [_issue_record(i, *calls[n % 3], None, address) for n, i in enumerate(issued[6:])]
    for args, kwargs in calls:
        function(*args, **kwargs)
    want = [_issue_record(i, *calls[n], None, address) for n, i in enumerate(issued[9:])]
    blank = [(k, g, b, {f: v for f, v in fields.items() if f not in ("o", "lse")})
             for k, g, b, fields in got + want]  # fmt: skip
    assert blank[:3] == blank[3:]
    assert [not r[3]["lse"] for r in got] == [True, False, True]  # (a null pointer: None)
    assert [callable(v) for v in _learnt(w, framework)] == [True] * 3


def test_a_shortcut_run_under_capture_notes_the_captured_batch(kit, monkeypatch):
    """A CUDA-graph decode wrapper's shortcut run while its stream is being captured records
    the batch, as the function's does: a later plan of a larger batch is refused."""
    from rtcinfer.attention import planned

    framework, empty, address, issued = kit
    capturing = [False]
    monkeypatch.setattr(planned, "is_capturing", lambda stream: capturing[0])
    w = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(
        use_cuda_graph=True, paged_kv_indptr_buffer=np.zeros(7, np.int32),
        paged_kv_indices_buffer=np.zeros(100, np.int32),
    )  # fmt: skip
    w.plan(np.linspace(0, 12, 4).astype(np.int32), np.arange(12, dtype=np.int32),
           np.full(3, 5, np.int32), 8, 2, 128, 16, q_data_type="float16")  # fmt: skip
    _planned(w, framework)
    q, cache = empty((3, 8, 128), "float16"), empty((12, 2, 16, 2, 128), "float16")
    w.run(q, cache)
    w.run(q, cache)  # noted, learnt: eager runs
    assert w._captured is None and len(_learnt(w, framework)) == 1
    capturing[0] = True
    w.run(q, cache)  # the shortcut, captured
    assert w._captured == 3 and len(issued) == 3
    with pytest.raises(ValueError, match="captured into a CUDA graph with 3"):
        w.plan(np.linspace(0, 12, 5).astype(np.int32), np.arange(12, dtype=np.int32),
               np.full(4, 3, np.int32), 8, 2, 128, 16, q_data_type="float16")  # fmt: skip
