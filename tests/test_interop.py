"""Interop without a GPU: dtype names, framework detection, clear errors, view layouts."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from rtcinfer import interop, layout, rmsnorm
from rtcinfer.interop import dtypes

from .fakes import FakeArray, fake_gpu


@pytest.mark.parametrize(
    "given,name",
    [
        (np.float16, "float16"),
        (np.dtype("float32"), "float32"),
        (ml_dtypes.bfloat16, "bfloat16"),
        (ml_dtypes.float8_e4m3fn, "float8_e4m3fn"),
        ("torch.bfloat16", "bfloat16"),
        ("torch.float8_e5m2", "float8_e5m2"),
        ("half", "float16"),
        ("e4m3", "float8_e4m3fn"),
        (np.int32, "int32"),
    ],
)
def test_dtype_names(given, name):
    assert dtypes.normalize(given) == name


def test_dtype_tables():
    assert dtypes.cuda_type("bfloat16") == "__nv_bfloat16"
    assert dtypes.itemsize("float8_e5m2") == 1
    assert dtypes.numpy_dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="complex64"):
        dtypes.cuda_type("complex64")


def test_framework_detection():
    assert interop.framework(np.zeros(2)) == "numpy"
    assert interop.framework(object()) == "dlpack"
    assert interop.framework([1.0]) == interop.framework((1.0,)) == "sequence"


@pytest.mark.parametrize("sequence", [[[0.0] * 8] * 4, ((0.0,) * 8,) * 4])
def test_lists_and_tuples_are_refused_by_name(sequence):
    kind = type(sequence).__name__
    with pytest.raises(TypeError, match=rf"^input must be an array \(PyTorch, JAX, CuPy or "
                                        rf"DLPack\), got {kind}$"):  # fmt: skip
        rmsnorm(sequence, np.ones(8, np.float32))


def test_a_list_after_an_array_is_refused_by_name():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^weight must be an array .* got list$"):
        rmsnorm(torch.zeros(4, 8), [1.0] * 8)


def test_host_array_is_refused_by_name():
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(TypeError, match=r"input: expected a CUDA array .* host numpy.ndarray"):
        rmsnorm(x, np.ones(8, np.float32))


def test_jax_arrays_off_the_gpu_are_refused_eagerly_and_inside_jit():
    """Before XLA could look for an FFI handler on the CPU: JAX's own placement decides, the
    array's devices eagerly, the mesh or the default backend under jax.jit."""
    jax = pytest.importorskip("jax")
    cpu = jax.devices("cpu")[0]
    x, w = (jax.device_put(a, cpu) for a in (jax.numpy.ones((4, 128)), jax.numpy.ones(128)))
    message = r"input: expected a JAX array on a GPU, got one on \{'cpu'\}"
    with pytest.raises(TypeError, match=message):
        rmsnorm(x, w)
    with jax.set_mesh(jax.make_mesh((1,), ("x",), devices=[cpu])):
        with pytest.raises(TypeError, match=message):
            jax.jit(rmsnorm)(x, w)
    if jax.default_backend() == "cpu":
        with pytest.raises(TypeError, match=message):
            jax.jit(rmsnorm)(x, w)


def test_a_known_signature_off_the_gpu_is_named_when_xla_fails(monkeypatch):
    """Where concrete JAX arrays are is checked with a new signature; a later call of that
    signature with arrays on the CPU fails in XLA (no CPU handler) and is told which one."""
    jax = pytest.importorskip("jax")
    fake_gpu(monkeypatch)
    op = interop.Op("toy", ("x",), lambda infos, align, static: interop.Prepared(
        (interop.OutSlot(infos[0].shape, infos[0].dtype),), lambda *args: None))  # fmt: skip
    x = jax.device_put(jax.numpy.ones(4), jax.devices("cpu")[0])
    with monkeypatch.context() as m:
        m.setattr(interop.arrays, "jax_platforms", lambda x: {"gpu"})  # the signature is new
        with pytest.raises(Exception, match="rtcinfer_cuda"):  # XLA has no handler on the CPU
            interop.call(op, (x,))
    assert op.cache  # prepared: the next call is a known signature
    with pytest.raises(TypeError, match=r"^x: expected a JAX array on a GPU, got one on \{'cpu'"):
        interop.call(op, (x,))
    interop.release(op)


def test_what_comes_with_a_jax_array_is_refused_by_name(monkeypatch):
    """Host arrays, sequences and CPU tensors beside a JAX array (one on a GPU, as far as the
    check can tell)."""
    jax = pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(interop.arrays, "jax_platforms", lambda x: {"gpu"})
    x = jax.numpy.ones((4, 128))
    for weight, message in (
        (np.ones(128, np.float32), r"weight: expected a CUDA array .* host numpy.ndarray of shape "
                                   r"\(128,\); move it to the GPU first"),
        ((1.0,) * 128, r"weight must be an array \(PyTorch, JAX, CuPy or DLPack\), got tuple"),
        (torch.ones(128), "weight: expected a CUDA tensor, got a torch.Tensor on cpu"),
    ):  # fmt: skip
        with pytest.raises(TypeError, match=message):
            rmsnorm(x, weight)


