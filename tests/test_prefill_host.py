"""The host side of batch prefill without a GPU: plan() validation, the packed work items read
back the way prefill.cu reads them, and the run() signature checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rtcinfer.attention.prefill_items import expand_items_host
from rtcinfer.attention.prefill_plan import (
    HEADER_INTS,
    ITEM_INTS,
    RAGGED_PAGE,
    WORK_ITEM,
    items_at,
)
from rtcinfer.interop import ArrayInfo, dense_strides

from .fakes import planning_without_a_gpu


@pytest.fixture
def wrappers(monkeypatch):
    """Prefill wrappers whose plan() runs without a GPU: device queries, the kernel's occupancy
    and the upload are stubbed; the packed plan is kept for reading back."""

    from rtcinfer.attention import prefill, prefill_wrapper
    from rtcinfer.launch import Kernel

    packed = {}

    def upload(self, fill, stream):
        buf = np.zeros(1 << 20, np.int32)
        packed["plan"] = buf[: fill(buf)]

    def expand(layout):  # the device's expansion of the items, by its NumPy twin
        expand_items_host(packed["plan"], layout)

    regions = dict.fromkeys(("plan", "counters", "lse", "o", "end"), 0)
    planning_without_a_gpu(monkeypatch, regions, upload, expand)
    monkeypatch.setattr(prefill_wrapper, "device_limits", lambda device: (132, 227 * 1024))
    monkeypatch.setattr(Kernel, "occupancy", lambda self, device, threads: 1)
    return prefill, packed


def items_of(packed, head_dim=128):
    plan = packed["plan"]
    w, start = int(plan[0]), items_at(head_dim)
    return plan[start : start + ITEM_INTS * w].view(WORK_ITEM), plan


def test_ragged_plan_packs_items_by_name(wrappers):
    prefill, packed = wrappers
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    qo_indptr, kv_indptr = [0, 10, 10, 300], [0, 50, 60, 360]
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, 128, causal=True, q_data_type="bfloat16")
    items, plan = items_of(packed)
    pages_at = items_at(128) + ITEM_INTS * items.shape[0]
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


def test_a_replan_of_the_same_grid_keeps_its_launch_and_rewrites_its_regions(wrappers):
    """A plan whose configuration, kernel and grid are the last plan's reuses its launch (no
    new parameter block), its plan regions written again; another grid or configuration makes
    a new one."""
    prefill, _ = wrappers
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    first = [0, 10, 300], [0, 50, 350]
    wrapper.plan(*first, 8, 2, 128, causal=True, q_data_type="bfloat16")
    launch = wrapper._launch.launch
    launch.params.plan = 12345  # a stale region: plan() must write it again
    wrapper.plan([0, 290, 300], [0, 300, 350], 8, 2, 128, causal=True, q_data_type="bfloat16")
    assert wrapper._launch.launch is launch and not launch.params.plan  # region 0 here
    assert wrapper._launch.nnz_q == 300
    wrapper.plan([0, 10], [0, 50], 8, 2, 128, causal=True, q_data_type="bfloat16")
    assert wrapper._launch.launch is not launch  # fewer tiles: another grid
    launch = wrapper._launch.launch
    wrapper.plan([0, 10], [0, 50], 8, 2, 128, causal=False, q_data_type="bfloat16")
    assert wrapper._launch.launch is not launch  # another configuration


def test_configurations_keep_the_hash_of_their_fields(wrappers):
    """A plan's configuration keys every run()'s prepared launch, so it keeps its hash: that of
    its fields (as a frozen dataclass computes it), equal for an equal one built by another
    plan, and another for another configuration."""
    prefill, _ = wrappers
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan([0, 10], [0, 50], 8, 2, 128, causal=True, q_data_type="bfloat16")
    first = wrapper._launch.cfg
    wrapper.plan([0, 20], [0, 60], 8, 2, 128, causal=True, q_data_type="bfloat16")
    again = wrapper._launch.cfg
    assert again == first and hash(again) == hash(first)
    assert hash(first) == hash(tuple(getattr(first, f) for f in first.__dataclass_fields__))
    attn = first.attn
    assert hash(attn) == hash(tuple(getattr(attn, f) for f in attn.__dataclass_fields__))
    assert {(first, 10, False): "prepared"}.get((again, 10, False)) == "prepared"
    wrapper.plan([0, 10], [0, 50], 8, 2, 128, causal=False, q_data_type="bfloat16")
    other = wrapper._launch.cfg
    assert other != first and hash(other) != hash(first)


def test_paged_plan_reads_the_table(wrappers):
    prefill, packed = wrappers
    wrapper = prefill.BatchPrefillWithPagedKVCacheWrapper()
    indptr, indices, last = [0, 2, 5], [7, 3, 0, 9, 4], [5, 16]
    wrapper.plan([0, 4, 40], indptr, indices, last, 8, 2, 128, 16, causal=True,
                 q_data_type="float16")  # fmt: skip
    items, plan = items_of(packed)
    pages_at = items_at(128) + ITEM_INTS * items.shape[0]
    # the page ids follow the items (then, where the device expanded them, the requests table)
    np.testing.assert_array_equal(plan[pages_at : pages_at + 5], indices)
    for it in items:
        b = 0 if it["qo_start"] == 0 else 1
        assert it["kv_len"] == [21, 48][b] and it["page_ids"] == pages_at + indptr[b]
    assert wrapper._launch.num_kv_rows == 10  # the largest page id + 1
    # a preallocated, longer indices buffer: read only indptr[-1] entries far (FlashInfer's
    # semantics); what lies past them (garbage, invalid ids) is neither checked nor packed
    wrapper.plan([0, 4, 40], indptr, indices + [-1, 99, 12], last, 8, 2, 128, 16, causal=True,
                 q_data_type="float16")  # fmt: skip
    items, plan = items_of(packed)
    pages_at = items_at(128) + ITEM_INTS * items.shape[0]
    np.testing.assert_array_equal(plan[pages_at : pages_at + 5], indices)
    assert 99 not in plan  # the entries past indptr[-1] packed nowhere
    assert wrapper._launch.num_kv_rows == 10


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(head_dim_vo=64), ValueError,
         r"^head_dim_vo 64 != head_dim_qk 128: not with this pair \(the pairs taken: "
         r"\(192, 128\)\)$"),
        (dict(head_dim_vo=128.0), TypeError, "head_dim_vo must be an int or None"),
        (dict(kv_data_type="float16"), TypeError, "kv_data_type must be q's dtype"),
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
    with pytest.raises(ValueError, match=r"must have at least paged_kv_indptr\[-1\] \(2\) "):
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
    with pytest.raises(ValueError, match="out: needs 16-byte aligned rows"):
        wrapper._prepare_run(good[:3] + [info((10, 8, 128))._replace(offset=4), None], 16, static)


@pytest.mark.parametrize("largest", [4, 2**31 - 1])
def test_run_refuses_a_plan_with_a_page_past_the_cache(wrappers, monkeypatch, largest):
    """Paged prefill (and decode with use_tensor_cores) reads page ids from the plan, checked on
    the host: run() on a cache without the plan's largest page id raises before anything is
    launched, and runs once the plan fits the cache."""
    prefill, _ = wrappers
    from rtcinfer.launch import Launch

    calls = []
    monkeypatch.setattr(Launch, "__call__", lambda self, stream, device: calls.append(stream))
    wrapper = prefill.BatchPrefillWithPagedKVCacheWrapper()

    def run(indices):
        wrapper._ws.stream_ptr = None  # the fake upload records no stream
        wrapper.plan([0, 3, 10], [0, 1, 3], np.array(indices, np.int32), [5, 16], 8, 2, 128,
                     16, causal=True, q_data_type="bfloat16")  # fmt: skip
        st = wrapper._launch
        q, cache = info((10, 8, 128)), info((4, 2, 16, 2, 128))
        prep = wrapper._prepare_run([q, cache, None, None, None], 16, (st.cfg, st.nnz_q, False))
        wrapper._ws.stream_ptr = 5  # run() on the plan's stream: no event to record
        prep.run(5, 0, [1 << 20, 1 << 21, 0, 0, 0, 1 << 22], (1.0, 1.0))

    with pytest.raises(ValueError, match=rf"the plan reads {largest + 1} key rows \(pages\), but "
                                         r"the cache has 4"):  # fmt: skip
        run([0, largest, 2])
    assert calls == []
    run([0, 3, 2])
    assert calls == [5]


@pytest.fixture
def single(monkeypatch, wrappers):
    """single_prefill's prepare without a GPU (the wrappers fixture stubs the kernel's
    occupancy); the uploaded plan is kept for reading back."""
    from rtcinfer.attention import single_prefill

    uploads = []

    class Memory:
        ptr = 4096

    def device_copy(host, device, what=None):
        uploads.append(host.copy())
        return Memory()

    monkeypatch.setattr(single_prefill, "device_limits", lambda device: (132, 227 * 1024))
    monkeypatch.setattr(single_prefill, "device_copy", device_copy)
    return single_prefill, uploads


def test_single_prefill_reads_hnd_strides_and_packs_one_request(single):
    single_prefill, uploads = single
    static = (None, True, "HND", "NONE", None, -1, None, None, None, True)
    q, k = info((300, 8, 128), "float16"), info((2, 5000, 128), "float16")
    prep = single_prefill._prepare([q, k, k, None], 16, static)
    shapes = [o.shape for o in prep.outs]
    assert shapes[:2] == [(300, 8, 128), (300, 8)]
    split = len(shapes) > 2  # a long request on 2 kv heads is split across the GPU
    assert split
    (plan,) = uploads
    items = items_of({"plan": plan})[0]
    assert set(items["kv_len"]) == {5000} and set(items["qo_len"]) == {300}
    assert set(items["qo_start"]) == {0} and plan[items["page_ids"][0]] == 0
    assert (items["kv_end"] <= 5000).all() and (items["kv_begin"] < items["kv_end"]).all()
    launch = next(c.cell_contents for c in prep.run.__closure__
                  if type(c.cell_contents).__name__ == "Launch")  # fmt: skip
    params = launch.params
    assert (params.k_token, params.k_head) == (128 * 2, 5000 * 128 * 2)  # HND: [Hkv, kv, D]
    assert params.k_page == params.k_token and params.page_size == RAGGED_PAGE
    assert (params.q_stride_n, params.q_stride_h, params.o_stride_n) == (1024, 128, 1024)
    assert launch.grid == (2, int(plan[0]), 1)


def test_single_prefill_refuses_what_it_cannot_do():
    import rtcinfer

    q = np.zeros((4, 8, 128), np.float16)
    with pytest.raises(ValueError, match="not supported: scale_q"):
        rtcinfer.single_prefill_with_kv_cache(q, q, q, scale_q=q)
    with pytest.raises(ValueError, match="backend must be one of"):
        rtcinfer.single_prefill_with_kv_cache(q, q, q, backend="cudnn")
    with pytest.raises(ValueError, match=r"custom_mask: expected shape \(4, 4\)"):
        rtcinfer.single_prefill_with_kv_cache(q, q, q, custom_mask=np.ones(15, bool))


def mask_in_plan(packed, launch, nbytes: int) -> np.ndarray:
    """The packed mask bytes that travelled with the plan (the fixture's regions sit at
    address 0, so the kernel's mask pointer is their byte offset in the plan region)."""
    at = launch.params.mask
    return packed["plan"].view(np.uint8)[at : at + nbytes]


def test_custom_mask_is_packed_per_request_and_replaces_causal(wrappers):
    """A boolean host mask: each request's qo_len x kv_len bits packed (little-endian) on whole
    bytes of its own, its first byte in every work item of the request, the bytes uploaded
    with the plan after its page ids; causal is dropped."""
    prefill, packed = wrappers
    qo_indptr, kv_indptr = [0, 3, 3, 8], [0, 5, 9, 20]  # blocks of 3 x 5, 0 x 4, 5 x 11 bits
    rng = np.random.default_rng(0)
    mask = rng.random(15 + 55) < 0.5
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, 128, custom_mask=mask, causal=True,
                 q_data_type="bfloat16")  # fmt: skip
    want = np.concatenate([np.packbits(mask[:15], bitorder="little"),
                           np.packbits(mask[15:], bitorder="little")])  # fmt: skip
    launch = wrapper._launch.launch
    items, _ = items_of(packed)
    assert launch.params.mask == 4 * (items_at(128) + ITEM_INTS * len(items) + 3)  # 3 page ids
    np.testing.assert_array_equal(mask_in_plan(packed, launch, 9), want)
    for it in items:
        assert it["mask_byte"] == {0: 0, 3: 2}[int(it["qo_start"])]  # 15 bits = 2 bytes
    spec = launch.kernel.spec
    assert spec.custom_mask and not spec.causal
    with pytest.raises(ValueError, match=r"custom_mask: expected bool with .* = 70 elements"):
        wrapper.plan(qo_indptr, kv_indptr, 8, 2, 128, custom_mask=mask[:69],
                     q_data_type="bfloat16")  # fmt: skip
    with pytest.raises(ValueError, match="packed_custom_mask: expected uint8 with at least 9"):
        wrapper.plan(qo_indptr, kv_indptr, 8, 2, 128, packed_custom_mask=want[:8],
                     q_data_type="bfloat16")  # fmt: skip


