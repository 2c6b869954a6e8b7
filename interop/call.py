"""Run one op on the caller's arrays and hand results back in the caller's framework.

An op is an `Op`: fixed input slots (an absent optional input is None) and a `prepare`
function that validates one call signature and returns a `Prepared` launch. `call` reads each
array once, straight from its framework object (PyTorch: `data_ptr()`, `shape`, `stride()`,
`dtype`; CuPy: `.data.ptr`, `shape`, `strides`, `dtype`), keys the prepared launch on the
signature (shapes, strides, dtypes, devices, the pointers' common alignment, the op's static
arguments), allocates the outputs with the caller's framework and launches on the caller's
current stream. Only a new signature pays for validation, kernel choice and geometry; one
that differs from a prepared one only in its row count (an op's `rows` slots: the norms,
activations, RoPE, the paged append and RoPE with fp8 outputs) is made from it
(prepared.with_rows).

JAX arrays, eager or traced inside `jax.jit`, are prepared when the call is traced: a launch
that reads only the call's own arrays becomes custom calls XLA launches itself (xla_launch),
any other goes through the XLA FFI target (jax_ffi), whose handler XLA runs with the buffers'
pointers and its stream. An output that aliases input `j` updates that input in place
(PyTorch, CuPy) or returns its new value (JAX, donatable). Other producers of `__dlpack__`
are taken as CuPy arrays. Lists and tuples, host arrays and arrays off the GPU are refused
with the name of their slot, before any shape or dtype is checked.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Sequence

from .. import gpu
from .arrays import CUPY_NDARRAY, TORCH_TENSOR, as_cupy, framework
from .dtypes import normalize, numpy_dtype
from .prepared import (
    ArrayInfo,
    Op,
    OutSlot,
    Prepared,
    common_align,
    dense_strides,
    no_launch,
    with_rows,
)

# The most call signatures an op keeps prepared (and their shortcuts); past it the cache is
# emptied: a long-running server whose steps bring ever new token counts holds a bounded
# number of launches, and a working set of signatures is prepared again as it recurs.
MAX_SIGNATURES = 4096


class _Local(threading.local):
    """Per thread: `stream`, a CUDA stream handle that launches go to instead of the caller's
    current stream, while nonzero (launching_on; rtcinfer/attention/side_stream.py). A class
    default, not getattr's: a missing thread-local attribute costs a caught AttributeError."""

    stream = 0


_LOCAL = _Local()


class launching_on:
    """Launch the calls of the block on CUDA stream `stream` (a handle) instead of the caller's
    current stream. The calls must allocate no output (give `out=`): the caller's allocator
    would hand out memory ordered on its own stream only, so a call that would allocate raises."""

    __slots__ = ("stream", "previous")

    def __init__(self, stream: int):
        self.stream, self.previous = stream, 0

    def __enter__(self):
        self.previous = _LOCAL.stream
        _LOCAL.stream = self.stream

    def __exit__(self, *exc):
        _LOCAL.stream = self.previous


def _unallocated(op: Op) -> RuntimeError:
    return RuntimeError(
        f"{op.name}: a call launched on another stream (launching_on) must be given its outputs"
    )


def call(op: Op, arrays: Sequence, static: tuple = (), scalars: tuple = ()):
    """Launch `op` on `arrays` (one per slot; None for absent ones); returns the outputs (one
    or a tuple) in the caller's array type. `static` is part of the launch's key; `scalars`
    are passed to each launch as they are."""
    first = arrays[0]
    kind = _KINDS.get(type(first)) or _kind(first)
    if kind == "torch":
        return _call_torch(op, arrays, static, scalars)
    if kind == "cupy":
        return _call_cupy(op, arrays, static, scalars)
    if kind == "jax":
        return _jax_path()(op, arrays, static, scalars)
    views = [None if x is None else as_cupy(x, n) for x, n in zip(arrays, op.slots, strict=True)]
    return _call_cupy(op, views, static, scalars)


@functools.cache
def _jax_path():
    """The JAX call path (interop/call_jax.py), imported by the first JAX call."""
    from .call_jax import call_jax

    return call_jax


# ---------------------------------------------------------------- framework detection

_KINDS: dict[type, str] = {}


def _kind(x) -> str:
    kind = framework(x)
    _KINDS[type(x)] = kind
    return kind


