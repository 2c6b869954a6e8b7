"""Batch prefill against the float64 reference on the GPU: ragged and paged KV, causal and
not, sliding window, soft cap, ALiBi, GQA, every head_dim, awkward and empty lengths, split
and whole plans, re-plans, and PyTorch / JAX / CuPy inputs."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import rtcinfer

from . import reference as ref
from . import reference_attention as aref
from .checks import assert_close, to_host
from .gpu_decode import random_values, to_gpu

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 17, 127, 128, 129, 1000]


def ragged_batch(rng, qo, extra, hq=8, hkv=2, d=128, dtype="bfloat16"):
    qo = np.asarray(qo)
    kv = qo + np.asarray(extra)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    q = random_values(rng, (int(qo_indptr[-1]), hq, d), dtype)
    k = random_values(rng, (int(kv_indptr[-1]), hkv, d), dtype)
    v = random_values(rng, (int(kv_indptr[-1]), hkv, d), dtype)
    return q, k, v, qo_indptr, kv_indptr


def reference(q, k, v, qo_indptr, kv_indptr, masks=None, **features):
    """Each request on its own; masks: one bool [qo_len, kv_len] per request (or None)."""
    outs = [
        aref.attention_ref(q[qo_indptr[b] : qo_indptr[b + 1]], k[kv_indptr[b] : kv_indptr[b + 1]],
                          v[kv_indptr[b] : kv_indptr[b + 1]],
                          mask=None if masks is None else masks[b], **features)
        for b in range(len(qo_indptr) - 1)
    ]  # fmt: skip
    return np.concatenate([o for o, _ in outs]), np.concatenate([s for _, s in outs])


def check(o, lse, o_ref, lse_ref, dtype):
    o, lse = to_host(o), to_host(lse)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert_close(o, o_ref, dtype, "o", per_vector=True)
    assert_close(lse, lse_ref, "float32", "lse", tol=2e-3)


FEATURES = {
    "plain": {},
    "window": dict(window_left=40),
    "soft_cap": dict(logits_soft_cap=8.0),
    "alibi": dict(pos_encoding_mode="ALIBI"),
}


def ref_features(features, hq, d, causal):
    out = dict(causal=causal, sm_scale=features.get("sm_scale", 1 / np.sqrt(d)),
               window_left=features.get("window_left", -1),
               logits_soft_cap=features.get("logits_soft_cap", 0.0))  # fmt: skip
    if features.get("pos_encoding_mode") == "ALIBI":
        out["alibi_slopes"] = aref.alibi_slopes(hq)
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("split", [False, True])
def test_ragged(causal, feature, split):
    rng = np.random.default_rng(zlib.crc32(repr((causal, feature, split)).encode()))
    qo = [int(x) for x in rng.permutation(LENGTHS)]
    extra = [int(x) for x in rng.integers(0, 200, len(qo))]
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, qo, extra)
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, 128, causal=causal, q_data_type="bfloat16",
                 disable_split_kv=not split, fixed_split_size=64 if split else None,
                 **FEATURES[feature])  # fmt: skip
    o, lse = wrapper.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True)
    features = ref_features(FEATURES[feature], 8, 128, causal)
    check(o, lse, *reference(q, k, v, qo_indptr, kv_indptr, **features), "bfloat16")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group", [1, 4, 7])
def test_head_dims_dtypes_and_groups(head_dim, dtype, group):
    rng = np.random.default_rng(head_dim * 10 + group)
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [33, 200, 5], [0, 100, 600], hq=2 * group,
                                                 hkv=2, d=head_dim, dtype=dtype)  # fmt: skip
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo_indptr, kv_indptr, 2 * group, 2, head_dim, causal=True, q_data_type=dtype)
    o, lse = wrapper.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True)
    check(o, lse, *reference(q, k, v, qo_indptr, kv_indptr, causal=True,
                             sm_scale=1 / np.sqrt(head_dim)), dtype)  # fmt: skip


def paged_table(rng, kv_lens, page_size, spare=3):
    pages = [-(-n // page_size) for n in kv_lens]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    num_pages = int(indptr[-1]) + spare
    indices = rng.permutation(num_pages)[: indptr[-1]].astype(np.int32)
    last = np.array([n - (p - 1) * page_size if p else 0 for n, p in
                     zip(kv_lens, pages, strict=True)], np.int32)  # fmt: skip
    return indptr, indices, last, num_pages


def paged_cache(k, v, kv_indptr, indptr, indices, num_pages, page_size, layout="NHD"):
    """The host cache [num_pages, 2, ...] (NHD or HND) holding each request's ragged k and v
    rows in its pages (indptr, indices: the page table), zeros elsewhere."""
    heads, d = k.shape[1:]
    inner = (page_size, heads, d) if layout == "NHD" else (heads, page_size, d)
    cache = np.zeros((num_pages, 2, *inner), dtype=k.dtype)
    for b, n in enumerate(np.diff(kv_indptr)):
        for t in range(n):
            page, slot = indices[indptr[b] + t // page_size], t % page_size
            for which, src in enumerate((k, v)):
                row = src[kv_indptr[b] + t]
                if layout == "NHD":
                    cache[page, which, slot] = row
                else:
                    cache[page, which, :, slot] = row
    return cache


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["5d", "tuple"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_append(layout, form, page_size):
    rng = np.random.default_rng(page_size + (layout == "HND") * 7 + (form == "tuple") * 3)
    qo = [16, 0, 1, 129, 40]
    extra = [4096 - 16, 3, 0, 17, 300]
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, qo, extra)
    kv_lens = np.diff(kv_indptr)
    indptr, indices, last, num_pages = paged_table(rng, kv_lens, page_size)
    cache = paged_cache(k, v, kv_indptr, indptr, indices, num_pages, page_size, layout)
    dev = to_gpu(cache)
    paged = dev if form == "5d" else (dev[:, 0], dev[:, 1])
    wrapper = rtcinfer.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout)
    wrapper.plan(qo_indptr, indptr, indices, last, 8, 2, 128, page_size, causal=True,
                 q_data_type="bfloat16")  # fmt: skip
    o, lse = wrapper.run(to_gpu(q), paged, return_lse=True)
    check(o, lse, *reference(q, k, v, qo_indptr, kv_indptr, causal=True,
                             sm_scale=1 / np.sqrt(128)), "bfloat16")  # fmt: skip


def test_replan_with_new_lengths_and_split_agreement():
    rng = np.random.default_rng(5)
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    for qo, extra in ([[300, 2], [0, 50]], [[1, 1, 1], [4000, 0, 9]], [[64], [0]]):
        q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, qo, extra)
        results = []
        for split in (False, True):
            split_args = dict(fixed_split_size=32) if split else dict(disable_split_kv=True)
            wrapper.plan(qo_indptr, kv_indptr, 8, 2, 128, causal=True, q_data_type="bfloat16",
                         **split_args)  # fmt: skip
            results.append(wrapper.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True))
        o_ref, lse_ref = reference(q, k, v, qo_indptr, kv_indptr, causal=True,
                                   sm_scale=1 / np.sqrt(128))  # fmt: skip
        for o, lse in results:
            check(o, lse, o_ref, lse_ref, "bfloat16")


def test_torch_and_jax_inputs():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [17, 100], [30, 0])
    expect = reference(q, k, v, qo_indptr, kv_indptr, causal=True, sm_scale=1 / np.sqrt(128))
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, 128, causal=True, q_data_type="bfloat16")
    tq, tk, tv = (torch.from_dlpack(to_gpu(x)) for x in (q, k, v))
    o, lse = wrapper.run(tq, tk, tv, return_lse=True)
    assert isinstance(o, torch.Tensor)
    check(o, lse, *expect, "bfloat16")
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        return
    jq, jk, jv = (jax.numpy.asarray(x) for x in (q, k, v))
    check(*wrapper.run(jq, jk, jv, return_lse=True), *expect, "bfloat16")
    step = jax.jit(lambda q, k, v: wrapper.run(q, k, v, return_lse=True))
    check(*step(jq, jk, jv), *expect, "bfloat16")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qo_len, kv_len", [(1, 1), (77, 77), (128, 4000), (300, 20), (0, 9),
                                            (5, 0)])  # fmt: skip
def test_single_prefill(layout, causal, qo_len, kv_len):
    rng = np.random.default_rng(qo_len * 7 + kv_len + causal)
    q = random_values(rng, (qo_len, 8, 128), "float16")
    k = random_values(rng, (kv_len, 2, 128), "float16")
    v = random_values(rng, (kv_len, 2, 128), "float16")
    o_ref, lse_ref = aref.attention_ref(q, k, v, causal=causal, sm_scale=0.1)
    gk, gv = to_gpu(k), to_gpu(v)
    if layout == "HND":
        gk, gv = gk.transpose(1, 0, 2), gv.transpose(1, 0, 2)  # strided views, not copies
    o, lse = rtcinfer.single_prefill_with_kv_cache(to_gpu(q), gk, gv, causal=causal,
                                                   kv_layout=layout, sm_scale=0.1,
                                                   return_lse=True)  # fmt: skip
    check(o, lse, o_ref, lse_ref, "float16")
    o2, lse2 = rtcinfer.single_prefill_with_kv_cache_return_lse(
        to_gpu(q), gk, gv, causal=causal, kv_layout=layout, sm_scale=0.1
    )
    check(o2, lse2, o_ref, lse_ref, "float16")


def test_single_prefill_without_lse_returns_o_when_nothing_splits():
    """A short prompt over a short cache (one work item, no split scratch) without lse: the
    call returns o itself, every row (a lone output once came back indexed by its first row)."""
    rng = np.random.default_rng(31)
    q = random_values(rng, (5, 8, 128), "bfloat16")
    k, v = (random_values(rng, (9, 2, 128), "bfloat16") for _ in range(2))
    o_ref, _ = aref.attention_ref(q, k, v, causal=True, sm_scale=1 / np.sqrt(128))
    o = rtcinfer.single_prefill_with_kv_cache(to_gpu(q), to_gpu(k), to_gpu(v), causal=True)
    assert tuple(o.shape) == (5, 8, 128)
    assert_close(to_host(o), o_ref, "bfloat16", "o", per_vector=True)


def test_single_prefill_window_soft_cap_and_strided_kv():
    rng = np.random.default_rng(3)
    q = random_values(rng, (200, 4, 64), "bfloat16")
    kv = random_values(rng, (700, 2, 3, 64), "bfloat16")  # K and V interleaved by token
    k, v = kv[:, 0, :2], kv[:, 1, 1:]
    o_ref, _ = aref.attention_ref(q, k, v, causal=True, sm_scale=0.125, window_left=100,
                                 logits_soft_cap=20.0)  # fmt: skip
    g = to_gpu(kv)
    o = rtcinfer.single_prefill_with_kv_cache(to_gpu(q), g[:, 0, :2], g[:, 1, 1:], causal=True,
                                              window_left=100, logits_soft_cap=20.0)  # fmt: skip
    assert_close(to_host(o), o_ref, "bfloat16", "o", per_vector=True)


def random_masks(rng, qo_indptr, kv_indptr):
    """One bool [qo_len, kv_len] per request: random, with a fully hidden row and a row that
    sees one key where there is room."""
    masks = []
    for qo, kv in zip(np.diff(qo_indptr), np.diff(kv_indptr), strict=True):
        m = rng.random((qo, kv)) < 0.6
        if qo > 2 and kv > 0:
            m[0] = False
            m[1] = False
            m[1, rng.integers(kv)] = True
        masks.append(m)
    return masks


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_ragged_custom_mask(packed, split):
    rng = np.random.default_rng(11 + packed + 2 * split)
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [0, 1, 70, 300, 5], [4, 0, 9, 150, 600])
    masks = random_masks(rng, qo_indptr, kv_indptr)
    flat = np.concatenate([m.ravel() for m in masks])
    kwargs = dict(custom_mask=to_gpu(flat))
    if packed:
        bit_indptr = np.concatenate([[0], np.cumsum([m.size for m in masks])])
        kwargs = dict(packed_custom_mask=rtcinfer.segment_packbits(to_gpu(flat), bit_indptr,
                                                                   "little")[0])  # fmt: skip
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, 128, causal=True, q_data_type="bfloat16",
                 window_left=200, disable_split_kv=not split,
                 fixed_split_size=64 if split else None, **kwargs)  # fmt: skip
    o, lse = wrapper.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True)
    # The custom mask replaces the causal one; the window still applies.
    check(o, lse, *reference(q, k, v, qo_indptr, kv_indptr, masks, sm_scale=1 / np.sqrt(128),
                             window_left=200), "bfloat16")  # fmt: skip


def test_paged_custom_mask_from_host_and_single_prefill_masks():
    """A paged batch whose first request has queries but no keys (FlashInfer 0.7.2 gets the
    later requests' mask offsets wrong there: it takes that kv_len as negative)."""
    rng = np.random.default_rng(12)
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [5, 33, 128], [-5, 100, 3], hq=4, hkv=4,
                                                 d=64)  # fmt: skip
    masks = random_masks(rng, qo_indptr, kv_indptr)
    kv_lens = np.diff(kv_indptr)
    indptr, indices, last, num_pages = paged_table(rng, kv_lens, 16)
    cache = paged_cache(k, v, kv_indptr, indptr, indices, num_pages, 16)
    wrapper = rtcinfer.BatchPrefillWithPagedKVCacheWrapper()
    wrapper.plan(qo_indptr, indptr, indices, last, 4, 4, 64, 16, q_data_type="bfloat16",
                 custom_mask=np.concatenate([m.ravel() for m in masks]))  # fmt: skip
    o, lse = wrapper.run(to_gpu(q), to_gpu(cache), return_lse=True)
    check(o, lse, *reference(q, k, v, qo_indptr, kv_indptr, masks, sm_scale=1 / 8), "bfloat16")

    b = 2  # single prefill of request 2 with its mask, boolean and packed
    qb, kb, vb = (x[i[b] : i[b + 1]] for x, i in ((q, qo_indptr), (k, kv_indptr),
                                                   (v, kv_indptr)))  # fmt: skip
    o_ref, lse_ref = aref.attention_ref(qb, kb, vb, sm_scale=1 / 8, mask=masks[b])
    for kwargs in (dict(custom_mask=to_gpu(masks[b])),
                   dict(packed_custom_mask=rtcinfer.packbits(to_gpu(masks[b].ravel()),
                                                             "little"))):  # fmt: skip
        o, lse = rtcinfer.single_prefill_with_kv_cache(to_gpu(qb), to_gpu(kb), to_gpu(vb),
                                                       causal=True, return_lse=True,
                                                       **kwargs)  # fmt: skip
        check(o, lse, o_ref, lse_ref, "bfloat16")