def test_rope_frequencies_ride_in_the_plan_header(wrappers):
    from rtcinfer.attention.decode_kernel import rope_frequencies

    prefill, packed = wrappers
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan([0, 4], [0, 8], 8, 2, 64, q_data_type="bfloat16", pos_encoding_mode="ROPE_LLAMA",
                 rope_scale=2.0, rope_theta=5e5)  # fmt: skip
    plan = packed["plan"]
    freq = plan[HEADER_INTS : items_at(64)].view(np.float32).reshape(-1, 2)
    np.testing.assert_array_equal(freq, rope_frequencies(64, 2.0, 5e5))
    spec = wrapper._launch.launch.kernel.spec
    assert spec.pos_encoding_mode == "ROPE_LLAMA" and spec.smem_bytes % 16 == 0
    wrapper.plan([0, 4], [0, 8], 8, 2, 64, q_data_type="bfloat16")
    assert not packed["plan"][HEADER_INTS : items_at(64)].any()  # zero without RoPE


def test_cascade_levels_are_checked(wrappers):
    from rtcinfer.attention.shared_prefix import MultiLevelCascadeAttentionWrapper

    with pytest.raises(ValueError, match="num_levels must be an integer >= 1"):
        MultiLevelCascadeAttentionWrapper(0)
    wrapper = MultiLevelCascadeAttentionWrapper(2)
    one = [np.array([0, 4]), np.array([0, 1]), np.array([3]), np.array([4])]
    with pytest.raises(ValueError, match="qo_indptr_arr has 1 entries, the wrapper 2 levels"):
        wrapper.plan(*[[a] for a in one], 8, 2, 128, 16)
    with pytest.raises(ValueError, match="level 1 covers 5 query rows, level 0 covers 4"):
        wrapper.plan([one[0], np.array([0, 5])], [one[1]] * 2, [one[2]] * 2, [one[3]] * 2, 8, 2,
                     128, 16)  # fmt: skip
    wrapper.plan([one[0], np.array([0, 1, 4])], [one[1], np.array([0, 1, 2])],
                 [one[2], np.array([5, 6])], [one[3], np.array([2, 16])], 8, 2, 128, 16,
                 causal=True)  # fmt: skip
    first, last = (level._launch.launch.kernel.spec for level in wrapper._levels)
    assert not first.causal and last.causal  # the causal mask on the last level only
    with pytest.raises(RuntimeError, match="plan"):
        MultiLevelCascadeAttentionWrapper(1).run(None, None)


