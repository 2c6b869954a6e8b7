"""Batch and single prefill with v of fewer dims than q and k (head_dim_qk 192, head_dim_vo
128: DeepSeek's prefill) on the GPU against the float64 reference: ragged and paged (a
(k_cache, v_cache) pair, NHD and HND), causal and not, every mask and logit feature the
kernel keeps, GQA, both 16-bit dtypes, split and whole plans, strided v and given outputs,
PyTorch (eager and torch.compile) and JAX (eager and jax.jit); CUDA-graph replays after
re-plans: test_prefill_graph.py."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import rtcinfer

from .checks import to_host
from .gpu_decode import random_values, to_gpu
from .test_prefill import (
    FEATURES,
    LENGTHS,
    check,
    paged_table,
    random_masks,
    ref_features,
    reference,
)

pytestmark = pytest.mark.gpu

D_QK, D_VO = 192, 128
SM_SCALE = 1 / np.sqrt(D_QK)  # FlashInfer's default: head_dim_qk's


def batch(rng, qo, extra, hq=8, hkv=2, dtype="bfloat16"):
    """q [nnz_q, hq, 192], k [nnz_kv, hkv, 192], v [nnz_kv, hkv, 128] and the indptrs."""
    qo = np.asarray(qo)
    kv = qo + np.asarray(extra)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    q = random_values(rng, (int(qo_indptr[-1]), hq, D_QK), dtype)
    k = random_values(rng, (int(kv_indptr[-1]), hkv, D_QK), dtype)
    v = random_values(rng, (int(kv_indptr[-1]), hkv, D_VO), dtype)
    return q, k, v, qo_indptr, kv_indptr


@pytest.fixture(params=["default", "mma_sync"])
def kernel(request, monkeypatch):
    """The device's own kernel (warpgroup MMAs on sm_90a for 64- and 128-row tiles), and the
    mma.sync one everywhere (RTCINFER_PREFILL_WGMMA=0, read at a configuration's first plan)."""
    if request.param == "mma_sync":
        monkeypatch.setenv("RTCINFER_PREFILL_WGMMA", "0")
    else:
        monkeypatch.delenv("RTCINFER_PREFILL_WGMMA", raising=False)
    return request.param


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("split", [False, True])
def test_ragged(kernel, causal, feature, split):
    rng = np.random.default_rng(zlib.crc32(repr(("vo", causal, feature, split)).encode()))
    qo = [int(x) for x in rng.permutation(LENGTHS)]
    extra = [int(x) for x in rng.integers(0, 200, len(qo))]
    q, k, v, qo_indptr, kv_indptr = batch(rng, qo, extra)
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, D_QK, D_VO, causal=causal, q_data_type="bfloat16",
                 disable_split_kv=not split, fixed_split_size=64 if split else None,
                 **FEATURES[feature])  # fmt: skip
    o, lse = wrapper.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True)
    assert o.shape == (q.shape[0], 8, D_VO)
    features = ref_features(FEATURES[feature], 8, D_QK, causal)
    check(o, lse, *reference(q, k, v, qo_indptr, kv_indptr, **features), "bfloat16")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("qo, extra", [
    ([33, 200, 5], [0, 100, 600]),        # 64- and 128-row tiles
    ([1, 2, 1, 3], [700, 40, 0, 2000]),   # decode-like: 16-row tiles, four warps on the keys
])  # fmt: skip
def test_dtypes_groups_and_tiles(kernel, dtype, group, qo, extra):
    rng = np.random.default_rng(group * 10 + len(qo) + (dtype == "float16"))
    q, k, v, qo_indptr, kv_indptr = batch(rng, qo, extra, hq=2 * group, hkv=2, dtype=dtype)
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo_indptr, kv_indptr, 2 * group, 2, D_QK, head_dim_vo=D_VO, causal=True,
                 q_data_type=dtype)  # fmt: skip
    o, lse = wrapper.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True)
    check(o, lse, *reference(q, k, v, qo_indptr, kv_indptr, causal=True, sm_scale=SM_SCALE),
          dtype)  # fmt: skip


