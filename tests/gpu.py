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
