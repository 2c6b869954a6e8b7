"""Multi-item scoring in batch prefill against the float64 reference on the GPU: ragged and
paged, a prefix and items of random lengths per request, appends (queries the last keys), the
scoring arrays on the device, a sliding window on top."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer

from . import reference_attention as aref
from .checks import assert_close, to_host
from .gpu_decode import random_values, to_gpu
from .test_multi_item import _token_pos

pytestmark = pytest.mark.gpu


def _scoring(rng, qo, kv, width):
    prefix = np.array([int(rng.integers(0, k // 2 + 1)) for k in kv], np.uint32)
    pos = np.zeros(len(kv) * width, np.uint16)
    for b, (k, p) in enumerate(zip(kv, prefix, strict=True)):
        pos[b * width : b * width + k - p] = _token_pos(rng, int(k - p))
    return prefix, pos


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("window_left", [-1, 20])
def test_multi_item_scoring(paged, window_left):
    rng = np.random.default_rng(int(paged) * 2 + (window_left > 0))
    qo = np.array([40, 1, 0, 130, 77])
    kv = qo + np.array([0, 30, 9, 200, 0])
    width = int(kv.max())
    prefix, pos = _scoring(rng, qo, kv, width)
    hq, hkv, d, page = 8, 2, 128, 16
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    q = random_values(rng, (int(qo_indptr[-1]), hq, d), "bfloat16")
    k = random_values(rng, (int(kv_indptr[-1]), hkv, d), "bfloat16")
    v = random_values(rng, (int(kv_indptr[-1]), hkv, d), "bfloat16")
    scoring = dict(prefix_len_ptr=to_gpu(prefix), token_pos_in_items_ptr=to_gpu(pos),
                   token_pos_in_items_len=width, window_left=window_left,
                   q_data_type="bfloat16")  # fmt: skip
    if paged:  # each request's keys on pages of its own, in a shuffled pool
        pages = -(-kv // page)
        ids = rng.permutation(int(pages.sum())).astype(np.int32)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        last = (kv - (pages - 1) * page).astype(np.int32)
        cache = np.zeros((int(pages.sum()), 2, page, hkv, d), k.dtype)
        for b in range(len(kv)):
            for t in range(kv[b]):
                page_id = ids[indptr[b] + t // page]
                cache[page_id, 0, t % page] = k[kv_indptr[b] + t]
                cache[page_id, 1, t % page] = v[kv_indptr[b] + t]
        wrapper = rtcinfer.BatchPrefillWithPagedKVCacheWrapper()
        wrapper.plan(qo_indptr, indptr, ids, np.where(pages > 0, last, 0), hq, hkv, d, page,
                     **scoring)  # fmt: skip
        o, lse = wrapper.run(to_gpu(q), to_gpu(cache), return_lse=True)
    else:
        wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
        wrapper.plan(qo_indptr, kv_indptr, hq, hkv, d, **scoring)
        o, lse = wrapper.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True)
    refs = [aref.attention_ref(q[qo_indptr[b] : qo_indptr[b + 1]],
                               k[kv_indptr[b] : kv_indptr[b + 1]],
                               v[kv_indptr[b] : kv_indptr[b + 1]], sm_scale=1 / np.sqrt(d),
                               window_left=window_left,
                               mask=aref.multi_item_visible_ref(int(qo[b]), int(kv[b]),
                                                                int(prefix[b]),
                                                                pos[b * width :]))
            for b in range(len(qo))]  # fmt: skip
    o_ref, lse_ref = (np.concatenate(x) for x in zip(*refs, strict=True))
    assert_close(to_host(o), o_ref, "bfloat16", "o", per_vector=True)
    assert_close(to_host(lse), lse_ref, "float32", "lse", tol=2e-3)
