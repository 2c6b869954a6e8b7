"""One dtype vocabulary (NumPy names) for every framework, and the CUDA C types behind it."""

from __future__ import annotations

import numpy as np

# name -> (CUDA C type, bytes). fp8 travels as uint8 storage plus this declared name.
CUDA_TYPES = {
    "float32": ("float", 4),
    "float16": ("half", 2),
    "bfloat16": ("__nv_bfloat16", 2),
    "float8_e4m3fn": ("__nv_fp8_e4m3", 1),
    "float8_e5m2": ("__nv_fp8_e5m2", 1),
    "int32": ("int32_t", 4),
    "int64": ("int64_t", 8),
    "uint8": ("uint8_t", 1),
}
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
_ALIASES = {"half": "float16", "float": "float32", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def normalize(dtype) -> str:
    """Canonical name of a dtype: a string, a NumPy/ml_dtypes/CuPy/JAX dtype or a torch dtype."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        return _ALIASES.get(name, name)
    text = str(dtype)
    if text.startswith("torch."):
        return normalize(text)
    return np.dtype(dtype).name


def numpy_dtype(name: str) -> np.dtype:
    """NumPy dtype for a canonical name (ml_dtypes for bfloat16 and fp8, imported only when
    such a dtype is first asked for: it takes longer to import than the rest of rtcinfer)."""
    if name in ("bfloat16", *FP8_DTYPES):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def cuda_type(name: str) -> str:
    try:
        return CUDA_TYPES[name][0]
    except KeyError:
        raise TypeError(f"dtype {name} has no CUDA kernel type") from None


def itemsize(name: str) -> int:
    return CUDA_TYPES[name][1] if name in CUDA_TYPES else numpy_dtype(name).itemsize
