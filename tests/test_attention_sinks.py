"""Attention sinks (FlashInfer's run(sinks=)) against the float64 references (GPU): the merge
op on its own, batch decode (CUDA-core and tensor-core), paged prefill with each LSE form,
FlashInfer's BatchAttentionWithAttentionSinkWrapper, and decode inside jax.jit. The reference
puts the sink in the softmax as one more key (tests/reference_attention.attention_ref), not
through the merge formula the kernels use."""

from __future__ import annotations

import math

import numpy as np
import pytest

import rtcinfer

from . import reference_attention as aref
from .checks import assert_close, to_host
from .gpu_decode import check_attention, make_batch, standard_lengths, to_gpu
from .test_cascade import DTYPES, states
from .test_prefill import check, paged_cache, paged_table, ragged_batch, reference

pytestmark = pytest.mark.gpu

LOG2E = 1.0 / math.log(2.0)


def sink_logits(rng, heads: int) -> np.ndarray:
    """[heads] float32 logits around the scaled logits' range, one head without a sink."""
    sinks = (rng.standard_normal(heads) * 2).astype(np.float32)
    sinks[heads // 2] = -np.inf
    return sinks


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_sinks_in_place(rng, dtype):
    shape = (9, 6, 128)
    v, s = states(rng, shape, dtype)  # a quarter of the rows without keys (s = -inf)
    sinks = sink_logits(rng, shape[1])
    v_dev, s_dev = to_gpu(v), to_gpu(s)
    out = rtcinfer.merge_sinks_in_place(v_dev, s_dev, to_gpu(sinks))
    assert out[0] is v_dev and out[1] is s_dev
    v0 = np.where(np.isneginf(s)[..., None], 0.0, v.astype(np.float64))
    sink_v = np.zeros(shape)
    sink_s = np.broadcast_to(sinks.astype(np.float64) * LOG2E, shape[:2])
    v_ref, s_ref = aref.merge_state_ref(v0, s, sink_v, sink_s)
    assert not np.isnan(to_host(v_dev)).any()
    assert_close(v_dev, v_ref, dtype, "v")
    assert_close(s_dev, s_ref, "float32", "s", tol=1e-5)


def test_merge_sinks_takes_fp16_sinks_and_refuses_a_wrong_shape(rng):
    v, s = states(rng, (3, 4, 64), "bfloat16", empty=0)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)  # exact in fp16
    v_dev, s_dev = to_gpu(v), to_gpu(s)
    rtcinfer.merge_sinks_in_place(v_dev, s_dev, to_gpu(sinks.astype(np.float16)))  # to fp32
    v_ref, s_ref = aref.merge_state_ref(v, s, np.zeros(v.shape),
                                        np.broadcast_to(sinks * LOG2E, s.shape))  # fmt: skip
    assert_close(v_dev, v_ref, "bfloat16", "v")
    with pytest.raises(ValueError, match=r"sinks: expected float32 \[4\]"):
        rtcinfer.merge_sinks_in_place(v_dev, s_dev, to_gpu(sinks[:3]))


@pytest.mark.parametrize("use_tensor_cores", [False, True])
@pytest.mark.parametrize("window_left", [-1, 40])  # gpt-oss: sinks on windowed layers too
def test_batch_decode_with_sinks(use_tensor_cores, window_left):
    rng = np.random.default_rng(41 + use_tensor_cores + 2 * (window_left > 0))
    batch = make_batch(rng, standard_lengths(16, rng), group_size=8)  # two empty requests
    sinks = sink_logits(rng, batch.num_qo_heads)
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=use_tensor_cores)
    batch.plan(wrapper, window_left=window_left)
    o, lse = wrapper.run(batch.q_dev, batch.cache_dev, sinks=to_gpu(sinks), return_lse=True)
    check_attention(o, lse, *batch.reference(sinks=sinks, window_left=window_left),
                    batch.q_dtype, tensor_cores=use_tensor_cores)  # fmt: skip
    o_only = wrapper.run(batch.q_dev, batch.cache_dev, sinks=to_gpu(sinks))
    np.testing.assert_array_equal(to_host(o_only), to_host(o))