def test_fp8_kv_plans_its_kernel_and_takes_uint8_bytes(wrappers):
    prefill, _ = wrappers
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan([0, 3, 10], [0, 5, 20], 8, 2, 128, causal=True, q_data_type="bfloat16",
                 kv_data_type="float8_e4m3fn")  # fmt: skip
    st = wrapper._launch
    assert st.launch.kernel.spec.kv_dtype == "float8_e4m3fn"
    static = (st.cfg, st.nnz_q, False)
    for storage in ("float8_e4m3fn", "uint8"):
        kv = info((20, 2, 128), storage)
        prep = wrapper._prepare_run([info((10, 8, 128)), kv, kv, None, None], 16, static)
        assert [o.dtype for o in prep.outs] == ["bfloat16"]
    with pytest.raises(ValueError, match="dtype float8_e4m3fn, got"):
        kv = info((20, 2, 128), "bfloat16")
        wrapper._prepare_run([info((10, 8, 128)), kv, kv, None, None], 16, static)


class Buf:
    """A stand-in for a FlashInfer-style buffer: only its length is read."""

    def __init__(self, n):
        self.shape = (n,)


def test_graph_mode_fixes_rows_grid_and_layout(wrappers):
    prefill, _ = wrappers
    with pytest.raises(ValueError, match="needs qo_indptr_buf"):
        prefill.BatchPrefillWithRaggedKVCacheWrapper(use_cuda_graph=True)
    with pytest.raises(ValueError, match="needs paged_kv_indices_buf"):
        prefill.BatchPrefillWithPagedKVCacheWrapper(use_cuda_graph=True, qo_indptr_buf=Buf(5))
    with pytest.raises(ValueError, match="backend must be one of"):
        prefill.BatchPrefillWithRaggedKVCacheWrapper(backend="cudnn")
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper(use_cuda_graph=True,
                                                           qo_indptr_buf=Buf(5))  # fmt: skip
    kw = dict(causal=True, q_data_type="bfloat16")
    wrapper.plan([0, 100, 300, 301], [0, 900, 1200, 1201], 8, 2, 128, **kw)
    first = wrapper._launch
    layout = wrapper._reserved
    assert first.nnz_q == 301
    for qo, kv in (([0, 1, 2], [0, 5000, 5001]), ([0, 0, 7, 200, 301], [0, 9, 20, 300, 500])):
        wrapper.plan(qo, kv, 8, 2, 128, **kw)
        st = wrapper._launch
        assert st.nnz_q == 301 and st.launch.grid == first.launch.grid  # fixed by the first
        assert st.launch.kernel is first.launch.kernel and wrapper._reserved == layout
    with pytest.raises(ValueError, match="302 query rows, but .* takes 301"):
        wrapper.plan([0, 302], [0, 400], 8, 2, 128, **kw)
    with pytest.raises(ValueError, match="batch of 5 requests .* exceeds the CUDA-graph"):
        wrapper.plan([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], 8, 2, 128, **kw)
    st = wrapper._launch
    static = (st.cfg, st.nnz_q, False)
    kv = info((1201, 2, 128))
    with pytest.raises(ValueError, match=r"q: expected shape \(301, 8, 128\)"):
        wrapper._prepare_run([info((300, 8, 128)), kv, kv, None, None], 16, static)
    prep = wrapper._prepare_run([info((301, 8, 128)), kv, kv, None, None], 16, static)
    assert prep.command_buffer  # XLA may record it: every launch argument is fixed


