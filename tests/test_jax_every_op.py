"""Every public op on JAX arrays, eagerly and inside `jax.jit` (GPU): the two give the same bits
(the same kernels through the same FFI target, one call alone or inside a compiled program),
and the eager result matches the float64 reference (or, for a sampler, draws a token of its
kept set with the same seed in both). The batch wrappers' run() inside jax.jit is tested with
their other tests (test_prefill, test_decode_graph, test_jax_replan)."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer

from . import reference as ref
from . import reference_attention as aref
from . import reference_sampling as sref
from .checks import assert_close
from .gpu import randn

pytestmark = pytest.mark.gpu

D, HQ, HKV, N = 64, 4, 2, 6  # head_dim, heads, tokens
POS = np.array([0, 3, 7, 100, 2047, 9], np.int32)
INDPTR, OFFSETS = np.array([0, 2, 6], np.int32), np.array([3, 1000], np.int32)
INV = ref.rope_inv_freq(D)


def _norms(rng):
    x, r = randn(rng, (5, 512), "bfloat16"), randn(rng, (5, 512), "bfloat16", 4.0)
    w = (1 + 0.1 * rng.standard_normal(512)).astype(x.dtype)
    g, b = (rng.standard_normal(512).astype(np.float32) for _ in range(2))
    fused = ref.fused_add_rmsnorm_ref(x, r, w, dtype="bfloat16")
    gemma_fused = ref.gemma_fused_add_rmsnorm_ref(x, r, w, dtype="bfloat16")
    return {
        "rmsnorm": (rtcinfer.rmsnorm, (x, w), ref.rmsnorm_ref(x, w)),
        "gemma_rmsnorm": (rtcinfer.gemma_rmsnorm, (x, w), ref.gemma_rmsnorm_ref(x, w)),
        "layernorm": (rtcinfer.layernorm, (x, g, b), ref.layernorm_ref(x, g, b)),
        "fused_add_rmsnorm": (rtcinfer.fused_add_rmsnorm, (x, r, w), fused),
        "gemma_fused_add_rmsnorm": (rtcinfer.gemma_fused_add_rmsnorm, (x, r, w), gemma_fused),
    }


def _activations(rng):
    x = randn(rng, (5, 2 * 256), "bfloat16")
    return {name: (getattr(rtcinfer, name), (x,), getattr(ref, f"{name}_ref")(x))
            for name in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul")}  # fmt: skip


def _rope(rng):
    q, k = randn(rng, (N, HQ, D), "bfloat16"), randn(rng, (N, HKV, D), "bfloat16")
    at = ref.positions_from_indptr(INDPTR, OFFSETS)
    llama = ref.llama31_inv_freq(D)
    angles = np.outer(np.arange(4096), INV)
    table = np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(np.float32)
    by_pos = (ref.rope_ref(q, POS, D, False, INV), ref.rope_ref(k, POS, D, False, INV))
    by_indptr = (ref.rope_ref(q, at, D, False, INV), ref.rope_ref(k, at, D, False, INV))
    by_llama = (ref.rope_ref(q, POS, D, False, llama), ref.rope_ref(k, POS, D, False, llama))
    flat = (q.reshape(N, HQ * D), k.reshape(N, HKV * D))
    by_table = tuple(ref.rope_cos_sin_cache_ref(x, POS, table).reshape(N, -1) for x in (q, k))
    cases = {}
    for suffix in ("", "_inplace"):
        cases["apply_rope_pos_ids" + suffix] = (
            getattr(rtcinfer, "apply_rope_pos_ids" + suffix),
            (q, k, POS),
            by_pos,
        )
        cases["apply_rope" + suffix] = (
            getattr(rtcinfer, "apply_rope" + suffix),
            (q, k, INDPTR, OFFSETS),
            by_indptr,
        )
        cases["apply_llama31_rope_pos_ids" + suffix] = (
            getattr(rtcinfer, "apply_llama31_rope_pos_ids" + suffix),
            (q, k, POS),
            by_llama,
        )
        op = getattr(rtcinfer, "apply_rope_with_cos_sin_cache" + suffix)
        cases["apply_rope_with_cos_sin_cache" + suffix] = (
            lambda p, x, y, t, op=op: op(p, x, y, D, t),
            (POS, *flat, table),
            by_table,
        )
    return cases


def _merge_and_append(rng):
    va, vb = randn(rng, (3, HQ, D), "bfloat16"), randn(rng, (3, HQ, D), "bfloat16")
    sa, sb = (rng.standard_normal((3, HQ)).astype(np.float32) for _ in range(2))
    sinks = rng.standard_normal(HQ).astype(np.float32)
    v, s = randn(rng, (3, 5, HQ, D), "bfloat16"), rng.standard_normal((3, 5, HQ)).astype(np.float32)
    pages, page = 8, 16
    cache = randn(rng, (pages, 2, page, HKV, D), "bfloat16")
    keys, values = randn(rng, (3, HKV, D), "bfloat16"), randn(rng, (3, HKV, D), "bfloat16")
    indices, indptr = np.array([5, 2, 7], np.int32), np.array([0, 2, 3], np.int32)
    last = np.array([4, 16], np.int32)  # request 0: 20 tokens, request 1: 16
    bidx, pos = np.array([0, 0, 1], np.int32), np.array([18, 19, 15], np.int32)
    append = aref.append_paged_kv_cache_ref(keys, values, bidx, pos, cache, indices, indptr, last)
    return {
        "merge_state": (rtcinfer.merge_state, (va, sa, vb, sb),
                        aref.merge_state_ref(va, sa, vb, sb)),
        "merge_states": (rtcinfer.merge_states, (v, s), aref.merge_states_ref(v, s)),
        "merge_sinks_in_place": (rtcinfer.merge_sinks_in_place, (va, sa, sinks),
                                 aref.merge_state_ref(va, sa, np.zeros(va.shape),
                                                      np.broadcast_to(sinks * aref.LOG2E,
                                                                      sa.shape))),
        "append_paged_kv_cache": (rtcinfer.append_paged_kv_cache,
                                  (keys, values, bidx, pos, cache, indices, indptr, last), append),
    }  # fmt: skip


def _attention(rng):
    q1 = randn(rng, (HQ, D), "bfloat16")
    q, k, v = (randn(rng, (n, h, D), "bfloat16") for n, h in ((N, HQ), (300, HKV), (300, HKV)))
    scale = 1 / np.sqrt(D)
    one = aref.attention_ref(q1[None], k, v, sm_scale=scale)[0][0]
    prefill = aref.attention_ref(q, k, v, causal=True, sm_scale=scale)[0]
    return {
        "single_decode_with_kv_cache": (rtcinfer.single_decode_with_kv_cache, (q1, k, v), one),
        "single_prefill_with_kv_cache": (
            lambda q, k, v: rtcinfer.single_prefill_with_kv_cache(q, k, v, causal=True),
            (q, k, v), prefill),
    }  # fmt: skip


def _sampling_refs(rng):
    logits = (3 * rng.standard_normal((3, 1000))).astype(np.float32)
    probs = sref.softmax_ref(logits).astype(np.float32)
    return {
        "softmax": (rtcinfer.softmax, (logits,), sref.softmax_ref(logits)),
        "top_k_mask_logits": (lambda x: rtcinfer.top_k_mask_logits(x, 10), (logits,),
                              sref.top_k_mask_logits_ref(logits, 10)),
        "top_k_renorm_probs": (lambda p: rtcinfer.top_k_renorm_probs(p, 10), (probs,),
                               sref.top_k_renorm_probs_ref(probs, 10)),
        "top_p_renorm_probs": (lambda p: rtcinfer.top_p_renorm_probs(p, 0.9), (probs,),
                               sref.top_p_renorm_probs_ref(probs, 0.9)),
    }  # fmt: skip


def _cases():
    rng = np.random.default_rng(0)
    out = {}
    for make in (_norms, _activations, _rope, _merge_and_append, _attention, _sampling_refs):
        out.update(make(rng))
    return out


CASES = _cases()


def _host(result) -> list[np.ndarray]:
    parts = result if isinstance(result, (tuple, list)) else (result,)
    return [np.asarray(p) for p in parts]


def _assert_same_bits(a: list[np.ndarray], b: list[np.ndarray], name: str) -> None:
    assert len(a) == len(b), name
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, name
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_op_inside_jit_gives_its_eager_bits_and_the_reference(jax_gpu, name):
    jax = jax_gpu
    fn, host_args, expect = CASES[name]
    args = [jax.numpy.asarray(a) for a in host_args]
    eager = _host(fn(*args))
    jitted = _host(jax.jit(fn)(*args))
    _assert_same_bits(eager, jitted, name)
    expected = expect if isinstance(expect, tuple) else (expect,)
    assert len(expected) == len(eager), name
    for got, want in zip(eager, expected, strict=True):
        if got.dtype == np.float32 and want.dtype != np.float32:
            assert_close(got, want, "float32", name, tol=2e-3)
        else:
            dtype = "bfloat16" if got.dtype.itemsize == 2 else "float32"
            assert_close(got, want, dtype, name, tol=2e-3 if dtype == "float32" else None)


SAMPLERS = {
    "sampling_from_probs": ("plain", {}, lambda p, kw: rtcinfer.sampling_from_probs(p, **kw)),
    "top_k_sampling_from_probs": ("top_k", dict(top_k=10),
                                  lambda p, kw: rtcinfer.top_k_sampling_from_probs(p, 10, **kw)),
    "top_p_sampling_from_probs": ("top_p", dict(top_p=0.9),
                                  lambda p, kw: rtcinfer.top_p_sampling_from_probs(p, 0.9, **kw)),
    "min_p_sampling_from_probs": ("min_p", dict(min_p=0.1),
                                  lambda p, kw: rtcinfer.min_p_sampling_from_probs(p, 0.1, **kw)),
    "top_k_top_p_sampling_from_probs": (
        "top_k_first", dict(top_k=10, top_p=0.9),
        lambda p, kw: rtcinfer.top_k_top_p_sampling_from_probs(p, 10, 0.9, **kw)),
    "sampling_from_logits": ("plain", {}, None),
    "top_k_top_p_sampling_from_logits": ("top_k_first", dict(top_k=10, top_p=0.9), None),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_a_sampler_inside_jit_draws_its_eager_tokens_from_its_kept_set(jax_gpu, name):
    jax = jax_gpu
    op, params, from_probs = SAMPLERS[name]
    rng = np.random.default_rng(1)
    logits = (3 * rng.standard_normal((4, 1000))).astype(np.float32)
    probs = sref.softmax_ref(logits).astype(np.float32)
    if from_probs is None:  # the one-call samplers take the logits
        k, p = params.get("top_k"), params.get("top_p")
        extra = () if k is None else (k, p)

        def fn(x):
            return getattr(rtcinfer, name)(x, *extra, seed=7, offset=3)

        arg = jax.numpy.asarray(logits)
    else:

        def fn(x):
            return from_probs(x, dict(seed=7, offset=3))

        arg = jax.numpy.asarray(probs)
    eager, jitted = _host(fn(arg)), _host(jax.jit(fn)(arg))
    _assert_same_bits(eager, jitted, name)
    keep = sref.sampling_keep_ref(probs, op, **params)
    tokens = eager[0]
    assert tokens.shape == (4,)
    assert all(keep[b, t] for b, t in enumerate(tokens.tolist())), (name, tokens)


def test_chain_speculative_sampling_inside_jit_gives_its_eager_bits(jax_gpu):
    jax = jax_gpu
    rng = np.random.default_rng(2)
    draft = sref.softmax_ref(rng.standard_normal((2, 3, 100))).astype(np.float32)
    target = sref.softmax_ref(rng.standard_normal((2, 4, 100))).astype(np.float32)
    tokens = rng.integers(0, 100, (2, 3)).astype(np.int32)
    args = [jax.numpy.asarray(a) for a in (draft, tokens, target)]

    def fn(d, t, p):
        return rtcinfer.chain_speculative_sampling(d, t, p, seed=5, offset=0)

    eager, jitted = _host(fn(*args)), _host(jax.jit(fn)(*args))
    _assert_same_bits(eager, jitted, "chain_speculative_sampling")
    emitted = eager[0]
    assert emitted.shape == (2, 4) and ((emitted >= -1) & (emitted < 100)).all()
