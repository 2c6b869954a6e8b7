"""RMSNorm, Gemma RMSNorm, fused residual add + RMSNorm, LayerNorm (FlashInfer's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import jit
from .interop import Out, dtype_name, run
from .interop.dtypes import FLOAT_DTYPES, itemsize
from .layout import common_rows, fit_vec, widest_vec

MAX_SMEM = 200 * 1024  # a row must fit in shared memory (Hopper and Ampere allow ~227 KB)
OPS = ("rmsnorm", "gemma_rmsnorm", "fused_add_rmsnorm", "gemma_fused_add_rmsnorm", "layernorm")


@dataclass(frozen=True)
class NormSpec:
    op: str
    dtype: str
    weight_dtype: str
    hidden: int
    vec: int
    threads: int
    source: ClassVar[str] = "norm.cu"
    kernels: ClassVar[tuple[str, ...]] = ("norm_kernel",)

    @property
    def smem(self) -> int:
        """Dynamic shared memory: the row (and the residual row for the fused ops)."""
        return self.hidden * itemsize(self.dtype) * (2 if "fused" in self.op else 1)

    def prelude(self) -> str:
        return jit.prelude(
            OP=OPS.index(self.op),
            T=self.dtype,
            W=self.weight_dtype,
            HIDDEN=self.hidden,
            VEC=self.vec,
            THREADS=self.threads,
        )


def norm_spec(op: str, dtype: str, weight_dtype: str, hidden: int, vec: int | None = None):
    """The spec for rows of `hidden` elements: ~4 vectors per thread, 32 to 1024 threads."""
    vec = vec or widest_vec(hidden, itemsize(dtype))
    nvec = hidden // vec
    threads = min(1024, -(-nvec // 128) * 32)  # ceil(nvec / 4) rounded up to whole warps
    row_bytes = hidden * itemsize(dtype) * (2 if "fused" in op else 1)
    if row_bytes > MAX_SMEM:
        limit = MAX_SMEM // (row_bytes // hidden)
        raise ValueError(f"hidden size {hidden} exceeds {limit}, the widest {dtype} {op} row")
    return NormSpec(op, dtype, weight_dtype, hidden, vec, threads)


def _check(x, weight, names=("input", "weight")) -> tuple[int, str]:
    dtype, hidden = dtype_name(x), (x.shape[-1] if len(x.shape) else 0)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{names[0]}: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if tuple(weight.shape) != (hidden,):
        raise ValueError(f"{names[1]}: expected shape ({hidden},), got {tuple(weight.shape)}")
    if dtype_name(weight) not in (dtype, "float32"):
        raise TypeError(f"{names[1]}: dtype must be {dtype} or float32, got {dtype_name(weight)}")
    return hidden, dtype


def _launch(stream, ins, outs, *, spec: NormSpec, eps: float):
    fused = "fused" in spec.op
    x, residual, y = (outs[0], outs[1], outs[0]) if fused else (ins[0], ins[0], outs[0])
    weight = ins[2] if fused else ins[1]
    bias = ins[2] if spec.op == "layernorm" else weight
    rows, n1, layouts = common_rows([x, residual, y], ["input", "residual", "out"])
    if rows == 0:
        return
    (xs0, xs1), (rs0, rs1), (ys0, ys1) = layouts
    vec = fit_vec(
        spec.vec,
        itemsize(spec.dtype),
        [a.data.ptr for a in (x, residual, y, weight, bias)],
        [xs0, xs1, rs0, rs1, ys0, ys1],
    )
    if vec != spec.vec:
        spec = norm_spec(spec.op, spec.dtype, spec.weight_dtype, spec.hidden, vec)
    fn = jit.get_function(spec, "norm_kernel", dynamic_smem=spec.smem)
    args = (x, xs0, xs1, residual, rs0, rs1, y, ys0, ys1, weight, bias, np.int32(n1))
    args = (*args, np.float32(eps))
    fn((rows, 1, 1), (spec.threads, 1, 1), args, shared_mem=spec.smem, stream=stream)


def _norm(op, x, weight, eps, out, bias=None):
    hidden, dtype = _check(x, weight)
    spec = norm_spec(op, dtype, dtype_name(weight), hidden)
    inputs = [("input", x), ("weight", weight)] + ([("beta", bias)] if bias is not None else [])
    return run(_launch, inputs, [Out(tuple(x.shape), dtype, out)], spec=spec, eps=float(eps))


def rmsnorm(input, weight, eps: float = 1e-6, *, out=None):
    """RMSNorm over the last dimension.

    out = input * rsqrt(mean(input**2, -1, keepdims=True) + eps) * weight   (fp32 math)
    input: [..., hidden] fp16/bf16/fp32 (rows may be strided); weight: [hidden], same dtype or
    fp32. Returns `out` (allocated when not given) in the caller's array type.
    """
    return _norm("rmsnorm", input, weight, eps, out)


def gemma_rmsnorm(input, weight, eps: float = 1e-6, *, out=None):
    """Gemma's RMSNorm: out = input * rsqrt(mean(input**2, -1) + eps) * (1 + weight)."""
    return _norm("gemma_rmsnorm", input, weight, eps, out)


def layernorm(input, gemma, beta, eps: float = 1e-6, *, out=None):
    """LayerNorm: out = (input - mean) * rsqrt(var + eps) * gemma + beta (biased variance).

    gemma (the scale, FlashInfer's name for gamma), beta: [hidden], the input's dtype or fp32.
    """
    _check(input, beta, ("input", "beta"))
    return _norm("layernorm", input, gemma, eps, out, bias=beta)


def _fused(op, input, residual, weight, eps):
    hidden, dtype = _check(input, weight)
    if tuple(residual.shape) != tuple(input.shape) or dtype_name(residual) != dtype:
        raise ValueError(
            f"residual: expected shape {tuple(input.shape)} and dtype {dtype}, "
            f"got {tuple(residual.shape)} and {dtype_name(residual)}"
        )
    spec = norm_spec(op, dtype, dtype_name(weight), hidden)
    shape = tuple(input.shape)
    return run(
        _launch,
        [("input", input), ("residual", residual), ("weight", weight)],
        [Out(shape, dtype, alias=0), Out(shape, dtype, alias=1)],
        spec=spec,
        eps=float(eps),
    )


def fused_add_rmsnorm(input, residual, weight, eps: float = 1e-6):
    """residual += input; input = rmsnorm(residual, weight, eps), both in place.

    The sum is rounded to the input dtype when stored, and the norm reads that stored value,
    so the result equals `residual += input; input[:] = rmsnorm(residual)` done in two steps.
    Returns (input, residual); for JAX arrays (immutable) these are the new values.
    """
    return _fused("fused_add_rmsnorm", input, residual, weight, eps)


def gemma_fused_add_rmsnorm(input, residual, weight, eps: float = 1e-6):
    """residual += input; input = gemma_rmsnorm(residual, weight, eps), both in place."""
    return _fused("gemma_fused_add_rmsnorm", input, residual, weight, eps)


def specs_for(hidden: int, dtypes=("bfloat16", "float16")) -> list[NormSpec]:
    """The specs a model of this hidden size uses (for warmup)."""
    return [norm_spec(op, d, d, hidden) for d in dtypes for op in ("rmsnorm", "fused_add_rmsnorm")]


__all__ = [
    "NormSpec",
    "fused_add_rmsnorm",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "layernorm",
    "norm_spec",
    "rmsnorm",
]
