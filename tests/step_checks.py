"""The float64 check of an attention step's outputs, shared by the tests that run one inside
jax.jit: RoPE on q and k, the append of k and v into a paged cache, batch decode over it."""

from __future__ import annotations

import numpy as np

from tests import reference as ref
from tests import reference_attention as aref
from tests.checks import assert_close


def assert_rope_append_decode(q, k, v, cache, pos, bidx, table, q2, k2, cache2, o) -> None:
    """q2, k2: q and k turned by RoPE at `pos`; cache2: `cache` after appending k2 and v at
    (bidx, pos) through `table` = (indptr, indices, last); o: batch decode of q2 over cache2
    (all bf16, checked against float64 NumPy from the step's own inputs to each op)."""
    indptr, indices, last = table
    inv = ref.rope_inv_freq(q.shape[-1])
    assert_close(q2, ref.rope_ref(q, pos, q.shape[-1], False, inv), "bfloat16")
    assert_close(k2, ref.rope_ref(k, pos, k.shape[-1], False, inv), "bfloat16")
    want_cache = aref.append_paged_kv_cache_ref(k2, v, bidx, pos, cache, indices, indptr, last)
    np.testing.assert_array_equal(cache2.astype(np.float32), want_cache.astype(np.float32))
    assert_close(o, aref.batch_decode_paged_ref(q2, cache2, indptr, indices, last), "bfloat16")
