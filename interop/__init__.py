"""Tensors in and out: DLPack from PyTorch, JAX and CuPy, dtype names, streams, JAX FFI."""

from .arrays import as_cupy, device_of, dtype_name, framework
from .call import Out, run

__all__ = ["Out", "as_cupy", "device_of", "dtype_name", "framework", "run"]
