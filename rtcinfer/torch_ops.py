"""rtcinfer's ops as PyTorch custom ops (torch.library), so that torch.compile traces a model
that calls them as single opaque nodes, without graph breaks (fullgraph=True), with their
mutations declared and fake (meta) implementations for shapes. Imported only where PyTorch
is: the public functions route a call here while PyTorch is compiling
(interop.arrays.torch_compiling) and run their usual launch path otherwise, eager calls
paying one module-name test for it.

Registered here: the norms, the gated activations and every RoPE form (functional and `out=`
forms, in place ones mutating q and k).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from . import activation, norm, rope

_NAMESPACE = "rtcinfer"


def _op(name: str, mutates=()):
    return torch.library.custom_op(f"{_NAMESPACE}::{name}", mutates_args=mutates)


# --- norms -------------------------------------------------------------------------------------


def _rms(name: str, public):
    """The two forms of an RMS norm: functional, and `out=` (mutating out)."""

    @_op(name)
    def functional(input: Tensor, weight: Tensor, eps: float) -> Tensor:
        return public(input, weight, eps)

    @_op(f"{name}_out", mutates=("out",))
    def with_out(input: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
        public(input, weight, eps, out=out)

    functional.register_fake(lambda input, weight, eps: torch.empty_like(input))
    with_out.register_fake(lambda input, weight, eps, out: None)


_rms("rmsnorm", norm.rmsnorm)
_rms("gemma_rmsnorm", norm.gemma_rmsnorm)


@_op("layernorm")
def _layernorm(input: Tensor, gemma: Tensor, beta: Tensor, eps: float) -> Tensor:
    return norm.layernorm(input, gemma, beta, eps)


@_op("layernorm_out", mutates=("out",))
def _layernorm_out(input: Tensor, gemma: Tensor, beta: Tensor, eps: float, out: Tensor) -> None:
    norm.layernorm(input, gemma, beta, eps, out=out)


@_op("fused_add_rmsnorm", mutates=("input", "residual"))
def _fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    norm.fused_add_rmsnorm(input, residual, weight, eps)


@_op("gemma_fused_add_rmsnorm", mutates=("input", "residual"))
def _gemma_fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor,
                             eps: float) -> None:  # fmt: skip
    norm.gemma_fused_add_rmsnorm(input, residual, weight, eps)


_layernorm.register_fake(lambda input, gemma, beta, eps: torch.empty_like(input))
_layernorm_out.register_fake(lambda input, gemma, beta, eps, out: None)
for _fn in (_fused_add_rmsnorm, _gemma_fused_add_rmsnorm):
    _fn.register_fake(lambda input, residual, weight, eps: None)


# --- gated activations: [..., 2d] -> [..., d] ----------------------------------------------------


def _gated(name: str, public):
    @_op(name)
    def functional(input: Tensor) -> Tensor:
        return public(input)

    @_op(f"{name}_out", mutates=("out",))
    def with_out(input: Tensor, out: Tensor) -> None:
        public(input, out=out)

    functional.register_fake(lambda input: input.new_empty((*input.shape[:-1],
                                                            input.shape[-1] // 2)))  # fmt: skip
    with_out.register_fake(lambda input, out: None)


for _name, _public in (("silu_and_mul", activation.silu_and_mul),
                       ("gelu_and_mul", activation.gelu_and_mul),
                       ("gelu_tanh_and_mul", activation.gelu_tanh_and_mul)):  # fmt: skip
    _gated(_name, _public)


# --- RoPE: every public form, its schema built from its signature --------------------------------

_ROTATED = ("q", "k", "query", "key")  # updated in place by the _inplace forms
_TENSORS = ("indptr", "offsets", "pos_ids", "positions", "cos_sin_cache")
_TYPES = {"rotary_dim": "SymInt?", "head_size": "SymInt", "interleave": "bool", "is_neox": "bool"}


def _rope(public) -> None:
    """A custom op per RoPE function (and an `_out` one for the out-of-place forms): its
    arguments the function's, by name and in order; tensors, ints, bools, the rest floats."""
    name = public.__name__
    names = [n for n in inspect.signature(public).parameters if n != "out"]
    inplace = name.endswith("_inplace")
    rotated = [i for i, n in enumerate(names) if n in _ROTATED]
    marks = iter("abcd")

    def arg(n: str) -> str:
        if n in _ROTATED:
            return f"Tensor({next(marks)}!) {n}" if inplace else f"Tensor {n}"
        return f"{'Tensor' if n in _TENSORS else _TYPES.get(n, 'float')} {n}"

    args = ", ".join(arg(n) for n in names)
    mutated = tuple(names[i] for i in rotated)

    def in_place(*a) -> None:
        public(*a)

    def functional(*a):
        return public(*a)

    def with_out(*a) -> None:
        public(*a[:-2], out=a[-2:])

    if inplace:
        op = torch.library.custom_op(f"{_NAMESPACE}::{name}", in_place, mutates_args=mutated,
                                     schema=f"({args}) -> ()")  # fmt: skip
        op.register_fake(lambda *a: None)
        return
    op = torch.library.custom_op(f"{_NAMESPACE}::{name}", functional, mutates_args=(),
                                 schema=f"({args}) -> (Tensor, Tensor)")  # fmt: skip
    op.register_fake(lambda *a: tuple(torch.empty_like(a[i]) for i in rotated))
    outs = f"{args}, Tensor(a!) {names[rotated[0]]}_out, Tensor(b!) {names[rotated[1]]}_out"
    op_out = torch.library.custom_op(f"{_NAMESPACE}::{name}_out", with_out,
                                     mutates_args=tuple(f"{names[i]}_out" for i in rotated),
                                     schema=f"({outs}) -> ()")  # fmt: skip
    op_out.register_fake(lambda *a: None)


for _public in rope.PUBLIC:
    _rope(_public)


def call(name: str, *args, out=None):
    """The custom op `name` (its `_out` form when `out` is given: an array, or a tuple of
    them) on args; returns what the public function returns."""
    ops = getattr(torch.ops, _NAMESPACE)
    if out is None:
        return getattr(ops, name)(*args)
    outs = out if isinstance(out, tuple) else (out,)
    getattr(ops, f"{name}_out")(*args, *outs)
    return out


def call_public(public, args: tuple, kwargs: dict):
    """A public function's call as its custom op: the arguments bound to its signature (its
    defaults filled in) and passed in order; what the function returns."""
    bound = inspect.signature(public).bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    out = values.pop("out", None)
    result = call(public.__name__, *values.values(), out=out)
    if public.__name__.endswith("_inplace"):  # (q, k) updated in place
        return tuple(v for n, v in values.items() if n in _ROTATED)
    return result


__all__ = ["call", "call_public"]
