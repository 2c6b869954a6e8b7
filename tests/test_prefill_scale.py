"""The softmax scale's sign and zero on the GPU: the prefill kernel folds the scale into its
exp2 and takes the row maxima of the raw scores (head_dim >= 128, no ALiBi or soft cap), a
negative scale through a negated Q tile, a zero one as the smallest normal float; head_dim 64
keeps the scaled logits. Each against the float64 reference, causal and not, and a single
prefill of one query (a decode step through the same kernel)."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer

from .gpu_decode import to_gpu
from .test_prefill import check, ragged_batch, reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("sm_scale", [-0.09, 0.0, 0.3])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_with_a_negative_zero_or_large_scale(sm_scale, head_dim, causal):
    rng = np.random.default_rng(1000 + head_dim + int(1000 * sm_scale) + causal)
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [1, 90, 300, 0], [700, 40, 0, 7],
                                                 d=head_dim)  # fmt: skip
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo_indptr, kv_indptr, 8, 2, head_dim, causal=causal, sm_scale=sm_scale,
                 q_data_type="bfloat16")  # fmt: skip
    o, lse = wrapper.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True)
    check(o, lse, *reference(q, k, v, qo_indptr, kv_indptr, causal=causal, sm_scale=sm_scale),
          "bfloat16")  # fmt: skip


@pytest.mark.parametrize("sm_scale", [-0.09, 0.0])
def test_single_prefill_of_one_query_with_a_negative_or_zero_scale(sm_scale):
    rng = np.random.default_rng(7)
    q, k, v, qo_indptr, kv_indptr = ragged_batch(rng, [1, 1, 1], [63, 500, 0], d=128)
    o_ref, lse_ref = reference(q, k, v, qo_indptr, kv_indptr, sm_scale=sm_scale)
    single = rtcinfer.single_prefill_with_kv_cache(
        to_gpu(q[1:2]), to_gpu(k[kv_indptr[1] : kv_indptr[2]]),
        to_gpu(v[kv_indptr[1] : kv_indptr[2]]), sm_scale=sm_scale, return_lse=True,
    )  # fmt: skip
    check(*single, o_ref[1:2], lse_ref[1:2], "bfloat16")
