"""Batch decode inside CUDA graphs (CuPy and PyTorch capture) and from PyTorch, JAX and CuPy
arrays (GPU). A graph captured around run() must replay correctly after plan() is called again
with new lengths, page tables and split decisions."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer

from .checks import assert_close, to_host
from .gpu_decode import check_attention, make_batch

pytestmark = pytest.mark.gpu

# Lengths re-planned under one captured graph: split and unsplit, longer and shorter than the
# first plan, empty requests, and a smaller batch (rows past it are left alone).
REPLANS = [
    [700, 3, 0, 1, 4000, 16],
    [1, 1, 1, 1, 1, 1],
    [0, 9000, 17, 513, 0, 2],
    [5, 2048, 600, 31],
]


def _pool(seed: int):
    """A batch of 6 requests over a cache large enough for every table in REPLANS."""
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, [9000, 4000, 700, 600, 17, 2], group_size=4)
    return rng, batch


def _graph_wrapper(batch, workspace=None, buffers=None):
    if buffers is None:
        import cupy

        buffers = (cupy.empty(7, np.int32), cupy.empty(1000, np.int32), cupy.empty(6, np.int32))
    return rtcinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(workspace, *buffers)


def test_cupy_graph_replays_after_replan():
    import cupy

    rng, batch = _pool(1)
    wrapper = _graph_wrapper(batch)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        batch.plan(wrapper)
        wrapper.run(batch.q_dev, batch.cache_dev)  # compile and load outside the capture
        out = cupy.empty((6, 8, 128), dtype=batch.q.dtype)
        lse = cupy.empty((6, 8), dtype=np.float32)
        stream.synchronize()
        stream.begin_capture()
        wrapper.run(batch.q_dev, batch.cache_dev, out=out, lse=lse)
        graph = stream.end_capture()
        for lengths in REPLANS:
            table = batch.with_table(lengths, rng)
            n = len(lengths)
            sub = table.__class__(**{**table.__dict__, "q": table.q[:n]})
            sub.plan(wrapper)
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            o_ref, lse_ref = sub.reference()
            check_attention(out[:n], lse[:n], o_ref, lse_ref, "bfloat16")


def test_replan_beyond_the_captured_batch_is_refused():
    """A graph captured with 4 of the capacity's 6 requests holds q and o of 4 rows: a plan of
    6 would make its replays read and write past them, so plan() refuses it (4 still plans)."""
    import cupy

    rng, batch = _pool(5)
    wrapper = _graph_wrapper(batch)
    four = batch.with_table([700, 3, 0, 1], rng)
    q = batch.q_dev[:4]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        four.plan(wrapper)
        out = wrapper.run(q, batch.cache_dev)  # compile and load outside the capture
        stream.synchronize()
        stream.begin_capture()
        wrapper.run(q, batch.cache_dev, out=out)
        stream.end_capture()
        with pytest.raises(ValueError, match="captured into a CUDA graph with 4"):
            batch.plan(wrapper)
        four.plan(wrapper)


def test_torch_graph_replays_after_replan():
    torch = pytest.importorskip("torch")
    rng, batch = _pool(2)
    workspace = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    buffers = [torch.empty(n, dtype=torch.int32, device="cuda") for n in (7, 1000, 6)]
    wrapper = _graph_wrapper(batch, workspace, buffers)
    q, cache = torch.from_dlpack(batch.q_dev), torch.from_dlpack(batch.cache_dev)
    batch.plan(wrapper)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as PyTorch recommends
        warm = wrapper.run(q, cache)
    torch.cuda.current_stream().wait_stream(side)
    assert_close(warm, batch.reference()[0], "bfloat16")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = wrapper.run(q, cache, return_lse=True)
    assert isinstance(out, torch.Tensor)
    for lengths in REPLANS[:3]:
        table = batch.with_table(lengths, rng)
        table.plan(wrapper)
        graph.replay()
        torch.cuda.synchronize()
        check_attention(out, lse, *table.reference(), "bfloat16")


def test_torch_arrays_in_torch_arrays_out():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    batch = make_batch(rng, [100, 0, 513], form="tuple", kv_dtype="float8_e5m2")
    k, v = (torch.from_dlpack(c).view(torch.float8_e5m2) for c in batch.cache_dev)
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    batch.plan(wrapper)
    o, lse = wrapper.run(torch.from_dlpack(batch.q_dev), (k, v), return_lse=True, v_scale=3.0)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16
    check_attention(o, lse, *batch.reference(v_scale=3.0), "bfloat16")


def _jax_gpu():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    return jax


def test_jax_eager_and_jit_with_replan():
    jax = _jax_gpu()
    rng, batch = _pool(4)
    q, cache = jax.numpy.asarray(batch.q), jax.numpy.asarray(batch.cache)
    capacity = dict(paged_kv_indptr_buffer=np.empty(7), paged_kv_indices_buffer=np.empty(1000))
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True, **capacity)
    batch.plan(wrapper)
    o, lse = wrapper.run(q, cache, return_lse=True)  # eager
    assert isinstance(o, jax.Array)
    check_attention(np.asarray(o), np.asarray(lse), *batch.reference(), "bfloat16")
    step = jax.jit(lambda q, c: wrapper.run(q, c, return_lse=True))
    for lengths in REPLANS[:3]:
        table = batch.with_table(lengths, rng)
        table.plan(wrapper)
        for _ in range(2):  # the second call may replay a recorded command buffer
            o, lse = step(q, cache)
            check_attention(np.asarray(o), np.asarray(lse), *table.reference(), "bfloat16")


def test_jax_single_decode_in_jit():
    jax = _jax_gpu()
    from . import reference_attention as aref
    from .gpu_decode import random_values

    rng = np.random.default_rng(5)
    q = random_values(rng, (8, 128), "bfloat16")
    k, v = (random_values(rng, (3000, 2, 128), "bfloat16") for _ in range(2))
    fn = jax.jit(lambda q, k, v: rtcinfer.single_decode_with_kv_cache(q, k, v, return_lse=True))
    o, lse = fn(*(jax.numpy.asarray(x) for x in (q, k, v)))
    expected = aref.single_decode_ref(q, k, v, return_lse=True)
    check_attention(np.asarray(o), np.asarray(lse), *expected, "bfloat16")


def test_cupy_run_on_another_stream_waits_for_the_plan():
    import cupy

    rng = np.random.default_rng(6)
    batch = make_batch(rng, [3000, 20, 1])
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    batch.plan(wrapper)  # uploaded on the null stream
    other = cupy.cuda.Stream(non_blocking=True)
    with other:
        o, lse = wrapper.run(batch.q_dev, batch.cache_dev, return_lse=True)
        other.synchronize()
    check_attention(o, lse, *batch.reference(), "bfloat16")
    assert to_host(o).shape == (3, 8, 128)


def test_single_decode_in_a_torch_cuda_graph():
    """single_decode_with_kv_cache captured with torch.cuda.graph after the usual warm-up call
    (which uploads its plan for these shapes) replays correctly on new contents, and so does a
    first call with new shapes made inside the capture (its plan is uploaded outside the graph,
    in relaxed capture mode)."""
    torch = pytest.importorskip("torch")
    from . import reference_attention as aref

    q = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(777, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rtcinfer.single_decode_with_kv_cache(q, k, v)  # warm-up: compiles, uploads the plan
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = rtcinfer.single_decode_with_kv_cache(q, k, v)
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        want = aref.single_decode_ref(to_host(q), to_host(k), to_host(v))
        assert_close(o, want, "bfloat16")
    k2 = torch.randn(778, 8, 128, device="cuda", dtype=torch.bfloat16)  # unseen shapes
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):  # the plan upload happens now, outside the graph
        o2 = rtcinfer.single_decode_with_kv_cache(q, k2, k2)
    k2.copy_(torch.randn_like(k2))
    graph2.replay()
    torch.cuda.synchronize()
    assert_close(o2, aref.single_decode_ref(to_host(q), to_host(k2), to_host(k2)), "bfloat16")
