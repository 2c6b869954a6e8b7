"""Batch prefill inside jax.jit with its plan passed as an array (GPU): one trace serves plans
of other lengths and shapes of work (split and unsplit, items expanded on the host), each
checked against float64; XLA launches it itself where JAX sees one GPU."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer

from .gpu_decode import random_values
from .test_prefill import check, reference

pytestmark = pytest.mark.gpu

HQ, HKV, D, ROWS, KEYS = 8, 2, 128, 3000, 6000
ROUNDS = [  # (qo lengths, kv lengths): at most ROWS queries (the first plan's), KEYS keys
    ([1500, 1000, 500], [1500, 1200, 900]),
    ([1, 700, 2299], [2000, 700, 3000]),
    ([0, 5, 100, 7], [0, 30, 100, 2000]),
    ([3000], [3000]),
]


def test_replanned_prefill_inside_jit_reads_its_plan_array(jax_gpu):
    jax = jax_gpu
    jnp = jax.numpy
    rng = np.random.default_rng(5)
    q = random_values(rng, (ROWS, HQ, D), "bfloat16")
    k = random_values(rng, (KEYS, HKV, D), "bfloat16")
    v = random_values(rng, (KEYS, HKV, D), "bfloat16")
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper(
        use_cuda_graph=True, qo_indptr_buf=np.zeros(5, np.int32),
        kv_indptr_buf=np.zeros(5, np.int32),
    )  # fmt: skip
    traces = []

    def run(q, k, v, plan):
        return wrapper.run(q, k, v, plan_array=plan, return_lse=True)

    def counted(*args):
        traces.append(1)
        return run(*args)

    step = jax.jit(counted)
    dq, dk, dv = (jnp.asarray(a) for a in (q, k, v))
    for i, (qo, kv) in enumerate(ROUNDS):
        qo_indptr, kv_indptr = np.cumsum([0, *qo]), np.cumsum([0, *kv])
        wrapper.plan(qo_indptr, kv_indptr, HQ, HKV, D, causal=True, q_data_type="bfloat16")
        plan = jnp.asarray(wrapper.plan_array())
        if i == 0 and len([d for d in jax.local_devices() if d.platform == "gpu"]) == 1:
            text = jax.jit(run).lower(dq, dk, dv, plan).as_text()
            assert "rtcinfer_xla_launch" in text and "rtcinfer_cuda" not in text
        o, lse = step(dq, dk, dv, plan)
        n = int(qo_indptr[-1])  # rows past the plan's are not written
        o_ref, lse_ref = reference(q[:n], k, v, qo_indptr, kv_indptr, causal=True,
                                   sm_scale=D**-0.5)  # fmt: skip
        try:
            check(np.asarray(o)[:n], np.asarray(lse)[:n], o_ref, lse_ref, "bfloat16")
        except AssertionError as e:
            raise AssertionError(f"round {i} (qo {qo}, kv {kv}): {e}") from e
    assert len(traces) == 1
    assert not wrapper._jax  # nothing waited on the host
