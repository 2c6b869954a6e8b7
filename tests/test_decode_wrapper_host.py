"""The decode wrapper's host side without a GPU: plan() on host tables (page ids, kernel and
tile choice, partials, uploads ordered after runs on other streams, CUDA-graph limits) and
run()'s checks before its launch, with the device queries, kernel and upload stubbed."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer.attention.decode_plan import ITEM_INTS, WORK_ITEM, header_ints, pack_plan
from rtcinfer.plan.decode import plan_decode

from .fakes import FakeStream, NullDevice, packing_upload, planning_without_a_gpu
from .paged_batch import page_table_for


@pytest.fixture
def host_wrapper(monkeypatch):
    """A decode wrapper whose plan() runs without a GPU: device queries, the kernel and the
    upload are stubbed (the host validation and planning are what is tested)."""
    from rtcinfer.attention import decode

    regions = dict.fromkeys(("plan", "counters", "lse", "o", "end"), 0)
    planning_without_a_gpu(monkeypatch, regions, packing_upload)
    monkeypatch.setattr(decode, "device_limits", lambda device: (132, 227 * 1024))
    monkeypatch.setattr(decode, "ctas_per_sm", lambda spec, device: 2)
    return decode.BatchDecodeWithPagedKVCacheWrapper()


@pytest.mark.parametrize(
    "dtype, bad, value",
    [(np.int32, 1, -2), (np.int64, 2, 2**31), (np.int64, 0, -1), (np.int16, 3, -7)],
)
def test_plan_rejects_page_ids_outside_int32(host_wrapper, dtype, bad, value):
    indices = np.arange(4, dtype=dtype)
    indices[bad] = value
    with pytest.raises(ValueError, match=rf"indices\[{bad}\] \({value}\) is not a valid page id"):
        host_wrapper.plan([0, 4], indices, [16], 8, 2, 128, 16, q_data_type="bfloat16")


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int64, np.uint16])
def test_plan_records_the_largest_page_id(host_wrapper, dtype):
    indices = np.array([5, 900, 3, 2**15 - 1], dtype=dtype)
    host_wrapper.plan([0, 1, 4], indices, [7, 16], 8, 2, 128, 16, q_data_type="bfloat16")
    assert host_wrapper._launch.max_page == 2**15 - 1
    # a longer, preallocated indices buffer is read only indptr[-1] entries far (FlashInfer)
    longer = np.concatenate([indices, np.array([30000, 2**15 - 1], dtype=dtype)])
    host_wrapper.plan([0, 1, 3], longer, [7, 16], 8, 2, 128, 16, q_data_type="bfloat16")
    assert host_wrapper._launch.max_page == 900


def _spec(wrapper):
    """The spec of the kernel the latest plan() launches."""
    return wrapper._launch.launch.kernel.spec


def test_plan_picks_the_one_tile_ahead_kernel_for_long_rows(host_wrapper):
    """Pages of 64 and 8192-token requests: the spec compiled with lookahead 1 (CUDA graphs
    aside); short requests keep the default kernel."""
    indptr = np.arange(41) * 128  # 40 requests of 128 full pages: 8192 tokens each
    host_wrapper.plan(indptr, np.arange(indptr[-1]), [64] * 40, 32, 8, 128, 64,
                      q_data_type="bfloat16")  # fmt: skip
    assert _spec(host_wrapper).lookahead == 1
    host_wrapper.plan([0, 1], [0], [64], 32, 8, 128, 64, q_data_type="bfloat16")
    assert _spec(host_wrapper).lookahead == 0


def test_uploads_wait_for_runs_on_every_other_stream(host_wrapper, monkeypatch):
    """The ordering plan() and run() set up between streams, with recording fakes: an upload
    waits for the latest run on each other stream since the previous plan (not just the
    last one), and moving the plan to another stream synchronizes the device."""
    import cupy

    from rtcinfer.attention import planned
    from rtcinfer.attention.workspace import Workspace

    log = []

    def stream(ptr):
        return FakeStream(ptr, log=log)

    class Event:
        def __init__(self, **kwargs):
            self.on = None
            self.ptr = self

        def record(self, stream):
            self.on = stream.ptr

    current = [stream(1)]
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: current[0])
    monkeypatch.setattr(cupy.cuda, "Event", Event)
    monkeypatch.setattr(cupy.cuda.Device, "synchronize", lambda self: log.append(("sync",)),
                        raising=False)  # fmt: skip
    monkeypatch.setattr(planned, "is_capturing", lambda stream: False)
    monkeypatch.setattr(planned, "wait_event", lambda stream, event: None)
    monkeypatch.setattr(planned, "record_event", lambda event, stream: setattr(event, "on", stream))

    def upload(self, fill, stream, after=None):
        fill(np.zeros(self.capacity.plan_ints, np.int32))
        self.stream_ptr = stream.ptr

    monkeypatch.setattr(Workspace, "upload", upload)
    monkeypatch.setattr(Workspace, "last_upload", lambda self: Event())
    w = host_wrapper

    def plan(ptr):
        current[0] = stream(ptr)
        w.plan([0, 1], [0], [5], 8, 2, 128, 16, q_data_type="bfloat16")

    plan(1)
    w._order(2)
    w._order(3)
    w._order(1)  # the upload's own stream: ordered already
    log.clear()
    plan(1)
    assert sorted(log) == [("wait", 1, 2), ("wait", 1, 3)]
    log.clear()
    plan(1)  # nothing ran since
    assert log == []
    plan(2)  # the plan moves to stream 2
    assert log == [("sync",)]


def test_calibration_scales_fold_into_two_factors():
    from rtcinfer.attention.decode_kernel import kv_scales

    assert kv_scales(None, None) == (1.0, 1.0)
    assert kv_scales(3, 2, 0.5) == (1.5, 2.0)
    assert kv_scales(0, None, None) == (0.0, 1.0)  # 0 is a scale
    assert kv_scales(None, None, np.float32(2)) == (2.0, 1.0)


def test_run_refuses_a_window_other_than_the_plans(host_wrapper):
    host_wrapper.plan([0, 1], [0], [5], 8, 2, 128, 16, q_data_type="bfloat16", window_left=64,
                      non_blocking=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"run\(window_left=32\) differs from the plan's "
                                         r"window_left \(64\)"):  # fmt: skip
        host_wrapper.run(None, None, window_left=32)


def test_run_names_host_arrays_and_lists_before_checking_shapes(host_wrapper):
    """q of a wrong shape as well: what is not on the GPU is said first."""
    host_wrapper.plan([0, 1, 3], [0, 1, 2], [5, 16], 8, 2, 128, 16, q_data_type="bfloat16")
    k = np.zeros((3, 16, 2, 128), np.float16)
    with pytest.raises(TypeError, match=r"^q: expected a CUDA array .* host numpy.ndarray of "
                                        r"shape \(7, 3\); move it to the GPU first$"):  # fmt: skip
        host_wrapper.run(np.zeros((7, 3), np.float32), (k, k))
    with pytest.raises(TypeError, match=r"^q must be an array .* got list$"):
        host_wrapper.run([[0.0] * 128] * 16, (k, k))


def _launch_with_fakes(wrapper, monkeypatch, out_strides=None, capturing=False, calls=None):
    """run()'s prepared launch on fake arrays (batch 2, 8 query heads, 2 kv heads, d 128, page
    16, bf16, a cache of 4 pages), as the call path drives it; returns the recorded kernel
    launches (appended to `calls` when given)."""
    from rtcinfer.attention import planned
    from rtcinfer.interop import ArrayInfo, dense_strides
    from rtcinfer.launch import Launch

    calls = [] if calls is None else calls
    monkeypatch.setattr(Launch, "__call__", lambda self, stream, device: calls.append(stream))
    monkeypatch.setattr(planned, "is_capturing", lambda stream: capturing)
    wrapper._ws.stream_ptr = 5  # the plan's stream: run() on it needs no event
    q = ArrayInfo((2, 8, 128), dense_strides((2, 8, 128)), "bfloat16", 0)
    cache = ArrayInfo((4, 2, 16, 2, 128), dense_strides((4, 2, 16, 2, 128)), "bfloat16", 0)
    out = None if out_strides is None else q._replace(strides=out_strides)
    st = wrapper._launch
    prep = wrapper._prepare_run([q, cache, None, out, None], 16, (st.cfg, st.batch, False))
    prep.run(5, 0, [1 << 20, 1 << 21, 0, 0, 0, 1 << 22], (1.0, 1.0))
    return calls


def test_run_launches_on_contiguous_rows_and_rejects_a_strided_out(host_wrapper, monkeypatch):
    host_wrapper.plan([0, 1, 3], [0, 1, 2], [5, 16], 8, 2, 128, 16, q_data_type="bfloat16")
    assert len(_launch_with_fakes(host_wrapper, monkeypatch)) == 1
    with pytest.raises(
        ValueError, match=r"contiguous in their last dimension.* out \(2048, 256, 2\)"
    ):
        _launch_with_fakes(host_wrapper, monkeypatch, out_strides=(2048, 256, 2))
    with pytest.raises(ValueError, match="contiguous in their last dimension"):
        _launch_with_fakes(host_wrapper, monkeypatch, out_strides=(1024, 128, -1))


@pytest.mark.parametrize("largest", [4, 2**31 - 1])
def test_run_refuses_a_plan_with_a_page_past_the_cache(host_wrapper, monkeypatch, largest):
    """Decode reads its page ids from the plan, checked on the host: run() on a cache without
    the plan's largest page id raises before anything is launched, and runs once the plan
    fits the cache."""
    host_wrapper.plan([0, 1, 3], [0, largest, 2], [5, 16], 8, 2, 128, 16, q_data_type="bfloat16")
    calls = []
    with pytest.raises(ValueError, match=rf"indices holds page id {largest}, but the cache has "
                                         r"4 pages"):  # fmt: skip
        _launch_with_fakes(host_wrapper, monkeypatch, calls=calls)
    assert calls == []
    host_wrapper._ws.stream_ptr = None  # uploads on the fake current stream again
    host_wrapper.plan([0, 1, 3], [0, 3, 2], [5, 16], 8, 2, 128, 16, q_data_type="bfloat16")
    assert len(_launch_with_fakes(host_wrapper, monkeypatch, calls=calls)) == 1


def test_a_captured_run_records_its_batch(host_wrapper, monkeypatch):
    from rtcinfer.attention import decode

    wrapper = decode.BatchDecodeWithPagedKVCacheWrapper(
        use_cuda_graph=True, paged_kv_indptr_buffer=np.zeros(7, np.int32),
        paged_kv_indices_buffer=np.zeros(100, np.int32),
    )  # fmt: skip
    wrapper.plan([0, 1, 3], [0, 1, 2], [5, 16], 8, 2, 128, 16, q_data_type="bfloat16")
    _launch_with_fakes(wrapper, monkeypatch)
    assert wrapper._captured is None  # an eager run
    assert len(_launch_with_fakes(wrapper, monkeypatch, capturing=True)) == 1
    assert wrapper._captured == 2
    with pytest.raises(ValueError, match="captured into a CUDA graph with 2"):
        wrapper.plan([0, 1, 2, 3], [0, 1, 2], [5, 16, 3], 8, 2, 128, 16, q_data_type="bfloat16")


def test_fixed_split_size_minus_one_means_none(host_wrapper):
    indptr, indices, last, _ = page_table_for([32768, 5], 16, np.random.default_rng(0))
    grids = []
    for fixed in (None, -1, np.int64(-1), 16):
        host_wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type="bfloat16",
                          fixed_split_size=fixed)  # fmt: skip
        grids.append(host_wrapper._launch.launch.grid)
    assert grids[0] == grids[1] == grids[2] != grids[3]
    with pytest.raises(ValueError, match="fixed_split_size must be >= 1, got -2"):
        host_wrapper.plan(indptr, indices, last, 32, 8, 128, 16, fixed_split_size=-2)


def test_a_batch_beyond_the_grid_says_to_plan_in_parts(host_wrapper):
    batch = 65536
    with pytest.raises(ValueError, match="a batch of 65536 requests exceeds the grid limit"):
        host_wrapper.plan(np.zeros(batch + 1, np.int32), np.zeros(0, np.int32),
                          np.zeros(batch, np.int32), 8, 8, 128, 16)  # fmt: skip


def test_plan_reserves_partials_only_for_split_plans(host_wrapper, monkeypatch):
    from rtcinfer.attention.workspace import Workspace

    needs = []
    reserve = Workspace.reserve  # the fixture's: it lays out the regions
    monkeypatch.setattr(
        Workspace,
        "reserve",
        lambda self, need, stream, grow: (needs.append(need), reserve(self, need, stream, grow)),
    )
    for lengths in ([1024] * 256, [32768]):  # whole requests, then one split request
        indptr, indices, last, _ = page_table_for(lengths, 16, np.random.default_rng(0))
        host_wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type="bfloat16")
    assert needs[0].partial_work == 0 and needs[0].max_work == 256
    assert needs[1].partial_work == needs[1].max_work == host_wrapper._launch.launch.grid[1] > 1


def test_graph_plan_refuses_a_batch_larger_than_the_captured_one(host_wrapper):
    """Under CUDA graphs plan() takes up to the capacity until a run() is captured, then at
    most the captured batch (the GPU test captures; here the record of it is set directly)."""
    from rtcinfer.attention import decode

    wrapper = decode.BatchDecodeWithPagedKVCacheWrapper(
        use_cuda_graph=True, paged_kv_indptr_buffer=np.zeros(7, np.int32),
        paged_kv_indices_buffer=np.zeros(100, np.int32),
    )  # fmt: skip
    indptr, indices, last, _ = page_table_for([30, 0, 17, 5, 64, 2], 16, np.random.default_rng(0))

    def plan(n):
        wrapper.plan(indptr[: n + 1], indices[: indptr[n]], last[:n], 8, 2, 128, 16,
                     q_data_type="bfloat16")  # fmt: skip

    plan(6)
    wrapper._captured = 4
    plan(4)
    plan(2)
    with pytest.raises(ValueError, match="5 requests, but run\\(\\) was captured .* with 4"):
        plan(5)


@pytest.mark.parametrize(
    "lengths, kv_dtype, options, halved",
    [
        ([1024] * 256, "float8_e4m3fn", {}, True),  # 2048 CTAs: one item per request
        ([100, 5000], "float8_e5m2", dict(disable_split_kv=True), True),
        ([32768], "float8_e4m3fn", {}, False),  # split: keeps the larger tile
        ([1024] * 256, "float8_e4m3fn", dict(fixed_split_size=128), False),  # batch-invariant
        ([1024] * 256, "bfloat16", {}, False),  # 16-bit KV: one tile size
    ],
)  # fmt: skip
def test_plan_picks_half_tiles_for_fp8_whole_requests(host_wrapper, lengths, kv_dtype,
                                                      options, halved):  # fmt: skip
    """fp8 KV in a plan of one item per request runs tiles of half the tokens; split plans,
    fixed_split_size plans and 16-bit KV keep the default tile."""
    indptr, indices, last, _ = page_table_for(lengths, 16, np.random.default_rng(0))
    host_wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type="bfloat16",
                      kv_data_type=kv_dtype, **options)  # fmt: skip
    spec, launched = host_wrapper._kernel[0], _spec(host_wrapper)
    assert launched.token_groups == (spec.token_groups // 2 if halved else spec.token_groups)
    assert host_wrapper._launch.launch.kernel.smem == launched.smem_bytes
    if halved:
        assert spec.token_groups == 2 and launched.tile == 64


def test_whole_request_plans_pack_the_same_after_a_larger_one():
    """The constant columns of one-item-per-request plans come from one growing table: a
    small plan packed after a large one holds exactly its own items."""
    rng = np.random.default_rng(3)
    packed = {}
    for batch in (5, 300, 7, 300, 5):
        lengths = [int(x) for x in rng.integers(0, 200, batch)]
        indptr, indices, last, _ = page_table_for(lengths, 16, rng)
        plan = plan_decode(indptr, last, 16, 8, num_sms=1, ctas_per_sm=1)
        assert plan.num_work == batch
        buf = np.full(header_ints(64) + ITEM_INTS * batch + len(indices), -7, dtype=np.int32)
        pack_plan(buf, plan, indptr.astype(np.int64), indices, 64, None)
        items = buf[header_ints(64) : header_ints(64) + ITEM_INTS * batch].view(WORK_ITEM)
        b = np.arange(batch)
        np.testing.assert_array_equal(items["request"], b)
        np.testing.assert_array_equal(items["token_begin"], 0)
        np.testing.assert_array_equal(items["token_end"], lengths)
        np.testing.assert_array_equal(items["kv_len"], lengths)
        pages_at = header_ints(64) + ITEM_INTS * batch
        np.testing.assert_array_equal(items["page_ids"], pages_at + indptr[:-1])
        np.testing.assert_array_equal(items["merge_begin"], b)
        np.testing.assert_array_equal(items["merge_count"], 1)
        np.testing.assert_array_equal(items["unused"], 0)
        constant = ["request", "token_begin", "merge_begin", "merge_count", "unused"]
        packed.setdefault(batch, items[constant].copy())
        np.testing.assert_array_equal(items[constant], packed[batch])


def test_a_plan_upload_inside_a_capture_says_to_warm_up(monkeypatch):
    """device_copy runs in relaxed capture mode and restores the thread's mode after, also
    when it fails; CUDA's capture errors become the advice to make the call once before
    capturing; other errors pass through."""
    import cupy

    from rtcinfer.attention import workspace

    class Driver:  # cuThreadExchangeStreamCaptureMode: set the mode, return the old one
        class CUstreamCaptureMode:
            CU_STREAM_CAPTURE_MODE_RELAXED = "relaxed"

        mode = "global"

        def cuThreadExchangeStreamCaptureMode(self, mode):
            old, self.mode = self.mode, mode
            return 0, old

    fake = Driver()

    def failing(status):
        def alloc(nbytes):
            assert fake.mode == "relaxed"
            raise cupy.cuda.runtime.CUDARuntimeError(status)

        return alloc

    monkeypatch.setattr(workspace, "driver", lambda: fake)
    monkeypatch.setattr(cupy.cuda, "Device", NullDevice)
    monkeypatch.setattr(cupy.cuda, "alloc", failing(900))  # cudaErrorStreamCaptureUnsupported
    with pytest.raises(RuntimeError, match=r"^single_decode_with_kv_cache uploads its plan "
                       r"once for its shapes, which cannot happen inside this CUDA-graph "
                       r"capture"):  # fmt: skip
        workspace.device_copy(np.zeros(4, np.int32), 0, "single_decode_with_kv_cache")
    assert fake.mode == "global"
    monkeypatch.setattr(cupy.cuda, "alloc", failing(2))  # cudaErrorMemoryAllocation
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
        workspace.device_copy(np.zeros(4, np.int32), 0)
    assert fake.mode == "global"


def test_run_on_another_device_than_the_wrappers_is_refused(host_wrapper):
    """A wrapper's workspace and plan live on the device it was made on: arrays on another
    device are refused by name when run() prepares their signature (a tensor-parallel
    process makes a wrapper per device)."""
    from rtcinfer.interop import ArrayInfo, dense_strides

    host_wrapper.plan([0, 1, 3], [0, 1, 2], [5, 16], 8, 2, 128, 16, q_data_type="bfloat16")
    st = host_wrapper._launch
    q = ArrayInfo((2, 8, 128), dense_strides((2, 8, 128)), "bfloat16", 1)
    cache = ArrayInfo((4, 2, 16, 2, 128), dense_strides((4, 2, 16, 2, 128)), "bfloat16", 1)
    with pytest.raises(ValueError, match=r"run: the arrays are on device 1, this wrapper's "
                                         r"workspace and plan on device 0"):  # fmt: skip
        host_wrapper._prepare_on_device([q, cache, None, None, None], 16, (st.cfg, st.batch, False))
    prep = host_wrapper._prepare_on_device(
        [q._replace(device=0), cache._replace(device=0), None, None, None], 16,
        (st.cfg, st.batch, False),
    )  # fmt: skip
    assert prep is not None


def test_flashinfer_plan_options_data_type_and_refusals(host_wrapper):
    """data_type stands for the dtypes left None (FlashInfer 0.7.2); q_len_per_req other than
    1 needs tensor cores, window_right and is_causal change nothing; run()'s trtllm-gen
    options, or a q_len_per_req other than the plan's, raise by name before any array is
    read."""
    host_wrapper.plan([0, 1], [0], [16], 8, 2, 128, 16, q_data_type=None, data_type="bfloat16")
    cfg = host_wrapper._launch.cfg
    assert (cfg.q_dtype, cfg.kv_dtype) == ("bfloat16", "bfloat16")
    with pytest.raises(ValueError, match="q_len_per_req=2: .* use_tensor_cores=True"):
        host_wrapper.plan([0, 1], [0], [16], 8, 2, 128, 16, q_len_per_req=2)
    host_wrapper.plan([0, 1], [0], [16], 8, 2, 128, 16, window_right=4, is_causal=True)
    assert host_wrapper._launch.cfg.window_left == -1  # no key after the query: nothing to do
    with pytest.raises(ValueError, match="not supported: kv_cache_sf"):
        host_wrapper.run(None, None, kv_cache_sf=np.zeros(8, np.float32), q_len_per_req=1)
    with pytest.raises(ValueError, match=r"run\(q_len_per_req=4\) differs from the plan's \(1\)"):
        host_wrapper.run(None, None, sinks=np.zeros(8, np.float32), q_len_per_req=4)
    assert host_wrapper.use_tensor_cores is False


def test_forward_checks_its_plan_parameters(host_wrapper, monkeypatch):
    host_wrapper.plan([0, 1], [0], [16], 8, 2, 128, 16, logits_soft_cap=30.0,
                      q_data_type="bfloat16")  # fmt: skip
    runs = []
    monkeypatch.setattr(host_wrapper, "run", lambda *a, **kw: runs.append(kw))
    host_wrapper.forward("q", "cache", logits_soft_cap=30.0, q_scale=0.5)
    assert runs == [{"q_scale": 0.5, "k_scale": None, "v_scale": None}]
    with pytest.raises(ValueError, match=r"logits_soft_cap 0.0 \(the plan's 30.0\)"):
        host_wrapper.forward_return_lse("q", "cache")


def test_run_with_sinks_asks_for_the_lse_and_merges_the_sinks_into_it(host_wrapper, monkeypatch):
    """run(sinks=): the kernel writes (o, lse) (into a given lse) and merge_sinks_in_place
    updates both; the caller gets o, or (o, lse) with return_lse."""
    from rtcinfer.attention import decode

    host_wrapper.plan([0, 1], [0], [16], 8, 2, 128, 16, q_data_type="bfloat16")
    calls = []

    def kernel(arrays, static, scalars):
        calls.append(("kernel", arrays[4], static[2]))  # the lse slot, with_lse
        return ("o", "lse" if arrays[4] is None else arrays[4]) if static[2] else "o"

    def merge(o, s, sinks):
        calls.append(("sinks", o, s, sinks))
        return o + "'", s + "'"

    monkeypatch.setattr(host_wrapper, "_call", kernel)
    monkeypatch.setattr(decode, "merge_sinks_in_place", merge)
    assert host_wrapper.run("q", "cache", sinks="S") == "o'"
    assert host_wrapper.run("q", "cache", sinks="S", return_lse=True) == ("o'", "lse'")
    assert host_wrapper.run("q", "cache", sinks="S", lse="L") == "o'"
    assert host_wrapper.run("q", "cache") == "o"
    assert calls == [
        ("kernel", None, True), ("sinks", "o", "lse", "S"),
        ("kernel", None, True), ("sinks", "o", "lse", "S"),
        ("kernel", "L", True), ("sinks", "o", "L", "S"),
        ("kernel", None, False),
    ]  # fmt: skip


def test_several_queries_a_request_plan_a_causal_prefill_over_the_cache(host_wrapper,
                                                                        monkeypatch):  # fmt: skip
    """plan(q_len_per_req=n) with tensor cores: the prefill wrapper plans n queries a request
    (qo_indptr = n * arange), causal among them; each request needs n keys at least; run()'s
    own q_len_per_req must be the plan's."""
    from rtcinfer.attention import decode

    tc = decode.BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)
    seen = {}
    monkeypatch.setattr(tc._tc, "plan", lambda *a, **kw: seen.update(args=a, kw=kw))
    table = ([0, 2, 3], [4, 1, 2], [5, 3])  # requests of 21 and 3 keys
    tc.plan(*table, 8, 2, 128, 16, q_len_per_req=3, q_data_type="bfloat16")
    assert list(seen["args"][0]) == [0, 3, 6] and seen["kw"]["causal"] is True
    with pytest.raises(ValueError, match=r"run\(q_len_per_req=2\) differs from the plan's \(3\)"):
        tc.run(None, None, q_len_per_req=2)
    with pytest.raises(RuntimeError, match="plan"):  # past the check (the plan was stubbed)
        tc.run(None, None, q_len_per_req=3)
    tc.plan(*table, 8, 2, 128, 16, q_data_type="bfloat16")
    assert list(seen["args"][0]) == [0, 1, 2] and seen["kw"]["causal"] is False
    with pytest.raises(ValueError, match="needs kv_len >= 4 .* got 3 keys for request 1"):
        tc.plan(*table, 8, 2, 128, 16, q_len_per_req=4)
    with pytest.raises(ValueError, match="q_len_per_req must be >= 1, got 0"):
        tc.plan(*table, 8, 2, 128, 16, q_len_per_req=0)