def test_graph_mode_custom_masks_travel_at_a_fixed_place(wrappers):
    """A CUDA-graph wrapper's packed mask rides in the workspace at a place that later plans
    keep (the captured kernel reads it there): room from the first masked plan, or from
    custom_mask_buf's size; a larger mask is refused with what to do."""
    prefill, packed = wrappers
    kw = dict(q_data_type="bfloat16")
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper(use_cuda_graph=True,
                                                           qo_indptr_buf=Buf(5))  # fmt: skip
    rng = np.random.default_rng(5)
    first = rng.random(3 * 10) < 0.5  # 30 bits: 4 bytes of room
    wrapper.plan([0, 3], [0, 10], 8, 2, 128, custom_mask=first, **kw)
    launch = wrapper._launch.launch
    where, layout = launch.params.mask, wrapper._reserved
    np.testing.assert_array_equal(mask_in_plan(packed, launch, 4),
                                  np.packbits(first, bitorder="little"))  # fmt: skip
    again = rng.random(2 * 12) < 0.5  # 3 bytes
    wrapper.plan([0, 2], [0, 12], 8, 2, 128, custom_mask=again, **kw)
    launch = wrapper._launch.launch
    assert launch.params.mask == where and wrapper._reserved == layout
    np.testing.assert_array_equal(mask_in_plan(packed, launch, 3),
                                  np.packbits(again, bitorder="little"))  # fmt: skip
    with pytest.raises(ValueError, match=r"takes 8 bytes, more than this CUDA-graph wrapper's "
                                         r"room \(4 bytes, from its first plan\)"):  # fmt: skip
        wrapper.plan([0, 3], [0, 20], 8, 2, 128, custom_mask=np.ones(60, bool), **kw)
    roomy = prefill.BatchPrefillWithRaggedKVCacheWrapper(
        use_cuda_graph=True, qo_indptr_buf=Buf(5), custom_mask_buf=np.zeros(64, np.uint8)
    )
    roomy.plan([0, 3], [0, 10], 8, 2, 128, custom_mask=first, **kw)
    roomy.plan([0, 3], [0, 20], 8, 2, 128, custom_mask=np.ones(60, bool), **kw)
    assert roomy._reserved.max_mask_ints == 16
    with pytest.raises(ValueError, match="custom_mask_buf: expected uint8, got int32"):
        prefill.BatchPrefillWithRaggedKVCacheWrapper(custom_mask_buf=np.zeros(4, np.int32))


def test_tensor_core_decode_plans_one_query_per_request(wrappers):
    from rtcinfer.attention.decode import BatchDecodeWithPagedKVCacheWrapper

    _, packed = wrappers
    wrapper = BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)
    wrapper.plan([0, 2, 2, 5], [7, 3, 0, 9, 4], [5, 0, 1], 32, 8, 128, 16,
                 q_data_type="bfloat16", window_left=10)  # fmt: skip
    items, _ = items_of(packed)
    assert set(items["qo_len"]) == {1} and set(items["kv_len"]) <= {21, 0, 33}
    st = wrapper._tc._launch
    assert st.nnz_q == 3 and st.launch.kernel.spec.tile_rows == 8  # 4 heads: keys on M
    assert not st.launch.kernel.spec.causal  # one query sees every key (the window aside)
    with pytest.raises(ValueError, match=r"run\(window_left=3\) differs"):
        wrapper.run(None, None, window_left=3)


