"""The JAX side of call(): a signature's prepared launch as a jitted function, usable eagerly
and inside jax.jit. Where the launch can be recorded it becomes custom calls that XLA launches
itself (xla_launch: no Python at execution); otherwise an XLA FFI call of a Python handler (one
per signature and scalars, registered in jax_ffi) that launches on the device of XLA's
stream, its kernels loaded at trace time on every GPU JAX sees."""

from __future__ import annotations

import functools
import math

from .. import gpu, jit
from .arrays import check_device_array
from .call import _KINDS, _kind, _prepare, returned
from .dtypes import normalize, numpy_dtype
from .prepared import ArrayInfo, Op, Prepared, dense_strides


def _jax_info(x, name: str) -> ArrayInfo | None:
    if x is None:
        return None
    return ArrayInfo(tuple(x.shape), dense_strides(x.shape), normalize(x.dtype), 0)


def call_jax(op: Op, arrays, static, scalars):
    """call() of JAX arrays: a jitted FFI call of the prepared launch, traced or eager."""
    for i in op.given:
        if arrays[i] is not None:
            raise TypeError(f"{op.slots[i]}= is not supported for JAX arrays (they are immutable)")
    if op.jax_static is not None:
        static = op.jax_static(static)
    key = ["jax", op, static]
    for x, name in zip(arrays, op.slots, strict=True):
        if x is None:
            key.append(None)
            continue
        kind = _KINDS.get(type(x)) or _kind(x)
        if kind != "jax":
            check_device_array(x, name, kind)  # raises for host arrays and sequences
            raise TypeError(f"{name}: expected a JAX array like the other arguments, got {kind}")
        key.append((x.shape, x.dtype))
    key = tuple(key)
    prep = op.cache.get(key)
    if prep is None or isinstance(arrays[0], _tracer()):
        _check_on_gpu(op, arrays)
        prep = prep or _prepare(op, key, arrays, _jax_info, (), static)
    fn = prep._jax.get(scalars) if prep._jax is not None else None
    if fn is None:
        present = [x is not None for x in arrays]
        fn = _jax_callable(op, prep, present, scalars)
        if prep._jax is None:
            prep._jax = {}
        prep._jax[scalars] = fn
    try:
        return fn(*[x for x in arrays if x is not None])
    except Exception:
        # Where concrete arrays are is checked with a new signature only (it costs a microsecond
        # an array): arrays of a known signature off the GPU fail in XLA, which has no handler
        # for them there; say which argument it was.
        _check_on_gpu(op, arrays)
        raise


@functools.cache
def _tracer() -> type:
    import jax

    return jax.core.Tracer


def _check_on_gpu(op: Op, arrays) -> None:
    """TypeError naming the first JAX array that is not on a GPU (concrete, or traced for one):
    the FFI target exists for CUDA only, and XLA's own error would not say which argument."""
    for x, name in zip(arrays, op.slots, strict=True):
        if x is not None:
            check_device_array(x, name, "jax")


def _jax_callable(op: Op, prep: Prepared, present: list[bool], scalars: tuple):
    """A jitted function of the present inputs that runs `prep`: launched by XLA itself where
    the call can be recorded (xla_launch), else through the Python FFI target."""
    import jax

    from ..launch import memcpy_async, stream_device
    from . import jax_ffi, xla_launch
    from .dtypes import itemsize

    gpu.runtime()  # the checks of a first use (driver, CUDA extra, a device)
    if prep.on_trace is not None:
        prep.on_trace()
    shapes = [jax.ShapeDtypeStruct(o.shape, numpy_dtype(o.dtype)) for o in prep.outs]
    devices = _jax_gpu_ordinals()
    # a launch reading state that may change after tracing (command_buffer False) keeps the
    # handler, which reads that state at every execution
    if prep.command_buffer and len({jit.device_arch(d) for d in devices}) == 1:
        run = xla_launch.native_run(prep, present, scalars, devices[0], shapes,
                                    single=len(devices) == 1)  # fmt: skip
        if run is not None:  # XLA launches it: no handler, no Python at execution
            return jax.jit(lambda *args: returned(run(*args), prep.scratch))
    for device in devices:  # load now: never inside XLA's execution or capture
        prep.preload(device)
    slots = [i for i, p in enumerate(present) if p]
    n_slots = len(present)
    # (output, its input slot, bytes) of each output that updates an input in place
    in_place = [(j, o.source, itemsize(o.dtype) * math.prod(o.shape))
                for j, o in enumerate(prep.outs) if o.alias]  # fmt: skip

    def launch(stream: int, ins: list[int], outs: list[int]) -> None:
        ptrs = [0] * n_slots
        bits = 0
        for i, p in zip(slots, ins, strict=True):
            ptrs[i] = p
            bits |= p
        for p in outs:
            bits |= p
        if bits & 15:
            raise ValueError(_misaligned(op, ptrs, outs))
        if in_place:
            move_in_place_updates(in_place, ptrs, outs, stream, memcpy_async)
        ptrs += outs
        prep.run(stream, stream_device(stream), ptrs, scalars)  # the buffers' device

    handler = jax_ffi.add_launch_handler(launch)
    if prep._handlers is None:
        prep._handlers = []
    prep._handlers.append(handler)
    aliases = {slots.index(o.source): i for i, o in enumerate(prep.outs) if o.alias}
    cb = prep.command_buffer

    def run(*args):
        results = jax_ffi.ffi_call(handler, args, shapes, input_output_aliases=aliases or None,
                                   command_buffer=cb)  # fmt: skip
        return returned(list(results), prep.scratch)

    return jax.jit(run)


def _misaligned(op: Op, ptrs: list[int], outs: list[int]) -> str:
    """The error of a call XLA gave buffers off 16-byte boundaries, naming them."""
    bad = [n for n, p in zip(op.slots, ptrs, strict=True) if p & 15]
    bad += [f"output {j}" for j, p in enumerate(outs) if p & 15]
    return (
        f"{op.name}: XLA passed {', '.join(bad)} at an address not aligned to 16 bytes, which "
        "rtcinfer's kernels read in 16-byte vectors: inside jax.jit, XLA passes a slice of "
        "another array as a view at its offset; start such slices at multiples of 16 bytes"
    )


def move_in_place_updates(in_place, ptrs: list[int], outs: list[int], stream: int, copy) -> None:
    """Make each in-place update land in its output's buffer. `in_place`: (output, input
    slot, bytes) of each output declared as aliasing an input; `ptrs`: the input slots'
    addresses (changed here); `copy(dst, src, nbytes, stream)`: a stream-ordered copy.

    XLA may give an aliased output a buffer other than its input's (seen on the GPU inside
    jax.jit, for RoPE on the q and k of a one-token step sliced from one matmul output). The
    kernels update their input slot in place, so the input is first copied to the output's
    buffer and the slot pointed there: the caller's input is left as it was, the output holds
    the update."""
    for j, i, nbytes in in_place:
        if outs[j] != ptrs[i]:
            copy(outs[j], ptrs[i], nbytes, stream)
            ptrs[i] = outs[j]


def _jax_gpu_ordinals() -> list[int]:
    """The CUDA ordinals of the GPUs JAX sees in this process."""
    import jax

    return [getattr(d, "local_hardware_id", d.id) for d in jax.local_devices()
            if d.platform == "gpu"]  # fmt: skip


__all__ = ["call_jax", "move_in_place_updates"]
