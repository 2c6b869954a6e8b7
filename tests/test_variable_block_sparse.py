"""VariableBlockSparseAttentionWrapper against the float64 reference on the GPU: a pattern per
kv head with blocks of varying sizes, GQA (the layout copies) and one query head a kv head
(views), causal and not, LSE, PyTorch inputs."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer

from . import reference_attention as aref
from .checks import assert_close, to_host
from .gpu_decode import random_values, to_gpu

pytestmark = pytest.mark.gpu


def _sizes(rng, total: int, blocks: int, heads: int) -> np.ndarray:
    """[heads, blocks] block sizes adding up to `total` per head (some blocks empty)."""
    cuts = np.sort(rng.integers(0, total + 1, (heads, blocks - 1)), axis=1)
    return np.diff(np.concatenate([np.zeros((heads, 1), int), cuts, np.full((heads, 1), total)],
                                  axis=1))  # fmt: skip


def _problem(rng, hq, hkv, L, Lk, d, blocks):
    """(rows, cols, keep, q, k, v): `blocks` (row, column) blocks a kv head, about 40% kept."""
    rows, cols = _sizes(rng, L, blocks[0], hkv), _sizes(rng, Lk, blocks[1], hkv)
    keep = rng.random((hkv, *blocks)) < 0.4
    q = random_values(rng, (hq, L, d), "bfloat16")
    k = random_values(rng, (hkv, Lk, d), "bfloat16")
    v = random_values(rng, (hkv, Lk, d), "bfloat16")
    return rows, cols, keep, q, k, v


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_variable_block_sparse(hq, hkv, causal):
    rng = np.random.default_rng(hq + 3 * hkv + causal)
    L, Lk, d = 300, 500, 128
    rows, cols, keep, q, k, v = _problem(rng, hq, hkv, L, Lk, d, (6, 9))
    wrapper = rtcinfer.VariableBlockSparseAttentionWrapper()
    wrapper.plan(to_gpu(keep), to_gpu(rows.astype(np.int32)), to_gpu(cols.astype(np.int32)),
                 hq, hkv, d, causal=causal, q_data_type="bfloat16")  # fmt: skip
    o, lse = wrapper.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True)
    scale = 1 / np.sqrt(d)
    o_ref, lse_ref = aref.variable_block_sparse_ref(q, k, v, keep, rows, cols, sm_scale=scale,
                                                    causal=causal)  # fmt: skip
    assert o.shape == (hq, L, d) and lse.shape == (hq, L)
    assert_close(to_host(o), o_ref, "bfloat16", "o", per_vector=True)
    assert_close(to_host(lse), lse_ref, "float32", "lse", tol=2e-3)


def test_pytorch_inputs():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    hq, hkv, L, Lk, d = 8, 2, 128, 128, 64
    rows, cols, keep, q, k, v = _problem(rng, hq, hkv, L, Lk, d, (4, 4))
    wrapper = rtcinfer.VariableBlockSparseAttentionWrapper()
    wrapper.plan(keep, rows, cols, hq, hkv, d, q_data_type="bfloat16")
    o = wrapper.run(*(torch.from_dlpack(to_gpu(x)) for x in (q, k, v)))
    assert isinstance(o, torch.Tensor) and tuple(o.shape) == (hq, L, d)
    o_ref, _ = aref.variable_block_sparse_ref(q, k, v, keep, rows, cols, sm_scale=1 / 8)
    assert_close(to_host(o), o_ref, "bfloat16", "o", per_vector=True)