@pytest.mark.parametrize("q_dtype, kv_dtype, batch, graph, keys", [
    ("bfloat16", None, 16, False, 128),  # 16 tiles x 8 heads <= 132 SMs: 128-key tiles
    ("bfloat16", None, 17, False, 64),  # 136 CTAs: in 64-key tiles
    ("bfloat16", None, 4, True, 64),  # a fixed capacity fixes the kernel
    ("float16", "float8_e4m3fn", 4, False, 128),  # fp8 read from the ring: 128 keys when idle
    ("float16", "float8_e4m3fn", 17, False, 64),  # and 64 where every SM has a CTA
    ("float16", "float8_e4m3fn", 17, True, 128),  # a fixed capacity keeps the kernel's own
])  # fmt: skip
def test_tensor_core_decode_of_a_small_batch_takes_128_key_tiles(wrappers, q_dtype, kv_dtype,
                                                                 batch, graph, keys):  # fmt: skip
    """A decode batch too small to give every SM a CTA runs 8-row tiles (a group of 4 heads)
    over 128-key K/V tiles in a 3-stage ring (wide_decode_spec); one that fills the GPU, or a
    CUDA-graph wrapper's, 64-key tiles. fp8 read from the ring: 128-key tiles (the kernel's
    own, a CUDA-graph wrapper's), 64-key ones where every SM has a CTA (busy_decode_spec)."""
    from rtcinfer.attention.decode import BatchDecodeWithPagedKVCacheWrapper

    kw = {}
    if graph:
        kw = dict(
            use_cuda_graph=True,
            paged_kv_indptr_buffer=Buf(batch + 1),
            paged_kv_indices_buffer=Buf(batch),
            paged_kv_last_page_len_buffer=Buf(batch),
        )
    wrapper = BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True, **kw)
    wrapper.plan(np.arange(batch + 1), np.arange(batch), np.full(batch, 5), 32, 8, 128, 16,
                 q_data_type=q_dtype, kv_data_type=kv_dtype)  # fmt: skip
    spec = wrapper._tc._launch.launch.kernel.spec
    assert (spec.tile_rows, spec.kv_tile) == (8, keys)
    assert spec.stages == 3 and spec.fp8_direct == (kv_dtype is not None)