def paged_pair(k, v, kv_indptr, indptr, indices, num_pages, page_size, layout):
    """Host k_cache [pages, ..., 192] and v_cache [pages, ..., 128] (NHD or HND) holding each
    request's ragged rows in its pages, zeros elsewhere."""
    heads = k.shape[1]
    caches = []
    for src in (k, v):
        inner = (page_size, heads) if layout == "NHD" else (heads, page_size)
        cache = np.zeros((num_pages, *inner, src.shape[2]), dtype=src.dtype)
        for b, n in enumerate(np.diff(kv_indptr)):
            t = np.arange(n)
            page, slot = indices[indptr[b] + t // page_size], t % page_size
            if layout == "NHD":
                cache[page, slot] = src[kv_indptr[b] + t]
            else:
                cache[page, :, slot] = src[kv_indptr[b] + t]
        caches.append(cache)
    return caches


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("split", [False, True])
def test_paged_append(kernel, layout, page_size, split):
    rng = np.random.default_rng(page_size + (layout == "HND") * 7 + split * 3)
    qo = [16, 0, 1, 129, 40]
    extra = [2048 - 16, 3, 0, 17, 300]
    q, k, v, qo_indptr, kv_indptr = batch(rng, qo, extra)
    indptr, indices, last, num_pages = paged_table(rng, np.diff(kv_indptr), page_size)
    k_cache, v_cache = paged_pair(k, v, kv_indptr, indptr, indices, num_pages, page_size, layout)
    wrapper = rtcinfer.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout)
    wrapper.plan(qo_indptr, indptr, indices, last, 8, 2, D_QK, page_size, head_dim_vo=D_VO,
                 causal=True, q_data_type="bfloat16", disable_split_kv=not split,
                 fixed_split_size=4 if split else None)  # fmt: skip
    o, lse = wrapper.run(to_gpu(q), (to_gpu(k_cache), to_gpu(v_cache)), return_lse=True)
    check(o, lse, *reference(q, k, v, qo_indptr, kv_indptr, causal=True, sm_scale=SM_SCALE),
          "bfloat16")  # fmt: skip


@pytest.mark.parametrize("split", [False, True])
def test_custom_mask_over_a_paged_pair(kernel, split):
    rng = np.random.default_rng(41 + split)
    qo, extra = [30, 1, 0, 77], [10, 200, 5, 0]
    q, k, v, qo_indptr, kv_indptr = batch(rng, qo, extra)
    masks = random_masks(rng, qo_indptr, kv_indptr)
    flat = np.concatenate([m.ravel() for m in masks])
    indptr, indices, last, num_pages = paged_table(rng, np.diff(kv_indptr), 16)
    k_cache, v_cache = paged_pair(k, v, kv_indptr, indptr, indices, num_pages, 16, "NHD")
    wrapper = rtcinfer.BatchPrefillWithPagedKVCacheWrapper()
    wrapper.plan(qo_indptr, indptr, indices, last, 8, 2, D_QK, 16, head_dim_vo=D_VO,
                 custom_mask=to_gpu(flat), q_data_type="bfloat16", disable_split_kv=not split,
                 fixed_split_size=2 if split else None)  # fmt: skip
    o, lse = wrapper.run(to_gpu(q), (to_gpu(k_cache), to_gpu(v_cache)), return_lse=True)
    check(o, lse, *reference(q, k, v, qo_indptr, kv_indptr, masks=masks, sm_scale=SM_SCALE),
          "bfloat16")  # fmt: skip


def test_strided_v_and_given_outputs():
    """v a view with a padded token stride, out and lse given (out of 128 dims a view of a
    wider buffer): written in place, returned as given."""
    import cupy

    rng = np.random.default_rng(3)
    q, k, v, qo_indptr, kv_indptr = batch(rng, [100, 9], [0, 300])
    v_wide = to_gpu(np.concatenate([v, np.zeros_like(v[:, :, :64])], axis=2))
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, D_QK, D_VO, causal=True, q_data_type="bfloat16")
    out_wide = to_gpu(np.full((q.shape[0], 8, D_VO + 64), np.nan, dtype=q.dtype))
    out = out_wide[:, :, :D_VO]
    lse = cupy.empty((q.shape[0], 8), np.float32)
    got = wrapper.run(to_gpu(q), to_gpu(k), v_wide[:, :, :D_VO], out=out, lse=lse)
    assert got is out
    check(out, lse, *reference(q, k, v, qo_indptr, kv_indptr, causal=True, sm_scale=SM_SCALE),
          "bfloat16")  # fmt: skip
    assert np.isnan(to_host(out_wide[:, :, D_VO:])).all()  # the padding left alone


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qo_len, kv_len", [(1, 1), (77, 77), (128, 3000), (300, 20), (0, 9)])
def test_single_prefill(causal, qo_len, kv_len):
    rng = np.random.default_rng(qo_len * 7 + kv_len + causal)
    q = random_values(rng, (qo_len, 8, D_QK), "float16")
    k = random_values(rng, (kv_len, 2, D_QK), "float16")
    v = random_values(rng, (kv_len, 2, D_VO), "float16")
    o, lse = rtcinfer.single_prefill_with_kv_cache(to_gpu(q), to_gpu(k), to_gpu(v),
                                                   causal=causal, return_lse=True)  # fmt: skip
    assert o.shape == (qo_len, 8, D_VO)
    indptr = np.array([0, qo_len]), np.array([0, kv_len])
    check(o, lse, *reference(q, k, v, *indptr, causal=causal, sm_scale=SM_SCALE), "float16")


