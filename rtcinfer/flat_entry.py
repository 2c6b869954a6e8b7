"""A kernel's flat entry: the same kernel with its parameter struct's fields as separate
parameters, compiled to PTX, for launchers that pass one value or one buffer per parameter
(jaxlib's native kernel launcher, interop/xla_launch.py).

Every kernel takes one struct by value (`const __grid_constant__ NormParams p`, params.py).
The flat source turns each kernel of the spec's source into a device function of the same
name taking `const NormParams&` (the ones not launched are then dropped from the PTX) and adds

    extern "C" __global__ void __launch_bounds__(THREADS) norm_kernel_flat(
        char* b0, char* b1, char* b2, int64_t o0, int64_t o1, ..., float v5, ...) {
      NormParams p;
      p.x = reinterpret_cast<decltype(p.x)>(b0 + o0);   // a pointer field: buffer + offset
      ...
      p.eps = v5;                                        // any other field: its value
      norm_kernel(p);
    }

with the kernel's own launch attributes. The source depends only on which buffer each pointer
field addresses (`bound`), never on shapes or values, so one PTX serves every signature of an
op. Pointer fields not bound to a buffer are passed as values (null ones).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import jit
from .params import StructLayout

# extern "C" __global__ void <attributes> name(const __grid_constant__ Params p)
_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?P<attrs>(?:__\w+__\s*\([^()]*\)\s*)*)'
    r"(?P<name>\w+)\s*\(\s*const\s+__grid_constant__\s+(?P<ptype>\w+)\s+(?P<arg>\w+)\s*\)"
)
# a scalar field's element type as a parameter (array fields pass one parameter an element)
_ELEMENT = """
template <class T> struct rtc_flat_element { using type = T; };
template <class T, int N> struct rtc_flat_element<T[N]> { using type = T; };
"""


@dataclass(frozen=True)
class FlatEntry:
    """The flat entry of kernel `kernel`: its PTX and the name of its entry point."""

    name: str
    ptx: str


def value_fields(layout: StructLayout, bound: dict[str, int]) -> list[tuple[str, str, int]]:
    """(field, C type, element index) of each value parameter, in parameter order: every
    element of every field not bound to a buffer."""
    return [(f.name, f.ctype, i) for f in layout.fields if f.name not in bound
            for i in range(f.count)]  # fmt: skip


def flat_source(spec, kernel: str, layout: StructLayout, buffers: int,
                bound: dict[str, int]) -> str:  # fmt: skip
    """The spec's source with `kernel`'s flat entry `<kernel>_flat`: parameters b0..b{buffers-1}
    (char*), then one int64 offset per field in `bound` (field -> buffer, in layout order),
    then value_fields(layout, bound)."""
    source = jit.expand_source(spec)
    found = {}

    def as_device_function(m: re.Match) -> str:
        found[m["name"]] = m
        return f"static __device__ __forceinline__ void {m['name']}(const {m['ptype']}& {m['arg']})"

    source = _KERNEL.sub(as_device_function, source)
    if kernel not in found:
        raise ValueError(f"{spec!r}: no kernel {kernel!r} taking one __grid_constant__ struct")
    m = found[kernel]
    if m["ptype"] != layout.name:
        raise ValueError(f"{kernel} takes {m['ptype']}, not {layout.name}")
    ptype = layout.name
    params = [f"char* b{i}" for i in range(buffers)]
    body = [f"  {ptype} p;"]
    for k, f in enumerate(f for f in layout.fields if f.name in bound):
        params.append(f"long long o{k}")
        body.append(f"  p.{f.name} = reinterpret_cast<decltype(p.{f.name})>"
                    f"(b{bound[f.name]} + o{k});")  # fmt: skip
    for k, (name, _, index) in enumerate(value_fields(layout, bound)):
        field = layout.field(name)
        params.append(f"typename rtc_flat_element<decltype({ptype}::{name})>::type v{k}")
        body.append(f"  p.{name}{f'[{index}]' if field.count > 1 else ''} = v{k};")
    body.append(f"  {kernel}(p);")
    entry = (f'extern "C" __global__ void {m["attrs"]}{kernel}_flat(\n    '
             + ",\n    ".join(params) + ") {\n" + "\n".join(body) + "\n}\n")  # fmt: skip
    return source + _ELEMENT + entry


def compile_flat(spec, kernel: str, layout: StructLayout, buffers: int, bound: dict[str, int],
                 arch: str) -> FlatEntry:  # fmt: skip
    """PTX of the flat entry for `arch` (e.g. "sm_90a": PTX for compute_90a), from the disk
    cache or compiled now by NVRTC (jit.compile_ptx)."""
    name = f"{kernel}_flat"
    source = flat_source(spec, kernel, layout, buffers, bound)
    return FlatEntry(name, jit.compile_ptx(spec, source, name, arch))


__all__ = ["FlatEntry", "compile_flat", "flat_source", "value_fields"]
