"""The host side of batch prefill without a GPU: plan() validation, the packed work items read
back the way prefill.cu reads them, and the run() signature checks."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer.attention.prefill_plan import HEADER_INTS, ITEM_INTS, RAGGED_PAGE, WORK_ITEM
from rtcinfer.interop import ArrayInfo, dense_strides

from .fakes import fake_gpu


@pytest.fixture
def wrappers(monkeypatch):
    """Prefill wrappers whose plan() runs without a GPU: device queries, the kernel's occupancy
    and the upload are stubbed; the packed plan is kept for reading back."""
    import cupy

    from rtcinfer.attention import prefill
    from rtcinfer.attention.workspace import Workspace
    from rtcinfer.launch import Kernel

    class Device:
        id = 0
        ptr = 0

        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *args):
            return False

    packed = {}

    def upload(self, fill, stream):
        buf = np.zeros(1 << 20, np.int32)
        packed["plan"] = buf[: fill(buf)]

    regions = dict.fromkeys(("plan", "counters", "lse", "o", "end"), 0)
    fake_gpu(monkeypatch)
    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: Device())
    monkeypatch.setattr(prefill, "device_limits", lambda device: (132, 227 * 1024))
    monkeypatch.setattr(Kernel, "occupancy", lambda self, device, threads: 1)
    monkeypatch.setattr(
        Workspace, "reserve", lambda self, need, stream, grow: setattr(self, "pointers", regions)
    )
    monkeypatch.setattr(Workspace, "upload", upload)
    return prefill, packed


def items_of(packed):
    plan = packed["plan"]
    w = int(plan[0])
    return plan[HEADER_INTS : HEADER_INTS + ITEM_INTS * w].view(WORK_ITEM), plan


def test_ragged_plan_packs_items_by_name(wrappers):
    prefill, packed = wrappers
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    qo_indptr, kv_indptr = [0, 10, 10, 300], [0, 50, 60, 360]
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, 128, causal=True, q_data_type="bfloat16")
    items, plan = items_of(packed)
    pages_at = HEADER_INTS + ITEM_INTS * items.shape[0]
    assert set(items["qo_start"]) == {0, 10}  # the request with no queries has no tile
    request_at = {0: 0, 10: 2}  # qo_start -> request (request 1 has no queries)
    for it in items:
        b = request_at[int(it["qo_start"])]
        assert plan[it["page_ids"]] == kv_indptr[b]  # a ragged request: one "page" at its row
        assert it["page_ids"] - pages_at == b
        assert it["kv_end"] <= it["kv_len"] == kv_indptr[b + 1] - kv_indptr[b]
    launch = wrapper._launch.launch
    assert launch.grid == (2, items.shape[0], 1) and launch.params.page_size == RAGGED_PAGE
    assert launch.params.group_size == 4 and launch.kernel.spec.causal


def test_paged_plan_reads_the_table(wrappers):
    prefill, packed = wrappers
    wrapper = prefill.BatchPrefillWithPagedKVCacheWrapper()
    indptr, indices, last = [0, 2, 5], [7, 3, 0, 9, 4], [5, 16]
    wrapper.plan([0, 4, 40], indptr, indices, last, 8, 2, 128, 16, causal=True,
                 q_data_type="float16")  # fmt: skip
    items, plan = items_of(packed)
    pages_at = HEADER_INTS + ITEM_INTS * items.shape[0]
    np.testing.assert_array_equal(plan[pages_at:], indices)
    for it in items:
        b = 0 if it["qo_start"] == 0 else 1
        assert it["kv_len"] == [21, 48][b] and it["page_ids"] == pages_at + indptr[b]
    assert wrapper._launch.num_kv_rows == 10  # the largest page id + 1


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(custom_mask=np.ones(4, bool)), ValueError, "custom masks are not supported yet"),
        (dict(head_dim_vo=64), ValueError, r"head_dim_vo \(64\) != head_dim_qk"),
        (dict(pos_encoding_mode="ROPE_LLAMA"), ValueError, "ROPE_LLAMA.* not supported yet"),
        (dict(kv_data_type="float8_e4m3fn"), TypeError, "fp8 KV.* not supported yet"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap must be None or >= 0"),
    ],
)  # fmt: skip
def test_what_is_not_built_yet_says_so(wrappers, kwargs, error, match):
    prefill, _ = wrappers
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    with pytest.raises(error, match=match):
        wrapper.plan([0, 4], [0, 8], 8, 2, 128, q_data_type="bfloat16", **kwargs)


def test_mismatched_batches_and_bad_page_ids_are_refused(wrappers):
    prefill, _ = wrappers
    ragged = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    with pytest.raises(ValueError, match="must describe the same batch"):
        ragged.plan([0, 4, 8], [0, 8], 8, 2, 128, q_data_type="bfloat16")
    paged = prefill.BatchPrefillWithPagedKVCacheWrapper()
    with pytest.raises(ValueError, match=r"paged_kv_indices\[1\] \(-3\) is not a valid page id"):
        paged.plan([0, 4], [0, 2], np.array([1, -3], np.int32), [16], 8, 2, 128, 16,
                   q_data_type="bfloat16")  # fmt: skip
    with pytest.raises(ValueError, match=r"must have paged_kv_indptr\[-1\] \(2\) entries"):
        paged.plan([0, 4], [0, 2], [1], [16], 8, 2, 128, 16, q_data_type="bfloat16")


def info(shape, dtype="bfloat16"):
    return ArrayInfo(tuple(shape), dense_strides(shape), dtype, 0)


def test_run_names_host_arrays_and_lists_before_checking_shapes(wrappers):
    prefill, _ = wrappers
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan([0, 3, 10], [0, 5, 20], 8, 2, 128, causal=True, q_data_type="bfloat16")
    kv = np.zeros((20, 2, 128), np.float16)
    with pytest.raises(TypeError, match=r"^q: expected a CUDA array .* host numpy.ndarray of "
                                        r"shape \(4, 4\); move it to the GPU first$"):  # fmt: skip
        wrapper.run(np.zeros((4, 4), np.float32), kv, kv)
    with pytest.raises(TypeError, match=r"^q must be an array .* got tuple$"):
        wrapper.run((0.0, 1.0), kv, kv)


def test_run_checks_arrays_against_the_plan(wrappers):
    prefill, _ = wrappers
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan([0, 3, 10], [0, 5, 20], 8, 2, 128, causal=True, q_data_type="bfloat16")
    st = wrapper._launch
    static = (st.cfg, st.nnz_q, False)
    good = [info((10, 8, 128)), info((20, 2, 128)), info((20, 2, 128)), None, None]
    prep = wrapper._prepare_run(good, 16, static)
    assert [o.shape for o in prep.outs] == [(10, 8, 128)]
    with pytest.raises(ValueError, match=r"q: expected shape \(10, 8, 128\)"):
        wrapper._prepare_run([info((9, 8, 128))] + good[1:], 16, static)
    with pytest.raises(ValueError, match=r"v: expected shape \(nnz_kv, 2, 128\)"):
        wrapper._prepare_run(good[:2] + [info((20, 4, 128))] + good[3:], 16, static)
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        wrapper._prepare_run([good[0]._replace(offset=8)] + good[1:], 16, static)
