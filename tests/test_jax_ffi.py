"""CPU tests of the ctypes XLA FFI bridge (rtcinfer.interop.jax_ffi).

Handlers here work on host memory through BufferView.ptr, the way GPU handlers work on device
memory. The fake-API tests drive the CUDA target's code path (stream lookup, errors, metadata)
without a GPU by handing it a hand-built XLA_FFI_CallFrame.
"""

import ctypes
import subprocess
import sys
import threading

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
ml_dtypes = pytest.importorskip("ml_dtypes")

from rtcinfer.interop import jax_ffi, jax_ffi_abi  # noqa: E402
from rtcinfer.interop.jax_ffi import DTYPE_NAMES, BufferView, add_handler, ffi_call  # noqa: E402


def np_dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name, name))


def host(view: BufferView) -> np.ndarray:
    """A writable numpy view over a host buffer described by a BufferView."""
    dtype = np_dtype(view.dtype)
    nbytes = int(np.prod(view.shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(view.shape, dtype)
    raw = (ctypes.c_char * nbytes).from_address(view.ptr)
    return np.frombuffer(raw, dtype).reshape(view.shape)


def enable_x64():
    ctx = getattr(jax, "enable_x64", None)
    if ctx is None:  # jax < 0.7 has it under jax.experimental
        from jax.experimental import enable_x64 as ctx
    return ctx(True)


def spec(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def call_cpu(handler_id, args, out_shapes, **kw):
    return ffi_call(handler_id, args, out_shapes, platform="cpu", **kw)


def axpy(stream, inputs, outputs):
    assert stream == 0
    x, y = (host(v) for v in inputs)
    host(outputs[0])[...] = 2 * x + y


def copy(stream, inputs, outputs):
    host(outputs[0])[...] = host(inputs[0])


AXPY = add_handler(axpy)
COPY = add_handler(copy)


@pytest.mark.parametrize("jit", [False, True])
def test_axpy_float32(jit):
    x = jnp.arange(15, dtype=jnp.float32).reshape(3, 5)
    y = jnp.full((3, 5), 0.5, jnp.float32)

    def f(x, y):
        return call_cpu(AXPY, [x, y], [spec(x)])[0]

    out = (jax.jit(f) if jit else f)(x, y)
    np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(x) + 0.5)


def test_bfloat16_copy_is_bit_exact():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 33)), jnp.bfloat16)
    out = jax.jit(lambda x: call_cpu(COPY, [x], [spec(x)])[0])(x)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(x).view(np.uint16))


def test_int32_and_dtype_names_seen_by_handler():
    seen = []

    def affine(stream, inputs, outputs):
        seen.append((inputs[0].dtype, outputs[0].dtype))
        host(outputs[0])[...] = 3 * host(inputs[0]) - 7

    hid = add_handler(affine)
    x = jnp.arange(-5, 5, dtype=jnp.int32)
    out = jax.jit(lambda x: call_cpu(hid, [x], [spec(x)])[0])(x)
    np.testing.assert_array_equal(np.asarray(out), 3 * np.arange(-5, 5) - 7)
    assert seen == [("int32", "int32")]


