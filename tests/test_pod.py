"""The POD wrappers on the GPU against float64 attention: a prefill chunk (or batch) and a decode
batch in one call, side by side on two streams for PyTorch and CuPy (one after the other for
JAX), eager and captured into a CUDA graph whose replays see new queries."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer

from . import reference_attention as aref
from .checks import assert_close, to_host
from .gpu_decode import random_values, to_gpu
from .test_shared_prefix import HKV, HQ, PAGE, D, PagedPool, _captured, _framework_arrays, table

pytestmark = pytest.mark.gpu
SCALE = 1 / np.sqrt(D)


def check_o(o, o_ref):
    assert_close(to_host(o), o_ref, "float16", "o", per_vector=True)


def decode_reference(q, segments, **features):
    """Each decode query over its request's keys (segments: PagedPool.add results)."""
    return np.concatenate([aref.attention_ref(q[b : b + 1], s[0], s[1], sm_scale=SCALE,
                                              **features)[0]
                           for b, s in enumerate(segments)])  # fmt: skip


@pytest.mark.parametrize("framework, graph", [("cupy", False), ("cupy", True), ("torch", False),
                                              ("torch", True), ("jax", False)])  # fmt: skip
def test_pod_runs_a_prefill_chunk_beside_a_decode_batch(framework, graph):
    import cupy

    rng = np.random.default_rng(3 + graph)
    pool = PagedPool(rng, 400)
    decodes = [pool.add(n) for n in (1, 250, 600, 33, 1000)]
    wrapper = rtcinfer.PODWithPagedKVCacheWrapper(None, "NHD")
    wrapper.plan(*table(decodes), HQ, HKV, D, PAGE, window_left=300, q_data_type="float16")
    qo_len, kv_len = 300, 900
    k_p = random_values(rng, (kv_len, HKV, D), "float16")
    v_p = random_values(rng, (kv_len, HKV, D), "float16")
    q_p_dev = to_gpu(np.zeros((qo_len, HQ, D), np.float16))
    q_d_dev = to_gpu(np.zeros((len(decodes), HQ, D), np.float16))
    q_p_in, q_d_in, k_in, v_in, cache_in = _framework_arrays(
        framework, q_p_dev, q_d_dev, to_gpu(k_p), to_gpu(v_p), to_gpu(pool.cache)
    )

    def call():
        return wrapper.run(q_p_in, k_in, v_in, q_d_in, cache_in, causal_p=True, v_scale=0.5)

    replay = None
    if graph:
        call()  # load the kernels outside the capture
        cupy.cuda.Device().synchronize()
        (o_p, o_d), replay = _captured(framework, call)
    for _ in range(2):  # new queries each time: a replay must see them
        q_p = random_values(rng, (qo_len, HQ, D), "float16")
        q_d = random_values(rng, (len(decodes), HQ, D), "float16")
        q_p_dev[...], q_d_dev[...] = to_gpu(q_p), to_gpu(q_d)
        cupy.cuda.Device().synchronize()
        if replay is None:
            q_p_in, q_d_in = _framework_arrays(framework, q_p_dev, q_d_dev)
            o_p, o_d = call()
        else:
            replay()
        cupy.cuda.Device().synchronize()
        check_o(o_p, aref.attention_ref(q_p, k_p, v_p, sm_scale=SCALE, causal=True)[0])
        check_o(o_d, decode_reference(q_d, decodes, window_left=300, v_scale=0.5))


@pytest.mark.parametrize("mask", ["none", "causal", "custom"])
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_batch_pod_runs_a_prefill_batch_beside_a_decode_batch(framework, mask):
    rng = np.random.default_rng(7 + len(mask))
    pool = PagedPool(rng, 600)
    qo_p = [40, 1, 130]
    prefills = [pool.add(n + 60) for n in qo_p]
    decodes = [pool.add(n) for n in (700, 5, 1200, 64)]
    qo_d = [1, 1, 1, 3]  # the last decode request has three queries (none causal)
    qo_indptr_p = np.concatenate([[0], np.cumsum(qo_p)]).astype(np.int32)
    qo_indptr_d = np.concatenate([[0], np.cumsum(qo_d)]).astype(np.int32)
    wrapper = rtcinfer.BatchPODWithPagedKVCacheWrapper(None, "NHD")
    wrapper.plan(qo_indptr_p, *table(prefills), qo_indptr_d, *table(decodes), HQ, HKV, D, PAGE,
                 q_data_type="float16")  # fmt: skip
    q_p = random_values(rng, (sum(qo_p), HQ, D), "float16")
    q_d = random_values(rng, (sum(qo_d), HQ, D), "float16")
    masks = [rng.random((n, n + 60)) < 0.6 for n in qo_p]
    kw = dict(causal_p=mask == "causal")
    if mask == "custom":
        kw["custom_mask_p"] = to_gpu(np.concatenate([m.ravel() for m in masks]))
    q_p_in, q_d_in, cache_in = _framework_arrays(framework, to_gpu(q_p), to_gpu(q_d),
                                                 to_gpu(pool.cache))  # fmt: skip
    (o_p, lse_p), (o_d, lse_d) = wrapper.run(q_p_in, cache_in, q_d_in, cache_in,
                                             return_lse=True, **kw)  # fmt: skip
    ref_p = [aref.attention_ref(q_p[qo_indptr_p[b] : qo_indptr_p[b + 1]], s[0], s[1],
                                sm_scale=SCALE, causal=mask == "causal",
                                mask=masks[b] if mask == "custom" else None)
             for b, s in enumerate(prefills)]  # fmt: skip
    ref_d = [aref.attention_ref(q_d[qo_indptr_d[b] : qo_indptr_d[b + 1]], s[0], s[1],
                                sm_scale=SCALE) for b, s in enumerate(decodes)]  # fmt: skip
    for (o, lse), refs in (((o_p, lse_p), ref_p), ((o_d, lse_d), ref_d)):
        check_o(o, np.concatenate([r[0] for r in refs]))
        assert_close(to_host(lse), np.concatenate([r[1] for r in refs]), "float32", "lse",
                     tol=2e-3)  # fmt: skip
    # FlashInfer's form without LSEs, and a mask change between runs (a re-plan)
    o_p, o_d = wrapper.run(q_p_in, cache_in, q_d_in, cache_in, causal_p=True)
    ref_causal = [aref.attention_ref(q_p[qo_indptr_p[b] : qo_indptr_p[b + 1]], s[0], s[1],
                                     sm_scale=SCALE, causal=True)[0]
                  for b, s in enumerate(prefills)]  # fmt: skip
    check_o(o_p, np.concatenate(ref_causal))
    check_o(o_d, np.concatenate([r[0] for r in ref_d]))