@pytest.mark.parametrize(("tile_rows", "head_dim", "custom_mask", "warp_rows"), [
    (128, 128, False, 32), (128, 64, False, 16), (128, 128, True, 16), (64, 128, False, 16),
    (16, 128, False, 16), (64, 256, False, 16),
])  # fmt: skip
def test_warps_take_32_rows_where_that_was_measured_faster(tile_rows, head_dim, custom_mask,
                                                           warp_rows):  # fmt: skip
    """prefill_spec's own choice of rows a warp: two 16-row MMA blocks in 128-row tiles at
    head_dim 128 without a custom mask (with KV tiles of 32 keys, half the warps), 16 elsewhere;
    an explicit choice still wins where the kernel allows it."""
    from rtcinfer.attention.prefill_kernel import prefill_spec

    spec = prefill_spec("bfloat16", "bfloat16", head_dim, tile_rows, True,
                        custom_mask=custom_mask)  # fmt: skip
    assert spec.warp_rows == warp_rows
    assert spec.threads == (128 if tile_rows == 16 else 32 * tile_rows // warp_rows)
    if warp_rows == 32:
        assert spec.kv_tile == 32
        assert prefill_spec("bfloat16", "bfloat16", 128, 128, True, warp_rows=16).warp_rows == 16


def test_flashinfer_plan_arguments_bind_in_its_order(wrappers):
    """FlashInfer 0.7.2's positional order: ragged (..., pos_encoding_mode,
    use_fp16_qk_reduction, window_left, ...), paged (..., use_fp16_qk_reduction, sm_scale,
    window_left, ...); its backend-specific arguments are taken and ignored; multi-item
    scoring plans a custom mask (causal off), its arrays refused without prefix_len_ptr."""
    prefill, _ = wrappers
    ragged = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    ragged.plan([0, 4], [0, 8], 8, 2, 128, None, None, None, True, "NONE", True, 17,
                q_data_type="bfloat16", seq_lens=[8], uniform_q_len=4, v_indptr=[0, 8])  # fmt: skip
    cfg = ragged._launch.cfg
    assert (cfg.causal, cfg.attn.window_left) == (True, 17)
    paged = prefill.BatchPrefillWithPagedKVCacheWrapper()
    paged.plan([0, 4], [0, 1], [0], [8], 8, 2, 128, 16, None, None, None, False, "NONE", False,
               0.125, 5, q_data_type="bfloat16", block_tables=[[0]])  # fmt: skip
    attn = paged._launch.cfg.attn
    assert (attn.sm_scale, attn.window_left) == (0.125, 5)
    with pytest.raises(ValueError, match="token_pos_in_items_len need prefix_len_ptr"):
        paged.plan([0, 4], [0, 1], [0], [8], 8, 2, 128, 16, token_pos_in_items_len=3)
    paged.plan([0, 4], [0, 1], [0], [8], 8, 2, 128, 16, causal=True, q_data_type="bfloat16",
               prefix_len_ptr=[2], token_pos_in_items_ptr=[0, 1, 2, 0, 1, 0],
               token_pos_in_items_len=6)  # fmt: skip
    cfg = paged._launch.cfg
    assert cfg.custom_mask and not cfg.causal


def test_flashinfer_run_options_refused_or_checked_before_any_launch(wrappers):
    prefill, _ = wrappers
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan([0, 3, 10], [0, 5, 20], 8, 2, 128, causal=True, q_data_type="bfloat16")
    q, kv = np.zeros((10, 8, 128), np.float16), np.zeros((20, 2, 128), np.float16)
    with pytest.raises(ValueError, match="not supported: o_scale, kv_cache_sf"):
        wrapper.run(q, kv, kv, o_scale=2.0, kv_cache_sf=kv)
    with pytest.raises(ValueError, match="lse_base must be one of"):
        wrapper.run(q, kv, kv, return_lse=True, lse_base="e")
    with pytest.raises(ValueError, match="lse_layout must be one of"):
        wrapper.run(q, kv, kv, return_lse=True, lse_layout="TN")
    with pytest.raises(ValueError, match=r'lse_layout="HN": expected shape \(8, 10\)'):
        wrapper.run(q, kv, kv, lse=np.zeros((10, 8), np.float32), lse_layout="HN")
    paged = prefill.BatchPrefillWithPagedKVCacheWrapper()
    paged.plan([0, 4], [0, 1], [0], [8], 8, 2, 128, 16, window_left=9, q_data_type="bfloat16")
    cache = np.zeros((1, 2, 16, 2, 128), np.float16)
    with pytest.raises(ValueError, match="not supported: kv_cache_sf"):
        paged.run(q[:4], cache, sinks=np.zeros(8, np.float32), kv_cache_sf=cache)
    with pytest.raises(ValueError, match=r"run\(window_left=3\) differs from the plan's"):
        paged.run(q[:4], cache, window_left=3)


def test_workspace_reset_drops_the_plan_and_graph_wrappers_keep_theirs(wrappers):
    prefill, _ = wrappers
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.begin_forward([0, 4], [0, 8], 8, 2, 128, q_data_type="bfloat16")
    assert wrapper._launch is not None
    graph = prefill.BatchPrefillWithRaggedKVCacheWrapper(
        use_cuda_graph=True, qo_indptr_buf=np.zeros(3, np.int32)
    )
    with pytest.raises(ValueError, match="keeps its workspace"):
        graph.reset_workspace_buffer(np.zeros(16, np.uint8), None)
    with pytest.raises(ValueError, match="variant must be 'independent'"):
        wrapper.prewarm_paged_kv_stride_variant("shared")


def test_forward_runs_with_the_plan_parameters_it_repeats(wrappers, monkeypatch):
    """FlashInfer's deprecated forward(): its plan parameters must be the plan's (an omitted
    one is FlashInfer's default, which overrides the plan there); then it is run()."""
    prefill, _ = wrappers
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan([0, 4], [0, 8], 8, 2, 128, causal=True, window_left=30, q_data_type="bfloat16")
    runs = []
    monkeypatch.setattr(wrapper, "run", lambda *a, **kw: runs.append((a, kw)))
    wrapper.forward("q", "k", "v", causal=True, window_left=30, sm_scale=1 / np.sqrt(128))
    wrapper.forward_return_lse("q", "k", "v", True, "NONE", False, 30)
    assert runs == [(("q", "k", "v"), {}), (("q", "k", "v"), {"return_lse": True})]
    with pytest.raises(ValueError, match=r"forward\(\) with window_left -1 \(the plan's 30\), "
                                         r"causal False \(the plan's True\)"):  # fmt: skip
        wrapper.forward("q", "k", "v")


def test_paged_run_with_sinks_merges_them_before_the_lse_takes_its_form(wrappers, monkeypatch):
    """run(sinks=) asks the kernel for the base-2 [tokens, heads] LSE, merges the sinks into
    (o, lse) and only then makes the LSE form asked for (ln, HN into a given array)."""
    prefill, _ = wrappers
    paged = prefill.BatchPrefillWithPagedKVCacheWrapper()
    paged.plan([0, 4], [0, 1], [0], [8], 8, 2, 128, 16, q_data_type="bfloat16")
    base2 = np.arange(32, dtype=np.float32).reshape(4, 8)
    seen = []

    def launch_run(q, k, v, out, lse, with_lse, *rest):
        seen.append(("kernel", lse, with_lse))
        return ("o", base2.copy()) if with_lse else "o"

    def merge(o, s, sinks):
        seen.append(("sinks", sinks))
        s += 1  # in place, as for PyTorch and CuPy arrays
        return o, s

    from rtcinfer.attention import prefill_wrapper

    monkeypatch.setattr(paged, "_launch_run", launch_run)
    monkeypatch.setattr(prefill_wrapper, "merge_sinks_in_place", merge)
    q, cache = np.zeros((4, 8, 128), np.float16), np.zeros((1, 2, 16, 2, 128), np.float16)
    assert paged.run(q, cache, sinks="S") == "o"
    o, ln = paged.run(q, cache, sinks="S", return_lse=True, lse_base="ln")
    np.testing.assert_allclose(ln, (base2 + 1) * math.log(2.0), rtol=1e-6)
    hn = np.zeros((8, 4), np.float32)
    assert paged.run(q, cache, sinks="S", lse=hn, lse_layout="HN") == "o"
    np.testing.assert_array_equal(hn, (base2 + 1).T)
    assert paged.run(q, cache) == "o"
    assert seen == [("kernel", None, True), ("sinks", "S")] * 3 + [("kernel", None, False)]
    ragged = prefill.BatchPrefillWithRaggedKVCacheWrapper()  # sinks: an rtcinfer extension
    ragged.plan([0, 4], [0, 8], 8, 2, 128, q_data_type="bfloat16")
    monkeypatch.setattr(ragged, "_launch_run", launch_run)
    seen.clear()
    kv = np.zeros((8, 2, 128), np.float16)
    o, lse = ragged.run(q, kv, kv, sinks="R", return_lse=True)
    assert o == "o" and seen == [("kernel", None, True), ("sinks", "R")]
    np.testing.assert_array_equal(lse, base2 + 1)


def test_the_sink_wrapper_takes_sinks_and_sm_scale_after_the_cache(wrappers, monkeypatch):
    """FlashInfer's BatchAttentionWithAttentionSinkWrapper: run(q, cache, sinks, sm_scale) is
    the paged run(sinks=sinks); an sm_scale other than the plan's raises before any launch."""
    from rtcinfer.attention.attention_sink import BatchAttentionWithAttentionSinkWrapper

    wrapper = BatchAttentionWithAttentionSinkWrapper(None, "NHD", window_left=-1,
                                                     q_data_type="bfloat16")  # fmt: skip
    wrapper.plan([0, 4], [0, 1], [0], [8], 8, 2, 128, 16, q_data_type="bfloat16", sm_scale=0.25)
    seen = []
    paged = type(wrapper).__mro__[1]  # BatchPrefillWithPagedKVCacheWrapper
    monkeypatch.setattr(paged, "run", lambda self, q, c, **kw: seen.append(kw["sinks"]) or "o")
    assert wrapper.run("q", "cache", "S", 0.25) == "o"
    assert wrapper.run("q", "cache", sinks="T") == "o"
    assert seen == ["S", "T"]
    with pytest.raises(ValueError, match=r"run\(sm_scale=0.5\) differs from the plan's"):
        wrapper.run("q", "cache", "S", 0.5)
    with pytest.raises(TypeError, match="multiple values for argument 'sinks'"):
        wrapper.run("q", "cache", "S", sinks="T")


def test_pages_of_keys_cut_each_request_to_its_keys():
    """BatchAttention's plan: each request's first ceil(kv_len / page) pages and its last
    page's length; tables listing exactly those are passed on as they are."""
    from rtcinfer.attention.batch_attention import pages_of_keys

    indptr, indices, last = pages_of_keys([0, 3, 3, 5], np.array([7, 2, 9, 4, 1]), [17, 0, 16],
                                          16)  # fmt: skip
    assert list(indptr) == [0, 2, 2, 3] and list(indices) == [7, 2, 4] and list(last) == [1, 0, 16]
    exact = np.array([7, 2, 4])
    same = pages_of_keys([0, 2, 2, 3], exact, [17, 0, 16], 16)
    assert same[1] is exact and list(same[2]) == [1, 0, 16]
    with pytest.raises(ValueError, match="request 0: kv_len_arr says 40 keys, 3 pages of 16, "):
        pages_of_keys([0, 2, 2, 3], exact, [40, 0, 16], 16)
    with pytest.raises(ValueError, match=r"kv_len_arr\[1\] = -1"):
        pages_of_keys([0, 2, 2, 3], exact, [1, -1, 16], 16)
    with pytest.raises(ValueError, match="one entry a request"):
        pages_of_keys([0, 2, 2, 3], exact, [1, 16], 16)


def test_batch_attention_plans_the_paged_prefill_and_returns_o_and_lse(wrappers, monkeypatch):
    from rtcinfer.attention.batch_attention import BatchAttention

    attention = BatchAttention("NHD", "cuda")
    seen = {}
    inner = attention._wrapper
    monkeypatch.setattr(inner, "plan", lambda *a, **kw: seen.update(plan=(a, kw)))
    monkeypatch.setattr(inner, "run", lambda q, cache, **kw: seen.update(run=kw) or ("o", "s"))
    attention.plan([0, 1, 9], [0, 2, 4], [3, 1, 0, 2], [20, 5], 8, 2, 128, 128, 16,
                   causal=True, logits_soft_cap=30.0)  # fmt: skip
    args, kw = seen["plan"]
    assert [list(a) for a in args[1:4]] == [[0, 2, 3], [3, 1, 0], [4, 5]]
    assert kw["causal"] and kw["logits_soft_cap"] == 30.0 and kw["head_dim_vo"] == 128
    assert attention.run("q", "cache", k_scale=0.5, logits_soft_cap=30.0) == ("o", "s")
    assert seen["run"]["return_lse"] and seen["run"]["k_scale"] == 0.5
    with pytest.raises(ValueError, match=r"run\(logits_soft_cap=20.0\) differs from the plan"):
        attention.run("q", "cache", logits_soft_cap=20.0)
    with pytest.raises(ValueError, match="not supported: profiler_buffer"):
        attention.run("q", "cache", profiler_buffer="p")
    with pytest.raises(ValueError, match="not supported: use_profiler"):
        attention.plan([0, 1], [0, 1], [0], [5], 8, 2, 128, 128, 16, use_profiler=True)
    with pytest.raises(ValueError, match="device: expected 'cuda' or 'cuda:N'"):
        BatchAttention("NHD", "cpu")


def test_paged_workspace_size_leaves_the_plan_and_a_graph_wrappers_capacity(wrappers):
    """workspace_size() of the paged wrapper: the layout plan() reserves (plus 256 bytes of
    alignment room), with the wrapper's plan and, for a CUDA-graph wrapper, its capacity (set
    by its first plan) as they were."""
    from rtcinfer.attention.workspace import ALIGN

    prefill, _ = wrappers
    args = ([0, 4, 9], [0, 1, 3], [2, 0, 1], [8, 16], 8, 2, 128, 16)
    paged = prefill.BatchPrefillWithPagedKVCacheWrapper()
    size, ints = paged.workspace_size(*args, causal=True, q_data_type="bfloat16")
    assert ints == 0 and paged._launch is None
    paged.plan(*args, causal=True, q_data_type="bfloat16")
    assert size == paged._ws.capacity.offsets()["end"] + ALIGN
    graph = prefill.BatchPrefillWithPagedKVCacheWrapper(
        use_cuda_graph=True, qo_indptr_buf=np.zeros(3, np.int32),
        paged_kv_indices_buf=np.zeros(8, np.int32),
    )  # fmt: skip
    graph.workspace_size(*args, q_data_type="bfloat16")
    assert graph._fixed is None  # the first plan() still fixes the capacity
    graph.plan(*args, q_data_type="bfloat16")
    fixed = graph._fixed
    graph.workspace_size([0, 1, 2], [0, 1, 2], [0, 1], [1, 1], 8, 2, 128, 16,
                         q_data_type="bfloat16")  # fmt: skip
    assert graph._fixed is fixed


def test_tensor_core_decode_workspace_size_is_its_prefill_wrappers(wrappers):
    from rtcinfer.attention import decode
    from rtcinfer.attention.workspace import ALIGN

    tc = decode.BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)
    table = ([0, 2, 3], [4, 1, 2], [5, 3])
    size, _ = tc.workspace_size(*table, 8, 2, 128, 16, q_data_type="bfloat16", q_len_per_req=2)
    assert tc._tc._launch is None and tc._q_len == 1
    tc.plan(*table, 8, 2, 128, 16, q_data_type="bfloat16", q_len_per_req=2)
    assert size == tc._tc._ws.capacity.offsets()["end"] + ALIGN


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kv_data_type="float8_e4m3fn"), r"not with KV float8_e4m3fn \(16-bit KV of q's "
                                             r"dtype\)$"),
        (dict(pos_encoding_mode="ROPE_LLAMA"), r"not with in-kernel RoPE \(apply it to q and k "),
        (dict(head_dim_vo=64), r"not with this pair .*; KV float8_e5m2", ),
    ],
)  # fmt: skip
def test_fewer_value_dims_are_refused_where_the_kernel_lacks_them(wrappers, kwargs, match):
    """head_dim_vo != head_dim_qk: a pair of DIM_PAIRS, 16-bit KV, RoPE outside the kernel;
    each missing condition named."""
    prefill, _ = wrappers
    kwargs = {"head_dim_vo": 128, **kwargs}
    if kwargs["head_dim_vo"] == 64:
        kwargs["kv_data_type"] = "float8_e5m2"
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    with pytest.raises(ValueError, match=match):
        wrapper.plan([0, 4], [0, 8], 8, 2, 192, q_data_type="bfloat16", **kwargs)