def test_fast_decode_plan_is_the_wrappers_plan(host_wrapper, monkeypatch):
    """FlashInfer's fast_decode_plan(wrapper, ...): the wrapper's plan(), with the CPU indptr
    override when given and FlashInfer's float16 default when no dtype is."""
    import rtcinfer

    seen = []
    monkeypatch.setattr(host_wrapper, "plan", lambda *a, **kw: seen.append((a, kw)))
    rtcinfer.fast_decode_plan(host_wrapper, [0, 1], [0], [16], 8, 2, 128, 16)
    rtcinfer.fast_decode_plan(host_wrapper, "device indptr", [0], [16], 8, 2, 128, 16,
                              data_type="bfloat16", global_override_indptr_cpu=[0, 1])  # fmt: skip
    (a1, kw1), (a2, kw2) = seen
    assert a1[0] == [0, 1] and kw1["q_data_type"] == "float16"
    assert a2[0] == [0, 1] and kw2["q_data_type"] is None and kw2["data_type"] == "bfloat16"


def test_workspace_size_is_the_plans_layout_and_leaves_the_plan(host_wrapper):
    """workspace_size(): the bytes of the layout plan() reserves for the same arguments, plus
    256 for a buffer that does not start on a 256-byte boundary, and no int workspace; the
    wrapper's own plan is the one it had."""
    from rtcinfer.attention.workspace import ALIGN, user_base

    table = ([0, 2, 3, 3], [4, 1, 2], [5, 3, 0])
    host_wrapper.plan(*table, 8, 2, 128, 16, q_data_type="bfloat16")
    planned, capacity = host_wrapper._launch, host_wrapper._ws.capacity
    big = ([0, 40, 41], list(range(41)), [16, 1])
    size, ints = host_wrapper.workspace_size(*big, 8, 2, 128, 16, q_data_type="bfloat16")
    assert ints == 0 and host_wrapper._launch is planned and host_wrapper._ws.capacity is capacity
    host_wrapper.plan(*big, 8, 2, 128, 16, q_data_type="bfloat16")
    need = host_wrapper._ws.capacity.offsets()["end"]
    assert size == need + ALIGN
    assert user_base(ALIGN + 1, size, need, host_wrapper._ws.capacity) == 2 * ALIGN