def rope_reference(q, k, v, qo_indptr, kv_indptr, rope_scale, rope_theta, **features):
    """RoPE (non-interleaved, over all of head_dim) on each request's q at its bottom-right
    aligned positions and its k at 0..kv_len - 1, then attention."""
    d = q.shape[2]
    inv_freq = ref.rope_inv_freq(d, rope_scale, rope_theta)
    q_rot, k_rot = ref.f64(q).copy(), ref.f64(k).copy()
    for b in range(len(qo_indptr) - 1):
        qs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        qo, kv = qs.stop - qs.start, ks.stop - ks.start
        q_rot[qs] = ref.rope_ref(q[qs], np.arange(kv - qo, kv), d, inv_freq=inv_freq)
        k_rot[ks] = ref.rope_ref(k[ks], np.arange(kv), d, inv_freq=inv_freq)
    return reference(q_rot, k_rot, v, qo_indptr, kv_indptr, **features)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_ragged_rope(head_dim, causal):
    rng = np.random.default_rng(head_dim + causal)
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [1, 90, 300, 0], [5000, 40, 0, 7],
                                                 d=head_dim)  # fmt: skip
    features = dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5,
                    logits_soft_cap=30.0 if causal else None)  # fmt: skip
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, head_dim, causal=causal, q_data_type="bfloat16",
                 **features)  # fmt: skip
    o, lse = wrapper.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True)
    expect = rope_reference(q, k, v, qo_indptr, kv_indptr, 2.0, 5e5, causal=causal,
                            sm_scale=1 / np.sqrt(head_dim),
                            logits_soft_cap=30.0 if causal else 0.0)  # fmt: skip
    check(o, lse, *expect, "bfloat16")
    # single prefill of the long request, default rope_scale and rope_theta
    qs, ks = slice(qo_indptr[1], qo_indptr[2]), slice(kv_indptr[1], kv_indptr[2])
    o, lse = rtcinfer.single_prefill_with_kv_cache(
        to_gpu(q[qs]), to_gpu(k[ks]), to_gpu(v[ks]), causal=causal,
        pos_encoding_mode="ROPE_LLAMA", return_lse=True,
    )  # fmt: skip
    one = np.array([0, qs.stop - qs.start]), np.array([0, ks.stop - ks.start])
    check(o, lse, *rope_reference(q[qs], k[ks], v[ks], *one, 1.0, 1e4, causal=causal,
                                  sm_scale=1 / np.sqrt(head_dim)), "bfloat16")  # fmt: skip


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_kv(kv_dtype, q_dtype, head_dim):
    """fp8 K/V (uint8 bytes on the device) widened in the kernel, with k_scale and v_scale:
    ragged and paged (HND, (k, v) pair) against float64 attention over the fp8 values."""
    rng = np.random.default_rng(head_dim + len(kv_dtype) + len(q_dtype))
    qo, extra = [70, 1, 0, 200], [300, 64, 5, 0]
    q, _, _, qo_indptr, kv_indptr = ragged_batch(rng, qo, extra, d=head_dim, dtype=q_dtype)
    k = random_values(rng, (int(kv_indptr[-1]), 2, head_dim), kv_dtype)
    v = random_values(rng, (int(kv_indptr[-1]), 2, head_dim), kv_dtype)
    scales = dict(k_scale=0.7, v_scale=1.3)
    expect = reference(q, k, v, qo_indptr, kv_indptr, causal=True,
                       sm_scale=1 / np.sqrt(head_dim), **scales)  # fmt: skip
    ragged = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    ragged.plan(qo_indptr, kv_indptr, 8, 2, head_dim, causal=True, q_data_type=q_dtype,
                kv_data_type=kv_dtype)  # fmt: skip
    check(*ragged.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True, **scales), *expect,
          q_dtype)  # fmt: skip

    kv_lens = np.diff(kv_indptr)
    indptr, indices, last, num_pages = paged_table(rng, kv_lens, 16)
    cache = paged_cache(k, v, kv_indptr, indptr, indices, num_pages, 16, "HND")
    k_cache, v_cache = cache[:, 0].copy(), cache[:, 1].copy()  # a (k, v) pair
    paged = rtcinfer.BatchPrefillWithPagedKVCacheWrapper(kv_layout="HND")
    paged.plan(qo_indptr, indptr, indices, last, 8, 2, head_dim, 16, causal=True,
               q_data_type=q_dtype, kv_data_type=kv_dtype)  # fmt: skip
    out = paged.run(to_gpu(q), (to_gpu(k_cache), to_gpu(v_cache)), return_lse=True, **scales)
    check(*out, *expect, q_dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", ["causal", "plain", "rope_cap", "fp8", "window_split"])
def test_32_row_warps(monkeypatch, head_dim, variant):
    """The kernel with two 16-row MMA blocks a warp (warp_rows=32, 128-row tiles; plan()'s own
    choice at head_dim 128, forced at 64), ragged and paged, against the float64 reference."""
    from rtcinfer.attention import prefill_launch as launches

    spec_of = launches.prefill_spec
    monkeypatch.setattr(launches, "prefill_spec", lambda *a, **k: spec_of(*a, **k, warp_rows=32))
    monkeypatch.setattr(launches, "pick_tile_rows", lambda cfg, qo_indptr, **_: 128)
    rng = np.random.default_rng(zlib.crc32(repr((head_dim, variant)).encode()))
    qo, extra = [300, 1, 0, 129, 40], [0, 700, 9, 64, 1000]
    kv_dtype = "float8_e4m3fn" if variant == "fp8" else "bfloat16"
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, qo, extra, d=head_dim)
    if variant == "fp8":
        k = random_values(rng, k.shape, kv_dtype)
        v = random_values(rng, v.shape, kv_dtype)
    causal = variant != "plain"
    plan_kw = dict(causal=causal, q_data_type="bfloat16", kv_data_type=kv_dtype)
    ref_kw = dict(causal=causal, sm_scale=1 / np.sqrt(head_dim))
    if variant == "window_split":
        plan_kw.update(window_left=100, fixed_split_size=4)
        ref_kw.update(window_left=100)
    if variant == "rope_cap":
        plan_kw.update(pos_encoding_mode="ROPE_LLAMA", logits_soft_cap=20.0)
        expect = rope_reference(q, k, v, qo_indptr, kv_indptr, 1.0, 1e4, logits_soft_cap=20.0,
                                **ref_kw)  # fmt: skip
    else:
        expect = reference(q, k, v, qo_indptr, kv_indptr, **ref_kw)
    ragged = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    ragged.plan(qo_indptr, kv_indptr, 8, 2, head_dim, **plan_kw)
    spec = ragged._launch.launch.kernel.spec
    assert (spec.warp_rows, spec.tile_rows, spec.ragged) == (32, 128, True)
    check(*ragged.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True), *expect, "bfloat16")

    kv_lens = np.diff(kv_indptr)
    indptr, indices, last, num_pages = paged_table(rng, kv_lens, 16)
    cache = np.zeros((num_pages, 2, 16, 2, head_dim), dtype=k.dtype)  # NHD, 5-D
    for b, n in enumerate(kv_lens):
        t = np.arange(n)
        cache[indices[indptr[b] + t // 16], 0, t % 16] = k[kv_indptr[b] + t]
        cache[indices[indptr[b] + t // 16], 1, t % 16] = v[kv_indptr[b] + t]
    paged = rtcinfer.BatchPrefillWithPagedKVCacheWrapper()
    paged.plan(qo_indptr, indptr, indices, last, 8, 2, head_dim, 16, **plan_kw)
    assert paged._launch.launch.kernel.spec.warp_rows == 32
    check(*paged.run(to_gpu(q), to_gpu(cache), return_lse=True), *expect, "bfloat16")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("tile_rows", [8, 16])
def test_decode_like_batches_use_small_tiles(monkeypatch, head_dim, split, kv_dtype, tile_rows):
    """One query per request and speculative-verification lengths (2-4 queries, 4 heads a
    group): tiles whose four warps split the keys, paged, with empty requests: 8 rows (plan()'s
    choice here: keys on the MMAs' M side; a request of more rows takes several) and 16
    (forced)."""
    rng = np.random.default_rng(head_dim + split)
    qo, extra = [1, 4, 2, 1, 3, 0, 1], [2000, 90, 0, 700, 16, 5, 0]
    q, _, _, qo_indptr, kv_indptr = ragged_batch(rng, qo, extra, d=head_dim)
    k = random_values(rng, (int(kv_indptr[-1]), 2, head_dim), kv_dtype)
    v = random_values(rng, (int(kv_indptr[-1]), 2, head_dim), kv_dtype)
    kv_lens = np.diff(kv_indptr)
    indptr, indices, last, num_pages = paged_table(rng, kv_lens, 16)
    cache = np.zeros((num_pages, 2, 16, 2, head_dim), dtype=k.dtype)
    for b, n in enumerate(kv_lens):
        for t in range(n):
            page, slot = indices[indptr[b] + t // 16], t % 16
            cache[page, 0, slot], cache[page, 1, slot] = k[kv_indptr[b] + t], v[kv_indptr[b] + t]
    if tile_rows == 16:
        from rtcinfer.attention import prefill_launch

        monkeypatch.setattr(prefill_launch, "pick_tile_rows", lambda cfg, qo_indptr, **_: 16)
    wrapper = rtcinfer.BatchPrefillWithPagedKVCacheWrapper()
    wrapper.plan(qo_indptr, indptr, indices, last, 8, 2, head_dim, 16, causal=True,
                 q_data_type="bfloat16", kv_data_type=kv_dtype,
                 disable_split_kv=not split, fixed_split_size=4 if split else None)  # fmt: skip
    assert wrapper._launch.launch.kernel.spec.tile_rows == tile_rows
    o, lse = wrapper.run(to_gpu(q), to_gpu(cache), return_lse=True)
    check(o, lse, *reference(q, k, v, qo_indptr, kv_indptr, causal=True,
                             sm_scale=1 / np.sqrt(head_dim)), "bfloat16")  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
def test_batch_attention_mixes_prefill_and_decode_requests(causal):
    """FlashInfer's BatchAttention over a batch of prompts and one-query (decode) requests,
    its table listing a page reserved ahead for some requests (kv_len_arr tells the keys):
    (o, lse) of the reference."""
    rng = np.random.default_rng(61 + causal)
    qo, extra = [1, 40, 1, 0, 129, 1], [300, 0, 15, 7, 16, 0]
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, qo, extra)
    kv_lens = np.diff(kv_indptr)
    indptr, indices, last, num_pages = paged_table(rng, kv_lens, 16, spare=8)
    cache = paged_cache(k, v, kv_indptr, indptr, indices, num_pages, 16)
    spare = sorted(set(range(num_pages)) - set(indices.tolist()))  # pages no request holds
    table, listed = [], [0]
    for b in range(len(qo)):  # every other request lists one more page, reserved ahead
        own = list(indices[indptr[b] : indptr[b + 1]]) + ([spare.pop()] if b % 2 else [])
        table += own
        listed.append(listed[-1] + len(own))
    attention = rtcinfer.BatchAttention()
    attention.plan(qo_indptr, np.array(listed, np.int32), np.array(table, np.int32),
                   kv_lens.astype(np.int32), 8, 2, 128, 128, 16, causal=causal)  # fmt: skip
    o, lse = attention.run(to_gpu(q), to_gpu(cache))
    check(o, lse, *reference(q, k, v, qo_indptr, kv_indptr, causal=causal,
                             sm_scale=1 / np.sqrt(128)), "bfloat16")  # fmt: skip
