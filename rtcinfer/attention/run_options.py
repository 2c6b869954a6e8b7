"""run()'s FlashInfer 0.7.2 options beyond the arrays: the LSE's base and layout, the options
with no counterpart here (refused by name unless left at their defaults), and the deprecated
forward()'s plan parameters (check_forward). q_scale folds into the logit factor as k_scale
does, through decode_kernel.kv_scales, which decode and prefill share.

The kernels write the LSE as FlashInfer's do, base 2 in [tokens, heads] ("log2", "NH"); the
other forms are made from it afterwards, as FlashInfer makes them: "ln" = log2 form * ln 2,
"HN" = its contiguous transpose [heads, tokens], in the caller's array type (a given `lse`
must then have the requested layout).
"""

from __future__ import annotations

import math

from ..interop.arrays import framework

LSE_BASES = ("log2", "ln")
LSE_LAYOUTS = ("NH", "HN")
LN2 = math.log(2.0)


def refuse(what: str = "options", /, **options) -> None:
    """ValueError naming the options given a value other than None (FlashInfer's options
    with no counterpart here: sinks, kv_cache_sf, ...); `what` says what they are."""
    given = [name for name, value in options.items() if value is not None]
    if given:
        raise ValueError(f"{what} not supported: {', '.join(given)}")


def check_forward(asked, planned) -> None:
    """FlashInfer's deprecated forward(): run() with plan parameters given again. Where they
    differ from the latest plan()'s (configurations `asked` and `planned`, dataclasses of
    plain fields or nested ones), ValueError naming each difference: the work was planned
    for the plan's (FlashInfer would run a plan scheduled for other parameters)."""
    if asked == planned:
        return
    differ = [f"{name} {mine!r} (the plan's {theirs!r})"
              for name, mine, theirs in _fields(asked, planned) if mine != theirs]  # fmt: skip
    raise ValueError(
        f"forward() with {', '.join(differ)}: plan() (begin_forward) with these parameters, "
        "then run()"
    )


def _fields(a, b):
    """(name, a's value, b's value) of each plain field of two like dataclasses, nested ones
    flattened."""
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if hasattr(x, "__dataclass_fields__"):
            yield from _fields(x, y)
        else:
            yield name, x, y


def check_lse_form(lse_base: str, lse_layout: str) -> None:
    if lse_base not in LSE_BASES:
        raise ValueError(f"lse_base must be one of {LSE_BASES}, got {lse_base!r}")
    if lse_layout not in LSE_LAYOUTS:
        raise ValueError(f"lse_layout must be one of {LSE_LAYOUTS}, got {lse_layout!r}")


def kernel_lse(lse, lse_base: str, lse_layout: str, q_shape):
    """The `lse` the kernel is to write for a caller's `lse` (None or given) in the requested
    form, checked: the caller's for "NH", a new one for "HN" (finish_lse fills the caller's
    [heads, tokens] array from it); q_shape: (tokens, heads, ...)."""
    check_lse_form(lse_base, lse_layout)
    if lse_layout == "NH":
        return lse
    check_given_hn(lse, q_shape[0], q_shape[1])
    return None


def finish_lse(lse, lse_base: str, lse_layout: str, given=None):
    """The kernel's base-2 [tokens, heads] `lse` in the requested base and layout: "NH" in
    place where the array type allows it, "HN" into `given` ([heads, tokens], contiguous; for
    "NH" it is the kernel's own) or a new contiguous array."""
    if lse_layout == "NH":
        if lse_base == "ln":
            lse *= LN2  # in place for PyTorch and CuPy; a new array for JAX
        return lse
    kind = framework(lse)
    heads_tokens = lse.T
    if given is not None:
        _copy_into(given, heads_tokens, kind)
        out = given
    elif kind == "torch":
        out = heads_tokens.contiguous()
    elif kind == "jax":
        out = heads_tokens
    else:
        out = heads_tokens.copy()  # CuPy: C order
    if lse_base == "ln":
        out *= LN2
    return out


def check_given_hn(lse, nnz: int, num_qo_heads: int) -> None:
    """A caller's lse for lse_layout="HN": [num_qo_heads, nnz] float32, contiguous."""
    if lse is None:
        return
    kind = framework(lse)
    if kind == "jax":
        raise TypeError("lse= is not supported for JAX arrays (they are immutable)")
    shape = tuple(lse.shape)
    dtype = str(lse.dtype).rpartition(".")[2]
    if shape != (num_qo_heads, nnz) or dtype != "float32":
        raise ValueError(
            f'lse for lse_layout="HN": expected shape ({num_qo_heads}, {nnz}) and float32, got '
            f"{shape} and {dtype}"
        )
    contiguous = lse.is_contiguous() if kind == "torch" else lse.flags.c_contiguous
    if not contiguous:
        raise ValueError('lse for lse_layout="HN" must be contiguous')


def _copy_into(dst, src, kind: str) -> None:
    """dst[...] = src for PyTorch or CuPy (JAX takes no given arrays: check_given_hn)."""
    if kind == "torch":
        dst.copy_(src)
    else:
        dst[...] = src


__all__ = ["LSE_BASES", "LSE_LAYOUTS", "check_forward", "check_given_hn", "check_lse_form",
           "finish_lse", "kernel_lse", "refuse"]  # fmt: skip
