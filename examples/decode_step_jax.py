"""The decode loop of decode_step.py with its GPU work inside one jax.jit (needs a CUDA GPU and
jax[cuda13] or jax[cuda12]): the jitted step appends the new keys and values (the updated cache
comes back as a new array; donated, so XLA reuses its buffer), runs batch decode and samples
the next tokens. plan() runs outside jit before each step, on host arrays: the step is traced
once and every later plan reaches it as data, without retracing (kv_indices is padded to the
cache's page count so that its shape never changes). Checked against float64 NumPy as in
decode_step.py; exit code 1 on a mismatch."""

import functools
import os
import sys

# JAX would take 75% of the GPU at import; rtcinfer's workspaces are CuPy memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import paged_cache  # noqa: E402

import rtcinfer  # noqa: E402

HQ, HKV, D, PAGE, PAGES, VOCAB = 32, 8, 128, 16, 64, 32000
LENGTHS = [37, 200, 1, 513]  # tokens each request holds before the first step
STEPS, TOP_K, TOP_P, SEED = 3, 50, 0.9, 1234

decode = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()  # one per model, reused every step


@functools.partial(jax.jit, donate_argnums=0)
def step(cache, k, v, batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len, q,
         logits, seed, offset):  # fmt: skip
    cache = rtcinfer.append_paged_kv_cache(k, v, batch_indices, positions, cache, kv_indices,
                                           kv_indptr, kv_last_page_len)  # fmt: skip
    o = decode.run(q, cache)  # the latest plan's batch
    tokens = rtcinfer.top_k_top_p_sampling_from_logits(logits, TOP_K, TOP_P, seed=seed,
                                                       offset=offset)  # fmt: skip
    return cache, o, tokens


def host(x):
    return np.asarray(x).astype(np.float64)


rng = np.random.default_rng(0)
batch = len(LENGTHS)
table = paged_cache.PageTable(LENGTHS, PAGE, PAGES, rng)
cache = jnp.asarray(rng.standard_normal((PAGES, 2, PAGE, HKV, D)), jnp.bfloat16)  # NHD pages
mirror = host(cache)  # what the reference reads
# Philox seed and offset as device arrays (uint32 words: JAX has no 64-bit ints by default), so
# that the traced step takes new ones every step.
seed = jnp.asarray([[SEED, 0]], jnp.uint32)
ok = True
for i in range(STEPS):
    table.grow()
    indptr, indices, last = table.arrays()
    decode.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=jnp.bfloat16)
    batch_indices, positions = rtcinfer.get_batch_indices_positions(
        np.arange(batch + 1, dtype=np.int32), np.array(table.lengths), batch
    )  # NumPy, on the host
    padded = np.zeros(PAGES, np.int32)
    padded[: len(indices)] = indices
    k, v, q = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
               for shape in ((batch, HKV, D), (batch, HKV, D), (batch, HQ, D)))  # fmt: skip
    logits = jnp.asarray(rng.standard_normal((batch, VOCAB)), jnp.float32)
    offset = jnp.asarray([[i, 0]], jnp.uint32)
    ints = [jnp.asarray(x, jnp.int32) for x in (batch_indices, positions, padded, indptr, last)]
    cache, o, tokens = step(cache, k, v, *ints, q, logits, seed, offset)

    paged_cache.append(mirror, table, host(k), host(v))
    ok &= paged_cache.check_step(i, table, mirror, host(q), host(o), host(cache), host(logits),
                                 np.asarray(tokens), TOP_K)  # fmt: skip
rtcinfer.check_errors()  # raises if the device skipped a bad page id or position
print("OK" if ok else "FAIL")
sys.exit(0 if ok else 1)
