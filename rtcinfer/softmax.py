"""Softmax with temperature (FlashInfer's `flashinfer.sampling.softmax`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import jit
from .interop import Out, dtype_name, run
from .interop.arrays import dense
from .interop.dtypes import FLOAT_DTYPES, itemsize
from .layout import fit_vec, leading_rows, widest_vec


@dataclass(frozen=True)
class SoftmaxSpec:
    dtype: str
    vec: int
    threads: int
    source: ClassVar[str] = "softmax.cu"
    kernels: ClassVar[tuple[str, ...]] = ("softmax_kernel",)

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


def _launch(stream, ins, outs, *, scalar: float):
    logits, probs = ins[0], outs[0]
    rows, vocab = logits.shape
    if rows == 0:
        return
    _, _, stride, _ = leading_rows(logits, "logits")  # the vocabulary axis must be contiguous
    spec = softmax_spec(dtype_name(logits), vocab)
    vec = fit_vec(spec.vec, logits.itemsize, [logits.data.ptr], [stride])
    if vec != spec.vec:
        spec = softmax_spec(spec.dtype, vocab, vec)
    fn = jit.get_function(spec, "softmax_kernel")
    temperature = dense(ins[1], "temperature") if len(ins) > 1 else 0
    args = (logits, np.int64(stride), probs, np.int64(vocab), np.int32(vocab), temperature,
            np.float32(scalar))  # fmt: skip
    fn((rows, 1, 1), (spec.threads, 1, 1), args, stream=stream)


def softmax(logits, temperature=None, enable_pdl=None):
    """Row softmax with temperature, in fp32.

    probs = exp(logits / t - max(logits / t)) / sum(exp(logits / t - max(logits / t)), -1)
    logits: [batch, vocab] float32/float16/bfloat16 (rows may be strided); temperature: None
    (1), a float, or a [batch] float32 array. Rows of -inf give zeros; a NaN makes its row NaN.
    enable_pdl is accepted for FlashInfer compatibility and ignored. Returns [batch, vocab]
    float32 in the caller's array type.
    """
    shape, dtype = tuple(logits.shape), dtype_name(logits)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if len(shape) != 2 or shape[1] == 0:
        raise ValueError(f"logits: expected shape (batch, vocab) with vocab > 0, got {shape}")
    inputs = [("logits", logits)]
    scalar = 1.0
    if temperature is None or isinstance(temperature, (int, float, np.integer, np.floating)):
        scalar = 1.0 if temperature is None else float(temperature)
    else:
        t_shape, t_dtype = tuple(temperature.shape), dtype_name(temperature)
        if t_dtype != "float32" or t_shape != (shape[0],):
            raise ValueError(
                f"temperature: expected a float or a float32 array of shape ({shape[0]},), "
                f"got {t_dtype} of shape {t_shape}"
            )
        inputs.append(("temperature", temperature))
    return run(_launch, inputs, [Out(shape, "float32")], scalar=scalar)


__all__ = ["SoftmaxSpec", "softmax", "softmax_spec"]
