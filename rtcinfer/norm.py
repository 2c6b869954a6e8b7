"""RMSNorm, Gemma RMSNorm, fused residual add + RMSNorm, LayerNorm, and the two RMSNorms with an
fp8 output (FlashInfer's names)."""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, replace
from typing import ClassVar

from . import jit
from .interop import Fill, Op, OutSlot, Prepared, call, dense_strides, one_launch, row_count
from .interop.arrays import cast, compilable
from .interop.dtypes import FLOAT_DTYPES, FP8_DTYPES, itemsize, normalize
from .interop.shortcut import Shortcut
from .launch import Kernel, Launch
from .layout import common_rows, fit_vec, widest_vec

MAX_SMEM = 200 * 1024  # a row must fit in shared memory (Hopper and Ampere allow ~227 KB)


class NormOp(enum.IntEnum):
    RMS = 0
    GEMMA_RMS = 1
    FUSED_ADD_RMS = 2
    GEMMA_FUSED_ADD_RMS = 3
    LAYER = 4


OPS = {
    "rmsnorm": NormOp.RMS,
    "gemma_rmsnorm": NormOp.GEMMA_RMS,
    "fused_add_rmsnorm": NormOp.FUSED_ADD_RMS,
    "gemma_fused_add_rmsnorm": NormOp.GEMMA_FUSED_ADD_RMS,
    "layernorm": NormOp.LAYER,
    "rmsnorm_quant": NormOp.RMS,
    "fused_add_rmsnorm_quant": NormOp.FUSED_ADD_RMS,
    "layernorm_quant": NormOp.LAYER,
}