def test_multiple_outputs_with_mixed_dtypes():
    def split(stream, inputs, outputs):
        x = host(inputs[0])
        host(outputs[0])[...] = x.sum(axis=1)
        host(outputs[1])[...] = (x > 0).sum(axis=1)
        host(outputs[2])[...] = x.T

    hid = add_handler(split)
    x = jnp.asarray([[1.0, -2.0, 3.0], [-1.0, -1.0, 4.0]], jnp.float32)
    shapes = [
        jax.ShapeDtypeStruct((2,), jnp.float32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.ShapeDtypeStruct((3, 2), jnp.float32),
    ]
    for f in (lambda x: call_cpu(hid, [x], shapes), jax.jit(lambda x: call_cpu(hid, [x], shapes))):
        total, positives, transposed = f(x)
        np.testing.assert_array_equal(np.asarray(total), [2.0, 2.0])
        np.testing.assert_array_equal(np.asarray(positives), [2, 1])
        np.testing.assert_array_equal(np.asarray(transposed), np.asarray(x).T)


def test_scalar_and_empty_shapes():
    shapes = []

    def record(stream, inputs, outputs):
        shapes.append(([v.shape for v in inputs], [v.shape for v in outputs]))
        host(outputs[0])[...] = host(inputs[0]) + 1
        host(outputs[1])[...] = host(inputs[1])

    hid = add_handler(record)
    scalar = jnp.float32(41.0)
    empty = jnp.zeros((0, 4), jnp.int32)
    f = jax.jit(lambda a, b: call_cpu(hid, [a, b], [spec(a), spec(b)]))
    out_scalar, out_empty = f(scalar, empty)
    assert out_scalar.shape == () and float(out_scalar) == 42.0
    assert out_empty.shape == (0, 4)
    assert shapes == [([(), (0, 4)], [(), (0, 4)])]


@pytest.mark.parametrize("donate", [False, True])
def test_input_output_alias_updates_in_place(donate):
    pointers = []

    def add_into(stream, inputs, outputs):
        pointers.append((inputs[0].ptr, outputs[0].ptr))
        host(outputs[0])[...] += host(inputs[1])  # the output already holds input 0

    hid = add_handler(add_into)

    def f(acc, delta):
        return call_cpu(hid, [acc, delta], [spec(acc)], input_output_aliases={0: 0})[0]

    acc = jnp.arange(6, dtype=jnp.float32) + 0
    delta = jnp.full(6, 10.0, jnp.float32)
    out = jax.jit(f, donate_argnums=(0,) if donate else ())(acc, delta)
    np.testing.assert_array_equal(np.asarray(out), np.arange(6) + 10.0)
    assert pointers[-1][0] == pointers[-1][1]
    if not donate:
        np.testing.assert_array_equal(np.asarray(acc), np.arange(6))
    assert f(jnp.zeros(6, jnp.float32), delta)[0] == 10.0  # eager path too


def test_handler_id_dispatch():
    def plus_one(stream, inputs, outputs):
        host(outputs[0])[...] = host(inputs[0]) + 1

    def times_ten(stream, inputs, outputs):
        host(outputs[0])[...] = host(inputs[0]) * 10

    a, b = add_handler(plus_one), add_handler(times_ten)
    assert a != b
    assert add_handler(plus_one) == a and add_handler(times_ten) == b

    @jax.jit
    def f(x):
        y = call_cpu(a, [x], [spec(x)])[0]
        return call_cpu(b, [y], [spec(y)])[0], call_cpu(a, [y], [spec(y)])[0]

    ten_x, plus_two = f(jnp.arange(3, dtype=jnp.float32))
    np.testing.assert_array_equal(np.asarray(ten_x), [10.0, 20.0, 30.0])
    np.testing.assert_array_equal(np.asarray(plus_two), [2.0, 3.0, 4.0])


def test_handler_exception_becomes_python_error():
    def broken(stream, inputs, outputs):
        raise ValueError("kernel launch refused: bad tile size")

    hid = add_handler(broken)
    x = jnp.ones(4, jnp.float32)
    with pytest.raises(Exception, match="bad tile size") as info:
        jax.block_until_ready(jax.jit(lambda x: call_cpu(hid, [x], [spec(x)])[0])(x))
    assert "ValueError" in str(info.value)
    with pytest.raises(Exception, match="bad tile size"):
        jax.block_until_ready(call_cpu(hid, [x], [spec(x)]))
    # The process and the FFI target still work afterwards.
    np.testing.assert_array_equal(np.asarray(call_cpu(COPY, [x], [spec(x)])[0]), np.ones(4))


def test_unknown_handler_id():
    x = jnp.ones(2, jnp.float32)
    with pytest.raises(KeyError):
        call_cpu(10**9, [x], [spec(x)])
    # Bypass the Python-side check: the FFI target itself must refuse the id.
    name = jax_ffi._ensure_registered("cpu")
    raw = jax.ffi.ffi_call(name, [spec(x)])
    with pytest.raises(Exception, match="no rtcinfer FFI handler with id 1000000000"):
        jax.block_until_ready(raw(x, handler=np.int64(10**9)))


def test_platform_names():
    assert jax_ffi.target_name("cuda") == "rtcinfer_cuda"
    assert jax_ffi.target_name("GPU") == "rtcinfer_cuda"
    assert jax_ffi.target_name("cpu") == "rtcinfer_cpu"
    with pytest.raises(ValueError):
        ffi_call(COPY, [jnp.ones(1)], [spec(jnp.ones(1))], platform="tpu")


def test_dtype_table():
    assert DTYPE_NAMES[1] == "bool"
    assert DTYPE_NAMES[4] == "int32"
    assert DTYPE_NAMES[5] == "int64"
    assert DTYPE_NAMES[6] == "uint8"
    assert DTYPE_NAMES[8] == "uint32"
    assert DTYPE_NAMES[10] == "float16"
    assert DTYPE_NAMES[11] == "float32"
    assert DTYPE_NAMES[12] == "float64"
    assert DTYPE_NAMES[16] == "bfloat16"
    assert DTYPE_NAMES[19] == "float8_e5m2"
    assert DTYPE_NAMES[20] == "float8_e4m3fn"
    assert len(set(DTYPE_NAMES.values())) == len(DTYPE_NAMES)
    for name in DTYPE_NAMES.values():
        assert np_dtype(name).name == name


ROUND_TRIP = [
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
]  # fmt: skip


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_dtype_round_trip_through_xla(name):
    if not hasattr(jnp, name):
        pytest.skip(f"this jax has no {name}")
    seen = []

    def record_copy(stream, inputs, outputs):
        seen.append((inputs[0].dtype, outputs[0].dtype))
        host(outputs[0])[...] = host(inputs[0])

    hid = add_handler(record_copy)
    bits = np.random.default_rng(1).integers(0, 2, (5, 3)).astype(np_dtype(name))
    with enable_x64():
        x = jnp.asarray(bits)
        assert x.dtype == np_dtype(name)
        out = jax.jit(lambda x: call_cpu(hid, [x], [spec(x)])[0])(x)
        np.testing.assert_array_equal(np.asarray(out), bits)
    assert seen == [(name, name)]


def test_add_handler_is_thread_safe_and_stable():
    funcs = [lambda s, i, o, k=k: None for k in range(64)]
    results: list[list[int]] = [[] for _ in range(8)]

    def worker(slot):
        results[slot] = [add_handler(fn) for fn in funcs]

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == results[0] for r in results)
    assert len(set(results[0])) == len(funcs)
    with pytest.raises(TypeError):
        add_handler(42)


