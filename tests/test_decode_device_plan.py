"""The batch decode plan built on the device (attention/decode_device_plan.py) on the GPU: the
same ints as the host planner's plan_array() for every kind of batch, decode over it against
the float64 reference in CuPy, PyTorch and inside jax.jit, and bad tables reported."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer

from .gpu_decode import check_attention, make_batch, to_gpu
from .paged_batch import page_table_for

pytestmark = pytest.mark.gpu

HQ, HKV = 32, 8


def _wrapper(max_batch: int, max_pages: int):
    return rtcinfer.BatchDecodeWithPagedKVCacheWrapper(
        use_cuda_graph=True, paged_kv_indptr_buffer=np.empty(max_batch + 1, np.int32),
        paged_kv_indices_buffer=np.empty(max_pages, np.int32),
    )  # fmt: skip


def _device_table(*arrays):
    """The page table's arrays as int32 CuPy arrays."""
    return [to_gpu(np.asarray(a, np.int32)) for a in arrays]


RNG = np.random.default_rng(7)
# (lengths, page_size, head_dim, plan() keywords): split searches over small batches, batches
# that fill the GPU (uniform, mixed, with a straggler), empty requests and batches, fixed and
# disabled splits, pages of one token, RoPE frequencies in the header, and more requests than
# the planning CTA has threads.
CASES = {
    "small mixed": ([700, 3, 0, 1, 4000, 16], 16, 128, {}),
    "one long": ([32768], 16, 128, {}),
    "two long, page 1": ([5000, 77], 1, 128, {}),
    "64 x 4096": ([4096] * 64, 16, 128, {}),
    "64 x 256-4096": (list(RNG.integers(256, 4097, 64)), 16, 128, {}),
    "128 x 16-8192": (list(RNG.integers(16, 8193, 128)), 16, 128, {}),
    "straggler": ([30000] + [300] * 40, 16, 128, {}),
    "all empty": ([0, 0, 0], 16, 128, {}),
    "no requests": ([], 16, 128, {}),
    "fixed split": ([700, 3, 0, 1, 4000, 16], 16, 128, {"fixed_split_size": 32}),
    "split disabled": ([700, 3, 0, 1, 32000], 16, 128, {"disable_split_kv": True}),
    "rope, head_dim 64": ([900, 5, 2000], 16, 64, {"pos_encoding_mode": "ROPE_LLAMA"}),
    "head_dim 256": ([900, 5, 2000], 32, 256, {}),
    "3000 requests": (list(RNG.integers(0, 300, 3000)), 16, 128, {}),
    "1500 requests, fixed split": (list(RNG.integers(1, 200, 1500)), 16, 128,
                                   {"fixed_split_size": 8}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_device_plan_is_the_host_plan(case):
    lengths, page_size, head_dim, kwargs = CASES[case]
    rng = np.random.default_rng(len(case))
    indptr, indices, last, num_pages = page_table_for(lengths, page_size, rng)
    w = _wrapper(max(len(lengths), 1), max(int(indptr[-1]), 1) + 5)
    w.plan(indptr, indices, last, HQ, HKV, head_dim, page_size, q_data_type="bfloat16",
           **kwargs)  # fmt: skip
    expect = w.plan_array()
    got = w.device_plan_array(*_device_table(indptr, indices, last), num_pages)
    assert got.dtype == np.int32 and got.shape == expect.shape
    got = got.get()
    assert got[0] == expect[0], "work items"
    np.testing.assert_array_equal(got, expect)
    rtcinfer.check_errors()


def _cupy_pool(seed: int):
    rng = np.random.default_rng(seed)
    return rng, make_batch(rng, [9000, 4000, 700, 600, 17, 2], group_size=4)


REPLANS = [
    [700, 3, 0, 1, 4000, 16],
    [1, 1, 1, 1, 1, 1],
    [0, 9000, 17, 513, 0, 2],
    [9000, 3000, 1000, 1, 1, 1],
]


def test_cupy_decode_over_device_plans():
    """One host plan() fixes the configuration; each later table is planned on the device
    only, and run(plan_array=...) reads that plan."""
    import cupy

    rng, batch = _cupy_pool(3)
    num_pages = batch.cache.shape[0]
    w = _wrapper(6, 1000)
    batch.plan(w)
    for lengths in REPLANS:
        table = batch.with_table(lengths, rng)
        plan = w.device_plan_array(*_device_table(table.indptr, table.indices, table.last),
                                   num_pages)  # fmt: skip
        o, lse = w.run(batch.q_dev, batch.cache_dev, return_lse=True, plan_array=plan)
        assert isinstance(o, cupy.ndarray)
        check_attention(o, lse, *table.reference(), "bfloat16")
    rtcinfer.check_errors()


def test_torch_decode_over_a_device_plan():
    torch = pytest.importorskip("torch")
    rng, batch = _cupy_pool(5)
    w = _wrapper(6, 1000)
    batch.plan(w)
    table = batch.with_table(REPLANS[2], rng)
    dev = [torch.as_tensor(x, device="cuda") for x in (table.indptr, table.indices, table.last)]
    plan = w.device_plan_array(*dev, batch.cache.shape[0])
    assert isinstance(plan, torch.Tensor) and plan.dtype == torch.int32
    q, cache = torch.from_dlpack(batch.q_dev), torch.from_dlpack(batch.cache_dev)
    o, lse = w.run(q, cache, return_lse=True, plan_array=plan)
    assert isinstance(o, torch.Tensor)
    check_attention(o, lse, *table.reference(), "bfloat16")


def test_a_torch_graph_plans_itself_at_every_replay():
    """device_plan_array and run(plan_array=...) captured in one CUDA graph over static table
    tensors: each replay plans the table copied in before it."""
    torch = pytest.importorskip("torch")
    rng, batch = _cupy_pool(6)
    w = _wrapper(6, 1000)
    batch.plan(w)
    q, cache = torch.from_dlpack(batch.q_dev), torch.from_dlpack(batch.cache_dev)
    static = [torch.zeros(n, dtype=torch.int32, device="cuda") for n in (7, 1000, 6)]

    def load(table):
        for dst, src in zip(static, (table.indptr, table.indices, table.last), strict=True):
            dst.zero_()
            dst[: len(src)].copy_(torch.from_numpy(np.asarray(src, np.int32)))

    def step():
        indptr, indices, last = static
        plan = w.device_plan_array(indptr, indices, last, batch.cache.shape[0])
        return w.run(q, cache, return_lse=True, plan_array=plan)

    load(batch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # kernels loaded outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = step()
    for lengths in REPLANS:
        table = batch.with_table(lengths, rng)
        load(table)
        graph.replay()
        torch.cuda.synchronize()
        check_attention(o, lse, *table.reference(), "bfloat16")
    rtcinfer.check_errors()


def test_a_compiled_torch_step_plans_itself():
    """torch.compile(fullgraph=True) of a step that plans on the device and decodes over that
    plan (one node each): the eager bits for every table, compiled once."""
    torch = pytest.importorskip("torch")
    rng, batch = _cupy_pool(8)
    w = _wrapper(6, 1000)
    batch.plan(w)
    q, cache = torch.from_dlpack(batch.q_dev), torch.from_dlpack(batch.cache_dev)
    num_pages = batch.cache.shape[0]

    def step(q, cache, indptr, indices, last):
        plan = w.device_plan_array(indptr, indices, last, num_pages)
        return w.run(q, cache, return_lse=True, plan_array=plan)

    compiled = torch.compile(step, fullgraph=True)
    for lengths in REPLANS:
        table = batch.with_table(lengths, rng)
        indices = np.zeros(1000, np.int32)
        indices[: table.indices.shape[0]] = table.indices
        args = [torch.as_tensor(a, device="cuda") for a in (table.indptr, indices, table.last)]
        want, got = step(q, cache, *args), compiled(q, cache, *args)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        check_attention(*got, *table.reference(), "bfloat16")


def test_jax_step_plans_itself_inside_jit():
    """The page table is the jitted step's input: the plan is built inside the computation,
    traced once for every later table of the same shapes."""
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    jnp = jax.numpy
    rng, batch = _cupy_pool(4)
    num_pages = batch.cache.shape[0]
    w = _wrapper(6, 1000)
    batch.plan(w)
    traces = []

    def step(q, cache, indptr, indices, last):
        traces.append(1)
        plan = w.device_plan_array(indptr, indices, last, num_pages)
        return w.run(q, cache, return_lse=True, plan_array=plan)

    jitted = jax.jit(step)
    q, cache = jnp.asarray(batch.q), jnp.asarray(batch.cache)
    for lengths in REPLANS:
        table = batch.with_table(lengths, rng)
        indices = np.zeros(1000, np.int32)  # one shape for every table: read to indptr[-1]
        indices[: table.indices.shape[0]] = table.indices
        for _ in range(2):  # the second call may replay a recorded command buffer
            o, lse = jitted(q, cache, jnp.asarray(table.indptr), jnp.asarray(indices),
                            jnp.asarray(table.last))  # fmt: skip
            check_attention(np.asarray(o), np.asarray(lse), *table.reference(), "bfloat16")
    assert len(traces) == 1
    rtcinfer.check_errors()


def _reported(w, table, num_pages, match):
    """Plan a bad table on the device: the plan holds what the kernel made of it, and
    check_errors() raises the report."""
    import cupy

    plan = w.device_plan_array(*_device_table(*table), num_pages)
    cupy.cuda.get_current_stream().synchronize()
    with pytest.raises(rtcinfer.BadIndexError, match=match):
        rtcinfer.check_errors()
    return plan.get()


def _broken(table, which: int, at: int, value: int, size: int | None = None):
    """The table with entry `at` of its array `which` (0 indptr, 1 indices, 2 last) set to
    `value` (the array first resized to `size`)."""
    arrays = [np.array(a, np.int32) for a in table]
    if size is not None:
        arrays[which] = np.resize(arrays[which], size)
    arrays[which][at] = value
    return arrays


def test_bad_tables_are_reported_and_plan_no_work():
    indptr, indices, last, num_pages = page_table_for([700, 3, 40], 16, np.random.default_rng(0))
    w = _wrapper(3, 100)
    w.plan(indptr, indices, last, HQ, HKV, 128, 16, q_data_type="bfloat16")
    items_end = 4 + 128 + 8 * w._ws.capacity.max_work  # the page ids follow (copied)
    table = (indptr, indices, last)
    long_ids = np.arange(200, dtype=np.int32) % num_pages  # valid: only kv_indptr is bad
    cases = [
        (_broken(table, 2, 1, 0), r"device_plan_array: kv_last_page_len\[1\] = 0 is out of range"),
        (_broken(table, 0, 2, 1), r"kv_indptr\[2\] = 1: the table must start at 0 and never"),
        ((_broken(table, 0, 3, 200)[0], long_ids, last), r"kv_indptr\[3\] = 200 pages exceed"),
    ]  # fmt: skip
    for bad, match in cases:
        plan = _reported(w, bad, num_pages, match)
        assert plan[0] == 0 and not plan[1:items_end].any()
    # A page id outside the cache: reported, page 0 in its place, the plan otherwise whole.
    expect = w.plan_array()
    wrong = _broken(table, 1, 4, num_pages + 5)
    match = rf"kv_indices\[4\] = {num_pages + 5} is not a page of the cache"
    plan = _reported(w, wrong, num_pages, match)
    at = items_end + 4  # the header, the items' room, page ids
    assert plan[at] == 0 and (np.delete(plan, at) == np.delete(expect, at)).all()


def test_a_fixed_split_past_the_capacity_is_reported():
    """plan() of a short table fixes a split of one page; a long table needs more items than
    the capacity under it (which plan() would refuse): the device plan reports it."""
    rng = np.random.default_rng(1)
    w = _wrapper(4, 1100)
    short = page_table_for([100] * 4, 16, rng)[:3]
    w.plan(*short, HQ, HKV, 128, 16, q_data_type="bfloat16", fixed_split_size=1)
    capacity = w._ws.capacity.max_work
    indptr, indices, last, num_pages = page_table_for([4000] * 4, 16, rng)
    plan = _reported(w, (indptr, indices, last), num_pages,
                     rf"fixed_split_size makes 1000 work items, more than the capacity's "
                     rf"{capacity}")  # fmt: skip
    assert plan[0] == 0


def test_the_next_call_raises_what_a_device_plan_reported():
    import cupy

    indptr, indices, last, num_pages = page_table_for([70, 3], 16, np.random.default_rng(2))
    w = _wrapper(2, 20)
    w.plan(indptr, indices, last, HQ, HKV, 128, 16, q_data_type="bfloat16")
    bad = last.copy()
    bad[0] = 17
    w.device_plan_array(*_device_table(indptr, indices, bad), num_pages)
    cupy.cuda.get_current_stream().synchronize()
    with pytest.raises(rtcinfer.BadIndexError, match=r"kv_last_page_len\[0\] = 17"):
        w.device_plan_array(*_device_table(indptr, indices, last), num_pages)
    w.device_plan_array(*_device_table(indptr, indices, last), num_pages)  # cleared
    rtcinfer.check_errors()
