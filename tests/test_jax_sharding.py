"""rtcinfer inside jax.jit with shardings (GPU): an attention step (RoPE in place, the append
into a donated paged cache, batch decode) under jax.jit with in_shardings/out_shardings on a
one-device mesh, and under shard_map with the heads split over a one-device mesh (its shard
the whole: what a device runs when a mesh splits heads), each checked against float64 NumPy.
A mesh of several devices, each with its own plan, is a two-GPU matter."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from tests import reference_attention as aref
from tests.checks import assert_close
from tests.gpu import randn
from tests.paged_batch import page_table_for
from tests.step_checks import assert_rope_append_decode

pytestmark = pytest.mark.gpu

HQ, HKV, D, PAGE, PAGES = 8, 2, 128, 16, 16
LENGTHS = [37, 5, 20]  # tokens each request holds, the new one included


def _tables(lengths, rng):
    """(indptr, indices, last, indices padded to PAGES, positions of the new tokens, batch
    indices) of requests holding `lengths` tokens, the new one included, over PAGES pages."""
    used = sum(-(-n // PAGE) for n in lengths)
    indptr, indices, last, _ = page_table_for(lengths, PAGE, rng, spare_pages=PAGES - used)
    padded = np.zeros(PAGES, np.int32)
    padded[: len(indices)] = indices
    pos = np.array(lengths, np.int32) - 1
    return indptr, indices, last, padded, pos, np.arange(len(lengths), dtype=np.int32)


def _step(decode):
    def step(q, k, v, cache, pos, bidx, padded, indptr, last):
        q2, k2 = rtcinfer.apply_rope_pos_ids_inplace(q, k, pos)
        cache2 = rtcinfer.append_paged_kv_cache(k2, v, bidx, pos, cache, padded, indptr, last)
        return q2, k2, cache2, decode.run(q2, cache2)

    return step


def _sharded(jax, how: str, step):
    """step jitted the way `how` says, over a mesh of the first device (axis "h": heads)."""
    P = jax.sharding.PartitionSpec
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("h",))
    if how == "in_shardings":
        every = jax.sharding.NamedSharding(mesh, P())
        return jax.jit(step, in_shardings=every, out_shardings=every, donate_argnums=3)
    heads, cache = P(None, "h", None), P(None, None, None, "h", None)
    mapped = jax.shard_map(
        step, mesh=mesh, in_specs=(heads, heads, heads, cache, P(), P(), P(), P(), P()),
        out_specs=(heads, heads, cache, heads), check_vma=False,
    )  # fmt: skip
    return jax.jit(mapped, donate_argnums=3)


@pytest.mark.parametrize("how", ["in_shardings", "shard_map"])
def test_an_attention_step_runs_under_shardings_and_matches_float64(jax_gpu, how):
    jax = jax_gpu
    rng = np.random.default_rng(3)
    indptr, indices, last, padded, pos, bidx = _tables(LENGTHS, rng)
    n = len(LENGTHS)
    q, k, v = (randn(rng, (n, h, D), "bfloat16") for h in (HQ, HKV, HKV))
    cache = randn(rng, (PAGES, 2, PAGE, HKV, D), "bfloat16")
    decode = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    decode.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type="bfloat16")
    step = _sharded(jax, how, _step(decode))
    args = [jax.numpy.asarray(a) for a in (q, k, v, cache, pos, bidx, padded, indptr, last)]
    q2, k2, cache2, o = (np.asarray(a) for a in step(*args))
    table = (indptr, indices, last)
    assert_rope_append_decode(q, k, v, cache, pos, bidx, table, q2, k2, cache2, o)
    # a re-plan with other lengths, the same shapes: the compiled step reads the new plan
    indptr, indices, last, padded, pos, bidx = _tables([3, 40, 17], rng)
    decode.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type="bfloat16")
    args = [jax.numpy.asarray(a) for a in (q, k, v, cache, pos, bidx, padded, indptr, last)]
    q2, _, cache2, o = (np.asarray(a) for a in step(*args))
    assert_close(o, aref.batch_decode_paged_ref(q2, cache2, indptr, indices, last), "bfloat16")
