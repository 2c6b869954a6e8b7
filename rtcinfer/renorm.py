"""Exact top-k / top-p renormalization and top-k masking (FlashInfer's names and meanings).

Thresholds are exact (a radix select, cuda_src/renorm.cu), ties with the threshold are kept,
and results are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from . import jit
from .interop import Out, dtype_name, run
from .interop.arrays import dense
from .interop.dtypes import FLOAT_DTYPES, itemsize
from .layout import fit_vec, leading_rows, row_smem_bytes, row_threads, widest_vec

RENORM_OPS = ("top_k_renorm", "top_p_renorm", "top_k_mask")


@dataclass(frozen=True)
class RenormSpec:
    op: str
    dtype: str
    vec: int
    threads: int
    source: ClassVar[str] = "renorm.cu"
    kernels: ClassVar[tuple[str, ...]] = ("renorm_kernel",)

    @property
    def cap(self) -> int:
        return 8 * self.threads

    def prelude(self) -> str:
        return jit.prelude(
            OP=RENORM_OPS.index(self.op),
            T=self.dtype,
            VEC=self.vec,
            THREADS=self.threads,
            CAP=self.cap,
        )


def renorm_spec(op: str, dtype: str, vocab: int, rows: int = 1, sm_count: int = 132):
    vec = widest_vec(vocab, itemsize(dtype))
    return RenormSpec(op, dtype, vec, row_threads(vocab, rows, sm_count))


def _launch(stream, ins, outs, *, op: str, k: int, p: float):
    x, y = ins[0], outs[0]
    rows, vocab = x.shape
    if rows == 0:
        return
    _, _, xs, _ = leading_rows(x, "logits" if op == "top_k_mask" else "probs")
    _, _, ys, _ = leading_rows(y, "out")
    spec = renorm_spec(op, dtype_name(x), vocab, rows, jit.sm_count(x.device.id))
    spec = replace(spec, vec=fit_vec(spec.vec, x.itemsize, [x.data.ptr, y.data.ptr], [xs, ys]))
    arr = dense(ins[1], "top_k" if op != "top_p_renorm" else "top_p") if len(ins) > 1 else None
    smem = row_smem_bytes(spec.threads)
    fn = jit.get_function(spec, "renorm_kernel", dynamic_smem=smem)
    args = (
        x, np.int64(xs), y, np.int64(ys), np.int32(vocab),
        arr if arr is not None and arr.dtype == np.int32 else 0,
        arr if arr is not None and arr.dtype == np.int64 else 0,
        np.int32(k), arr if arr is not None and arr.dtype == np.float32 else 0, np.float32(p),
    )  # fmt: skip
    fn((rows, 1, 1), (spec.threads, 1, 1), args, stream=stream, shared_mem=smem)


def _threshold_op(op, x, param, name, dtypes, kind):
    shape, dtype = tuple(x.shape), dtype_name(x)
    arg = "logits" if op == "top_k_mask" else "probs"
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{arg}: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if len(shape) != 2 or shape[1] == 0:
        raise ValueError(f"{arg}: expected shape (batch, vocab) with vocab > 0, got {shape}")
    inputs = [(arg, x)]
    k, p = 0, 1.0
    if isinstance(param, (int, float, np.integer, np.floating)) and not isinstance(param, bool):
        if kind is int:
            k = max(-(2**31), min(int(param), 2**31 - 1))
        else:
            p = float(param)
    else:
        p_shape, p_dtype = tuple(param.shape), dtype_name(param)
        if p_dtype not in dtypes or p_shape != (shape[0],):
            raise ValueError(
                f"{name}: expected a scalar or a {'/'.join(dtypes)} array of shape "
                f"({shape[0]},), got {p_dtype} of shape {p_shape}"
            )
        inputs.append((name, param))
    return run(_launch, inputs, [Out(shape, dtype)], op=op, k=k, p=p)


def top_k_renorm_probs(probs, top_k, is_deterministic=False):
    """Keep the top-k probabilities of each row and renormalize.

    v = k-th largest of probs[b]; out[b] = where(probs[b] >= v, probs[b], 0) / sum(that)
    probs: [batch, vocab] float32/float16/bfloat16; top_k: int or [batch] int32/int64
    (<= 0 or >= vocab keeps the whole row). Ties with v are kept. Deterministic always.
    """
    return _threshold_op("top_k_renorm", probs, top_k, "top_k", ("int32", "int64"), int)


def top_p_renorm_probs(probs, top_p, is_deterministic=False):
    """Keep the smallest top set of probabilities whose mass reaches top_p; renormalize.

    kept = {j : sum(p[p > p[j]]) < top_p * sum(p)} | {argmax p};  out = p * kept / sum(p * kept)
    top_p: float or [batch] float32 (>= 1 keeps the row). Ties with the threshold are kept.
    """
    return _threshold_op("top_p_renorm", probs, top_p, "top_p", ("float32",), float)


def top_k_mask_logits(logits, top_k):
    """Set all but the top-k logits of each row to -inf.

    v = k-th largest of logits[b]; out[b] = where(logits[b] >= v, logits[b], -inf)
    logits: [batch, vocab] float32/float16/bfloat16; top_k: int or [batch] int32/int64
    (<= 0 or >= vocab keeps the row). Ties with v are kept; NaN becomes -inf.
    """
    return _threshold_op("top_k_mask", logits, top_k, "top_k", ("int32", "int64"), int)


__all__ = ["RenormSpec", "renorm_spec", "top_k_mask_logits", "top_k_renorm_probs",
           "top_p_renorm_probs"]  # fmt: skip
