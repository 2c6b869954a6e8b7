"""Interop without a GPU: dtype names, framework detection, clear errors, view layouts."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from rtcinfer import interop, layout, rmsnorm
from rtcinfer.interop import dtypes

from .fakes import FakeArray


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


def test_host_array_is_refused_by_name():
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(TypeError, match=r"input: expected a CUDA array .* host numpy.ndarray"):
        rmsnorm(x, np.ones(8, np.float32))


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
    strided = FakeArray((4,), 1, strides=(2,))
    with pytest.raises(ValueError, match="cannot be made dense inside a CUDA-graph capture"):
        call._densify_cupy(prep, [strided], [0])
    contiguous = FakeArray((4,), 1)
    assert call._densify_cupy(prep, [contiguous], [0])[0][0] is contiguous


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
