"""Batch prefill with its plan as an array (attention/prefill_array.py) without a GPU: the
array is the plan region as the device holds it (items expanded as the device would), at one
size for every plan; the launch reads it from a call slot, recorded as XLA would launch it; the
checks that keep a plan inside the arrays it runs on."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer.interop import xla_launch

from . import test_prefill_host as host
from .test_prefill_host import Buf, info

KW = dict(causal=True, q_data_type="bfloat16")


@pytest.fixture
def wrappers(monkeypatch):
    """test_prefill_host's: the prefill module and its wrappers planning without a GPU, the
    plan region as the device holds it in packed["plan"]."""
    return host.wrappers.__wrapped__(monkeypatch)


def _paged(prefill, batch=4, pages=64):
    return prefill.BatchPrefillWithPagedKVCacheWrapper(
        use_cuda_graph=True, qo_indptr_buf=Buf(batch + 1), paged_kv_indices_buf=Buf(pages)
    )


def _plan(w, qo, kv_len, pages):
    counts = [-(-n // 16) for n in kv_len]
    indptr = np.cumsum([0, *counts])
    last = [n - 16 * (c - 1) if c else 0 for n, c in zip(kv_len, counts, strict=True)]
    w.plan(np.cumsum([0, *qo]), indptr, pages[: indptr[-1]], last, 8, 2, 128, 16, **KW)


def test_plan_array_is_the_plan_region_the_device_holds(wrappers):
    """Each plan's array is what plan() leaves in the plan region, the items the device
    expands included (their NumPy twin), then zeros; one size for every plan."""
    prefill, packed = wrappers
    w = _paged(prefill)
    pages = np.random.default_rng(1).permutation(64).astype(np.int32)
    sizes = set()
    batches = (([100, 7, 1], [300, 7, 40]), ([1, 1], [900, 17]), ([30, 0, 70, 2], [30, 5, 200, 2]))
    for qo, kv in batches:  # at most the first plan's 108 query rows
        _plan(w, qo, kv, pages)
        a = w.plan_array()
        region = packed["plan"]
        sizes.add(a.shape)
        assert a.dtype == np.int32 and a.shape == (w.plan_array_size,)
        np.testing.assert_array_equal(a[: region.shape[0]], region)
        assert not a[region.shape[0] :].any()
        out = np.full(w.plan_array_size, 9, np.int32)
        assert w.plan_array(out=out) is out and (out == a).all()
    assert sizes == {(w.plan_array_size,)}


def test_plan_arrays_need_a_fixed_capacity(wrappers):
    prefill, _ = wrappers
    w = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan([0, 5], [0, 9], 8, 2, 128, **KW)
    with pytest.raises(ValueError, match="fixed capacity"):
        w.plan_array()


def test_the_launch_reads_only_its_arrays(wrappers):
    """Recorded as XLA would launch it: q, the cache and the plan array in; o and the scratch
    out (the merge counters zeroed first), on the graph launch's grid."""
    prefill, _ = wrappers
    w = _paged(prefill)
    _plan(w, [100, 7, 1], [300, 7, 40], np.arange(64, dtype=np.int32))
    st, cap = w._launch, w._fixed.capacity
    infos = [info((108, 8, 128)), info((64, 2, 16, 2, 128)), None, None, None,
             info((w.plan_array_size,), "int32")]  # fmt: skip
    prep = w._prepare_array_run(infos, 16, (st.cfg, st.nnz_q, cap, False))
    assert prep.scratch == 2 and prep.command_buffer
    present = [x is not None for x in infos]
    (n,) = xla_launch.plan(prep, present, xla_launch.record(prep, present, (0.088, 1.0), 0))
    assert n.grid == st.launch.grid and n.kernel is st.launch.kernel
    assert n.operands == (0, 1, 5) and set(n.results) == {6, 7, 8}
    assert n.zero[n.results.index(7)] == 4 * cap.max_tiles * cap.num_kv_heads  # counters
    assert n.bound["plan"] == 2


def test_plans_stay_inside_the_arrays_they_run_on(wrappers):
    prefill, _ = wrappers
    w = _paged(prefill)
    pages = np.arange(64, dtype=np.int32)
    _plan(w, [100, 7], [300, 7], pages)  # pages 0-19
    st, cap = w._launch, w._fixed.capacity
    static = (st.cfg, st.nnz_q, cap, False)
    q, plan = info((107, 8, 128)), info((w.plan_array_size,), "int32")
    with pytest.raises(ValueError, match="plan_array: expected int32"):
        w._prepare_array_run([q, info((30, 2, 16, 2, 128)), None, None, None,
                              info((7,), "int32")], 16, static)  # fmt: skip
    with pytest.raises(ValueError, match="reads 20 key rows .pages., but the cache has 10"):
        w._prepare_array_run([q, info((10, 2, 16, 2, 128)), None, None, None, plan], 16, static)
    w._prepare_array_run([q, info((30, 2, 16, 2, 128)), None, None, None, plan], 16, static)
    with pytest.raises(ValueError, match="prepared with a cache of 30"):
        _plan(w, [100, 7], [300, 7], pages[::-1].copy())  # page 63


def test_items_plan_expands_on_the_device_come_expanded(wrappers):
    """A batch that fills the GPU without split KV: plan() uploads the requests' table and has
    the device write the items (prefill_items.py); plan_array() writes them on the host."""
    from rtcinfer.plan.prefill import TilePlan

    prefill, packed = wrappers
    w = _paged(prefill, pages=512)
    qo = [1500, 1200, 900]
    _plan(w, qo, qo, np.random.default_rng(2).permutation(512).astype(np.int32))
    assert isinstance(w._launch.plan, TilePlan)
    a, region = w.plan_array(), packed["plan"]
    np.testing.assert_array_equal(a[: region.shape[0]], region)
    assert a[0] == w._launch.plan.num_work and a[: region.shape[0]].any()


def test_a_padding_request_without_keys_fixes_the_rows(wrappers):
    """serve_jax's prefill steps: each step's prompts, then a request of the padding rows with
    no pages, so that every plan has the same query rows (the graph wrapper's first plan's)."""
    prefill, _ = wrappers
    w = _paged(prefill, batch=9, pages=512)
    pages = np.arange(512, dtype=np.int32)
    for prompts in ([37, 300], [5], [129, 64, 17]):
        counts = [-(-n // 16) for n in prompts]
        indptr = np.cumsum([0, *counts, 0])  # the padding request: no pages
        last = [n - 16 * (c - 1) for n, c in zip(prompts, counts, strict=True)] + [0]
        qo = np.append(np.cumsum([0, *prompts]), 512)
        w.plan(qo, indptr, pages[: indptr[-1]], last, 8, 2, 128, 16, **KW)
        assert w._launch.nnz_q == 512 and w.plan_array().shape == (w.plan_array_size,)
