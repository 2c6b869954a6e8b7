"""Run one op on the caller's arrays and hand results back in the caller's framework.

Every op is a `launch(stream, ins, outs, **params)` over CuPy views. `run` builds those views:
for PyTorch and CuPy inputs directly (outputs allocated by the caller's framework, launch on
its current stream); for JAX inputs, eager or traced inside `jax.jit`, through the XLA FFI
target, which calls the same `launch` on XLA's stream. An output that aliases input `j`
updates that input in place (PyTorch, CuPy) or returns its new value (JAX, donatable).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .arrays import (
    as_cupy,
    current_stream,
    device_of,
    dtype_name,
    empty,
    framework,
    stream_from_ptr,
)
from .dtypes import numpy_dtype


@dataclass(frozen=True)
class Out:
    """One output: shape and dtype, plus the caller's `out=` array or the input it updates."""

    shape: tuple[int, ...]
    dtype: str
    given: object = None
    alias: int | None = None


def run(launch: Callable, inputs: Sequence[tuple[str, object]], outputs: Sequence[Out], **params):
    """Launch on (name, array) inputs; returns the outputs (one or a tuple) in the caller's type."""
    first = inputs[0][1]
    if framework(first) == "jax":
        return _run_jax(launch, inputs, outputs, params)
    device = _common_device(inputs, outputs)
    import cupy

    with cupy.cuda.Device(device), current_stream(first) as stream:
        ins = [as_cupy(x, name) for name, x in inputs]
        natives, outs = [], []
        for i, out in enumerate(outputs):
            if out.alias is not None:
                native, arr = inputs[out.alias][1], ins[out.alias]
            elif out.given is not None:
                native = out.given
                _check_out(native, out, "out" if len(outputs) == 1 else f"out[{i}]")
                arr = as_cupy(native, "out")
            else:
                native = empty(first, out.shape, out.dtype)
                arr = native if framework(native) == "cupy" else as_cupy(native, "out")
            natives.append(native)
            outs.append(arr)
        launch(stream, ins, outs, **params)
    return natives[0] if len(natives) == 1 else tuple(natives)


def _common_device(inputs, outputs) -> int:
    """The one CUDA device of every array; host arrays and mixed devices raise, by name."""
    arrays = list(inputs) + [
        (f"out[{i}]", o.given) for i, o in enumerate(outputs) if o.given is not None
    ]
    devices = {}
    for name, x in arrays:
        devices[name] = device_of(x)
        if devices[name] < 0:
            as_cupy(x, name)  # raises the TypeError that names the argument
    if len(set(devices.values())) > 1:
        raise ValueError(f"arrays are on different devices: {devices}")
    return devices[inputs[0][0]]


def _check_out(native, out: Out, name: str) -> None:
    shape, dtype = tuple(native.shape), dtype_name(native)
    if shape != tuple(out.shape) or dtype != out.dtype:
        raise ValueError(
            f"{name}: expected shape {tuple(out.shape)} and dtype {out.dtype}, "
            f"got shape {shape} and dtype {dtype}"
        )


def _run_jax(launch, inputs, outputs, params):
    import jax

    from . import jax_ffi

    if any(out.given is not None for out in outputs):
        raise TypeError("out= is not supported for JAX arrays (they are immutable)")
    if "spec" in params:  # XLA buffers are dense and aligned: this spec is the one launched
        from rtcinfer import jit

        jit.preload(params["spec"])
    handler = _jax_handler(launch, tuple(sorted(params.items())))
    shapes = [jax.ShapeDtypeStruct(o.shape, numpy_dtype(o.dtype)) for o in outputs]
    aliases = {o.alias: i for i, o in enumerate(outputs) if o.alias is not None}
    results = jax_ffi.ffi_call(
        handler, [x for _, x in inputs], shapes, input_output_aliases=aliases or None
    )
    return results[0] if len(results) == 1 else tuple(results)


@functools.cache
def _jax_handler(launch, params: tuple) -> int:
    """One FFI handler id per (launch, static params), reused by every trace."""
    from . import jax_ffi

    kwargs = dict(params)

    def handler(stream_ptr: int, ins, outs) -> None:
        stream = stream_from_ptr(stream_ptr)
        launch(stream, [_view(b) for b in ins], [_view(b) for b in outs], **kwargs)

    return jax_ffi.add_handler(handler)


def _view(buf):
    """CuPy array over an XLA buffer (dense row-major); fp8 as uint8 storage."""
    import cupy

    dtype = numpy_dtype("uint8" if buf.dtype.startswith("float8") else buf.dtype)
    size = dtype.itemsize
    for n in buf.shape:
        size *= n
    # An empty buffer may come as a null pointer, whose device CuPy cannot look up.
    device = cupy.cuda.runtime.getDevice() if buf.ptr == 0 else -1
    memory = cupy.cuda.UnownedMemory(buf.ptr, size, None, device)
    return cupy.ndarray(buf.shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))
