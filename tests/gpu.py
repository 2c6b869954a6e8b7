"""Helpers for GPU tests: random inputs of any dtype, uploaded as CuPy arrays."""

from __future__ import annotations

import numpy as np

from rtcinfer.interop.dtypes import numpy_dtype


def randn(rng, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    """Normal samples rounded to `dtype` (a NumPy array of that dtype)."""
    return (rng.standard_normal(shape) * scale).astype(numpy_dtype(dtype))


def upload(x: np.ndarray):
    import cupy

    return cupy.asarray(x)


def poisoned(shape, dtype: str):
    """A CuPy array filled with NaN, to prove a kernel writes every element."""
    import cupy

    return cupy.full(shape, np.nan, dtype=numpy_dtype(dtype))


def cos_sin_table(rng, max_pos: int, rope_dim: int) -> np.ndarray:
    """A float32 [max_pos, rope_dim] RoPE table of random angles: cos, then sin."""
    angle = rng.uniform(0, 2 * np.pi, (max_pos, rope_dim // 2))
    return np.concatenate([np.cos(angle), np.sin(angle)], axis=1).astype(np.float32)


def fp8_cache_shapes(mla: bool, kv_layout: str, pages: int, page_size: int, heads: int,
                     rope_dim: int, nope: int) -> tuple:  # fmt: skip
    """The two caches rope_quantize_fp8_append_paged_kv_cache writes: MLA (ckv, kpe), GQA
    (k, v) in NHD or HND."""
    if mla:
        return (pages, page_size, nope), (pages, page_size, rope_dim)
    if kv_layout == "NHD":
        return ((pages, page_size, heads, rope_dim + nope),) * 2
    return ((pages, heads, page_size, rope_dim + nope),) * 2
