"""Call Python kernel launchers from inside ``jax.jit`` through XLA's typed FFI, with no C++.

One XLA FFI target per platform (``rtcinfer_cuda`` for XLA platform "CUDA", ``rtcinfer_cpu``
for "cpu") is a ``ctypes.CFUNCTYPE`` callback registered with ``jax.ffi.register_ffi_target``.
XLA calls it with a pointer to an ``XLA_FFI_CallFrame`` (``xla/ffi/api/c_api.h``):

1. Metadata query. At registration XLA calls the target once with ``api == NULL`` and an
   ``XLA_FFI_Metadata_Extension`` in ``extension_start``. We fill in the FFI API version and
   the traits (``COMMAND_BUFFER_COMPATIBLE`` for CUDA, which lets XLA capture the call into a
   CUDA graph) and return without running any handler.
2. Execution. Only the EXECUTE stage runs a handler (the bundle registered by JAX has no other
   stage). The int64 attribute ``handler`` picks a Python function from the table filled by
   :func:`add_handler`; it is called as ``fn(stream, inputs, outputs)`` where ``stream`` comes
   from ``XLA_FFI_Stream_Get`` on CUDA (a ``cudaStream_t`` as int) and is 0 on CPU, and inputs
   and outputs are :class:`BufferView` s (dense, row-major).
3. Errors. An exception in the handler, an unknown handler id or an unsupported buffer becomes
   an ``XLA_FFI_Error`` made with ``XLA_FFI_Error_Create``; JAX raises it as a Python exception.

Handler contract on CUDA: only enqueue work on ``stream``; never synchronize, allocate with a
blocking call, or read device data on the host. Under command-buffer capture XLA may call the
handler once while recording a CUDA graph and then replay the graph without calling Python
again, so the launches must depend only on the shapes, dtypes, pointers and the handler itself.

Struct sizes: XLA versions its C API by ``struct_size``; every struct read here is checked to be
at least as large as the prefix this module knows before its fields are used.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .jax_ffi_abi import (
    _API_VERSION,
    _ATTR_SCALAR,
    _ATTR_STRING,
    _BUFFER,
    _COMMAND_BUFFER_COMPATIBLE,
    _EXTENSION_METADATA,
    _INTERNAL,
    _INVALID_ARGUMENT,
    _SCALAR_CTYPES,
    _STAGE_EXECUTE,
    DTYPE_NAMES,
    _Api,
    _ApiVersion,
    _Attrs,
    _Buffer,
    _ByteSpan,
    _CallFrame,
    _end,
    _ErrorCreateArgs,
    _ErrorCreateFn,
    _List,
    _Metadata,
    _MetadataExtension,
    _Scalar,
    _StreamGetArgs,
    _StreamGetFn,
    _TargetFn,
)

if TYPE_CHECKING:  # pragma: no cover
    import jax

__all__ = [
    "BufferView",
    "DTYPE_NAMES",
    "Handler",
    "add_handler",
    "add_launch_handler",
    "ffi_call",
    "remove_handler",
    "target_name",
]


@dataclass(frozen=True)
class BufferView:
    """One XLA buffer as the handler sees it: address, shape and numpy-style dtype name."""

    ptr: int  # may be 0 for an empty buffer
    shape: tuple[int, ...]
    dtype: str


Handler = Callable[[int, list[BufferView], list[BufferView]], None]


class _FfiError(Exception):
    """A failure reported to XLA with a specific error code."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class _PassThrough(Exception):
    """Carries an ``XLA_FFI_Error*`` (``args[0]``) that an XLA API call returned back to XLA."""


# ---------------------------------------------------------------- handler table

_lock = threading.Lock()
_handlers: dict[int, tuple[Callable, bool]] = {}  # id -> (fn, whether it takes bare pointers)
_ids: dict[object, int] = {}
_next_id = 1


def _key(fn: object) -> object:
    try:
        hash(fn)
    except TypeError:
        return ("unhashable", id(fn))  # the table keeps fn alive, so its id is never reused
    return fn


def _add(fn: object, pointers: bool) -> int:
    global _next_id
    if not callable(fn):
        raise TypeError(f"handler must be callable, got {type(fn).__name__}")
    with _lock:
        key = (_key(fn), pointers)
        handler_id = _ids.get(key)
        if handler_id is None:
            handler_id = _next_id
            _next_id += 1
            _handlers[handler_id] = (fn, pointers)
            _ids[key] = handler_id
        return handler_id


