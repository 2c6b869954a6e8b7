"""Arrays in and out: PyTorch, JAX and CuPy arrays read directly, dtype names, streams; JAX
calls as XLA launches (xla_launch) or an FFI handler (jax_ffi)."""

from .arrays import as_cupy, device_of, dtype_name, framework
from .call import call, release
from .fill import Fill
from .prepared import (
    ArrayInfo,
    Op,
    OutSlot,
    Planned,
    Prepared,
    dense_strides,
    no_launch,
    one_launch,
    row_count,
)

__all__ = [
    "ArrayInfo",
    "Fill",
    "Op",
    "OutSlot",
    "Planned",
    "Prepared",
    "as_cupy",
    "call",
    "dense_strides",
    "device_of",
    "dtype_name",
    "framework",
    "no_launch",
    "one_launch",
    "release",
    "row_count",
]
