"""The XLA FFI C API (xla/ffi/api/c_api.h) as ctypes: its data type codes, enum values,
the structs of the call frame and of the API calls used here, and their sizes."""

from __future__ import annotations

import ctypes

# XLA_FFI_DataType code -> numpy-style name (ml_dtypes names for the narrow float/int types).
DTYPE_NAMES: dict[int, str] = {
    1: "bool", 2: "int8", 3: "int16", 4: "int32", 5: "int64",
    6: "uint8", 7: "uint16", 8: "uint32", 9: "uint64",
    10: "float16", 11: "float32", 12: "float64", 15: "complex64", 16: "bfloat16",
    18: "complex128", 19: "float8_e5m2", 20: "float8_e4m3fn", 21: "int4", 22: "uint4",
    23: "float8_e4m3b11fnuz", 24: "float8_e5m2fnuz", 25: "float8_e4m3fnuz", 26: "int2",
    27: "uint2", 28: "float8_e4m3", 29: "float8_e3m4", 30: "int1", 31: "uint1",
    32: "float4_e2m1fn", 33: "float8_e8m0fnu",
}  # fmt: skip

# Enum values from c_api.h.
_EXTENSION_METADATA = 1  # XLA_FFI_Extension_Metadata
_STAGE_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
_BUFFER = 1  # XLA_FFI_ArgType_BUFFER == XLA_FFI_RetType_BUFFER
_ATTR_SCALAR, _ATTR_STRING = 3, 4  # XLA_FFI_AttrType
_INVALID_ARGUMENT, _INTERNAL = 3, 13  # XLA_FFI_Error_Code
_COMMAND_BUFFER_COMPATIBLE = 1  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE
# Version reported to the metadata query: every struct used here is unchanged since 0.1, and
# XLA accepts handlers built against any version from 0.1 to its own.
_API_VERSION = (0, 1)

_size_t, _void_p, _int, _int64 = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class _ExtensionBase(ctypes.Structure):  # XLA_FFI_Extension_Base
    pass


_ExtensionBase._fields_ = [
    ("struct_size", _size_t),
    ("type", _int),  # XLA_FFI_Extension_Type
    ("next", ctypes.POINTER(_ExtensionBase)),
]
_ExtPtr = ctypes.POINTER(_ExtensionBase)


class _ApiVersion(ctypes.Structure):  # XLA_FFI_Api_Version
    _fields_ = [("struct_size", _size_t), ("extension_start", _ExtPtr),
                ("major_version", _int), ("minor_version", _int)]  # fmt: skip


class _Metadata(ctypes.Structure):  # XLA_FFI_Metadata (newer headers append state_type_id)
    _fields_ = [("struct_size", _size_t), ("api_version", _ApiVersion), ("traits", ctypes.c_uint32)]


class _MetadataExtension(ctypes.Structure):  # XLA_FFI_Metadata_Extension
    _fields_ = [("extension_base", _ExtensionBase), ("metadata", ctypes.POINTER(_Metadata))]


class _Buffer(ctypes.Structure):  # XLA_FFI_Buffer
    _fields_ = [("struct_size", _size_t), ("extension_start", _ExtPtr), ("dtype", _int),
                ("data", _void_p), ("rank", _int64), ("dims", ctypes.POINTER(_int64))]  # fmt: skip


class _List(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets (same layout)
    _fields_ = [("struct_size", _size_t), ("extension_start", _ExtPtr), ("size", _int64),
                ("types", ctypes.POINTER(_int)), ("items", ctypes.POINTER(_void_p))]  # fmt: skip


class _ByteSpan(ctypes.Structure):  # XLA_FFI_ByteSpan
    _fields_ = [("ptr", _void_p), ("len", _size_t)]


class _Scalar(ctypes.Structure):  # XLA_FFI_Scalar
    _fields_ = [("dtype", _int), ("value", _void_p)]


_SpanPtr = ctypes.POINTER(_ByteSpan)


class _Attrs(ctypes.Structure):  # XLA_FFI_Attrs
    _fields_ = [("struct_size", _size_t), ("extension_start", _ExtPtr), ("size", _int64),
                ("types", ctypes.POINTER(_int)), ("names", ctypes.POINTER(_SpanPtr)),
                ("attrs", ctypes.POINTER(_void_p))]  # fmt: skip


class _Api(ctypes.Structure):  # XLA_FFI_Api, the prefix up to XLA_FFI_Stream_Get
    _fields_ = [("struct_size", _size_t), ("extension_start", _ExtPtr),
                ("api_version", _ApiVersion), ("internal_api", _void_p),
                ("error_create", _void_p), ("error_get_message", _void_p),
                ("error_destroy", _void_p), ("handler_register", _void_p),
                ("stream_get", _void_p)]  # fmt: skip


class _CallFrame(ctypes.Structure):  # XLA_FFI_CallFrame
    _fields_ = [("struct_size", _size_t), ("extension_start", _ExtPtr),
                ("api", ctypes.POINTER(_Api)), ("ctx", _void_p), ("stage", _int),
                ("args", _List), ("rets", _List), ("attrs", _Attrs),
                ("future", _void_p)]  # fmt: skip


class _ErrorCreateArgs(ctypes.Structure):  # XLA_FFI_Error_Create_Args
    _fields_ = [("struct_size", _size_t), ("extension_start", _ExtPtr),
                ("message", ctypes.c_char_p), ("errc", _int)]  # fmt: skip


class _StreamGetArgs(ctypes.Structure):  # XLA_FFI_Stream_Get_Args
    _fields_ = [("struct_size", _size_t), ("extension_start", _ExtPtr),
                ("ctx", _void_p), ("stream", _void_p)]  # fmt: skip


# Function types: XLA_FFI_Error* f(Args*). Errors are opaque pointers (int or None).
_ErrorCreateFn = ctypes.CFUNCTYPE(_void_p, ctypes.POINTER(_ErrorCreateArgs))
_StreamGetFn = ctypes.CFUNCTYPE(_void_p, ctypes.POINTER(_StreamGetArgs))
_TargetFn = ctypes.CFUNCTYPE(_void_p, _void_p)  # XLA_FFI_Handler, taking the frame's address

_SCALAR_CTYPES = {1: ctypes.c_bool, 2: ctypes.c_int8, 3: ctypes.c_int16, 4: ctypes.c_int32,
                  5: ctypes.c_int64, 6: ctypes.c_uint8, 7: ctypes.c_uint16, 8: ctypes.c_uint32,
                  9: ctypes.c_uint64, 11: ctypes.c_float, 12: ctypes.c_double}  # fmt: skip


def _end(struct: type[ctypes.Structure], field: str) -> int:
    """Bytes a struct must span for ``field`` to be present (the C ``XLA_FFI_STRUCT_SIZE``)."""
    desc = getattr(struct, field)
    return desc.offset + desc.size
