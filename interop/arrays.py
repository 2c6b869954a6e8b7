"""DLPack in and out without importing a framework the caller did not use.

Inputs become CuPy views (zero-copy); fp8 tensors become uint8 views with their name kept by
`dtype_name`. Outputs are allocated by the caller's framework (its allocator, its device), so
torch in gives torch out and CuPy in gives CuPy out.
"""

from __future__ import annotations

import sys

from .dtypes import FP8_DTYPES, normalize, numpy_dtype


def framework(x) -> str:
    """ "torch", "jax", "cupy", "numpy" or "dlpack" (anything else exporting __dlpack__)."""
    module = type(x).__module__.partition(".")[0]
    if module in ("torch", "jax", "jaxlib", "cupy", "numpy"):
        return "jax" if module == "jaxlib" else module
    return "dlpack"


def dtype_name(x) -> str:
    """Canonical dtype name of an array of any framework ("bfloat16", "float8_e4m3fn", ...)."""
    return normalize(x.dtype)


def dense(x, name: str, output: bool = False):
    """A CuPy array `x` as a C-contiguous one, for a kernel that takes it as a bare pointer:
    an input is copied when it is not (on the current stream), an output raises."""
    if x is None or x.flags.c_contiguous:
        return x
    if output:
        raise ValueError(f"{name}: must be contiguous (written densely), got strides {x.strides}")
    import cupy

    if cupy.cuda.get_current_stream().is_capturing():  # a copy's buffer would not outlive it
        raise ValueError(
            f"{name}: a strided array cannot be made dense inside a CUDA-graph capture; pass "
            f"a contiguous one (strides {x.strides})"
        )
    return cupy.ascontiguousarray(x)


def _describe(x) -> str:
    shape = tuple(getattr(x, "shape", ()))
    return f"{type(x).__module__}.{type(x).__qualname__} of shape {shape}"


def as_cupy(x, name: str):
    """Zero-copy CuPy view of a CUDA array from any framework; host arrays raise TypeError."""
    import cupy

    fw = framework(x)
    if fw == "cupy":
        return x
    if fw == "numpy":
        raise TypeError(
            f"{name}: expected a CUDA array (CuPy, PyTorch or JAX), got a host numpy.ndarray "
            f"of shape {x.shape}; move it to the GPU first"
        )
    if fw == "torch":
        if x.device.type != "cuda":
            raise TypeError(f"{name}: expected a CUDA tensor, got a torch.Tensor on {x.device}")
        if dtype_name(x) in FP8_DTYPES:
            x = x.view(sys.modules["torch"].uint8)
    elif fw == "jax":
        devices = {d.platform for d in x.devices()}
        if devices != {"gpu"}:
            raise TypeError(f"{name}: expected a JAX array on a GPU, got one on {devices}")
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"{name}: expected a CUDA array with __dlpack__, got {_describe(x)}")
    try:
        return cupy.from_dlpack(x)
    except (TypeError, ValueError, BufferError, RuntimeError) as e:
        raise TypeError(f"{name}: cannot take {_describe(x)} as a CUDA array: {e}") from e


def device_of(x) -> int:
    """CUDA device ordinal of an array of any framework (without conversion)."""
    fw = framework(x)
    if fw == "torch":
        return x.device.index if x.device.type == "cuda" else -1
    if fw == "cupy":
        return x.device.id
    if fw == "jax":
        return next(iter(x.devices())).id
    if hasattr(x, "__dlpack_device__"):
        kind, index = x.__dlpack_device__()
        return int(index) if int(kind) in (2, 3, 13) else -1  # CUDA, CUDA host, CUDA managed
    return -1


def empty(like, shape: tuple[int, ...], dtype: str):
    """A new array on `like`'s device, allocated by `like`'s framework (torch or CuPy)."""
    if framework(like) == "torch":
        torch = sys.modules["torch"]
        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    import cupy

    with cupy.cuda.Device(like.device.id):
        return cupy.empty(shape, dtype=numpy_dtype(dtype))


def current_stream(like):
    """The stream to launch on: the producer framework's current stream, as a CuPy stream."""
    import cupy

    if framework(like) == "torch":
        torch = sys.modules["torch"]
        return stream_from_ptr(torch.cuda.current_stream(like.device).cuda_stream)
    return cupy.cuda.get_current_stream()


class _StreamHandle:
    """A raw cudaStream_t seen through the CUDA stream protocol."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def stream_from_ptr(ptr: int):
    """A CuPy stream object for a stream some other library created (no ownership)."""
    import cupy

    return cupy.cuda.Stream.from_external(_StreamHandle(ptr))


def to_numpy(x):
    """A host NumPy array of any array or sequence; device arrays cost one device-to-host copy."""
    import numpy as np

    fw = framework(x)
    if fw == "torch":
        return x.detach().cpu().numpy()
    if fw == "cupy":
        return x.get()
    return np.asarray(x)


def to_device(like, host):
    """A device copy of NumPy array `host` in `like`'s framework, on `like`'s device."""
    fw = framework(like)
    if fw == "torch":
        torch = sys.modules["torch"]
        return torch.from_numpy(host).to(like.device)
    if fw == "jax":  # a constant when traced inside jax.jit
        import jax.numpy as jnp

        return jnp.asarray(host)
    import cupy

    with cupy.cuda.Device(device_of(like)):
        return cupy.asarray(host)
