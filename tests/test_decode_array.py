"""Batch decode with its plan as an array (attention/decode_array.py) without a GPU: the packed
plan at a fixed size, the launch that reads it from a call slot (recorded and planned as XLA
would launch it), and the checks that keep a plan inside the arrays it runs on."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer.attention import decode
from rtcinfer.interop import xla_launch
from rtcinfer.interop.call import ArrayInfo, dense_strides

from .fakes import packing_upload, planning_without_a_gpu

MAX_BATCH, MAX_PAGES = 8, 64


@pytest.fixture
def graph_wrapper(monkeypatch):
    """A decode wrapper of fixed capacity (8 requests, 64 pages) whose plan() runs without a
    GPU (device queries and upload stubbed; the plan is packed as it would be)."""
    regions = dict.fromkeys(("plan", "counters", "lse", "o", "end"), 0)
    planning_without_a_gpu(monkeypatch, regions, packing_upload)
    monkeypatch.setattr(decode, "device_limits", lambda device: (132, 227 * 1024))
    monkeypatch.setattr(decode, "ctas_per_sm", lambda spec, device: 2)
    return decode.BatchDecodeWithPagedKVCacheWrapper(
        use_cuda_graph=True, paged_kv_indptr_buffer=np.zeros(MAX_BATCH + 1, np.int32),
        paged_kv_indices_buffer=np.zeros(MAX_PAGES, np.int32),
    )  # fmt: skip


def _plan(w, lengths, pages):
    counts = [-(-n // 16) for n in lengths]
    indptr = np.cumsum([0, *counts])
    last = [n - 16 * (c - 1) for n, c in zip(lengths, counts, strict=True)]
    w.plan(indptr, pages[: indptr[-1]], last, 32, 8, 128, 16, q_data_type="bfloat16")


def _info(shape, dtype):
    return ArrayInfo(tuple(shape), dense_strides(shape), dtype, 0)


def test_plan_array_is_the_packed_plan_at_one_size(graph_wrapper):
    w = graph_wrapper
    pages = np.random.default_rng(0).permutation(MAX_PAGES).astype(np.int32)
    sizes = set()
    for lengths in ([100, 7, 300], [1, 1], [600, 17, 64, 5, 9]):
        _plan(w, lengths, pages)
        a = w.plan_array()
        sizes.add(a.shape)
        packed = w._launch.packed
        assert a.dtype == np.int32 and a.shape == (w.plan_array_size,)
        assert (a[: packed.shape[0]] == packed).all() and not a[packed.shape[0] :].any()
        assert a[0] >= len(lengths)  # the work items: at least one a request
        assert not a[1 : 4 + 128].any()  # no RoPE: zeros, whatever the reused buffer held
        out = np.full(w.plan_array_size, 7, np.int32)  # written in place, the rest zeroed
        assert w.plan_array(out=out) is out and (out == a).all()
    assert sizes == {(w.plan_array_size,)}
    with pytest.raises(ValueError, match="NumPy int32 array of shape"):
        w.plan_array(out=np.zeros(3, np.int32))


def test_plan_arrays_need_a_fixed_capacity(graph_wrapper, monkeypatch):
    w = decode.BatchDecodeWithPagedKVCacheWrapper()
    _plan(w, [5], np.arange(4, dtype=np.int32))
    with pytest.raises(ValueError, match="fixed capacity"):
        w.plan_array()


def test_the_launch_reads_only_its_arrays(graph_wrapper):
    """Recorded as XLA would launch it: q, the cache and the plan array in; o and the scratch
    out (the merge counters zeroed first); the grid is the capacity's, whatever the plan."""
    w = graph_wrapper
    _plan(w, [100, 7, 300], np.arange(MAX_PAGES, dtype=np.int32))
    st = w._launch
    cap = w._ws.capacity
    infos = [_info((5, 32, 128), "bfloat16"), _info((MAX_PAGES, 2, 16, 8, 128), "bfloat16"),
             None, None, None, _info((w.plan_array_size,), "int32")]  # fmt: skip
    static = (st.cfg, w._kernel[0], cap, False)
    prep = w._prepare_array_run(infos, 16, static)
    assert [o.shape for o in prep.outs] == [
        (5, 32, 128), (cap.max_batch * st.cfg.kv_blocks,),
        (cap.max_work * 32 * 129,),
    ]  # fmt: skip
    assert prep.scratch == 2 and prep.command_buffer
    present = [x is not None for x in infos]
    steps = xla_launch.record(prep, present, (0.088, 1.0), 0)
    (n,) = xla_launch.plan(prep, present, steps)
    assert n.grid == (st.cfg.kv_blocks, cap.max_work, 1)
    assert n.operands == (0, 1, 5) and n.results == (6, 8, 7)  # o, partials, counters
    assert n.zero == (0, 0, 4 * cap.max_batch * st.cfg.kv_blocks)
    assert n.bound["plan"] == 2 and n.bound["q"] == 0 and n.bound["v_cache"] == 1