def _prepare(op: Op, key: tuple, arrays, info, ptrs: list[int], static: tuple) -> Prepared:
    """The prepared launch of a new signature: `info(array, name)` describes each array and
    `ptrs` holds their addresses (0 for absent slots); host memory and mixed devices are
    refused by name before the op's own checks. A signature that differs from a prepared one
    only in the leading dim of the op's row slots (a new token count) is made from it
    (prepared.with_rows). JAX keys are left out: a JAX call of a new shape is traced and
    compiled anew, which costs far more than the validation saved."""
    free, rows = _row_free(key, op.rows) if op.rows and key[0] is op else (None, 0)
    if free is not None:
        model = op.cache.get(free)
        if model is not None:
            return _kept(op, key, with_rows(model, rows, op.rows))
    infos = [info(x, name) for x, name in zip(arrays, op.slots, strict=True)]
    for name, seen in zip(op.slots, infos, strict=True):
        if seen is not None and seen.device < 0:
            raise TypeError(
                f"{name}: expected a CUDA array (CuPy, PyTorch or JAX), got host memory of "
                f"shape {seen.shape}; move it to the GPU first"
            )
    devices = {n: i.device for n, i in zip(op.slots, infos, strict=True) if i is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"arrays are on different devices: {devices}")
    runtime = gpu.runtime()  # a missing driver or CUDA extra is named before the op runs
    bits = 0
    for p in ptrs:
        bits |= p
    prep = op.prepare(infos, common_align(bits), static)
    prep.outs = tuple(_with_like(slot, infos) for slot in prep.outs)
    prep.one_device = runtime.getDeviceCount() == 1
    if free is not None and prep.rows == rows:  # the model of its other row counts
        _kept(op, free, prep)
    return _kept(op, key, prep)


def seen_before(op: Op, key: tuple) -> bool:
    """Whether the signature `key` was noted before; notes it if not (the shortcut learns a
    signature at its second sighting, interop/shortcut.py). A note is op.cache's entry of the
    key's hash (an int) to (): nothing the garbage collector tracks, where the key's tuples
    would be (each new token count of a prefill step is a signature seen once or a layer's
    count of times)."""
    h = hash(key)
    if h in op.cache:
        return True
    _kept(op, h, ())
    return False


def _kept(op: Op, key, prep):
    """op.cache's entry for `key`, `prep` unless another thread kept one first (a prepared
    call, or a note of seen_before)."""
    with op._lock:
        if len(op.cache) >= MAX_SIGNATURES:  # a server's ever-new token counts: start over
            op.cache.clear()
        return op.cache.setdefault(key, prep)


class _Rows:
    """The first element of a row-free key (an op's signature but for its row count)."""

    __slots__ = ()


_ROWS = _Rows()


def _row_free(key: tuple, row_slots: tuple[int, ...]) -> tuple[tuple | None, int]:
    """(the key with the leading dim of every row slot left out, that dim), or (None, 0) where
    the row slots disagree on it or it is below 2 (one row: its strides read differently)."""
    parts, rows = [_ROWS, *key[1:]], 0
    for i in row_slots:
        attrs = parts[2 + i]
        if attrs is None:
            continue
        shape = attrs[0]
        if not shape or shape[0] < 2 or (rows and shape[0] != rows):
            return None, 0
        rows = shape[0]
        parts[2 + i] = (tuple(shape[1:]), *attrs[1:])
    return (tuple(parts), rows) if rows else (None, 0)


def _with_like(slot: OutSlot, infos) -> OutSlot:
    if slot.source is not None:
        return slot
    for i, info in enumerate(infos):
        if info is not None and info.shape == slot.shape and info.dtype == slot.dtype:
            if info.contiguous and info.size:
                return OutSlot(slot.shape, slot.dtype, slot.source, slot.alias, i)
    return slot


# ---------------------------------------------------------------- PyTorch


@functools.cache
def _torch():
    torch = sys.modules["torch"]
    TORCH_TENSOR[1] = torch.compiler.is_compiling
    TORCH_TENSOR[0] = torch.Tensor
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    stream = raw or (lambda device: torch.cuda.current_stream(device).cuda_stream)
    return torch, torch.Tensor, stream, torch.empty_like


_TORCH_DTYPES: dict[str, object] = {}


def _torch_dtype(name: str):
    dtype = _TORCH_DTYPES.get(name)
    if dtype is None:
        dtype = _TORCH_DTYPES[name] = getattr(sys.modules["torch"], name)
    return dtype


def _torch_info(x, name: str) -> ArrayInfo | None:
    if x is None:
        return None
    if not x.is_cuda:
        raise TypeError(f"{name}: expected a CUDA tensor, got a torch.Tensor on {x.device}")
    return ArrayInfo(tuple(x.shape), tuple(x.stride()), normalize(x.dtype), x.get_device(),
                     x.data_ptr() & 15)  # fmt: skip


