"""Batch prefill in CUDA-graph mode on the GPU: one captured run() replayed after each of
several re-plans with new lengths (split and whole plans, custom masks from the host and from
the device), each replay against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer

from .gpu_decode import random_values, to_gpu
from .test_prefill import check, random_masks, reference

pytestmark = pytest.mark.gpu


def replay_after_each_plan(wrapper, rows: int, kv_rows: int, plans, rng,
                           dims=(128, 128)) -> None:  # fmt: skip
    """Plan each (qo, kv, plan keywords, masks or None) of `plans` on a ragged use_cuda_graph
    wrapper whose run() over q [rows] was captured once, after the first plan, on a CuPy
    stream; replay, and check the rows of that plan against float64 attention (causal
    without masks). dims: (head_dim_qk, head_dim_vo)."""
    import cupy

    d, dv = dims
    q_all = random_values(rng, (rows, 8, d), "bfloat16")
    k_all = random_values(rng, (kv_rows, 2, d), "bfloat16")
    v_all = random_values(rng, (kv_rows, 2, dv), "bfloat16")
    q, k, v = to_gpu(q_all), to_gpu(k_all), to_gpu(v_all)
    out = cupy.empty((rows, 8, dv), dtype=q.dtype)
    lse = cupy.empty((rows, 8), dtype=np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for i, (qo, kv, kw, masks) in enumerate(plans):
            qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
            kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
            masks = masks(qo_indptr, kv_indptr) if masks else None
            if masks is not None:
                kw = {**kw, "custom_mask": masks[1]}
                masks = masks[0]
            wrapper.plan(qo_indptr, kv_indptr, 8, 2, d, dv, causal=masks is None,
                         q_data_type="bfloat16", **kw)  # fmt: skip
            if i == 0:  # compile and load outside the capture, then capture
                wrapper.run(q, k, v, out=out, lse=lse)
                stream.synchronize()
                stream.begin_capture()
                wrapper.run(q, k, v, out=out, lse=lse)
                graph = stream.end_capture()
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            n = int(qo_indptr[-1])
            expect = reference(q_all[:n], k_all, v_all, qo_indptr, kv_indptr, masks=masks,
                               causal=masks is None, sm_scale=1 / np.sqrt(d))  # fmt: skip
            check(out[:n], lse[:n], *expect, "bfloat16")


@pytest.mark.parametrize("dims", [(128, 128), (192, 128)])
def test_cuda_graph_replays_after_replan(dims):
    """A graph captured around run() of a use_cuda_graph wrapper replays correctly after plans
    with new lengths, fewer rows and requests, split and not (q padded to the first plan's
    rows; rows past a plan are left alone); dims: (head_dim_qk, head_dim_vo), v of fewer dims
    too."""
    import cupy

    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper(
        use_cuda_graph=True, qo_indptr_buf=cupy.empty(5, np.int32),
        kv_indptr_buf=cupy.empty(5, np.int32),
    )  # fmt: skip
    plans = [([100, 150, 50, 0], [900, 150, 1000, 0]), ([1, 1, 1], [8000, 1, 0]),
             ([300], [300]), ([7, 0, 100, 90], [2000, 30, 100, 90])]  # fmt: skip
    replay_after_each_plan(wrapper, 300, 9000, [(qo, kv, {}, None) for qo, kv in plans],
                           np.random.default_rng(21), dims)  # fmt: skip


@pytest.mark.parametrize("on_device", [False, True])
def test_cuda_graph_replays_custom_masks_after_replan(on_device):
    """Custom masks in CUDA-graph mode: the packed mask travels in the workspace at a fixed
    place, so a graph captured around run() replays each later plan's own mask (host masks
    uploaded with the plan, device masks copied behind it), split and not."""
    import cupy

    rng = np.random.default_rng(22 + on_device)
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper(
        use_cuda_graph=True, qo_indptr_buf=cupy.empty(4, np.int32),
        custom_mask_buf=cupy.empty(1 << 16, np.uint8),
    )  # fmt: skip

    def masks(qo_indptr, kv_indptr):
        per_request = random_masks(rng, qo_indptr, kv_indptr)
        flat = np.concatenate([m.ravel() for m in per_request])
        return per_request, to_gpu(flat) if on_device else flat

    plans = [([120, 80], [300, 900], {}, masks),
             ([50, 3, 100], [1000, 3, 400], {"fixed_split_size": 256}, masks),
             ([200], [1500], {}, masks)]  # fmt: skip
    replay_after_each_plan(wrapper, 200, 3000, plans, rng)
