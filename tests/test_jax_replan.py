"""JAX inside jax.jit with plans that change between executions (GPU): every re-plan reaches
the compiled step as data, with XLA's default flags and with command buffers forced on, for
the plain and the CUDA-graph decode wrapper and for plans passed as arrays; a dropped wrapper
is collected."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

import rtcinfer

from . import jax_replan

pytestmark = pytest.mark.gpu


def _jax():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    return jax


@pytest.mark.parametrize("mode", jax_replan.MODES)
def test_replanned_step_default_flags(mode):
    _jax()
    assert jax_replan.run(mode) == len(jax_replan.ROUNDS)


@pytest.mark.parametrize("mode", jax_replan.MODES)
def test_replanned_step_with_command_buffers(mode):
    """XLA records the custom calls into CUDA graphs and replays them: a plain wrapper's launch
    (whose grid follows the plan) must not be recorded, a graph wrapper's may be."""
    _jax()
    env = {**os.environ, "XLA_FLAGS": jax_replan.COMMAND_BUFFER_FLAGS,
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # fmt: skip
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "tests.jax_replan", mode],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"checked {len(jax_replan.ROUNDS)} steps" in done.stdout


def test_a_dropped_wrapper_is_collected_after_jax_calls():
    jax = _jax()
    jnp = jax.numpy
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    wrapper.plan([0, 1, 3], [2, 0, 1], [5, 16], 8, 2, 128, 16, q_data_type="bfloat16")
    q = jnp.zeros((2, 8, 128), jnp.bfloat16)
    cache = jnp.zeros((3, 2, 16, 2, 128), jnp.bfloat16)
    step = jax.jit(wrapper.run)
    np.asarray(step(q, cache))
    np.asarray(wrapper.run(q, cache))  # eager too
    ref = weakref.ref(wrapper)
    del wrapper, step
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())