def test_paged_prefill_with_sinks_and_each_lse_form():
    rng = np.random.default_rng(43)  # a split plan: its partials merge before the sinks
    qo, extra = [16, 0, 1, 129, 40], [300, 3, 0, 17, 0]
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, qo, extra)
    kv_lens = np.diff(kv_indptr)
    indptr, indices, last, num_pages = paged_table(rng, kv_lens, 16)
    cache = paged_cache(k, v, kv_indptr, indptr, indices, num_pages, 16)
    sinks = sink_logits(rng, 8)
    o_ref, lse_ref = reference(q, k, v, qo_indptr, kv_indptr, causal=True,
                               sm_scale=1 / np.sqrt(128), sinks=sinks)  # fmt: skip
    wrapper = rtcinfer.BatchPrefillWithPagedKVCacheWrapper()
    wrapper.plan(qo_indptr, indptr, indices, last, 8, 2, 128, 16, causal=True,
                 q_data_type="bfloat16", fixed_split_size=64)  # fmt: skip
    q_dev, cache_dev, sinks_dev = to_gpu(q), to_gpu(cache), to_gpu(sinks)
    check(*wrapper.run(q_dev, cache_dev, sinks=sinks_dev, return_lse=True), o_ref, lse_ref,
          "bfloat16")  # fmt: skip
    o, ln = wrapper.run(q_dev, cache_dev, sinks=sinks_dev, return_lse=True, lse_base="ln")
    check(o, ln, o_ref, lse_ref * math.log(2.0), "bfloat16")
    hn = to_gpu(np.zeros((8, len(q)), np.float32))
    o = wrapper.run(q_dev, cache_dev, sinks=sinks_dev, lse=hn, lse_layout="HN")
    check(o, hn.T, o_ref, lse_ref, "bfloat16")
    sink_wrapper = rtcinfer.BatchAttentionWithAttentionSinkWrapper(
        q_data_type="bfloat16", kv_data_type="bfloat16", head_dim_qk=128, head_dim_vo=128
    )
    sink_wrapper.plan(qo_indptr, indptr, indices, last, 8, 2, 128, 16, causal=True,
                      q_data_type="bfloat16")  # fmt: skip
    check(*sink_wrapper.run(q_dev, cache_dev, sinks_dev, 1 / np.sqrt(128), return_lse=True),
          o_ref, lse_ref, "bfloat16")  # fmt: skip
    with pytest.raises(ValueError, match="differs from the plan's sm_scale"):
        sink_wrapper.run(q_dev, cache_dev, sinks_dev, 0.5)


@pytest.mark.parametrize("causal", [False, True])
def test_ragged_prefill_with_sinks(causal):
    """The ragged wrapper's run(sinks=) (an rtcinfer extension), split plans included."""
    rng = np.random.default_rng(53 + causal)
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [7, 0, 200, 1], [50, 9, 0, 1000])
    sinks = sink_logits(rng, 8)
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, 128, causal=causal, q_data_type="bfloat16",
                 fixed_split_size=128)  # fmt: skip
    o, lse = wrapper.run(to_gpu(q), to_gpu(k), to_gpu(v), sinks=to_gpu(sinks), return_lse=True)
    check(o, lse, *reference(q, k, v, qo_indptr, kv_indptr, causal=causal,
                             sm_scale=1 / np.sqrt(128), sinks=sinks), "bfloat16")  # fmt: skip


def test_decode_with_sinks_inside_jax_jit():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    rng = np.random.default_rng(47)
    batch = make_batch(rng, [40, 0, 300, 17])
    sinks = sink_logits(rng, batch.num_qo_heads)
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    batch.plan(wrapper)
    q, cache, s = (jax.numpy.asarray(x) for x in (batch.q, batch.cache, sinks))
    step = jax.jit(lambda q, cache, s: wrapper.run(q, cache, sinks=s, return_lse=True))
    o, lse = step(q, cache, s)
    check_attention(o, lse, *batch.reference(sinks=sinks), batch.q_dtype)