def add_handler(fn: Handler) -> int:
    """Registers ``fn`` in the process-wide table and returns its id (stable for the same fn).

    ``fn(stream_ptr, inputs, outputs)`` must launch its work on ``stream_ptr`` and not block;
    inputs and outputs are BufferViews. Handlers stay registered until removed.
    """
    return _add(fn, pointers=False)


def add_launch_handler(fn: Callable[[int, list, list], None]) -> int:
    """Like add_handler, for the hot path: ``fn(stream_ptr, in_ptrs, out_ptrs)`` gets the
    buffers' device addresses only (ints; their shapes and dtypes were fixed at trace time)."""
    return _add(fn, pointers=True)


def remove_handler(handler_id: int) -> None:
    """Forgets a handler (a later call of a computation that uses it raises)."""
    with _lock:
        entry = _handlers.pop(handler_id, None)
        if entry is not None:
            _ids.pop((_key(entry[0]), entry[1]), None)


# ---------------------------------------------------------------- call frame decoding


def _decode_attrs(attrs: _Attrs) -> dict[str, object]:
    """Scalar and string attributes by name (arrays and dictionaries are skipped)."""
    out: dict[str, object] = {}
    for i in range(attrs.size):
        span = attrs.names[i].contents
        name = ctypes.string_at(span.ptr, span.len).decode()
        kind, addr = attrs.types[i], attrs.attrs[i]
        if kind == _ATTR_SCALAR:
            scalar = _Scalar.from_address(addr)
            ctype = _SCALAR_CTYPES.get(scalar.dtype)
            if ctype is not None:
                out[name] = ctype.from_address(scalar.value).value
        elif kind == _ATTR_STRING:
            text = _ByteSpan.from_address(addr)
            out[name] = ctypes.string_at(text.ptr, text.len).decode()
    return out


def _buffers(items: _List, what: str) -> list[BufferView]:
    views = []
    for i in range(items.size):
        if items.types[i] != _BUFFER:
            raise _FfiError(_INVALID_ARGUMENT, f"{what} {i} is not a buffer")
        buf = _Buffer.from_address(items.items[i])
        if buf.struct_size < _end(_Buffer, "dims"):
            raise _FfiError(_INVALID_ARGUMENT, f"{what} {i}: XLA_FFI_Buffer is too small")
        dtype = DTYPE_NAMES.get(buf.dtype)
        if dtype is None:
            raise _FfiError(_INVALID_ARGUMENT, f"{what} {i}: unsupported XLA dtype {buf.dtype}")
        shape = tuple(buf.dims[: buf.rank]) if buf.rank > 0 else ()
        views.append(BufferView(ptr=buf.data or 0, shape=shape, dtype=dtype))
    return views


_DATA = _Buffer.data.offset
_u64 = ctypes.c_uint64.from_address
_i64 = ctypes.c_int64.from_address
_i32 = ctypes.c_int32.from_address


def _field(*path: str) -> int:
    """Byte offset of a (nested) field of XLA_FFI_CallFrame."""
    struct, at = _CallFrame, 0
    for name in path:
        desc = getattr(struct, name)
        at += desc.offset
        struct = dict(struct._fields_)[name]
    return at


# The hot path reads a call frame's header as 8-byte words in place (a ctypes array over it:
# indexing reads one word, far cheaper than copying the header out) and picks these words.
_HEADER_WORDS = _field("attrs") // 8 + 6  # up to the end of attrs.attrs
_Header = ctypes.c_uint64 * _HEADER_WORDS
_W = {name: _field(*name.split(".")) // 8 for name in (
    "extension_start", "api", "ctx", "stage", "args.size", "args.items", "rets.size",
    "rets.items", "attrs.size", "attrs.types", "attrs.attrs")}  # fmt: skip
_W_EXT, _W_API, _W_CTX, _W_STAGE = (_W[k] for k in ("extension_start", "api", "ctx", "stage"))
_W_ARGS = (_W["args.size"], _W["args.items"])
_W_RETS = (_W["rets.size"], _W["rets.items"])
_W_ATTRS = (_W["attrs.size"], _W["attrs.types"], _W["attrs.attrs"])
_SCALAR_VALUE = _Scalar.value.offset  # XLA_FFI_Scalar: dtype, then the value's address


