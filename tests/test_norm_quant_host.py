"""The norms with an fp8 output without a GPU: the parameter block each form launches with (CuPy
arrays at made-up addresses, launches recorded), the refusals, and the launch XLA makes of a
call on JAX arrays (new arrays, nothing aliased)."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from rtcinfer import launch, norm
from rtcinfer.interop import xla_launch
from rtcinfer.interop.call import ArrayInfo

from .fakes import cupy_without_a_gpu, fake_gpu

cupy = pytest.importorskip("cupy")


@pytest.fixture
def empty(monkeypatch):
    fake_gpu(monkeypatch)
    for op in (norm._QUANT,):
        monkeypatch.setattr(op, "cache", {})
    with cupy_without_a_gpu(monkeypatch) as ndarray:
        yield ndarray


def _params(record):
    return record.kernel.params_type.from_buffer_copy(record.params)


def test_rmsnorm_quant_writes_out_from_the_input_and_reads_the_scale(empty):
    x, w = empty((3, 5, 256), np.float16)[:, 1:], empty((256,), np.float16)
    out, scale = empty((3, 4, 256), np.uint8), empty((1,), np.float32)
    with launch.recording() as steps:
        assert rtcinfer.rmsnorm_quant(out, x, w, scale, 1e-5, out_dtype="float8_e4m3fn") is out
        assert rtcinfer.rmsnorm_quant(out, x, w, 0.25, out_dtype="float8_e4m3fn") is out
    by_array, by_number = (_params(s) for s in steps)
    assert steps[0].kernel.spec.out_dtype == "float8_e4m3fn" and steps[0].grid == (12, 1, 1)
    for p in (by_array, by_number):
        assert p.x == p.residual == p.residual_out == x.data.ptr
        assert p.out == out.data.ptr and p.weight == w.data.ptr
        assert (p.xs0, p.xs1, p.os0, p.os1, p.n1) == (5 * 256, 256, 4 * 256, 256, 4)
    assert by_array.scale == scale.data.ptr and by_array.eps == pytest.approx(1e-5)
    assert by_number.scale is None and by_number.scale_value == 0.25
    assert by_number.eps == pytest.approx(1e-6)


def test_fused_add_rmsnorm_quant_updates_the_residual_and_leaves_the_input(empty):
    x, r, w = (empty(s, np.float16) for s in ((2, 512), (2, 512), (512,)))
    out, scale = empty((2, 512), np.uint8), empty((), np.float32)
    with launch.recording() as steps:
        got = rtcinfer.fused_add_rmsnorm_quant(out, x, r, w, scale, out_dtype="float8_e5m2")
    assert got[0] is out and got[1] is r
    (step,) = steps
    p = _params(step)
    assert step.kernel.spec.op == "fused_add_rmsnorm_quant"
    assert step.kernel.spec.out_dtype == "float8_e5m2" and step.kernel.spec.smem == 2 * 512 * 2
    assert p.x == x.data.ptr and p.residual == p.residual_out == r.data.ptr
    assert p.out == out.data.ptr and p.scale == scale.data.ptr


def test_refusals(empty):
    x, w = empty((2, 256), np.float16), empty((256,), np.float16)
    fp8, scale = empty((2, 256), np.uint8), empty((1,), np.float32)
    with launch.recording():
        with pytest.raises(TypeError, match="out_dtype="):
            rtcinfer.rmsnorm_quant(fp8, x, w, scale)  # uint8 storage: which fp8 type?
        with pytest.raises(TypeError, match="out_dtype: expected one of"):
            rtcinfer.rmsnorm_quant(fp8, x, w, scale, out_dtype="float16")
        with pytest.raises(TypeError, match="expected an fp8 array"):
            rtcinfer.rmsnorm_quant(empty((2, 256), np.float16), x, w, scale)
        with pytest.raises(ValueError, match=r"out: expected shape \(2, 256\)"):
            rtcinfer.rmsnorm_quant(empty((2, 128), np.uint8), x, w, scale, out_dtype="e4m3")
        with pytest.raises(ValueError, match="scale: expected a float or a float32 array"):
            rtcinfer.rmsnorm_quant(fp8, x, w, empty((2,), np.float32), out_dtype="e4m3")
        with pytest.raises(ValueError, match="residual: expected shape"):
            rtcinfer.fused_add_rmsnorm_quant(fp8, x, empty((2, 256), np.float32), w, 1.0,
                                             out_dtype="float8_e4m3fn")  # fmt: skip


def test_the_spec_of_a_quant_op_needs_its_fp8_type():
    with pytest.raises(ValueError, match="fp8 out_dtype goes with the _quant ops"):
        norm.norm_spec("rmsnorm_quant", "bfloat16", "bfloat16", 4096)
    with pytest.raises(ValueError, match="fp8 out_dtype goes with the _quant ops"):
        norm.norm_spec("rmsnorm", "bfloat16", "bfloat16", 4096, out_dtype="float8_e4m3fn")


X = ArrayInfo((3, 4096), (4096, 1), "bfloat16", 0)
W = ArrayInfo((4096,), (1,), "bfloat16", 0)
OUT = ArrayInfo((3, 4096), (4096, 1), "float8_e4m3fn", 0)
SCALE = ArrayInfo((1,), (1,), "float32", 0)


def test_on_jax_arrays_xla_launches_the_norm_into_new_arrays():
    """JAX: out (an input here, never read) and the residual come back as new arrays, so the
    call reads only its own buffers and is launched by XLA, with nothing aliased."""
    static = norm._QUANT.jax_static(("fused_add_rmsnorm_quant", None))
    present = [True] * 5 + [False]  # no beta
    prep = norm._QUANT.prepare([X, X, W, OUT, SCALE, None], 16, static)
    outs = [(o.dtype, o.source) for o in prep.outs]
    assert outs == [("float8_e4m3fn", None), ("bfloat16", None)]
    steps = xla_launch.record(prep, present, (1e-6, 1.0), 0)
    (n,) = xla_launch.plan(prep, present, steps)
    assert n.kernel.name == "norm_kernel" and n.aliases() == {}
    assert n.operands == (0, 1, 2, 4) and n.results == (6, 7)  # input, residual, weight, scale
    assert n.bound["out"] == 4 and n.bound["residual_out"] == 5 and n.bound["scale"] == 3
    present = [True, False, True, True, False, False]
    plain = norm._QUANT.prepare([X, None, W, OUT, None, None], 16,
                                norm._QUANT.jax_static(("rmsnorm_quant", None)))  # fmt: skip
    steps = xla_launch.record(plain, present, (1e-6, 0.5), 0)
    (n,) = xla_launch.plan(plain, present, steps)
    assert n.operands == (0, 2) and n.results == (6,) and n.bound["out"] == 2
    present = [True, False, True, True, False, True]  # layernorm_quant: gemma and beta
    layer = norm._QUANT.prepare([X, None, W, OUT, None, W], 16,
                                norm._QUANT.jax_static(("layernorm_quant", None)))  # fmt: skip
    steps = xla_launch.record(layer, present, (1e-6, 0.5), 0)
    (n,) = xla_launch.plan(layer, present, steps)
    assert n.operands == (0, 2, 5) and n.results == (6,)
    assert n.bound["weight"] == 1 and n.bound["bias"] == 2 and n.bound["out"] == 3


def test_layernorm_quant_reads_gemma_and_beta(empty):
    x, g, b = empty((4, 256), np.float16), empty((256,), np.float32), empty((256,), np.float32)
    out = empty((4, 256), np.uint8)
    with launch.recording() as steps:
        assert rtcinfer.layernorm_quant(out, x, g, b, 0.5, 1e-5, out_dtype="e5m2") is out
    (step,) = steps
    p = _params(step)
    assert step.kernel.spec.op == "layernorm_quant" and step.kernel.spec.weight_dtype == "float32"
    assert step.kernel.spec.out_dtype == "float8_e5m2" and step.grid == (4, 1, 1)
    assert p.x == p.residual == p.residual_out == x.data.ptr and p.out == out.data.ptr
    assert p.weight == g.data.ptr and p.bias == b.data.ptr
    assert p.scale is None and p.scale_value == 0.5 and p.eps == pytest.approx(1e-5)


def test_a_strided_weight_is_made_dense_and_a_beta_of_another_dtype_refused(empty):
    """The kernel reads the weight (gemma, beta) densely, and beta as gemma's type: strided
    weights are copied dense before the launch (Prepared.dense), a beta of another dtype is
    refused."""
    strided = ArrayInfo((4096,), (2,), "bfloat16", 0)
    plain, fused = ("rmsnorm",), ("fused_add_rmsnorm",)
    assert norm._PLAIN.prepare([X, strided, None, None], 16, plain).dense == (1,)
    assert norm._PLAIN.prepare([X, W, None, None], 16, plain).dense == ()
    assert norm._PLAIN.prepare([X, W, strided, None], 16, ("layernorm",)).dense == (2,)
    assert norm._FUSED.prepare([X, X, strided], 16, fused).dense == (2,)
    layer = ("layernorm_quant", None)
    assert norm._QUANT.prepare([X, None, strided, OUT, None, strided], 16, layer).dense == (2, 5)
    x, out = empty((2, 256), np.float16), empty((2, 256), np.uint8)
    g16, g32 = empty((256,), np.float16), empty((256,), np.float32)
    with launch.recording() as steps:
        with pytest.raises(TypeError, match=r"beta: dtype must be gemma's \(float16\)"):
            rtcinfer.layernorm(x, g16, g32)
        with pytest.raises(TypeError, match=r"beta: dtype must be gemma's \(float32\)"):
            rtcinfer.layernorm_quant(out, x, g32, g16, 1.0, out_dtype="e4m3")
    assert steps == []
