"""BlockSparseAttentionWrapper against the float64 block-sparse reference on the GPU: block
sizes from 1 x 1 to 64 x 64, a partial last block row, empty block rows, masks inside the kept
blocks (boolean and packed), causal, soft cap, LSE, strided k and v, PyTorch and JAX inputs."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import rtcinfer

from . import reference_attention as aref
from .checks import assert_close, to_host
from .gpu_decode import random_values, to_gpu

pytestmark = pytest.mark.gpu


def pattern(rng, M, N, R, C, density=0.4):
    """(indptr, indices) of a random pattern: each block row keeps about `density` of the
    column blocks, in a random order; block row 1 keeps none."""
    MB, NB = -(-M // R), N // C
    keep = rng.random((MB, NB)) < density
    if MB > 1:
        keep[1] = False
    indptr = np.concatenate([[0], np.cumsum(keep.sum(1))]).astype(np.int32)
    rows = [rng.permutation(np.flatnonzero(r)) for r in keep]
    indices = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32)
    return indptr, indices


def check(o, lse, o_ref, lse_ref, dtype):
    o, lse = to_host(o), to_host(lse)
    assert not np.isnan(o).any()
    assert_close(o, o_ref, dtype, "o", per_vector=True)
    assert_close(lse, lse_ref, "float32", "lse", tol=2e-3)


CASES = {  # M, N, R, C, options
    "16x16": (256, 256, 16, 16, {}),
    "64x64 causal": (512, 1024, 64, 64, dict(causal=True)),
    "3x5 masked": (50, 60, 3, 5, dict(masked=True)),
    "1x1 tokens": (64, 48, 1, 1, {}),
    "8x32 soft cap, packed mask": (100, 256, 8, 32, dict(masked="packed", logits_soft_cap=5.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_block_sparse(case):
    M, N, R, C, options = CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    indptr, indices = pattern(rng, M, N, R, C)
    hq, hkv, d = 8, 2, 128
    q = random_values(rng, (M, hq, d), "bfloat16")
    k = random_values(rng, (N, hkv, d), "bfloat16")
    v = random_values(rng, (N, hkv, d), "bfloat16")
    masked = options.get("masked")
    mask = rng.random((indices.size, R, C)) < 0.6 if masked else None
    kwargs = {}
    if masked == "packed":  # each block row's rows x kept keys, row-major, packed per row
        flat = []
        for i in range(indptr.size - 1):
            rows = min(R, M - i * R)
            flat.append(mask[indptr[i] : indptr[i + 1], :rows].transpose(1, 0, 2).reshape(-1))
        qo = np.minimum(np.arange(indptr.size) * R, M)
        bits = np.concatenate([[0], np.cumsum(np.diff(qo) * np.diff(indptr) * C)])
        packed, _ = rtcinfer.segment_packbits(to_gpu(np.concatenate(flat)), to_gpu(bits),
                                              "little")  # fmt: skip
        kwargs["packed_mask"] = packed
    elif masked:
        kwargs["mask"] = to_gpu(mask)
    causal, cap = options.get("causal", False), options.get("logits_soft_cap")
    wrapper = rtcinfer.BlockSparseAttentionWrapper()
    wrapper.plan(to_gpu(indptr), to_gpu(indices), M, N, R, C, hq, hkv, d, causal=causal,
                 logits_soft_cap=cap, q_data_type="bfloat16", o_data_type="bfloat16",
                 **kwargs)  # fmt: skip
    o, lse = wrapper.run(to_gpu(q), to_gpu(k), to_gpu(v), return_lse=True)
    o_ref, lse_ref = aref.block_sparse_ref(q, k, v, indptr, indices, R, C,
                                           sm_scale=1 / np.sqrt(d), mask=mask, causal=causal,
                                           logits_soft_cap=cap or 0.0)  # fmt: skip
    check(o, lse, o_ref, lse_ref, "bfloat16")


def test_default_output_dtype_strided_kv_and_a_replan():
    """FlashInfer's default o_data_type is float16, whatever q's dtype; k and v may be views
    of a fused qkv buffer (token stride 3 heads); a second plan with another pattern."""
    rng = np.random.default_rng(7)
    M = N = 128
    hq, hkv, d = 4, 4, 64
    qkv = random_values(rng, (N, 3 * hkv, d), "bfloat16")
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    dev = to_gpu(qkv)
    wrapper = rtcinfer.BlockSparseAttentionWrapper()
    for R, C in ((16, 16), (32, 8)):
        indptr, indices = pattern(rng, M, N, R, C, density=0.5)
        wrapper.plan(indptr, indices, M, N, R, C, hq, hkv, d, q_data_type="bfloat16")
        o = wrapper.run(dev[:, :hq], dev[:, hq : hq + hkv], dev[:, hq + hkv :])
        assert o.dtype == np.float16
        o_ref, _ = aref.block_sparse_ref(q, k, v, indptr, indices, R, C, sm_scale=1 / 8)
        assert_close(to_host(o), o_ref, "float16", "o", tol=1.6e-2, per_vector=True)


def test_pytorch_and_jax_inputs(jax_gpu):
    """The same pattern on PyTorch tensors and, inside jax.jit, on JAX arrays."""
    torch = pytest.importorskip("torch")
    jax = jax_gpu
    rng = np.random.default_rng(11)
    M, N, R, C = 96, 128, 16, 16
    indptr, indices = pattern(rng, M, N, R, C)
    q = random_values(rng, (M, 4, 128), "bfloat16")
    k = random_values(rng, (N, 2, 128), "bfloat16")
    v = random_values(rng, (N, 2, 128), "bfloat16")
    o_ref, _ = aref.block_sparse_ref(q, k, v, indptr, indices, R, C, sm_scale=1 / np.sqrt(128))
    wrapper = rtcinfer.BlockSparseAttentionWrapper()
    wrapper.plan(indptr, indices, M, N, R, C, 4, 2, 128, q_data_type="bfloat16",
                 o_data_type="bfloat16")  # fmt: skip
    o = wrapper.run(*(torch.from_dlpack(to_gpu(x)) for x in (q, k, v)))
    assert isinstance(o, torch.Tensor)
    assert_close(to_host(o), o_ref, "bfloat16", "o", per_vector=True)
    jnp = jax.numpy
    run = jax.jit(lambda q, k, v: wrapper.run(q, k, v))
    o = run(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    assert_close(to_host(o), o_ref, "bfloat16", "o", per_vector=True)