def test_plans_stay_inside_the_arrays_they_run_on(graph_wrapper):
    w = graph_wrapper
    pages = np.arange(MAX_PAGES, dtype=np.int32)
    _plan(w, [100, 7], pages)
    st = w._launch
    static = (st.cfg, w._kernel[0], w._ws.capacity, False)
    cache = _info((20, 2, 16, 8, 128), "bfloat16")
    plan = _info((w.plan_array_size,), "int32")
    q = _info((2, 32, 128), "bfloat16")
    with pytest.raises(ValueError, match="plan_array: expected int32"):
        w._prepare_array_run([q, cache, None, None, None, _info((9,), "int32")], 16, static)
    w._prepare_array_run([q, cache, None, None, None, plan], 16, static)
    with pytest.raises(ValueError, match="page id 63, but run\\(plan_array=...\\) was prepared "
                       "with a cache of 20 pages"):  # fmt: skip
        _plan(w, [100, 7], pages[::-1].copy())
    small = _info((4, 2, 16, 8, 128), "bfloat16")  # the plan (page ids 0-7) reads past it
    with pytest.raises(ValueError, match="page id 7, but the cache has 4 pages"):
        w._prepare_array_run([q, small, None, None, None, plan], 16, static)


def test_plans_stay_on_the_host_until_a_run_reads_the_workspace(graph_wrapper, monkeypatch):
    """While every run reads its plan from an array, plan() uploads nothing (plan_array()
    still gives each plan); the first run on the workspace sends the latest plan, and later
    plans upload at once again."""
    from rtcinfer.attention import planned
    from rtcinfer.attention.workspace import Workspace

    sent = []

    def upload(ws, fill, stream, after=None):
        buf = np.zeros(ws.capacity.plan_ints, np.int32)
        sent.append(buf[: fill(buf)])

    monkeypatch.setattr(Workspace, "upload", upload)
    w = graph_wrapper
    pages = np.arange(MAX_PAGES, dtype=np.int32)
    _plan(w, [100, 7], pages)  # no run on an array yet: uploaded
    st = w._launch
    infos = [_info((2, 32, 128), "bfloat16"), _info((MAX_PAGES, 2, 16, 8, 128), "bfloat16"),
             None, None, None, _info((w.plan_array_size,), "int32")]  # fmt: skip
    w._prepare_array_run(infos, 16, (st.cfg, w._kernel[0], w._ws.capacity, False))
    _plan(w, [5, 9, 300], pages)
    _plan(w, [40, 1], pages)
    assert len(sent) == 1
    latest = w.plan_array()
    monkeypatch.setattr(planned, "call", lambda op, arrays, static, scalars: None)
    w._call((), (), ())  # a run on the workspace's plan
    assert len(sent) == 2
    np.testing.assert_array_equal(sent[1], latest[: sent[1].shape[0]])
    _plan(w, [5, 9], pages)
    assert len(sent) == 3
