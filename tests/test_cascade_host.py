"""merge_state(s) without a GPU: the argument checks of each call signature (the ops' prepare
step, on host arrays taken as device ones) and the launch each signature prepares."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import rtcinfer
from rtcinfer.attention import cascade
from rtcinfer.interop import ArrayInfo
from rtcinfer.interop.dtypes import normalize

from .fakes import launched


def info(x: np.ndarray) -> ArrayInfo:
    """A host array as prepare sees a device array (strides in elements)."""
    return ArrayInfo(x.shape, tuple(s // x.itemsize for s in x.strides), normalize(x.dtype), 0)


def prepare(op, arrays, static, align=16):
    """What call() does for a new signature, with host arrays seen as device arrays whose
    addresses are all aligned to `align` bytes (at most 16)."""
    infos = [None if x is None else info(x)._replace(offset=align % 16) for x in arrays]
    return op.prepare(infos, align, static)


def test_mismatched_states_name_shape_and_dtype():
    v16 = np.zeros((2, 3, 8), np.float16)
    vb = np.zeros((2, 3, 8), ml_dtypes.bfloat16)
    s = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"v_a \(float16 .*\) and v_b \(bfloat16 .*\) must match"):
        prepare(cascade._MERGE, (v16, s, vb, s), ("merge_state",))
    with pytest.raises(ValueError, match=r"v \(float16 .*\) and v_other \(bfloat16 .*\) must"):
        prepare(cascade._IN_PLACE, (v16, s, vb, s, None), ("in_place",))
    with pytest.raises(ValueError, match=r"mask: expected bool \[2\], got int32 \(2,\)"):
        prepare(cascade._IN_PLACE, (v16, s, v16, s, np.zeros(2, np.int32)), ("in_place",))


def test_head_dim_zero_is_refused():
    v, s = np.zeros((2, 3, 0), np.float32), np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="head_dim must be at least 1"):
        prepare(cascade._MERGE, (v, s, v, s), ("merge_state",))
    with pytest.raises(ValueError, match="head_dim must be at least 1"):
        prepare(cascade._STATES, (v[:, None], s[:, None]), ("merge_states",))


def test_host_arrays_are_refused_by_slot_name():
    v, s = np.zeros((2, 3, 8), np.float32), np.zeros((2, 3), np.float32)
    with pytest.raises(TypeError, match="v_a: expected a CUDA array"):
        rtcinfer.merge_state(v, s, v, s)


def test_in_place_reads_and_writes_the_outputs(monkeypatch):
    """The outputs alias v and s; the kernel reads a through them (under JAX they are XLA's
    copies of v and s), b from v_other and s_other, and the mask is made dense first."""
    v, s = np.zeros((9, 4, 128), ml_dtypes.bfloat16), np.zeros((9, 4), np.float32)
    prep = prepare(cascade._IN_PLACE, (v, s, v, s, np.zeros(18, bool)[::2]), ("in_place",))
    assert [(o.source, o.alias) for o in prep.outs] == [(0, True), (1, True)]
    assert prep.dense == (4,)  # a strided mask is copied first (a contiguous one is not)
    launch, p = launched(monkeypatch, prep, [0x100, 0x200, 0x300, 0x400, 0x500, 0x600, 0x700])
    assert (p["a_v"], p["a_s"], p["o_v"], p["o_s"]) == (0x600, 0x700, 0x600, 0x700)
    assert (p["b_v"], p["b_s"], p["mask"]) == (0x300, 0x400, 0x500)
    assert launch.kernel.spec == cascade.MergeSpec("bfloat16", 8, True, True)
    assert (p["a_vn"], p["a_vs"], p["a_vh"]) == (512, 0, 128)  # one state per row: stride 0
    assert (p["a_sn"], p["a_ss"], p["a_sh"]) == (4, 0, 1)
    assert (p["rows"], p["num_heads"], p["head_dim"], p["num_a"]) == (36, 4, 128, 1)


def test_sinks_merge_in_place_with_each_heads_sink(monkeypatch):
    """merge_sinks_in_place: outputs alias v and s, read through them; sinks [h] float32 at
    any stride is the extra state's LSE source (SINK spec, no b arrays)."""
    v, s = np.zeros((5, 4, 64), np.float16), np.zeros((5, 4), np.float32)
    sinks = np.zeros(8, np.float32)[::2]
    prep = prepare(cascade._SINKS, (v, s, sinks), ("sinks",))
    assert [(o.source, o.alias) for o in prep.outs] == [(0, True), (1, True)]
    launch, p = launched(monkeypatch, prep, [0x100, 0x200, 0x300, 0x400, 0x500])
    assert launch.kernel.spec == cascade.MergeSpec("float16", 8, False, False, True)
    assert (p["a_v"], p["a_s"], p["o_v"], p["o_s"]) == (0x400, 0x500, 0x400, 0x500)
    assert (p["sinks"], p["sinks_h"], p["num_a"], p["rows"]) == (0x300, 2, 1, 20)
    for bad in (np.zeros(3, np.float32), np.zeros(4, np.float16), np.zeros((4, 1), np.float32)):
        with pytest.raises(ValueError, match=r"sinks: expected float32 \[4\]"):
            prepare(cascade._SINKS, (v, s, bad), ("sinks",))
    prep = prepare(cascade._SINKS, (v, s, sinks), ("sinks",), align=4)
    spec = launched(monkeypatch, prep, [4] * 5)[0].kernel.spec
    assert spec.sink and spec.vec == 2  # narrowed to the alignment, still the sink's


def test_merge_states_of_zero_states_and_of_no_rows(monkeypatch):
    """S = 0 still launches (every row: v = 0, s = -inf) and never reads v or s, which may be
    null; an empty batch launches nothing."""
    v, s = np.zeros((6, 0, 3, 64), np.float16), np.zeros((6, 0, 3), np.float32)
    prep = prepare(cascade._STATES, (v, s), ("merge_states",))
    assert [(o.shape, o.source) for o in prep.outs] == [((6, 3, 64), None), ((6, 3), None)]
    launch, p = launched(monkeypatch, prep, [0, 0, 0x1000, 0x2000])
    assert not launch.empty and (p["num_a"], p["rows"]) == (0, 18)
    assert (p["o_v"], p["o_s"], p["o_vn"], p["o_vh"], p["o_sn"]) == (0x1000, 0x2000, 192, 64, 3)
    empty = prepare(cascade._STATES, (v[:0, :], s[:0]), ("merge_states",))
    assert launched(monkeypatch, empty, [0, 0, 0, 0])[0].empty


def test_vector_width_follows_strides_and_alignment(monkeypatch):
    big = np.zeros((4, 3, 2 * 128), np.float16)
    s = np.zeros((4, 3), np.float32)
    for v, align, vec in [
        (big[..., :128], 16, 8),
        (big[..., :128], 4, 2),
        (big[:, :, 1:129], 2, 1),
    ]:
        prep = prepare(cascade._MERGE, (v, s, v, s), ("merge_state",), align)
        assert launched(monkeypatch, prep, [16] * 6)[0].kernel.spec.vec == vec
    with pytest.raises(ValueError, match="head_dim of every v must be contiguous"):
        prepare(cascade._MERGE, (big[..., ::2], s, big[..., ::2], s), ("merge_state",))
