"""Gated activations: silu_and_mul, gelu_and_mul, gelu_tanh_and_mul (FlashInfer's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import jit
from .interop import Out, dtype_name, run
from .interop.dtypes import FLOAT_DTYPES, itemsize
from .layout import common_rows, fit_vec, widest_vec

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
THREADS, UNROLL = 128, 2


@dataclass(frozen=True)
class ActivationSpec:
    act: str
    dtype: str
    vec: int
    source: ClassVar[str] = "activation.cu"
    kernels: ClassVar[tuple[str, ...]] = ("act_and_mul_kernel",)

    def prelude(self) -> str:
        return jit.prelude(
            ACT=ACTIVATIONS.index(self.act),
            T=self.dtype,
            VEC=self.vec,
            THREADS=THREADS,
            UNROLL=UNROLL,
        )


def _launch(stream, ins, outs, *, spec: ActivationSpec):
    (x,), (y,) = ins, outs
    d = y.shape[-1]
    rows, n1, ((xs0, xs1), (ys0, ys1)) = common_rows([x, y], ["input", "out"])
    if rows == 0 or d == 0:
        return
    vec = fit_vec(spec.vec, itemsize(spec.dtype), [x.data.ptr, y.data.ptr], [xs0, xs1, ys0, ys1, d])
    if vec != spec.vec:
        spec = ActivationSpec(spec.act, spec.dtype, vec)
    fn = jit.get_function(spec, "act_and_mul_kernel")
    tiles = -(-d // (THREADS * UNROLL * spec.vec))
    args = (x, xs0, xs1, y, ys0, ys1, np.int32(n1), np.int32(d))
    fn((rows, tiles, 1), (THREADS, 1, 1), args, stream=stream)


def _act_and_mul(act: str, input, out):
    dtype = dtype_name(input)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"input: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    shape = tuple(input.shape)
    if not shape or shape[-1] % 2:
        raise ValueError(f"input: the last dimension must be even (2 * d), got shape {shape}")
    d = shape[-1] // 2
    spec = ActivationSpec(act, dtype, widest_vec(d, itemsize(dtype)))
    return run(_launch, [("input", input)], [Out((*shape[:-1], d), dtype, out)], spec=spec)


def silu_and_mul(input, *, out=None):
    """out = silu(input[..., :d]) * input[..., d:], silu(a) = a * sigmoid(a). input: [..., 2d]."""
    return _act_and_mul("silu", input, out)


def gelu_and_mul(input, *, out=None):
    """out = gelu(input[..., :d]) * input[..., d:], exact (erf) GELU. input: [..., 2d]."""
    return _act_and_mul("gelu", input, out)


def gelu_tanh_and_mul(input, *, out=None):
    """out = gelu_tanh(input[..., :d]) * input[..., d:], tanh-approximated GELU."""
    return _act_and_mul("gelu_tanh", input, out)


def specs_for(intermediate: int, dtypes=("bfloat16", "float16")) -> list[ActivationSpec]:
    return [ActivationSpec("silu", d, widest_vec(intermediate, itemsize(d))) for d in dtypes]
