"""Gated activations: silu_and_mul, gelu_and_mul, gelu_tanh_and_mul (FlashInfer's names)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from . import jit
from .interop import Fill, Op, OutSlot, Prepared, call, dense_strides, one_launch, row_count
from .interop.arrays import compilable
from .interop.dtypes import FLOAT_DTYPES, itemsize
from .interop.shortcut import Shortcut
from .launch import Kernel, Launch
from .layout import common_rows, fit_vec, widest_vec

THREADS, UNROLL = 128, 2


class Activation(enum.IntEnum):
    SILU = 0
    GELU = 1
    GELU_TANH = 2


ACTIVATIONS = {"silu": Activation.SILU, "gelu": Activation.GELU, "gelu_tanh": Activation.GELU_TANH}


@dataclass(frozen=True)
class ActivationSpec:
    act: str
    dtype: str
    vec: int
    source: ClassVar[str] = "activation.cu"
    kernels: ClassVar[tuple[str, ...]] = ("act_and_mul_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("ActivationParams",)  # crossing the seam

    def prelude(self) -> str:
        return jit.prelude(
            ACT=ACTIVATIONS[self.act],
            T=self.dtype,
            VEC=self.vec,
            THREADS=THREADS,
            UNROLL=UNROLL,
        )


def _prepare(infos, align: int, static: tuple) -> Prepared:
    """Slots (input, out) -> one output [..., d]."""
    (act,) = static
    x, out = infos
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"input: dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")
    if not x.shape or x.shape[-1] % 2:
        raise ValueError(f"input: the last dimension must be even (2 * d), got shape {x.shape}")
    d = x.shape[-1] // 2
    shape = (*x.shape[:-1], d)
    if out is not None and (out.shape != shape or out.dtype != x.dtype):
        raise ValueError(
            f"out: expected shape {shape} and dtype {x.dtype}, "
            f"got shape {out.shape} and dtype {out.dtype}"
        )
    y = out if out is not None else x._replace(shape=shape, strides=dense_strides(shape))
    rows, n1, ((xs0, xs1), (ys0, ys1)) = common_rows([x, y], ["input", "out"])
    spec = ActivationSpec(act, x.dtype, widest_vec(max(d, 1), itemsize(x.dtype)))
    vec = fit_vec(spec.vec, itemsize(spec.dtype), align, [xs0, xs1, ys0, ys1, d])
    if vec != spec.vec:
        spec = ActivationSpec(act, x.dtype, vec)
    tiles = -(-d // (THREADS * UNROLL * spec.vec))
    kernel = Kernel(spec, "act_and_mul_kernel", "ActivationParams")
    launch = Launch(kernel, (rows, tiles, 1), (THREADS, 1, 1))
    p = launch.params
    p.xs0, p.xs1, p.os0, p.os1, p.n1, p.d = xs0, xs1, ys0, ys1, n1, d

    outs = (OutSlot(shape, x.dtype, 1 if out is not None else None),)
    return one_launch(outs, launch, Fill((("x", 0), ("out", 2))), rows=row_count(x))


_OP = Op("act_and_mul", ("input", "out"), _prepare, given=("out",), rows=("input", "out"))


@compilable("input", Shortcut(_OP, ("input", "out"), '("silu",)'))
def silu_and_mul(input, out=None, enable_pdl=None):
    """out = silu(input[..., :d]) * input[..., d:], silu(a) = a * sigmoid(a). input: [..., 2d].
    enable_pdl: accepted for FlashInfer compatibility (rmsnorm's docstring)."""
    return call(_OP, (input, out), ("silu",))


@compilable("input", Shortcut(_OP, ("input", "out"), '("gelu",)'))
def gelu_and_mul(input, out=None, enable_pdl=None):
    """out = gelu(input[..., :d]) * input[..., d:], exact (erf) GELU. input: [..., 2d]."""
    return call(_OP, (input, out), ("gelu",))


@compilable("input", Shortcut(_OP, ("input", "out"), '("gelu_tanh",)'))
def gelu_tanh_and_mul(input, out=None, enable_pdl=None):
    """out = gelu_tanh(input[..., :d]) * input[..., d:], tanh-approximated GELU."""
    return call(_OP, (input, out), ("gelu_tanh",))


def specs_for(intermediate: int, dtypes=("bfloat16", "float16")) -> list[ActivationSpec]:
    return [ActivationSpec("silu", d, widest_vec(intermediate, itemsize(d))) for d in dtypes]
