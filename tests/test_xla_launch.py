"""The native JAX launch path without a GPU: recording a prepared call, planning its launches
as jaxlib's native launcher takes them, and the kernels' flat entries compiled to PTX."""

from __future__ import annotations

import re

import pytest

from rtcinfer import catalog, flat_entry, jit, launch, norm
from rtcinfer.interop import xla_launch
from rtcinfer.interop.call import ArrayInfo, dense_strides

X = ArrayInfo((3, 4096), (4096, 1), "bfloat16", 0)
W = ArrayInfo((4096,), (1,), "bfloat16", 0)


def _one_spec_per_kernel():
    seen = {}
    for spec in catalog.shipped_specs():
        for name in spec.kernels:
            seen.setdefault(name, spec)
    return sorted(seen.items())


@pytest.mark.parametrize(
    "kernel,spec", _one_spec_per_kernel(), ids=[k for k, _ in _one_spec_per_kernel()]
)
def test_flat_entry_compiles_with_one_parameter_per_field(kernel, spec):
    """Every shipped kernel has a flat entry: its pointer fields bound to buffers (two fields
    sharing one), offsets and values as parameters, in the order xla_launch passes them."""
    declared = r"\s*\(\s*const\s+__grid_constant__\s+(\w+)"
    ptype = re.search(kernel + declared, jit.expand_source(spec))[1]
    layout = jit.struct_layout(spec, ptype)
    pointers = [f.name for f in layout.fields if f.ctype == "ptr"]
    bound = {name: i // 2 for i, name in enumerate(pointers)}
    buffers = max(bound.values()) + 1
    entry = flat_entry.compile_flat(spec, kernel, layout, buffers, bound, "sm_90a")
    assert entry.name == f"{kernel}_flat"
    params = re.search(r"\.entry " + entry.name + r"\((.*?)\)", entry.ptx, re.S)[1]
    count = len(re.findall(r"\.param", params))
    assert count == buffers + len(bound) + len(flat_entry.value_fields(layout, bound))
    assert len(re.findall(r"\.entry ", entry.ptx)) == 1  # the spec's other kernels are dropped


def test_flat_entry_keeps_launch_attributes():
    spec = norm.norm_spec("rmsnorm", "bfloat16", "bfloat16", 4096)
    layout = jit.struct_layout(spec, "NormParams")
    source = flat_entry.flat_source(spec, "norm_kernel", layout, 3, {"x": 0, "out": 2})
    assert re.search(r"__global__ void __launch_bounds__\(THREADS\)\s*norm_kernel_flat", source)
    assert "static __device__ __forceinline__ void norm_kernel(const NormParams& p)" in source
    with pytest.raises(ValueError, match="no kernel"):
        flat_entry.flat_source(spec, "other_kernel", layout, 3, {"x": 0})


def test_rmsnorm_records_one_launch_on_its_own_buffers():
    prep = norm._PLAIN.prepare([X, W, None, None], 16, ("rmsnorm",))
    present = [True, True, False, False]
    steps = xla_launch.record(prep, present, (1e-6,), 0)
    assert len(steps) == 1 and steps[0].grid == (3, 1, 1)
    (n,) = xla_launch.plan(prep, present, steps)
    assert n.operands == (0, 1) and n.results == (4,)  # input, weight; out is output slot 4
    assert n.bound == {"x": 0, "residual": 0, "residual_out": 0, "weight": 1, "bias": 1, "out": 2}
    assert n.warps == 4 and n.zero == (0,)
    assert n.values[-1] == (pytest.approx(1e-6), "fp32") and n.values[-2] == (1, "i32")


def test_in_place_updates_start_by_moving_their_inputs():
    """fused_add_rmsnorm updates input and residual in place (its PyTorch and CuPy form): each
    output is aliased to its input and starts with move_kernel (a copy where XLA gave the
    output a buffer of its own, nothing where it did not); the norm then reads and writes the
    outputs, aliased again."""
    prep = norm._FUSED.prepare([X, X, W], 16, ("fused_add_rmsnorm",))
    steps = xla_launch.record(prep, [True] * 3, (1e-6,), 0)
    assert len(steps) == 1
    first, second, fused = xla_launch.plan(prep, [True] * 3, steps)
    for n, source in ((first, 0), (second, 1)):
        assert n.kernel.name == "move_kernel" and n.operands == (source,)
        assert n.results == (3 + source,) and n.aliases() == {0: 0}
        assert n.bound == {"src": 0, "dst": 1} and n.values == ((3 * 4096 * 2 // 16, "i64"),)
    assert fused.operands == (3, 4, 2) and fused.results == (3, 4)
    assert fused.aliases() == {0: 0, 1: 1}
    assert fused.bound["x"] == 3 and fused.bound["residual"] == 4  # the results' buffers


def test_the_sink_merge_moves_its_state_then_reads_it_and_the_sinks():
    """merge_sinks_in_place under JAX: v and s start by moving into their outputs (aliased),
    then the merge reads and writes the outputs and reads the sinks input."""
    from rtcinfer.attention import cascade

    v = ArrayInfo((3, 8, 128), (1024, 128, 1), "bfloat16", 0)
    s = ArrayInfo((3, 8), (8, 1), "float32", 0)
    sinks = ArrayInfo((8,), (1,), "float32", 0)
    prep = cascade._SINKS.prepare([v, s, sinks], 16, ("sinks",))
    steps = xla_launch.record(prep, [True] * 3, (), 0)
    assert len(steps) == 1
    first, second, merge = xla_launch.plan(prep, [True] * 3, steps)
    for n, source in ((first, 0), (second, 1)):
        assert n.kernel.name == "move_kernel" and n.operands == (source,)
        assert n.results == (3 + source,) and n.aliases() == {0: 0}
    assert merge.kernel.name == "merge_kernel" and merge.results == (3, 4)
    assert merge.aliases() == {0: 0, 1: 1}
    assert merge.bound["a_v"] == merge.bound["o_v"] == 3
    assert merge.bound["a_s"] == merge.bound["o_s"] == 4 and merge.bound["sinks"] == 2


def test_a_launch_through_an_input_updated_in_place_keeps_the_handler():
    """An in-place update must be written through its output's address (the input's may be
    another buffer): a launch addressing the input slot keeps the Python handler."""

    def run(stream, device, ptrs, scalars):
        _fake_launch((ptrs[0], ptrs[0], ptrs[1]))(stream, device)

    prep = _Prep(run)
    prep.outs = (norm.OutSlot((1, 4096), "bfloat16", 0, alias=True),)
    steps = xla_launch.record(prep, [True, True], (), 0)
    assert xla_launch.plan(prep, [True, True], steps) is None


def test_resident_memory_is_a_constant_on_one_gpu_only():
    """A pointer into memory kept for the process (a device's bad-index record) is baked in
    where the computation runs on one GPU; otherwise the call keeps the Python handler."""
    record = 0x7F0000100000
    launch.keep_resident(record, 32)

    def run(stream, device, ptrs, scalars):
        _fake_launch((ptrs[0], ptrs[2], record + 8))(stream, device)

    prep = _Prep(run)
    steps = xla_launch.record(prep, [True, True], (), 0)
    assert xla_launch.plan(prep, [True, True], steps) is None
    (n,) = xla_launch.plan(prep, [True, True], steps, constants=True)
    assert "weight" not in n.bound and (record + 8, "u64") in n.values


def test_fused_norm_on_new_arrays_is_native():
    """On JAX arrays fused_add_rmsnorm reads input and residual and writes two new arrays:
    nothing aliased, one native launch."""
    prep = norm._FUSED.prepare([X, X, W], 16, ("fused_add_rmsnorm", True))
    assert not any(o.alias for o in prep.outs)
    steps = xla_launch.record(prep, [True] * 3, (1e-6,), 0)
    (n,) = xla_launch.plan(prep, [True] * 3, steps)
    assert n.operands == (0, 1, 2) and n.results == (3, 4)
    assert n.bound == {"x": 0, "residual": 1, "out": 3, "residual_out": 4, "weight": 2,
                       "bias": 2}  # fmt: skip


def _fake_launch(ptrs, n_slots=3):
    spec = norm.norm_spec("rmsnorm", "bfloat16", "bfloat16", 4096)
    run = launch.Launch(launch.Kernel(spec, "norm_kernel", "NormParams"), (1, 1, 1), (128, 1, 1))
    run.params.x, run.params.out, run.params.weight = ptrs
    return run


class _Prep:
    def __init__(self, run, outs=1):
        self.run = run
        self.outs = tuple(norm.OutSlot((1, 4096), "bfloat16") for _ in range(outs))


def test_memory_the_call_does_not_own_keeps_the_python_handler():
    def run(stream, device, ptrs, scalars):
        _fake_launch((ptrs[0], ptrs[2], 0x7F0000001000))(stream, device)

    prep = _Prep(run)
    steps = xla_launch.record(prep, [True, True], (), 0)
    assert xla_launch.plan(prep, [True, True], steps) is None


def test_a_fill_becomes_bytes_to_zero_of_the_next_launch():
    def run(stream, device, ptrs, scalars):
        launch.zero_fill(ptrs[2], 8, stream)
        _fake_launch((ptrs[0], ptrs[2], ptrs[1]))(stream, device)

    prep = _Prep(run)
    steps = xla_launch.record(prep, [True, True], (), 0)
    assert isinstance(steps[0], launch.FillRecord)
    (n,) = xla_launch.plan(prep, [True, True], steps)
    assert n.results == (2,) and n.zero == (32,)


def test_copies_and_unwritten_outputs_are_not_recordable():
    def copies(stream, device, ptrs, scalars):
        launch.memcpy_async(ptrs[2], ptrs[0], 64, stream)

    assert xla_launch.record(_Prep(copies), [True, True], (), 0) is None

    def writes_one(stream, device, ptrs, scalars):
        _fake_launch((ptrs[0], ptrs[2], ptrs[1]))(stream, device)

    prep = _Prep(writes_one, outs=2)  # the second output is never written
    steps = xla_launch.record(prep, [True, True], (), 0)
    assert xla_launch.plan(prep, [True, True], steps) is None


def test_recording_leaves_nothing_behind():
    """Inside recording() a launch touches no device; after it, the thread records nothing."""
    with launch.recording() as steps:
        _fake_launch((1 << 62, 0, 0))(0, 0)
    assert len(steps) == 1
    assert getattr(launch._RECORDING, "steps", None) is None


def test_no_compile_refuses_an_uncached_flat_entry(tmp_path, monkeypatch):
    """Under RTCINFER_NO_COMPILE=1 a flat entry missing from the cache raises CacheMissError
    (native_run then keeps the Python handler, which launches the cached CUBIN)."""
    monkeypatch.setenv("RTCINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("RTCINFER_NO_COMPILE", "1")
    spec = norm.norm_spec("rmsnorm", "bfloat16", "bfloat16", 4096)
    layout = jit.struct_layout(spec, "NormParams")
    with pytest.raises(jit.CacheMissError):
        flat_entry.compile_flat(spec, "norm_kernel", layout, 3, {"x": 0, "out": 2}, "sm_90a")
    monkeypatch.delenv("RTCINFER_NO_COMPILE")
    entry = flat_entry.compile_flat(spec, "norm_kernel", layout, 3, {"x": 0, "out": 2}, "sm_90a")
    monkeypatch.setenv("RTCINFER_NO_COMPILE", "1")  # now cached: read back, not compiled
    again = flat_entry.compile_flat(spec, "norm_kernel", layout, 3, {"x": 0, "out": 2}, "sm_90a")
    assert again == entry


def test_a_multi_launch_call_chains_its_outputs():
    """A scratch output written by the first launch is passed to the second as an operand
    aliased to its result; the final output is the second launch's fresh result."""

    def run(stream, device, ptrs, scalars):  # slots: 0, 1 inputs; 2 output; 3 scratch
        _fake_launch((ptrs[0], ptrs[3], ptrs[1]))(stream, device)  # x -> scratch
        _fake_launch((ptrs[3] + 256, ptrs[2], ptrs[3]))(stream, device)  # scratch -> output

    prep = _Prep(run, outs=2)
    steps = xla_launch.record(prep, [True, True], (), 0)
    first, second = xla_launch.plan(prep, [True, True], steps)
    assert first.operands == (0, 1) and first.results == (3,)
    assert second.operands == (3,) and second.results == (3, 2)  # scratch aliased, then out
    assert second.bound == {"x": 1, "out": 2, "weight": 1} and second.offsets[0] == 256


def test_rope_on_jax_arrays_is_native(monkeypatch):
    """The RoPE `_inplace` calls on JAX arrays take the out-of-place kernel (static inplace
    False): q, k and the positions in, two new arrays out, one native launch; the in-place
    kernel (PyTorch, CuPy) aliases its outputs, which first takes a move each."""
    from rtcinfer import rope

    monkeypatch.setattr(jit, "sm_count", lambda device: 132)
    monkeypatch.setattr(launch.Kernel, "occupancy", lambda self, device, threads: 4)
    q = ArrayInfo((4, 32, 128), (4096, 128, 1), "bfloat16", 0)
    k = ArrayInfo((4, 8, 128), (1024, 128, 1), "bfloat16", 0)
    pos = ArrayInfo((4,), (1,), "int32", 0)
    present = [True, True, True, False, False]
    for in_place, launches in ((False, 1), (True, 3)):
        static = ("theta", in_place, None, False, None)
        prep = rope._POS_IDS.prepare([q, k, pos, None, None], 16, static)
        planned = xla_launch.plan(prep, present, xla_launch.record(prep, present, (1.0, 1e4), 0))
        assert len(planned) == launches
        assert planned[-1].operands[-1] == 2 and planned[-1].results == (5, 6)


def test_ptx_newer_than_jaxs_ptxas_keeps_the_handler(tmp_path, monkeypatch):
    """A ptxas that refuses the PTX's .version (or none at all) turns the native path off for
    that version, before XLA could fail at execution."""
    fake = tmp_path / "ptxas"
    fake.write_text('#!/bin/sh\ngrep -q "^.version 9.0" "$2"\n')  # accepts ISA 9.0 only
    fake.chmod(0o755)
    monkeypatch.setattr(xla_launch, "_ptxas", lambda: str(fake))
    xla_launch.ptx_accepted.cache_clear()
    assert xla_launch.ptx_accepted("9.0", "sm_90a")
    assert not xla_launch.ptx_accepted("9.5", "sm_90a")
    monkeypatch.setattr(xla_launch, "_ptxas", lambda: None)
    xla_launch.ptx_accepted.cache_clear()
    assert not xla_launch.ptx_accepted("9.0", "sm_90a")
    xla_launch.ptx_accepted.cache_clear()
    assert xla_launch._ptx_version("//\n.version 9.5\n.target sm_90a\n") == "9.5"


def test_in_place_ops_are_prepared_out_of_place_for_jax():
    """call_jax prepares a call on JAX arrays with Op.jax_static: the fused norms and the
    RoPE `_inplace` forms then write new arrays (the PyTorch and CuPy calls are unchanged)."""
    from rtcinfer import rope

    assert norm._FUSED.jax_static(("fused_add_rmsnorm",)) == ("fused_add_rmsnorm", True)
    in_place = ("theta", True, None, False, None)
    for op in (rope._RAGGED, rope._POS_IDS, rope._CACHE):
        assert op.jax_static(in_place) == ("theta", False, None, False, None)
    assert norm._PLAIN.jax_static is None


def test_append_is_native_on_one_gpu(monkeypatch):
    """append_paged_kv_cache on JAX arrays: a move of the cache into its output (nothing when
    XLA aliased them, as it normally does), then the append kernel writing through the
    output, its device's bad-index record a constant: where JAX sees one GPU."""
    import ctypes

    from rtcinfer import errors
    from rtcinfer.attention import page

    fake = errors.Record(0, 0x7F0000200000, 0x7F0000300000, ctypes.c_int32(0))
    monkeypatch.setattr(errors, "_RECORDS", {0: fake})
    launch.keep_resident(fake.device_ptr, 32)
    launch.keep_resident(fake.host_ptr, 32)
    info = lambda shape, dtype="int32": ArrayInfo(shape, dense_strides(shape), dtype, 0)  # noqa: E731
    rows = [info((4, 8, 128), "bfloat16")] * 2 + [info((4,))] * 2
    cache = info((64, 2, 16, 8, 128), "bfloat16")
    infos = [*rows, cache, info((8,)), info((3,)), info((2,))]
    prep = page._APPEND.prepare(infos, 16, ("NHD",))
    present = [True] * len(infos)
    steps = xla_launch.record(prep, present, (), 0)
    assert xla_launch.plan(prep, present, steps) is None  # several GPUs: the handler
    moved, append = xla_launch.plan(prep, present, steps, constants=True)
    assert moved.kernel.name == "move_kernel" and moved.operands == (4,)
    assert moved.results == (8,) and moved.aliases() == {0: 0}
    assert append.results == (8,) and 8 in append.operands and append.aliases()
    assert (fake.device_ptr, "u64") in append.values and (fake.host_ptr, "u64") in append.values


def test_rope_with_fp8_outputs_is_native_on_one_gpu(monkeypatch):
    """rope_quantize_fp8 on JAX arrays: one launch on its own buffers, its four outputs new;
    the form that appends (MLA's latent cache): a move of each cache into its output, then the
    kernel writing through both (the record of its device a constant)."""
    import ctypes

    from rtcinfer import errors, rope_quantize

    fake = errors.Record(0, 0x7F0000200000, 0x7F0000300000, ctypes.c_int32(0))
    monkeypatch.setattr(errors, "_RECORDS", {0: fake})
    launch.keep_resident(fake.device_ptr, 32)
    launch.keep_resident(fake.host_ptr, 32)
    info = lambda shape, dtype="int32": ArrayInfo(shape, dense_strides(shape), dtype, 0)  # noqa: E731
    q, k = info((4, 16, 64), "bfloat16"), info((4, 64), "bfloat16")
    qn, kn = info((4, 16, 512), "bfloat16"), info((4, 512), "bfloat16")
    table, pos = info((100, 64), "float32"), info((4,))
    infos = [q, k, qn, kn, table, pos, None, None, None, None]
    prep = rope_quantize._QUANTIZE.prepare(infos, 16, (False, None))
    present = [i is not None for i in infos]
    steps = xla_launch.record(prep, present, (1.0, 1.0), 0)
    (one,) = xla_launch.plan(prep, present, steps, constants=True)
    assert one.kernel.name == "rope_quantize_kernel" and one.operands == (0, 1, 2, 3, 4, 5)
    assert sorted(one.results) == [10, 11, 12, 13] and not one.aliases()
    ckv, kpe = info((8, 16, 512), "float8_e4m3fn"), info((8, 16, 64), "float8_e4m3fn")
    infos = [q, k, qn, kn, None, table, pos, ckv, kpe, info((8,)), info((5,)), info((4,)),
             info((4,)), None, None]  # fmt: skip
    prep = rope_quantize._APPEND.prepare(infos, 16, (False, None, "NHD", 16))
    present = [i is not None for i in infos]
    steps = xla_launch.record(prep, present, (1.0, 1.0), 0)
    assert xla_launch.plan(prep, present, steps) is None  # several GPUs: the handler
    *moves, append = xla_launch.plan(prep, present, steps, constants=True)
    assert [(m.kernel.name, m.operands, m.results) for m in moves] == [
        ("move_kernel", (7,), (17,)), ("move_kernel", (8,), (18,))]  # fmt: skip
    assert set(append.results) == {15, 16, 17, 18} and {17, 18} <= set(append.operands)
    assert (fake.device_ptr, "u64") in append.values and (fake.host_ptr, "u64") in append.values
