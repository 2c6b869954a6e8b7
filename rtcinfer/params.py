"""Named structs across the kernel seam: declared once in cuda_src/, mirrored here by parsing.

A kernel takes one parameter struct by value (`const __grid_constant__ NormParams p`), and a
planner's work items are a struct too. Each is declared once, in the kernel's source file:

    struct NormParams {
      T* x;                      // [n0, n1, HIDDEN] strides (xs0, xs1, 1)
      int64_t xs0, xs1;
      float eps;
    };

`struct_layout(source, "NormParams")` reads that declaration and lays it out as the C
compiler does (natural alignment, `alignas(N)` on the struct): every pointer is a device
address (8 bytes), `CUtensorMap` is 128 bytes aligned to 64. `params_type` makes the ctypes
mirror the launch fills by field name; `record_dtype` the NumPy structured dtype a planner
writes work items with. `layout_probe` renders static_asserts of every offset and size, which
the tests compile with NVRTC: the two sides cannot drift apart.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass

import numpy as np

# C type -> (bytes, alignment, ctypes type, NumPy type); pointers are handled apart.
_SCALARS = {
    "int": (4, 4, ctypes.c_int32, "<i4"),
    "int32_t": (4, 4, ctypes.c_int32, "<i4"),
    "unsigned": (4, 4, ctypes.c_uint32, "<u4"),
    "uint32_t": (4, 4, ctypes.c_uint32, "<u4"),
    "int64_t": (8, 8, ctypes.c_int64, "<i8"),
    "uint64_t": (8, 8, ctypes.c_uint64, "<u8"),
    "float": (4, 4, ctypes.c_float, "<f4"),
    "double": (8, 8, ctypes.c_double, "<f8"),
    "CUtensorMap": (128, 64, ctypes.c_char * 128, "V128"),
}
_POINTER = (8, 8, ctypes.c_void_p, "<u8")
_QUALIFIERS = re.compile(r"\b(const|volatile|__restrict__)\b")
_DECL = re.compile(r"^(?P<type>[A-Za-z_][\w\s\*]*?)\s*(?P<names>[A-Za-z_]\w*(\s*\[\s*\d+\s*\])?"
                   r"(\s*,\s*[A-Za-z_]\w*(\s*\[\s*\d+\s*\])?)*)$")  # fmt: skip


@dataclass(frozen=True)
class Field:
    name: str
    ctype: str  # "ptr" or a key of _SCALARS
    count: int  # array length (1 for a plain field)
    offset: int
    size: int  # bytes of the whole field


@dataclass(frozen=True)
class StructLayout:
    name: str
    fields: tuple[Field, ...]
    size: int
    align: int

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.name} has no field {name!r}")


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def struct_layout(source: str, name: str) -> StructLayout:
    """The layout of `struct <name> { ... };` declared in `source` (text of a .cu/.cuh)."""
    found = re.search(
        r"\bstruct\s+(?:alignas\((\d+)\)\s+)?" + re.escape(name) + r"\s*\{(.*?)\}\s*;",
        _strip_comments(source),
        re.S,
    )
    if found is None:
        raise ValueError(f"struct {name} is not declared in the given source")
    struct_align = int(found.group(1) or 1)
    fields: list[Field] = []
    offset, align = 0, struct_align
    for decl in found.group(2).split(";"):
        decl = " ".join(_QUALIFIERS.sub(" ", decl).split())
        if not decl:
            continue
        m = _DECL.match(decl)
        if m is None:
            raise ValueError(f"struct {name}: cannot read the declaration {decl!r}")
        ctype = m["type"].replace(" ", "")
        if ctype.endswith("*"):
            size, field_align, kind = _POINTER[0], _POINTER[1], "ptr"
        elif ctype in _SCALARS:
            size, field_align, kind = _SCALARS[ctype][0], _SCALARS[ctype][1], ctype
        else:
            raise ValueError(f"struct {name}: field type {m['type']!r} has no host mirror")
        for part in m["names"].split(","):
            part = part.strip()
            count = 1
            if "[" in part:
                part, n = part.split("[")
                part, count = part.strip(), int(n.rstrip("] "))
            offset = -(-offset // field_align) * field_align
            fields.append(Field(part, kind, count, offset, size * count))
            offset += size * count
            align = max(align, field_align)
    return StructLayout(name, tuple(fields), -(-offset // align) * align, align)


def _ctype(field: Field):
    base = _POINTER[2] if field.ctype == "ptr" else _SCALARS[field.ctype][2]
    return base if field.count == 1 else base * field.count


@functools.cache
def params_type(layout: StructLayout) -> type[ctypes.Structure]:
    """A ctypes Structure with the struct's fields by name at the C offsets (explicit padding,
    so over-aligned members such as CUtensorMap land where the device expects them)."""
    members, at = [], 0
    for f in layout.fields:
        if f.offset > at:
            members.append((f"_pad{at}", ctypes.c_char * (f.offset - at)))
        members.append((f.name, _ctype(f)))
        at = f.offset + f.size
    if layout.size > at:
        members.append((f"_pad{at}", ctypes.c_char * (layout.size - at)))
    cls = type(layout.name, (ctypes.Structure,), {"_pack_": 1, "_fields_": members})
    assert ctypes.sizeof(cls) == layout.size
    return cls


@functools.cache
def record_dtype(layout: StructLayout) -> np.dtype:
    """NumPy structured dtype of the struct (work items: plain fields, no pointers)."""
    names, formats, offsets = [], [], []
    for f in layout.fields:
        base = _POINTER[3] if f.ctype == "ptr" else _SCALARS[f.ctype][3]
        names.append(f.name)
        formats.append(base if f.count == 1 else (base, (f.count,)))
        offsets.append(f.offset)
    spec = {"names": names, "formats": formats, "offsets": offsets, "itemsize": layout.size}
    return np.dtype(spec)


def layout_probe(layout: StructLayout) -> str:
    """C++ static_asserts that the compiled struct has this layout (offsets and size)."""
    lines = [f'static_assert(sizeof({layout.name}) == {layout.size}, "{layout.name} size");']
    lines.append(f'static_assert(alignof({layout.name}) == {layout.align}, "{layout.name} align");')
    for f in layout.fields:
        lines.append(
            f"static_assert(__builtin_offsetof({layout.name}, {f.name}) == {f.offset}, "
            f'"{layout.name}.{f.name}");'
        )
    return "\n".join(lines)


__all__ = [
    "Field",
    "StructLayout",
    "layout_probe",
    "params_type",
    "record_dtype",
    "struct_layout",
]
