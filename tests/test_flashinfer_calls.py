"""Calls written for FlashInfer 0.7.2 give FlashInfer's results on the GPU: positional out= and
enable_pdl on the norms and activations, the prefill LSE in base e and heads-first layout,
q_scale on prefill, the samplers' valid flags, run_return_lse, begin_forward, a workspace reset,
the deprecated forward() and the decode plan's deprecated positional options
(test_flashinfer_api.py checks the signatures themselves)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import rtcinfer

from . import reference as ref
from .checks import assert_close, to_host
from .gpu_decode import random_values, to_gpu
from .test_prefill import ragged_batch, reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def test_norms_and_activations_take_out_positionally_and_enable_pdl(torch):
    rng = np.random.default_rng(1)
    x = random_values(rng, (5, 256), "bfloat16")
    w = random_values(rng, (256,), "bfloat16")
    tx, tw = (torch.from_dlpack(to_gpu(a)) for a in (x, w))
    out = torch.empty_like(tx)
    y = rtcinfer.rmsnorm(tx, tw, 1e-6, out, True)
    assert y.data_ptr() == out.data_ptr()
    assert_close(to_host(y), ref.rmsnorm_ref(x, w, 1e-6), "bfloat16", "rmsnorm")
    gate = random_values(rng, (3, 2 * 128), "bfloat16")
    tg = torch.from_dlpack(to_gpu(gate))
    act = torch.empty(3, 128, dtype=tg.dtype, device=tg.device)
    assert rtcinfer.silu_and_mul(tg, act, True).data_ptr() == act.data_ptr()
    assert_close(to_host(act), ref.silu_and_mul_ref(gate), "bfloat16", "silu_and_mul")
    r = random_values(rng, (5, 256), "bfloat16")
    tr = torch.from_dlpack(to_gpu(r))
    rtcinfer.fused_add_rmsnorm(tx, tr, tw, 1e-6, enable_pdl=True)
    expect_r = x.astype(np.float64) + r.astype(np.float64)
    assert_close(to_host(tr), expect_r, "bfloat16", "residual")


def _planned_ragged(rng):
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [17, 0, 100], [30, 5, 0])
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.begin_forward(qo_indptr, kv_indptr, 8, 2, 128, causal=True, q_data_type="bfloat16")
    expect = reference(q, k, v, qo_indptr, kv_indptr, causal=True, sm_scale=1 / np.sqrt(128))
    return wrapper, (q, k, v), expect


@pytest.mark.parametrize("framework", ["cupy", "torch", "jax"])
def test_prefill_lse_in_base_e_and_heads_first(framework):
    """lse_base="ln" is the base-2 LSE times ln 2, lse_layout="HN" its [heads, tokens]
    transpose, contiguous; a given HN lse is filled (PyTorch, CuPy)."""
    rng = np.random.default_rng(2)
    wrapper, arrays, (o_ref, lse_ref) = _planned_ragged(rng)
    if framework == "cupy":
        args = tuple(to_gpu(a) for a in arrays)
    elif framework == "torch":
        torch = pytest.importorskip("torch")
        args = tuple(torch.from_dlpack(to_gpu(a)) for a in arrays)
    else:
        jax = pytest.importorskip("jax")
        if jax.default_backend() != "gpu":
            pytest.skip("JAX sees no GPU")
        args = tuple(jax.numpy.asarray(a) for a in arrays)
    base2 = to_host(wrapper.run_return_lse(*args)[1])
    assert_close(base2, lse_ref, "float32", "lse", tol=2e-3)
    for base, layout in (("ln", "NH"), ("log2", "HN"), ("ln", "HN")):
        o, lse = wrapper.run(*args, return_lse=True, lse_base=base, lse_layout=layout)
        expect = base2 * (math.log(2.0) if base == "ln" else 1.0)
        expect = expect.T if layout == "HN" else expect
        assert tuple(lse.shape) == expect.shape
        np.testing.assert_allclose(to_host(lse), expect, rtol=1e-6, atol=1e-6)
        assert_close(to_host(o), o_ref, "bfloat16", "o", per_vector=True)
    if framework == "jax":
        return
    heads_tokens = base2.T.copy()
    given = to_gpu(np.zeros(heads_tokens.shape, np.float32))
    if framework == "torch":
        given = torch.from_dlpack(given)
    o = wrapper.run(*args, lse=given, lse_layout="HN", lse_base="ln")
    np.testing.assert_allclose(to_host(given), heads_tokens * math.log(2.0), rtol=1e-6,
                               atol=1e-6)  # fmt: skip
    assert_close(to_host(o), o_ref, "bfloat16", "o", per_vector=True)
    with pytest.raises(ValueError, match='lse_layout="HN": expected shape'):
        wrapper.run(*args, lse=to_gpu(np.zeros((3, 3), np.float32)) if framework == "cupy"
                    else given[:3], lse_layout="HN")  # fmt: skip
    with pytest.raises(ValueError, match="lse_base must be one of"):
        wrapper.run(*args, return_lse=True, lse_base="e")


def test_prefill_q_scale_multiplies_the_logits_as_k_scale_does():
    rng = np.random.default_rng(3)
    wrapper, arrays, _ = _planned_ragged(rng)
    args = tuple(to_gpu(a) for a in arrays)
    by_q = to_host(wrapper.run(*args, q_scale=0.5, k_scale=3.0))
    by_k = to_host(wrapper.run(*args, k_scale=1.5))
    np.testing.assert_array_equal(by_q, by_k)
    with pytest.raises(ValueError, match="not supported: o_scale"):
        wrapper.run(*args, o_scale=2.0)


def test_paged_run_options_window_and_refusals():
    rng = np.random.default_rng(4)
    q = to_gpu(random_values(rng, (3, 8, 128), "bfloat16"))
    cache = to_gpu(random_values(rng, (4, 2, 16, 2, 128), "bfloat16"))
    wrapper = rtcinfer.BatchPrefillWithPagedKVCacheWrapper()
    wrapper.plan(np.array([0, 3], np.int32), np.array([0, 2], np.int32),
                 np.array([1, 3], np.int32), np.array([5], np.int32), 8, 2, 128, 16,
                 window_left=7, q_data_type="bfloat16")  # fmt: skip
    plain = to_host(wrapper.run(q, cache))
    np.testing.assert_array_equal(to_host(wrapper.run(q, cache, window_left=7,
                                                      use_fp16_softmax=True)), plain)  # fmt: skip
    with pytest.raises(ValueError, match="differs from the plan's window_left"):
        wrapper.run(q, cache, window_left=3)
    with pytest.raises(ValueError, match="not supported: kv_cache_sf"):
        wrapper.run(q, cache, kv_cache_sf=q)
    with pytest.raises(ValueError, match="multi-item scoring .prefix_len_ptr. defines the mask"):
        wrapper.plan(np.array([0, 3], np.int32), np.array([0, 2], np.int32),
                     np.array([1, 3], np.int32), np.array([5], np.int32), 8, 2, 128, 16,
                     custom_mask=np.ones(15, bool), prefix_len_ptr=np.array([1]))  # fmt: skip


@pytest.mark.parametrize("name", ["sampling_from_probs", "top_k_sampling_from_probs",
                                  "top_p_sampling_from_probs", "min_p_sampling_from_probs",
                                  "top_k_top_p_sampling_from_probs"])  # fmt: skip
def test_samplers_return_valid_flags(name):
    """valid[b]: row b has a value > 0 (an empty, negative or NaN row gives token 0)."""
    probs = np.full((4, 1000), 1e-3, np.float32)
    probs[1] = 0.0
    probs[2] = np.nan
    probs[3, :500] = -1.0
    params = {"top_k_sampling_from_probs": (50,), "top_p_sampling_from_probs": (0.9,),
              "min_p_sampling_from_probs": (0.1,),
              "top_k_top_p_sampling_from_probs": (50, 0.9)}.get(name, ())  # fmt: skip
    fn = getattr(rtcinfer, name)
    samples, valid = fn(to_gpu(probs), *params, return_valid=True, seed=1, offset=0)
    np.testing.assert_array_equal(to_host(valid), [True, False, False, True])
    assert to_host(samples)[1] == 0
    indices = to_gpu(np.array([1, 0, 0, 3], np.int32))
    _, valid = fn(to_gpu(probs), *params, indices, return_valid=True)
    np.testing.assert_array_equal(to_host(valid), [False, True, True, True])
    alone = fn(to_gpu(probs), *params, seed=1, offset=0)
    np.testing.assert_array_equal(to_host(alone), to_host(samples))


def test_reset_workspace_buffer_then_plan_again():
    rng = np.random.default_rng(5)
    wrapper, arrays, (o_ref, _) = _planned_ragged(rng)
    args = tuple(to_gpu(a) for a in arrays)
    before = to_host(wrapper.run(*args))
    import cupy

    fresh = cupy.empty(64 << 20, dtype=cupy.uint8)
    wrapper.reset_workspace_buffer(fresh, cupy.empty(8 << 20, dtype=cupy.uint8))
    with pytest.raises(RuntimeError, match="plan\\(\\) must be called"):
        wrapper.run(*args)
    qo_indptr, kv_indptr = ragged_batch(np.random.default_rng(5), [17, 0, 100], [30, 5, 0])[3:]
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, 128, causal=True, q_data_type="bfloat16")
    np.testing.assert_array_equal(to_host(wrapper.run(*args)), before)
    assert_close(before, o_ref, "bfloat16", "o", per_vector=True)
    graph = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper(
        fresh, use_cuda_graph=True, qo_indptr_buf=to_gpu(np.zeros(4, np.int32))
    )
    with pytest.raises(ValueError, match="keeps its workspace"):
        graph.reset_workspace_buffer(cupy.empty(64 << 20, dtype=cupy.uint8), None)


def test_decode_plan_deprecated_positional_options_and_data_type():
    """plan(..., page_size, "NONE", -1, None) as FlashInfer 0.7.2 binds it, and data_type for
    the KV dtype: the same attention as the keyword form."""
    rng = np.random.default_rng(6)
    q = to_gpu(random_values(rng, (2, 8, 128), "bfloat16"))
    cache = to_gpu(random_values(rng, (5, 2, 16, 2, 128), "bfloat16"))
    table = (np.array([0, 2, 3], np.int32), np.array([4, 0, 2], np.int32),
             np.array([9, 16], np.int32))  # fmt: skip
    by_keyword = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    by_keyword.plan(*table, 8, 2, 128, 16, q_data_type="bfloat16", kv_data_type="bfloat16")
    legacy = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    legacy.plan(*table, 8, 2, 128, 16, "NONE", -1, None, "bfloat16", data_type="bfloat16")
    np.testing.assert_array_equal(to_host(legacy.run(q, cache)),
                                  to_host(by_keyword.run(q, cache)))  # fmt: skip
    o, lse = legacy.run_return_lse(q, cache)
    assert tuple(lse.shape) == (2, 8)
    with pytest.raises(ValueError, match="not supported: kv_cache_sf"):
        legacy.run(q, cache, kv_cache_sf=q)
    with pytest.raises(ValueError, match="q_len_per_req"):
        legacy.plan(*table, 8, 2, 128, 16, q_len_per_req=2)


def test_forward_with_the_plan_parameters_is_run():
    """FlashInfer's deprecated begin_forward / forward pair (the parameters repeated)."""
    rng = np.random.default_rng(7)
    wrapper, arrays, (o_ref, lse_ref) = _planned_ragged(rng)
    args = tuple(to_gpu(a) for a in arrays)
    o = wrapper.forward(*args, causal=True)
    np.testing.assert_array_equal(to_host(o), to_host(wrapper.run(*args)))
    o, lse = wrapper.forward_return_lse(*args, causal=True)
    assert_close(to_host(o), o_ref, "bfloat16", "o", per_vector=True)
    assert_close(to_host(lse), lse_ref, "float32", "lse", tol=2e-3)