def test_fewer_value_dims_check_v_and_o_and_refuse_a_5d_cache(wrappers):
    """With head_dim_vo 128 beside 192: v must have 128 dims (ragged and paged pair), a 5-D
    paged cache (one head_dim) is refused by name, q keeps 192; head_dim_vo equal to
    head_dim_qk is the plain plan (no head_dim_vo in the configuration)."""
    prefill, _ = wrappers
    ragged = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    ragged.plan([0, 4], [0, 8], 8, 2, 192, head_dim_vo=128, q_data_type="bfloat16")
    cfg = ragged._launch.cfg
    assert (cfg.attn.head_dim, cfg.dim_vo, cfg.head_dim_vo) == (192, 128, 128)
    assert ragged._plan_o_shape((4, 8, 192)) == (4, 8, 128)
    with pytest.raises(ValueError, match=r"^v: expected shape \(nnz_kv, 2, 128\)"):
        ragged._check_kv(cfg, info((8, 2, 192)), info((8, 2, 192)))
    with pytest.raises(ValueError, match=r"^k: expected shape \(nnz_kv, 2, 192\)"):
        ragged._check_kv(cfg, info((8, 2, 128)), info((8, 2, 128)))
    with pytest.raises(ValueError, match="must have the same rows"):
        ragged._check_kv(cfg, info((8, 2, 192)), info((9, 2, 128)))
    ragged._check_kv(cfg, info((8, 2, 192)), info((8, 2, 128)))
    from rtcinfer.attention.prefill_args import check_query

    assert check_query(info((4, 8, 192)), 4, cfg) == (4, 8, 128)
    with pytest.raises(ValueError, match=r"q: expected shape \(4, 8, 192\)"):
        check_query(info((4, 8, 128)), 4, cfg)

    paged = prefill.BatchPrefillWithPagedKVCacheWrapper()
    paged.plan([0, 4], [0, 1], [0], [8], 8, 2, 192, 16, head_dim_vo=128,
               q_data_type="bfloat16")  # fmt: skip
    cfg = paged._launch.cfg
    paged._check_kv(cfg, info((3, 16, 2, 192)), info((3, 16, 2, 128)))
    with pytest.raises(ValueError, match=r"^v_cache: expected shape \(num_pages, 16, 2, 128\)"):
        paged._check_kv(cfg, info((3, 16, 2, 192)), info((3, 16, 2, 192)))
    with pytest.raises(ValueError, match=r"one array holds k and v of one head_dim.*pass a "
                                         r"\(k_cache, v_cache\) pair$"):  # fmt: skip
        paged._check_kv(cfg, info((3, 2, 16, 2, 192)), None)

    same = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    same.plan([0, 4], [0, 8], 8, 2, 128, head_dim_vo=128, q_data_type="bfloat16")
    assert same._launch.cfg.head_dim_vo is None and same._launch.cfg.dim_vo == 128
