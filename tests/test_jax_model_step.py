"""One decode step of a small model inside jax.jit, as examples/serve_jax.py runs it (GPU): q,
k and v sliced from one matmul's output, RoPE in place, the append into a donated paged cache,
batch decode, the residual norms and SiLU-and-mul, for batches of one and of three requests.
Every intermediate comes back and is checked against float64 NumPy computed from the step's
own inputs to that op, so a wrong op is named (serve_jax's decode step of one request gave
NaN logits on the H200)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import rtcinfer
from tests import reference as ref
from tests.checks import assert_close
from tests.gpu import randn
from tests.step_checks import assert_rope_append_decode

pytestmark = pytest.mark.gpu

HQ, HKV, D, HIDDEN, PAGE, PAGES, EPS = 8, 2, 128, 256, 16, 16, 1e-6


@pytest.mark.parametrize("plan_array", [False, True], ids=["wrapper_plan", "plan_array"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_decode_step_inside_jit_matches_float64_op_by_op(jax_gpu, batch, plan_array):
    """plan_array: the decode plan reaches the step as an argument (a wrapper of fixed
    capacity), every op then launched by XLA itself where JAX sees one GPU."""
    jax = jax_gpu
    jnp = jax.numpy
    rng = np.random.default_rng(batch)
    lengths = [37, 5, 20][:batch]  # tokens each request holds, the new one included
    pages = [-(-n // PAGE) for n in lengths]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(PAGES)[: indptr[-1]].astype(np.int32)
    last = np.array([n - (p - 1) * PAGE for n, p in zip(lengths, pages, strict=True)], np.int32)
    padded = np.zeros(PAGES, np.int32)
    padded[: len(indices)] = indices
    pos = np.array(lengths, np.int32) - 1
    bidx = np.arange(batch, dtype=np.int32)
    x = randn(rng, (batch, HIDDEN), "bfloat16")
    w_qkv = randn(rng, (HIDDEN, (HQ + 2 * HKV) * D), "bfloat16", HIDDEN**-0.5)
    ln = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(x.dtype)
    cache = randn(rng, (PAGES, 2, PAGE, HKV, D), "bfloat16")
    if plan_array:
        decode = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(
            use_cuda_graph=True, paged_kv_indptr_buffer=np.zeros(4, np.int32),
            paged_kv_indices_buffer=np.zeros(PAGES, np.int32),
        )  # fmt: skip
    else:
        decode = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    decode.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type="bfloat16")
    plan = jnp.asarray(decode.plan_array()) if plan_array else jnp.zeros(4, np.int32)
    ln_gpu, w_qkv_gpu = jnp.asarray(ln), jnp.asarray(w_qkv)  # the ops take device arrays

    @functools.partial(jax.jit, donate_argnums=1)
    def step(x, cache, pos, bidx, padded, indptr, last, plan):
        n = x.shape[0]
        h = rtcinfer.rmsnorm(x, ln_gpu, EPS)
        qkv = h @ w_qkv_gpu
        q = qkv[:, : HQ * D].reshape(n, HQ, D)
        k = qkv[:, HQ * D : (HQ + HKV) * D].reshape(n, HKV, D)
        v = qkv[:, (HQ + HKV) * D :].reshape(n, HKV, D)
        q2, k2 = rtcinfer.apply_rope_pos_ids_inplace(q, k, pos)
        cache2 = rtcinfer.append_paged_kv_cache(k2, v, bidx, pos, cache, padded, indptr, last)
        o = decode.run(q2, cache2, plan_array=plan if plan_array else None)
        out, residual = rtcinfer.fused_add_rmsnorm(o.reshape(n, HQ * D)[:, :HIDDEN], x, ln_gpu, EPS)
        act = rtcinfer.silu_and_mul(out)
        return h, qkv, q2, k2, cache2, o, out, residual, act

    args = [jnp.asarray(a) for a in (x, cache, pos, bidx, padded, indptr, last)] + [plan]
    address = args[1].unsafe_buffer_pointer()
    results = step(*args)
    assert results[4].unsafe_buffer_pointer() == address  # the donated cache, updated in place
    h, qkv, q2, k2, cache2, o, out, residual, act = (np.asarray(a) for a in results)
    for name, a in (("h", h), ("qkv", qkv), ("q", q2), ("k", k2), ("cache", cache2), ("o", o),
                    ("out", out), ("residual", residual), ("act", act)):  # fmt: skip
        assert np.isfinite(a.astype(np.float32)).all(), f"{name} holds non-finite values"
    assert_close(h, ref.rmsnorm_ref(x, ln, EPS), "bfloat16")
    q = qkv[:, : HQ * D].reshape(batch, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].reshape(batch, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].reshape(batch, HKV, D)
    table = (indptr, indices, last)
    assert_rope_append_decode(q, k, v, cache, pos, bidx, table, q2, k2, cache2, o)
    want_out, want_residual = ref.fused_add_rmsnorm_ref(
        o.reshape(batch, HQ * D)[:, :HIDDEN], x, ln, EPS, dtype="bfloat16"
    )
    assert_close(out, want_out, "bfloat16")
    np.testing.assert_array_equal(residual.astype(np.float64), want_residual)
    assert_close(act, ref.silu_and_mul_ref(out), "bfloat16")
