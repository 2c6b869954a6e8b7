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
    assert _targets(jax, append, k, cache) == {"rtcinfer_cuda"}  # in place: the handler