def test_import_does_not_import_jax():
    code = "import sys, rtcinfer.interop.jax_ffi; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- hand-built call frames

_FAKE_STREAM = 0xC0FFEE


class FakeXla:
    """A hand-built XLA_FFI_Api and call frame, to drive a target without XLA."""

    def __init__(self, stream_error: int | None = None):
        self.errors: list[tuple[int, str]] = []
        self.stream_calls = 0

        def error_create(args):
            self.errors.append((args.contents.errc, args.contents.message.decode()))
            return 0xE0 + len(self.errors)

        def stream_get(args):
            self.stream_calls += 1
            if stream_error is not None:
                return stream_error
            args.contents.stream = _FAKE_STREAM
            return None

        self._fns = [jax_ffi._ErrorCreateFn(error_create), jax_ffi._StreamGetFn(stream_get)]
        self.api = jax_ffi._Api(struct_size=ctypes.sizeof(jax_ffi._Api))
        self.api.error_create = ctypes.cast(self._fns[0], ctypes.c_void_p).value
        self.api.stream_get = ctypes.cast(self._fns[1], ctypes.c_void_p).value

    def frame(self, handler_id: int, stage: int = 3) -> jax_ffi._CallFrame:
        self.data = np.arange(6, dtype=np.float32)
        self.out = np.zeros(6, dtype=np.float32)
        self.dims = (ctypes.c_int64 * 2)(2, 3)
        self.bufs = [
            jax_ffi._Buffer(ctypes.sizeof(jax_ffi._Buffer), None, 11, a.ctypes.data, 2, self.dims)
            for a in (self.data, self.out)
        ]
        self.types = (ctypes.c_int * 1)(1)
        self.in_ptr = (ctypes.c_void_p * 1)(ctypes.addressof(self.bufs[0]))
        self.out_ptr = (ctypes.c_void_p * 1)(ctypes.addressof(self.bufs[1]))
        self.name = b"handler"
        self.span = jax_ffi._ByteSpan(ctypes.cast(self.name, ctypes.c_void_p).value, 7)
        self.span_ptr = (ctypes.POINTER(jax_ffi._ByteSpan) * 1)(ctypes.pointer(self.span))
        self.value = ctypes.c_int64(handler_id)
        self.scalar = jax_ffi._Scalar(5, ctypes.addressof(self.value))
        self.attr_ptr = (ctypes.c_void_p * 1)(ctypes.addressof(self.scalar))
        self.attr_types = (ctypes.c_int * 1)(3)
        size = ctypes.sizeof
        frame = jax_ffi._CallFrame(struct_size=size(jax_ffi._CallFrame), stage=stage)
        frame.api = ctypes.pointer(self.api)
        frame.args = jax_ffi._List(size(jax_ffi._List), None, 1, self.types, self.in_ptr)
        frame.rets = jax_ffi._List(size(jax_ffi._List), None, 1, self.types, self.out_ptr)
        frame.attrs = jax_ffi._Attrs(
            size(jax_ffi._Attrs), None, 1, self.attr_types, self.span_ptr, self.attr_ptr
        )
        return frame