@dataclass(frozen=True)
class NormSpec:
    op: str
    dtype: str
    weight_dtype: str
    hidden: int
    vec: int  # elements per thread-vector: with threads, the arithmetic's order
    threads: int
    load_vec: int = 0  # elements per global access (0: vec); narrower for misaligned views
    out_dtype: str = ""  # the _quant ops: fp8 (out = fp8(y / scale)); else out is `dtype`
    source: ClassVar[str] = "norm.cu"
    kernels: ClassVar[tuple[str, ...]] = ("norm_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("NormParams",)  # crossing the seam

    @property
    def smem(self) -> int:
        """Dynamic shared memory: the row (and the residual row for the fused ops)."""
        return self.hidden * itemsize(self.dtype) * (2 if "fused" in self.op else 1)

    def prelude(self) -> str:
        return jit.prelude(
            OP=OPS[self.op],
            T=self.dtype,
            W=self.weight_dtype,
            OT=self.out_dtype or self.dtype,
            QUANT=bool(self.out_dtype),
            HIDDEN=self.hidden,
            VEC=self.vec,
            LOAD_VEC=self.load_vec or self.vec,
            THREADS=self.threads,
        )


def norm_spec(op: str, dtype: str, weight_dtype: str, hidden: int, vec: int | None = None,
              out_dtype: str = ""):  # fmt: skip
    """The spec for rows of `hidden` elements: ~4 vectors per thread, 32 to 1024 threads.
    `out_dtype`: the fp8 output of the _quant ops."""
    if op.endswith("_quant") != bool(out_dtype):
        raise ValueError(f"{op}: an fp8 out_dtype goes with the _quant ops, got {out_dtype!r}")
    vec = vec or widest_vec(hidden, itemsize(dtype))
    nvec = hidden // vec
    threads = min(1024, -(-nvec // 128) * 32)  # ceil(nvec / 4) rounded up to whole warps
    row_bytes = hidden * itemsize(dtype) * (2 if "fused" in op else 1)
    if row_bytes > MAX_SMEM:
        limit = MAX_SMEM // (row_bytes // hidden)
        raise ValueError(f"hidden size {hidden} exceeds {limit}, the widest {dtype} {op} row")
    return NormSpec(op, dtype, weight_dtype, hidden, vec, threads, out_dtype=out_dtype)


def _check(x, weight, names=("input", "weight")) -> tuple[int, str]:
    dtype, hidden = x.dtype, (x.shape[-1] if x.ndim else 0)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{names[0]}: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if weight.shape != (hidden,):
        raise ValueError(f"{names[1]}: expected shape ({hidden},), got {weight.shape}")
    if weight.dtype not in (dtype, "float32"):
        raise TypeError(f"{names[1]}: dtype must be {dtype} or float32, got {weight.dtype}")
    return hidden, dtype


def _dense(infos, slots: tuple[int, ...]) -> tuple[int, ...]:
    """The weight slots (weight, beta) whose arrays are strided: the kernel reads them densely,
    so call() copies them first (Prepared.dense)."""
    return tuple(i for i in slots if infos[i] is not None and not infos[i].contiguous)


def _check_beta(x, gemma, beta) -> None:
    """LayerNorm's beta: as gemma is checked, and of gemma's dtype (the kernel reads both as
    one type)."""
    _check(x, beta, ("input", "beta"))
    if beta.dtype != gemma.dtype:
        raise TypeError(f"beta: dtype must be gemma's ({gemma.dtype}), got {beta.dtype}")


def _check_out(out, shape: tuple, dtype: str, name: str = "out") -> None:
    if out is not None and (out.shape != shape or out.dtype != dtype):
        raise ValueError(
            f"{name}: expected shape {shape} and dtype {dtype}, "
            f"got shape {out.shape} and dtype {out.dtype}"
        )


def _launch(spec: NormSpec, align: int, arrays: list, names: list) -> Launch:
    """The launch of `spec` over the rows of its four arrays (x, residual, out, residual_out:
    ArrayInfo, a stand-in where the op has none), their strides written to its parameters."""
    rows, n1, layouts = common_rows(arrays, names)
    (xs0, xs1), (rs0, rs1), (ys0, ys1), (ros0, ros1) = layouts
    # Only the access width follows the layout: the same rows give the same bits however
    # they are laid out.
    vec = fit_vec(spec.vec, itemsize(spec.dtype), align,
                  [xs0, xs1, rs0, rs1, ys0, ys1, ros0, ros1])  # fmt: skip
    if vec != spec.vec:
        spec = replace(spec, load_vec=vec)
    launch = Launch(Kernel(spec, "norm_kernel", "NormParams", spec.smem), (rows, 1, 1),
                    (spec.threads, 1, 1))  # fmt: skip
    p = launch.params
    p.xs0, p.xs1, p.rs0, p.rs1, p.os0, p.os1, p.n1 = xs0, xs1, rs0, rs1, ys0, ys1, n1
    p.ros0, p.ros1 = ros0, ros1
    return launch


def _prepare(infos, align: int, static: tuple) -> Prepared:
    """Slots: plain ops (input, weight, beta, out) -> one output; fused ops (input, residual,
    weight) -> (input, residual) updated in place, or new arrays when static ends with True
    (JAX). Pointers: the slots', then the outputs'."""
    op, new_arrays = static[0], static[1:] == (True,)
    fused = "fused" in op
    if fused:
        x, residual, weight = infos
        hidden, dtype = _check(x, weight)
        if residual.shape != x.shape or residual.dtype != dtype:
            raise ValueError(
                f"residual: expected shape {x.shape} and dtype {dtype}, "
                f"got {residual.shape} and {residual.dtype}"
            )
        if new_arrays:  # JAX: the results in buffers of their own, nothing aliased
            outs = (OutSlot(x.shape, dtype), OutSlot(x.shape, dtype))
            dense = x._replace(strides=dense_strides(x.shape))
            arrays, names = [x, residual, dense, dense], ["input", "residual", "out", "out"]
        else:
            outs = (OutSlot(x.shape, dtype, 0, alias=True),
                    OutSlot(x.shape, dtype, 1, alias=True))  # fmt: skip
            arrays, names = [x, residual, x, residual], ["input", "residual", "out", "out"]
    else:
        x, weight, bias, out = infos
        hidden, dtype = _check(x, weight, ("input", "gemma") if op == "layernorm" else
                               ("input", "weight"))  # fmt: skip
        if bias is not None:
            _check_beta(x, weight, bias)
        _check_out(out, x.shape, dtype)
        outs = (OutSlot(x.shape, dtype, 3 if out is not None else None),)
        y = out if out is not None else x._replace(strides=dense_strides(x.shape))
        arrays, names = [x, x, y, x], ["input", "residual", "out", "residual"]
    launch = _launch(norm_spec(op, dtype, weight.dtype, hidden), align, arrays, names)
    if fused and new_arrays:  # read input and residual, write the two outputs
        pointers = (("x", 0), ("residual", 1), ("weight", 2), ("bias", 2), ("out", 3),
                    ("residual_out", 4))  # fmt: skip
    elif fused:  # the outputs: the input and the residual, in place
        pointers = (("x", 3), ("out", 3), ("residual", 4), ("residual_out", 4), ("weight", 2),
                    ("bias", 2))  # fmt: skip
    else:
        pointers = (("x", 0), ("residual", 0), ("residual_out", 0), ("out", 4), ("weight", 1),
                    ("bias", 2 if op == "layernorm" else 1))  # fmt: skip
    dense = _dense(infos, (2,) if fused else (1, 2))
    return one_launch(outs, launch, Fill(pointers, (("eps", 0),)), rows=row_count(x),
                      dense=dense)  # fmt: skip


_PLAIN = Op("norm", ("input", "weight", "beta", "out"), _prepare, given=("out",),
            rows=("input", "out"))  # fmt: skip


def _new_arrays(static: tuple) -> tuple:
    """A fused or _quant call on JAX arrays (immutable): its inputs read, its outputs new
    arrays (no output aliases an input, so XLA can launch it itself)."""
    return (*static, True)


_FUSED = Op("fused_norm", ("input", "residual", "weight"), _prepare, jax_static=_new_arrays,
            rows=("input", "residual"))  # fmt: skip


def _out_dtype(out, named: str | None) -> str:
    """The fp8 type of a _quant op's `out`: its own dtype, or `out_dtype` where it arrives as
    uint8 storage (CuPy has no fp8 dtype); a given out_dtype must agree with an fp8 out."""
    if named is not None and normalize(named) not in FP8_DTYPES:
        raise TypeError(f"out_dtype: expected one of {FP8_DTYPES}, got {named!r}")
    named = None if named is None else normalize(named)
    if out.dtype in FP8_DTYPES and named in (None, out.dtype):
        return out.dtype
    if out.dtype == "uint8" and named is not None:
        return named
    if out.dtype == "uint8":
        raise TypeError("out: uint8 storage of fp8 values; say which fp8 type with out_dtype=")
    raise TypeError(
        f"out: expected an fp8 array ({', '.join(FP8_DTYPES)}), got {out.dtype}"
        + (f" with out_dtype={named!r}" if named is not None else "")
    )


def _prepare_quant(infos, align: int, static: tuple) -> Prepared:
    """Slots (input, residual, weight, out, scale, beta): out = fp8(norm(x) / scale), the norm
    rmsnorm(x, weight) (rmsnorm_quant, fused_add_rmsnorm_quant) or layernorm(x, weight, beta)
    (layernorm_quant), x = input, or residual + input, which fused_add_rmsnorm_quant first
    stores to residual (the others: residual None). Outputs: out and the residual updated in
    place, or (static ending with True: JAX) new arrays. Scalars: (eps, scale) where the scale
    slot is None. Pointers: the slots', then the outputs'."""
    op, named, new_arrays = static[0], static[1], static[2:] == (True,)
    fused, layer = op == "fused_add_rmsnorm_quant", op == "layernorm_quant"
    x, residual, weight, out, scale, beta = infos
    names = ("input", "gemma") if layer else ("input", "weight")
    hidden, dtype = _check(x, weight, names)
    if layer:
        _check_beta(x, weight, beta)
    out_dtype = _out_dtype(out, named)
    if out.shape != x.shape:
        raise ValueError(f"out: expected shape {x.shape}, got {out.shape}")
    if fused and (residual.shape != x.shape or residual.dtype != dtype):
        raise ValueError(
            f"residual: expected shape {x.shape} and dtype {dtype}, "
            f"got {residual.shape} and {residual.dtype}"
        )
    if scale is not None and (scale.size != 1 or scale.ndim > 1 or scale.dtype != "float32"):
        raise ValueError(
            f"scale: expected a float or a float32 array of one element, got {scale.dtype} "
            f"{scale.shape}"
        )
    dense = x._replace(strides=dense_strides(x.shape))
    if new_arrays:  # JAX: out and the new residual in buffers of their own
        outs = (OutSlot(x.shape, out_dtype),) + ((OutSlot(x.shape, dtype),) if fused else ())
        y, r_out = dense, dense
    else:
        outs = (OutSlot(x.shape, out_dtype, 3, alias=True),)
        outs += (OutSlot(x.shape, dtype, 1, alias=True),) if fused else ()
        y, r_out = out, residual
    r = residual if fused else x
    spec = norm_spec(op, dtype, weight.dtype, hidden, out_dtype=out_dtype)
    launch = _launch(spec, align, [x, r, y, r_out if fused else x],
                     ["input", "residual", "out", "residual"])  # fmt: skip
    residual, residual_out = (1, 7) if fused else (0, 0)
    pointers = (("x", 0), ("weight", 2), ("bias", 5 if layer else 2), ("scale", 4), ("out", 6),
                ("residual", residual), ("residual_out", residual_out))  # fmt: skip
    return one_launch(outs, launch, Fill(pointers, (("eps", 0), ("scale_value", 1))),
                      rows=row_count(x), dense=_dense(infos, (2, 5)))  # fmt: skip


_QUANT = Op("norm_quant", ("input", "residual", "weight", "out", "scale", "beta"), _prepare_quant,
            jax_static=_new_arrays, rows=("input", "residual", "out"))  # fmt: skip


def _scale(scale) -> tuple:
    """(array, value): a _quant op's scale as its slot (a float32 array of one element) or
    its scalar (a number: the slot None)."""
    if isinstance(scale, numbers.Real):
        return None, float(scale)
    return cast(scale, "float32"), 1.0


def _shortcut(op: Op, slots: tuple, name: str) -> Shortcut:
    """How the norm `name` calls its op, for its PyTorch shortcut (interop/shortcut.py)."""
    return Shortcut(op, slots, repr((name,)), "(float(eps),)")


@compilable("input", _shortcut(_PLAIN, ("input", "weight", None, "out"), "rmsnorm"))
def rmsnorm(input, weight, eps: float = 1e-6, out=None, enable_pdl=None):
    """RMSNorm over the last dimension.

    out = input * rsqrt(mean(input**2, -1, keepdims=True) + eps) * weight   (fp32 math)
    input: [..., hidden] fp16/bf16/fp32 (rows may be strided); weight: [hidden], same dtype or
    fp32. Returns `out` (allocated when not given) in the caller's array type. enable_pdl, as
    in every op that takes it, is accepted for FlashInfer compatibility: launches on sm_90+ are
    programmatically dependent for the whole process (rtcinfer/dependent_launch.py).
    """
    return call(_PLAIN, (input, weight, None, out), ("rmsnorm",), (float(eps),))


@compilable("input", _shortcut(_PLAIN, ("input", "weight", None, "out"), "gemma_rmsnorm"))
def gemma_rmsnorm(input, weight, eps: float = 1e-6, out=None, enable_pdl=None):
    """Gemma's RMSNorm: out = input * rsqrt(mean(input**2, -1) + eps) * (1 + weight)."""
    return call(_PLAIN, (input, weight, None, out), ("gemma_rmsnorm",), (float(eps),))


@compilable("input", _shortcut(_PLAIN, ("input", "gemma", "beta", "out"), "layernorm"))
def layernorm(input, gemma, beta, eps: float = 1e-6, *, out=None):
    """LayerNorm: out = (input - mean) * rsqrt(var + eps) * gemma + beta (biased variance).

    gemma (the scale, FlashInfer's name for gamma), beta: [hidden], contiguous, both the
    input's dtype or both float32.
    """
    return call(_PLAIN, (input, gemma, beta, out), ("layernorm",), (float(eps),))


@compilable("input", _shortcut(_FUSED, ("input", "residual", "weight"), "fused_add_rmsnorm"))
def fused_add_rmsnorm(input, residual, weight, eps: float = 1e-6, enable_pdl=None):
    """residual += input; input = rmsnorm(residual, weight, eps), both in place.

    The sum is rounded to the input dtype when stored, and the norm reads that stored value,
    so the result equals `residual += input; input[:] = rmsnorm(residual)` done in two steps.
    Returns (input, residual); for JAX arrays (immutable) these are the new values.
    """
    return call(_FUSED, (input, residual, weight), ("fused_add_rmsnorm",), (float(eps),))


@compilable("input", _shortcut(_FUSED, ("input", "residual", "weight"), "gemma_fused_add_rmsnorm"))
def gemma_fused_add_rmsnorm(input, residual, weight, eps: float = 1e-6, enable_pdl=None):
    """residual += input; input = gemma_rmsnorm(residual, weight, eps), both in place."""
    return call(_FUSED, (input, residual, weight), ("gemma_fused_add_rmsnorm",), (float(eps),))


def _quant_shortcut(slots: tuple, name: str) -> Shortcut:
    """How a norm with an fp8 output calls its op, for its shortcut: the scale an array (a
    number takes call()'s path)."""
    return Shortcut(_QUANT, slots, f"({name!r}, out_dtype)", "(float(eps), 1.0)")


@compilable("input", _quant_shortcut(("input", None, "weight", "out", "scale", None),
                                     "rmsnorm_quant"))  # fmt: skip
def rmsnorm_quant(out, input, weight, scale, eps: float = 1e-6, enable_pdl=None, *,
                  out_dtype=None):  # fmt: skip
    """RMSNorm with an fp8 output: out = fp8(rmsnorm(input, weight, eps) / scale).

    The norm in fp32 as rmsnorm's, then divided by scale and rounded to out's fp8 type
    (float8_e4m3fn or float8_e5m2), saturated to its largest finite value (NaN stays NaN).
    out: [..., hidden] fp8, written; scale: a number or a float32 array of one element (read
    on the device, as a calibrated scale lives there). CuPy has no fp8 dtype: give out as
    uint8 storage and its type as out_dtype ("float8_e4m3fn" or "float8_e5m2"). Returns out
    (FlashInfer's returns None; for JAX arrays, immutable, out is the new array).
    """
    scale_arr, value = _scale(scale)
    return call(_QUANT, (input, None, weight, out, scale_arr, None),
                ("rmsnorm_quant", out_dtype), (float(eps), value))  # fmt: skip


@compilable("input", _quant_shortcut(("input", "residual", "weight", "out", "scale", None),
                                     "fused_add_rmsnorm_quant"))  # fmt: skip
def fused_add_rmsnorm_quant(out, input, residual, weight, scale, eps: float = 1e-6,
                            enable_pdl=None, *, out_dtype=None):  # fmt: skip
    """residual += input; out = fp8(rmsnorm(residual, weight, eps) / scale). input is only read.

    The sum is rounded to residual's dtype when stored and the norm reads the stored value,
    as fused_add_rmsnorm's; out, scale and out_dtype as rmsnorm_quant's. Returns (out,
    residual); for JAX arrays these are the new values.
    """
    scale_arr, value = _scale(scale)
    return call(_QUANT, (input, residual, weight, out, scale_arr, None),
                ("fused_add_rmsnorm_quant", out_dtype), (float(eps), value))  # fmt: skip


@compilable("input", _quant_shortcut(("input", None, "gemma", "out", "scale", "beta"),
                                     "layernorm_quant"))  # fmt: skip
def layernorm_quant(out, input, gemma, beta, scale, eps: float = 1e-6, *, out_dtype=None):
    """LayerNorm with an fp8 output: out = fp8(layernorm(input, gemma, beta, eps) / scale).

    The norm in fp32 as layernorm's (biased variance; gemma and beta [hidden], contiguous,
    both the input's dtype or both float32), then divided by scale and rounded to out's fp8
    type, saturated; out, scale and out_dtype as rmsnorm_quant's. Returns out (FlashInfer's
    returns None; for JAX arrays, immutable, out is the new array).
    """
    scale_arr, value = _scale(scale)
    return call(_QUANT, (input, None, gemma, out, scale_arr, beta),
                ("layernorm_quant", out_dtype), (float(eps), value))  # fmt: skip


def specs_for(hidden: int, dtypes=("bfloat16", "float16")) -> list[NormSpec]:
    """The specs a model of this hidden size uses (for warmup)."""
    return [norm_spec(op, d, d, hidden) for d in dtypes for op in ("rmsnorm", "fused_add_rmsnorm")]


__all__ = [
    "NormSpec",
    "fused_add_rmsnorm",
    "fused_add_rmsnorm_quant",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "layernorm",
    "layernorm_quant",
    "norm_spec",
    "rmsnorm",
    "rmsnorm_quant",
]
