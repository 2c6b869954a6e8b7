"""Softmax with temperature (FlashInfer's `flashinfer.sampling.softmax`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .. import jit
from ..interop import Op, OutSlot, Prepared, call
from ..interop.arrays import torch_compiling
from ..interop.dtypes import FLOAT_DTYPES, itemsize
from ..launch import Kernel, Launch
from ..layout import fit_vec, leading_rows, widest_vec


@dataclass(frozen=True)
class SoftmaxSpec:
    dtype: str
    vec: int
    threads: int
    source: ClassVar[str] = "sampling/softmax.cu"
    kernels: ClassVar[tuple[str, ...]] = ("softmax_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("SoftmaxParams",)  # crossing the seam

    def prelude(self) -> str:
        return jit.prelude(
            T=self.dtype,
            VEC=self.vec,
            THREADS=self.threads,
        )


def softmax_spec(dtype: str, vocab: int, vec: int | None = None) -> SoftmaxSpec:
    """About 8 vectors per thread, 32 to 1024 threads."""
    vec = vec or widest_vec(vocab, itemsize(dtype))
    threads = 32
    while threads < 1024 and threads * vec * 8 < vocab:
        threads *= 2
    return SoftmaxSpec(dtype, vec, threads)


def prepare_softmax(infos, _align: int, static: tuple) -> Prepared:
    """Slots (logits, temperature array) -> probs [rows, vocab] float32. Scalars: (temperature,)
    for rows without the array."""
    logits, temperature = infos
    shape, dtype = logits.shape, logits.dtype
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if len(shape) != 2 or shape[1] == 0:
        raise ValueError(f"logits: expected shape (batch, vocab) with vocab > 0, got {shape}")
    rows, vocab = shape
    if temperature is not None and (temperature.dtype, temperature.shape) != ("float32", (rows,)):
        raise ValueError(
            f"temperature: expected a float or a float32 array of shape ({rows},), "
            f"got {temperature.dtype} of shape {temperature.shape}"
        )
    _, _, stride, _ = leading_rows(logits, "logits")  # the vocabulary axis must be contiguous
    spec = softmax_spec(dtype, vocab)
    vec = fit_vec(spec.vec, itemsize(dtype), logits.align, [stride])
    if vec != spec.vec:
        spec = softmax_spec(dtype, vocab, vec)
    launch = Launch(Kernel(spec, "softmax_kernel", "SoftmaxParams"), (rows, 1, 1),
                    (spec.threads, 1, 1))  # fmt: skip
    p = launch.params
    p.in_stride, p.out_stride, p.vocab = stride, vocab, vocab  # the output is allocated dense

    def run(stream, device, ptrs, scalars):
        with launch.lock:
            p.logits, p.temperature_arr, p.probs = ptrs
            (p.temperature_val,) = scalars
            launch(stream, device)

    dense = () if temperature is None else (1,)
    return Prepared((OutSlot(shape, "float32"),), run, preload=launch.preload, dense=dense)


_OP = Op("softmax", ("logits", "temperature"), prepare_softmax)


def softmax(logits, temperature=None, enable_pdl=None):
    """Row softmax with temperature, in fp32.

    probs = exp(logits / t - max(logits / t)) / sum(exp(logits / t - max(logits / t)), -1)
    logits: [batch, vocab] float32/float16/bfloat16 (rows may be strided); temperature: None
    (1), a float, or a [batch] float32 array. Rows of -inf give zeros; a NaN makes its row NaN.
    enable_pdl is accepted for FlashInfer compatibility and ignored. Returns [batch, vocab]
    float32 in the caller's array type.
    """
    if torch_compiling(logits):  # a custom op node (rtcinfer/torch_ops.py)
        from .. import torch_ops

        return torch_ops.softmax(logits, temperature)
    if temperature is None:
        return call(_OP, (logits, None), (), (1.0,))
    if isinstance(temperature, (int, float, np.integer, np.floating)):
        return call(_OP, (logits, None), (), (float(temperature),))
    return call(_OP, (logits, temperature), (), (1.0,))


def specs_for(vocab: int, dtypes=("float32",)) -> list[SoftmaxSpec]:
    """What a serving loop may launch (warmup): softmax of logits of each dtype, aligned rows."""
    return [softmax_spec(d, vocab) for d in dtypes]


__all__ = ["SoftmaxSpec", "prepare_softmax", "softmax", "softmax_spec", "specs_for"]
