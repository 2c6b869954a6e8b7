"""The same step inside jax.jit (needs a CUDA GPU and jax with CUDA)."""

import jax
import jax.numpy as jnp

import rtcinfer


@jax.jit
def step(x, residual, w, q, k, pos, gate_up):
    x, residual = rtcinfer.fused_add_rmsnorm(x, residual, w, eps=1e-5)
    q, k = rtcinfer.apply_llama31_rope_pos_ids(q, k, pos)
    return x, residual, q, k, rtcinfer.silu_and_mul(gate_up)


tokens = 256
keys = jax.random.split(jax.random.key(0), 5)
x = jax.random.normal(keys[0], (tokens, 4096), jnp.bfloat16)
q = jax.random.normal(keys[1], (tokens, 32, 128), jnp.bfloat16)
k = jax.random.normal(keys[2], (tokens, 8, 128), jnp.bfloat16)
gate_up = jax.random.normal(keys[3], (tokens, 2 * 14336), jnp.bfloat16)
pos = jnp.arange(tokens, dtype=jnp.int32)
out = step(x, x, jnp.ones(4096, jnp.bfloat16), q, k, pos, gate_up)
print("ok:", [tuple(o.shape) for o in out])