def test_cuda_target_gets_stream_from_xla():
    calls = []

    def launch(stream, inputs, outputs):
        calls.append((stream, inputs, outputs))
        host(outputs[0])[...] = host(inputs[0]) * 2

    fake = FakeXla()
    frame = fake.frame(add_handler(launch))
    target = jax_ffi._make_target(on_gpu=True)
    assert target(ctypes.pointer(frame)) is None
    assert fake.errors == [] and fake.stream_calls == 1
    [(stream, inputs, outputs)] = calls
    assert stream == _FAKE_STREAM
    assert inputs == [BufferView(fake.data.ctypes.data, (2, 3), "float32")]
    assert outputs == [BufferView(fake.out.ctypes.data, (2, 3), "float32")]
    np.testing.assert_array_equal(fake.out, np.arange(6) * 2)


def test_cpu_target_passes_null_stream():
    calls = []
    fake = FakeXla()
    frame = fake.frame(add_handler(lambda s, i, o: calls.append(s)))
    assert jax_ffi._make_target(on_gpu=False)(ctypes.pointer(frame)) is None
    assert calls == [0] and fake.stream_calls == 0


def test_target_reports_errors_through_error_create():
    def broken(stream, inputs, outputs):
        raise RuntimeError("no launch today")

    target = jax_ffi._make_target(on_gpu=True)
    fake = FakeXla()
    assert target(ctypes.pointer(fake.frame(add_handler(broken)))) == 0xE1
    [(code, message)] = fake.errors
    assert code == 13 and "no launch today" in message  # INTERNAL
    assert target(ctypes.pointer(fake.frame(10**9))) == 0xE2
    assert fake.errors[1][0] == 3 and "10" in fake.errors[1][1]  # INVALID_ARGUMENT


def test_stream_get_error_is_passed_back_without_calling_handler():
    calls = []
    fake = FakeXla(stream_error=0xBAD)
    frame = fake.frame(add_handler(lambda s, i, o: calls.append(s)))
    assert jax_ffi._make_target(on_gpu=True)(ctypes.pointer(frame)) == 0xBAD
    assert calls == [] and fake.errors == []


def test_only_execute_stage_runs_the_handler():
    calls = []
    fake = FakeXla()
    hid = add_handler(lambda s, i, o: calls.append(s))
    target = jax_ffi._make_target(on_gpu=True)
    for stage in (0, 1, 2):  # INSTANTIATE, PREPARE, INITIALIZE
        assert target(ctypes.pointer(fake.frame(hid, stage=stage))) is None
    assert calls == []


@pytest.mark.parametrize("on_gpu, traits", [(True, 1), (False, 0)])
def test_metadata_query(on_gpu, traits):
    # XLA asks with api == NULL and an XLA_FFI_Metadata_Extension; the struct XLA allocates is
    # larger than the C STRUCT_SIZE it reports (newer headers append state_type_id).
    storage = (ctypes.c_char * 64)()
    metadata = jax_ffi._Metadata.from_buffer(storage)
    metadata.struct_size = jax_ffi._end(jax_ffi._Metadata, "traits")
    extension = jax_ffi._MetadataExtension()
    extension.extension_base.struct_size = ctypes.sizeof(jax_ffi._MetadataExtension)
    extension.extension_base.type = 1
    extension.metadata = ctypes.pointer(metadata)
    frame = jax_ffi._CallFrame(struct_size=ctypes.sizeof(jax_ffi._CallFrame), stage=3)
    frame.extension_start = ctypes.cast(ctypes.pointer(extension), jax_ffi_abi._ExtPtr)
    assert jax_ffi._make_target(on_gpu=on_gpu)(ctypes.pointer(frame)) is None
    version = metadata.api_version
    assert (version.major_version, version.minor_version) == jax_ffi._API_VERSION
    assert version.struct_size == 24
    assert metadata.traits == traits
    assert bytes(storage[40:]) == bytes(24)  # nothing written past the reported struct