def test_object_without_dlpack_is_refused():
    pytest.importorskip("cupy")

    class Thing:
        shape = (3,)

    with pytest.raises(TypeError, match=r"weight: expected a CUDA array with __dlpack__"):
        interop.as_cupy(Thing(), "weight")


def test_torch_cpu_tensor_is_refused():
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    with pytest.raises(TypeError, match="input: expected a CUDA tensor, got a torch.Tensor on cpu"):
        interop.as_cupy(torch.zeros(3), "input")


def _fake(shape, strides, dtype="float16"):
    """An array as a prepare function sees it: strides in elements."""
    return interop.ArrayInfo(tuple(shape), tuple(strides), dtype, 0)


def _info(arr: np.ndarray):
    return _fake(arr.shape, [s // arr.itemsize for s in arr.strides], arr.dtype.name)


@pytest.mark.parametrize(
    "shape,strides,expected",
    [
        ((4, 64), (64, 1), (4, 1, 64, 0)),
        ((4, 64), (128, 1), (4, 1, 128, 0)),
        ((2, 3, 64), (192, 64, 1), (6, 1, 64, 0)),  # contiguous leading dims merge
        ((2, 3, 64), (1000, 100, 1), (6, 3, 1000, 100)),
        ((64,), (1,), (1, 1, 0, 0)),
        ((2, 1, 3, 64), (500, 500, 100, 1), (6, 3, 500, 100)),  # size-1 dims drop out
    ],
)
def test_leading_rows(shape, strides, expected):
    assert layout.leading_rows(_fake(shape, strides), "x") == expected


def test_leading_rows_errors():
    with pytest.raises(ValueError, match="x: the last dimension must be contiguous"):
        layout.leading_rows(_fake((4, 64), (1, 4)), "x")
    with pytest.raises(ValueError, match="do not fold into two strided levels"):
        layout.leading_rows(_fake((2, 3, 5, 64), (10000, 1000, 100, 1)), "x")


def _row_offsets(arr) -> np.ndarray:
    """Element offset of every row (all leading indices, row-major) of a NumPy view."""
    lead = np.indices(arr.shape[:-1]).reshape(len(arr.shape) - 1, -1).T
    steps = np.array([s // arr.itemsize for s in arr.strides[:-1]])
    return lead @ steps if len(steps) else np.zeros(1, np.int64)


@pytest.mark.parametrize(
    "make_x, make_out",
    [
        (lambda b: b[:, :3], lambda b: np.empty((2, 3, 8), b.dtype)),  # strided in, dense out
        (lambda b: np.empty((2, 3, 8), b.dtype), lambda b: b[:, :3]),  # dense in, strided out
        (lambda b: b[:, 1:], lambda b: b[:, :3][::-1]),  # both strided, one reversed
        (lambda b: b[:, :3], lambda b: b[:, 1:]),
    ],
)  # fmt: skip
def test_common_rows_fold_every_array_the_same_way(make_x, make_out):
    """The row split (n1) is shared by all arrays of a launch, so it must be right for each:
    row r of array a starts at (r // n1) * s0_a + (r % n1) * s1_a."""
    base = np.zeros((2, 4, 8), np.float16)
    x, out = make_x(base), make_out(base)
    rows, n1, layouts = layout.common_rows([_info(x), _info(out)], ["input", "out"])
    assert rows == 6
    r = np.arange(rows)
    for arr, (s0, s1) in zip((x, out), layouts, strict=True):
        np.testing.assert_array_equal((r // n1) * s0 + (r % n1) * s1, _row_offsets(arr))


def test_common_rows_errors_name_the_arrays():
    a = np.zeros((2, 3, 5, 8), np.float32)
    with pytest.raises(ValueError, match="leading dimensions differ"):
        layout.common_rows([_info(a), _info(a[:1])], ["input", "out"])
    x = a[:, :, :4]  # dims 0 and 1 merge, 1 and 2 do not
    out = np.zeros((2, 5, 4, 8), np.float32)[:, :3]  # dims 1 and 2 merge, 0 and 1 do not
    x, out = _info(x), _info(out)
    assert layout.leading_rows(x, "input")[0] == layout.leading_rows(out, "out")[0] == 24
    with pytest.raises(ValueError, match="input, out together: .* do not fold"):
        layout.common_rows([x, out], ["input", "out"])


def test_strided_index_arrays_are_not_copied_inside_a_graph_capture(monkeypatch):
    """A copy made during capture would be replayed into a buffer freed after the launch; a
    contiguous array needs no copy and passes."""
    import importlib

    import cupy

    from rtcinfer.interop import Prepared

    call = importlib.import_module("rtcinfer.interop.call")  # the module, not its call()
    capturing = type("Stream", (), {"is_capturing": lambda self: True})()
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *a: capturing)
    prep = Prepared((), lambda *a: None, dense=(0,))
    op = call.Op("op", ("x",), lambda *a: prep)
    strided = FakeArray((4,), 1, strides=(2,))
    with pytest.raises(ValueError, match="cannot be made dense inside a CUDA-graph capture"):
        call._densify_cupy(op, prep, [strided], [0], 0)
    contiguous = FakeArray((4,), 1)
    assert call._densify_cupy(op, prep, [contiguous], [0], 0)[0][0] is contiguous
    # nor launched on another stream (launching_on): the copy would be ordered on the caller's
    with pytest.raises(RuntimeError, match="given its outputs"):
        call._densify_cupy(op, prep, [strided], [0], 7)
    assert call._densify_cupy(op, prep, [contiguous], [0], 7)[0][0] is contiguous


def test_vector_width():
    assert layout.widest_vec(4096, 2) == 8 and layout.widest_vec(4096, 4) == 4
    assert layout.widest_vec(1001, 2) == 1 and layout.widest_vec(4100, 2) == 4
    assert layout.fit_vec(8, 2, 16, [4096]) == 8
    assert layout.fit_vec(8, 2, 2, [4096]) == 1
    assert layout.fit_vec(8, 2, 8, [4096]) == 4  # 8-byte aligned pointers: 4 bf16 at a time
    assert layout.fit_vec(8, 2, 16, [4100]) == 4


_WITHOUT_CUPY = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cupy", "cupy_backends", "cuda", "torch", "jax"):
            raise ImportError(f"{name} is blocked")
sys.meta_path.insert(0, Block())
import rtcinfer
from rtcinfer.plan.decode import plan_decode
plan = plan_decode([0, 3, 3, 10], [5, 0, 16], 16, 8, num_sms=132, ctas_per_sm=2)
print(plan.num_work, sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax")))
"""


def test_base_install_imports_and_plans_without_cupy_torch_or_jax():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _WITHOUT_CUPY], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "[]"  # neither torch nor jax was imported


def test_import_loads_the_gpu_stack_only_where_there_is_a_gpu():
    """`import rtcinfer` with everything installed never imports PyTorch or JAX; CuPy (with
    ml_dtypes) and the CUDA bindings load with it only on a machine with an NVIDIA device node
    (so that the first call is fast there), and nowhere else (so that the import is: most of a
    second less on a slow CPU)."""
    import ast
    import subprocess
    import sys

    from rtcinfer import gpu

    code = (
        "import sys, rtcinfer; print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'cupy', 'cupy_backends', 'cuda', 'ml_dtypes', 'torch', 'jax', 'jaxlib'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    loaded = set(ast.literal_eval(done.stdout.split("\n")[-2]))
    assert not loaded & {"torch", "jax", "jaxlib"}
    if gpu.nvidia_device_node():
        assert {"cupy", "cuda"} <= loaded
    else:
        assert not loaded


def test_cast_converts_in_the_callers_framework():
    """Per-row sampling parameters of another dtype are converted by their own framework (as
    FlashInfer's .int() / .float()): JAX here (on the CPU), the dtype kept when it is the
    target or an accepted one, other objects passed through for the call path to refuse."""
    import jax.numpy as jnp

    from rtcinfer.interop.arrays import cast
    from rtcinfer.sampling.renorm import per_row

    ints = jnp.ones(2, jnp.int32)
    j = cast(ints, "float32")
    assert j.dtype == jnp.float32 and j.tolist() == [1.0, 1.0]
    assert cast(ints, "int32", keep=("int64",)) is ints and cast(j, "float32") is j
    host = np.ones(2, np.int64)
    assert cast(host, "float32") is host  # refused by name later: a host array
    k, arr = per_row(jnp.array([5.0, 7.0]), int)
    assert k == 0 and arr.dtype == jnp.int32 and arr.tolist() == [5, 7]
    p, arr = per_row(jnp.array([1, 0]), float)
    assert p == 0.0 and arr.dtype == jnp.float32
    assert per_row(3, int) == (3, None) and per_row(0.5, float) == (0.5, None)


def test_cast_of_torch_tensors():
    """The same with PyTorch (.to), where it is installed: torch.full((B,), 1) is int64."""
    torch = pytest.importorskip("torch")
    from rtcinfer.interop.arrays import cast
    from rtcinfer.sampling.renorm import per_row

    t = torch.full((3,), 1)
    out = cast(t, "float32")
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 1.0, 1.0]
    assert cast(t, "int32", keep=("int64",)) is t
    k, arr = per_row(torch.tensor([5.0, 7.0]), int)
    assert k == 0 and arr.dtype == torch.int32 and arr.tolist() == [5, 7]
