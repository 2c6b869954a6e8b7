"""The same step on CuPy arrays (needs a CUDA GPU)."""

import cupy
import ml_dtypes
import numpy as np

import rtcinfer

bf16 = ml_dtypes.bfloat16
rng = np.random.default_rng(0)
tokens = 256
x = cupy.asarray(rng.standard_normal((tokens, 4096)).astype(bf16))
residual = cupy.asarray(rng.standard_normal((tokens, 4096)).astype(bf16))
rtcinfer.fused_add_rmsnorm(x, residual, cupy.ones(4096, dtype=bf16), eps=1e-5)
q = cupy.asarray(rng.standard_normal((tokens, 32, 128)).astype(bf16))
k = cupy.asarray(rng.standard_normal((tokens, 8, 128)).astype(bf16))
indptr = cupy.asarray([0, 100, tokens], dtype=cupy.int32)
offsets = cupy.asarray([0, 4000], dtype=cupy.int32)
q, k = rtcinfer.apply_rope(q, k, indptr, offsets, rope_theta=5e5)
h = rtcinfer.silu_and_mul(cupy.asarray(rng.standard_normal((tokens, 2 * 14336)).astype(bf16)))
cupy.cuda.runtime.deviceSynchronize()
print("ok:", x.shape, q.shape, h.shape, h.dtype)