def torch_call_key(op: Op, arrays, static) -> tuple:
    """The key under which call() holds the prepared launch of `op` on these PyTorch tensors
    (None for absent slots): what _call_torch builds inline (interop/shortcut.py reads it)."""
    return (op, static, *(None if x is None else
                          (x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15)
                          for x in arrays))  # fmt: skip


def _call_torch(op: Op, arrays, static, scalars):
    torch, tensor, raw_stream, empty_like = _torch()
    key, ptrs = [op, static], []  # torch_call_key's, built with the pointers in one pass
    for x in arrays:
        if x is None:
            key.append(None)
            ptrs.append(0)
        elif type(x) is tensor or isinstance(x, tensor):
            p = x.data_ptr()
            key.append((x.shape, x.stride(), x.dtype, x.get_device(), p & 15))
            ptrs.append(p)
        else:
            return _mixed(op, arrays, static, scalars)
    key = tuple(key)
    prep = op.cache.get(key) or _prepare(op, key, arrays, _torch_info, ptrs, static)
    stream = _LOCAL.stream
    if prep.dense:
        arrays, ptrs = _densify_torch(op, prep, arrays, ptrs, stream)
    first = arrays[0]
    device = key[2][3]  # the first slot's (never absent)
    results = []
    for slot in prep.outs:
        if slot.source is not None:
            ptrs.append(ptrs[slot.source])
            results.append(arrays[slot.source])
            continue
        if stream:
            raise _unallocated(op)
        if slot.like is not None:
            t = empty_like(arrays[slot.like])
        elif slot.shape:  # the sizes as arguments: PyTorch parses them faster than a tuple
            t = torch.empty(*slot.shape, dtype=_torch_dtype(slot.dtype), device=first.device)
        else:
            t = torch.empty((), dtype=_torch_dtype(slot.dtype), device=first.device)
        ptrs.append(t.data_ptr())
        results.append(t)
    if prep.one_device or gpu.runtime().getDevice() == device:
        prep.run(stream or raw_stream(device), device, ptrs, scalars)
    else:
        with _on_device(device):
            prep.run(stream or raw_stream(device), device, ptrs, scalars)
    if prep.scratch:
        del results[-prep.scratch :]
    return results[0] if len(results) == 1 else tuple(results)


def _densify_torch(op: Op, prep: Prepared, arrays, ptrs, stream: int):
    arrays, ptrs = list(arrays), list(ptrs)
    for i in prep.dense:
        x = arrays[i]
        if x is not None and not x.is_contiguous():
            if stream:  # launching_on: the copy would be ordered on another stream
                raise _unallocated(op)
            arrays[i] = x.contiguous()
            ptrs[i] = arrays[i].data_ptr()
    return arrays, ptrs


# ---------------------------------------------------------------- CuPy


@functools.cache
def _cupy():
    import cupy

    CUPY_NDARRAY[0] = cupy.ndarray
    return cupy, cupy.ndarray, cupy.cuda.get_current_stream


