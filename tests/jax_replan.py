"""A jitted serving step (norm, activation, batch decode) re-planned between calls with the
same batch size and very different lengths, checked against float64 after every call.

Four wrappers: a plain one, a CUDA-graph one (fixed capacity), that one with each plan passed
to the step as an array (plan_array: no Python at execution, the step traced once), and that
one planning inside the step from the page table it is passed (device_plan_array: plan() once,
before the first step, for the configuration).
Run by tests/test_jax_replan.py in-process (XLA's default flags) and in a subprocess with XLA
command buffers forced on for custom calls (`python -m tests.jax_replan plain|graph|array|device`),
where XLA records the launches once and replays them without calling Python.
"""

from __future__ import annotations

import sys

import numpy as np

import rtcinfer

from . import reference as ref
from . import reference_attention as aref
from .checks import assert_close
from .gpu_decode import random_values
from .paged_batch import page_table_for

COMMAND_BUFFER_FLAGS = (
    "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
)
BATCH, HQ, HKV, D, PAGE, HIDDEN = 4, 8, 2, 128, 16, 256
ROUNDS = [  # lengths per plan: split plans (a long request among short ones) and whole ones
    [1, 15000, 3, 700],
    [15000, 15000, 1, 1],
    [5, 0, 5, 17],
    [1, 1, 1, 1],
    [9000, 1, 2, 3000],
    [64, 16, 15, 33],
    [1, 15000, 3, 700],
]
MAX_PAGES = 2 * 15000 // PAGE + 8


MODES = ("plain", "graph", "array", "device")


def run(mode: str, rounds=ROUNDS) -> int:
    """Plans every round's table into one wrapper and runs the same jitted step after each;
    raises on the first mismatch. Returns the number of steps checked."""
    graph = mode != "plain"
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(11)
    cache = random_values(rng, (MAX_PAGES, 2, PAGE, HKV, D), "bfloat16")
    q = random_values(rng, (BATCH, HQ, D), "bfloat16")
    x = random_values(rng, (BATCH, HIDDEN), "bfloat16")
    res = random_values(rng, (BATCH, HIDDEN), "bfloat16", 4.0)
    w = random_values(rng, (HIDDEN,), "bfloat16")
    gate = random_values(rng, (BATCH, 2 * HIDDEN), "bfloat16")
    dev = {k: jnp.asarray(v) for k, v in dict(cache=cache, q=q, x=x, res=res, w=w,
                                               gate=gate).items()}  # fmt: skip
    if graph:
        wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(
            use_cuda_graph=True, paged_kv_indptr_buffer=np.zeros(BATCH + 1, np.int32),
            paged_kv_indices_buffer=np.zeros(MAX_PAGES, np.int32),
            paged_kv_last_page_len_buffer=np.zeros(BATCH, np.int32),
        )  # fmt: skip
    else:
        wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()

    traces = []

    @jax.jit
    def step(x, res, w, gate, q, cache, plan, table):
        traces.append(1)
        h, res = rtcinfer.fused_add_rmsnorm(x, res, w)
        a = rtcinfer.silu_and_mul(gate)
        if mode == "device":
            indptr, indices, last = table
            plan = wrapper.device_plan_array(indptr, indices, last, MAX_PAGES)
        o, lse = wrapper.run(q, cache, return_lse=True,
                             plan_array=plan if mode in ("array", "device") else None)  # fmt: skip
        return h, res, a, o, lse

    expect_h, expect_res = ref.fused_add_rmsnorm_ref(x, res, w, dtype="bfloat16")
    expect_a = ref.silu_and_mul_ref(gate)
    for i, lengths in enumerate(rounds):
        indptr, _, last, _ = page_table_for(lengths, PAGE, rng, spare_pages=0)
        indices = rng.permutation(MAX_PAGES)[: indptr[-1]].astype(np.int32)
        if mode != "device" or i == 0:
            wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type="bfloat16")
        plan = jnp.asarray(wrapper.plan_array() if mode == "array" else np.zeros(4, np.int32))
        padded = np.zeros(MAX_PAGES, np.int32)  # one shape for every table
        padded[: indices.shape[0]] = indices
        table = tuple(jnp.asarray(t) for t in (indptr, padded, last))
        h, res2, a, o, lse = step(dev["x"], dev["res"], dev["w"], dev["gate"], dev["q"],
                                  dev["cache"], plan, table)  # fmt: skip
        o_ref, lse_ref = aref.batch_decode_paged_ref(q, cache, indptr, indices, last,
                                                    kv_layout="NHD", return_lse=True)  # fmt: skip
        try:
            assert_close(np.asarray(o), o_ref, "bfloat16", "o")
            assert_close(np.asarray(lse), lse_ref, "float32", "lse", tol=1e-3)
            assert_close(np.asarray(h), expect_h, "bfloat16", "h")
            np.testing.assert_array_equal(np.asarray(res2).astype(np.float64), expect_res)
            assert_close(np.asarray(a), expect_a, "bfloat16", "a")
        except AssertionError as e:
            raise AssertionError(f"step {i} (lengths {lengths}, {mode}): {e}") from e
    assert len(traces) == 1, f"{len(traces)} traces"
    if mode in ("array", "device"):  # nothing waited on the host: the wrapper never learned of JAX
        assert not wrapper._jax
    return len(rounds)


if __name__ == "__main__":
    print(f"checked {run(sys.argv[1])} steps")
