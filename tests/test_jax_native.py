"""On the GPU: the ops that read only their own arrays lower, inside jax.jit, to calls XLA
launches itself (interop/xla_launch.py), and the others to the Python FFI handler. If jaxlib
has its kernel launcher and this fails, the native path was turned off (a missing or refusing
ptxas: xla_launch.ptx_accepted) and every JAX call pays the handler's host time."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from rtcinfer.interop import xla_launch

pytestmark = pytest.mark.gpu


def _targets(jax, fn, *args) -> set[str]:
    text = jax.jit(fn).lower(*args).as_text()
    return {
        t for t in ("rtcinfer_xla_launch", "rtcinfer_cuda") if f"@{t}" in text or f'"{t}"' in text
    }


def test_ops_on_their_own_arrays_are_launched_by_xla(jax_gpu):
    jax = jax_gpu
    if xla_launch._lib() is None:
        pytest.skip("this jaxlib has no native kernel launcher")
    jnp = jax.numpy
    x = jnp.ones((4, 4096), jnp.bfloat16)
    w = jnp.ones((4096,), jnp.bfloat16)
    q = jnp.ones((4, 32, 128), jnp.bfloat16)
    k = jnp.ones((4, 8, 128), jnp.bfloat16)
    pos = jnp.arange(4, dtype=jnp.int32)
    probs = jnp.asarray(np.full((2, 1000), 1e-3, np.float32))
    native = {
        "rmsnorm": (lambda x, w: rtcinfer.rmsnorm(x, w), x, w),
        "fused_add_rmsnorm": (lambda x, w: rtcinfer.fused_add_rmsnorm(x, x, w), x, w),
        "silu_and_mul": (lambda x: rtcinfer.silu_and_mul(x), x),
        "apply_rope_pos_ids_inplace": (
            lambda q, k, p: rtcinfer.apply_rope_pos_ids_inplace(q, k, p), q, k, pos),
        "top_k_renorm_probs": (lambda p: rtcinfer.top_k_renorm_probs(p, 5), probs),
    }  # fmt: skip
    for name, (fn, *args) in native.items():
        assert _targets(jax, fn, *args) == {"rtcinfer_xla_launch"}, name
    assert xla_launch.enabled()
    cache = jnp.zeros((4, 2, 16, 8, 128), jnp.bfloat16)
    i32 = lambda a: jnp.asarray(np.array(a, np.int32))  # noqa: E731
    append = lambda k, cache: rtcinfer.append_paged_kv_cache(  # noqa: E731
        k, k, i32([0, 0, 0, 0]), i32([0, 1, 2, 3]), cache, i32([0]), i32([0, 1]), i32([4])
    )
    # in place: a move (nothing when XLA aliased the cache), then the append; on one GPU only
    # (its bad-index record is a constant)
    one_gpu = len([d for d in jax.local_devices() if d.platform == "gpu"]) == 1
    want = "rtcinfer_xla_launch" if one_gpu else "rtcinfer_cuda"
    assert _targets(jax, append, k, cache) == {want}
    # batch decode with its plan as an array reads only its arrays: native (on the wrapper's
    # plan it keeps the handler, which reads the latest plan at every execution)
    decode = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(
        use_cuda_graph=True, paged_kv_indptr_buffer=np.zeros(5, np.int32),
        paged_kv_indices_buffer=np.zeros(4, np.int32),
    )  # fmt: skip
    decode.plan(np.arange(5), np.arange(4), [16, 3, 1, 9], 32, 8, 128, 16, q_data_type="bfloat16")
    plan = jnp.asarray(decode.plan_array())
    run = lambda q, cache, plan: decode.run(q, cache, plan_array=plan)  # noqa: E731
    assert _targets(jax, run, q, cache, plan) == {"rtcinfer_xla_launch"}
    assert _targets(jax, lambda q, cache: decode.run(q, cache), q, cache) == {"rtcinfer_cuda"}


@pytest.mark.parametrize("donate", [False, True])
def test_append_into_a_slice_or_a_kept_cache_is_correct(jax_gpu, donate):
    """In-place appends inside jax.jit wherever XLA places the output: into a slice of a larger
    array (which XLA may give an output buffer of its own: the move kernel copies the slice
    there first) and into a cache the caller keeps (not donated: XLA copies it), each checked
    against float64, the caller's arrays left as they were."""
    from tests.reference_attention import append_paged_kv_cache_ref

    jax = jax_gpu
    jnp = jax.numpy
    rng = np.random.default_rng(3)
    big = rng.standard_normal((12, 2, 16, 2, 64)).astype(np.float32).astype(jnp.bfloat16)
    k = rng.standard_normal((5, 2, 64)).astype(np.float32).astype(jnp.bfloat16)
    v = rng.standard_normal((5, 2, 64)).astype(np.float32).astype(jnp.bfloat16)
    bidx, pos = np.array([0, 0, 1, 1, 1], np.int32), np.array([3, 20, 0, 1, 2], np.int32)
    table = (np.array([4, 1, 7], np.int32), np.array([0, 2, 3], np.int32),
             np.array([5, 3], np.int32))  # fmt: skip

    def append(cache, k, v):
        return rtcinfer.append_paged_kv_cache(k, v, jnp.asarray(bidx), jnp.asarray(pos), cache,
                                              *map(jnp.asarray, table))  # fmt: skip

    sliced = jax.jit(lambda big, k, v: append(big[2:10], k, v), donate_argnums=0 if donate else ())
    whole = jax.jit(append, donate_argnums=0 if donate else ())
    for fn, cache in ((sliced, big[2:10]), (whole, big[:8])):
        arg = jnp.asarray(big if fn is sliced else big[:8])
        want = append_paged_kv_cache_ref(k, v, bidx, pos, cache, *table)
        got = np.asarray(fn(arg, jnp.asarray(k), jnp.asarray(v)))
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
        if not donate:  # the caller's array is unchanged
            kept = big if fn is sliced else big[:8]
            np.testing.assert_array_equal(np.asarray(arg).astype(np.float32),
                                          kept.astype(np.float32))  # fmt: skip