def _header(frame: int):
    """The frame's first words, indexable by the _W_* positions (read when indexed)."""
    if _u64(frame).value < 8 * _HEADER_WORDS:
        raise _FfiError(_INVALID_ARGUMENT, "XLA_FFI_CallFrame is too small")
    return _Header.from_address(frame)


def _pointers(words: _Header, at: tuple[int, int]) -> list[int]:
    """The data addresses of the frame's args or rets (the launch handlers' fast path: XLA
    passes what the traced call declared, so only the addresses are read)."""
    n, items = words[at[0]], words[at[1]]
    if n == 0 or n >= 1 << 63:
        return []
    return [_u64(_u64(items + 8 * i).value + _DATA).value for i in range(n)]


def _handler_id(frame: int, words: _Header) -> object:
    """The int64 attribute "handler" (the only attribute our calls pass: read directly)."""
    if words[_W_ATTRS[0]] == 1 and _i32(words[_W_ATTRS[1]]).value == _ATTR_SCALAR:
        scalar = _u64(words[_W_ATTRS[2]]).value  # XLA_FFI_Scalar: dtype, value address
        if _i32(scalar).value == 5:  # S64
            return _i64(_u64(scalar + _SCALAR_VALUE).value).value
    return _decode_attrs(_CallFrame.from_address(frame).attrs).get("handler")


def _api_fn(frame: _CallFrame, field: str, proto: type) -> Callable | None:
    """The C API function in ``field`` of ``frame.api``, or None if this XLA lacks it."""
    if not frame.api:
        return None
    api = frame.api.contents
    if api.struct_size < _end(_Api, field) or not getattr(api, field):
        return None
    return proto(getattr(api, field))


def _make_error(frame: _CallFrame, code: int, message: str) -> int | None:
    create = _api_fn(frame, "error_create", _ErrorCreateFn)
    if create is None:  # cannot happen with a real XLA; say it rather than fail silently
        print(f"rtcinfer: cannot report an FFI error to XLA: {message}", file=sys.stderr)
        return None
    args = _ErrorCreateArgs(_end(_ErrorCreateArgs, "errc"), None, message.encode(), code)
    return create(ctypes.byref(args))  # XLA copies the message


_stream_getters: dict[int, Callable] = {}  # XLA_FFI_Api address -> its XLA_FFI_Stream_Get
_STREAM_ARGS_SIZE = _end(_StreamGetArgs, "stream")
_stream_args = threading.local()  # .reused: (XLA_FFI_Stream_Get_Args, a byref to it)


def _stream(frame: int, words: _Header) -> int:
    api = words[_W_API]
    get = _stream_getters.get(api)
    if get is None:
        get = _api_fn(_CallFrame.from_address(frame), "stream_get", _StreamGetFn)
        if get is None:
            raise _FfiError(_INTERNAL, "this XLA has no XLA_FFI_Stream_Get")
        _stream_getters[api] = get
    try:
        args, ref = _stream_args.reused
    except AttributeError:  # this thread's first call: its own arguments, reused after
        args = _StreamGetArgs(_STREAM_ARGS_SIZE, None, 0, None)
        ref = ctypes.byref(args)
        _stream_args.reused = args, ref
    args.ctx, args.stream = words[_W_CTX], None
    err = get(ref)
    if err:
        raise _PassThrough(err)
    return args.stream or 0


def _answer_metadata(frame: _CallFrame, traits: int) -> bool:
    """Fills in XLA_FFI_Metadata if the frame is a metadata query; True if it was one."""
    ext = frame.extension_start
    while ext:
        base = ext.contents
        if base.type == _EXTENSION_METADATA:
            query = ctypes.cast(ext, ctypes.POINTER(_MetadataExtension)).contents
            if base.struct_size >= _end(_MetadataExtension, "metadata") and query.metadata:
                meta = query.metadata.contents
                if meta.struct_size >= _end(_Metadata, "traits"):
                    size = _end(_ApiVersion, "minor_version")
                    meta.api_version = _ApiVersion(size, None, *_API_VERSION)
                    meta.traits = traits
            return True
        ext = base.next
    return False


