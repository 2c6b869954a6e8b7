"""top_k without a GPU: the launch each call makes (CuPy arrays at made-up addresses, launches
recorded), its outputs and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from rtcinfer import jit, launch
from rtcinfer.sampling import topk

from .fakes import cupy_without_a_gpu, fake_gpu

cupy = pytest.importorskip("cupy")


@pytest.fixture
def empty(monkeypatch):
    fake_gpu(monkeypatch)
    monkeypatch.setattr(jit, "device_limits", lambda device: (132, 227 * 1024))
    monkeypatch.setattr(topk._OP, "cache", {})
    with cupy_without_a_gpu(monkeypatch) as ndarray:
        yield ndarray


def _params(step):
    return step.kernel.params_type.from_buffer_copy(step.params)


def test_a_call_launches_one_cta_a_row_into_values_and_indices(empty):
    x = empty((6, 2 * 32000), np.float32)[:, :32000]  # rows strided
    with launch.recording() as steps:
        values, indices = rtcinfer.top_k(x, 50)
    assert values.shape == (6, 50) and values.dtype == np.float32
    assert indices.shape == (6, 50) and indices.dtype == np.int64
    (step,) = steps
    p = _params(step)
    assert step.kernel.spec.op == "top_k_select" and step.grid == (6, 1, 1)
    assert p.input == x.data.ptr and p.in_stride == 2 * 32000 and p.vocab == 32000
    assert p.values_out == values.data.ptr and p.indices_out == indices.data.ptr
    assert p.top_k_val == 50 and p.top_k_arr is None and p.top_k_arr64 is None
    assert p.ties_last == 0
    with launch.recording() as steps:
        rtcinfer.top_k(x, 50, tie_break=2)  # the ties of the largest indices: another launch
    assert _params(steps[0]).ties_last == 1 and len(topk._OP.cache) == 2


def test_k_of_the_whole_row_and_of_one(empty):
    x = empty((2, 100), np.float16)
    with launch.recording() as steps:
        assert rtcinfer.top_k(x, 100)[0].shape == (2, 100)
        assert rtcinfer.top_k(x, 1)[1].shape == (2, 1)
    assert [_params(s).top_k_val for s in steps] == [100, 1]


def test_jax_without_64_bit_types_gets_int32_indices(monkeypatch):
    """A JAX call's static ends with "jax": its indices are int32 where JAX has no int64."""
    from rtcinfer.interop.call import ArrayInfo

    fake_gpu(monkeypatch)
    monkeypatch.setattr(jit, "device_limits", lambda device: (132, 227 * 1024))
    x = ArrayInfo((4, 1000), (1000, 1), "float32", 0)
    for x64, index, field in ((False, "int32", "indices32_out"), (True, "int64", "indices_out")):
        monkeypatch.setattr(topk, "_jax_x64", lambda x64=x64: x64)
        prep = topk._OP.prepare([x], 16, topk._OP.jax_static((10, 0)))
        assert [o.dtype for o in prep.outs] == ["float32", index]
        assert (field, 2) in prep.fill.pointers
    assert topk._OP.prepare([x], 16, (10, 0)).outs[1].dtype == "int64"  # PyTorch, CuPy


def test_refusals(empty):
    x = empty((2, 100), np.float32)
    with launch.recording() as steps:
        for k in (0, 101, -1):
            with pytest.raises(ValueError, match=r"k: expected 1 <= k <= 100"):
                rtcinfer.top_k(x, k)
        with pytest.raises(TypeError, match="k: expected an int"):
            rtcinfer.top_k(x, True)
        with pytest.raises(TypeError, match="k: expected an int"):
            rtcinfer.top_k(x, 2.0)
        with pytest.raises(ValueError, match="tie_break=3: expected 0, 1 or 2"):
            rtcinfer.top_k(x, 5, tie_break=3)
        with pytest.raises(TypeError, match="input: dtype must be one of"):
            rtcinfer.top_k(empty((2, 100), np.int32), 5)
        with pytest.raises(ValueError, match=r"input: expected shape \(batch, vocab\)"):
            rtcinfer.top_k(empty((2, 3, 100), np.float32), 5)
    assert steps == []