def test_torch_eager_and_compiled():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    q, k, v, qo_indptr, kv_indptr = batch(rng, [17, 100], [30, 0])
    expect = reference(q, k, v, qo_indptr, kv_indptr, causal=True, sm_scale=SM_SCALE)
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, D_QK, D_VO, causal=True, q_data_type="bfloat16")
    tq, tk, tv = (torch.from_dlpack(to_gpu(x)) for x in (q, k, v))
    o, lse = wrapper.run(tq, tk, tv, return_lse=True)
    assert isinstance(o, torch.Tensor) and tuple(o.shape) == (q.shape[0], 8, D_VO)
    check(o, lse, *expect, "bfloat16")
    step = torch.compile(lambda q, k, v: wrapper.run(q, k, v, return_lse=True), fullgraph=True)
    check(*step(tq, tk, tv), *expect, "bfloat16")
    single = torch.compile(lambda q, k, v: rtcinfer.single_prefill_with_kv_cache(
        q, k, v, causal=True, return_lse=True), fullgraph=True)  # fmt: skip
    one = slice(0, 17)
    expect_one = reference(q[one], k[:47], v[:47], np.array([0, 17]), np.array([0, 47]),
                           causal=True, sm_scale=SM_SCALE)  # fmt: skip
    check(*single(tq[one], tk[:47], tv[:47]), *expect_one, "bfloat16")


def test_jax_eager_and_jitted():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    rng = np.random.default_rng(10)
    q, k, v, qo_indptr, kv_indptr = batch(rng, [40, 3], [0, 500])
    expect = reference(q, k, v, qo_indptr, kv_indptr, causal=True, sm_scale=SM_SCALE)
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, D_QK, D_VO, causal=True, q_data_type="bfloat16")
    jq, jk, jv = (jax.numpy.asarray(x) for x in (q, k, v))
    check(*wrapper.run(jq, jk, jv, return_lse=True), *expect, "bfloat16")
    step = jax.jit(lambda q, k, v: wrapper.run(q, k, v, return_lse=True))
    o, lse = step(jq, jk, jv)
    assert o.shape == (q.shape[0], 8, D_VO)
    check(o, lse, *expect, "bfloat16")


def test_append_into_a_pair_of_two_head_dims():
    """append_paged_kv_cache into a (k_cache [.., 192], v_cache [.., 128]) pair: each row where
    the table puts it, in K's and V's own widths; the rest of the caches untouched."""
    rng = np.random.default_rng(31)
    pages, page, hkv = 6, 16, 2
    k_cache = random_values(rng, (pages, page, hkv, D_QK), "bfloat16")
    v_cache = random_values(rng, (pages, page, hkv, D_VO), "bfloat16")
    kv_len = np.array([20, 5], np.int32)
    indptr, indices = np.array([0, 2, 3], np.int32), np.array([4, 0, 2], np.int32)
    last = np.array([4, 5], np.int32)
    b_idx, pos = np.array([0, 0, 1], np.int32), np.array([18, 19, 4], np.int32)
    keys = random_values(rng, (3, hkv, D_QK), "bfloat16")
    values = random_values(rng, (3, hkv, D_VO), "bfloat16")
    k_dev, v_dev = to_gpu(k_cache), to_gpu(v_cache)
    rtcinfer.append_paged_kv_cache(to_gpu(keys), to_gpu(values), to_gpu(b_idx), to_gpu(pos),
                                   (k_dev, v_dev), to_gpu(indices), to_gpu(indptr),
                                   to_gpu(last))  # fmt: skip
    for t, (b, p) in enumerate(zip(b_idx, pos, strict=True)):
        assert p < kv_len[b]
        pg = indices[indptr[b] + p // page]
        k_cache[pg, p % page], v_cache[pg, p % page] = keys[t], values[t]
    np.testing.assert_array_equal(to_host(k_dev), k_cache.astype(np.float64))
    np.testing.assert_array_equal(to_host(v_dev), v_cache.astype(np.float64))
