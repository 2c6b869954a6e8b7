"""rtcinfer's ops as PyTorch custom ops (torch.library), so that torch.compile traces a model
that calls them as single opaque nodes, without graph breaks (fullgraph=True), with their
mutations declared and fake (meta) implementations for shapes. Imported only where PyTorch
is: the public functions route a call here while PyTorch is compiling
(interop.arrays.torch_compiling) and run their usual launch path otherwise, eager calls
paying one module-name test for it.

Registered here: the norms and the gated activations (functional and `out=` forms).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import activation, norm

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


def call(name: str, *args, out=None):
    """The custom op `name` (its `_out` form when `out` is given) on args; returns what the
    public function returns."""
    ops = getattr(torch.ops, _NAMESPACE)
    if out is None:
        return getattr(ops, name)(*args)
    getattr(ops, f"{name}_out")(*args, out)
    return out


__all__ = ["call"]
