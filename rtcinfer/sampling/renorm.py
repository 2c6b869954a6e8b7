"""Exact top-k / top-p renormalization and top-k masking (FlashInfer's names and meanings).

Thresholds are exact (a radix select, cuda_src/sampling/renorm.cu), ties with the threshold are
kept, and results are deterministic.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from .. import jit
from ..interop import Fill, Op, OutSlot, Prepared, call, one_launch
from ..interop.arrays import cast, torch_compiling, with_shortcut
from ..interop.dtypes import FLOAT_DTYPES, itemsize
from ..interop.shortcut import Shortcut
from ..launch import Kernel, Launch
from ..layout import (
    fit_vec,
    leading_rows,
    row_smem_bytes,
    row_thread_choices,
    row_threads,
    widest_vec,
)


class RenormOp(enum.IntEnum):
    TOP_K_RENORM = 0
    TOP_P_RENORM = 1
    TOP_K_MASK = 2
    TOP_K_SELECT = 3


RENORM_OPS = {
    "top_k_renorm": RenormOp.TOP_K_RENORM,
    "top_p_renorm": RenormOp.TOP_P_RENORM,
    "top_k_mask": RenormOp.TOP_K_MASK,
    "top_k_select": RenormOp.TOP_K_SELECT,  # top_k (sampling/topk.py)
}
# top-k's cut (layout.row_threads)
BY_RANK = frozenset({"top_k_renorm", "top_k_mask", "top_k_select"})


@dataclass(frozen=True)
class RenormSpec:
    op: str  # a key of RENORM_OPS
    dtype: str
    vec: int
    threads: int
    source: ClassVar[str] = "sampling/renorm.cu"
    kernels: ClassVar[tuple[str, ...]] = ("renorm_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("RenormParams",)  # crossing the seam

    @property
    def cap(self) -> int:
        return 8 * self.threads

    def prelude(self) -> str:
        return jit.prelude(
            OP=RENORM_OPS[self.op],
            T=self.dtype,
            VEC=self.vec,
            THREADS=self.threads,
            CAP=self.cap,
        )


def renorm_spec(op: str, dtype: str, vocab: int, rows: int = 1, sm_count: int = 132):
    vec = widest_vec(vocab, itemsize(dtype))
    return RenormSpec(op, dtype, vec, row_threads(vocab, rows, sm_count, op in BY_RANK))


_NUMBERS = (int, float, np.integer, np.floating)


def clamp_int32(k: int) -> int:
    """An int count (top_k) as the kernels take it: clamped to int32, where <= 0 and >= vocab
    already mean the same."""
    return max(-(2**31), min(k, 2**31 - 1))


def per_row(value, kind: type) -> tuple:
    """(scalar, None) for a per-row parameter given as a number (kind int or float; ints are
    clamped to int32, where <= 0 and >= vocab already mean the same); (kind(0), array) for an
    array of one entry per row (its shape checked by the op's prepare), converted as FlashInfer
    does by the caller's framework when its dtype is another: to int32 for kind int (int64
    kept), to float32 for kind float (a min_p from torch.full((B,), 1) is int64)."""
    if isinstance(value, _NUMBERS) and not isinstance(value, bool):
        if kind is int:
            return clamp_int32(int(value)), None
        return float(value), None
    if kind is int:
        return 0, cast(value, "int32", keep=("int64",))
    return 0.0, cast(value, "float32")


# Each op's parameter (its name in messages, the dtypes of its per-row array); the field of
# RenormParams an array's pointer goes to, by its dtype.
_PARAMS = {
    "top_k_renorm": ("top_k", ("int32", "int64")),
    "top_p_renorm": ("top_p", ("float32",)),
    "top_k_mask": ("top_k", ("int32", "int64")),
}
_ARRAY_FIELDS = {"int32": "top_k_arr", "int64": "top_k_arr64", "float32": "top_p_arr"}


def _prepare(infos, _align: int, static: tuple) -> Prepared:
    """Slots (probs or logits, top_k or top_p array) -> out [rows, vocab] in the input's dtype.
    Scalars: (top_k, top_p)."""
    (op,) = static
    x, param = infos
    rows, vocab, xs = checked_rows(x, "logits" if op == "top_k_mask" else "probs")
    if param is not None:
        name, dtypes = _PARAMS[op]
        if param.dtype not in dtypes or param.shape != (rows,):
            raise ValueError(
                f"{name}: expected a scalar or a {'/'.join(dtypes)} array of shape "
                f"({rows},), got a rank-{len(param.shape)} {param.dtype} array of shape "
                f"{param.shape}"
            )
    launch = row_launch(op, x, xs, vocab)  # the output: allocated dense
    pointers = (("input", 0), ("out", 2))
    pointers += () if param is None else ((_ARRAY_FIELDS[param.dtype], 1),)
    fill = Fill(pointers, (("top_k_val", 0), ("top_p_val", 1)))
    dense = () if param is None else (1,)
    return one_launch((OutSlot(x.shape, x.dtype),), launch, fill, dense=dense)


def checked_rows(x, arg: str) -> tuple[int, int, int]:
    """(rows, vocab, row stride) of x [rows, vocab] (ArrayInfo, `arg` its name in messages),
    checked: a float dtype, two dims, a nonempty row."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{arg}: dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"{arg}: expected shape (batch, vocab) with vocab > 0, got {x.shape}")
    return x.shape[0], x.shape[1], leading_rows(x, arg)[2]


