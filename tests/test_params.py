"""The kernel seam without a GPU: parameter structs and work items, read from their C
declarations, have the host layout the compiler gives them (checked by compiling a probe)."""

from __future__ import annotations

import ctypes
import enum

import numpy as np
import pytest

from rtcinfer import catalog, jit
from rtcinfer.params import layout_probe, params_type, record_dtype, struct_layout

SOURCE = """
struct Plain {
  const T* __restrict__ x;   // [n] comment with; a semicolon
  int64_t s0, s1;
  int n;                     /* a block comment */
  float eps;
  uint32_t magic;
};
struct alignas(16) Item { int a, b[3]; };
struct WithMap { int before; CUtensorMap map; float after; };
"""


def test_layout_follows_c_rules():
    plain = struct_layout(SOURCE, "Plain")
    assert [(f.name, f.offset, f.size) for f in plain.fields] == [
        ("x", 0, 8), ("s0", 8, 8), ("s1", 16, 8), ("n", 24, 4), ("eps", 28, 4), ("magic", 32, 4)
    ]  # fmt: skip
    assert (plain.size, plain.align) == (40, 8)
    item = struct_layout(SOURCE, "Item")
    assert [(f.name, f.count, f.offset) for f in item.fields] == [("a", 1, 0), ("b", 3, 4)]
    assert (item.size, item.align) == (16, 16)
    tmap = struct_layout(SOURCE, "WithMap")
    assert [(f.name, f.offset) for f in tmap.fields] == [("before", 0), ("map", 64), ("after", 192)]
    assert (tmap.size, tmap.align) == (256, 64)


def test_ctypes_mirror_is_filled_by_name_at_the_c_offsets():
    layout = struct_layout(SOURCE, "WithMap")
    cls = params_type(layout)
    assert ctypes.sizeof(cls) == 256 and cls.map.offset == 64 and cls.after.offset == 192
    p = cls()
    p.before, p.after = 7, 1.5
    raw = bytes(p)
    assert int.from_bytes(raw[:4], "little") == 7
    assert np.frombuffer(raw[192:196], np.float32)[0] == 1.5
    plain = params_type(struct_layout(SOURCE, "Plain"))()
    plain.x, plain.eps = 0xDEADBEEF00, 0.25
    assert int.from_bytes(bytes(plain)[:8], "little") == 0xDEADBEEF00


def test_work_items_as_a_numpy_record():
    dtype = record_dtype(struct_layout(SOURCE, "Item"))
    assert dtype.itemsize == 16 and dtype.names == ("a", "b")
    rows = np.zeros(3, dtype)
    rows["a"] = [1, 2, 3]
    rows["b"][:, 2] = 9
    words = rows.view(np.int32).reshape(3, 4)
    np.testing.assert_array_equal(words[:, [0, 3]], [[1, 9], [2, 9], [3, 9]])


def test_unknown_declarations_are_refused():
    with pytest.raises(ValueError, match="struct Missing is not declared"):
        struct_layout(SOURCE, "Missing")
    with pytest.raises(ValueError, match="field type 'half2' has no host mirror"):
        struct_layout("struct Bad { half2 h; };", "Bad")


class Color(enum.IntEnum):
    RED = 0
    BLUE = 3


def test_enums_cross_the_seam_by_name():
    text = jit.prelude(MODE=Color.BLUE, OTHER=Color.RED, N=4)
    assert text.splitlines() == [
        "enum class Color : int { RED = 0, BLUE = 3 };",
        "constexpr Color MODE = Color::BLUE;",
        "constexpr Color OTHER = Color::RED;",
        "constexpr int N = 4;",
    ]
    assert jit.prelude(Color=Color, MODE=Color.RED).splitlines() == [  # the declaration alone
        "enum class Color : int { RED = 0, BLUE = 3 };",
        "constexpr Color MODE = Color::RED;",
    ]


def _families():
    """One shipped spec per (source file, struct): the layout does not depend on the dtypes."""
    seen = {}
    for spec in catalog.shipped_specs():
        for struct in getattr(spec, "structs", ()):
            seen.setdefault((spec.source, struct), spec)
    return [
        pytest.param(spec, struct, id=f"{src}:{struct}") for (src, struct), spec in seen.items()
    ]


@pytest.mark.parametrize("spec,struct", _families())
def test_compiled_struct_matches_the_host_layout(spec, struct):
    """The expanded kernel source plus static_asserts of every offset, the size and the
    alignment compiles: the device sees what params_type writes."""
    probe = jit.expand_source(spec) + "\n" + layout_probe(jit.struct_layout(spec, struct))
    arch = "sm_90a"
    cubin, log = jit._nvrtc(probe, "probe", jit.compile_options(arch))
    assert cubin is not None, log


def test_a_tensor_map_travels_by_value_in_the_parameter_block():
    """The Hopper kernels' seam: a __grid_constant__ struct holding a CUtensorMap (128 bytes,
    aligned to 64) compiles for sm_90a with the layout the host mirror writes."""
    source = (
        (jit.source_root() / "common.cuh").read_text()
        + """
struct TmaParams {
  const T* q;          // [n, d]
  CUtensorMap k_map;   // K tiles, built on the host
  int n;
};
extern "C" __global__ void tma_probe(const __grid_constant__ TmaParams p) {
  if (threadIdx.x == 0 && p.n < 0) asm volatile("prefetch.tensormap [%0];" :: "l"(&p.k_map));
}
"""
    )
    layout = struct_layout(source, "TmaParams")
    assert [(f.name, f.offset) for f in layout.fields] == [("q", 0), ("k_map", 64), ("n", 192)]
    cls = params_type(layout)
    assert ctypes.sizeof(cls) == layout.size == 256
    prelude = "using T = __nv_bfloat16;\n"
    head, _, body = source.partition("struct TmaParams")
    probe = head + prelude + "struct TmaParams" + body + layout_probe(layout)
    cubin, log = jit._nvrtc(probe, "tma_probe", jit.compile_options("sm_90a"))
    assert cubin is not None, log


def test_every_shipped_family_declares_its_structs():
    missing = {type(s).__name__ for s in catalog.shipped_specs() if not getattr(s, "structs", ())}
    assert not missing, f"specs without parameter structs: {sorted(missing)}"
