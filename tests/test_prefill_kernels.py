"""GPU: the two prefill kernels of sm_90a, warpgroup MMAs (plan()'s choice for 64- and 128-row
tiles there) and mma.sync (RTCINFER_PREFILL_WGMMA=0, and every tile elsewhere), each against
the float64 reference on the same ragged and paged batches: every head_dim, both 16-bit
dtypes, both tile sizes, causal, custom masks, sliding window, soft cap and ALiBi."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import rtcinfer

from .gpu_decode import to_gpu
from .test_prefill import (
    FEATURES,
    LENGTHS,
    check,
    paged_table,
    ragged_batch,
    random_masks,
    ref_features,
    reference,
)

pytestmark = pytest.mark.gpu

KERNELS = ["wgmma", "mma.sync"]


def expect_wgmma(kernel: str) -> bool:
    """Whether plan() takes the warpgroup-MMA kernel here for a 64- or 128-row tile."""
    import cupy

    return kernel == "wgmma" and cupy.cuda.Device().compute_capability == "90"


@pytest.fixture
def kernel_choice(monkeypatch, request):
    kernel, tile_rows = request.param
    from rtcinfer.attention import prefill_launch

    monkeypatch.setenv("RTCINFER_PREFILL_WGMMA", "1" if kernel == "wgmma" else "0")
    monkeypatch.setattr(prefill_launch, "pick_tile_rows", lambda cfg, qo_indptr, **_: tile_rows)
    return kernel, tile_rows


CHOICES = [(kernel, rows) for kernel in KERNELS for rows in (64, 128)]


def planned_spec(wrapper):
    return wrapper._launch.launch.kernel.spec


# head_dim 256 takes 128-row tiles on the warpgroup-MMA kernel only
SHAPES = [(choice, d) for choice in CHOICES for d in (64, 128, 256)
          if d < 256 or choice[1] == 64 or choice[0] == "wgmma"]  # fmt: skip


@pytest.mark.parametrize("kernel_choice,head_dim", SHAPES, indirect=["kernel_choice"], ids=str)
@pytest.mark.parametrize("feature", ["causal", "plain", *[f for f in FEATURES if f != "plain"]])
def test_ragged_and_paged(kernel_choice, head_dim, feature):
    kernel, tile_rows = kernel_choice
    dtype = ("float16", "bfloat16")[(head_dim // 64 + len(feature)) % 2]  # both, across cases
    rng = np.random.default_rng(zlib.crc32(repr((kernel_choice, head_dim, feature)).encode()))
    qo = [int(x) for x in rng.permutation(LENGTHS)]
    extra = [int(x) for x in rng.integers(0, 300, len(qo))]
    hq, hkv = 8, 2
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, qo, extra, hq, hkv, head_dim, dtype)
    causal = feature != "plain"
    features = {} if feature in ("causal", "plain") else FEATURES[feature]
    kw = dict(causal=causal, q_data_type=dtype, fixed_split_size=96, **features)
    ref_kw = ref_features(features, hq, head_dim, causal)
    expect = reference(q, k, v, qo_indptr, kv_indptr, **ref_kw)

    ragged = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    ragged.plan(qo_indptr, kv_indptr, hq, hkv, head_dim, **kw)
    spec = planned_spec(ragged)
    assert (spec.wgmma, spec.tile_rows) == (expect_wgmma(kernel), tile_rows)
    check(*ragged.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True), *expect, dtype)

    kv_lens = np.diff(kv_indptr)
    indptr, indices, last, num_pages = paged_table(rng, kv_lens, 16)
    cache = np.zeros((num_pages, 2, hkv, 16, head_dim), dtype=k.dtype)  # HND, 5-D
    for b, n in enumerate(kv_lens):
        t = np.arange(n)
        cache[indices[indptr[b] + t // 16], 0, :, t % 16] = k[kv_indptr[b] + t]
        cache[indices[indptr[b] + t // 16], 1, :, t % 16] = v[kv_indptr[b] + t]
    paged = rtcinfer.BatchPrefillWithPagedKVCacheWrapper(kv_layout="HND")
    paged.plan(qo_indptr, indptr, indices, last, hq, hkv, head_dim, 16, **kw)
    assert planned_spec(paged).wgmma == expect_wgmma(kernel)
    check(*paged.run(to_gpu(q), to_gpu(cache), return_lse=True), *expect, dtype)


@pytest.mark.parametrize("kernel_choice", CHOICES, indirect=True, ids=str)
def test_custom_mask(kernel_choice):
    kernel, _ = kernel_choice
    rng = np.random.default_rng(zlib.crc32(repr(kernel_choice).encode()))
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [129, 0, 17, 300], [5, 40, 0, 200])
    masks = random_masks(rng, qo_indptr, kv_indptr)
    flat = np.concatenate([m.ravel() for m in masks])
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, 128, custom_mask=flat, q_data_type="bfloat16")
    assert planned_spec(wrapper).wgmma == expect_wgmma(kernel)
    expect = reference(q, k, v, qo_indptr, kv_indptr, masks, sm_scale=1 / np.sqrt(128))
    check(*wrapper.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True), *expect, "bfloat16")


@pytest.mark.parametrize("kernel_choice", CHOICES, indirect=True, ids=str)
def test_negative_and_zero_scales(kernel_choice):
    """The folded scale's sign trick (the Q tile negated in shared memory) and a zero scale."""
    rng = np.random.default_rng(zlib.crc32(repr(kernel_choice).encode()) + 1)
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [200, 3], [60, 500])
    for scale in (-0.2, 0.0):
        wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
        wrapper.plan(qo_indptr, kv_indptr, 8, 2, 128, causal=True, sm_scale=scale,
                     q_data_type="bfloat16")  # fmt: skip
        expect = reference(q, k, v, qo_indptr, kv_indptr, causal=True, sm_scale=scale)
        check(*wrapper.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True), *expect, "bfloat16")
