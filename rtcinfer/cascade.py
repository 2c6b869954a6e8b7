"""Merging attention states (FlashInfer's cascade primitives), LSE in base 2.

A state (v, s) is a normalized partial attention output v over some keys and the base-2
log-sum-exp s of its logits. Merging states of disjoint key sets gives the state of the union:

    m = max_k s_k;  w_k = 2 ** (s_k - m);  s = m + log2(sum_k w_k);  v = sum_k w_k v_k / sum_k w_k

Empty states (s = -inf) contribute nothing; merging only empty states gives v = 0, s = -inf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import jit
from .interop import Out, dtype_name, run
from .interop.arrays import dense
from .interop.dtypes import FLOAT_DTYPES, itemsize
from .layout import fit_vec, widest_vec
from .plan._checks import INT32_MAX

THREADS = 128


@dataclass(frozen=True)
class MergeSpec:
    dtype: str
    vec: int
    has_b: bool  # one more state from a second array (merge_state, merge_state_in_place)
    mask: bool
    source: ClassVar[str] = "merge.cu"
    kernels: ClassVar[tuple[str, ...]] = ("merge_kernel",)

    def prelude(self) -> str:
        return jit.prelude(
            T=self.dtype,
            VEC=self.vec,
            HAS_B=self.has_b,
            MASK=self.mask,
        )


def _elem_strides(arr) -> list[int]:
    return [s // arr.itemsize for s in arr.strides]


def _launch(stream, ins, outs, *, spec: MergeSpec, num_a: int):
    """ins: a_v [n, S, h, D], a_s [n, S, h] (viewed so), then b_v, b_s, mask as the spec says."""
    a_v, a_s = ins[0], ins[1]
    b_v, b_s = (ins[2], ins[3]) if spec.has_b else (a_v, a_s)
    mask = ins[-1] if spec.mask else None
    o_v, o_s = outs
    if a_v.ndim == 3:  # one state per row: [n, h, D] as [n, 1, h, D]
        a_v, a_s = a_v[:, None], a_s[:, None]
    n, _, h, d = a_v.shape
    rows = n * h
    if rows == 0:
        return
    if rows * 32 > INT32_MAX:
        raise ValueError(f"{n} x {h} rows of states exceed the kernel's int32 grid indexing")
    arrays = [a_v, b_v, o_v]
    for arr in arrays:
        if d > 1 and arr.size and arr.strides[-1] != arr.itemsize:
            raise ValueError(f"the head_dim of every v must be contiguous, got {arr.strides}")
    strides = [s for arr in arrays for s in _elem_strides(arr)[:-1]]
    vec = fit_vec(spec.vec, a_v.itemsize, [arr.data.ptr for arr in arrays], strides)
    if vec != spec.vec:
        spec = MergeSpec(spec.dtype, vec, spec.has_b, spec.mask)
    fn = jit.get_function(spec, "merge_kernel")
    args = (
        a_v, *_elem_strides(a_v)[:3], a_s, *_elem_strides(a_s),
        b_v, *_elem_strides(b_v)[:2], b_s, *_elem_strides(b_s)[:2],
        o_v, *_elem_strides(o_v)[:2], o_s, *_elem_strides(o_s),
        0 if mask is None else dense(mask, "mask"), np.int32(rows), np.int32(h), np.int32(d),
        np.int32(num_a),
    )  # fmt: skip
    grid = -(-rows * 32 // THREADS)
    fn((grid, 1, 1), (THREADS, 1, 1), args, stream=stream)


def _check_state(v, s, name: str, ndim: int):
    dtype = dtype_name(v)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: v dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if len(v.shape) != ndim or tuple(s.shape) != tuple(v.shape[:-1]):
        raise ValueError(
            f"{name}: expected v of {ndim} dims and s of v's shape without head_dim, got v "
            f"{tuple(v.shape)} and s {tuple(s.shape)}"
        )
    if dtype_name(s) != "float32":
        raise TypeError(f"{name}: s must be float32, got {dtype_name(s)}")
    if v.shape[-1] == 0:
        raise ValueError(f"{name}: head_dim must be at least 1, got v {tuple(v.shape)}")
    return dtype


def _spec(dtype: str, head_dim: int, has_b: bool, mask: bool) -> MergeSpec:
    return MergeSpec(dtype, widest_vec(max(head_dim, 1), itemsize(dtype)), has_b, mask)


def merge_state(v_a, s_a, v_b, s_b):
    """Merge two states: v_a, v_b [n, h, D] (fp16/bf16/fp32), s_a, s_b [n, h] float32.

    Returns (v [n, h, D] in v_a's dtype, s [n, h] float32) in the caller's array type.
    """
    dtype = _check_state(v_a, s_a, "a", 3)
    if _check_state(v_b, s_b, "b", 3) != dtype or tuple(v_b.shape) != tuple(v_a.shape):
        raise ValueError(
            f"v_a ({dtype} {tuple(v_a.shape)}) and v_b ({dtype_name(v_b)} {tuple(v_b.shape)}) "
            "must match in shape and dtype"
        )
    shape = tuple(v_a.shape)
    return run(
        _launch,
        [("v_a", v_a), ("s_a", s_a), ("v_b", v_b), ("s_b", s_b)],
        [Out(shape, dtype), Out(shape[:-1], "float32")],
        spec=_spec(dtype, shape[-1], True, False),
        num_a=1,
    )


def merge_state_in_place(v, s, v_other, s_other, mask=None):
    """(v, s) <- merge((v, s), (v_other, s_other)) where mask [n] (bool) is true (all rows
    without a mask). Shapes as merge_state. Returns (v, s): the updated arrays (new ones for
    JAX, whose arrays are immutable)."""
    dtype = _check_state(v, s, "v", 3)
    if _check_state(v_other, s_other, "v_other", 3) != dtype or v_other.shape != v.shape:
        raise ValueError(
            f"v ({dtype} {tuple(v.shape)}) and v_other ({dtype_name(v_other)} "
            f"{tuple(v_other.shape)}) must match in shape and dtype"
        )
    ins = [("v", v), ("s", s), ("v_other", v_other), ("s_other", s_other)]
    if mask is not None:
        if tuple(mask.shape) != tuple(v.shape[:1]) or dtype_name(mask) not in ("bool", "uint8"):
            raise ValueError(
                f"mask: expected bool [{v.shape[0]}], got {dtype_name(mask)} {tuple(mask.shape)}"
            )
        ins.append(("mask", mask))
    shape = tuple(v.shape)
    return run(
        _launch,
        ins,
        [Out(shape, dtype, alias=0), Out(shape[:-1], "float32", alias=1)],
        spec=_spec(dtype, shape[-1], True, mask is not None),
        num_a=1,
    )


def merge_states(v, s):
    """Merge S states per row: v [n, S, h, D], s [n, S, h] float32 -> (v [n, h, D], s [n, h]).

    States merge in index order (deterministic). S = 0 gives v = 0 and s = -inf.
    """
    dtype = _check_state(v, s, "v", 4)
    n, num_states, h, d = tuple(v.shape)
    return run(
        _launch,
        [("v", v), ("s", s)],
        [Out((n, h, d), dtype), Out((n, h), "float32")],
        spec=_spec(dtype, d, False, False),
        num_a=num_states,
    )


__all__ = ["MergeSpec", "merge_state", "merge_state_in_place", "merge_states"]
