"""Cascade attention over shared prefixes against float64 attention over the concatenated keys:
MultiLevelCascadeAttentionWrapper (two and three levels over one paged cache), and the
shared-prefix decode and prefill wrappers."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer

from . import reference_attention as aref
from .checks import assert_close, to_host
from .gpu_decode import random_values, to_gpu

HQ, HKV, D, PAGE = 8, 2, 128, 16


class PagedPool:
    """A host paged cache [pages, 2, PAGE, HKV, D] filled segment by segment."""

    def __init__(self, rng, num_pages):
        self.rng = rng
        self.cache = np.zeros((num_pages, 2, PAGE, HKV, D), np.float16)
        self.free = list(rng.permutation(num_pages))

    def add(self, length):
        """Random keys and values of `length` tokens on fresh pages: (k, v, page ids, last)."""
        k = random_values(self.rng, (length, HKV, D), "float16")
        v = random_values(self.rng, (length, HKV, D), "float16")
        pages = [self.free.pop() for _ in range(-(-length // PAGE))]
        for t in range(length):
            self.cache[pages[t // PAGE], 0, t % PAGE] = k[t]
            self.cache[pages[t // PAGE], 1, t % PAGE] = v[t]
        last = length - (len(pages) - 1) * PAGE if pages else 0
        return k, v, np.array(pages, np.int32), last


def table(segments):
    """(indptr, indices, last_page_len) of a list of PagedPool.add results."""
    indptr = np.concatenate([[0], np.cumsum([len(s[2]) for s in segments])]).astype(np.int32)
    indices = np.concatenate([s[2] for s in segments]).astype(np.int32)
    return indptr, indices, np.array([s[3] for s in segments], np.int32)


def check(o, lse, o_ref, lse_ref):
    assert_close(to_host(o), o_ref, "float16", "o", per_vector=True)
    assert_close(to_host(lse), lse_ref, "float32", "lse", tol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("levels", [2, 3])
def test_multi_level_cascade(levels):
    rng = np.random.default_rng(levels)
    pool = PagedPool(rng, 400)
    qo = [3, 40, 1, 17]
    prefix = pool.add(300)  # level 0: every request
    pairs = [pool.add(50), pool.add(33)]  # level 1 of three: requests (0, 1) and (2, 3)
    unique = [pool.add(n + 20) for n in qo]  # last level: >= each request's queries
    q = random_values(rng, (sum(qo), HQ, D), "float16")
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    levels_qo = [np.array([0, sum(qo)], np.int32)]
    tables = [table([prefix])]
    if levels == 3:
        levels_qo.append(np.array([0, qo[0] + qo[1], sum(qo)], np.int32))
        tables.append(table(pairs))
    levels_qo.append(qo_indptr)
    tables.append(table(unique))
    wrapper = rtcinfer.MultiLevelCascadeAttentionWrapper(levels)
    wrapper.plan(levels_qo, [t[0] for t in tables], [t[1] for t in tables],
                 [t[2] for t in tables], HQ, HKV, D, PAGE, causal=True,
                 q_data_type="float16")  # fmt: skip
    o, lse = wrapper.run(to_gpu(q), to_gpu(pool.cache), return_lse=True)
    outs = []
    for b in range(len(qo)):
        parts = [prefix] + ([pairs[b // 2]] if levels == 3 else []) + [unique[b]]
        k = np.concatenate([p[0] for p in parts])
        v = np.concatenate([p[1] for p in parts])
        outs.append(aref.attention_ref(q[qo_indptr[b] : qo_indptr[b + 1]], k, v, causal=True,
                                      sm_scale=1 / np.sqrt(D)))  # fmt: skip
    check(o, lse, np.concatenate([x[0] for x in outs]), np.concatenate([x[1] for x in outs]))


@pytest.mark.gpu
def test_shared_prefix_decode_and_prefill():
    rng = np.random.default_rng(7)
    pool = PagedPool(rng, 200)
    k_shared = random_values(rng, (500, HKV, D), "float16")
    v_shared = random_values(rng, (500, HKV, D), "float16")
    unique = [pool.add(n) for n in (1, 70, 16, 300)]
    indptr, indices, last = table(unique)
    cache = to_gpu(pool.cache)
    ks, vs = to_gpu(k_shared), to_gpu(v_shared)

    q = random_values(rng, (4, HQ, D), "float16")  # decode: one query per request
    decode = rtcinfer.BatchDecodeWithSharedPrefixPagedKVCacheWrapper()
    decode.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type="float16")
    o, lse = decode.run(to_gpu(q), ks, vs, cache, return_lse=True)
    outs = [aref.attention_ref(q[b : b + 1], np.concatenate([k_shared, u[0]]),
                              np.concatenate([v_shared, u[1]]), sm_scale=1 / np.sqrt(D))
            for b, u in enumerate(unique)]  # fmt: skip
    check(o, lse, np.concatenate([x[0] for x in outs]), np.concatenate([x[1] for x in outs]))

    qo = [1, 30, 16, 100]
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    q = random_values(rng, (sum(qo), HQ, D), "float16")
    prefill = rtcinfer.BatchPrefillWithSharedPrefixPagedKVCacheWrapper()
    prefill.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, PAGE, causal=True,
                 q_data_type="float16")  # fmt: skip
    o, lse = prefill.run(to_gpu(q), ks, vs, cache, return_lse=True)
    outs = [aref.attention_ref(q[qo_indptr[b] : qo_indptr[b + 1]],
                              np.concatenate([k_shared, u[0]]), np.concatenate([v_shared, u[1]]),
                              causal=True, sm_scale=1 / np.sqrt(D))
            for b, u in enumerate(unique)]  # fmt: skip
    check(o, lse, np.concatenate([x[0] for x in outs]), np.concatenate([x[1] for x in outs]))


def _framework_arrays(framework, *arrays):
    if framework == "torch":
        torch = pytest.importorskip("torch")
        return [torch.from_dlpack(a) for a in arrays]
    if framework == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return [jnp.asarray(a.get()) for a in arrays]
    return list(arrays)


def _captured(framework, fn):
    """fn() captured into a CUDA graph on a side stream of the framework, and its replay."""
    if framework == "torch":
        torch = pytest.importorskip("torch")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return out, graph.replay
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        out = fn()
        graph = stream.end_capture()
    return out, lambda: graph.launch(stream)


@pytest.mark.gpu
@pytest.mark.parametrize("own_first", [False, True])
@pytest.mark.parametrize(
    "framework, graph",
    [("cupy", False), ("cupy", True), ("torch", False), ("torch", True), ("jax", False)],
)
def test_levels_side_by_side(monkeypatch, framework, graph, own_first):
    """The shared and own levels on two streams (side_stream.py), in either launch order, for
    each framework (JAX: one after the other), eager and captured into a CUDA graph whose
    replays see new queries; the multi-level wrapper's later levels the same way. (These
    levels are small: the overlap is forced.)"""
    import cupy

    from rtcinfer.attention import shared_prefix

    monkeypatch.setattr(shared_prefix, "MIN_SIDE_WORK", 0)

    rng = np.random.default_rng(11)
    pool = PagedPool(rng, 300)
    k_shared = random_values(rng, (700, HKV, D), "float16")
    v_shared = random_values(rng, (700, HKV, D), "float16")
    unique = [pool.add(n) for n in (1, 250, 0, 600, 33)]
    indptr, indices, last = table(unique)
    decode = rtcinfer.BatchDecodeWithSharedPrefixPagedKVCacheWrapper()
    decode.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type="float16")
    decode._own_work = float("inf") if own_first else 0.0
    q_dev = to_gpu(np.zeros((5, HQ, D), np.float16))
    device = [to_gpu(a) for a in (pool.cache, k_shared, v_shared)]
    cache_in, ks_in, vs_in = _framework_arrays(framework, *device)
    q_in = _framework_arrays(framework, q_dev)[0]  # a view of q_dev (torch, CuPy)

    def call():
        return decode.run(q_in, ks_in, vs_in, cache_in, return_lse=True)

    replay = None
    if graph:
        call()  # load the kernels outside the capture
        cupy.cuda.Device().synchronize()
        (o, lse), replay = _captured(framework, call)
    for _ in range(2):  # new queries each time: a replay must see them
        q = random_values(rng, (5, HQ, D), "float16")
        q_dev[...] = to_gpu(q)
        cupy.cuda.Device().synchronize()
        if replay is None:
            q_in = _framework_arrays(framework, q_dev)[0]
            o, lse = call()
        else:
            replay()
        cupy.cuda.Device().synchronize()
        outs = [aref.attention_ref(q[b : b + 1], np.concatenate([k_shared, u[0]]),
                                  np.concatenate([v_shared, u[1]]), sm_scale=1 / np.sqrt(D))
                for b, u in enumerate(unique)]  # fmt: skip
        check(o, lse, np.concatenate([x[0] for x in outs]), np.concatenate([x[1] for x in outs]))

    if graph:
        return
    qo = [2, 19, 0, 40, 7]
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    q = random_values(rng, (sum(qo), HQ, D), "float16")
    prefix, own = pool.add(200), [pool.add(n + 5) for n in qo]
    levels = [table([prefix]), table(own)]
    wrapper = rtcinfer.MultiLevelCascadeAttentionWrapper(2)
    wrapper.plan([np.array([0, sum(qo)], np.int32), qo_indptr], [t[0] for t in levels],
                 [t[1] for t in levels], [t[2] for t in levels], HQ, HKV, D, PAGE,
                 causal=True, q_data_type="float16")  # fmt: skip
    wrapper._work = [1.0, 2.0] if own_first else [2.0, 1.0]
    q_in, cache_in = _framework_arrays(framework, to_gpu(q), to_gpu(pool.cache))
    o, lse = wrapper.run(q_in, cache_in, return_lse=True)
    assert type(o).__module__.partition(".")[0] == type(q_in).__module__.partition(".")[0]
    outs = [aref.attention_ref(q[qo_indptr[b] : qo_indptr[b + 1]],
                              np.concatenate([prefix[0], u[0]]), np.concatenate([prefix[1], u[1]]),
                              causal=True, sm_scale=1 / np.sqrt(D))
            for b, u in enumerate(own)]  # fmt: skip
    check(o, lse, np.concatenate([x[0] for x in outs]), np.concatenate([x[1] for x in outs]))


@pytest.mark.gpu
def test_a_call_on_another_stream_must_be_given_its_outputs():
    """launching_on (the side stream's calls) refuses a call that would allocate, whose memory
    the caller's allocator orders on its own stream only."""
    import cupy

    from rtcinfer.interop.call import launching_on

    x = cupy.ones((4, 256), cupy.float16)
    w = cupy.ones(256, cupy.float16)
    cupy.cuda.Device().synchronize()  # the side stream is not ordered after the legacy one
    stream = cupy.cuda.Stream(non_blocking=True)
    with launching_on(stream.ptr), pytest.raises(RuntimeError, match="given its outputs"):
        rtcinfer.rmsnorm(x, w)
    out = cupy.empty_like(x)
    with launching_on(stream.ptr):
        rtcinfer.rmsnorm(x, w, out=out)
    stream.synchronize()
    assert_close(to_host(out), to_host(x), "float16", "rmsnorm of ones")