def _cupy_info(x, name: str) -> ArrayInfo | None:
    if x is None:
        return None
    item, data = x.itemsize, x.data
    # an empty array addresses nothing; CuPy may give it zero strides, so it gets dense ones
    strides = tuple(s // item for s in x.strides) if x.size else dense_strides(x.shape)
    return ArrayInfo(tuple(x.shape), strides, normalize(x.dtype), data.device_id, data.ptr & 15)


def cupy_call_key(op: Op, arrays, static) -> tuple:
    """The key under which call() holds the prepared launch of `op` on these CuPy arrays
    (None for absent slots): what _call_cupy builds inline (interop/shortcut.py reads it)."""
    return (op, static, *(None if x is None else
                          (x.shape, x.strides, x.dtype, x.data.device_id, x.data.ptr & 15)
                          for x in arrays))  # fmt: skip


def _call_cupy(op: Op, arrays, static, scalars):
    ndarray = _cupy()[1]
    key, ptrs = [op, static], []  # cupy_call_key's, built with the pointers in one pass
    for x in arrays:
        if x is None:
            key.append(None)
            ptrs.append(0)
        elif type(x) is ndarray:
            data = x.data
            p = data.ptr
            key.append((x.shape, x.strides, x.dtype, data.device_id, p & 15))
            ptrs.append(p)
        else:
            return _mixed(op, arrays, static, scalars)
    key = tuple(key)
    prep = op.cache.get(key) or _prepare(op, key, arrays, _cupy_info, ptrs, static)
    device = key[2][3]  # the first slot's (never absent)
    if prep.one_device:
        return _run_cupy(op, prep, arrays, ptrs, device, scalars)
    with _on_device(device):
        return _run_cupy(op, prep, arrays, ptrs, device, scalars)


def _run_cupy(op: Op, prep: Prepared, arrays, ptrs: list[int], device: int, scalars):
    """The launch of a CuPy call, `device` current: outputs allocated there, then the run."""
    ndarray, current_stream = _cupy()[1:]
    stream = _LOCAL.stream
    if prep.dense:
        arrays, ptrs = _densify_cupy(op, prep, arrays, ptrs, stream)
    results = []
    for slot in prep.outs:
        if slot.source is not None:
            ptrs.append(ptrs[slot.source])
            results.append(arrays[slot.source])
            continue
        if stream:
            raise _unallocated(op)
        if slot.like is not None:  # a C-contiguous array of its shape and dtype, as empty_like
            like = arrays[slot.like]  # makes of one but without its layout logic
            a = ndarray(like.shape, like.dtype)
        else:
            a = ndarray(slot.shape, storage_dtype(slot.dtype))
        ptrs.append(a.data.ptr)
        results.append(a)
    prep.run(stream or current_stream().ptr, device, ptrs, scalars)
    return returned(results, prep.scratch)


def caller_stream(x) -> tuple[int, int]:
    """(device, the current stream handle there) of a PyTorch or CuPy array's framework: the
    stream a call on x launches on (outside launching_on)."""
    if (_KINDS.get(type(x)) or _kind(x)) == "torch":
        device = x.get_device()
        return device, _torch()[2](device)
    return x.data.device_id, _cupy()[2]().ptr


def returned(results: list, scratch: int):
    """What a call returns of its outputs: all but the last `scratch`, one bare, else a tuple."""
    if scratch:
        del results[-scratch:]
    return results[0] if len(results) == 1 else tuple(results)


def storage_dtype(name: str):
    """The NumPy dtype of a new CuPy array of dtype `name` (fp8: its bytes, uint8)."""
    return numpy_dtype("uint8" if name.startswith("float8") else name)


def _densify_cupy(op: Op, prep: Prepared, arrays, ptrs, stream: int):
    cupy = _cupy()[0]
    arrays, ptrs = list(arrays), list(ptrs)
    for i in prep.dense:
        x = arrays[i]
        if x is not None and not x.flags.c_contiguous:
            if stream:  # launching_on: the copy would be ordered on another stream
                raise _unallocated(op)
            if cupy.cuda.get_current_stream().is_capturing():  # a copy would not outlive it
                raise ValueError(
                    f"a strided array cannot be made dense inside a CUDA-graph capture; pass "
                    f"a contiguous one (strides {x.strides})"
                )
            arrays[i] = cupy.ascontiguousarray(x)
            ptrs[i] = arrays[i].data.ptr
    return arrays, ptrs


# ---------------------------------------------------------------- devices and mixed inputs


class _on_device:
    """Makes `device` current for the block when it is not, and restores the previous one."""

    __slots__ = ("device", "previous")

    def __init__(self, device: int):
        self.device, self.previous = device, None

    def __enter__(self):
        runtime = gpu.runtime()
        current = runtime.getDevice()
        if current != self.device:
            self.previous = current
            runtime.setDevice(self.device)

    def __exit__(self, *exc):
        if self.previous is not None:
            gpu.runtime().setDevice(self.previous)


def _mixed(op: Op, arrays, static, scalars):
    """Arrays of several frameworks in one call: host arrays and unknown objects raise by name;
    CUDA arrays of another framework are taken as views of the first one's kind."""
    first_kind = _KINDS.get(type(arrays[0])) or _kind(arrays[0])
    converted = []
    for x, name in zip(arrays, op.slots, strict=True):
        if x is None or framework(x) == first_kind:
            converted.append(x)
            continue
        view = as_cupy(x, name)  # raises the TypeError that names a host array
        if first_kind == "torch":
            view = sys.modules["torch"].from_dlpack(view)
        converted.append(view)
    if first_kind == "torch":
        return _call_torch(op, converted, static, scalars)
    return _call_cupy(op, converted, static, scalars)


def release(op: Op) -> None:
    """Forget `op`'s prepared launches and unregister their JAX handlers (a compiled JAX
    computation still using one raises when it runs)."""
    with op._lock:
        entries, op.cache = list(op.cache.values()), {}
    preps = [p for p in entries if isinstance(p, Prepared)]  # not the shortcuts' launches
    if not any(p._handlers for p in preps):
        return
    from . import jax_ffi

    for prep in preps:
        for handler in prep._handlers or ():
            jax_ffi.remove_handler(handler)


__all__ = [
    "ArrayInfo",
    "Op",
    "OutSlot",
    "Prepared",
    "call",
    "caller_stream",
    "dense_strides",
    "no_launch",
    "launching_on",
    "release",
]