def row_launch(op: str, x, xs: int, out_stride: int) -> Launch:
    """The launch of `op` (a key of RENORM_OPS) over the rows of x (checked_rows', `xs` its row
    stride), a CTA a row: in_stride, out_stride and vocab written."""
    rows, vocab = x.shape
    spec = renorm_spec(op, x.dtype, vocab, rows, jit.device_limits(x.device)[0])
    spec = replace(spec, vec=fit_vec(spec.vec, x.itemsize, x.align, [xs, out_stride]))
    kernel = Kernel(spec, "renorm_kernel", "RenormParams", row_smem_bytes(spec.threads))
    launch = Launch(kernel, (rows, 1, 1), (spec.threads, 1, 1))
    p = launch.params
    p.in_stride, p.out_stride, p.vocab = xs, out_stride, vocab
    return launch


_OPS = {
    "top_k_renorm": Op("top_k_renorm_probs", ("probs", "top_k"), _prepare),
    "top_p_renorm": Op("top_p_renorm_probs", ("probs", "top_p"), _prepare),
    "top_k_mask": Op("top_k_mask_logits", ("logits", "top_k"), _prepare),
}


def _threshold_op(op: str, x, param, kind: type):
    if torch_compiling(x):  # a custom op node (rtcinfer/torch_ops.py)
        from .. import torch_ops

        return torch_ops.threshold(op, x, param, kind)
    value, array = per_row(param, kind)
    scalars = (value, 1.0) if kind is int else (0, value)
    return call(_OPS[op], (x, array), (op,), scalars)


def _shortcut(op: str, arg: str, param: str, kind: type) -> Shortcut:
    """How _threshold_op calls `op` for a number `param` (an int top_k, a float top_p), for
    the shortcut (interop/shortcut.py); any other param takes the function."""
    scalars = f"(clamp_int32({param}), 1.0)" if kind is int else f"(0, {param})"
    return Shortcut(_OPS[op], (arg, None), repr((op,)), scalars, (clamp_int32,),
                    f"type({param}) is {kind.__name__}")  # fmt: skip


@with_shortcut(_shortcut("top_k_renorm", "probs", "top_k", int))
def top_k_renorm_probs(probs, top_k, is_deterministic=False):
    """Keep the top-k probabilities of each row and renormalize.

    v = k-th largest of probs[b]; out[b] = where(probs[b] >= v, probs[b], 0) / sum(that)
    probs: [batch, vocab] float32/float16/bfloat16; top_k: int or [batch] int32/int64
    (<= 0 or >= vocab keeps the whole row). Ties with v are kept. Deterministic always.
    """
    return _threshold_op("top_k_renorm", probs, top_k, int)


@with_shortcut(_shortcut("top_p_renorm", "probs", "top_p", float))
def top_p_renorm_probs(probs, top_p, is_deterministic=False):
    """Keep the smallest top set of probabilities whose mass reaches top_p; renormalize.

    kept = {j : sum(p[p > p[j]]) < top_p * sum(p)} | {argmax p};  out = p * kept / sum(p * kept)
    top_p: float or [batch] float32 (>= 1 keeps the row). Ties with the threshold are kept.
    """
    return _threshold_op("top_p_renorm", probs, top_p, float)


@with_shortcut(_shortcut("top_k_mask", "logits", "top_k", int))
def top_k_mask_logits(logits, top_k):
    """Set all but the top-k logits of each row to -inf.

    v = k-th largest of logits[b]; out[b] = where(logits[b] >= v, logits[b], -inf)
    logits: [batch, vocab] float32/float16/bfloat16; top_k: int or [batch] int32/int64
    (<= 0 or >= vocab keeps the row). Ties with v are kept; NaN becomes -inf.
    """
    return _threshold_op("top_k_mask", logits, top_k, int)


def specs_for(vocab: int, logits_dtypes=("float32",)) -> list[RenormSpec]:
    """What a serving loop may launch (warmup) on rows of `vocab`: top_k_renorm_probs and
    top_p_renorm_probs on float32 probabilities (softmax's), top_k_mask_logits on logits of
    `logits_dtypes`, each at every block size a batch may get (row_thread_choices)."""
    threads = row_thread_choices(vocab)
    ops = [(op, "float32") for op in ("top_k_renorm", "top_p_renorm")]
    ops += [("top_k_mask", d) for d in logits_dtypes]
    return [RenormSpec(op, d, widest_vec(vocab, itemsize(d)), t) for op, d in ops for t in threads]


__all__ = ["RenormOp", "RenormSpec", "clamp_int32", "per_row", "renorm_spec", "specs_for",
           "top_k_mask_logits", "top_k_renorm_probs", "top_p_renorm_probs"]  # fmt: skip