def _execute(frame: int, words: _Header, on_gpu: bool) -> int | None:
    handler_id = _handler_id(frame, words)
    entry = _handlers.get(handler_id) if isinstance(handler_id, int) else None
    if entry is None:
        raise _FfiError(_INVALID_ARGUMENT, f"no rtcinfer FFI handler with id {handler_id!r}")
    fn, pointers = entry
    if pointers:
        inputs, outputs = _pointers(words, _W_ARGS), _pointers(words, _W_RETS)
    else:
        struct_ = _CallFrame.from_address(frame)
        inputs, outputs = _buffers(struct_.args, "input"), _buffers(struct_.rets, "output")
    stream = _stream(frame, words) if on_gpu else 0
    try:
        fn(stream, inputs, outputs)
    except Exception as exc:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        raise _FfiError(_INTERNAL, f"rtcinfer handler {name} raised {exc!r}\n{detail}") from exc
    return None


def _make_target(on_gpu: bool, command_buffer: bool = True) -> _TargetFn:
    traits = _COMMAND_BUFFER_COMPATIBLE if on_gpu and command_buffer else 0

    def target(frame):  # the XLA_FFI_CallFrame's address
        if not frame:
            return None
        try:
            if _u64(frame + 8).value and _answer_metadata(  # extension_start: a query?
                _CallFrame.from_address(frame), traits
            ):
                return None
            words = _header(frame)
            if words[_W_STAGE] & 0xFFFFFFFF != _STAGE_EXECUTE:
                return None
            return _execute(frame, words, on_gpu)
        except _PassThrough as exc:
            return exc.args[0]
        except _FfiError as exc:
            return _make_error(_CallFrame.from_address(frame), exc.code, str(exc))
        except BaseException as exc:  # nothing may unwind into XLA
            return _make_error(_CallFrame.from_address(frame), _INTERNAL,
                               f"rtcinfer FFI target failed: {exc!r}")  # fmt: skip

    return _TargetFn(target)


# ---------------------------------------------------------------- registration and calls

_PLATFORMS = {"cuda": "CUDA", "gpu": "CUDA", "cpu": "cpu"}  # our key -> XLA platform name
_targets: dict[str, _TargetFn] = {}  # keeps the callbacks alive for the life of the process
_registered: set[str] = set()
_register_lock = threading.Lock()


def target_name(platform: str = "cuda", command_buffer: bool = True) -> str:
    """The FFI target name used for ``platform`` ("cuda" or "cpu"). On CUDA, calls whose
    launch reads state that may change between executions (``command_buffer=False``) go to a
    second target that does not declare command-buffer compatibility, so XLA calls it on
    every execution instead of replaying a recorded launch."""
    key = platform.lower()
    if key not in _PLATFORMS:
        raise ValueError(f"unsupported platform {platform!r}; expected one of {sorted(_PLATFORMS)}")
    live = "_live" if _PLATFORMS[key] == "CUDA" and not command_buffer else ""
    return f"rtcinfer_{_PLATFORMS[key].lower()}{live}"


def _ensure_registered(platform: str, command_buffer: bool = True) -> str:
    name = target_name(platform, command_buffer)
    with _register_lock:
        if name not in _registered:
            import jax

            if name not in _targets:  # one callback per target, reused if registering is retried
                on_gpu = name.startswith("rtcinfer_cuda")
                _targets[name] = _make_target(on_gpu, command_buffer)
            address = ctypes.cast(_targets[name], ctypes.c_void_p).value
            capsule = jax.ffi.pycapsule(address)
            jax.ffi.register_ffi_target(name, capsule, platform=_PLATFORMS[platform.lower()])
            _registered.add(name)
    return name


def ffi_call(
    handler_id: int,
    args: Sequence,
    out_shapes: Sequence[jax.ShapeDtypeStruct],
    *,
    input_output_aliases: dict[int, int] | None = None,
    platform: str = "cuda",
    command_buffer: bool = True,
) -> list[jax.Array]:
    """Runs handler ``handler_id`` on ``args`` through XLA, eagerly or inside ``jax.jit``.

    ``out_shapes`` gives the shape and dtype of each output; ``input_output_aliases`` maps an
    input index to the output index that reuses its buffer. The FFI target for ``platform`` is
    registered on first use; ``command_buffer=False`` picks the target XLA never records
    (see target_name). Returns the outputs as a list.
    """
    import jax
    import numpy as np

    with _lock:
        known = handler_id in _handlers
    if not known:
        raise KeyError(f"no rtcinfer FFI handler with id {handler_id!r}; use add_handler()")
    name = _ensure_registered(platform, command_buffer)
    call = jax.ffi.ffi_call(name, list(out_shapes), input_output_aliases=input_output_aliases)
    return list(call(*args, handler=np.int64(handler_id)))
