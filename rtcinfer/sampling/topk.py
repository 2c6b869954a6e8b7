"""FlashInfer's top_k: the k largest values of each row and their indices.

The k-th largest value v is found exactly as top_k_mask_logits finds it (a radix select,
cuda_src/sampling/renorm.cu); the kernel then writes every value > v and the ties == v of the
smallest indices (tie_break 2: the largest), k in all, each group in index order:
deterministic, whatever the flags. NaN counts as -inf (selected only where fewer than k other
values exist).
"""

from __future__ import annotations

from ..interop import Fill, Op, OutSlot, Prepared, call, one_launch
from ..interop.arrays import compilable, framework
from .renorm import checked_rows, row_launch

TIE_BREAKS = (0, 1, 2)  # none (here: the smallest indices, as 1), smallest, largest indices


def _prepare(infos, _align: int, static: tuple) -> Prepared:
    """Slot (input,) -> (values [rows, k] in the input's dtype, indices [rows, k] int64, or
    int32 for JAX without 64-bit types). Static: (k, ties_last[, "jax"]). Scalars: (k,)."""
    k, ties_last = static[:2]
    index = "int32" if static[2:] == ("jax",) and not _jax_x64() else "int64"
    (x,) = infos
    rows, vocab, xs = checked_rows(x, "input")
    if not 1 <= k <= vocab:
        raise ValueError(f"k: expected 1 <= k <= {vocab} (the row's length), got {k}")
    launch = row_launch("top_k_select", x, xs, 0)  # (no row output)
    launch.params.ties_last = int(ties_last)
    outs = (OutSlot((rows, k), x.dtype), OutSlot((rows, k), index))
    indices = "indices_out" if index == "int64" else "indices32_out"
    fill = Fill((("input", 0), ("values_out", 1), (indices, 2)), (("top_k_val", 0),))
    return one_launch(outs, launch, fill)


def _jax_x64() -> bool:
    """Whether JAX has 64-bit types (jax_enable_x64): int64 indices, else int32 ones."""
    import jax

    return bool(jax.config.jax_enable_x64)


_OP = Op("top_k", ("input",), _prepare, jax_static=lambda static: (*static, "jax"))


@compilable("input")
def top_k(input, k: int, sorted: bool = False, deterministic: bool = False,
          tie_break: int = 0, dsa_graph_safe: bool = False):  # fmt: skip
    """(values, indices): the k largest values of each row of input [batch, d] (float32,
    float16, bfloat16) and their indices (int64; int32 for JAX arrays without
    jax_enable_x64), [batch, k] each.

    Selection: v = the k-th largest of row b; every x > v, then the ties x == v of the smallest
    indices (tie_break 0 or 1; 2: the largest indices), k in all (NaN counts as -inf).
    Unsorted (sorted=False), the values > v come first, each group in index order;
    sorted=True orders each row by value, descending (ties by index), through the caller's
    framework. Deterministic whatever `deterministic`; dsa_graph_safe is accepted (the call
    allocates only its outputs, on the caller's stream).
    """
    if tie_break not in TIE_BREAKS:
        raise ValueError(f"tie_break={tie_break!r}: expected 0, 1 or 2")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k: expected an int, got {type(k).__name__}")
    values, indices = call(_OP, (input,), (int(k), tie_break == 2), (int(k),))
    if not sorted:
        return values, indices
    return _sorted(values, indices)


def _sorted(values, indices):
    """Each row by value, descending (NaN as -inf, last), ties by their order (index order
    here), in the arrays' own framework."""
    fw = framework(values)
    if fw == "torch":
        import torch

        keys = torch.nan_to_num(values.float(), nan=float("-inf"))  # NaN as -inf, last
        order = torch.argsort(keys, dim=1, descending=True, stable=True)
        return torch.gather(values, 1, order), torch.gather(indices, 1, order)
    if fw == "jax":
        import jax.numpy as jnp

        order = jnp.argsort(-values.astype(jnp.float32), axis=1, stable=True)
        return jnp.take_along_axis(values, order, 1), jnp.take_along_axis(indices, order, 1)
    import cupy

    if values.dtype.name == "bfloat16":  # its 16 bits are a float32's top half
        keys = (values.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
    else:
        keys = values.astype(cupy.float32)
    order = cupy.argsort(-keys, axis=1, kind="stable")
    return cupy.take_along_axis(values, order, 1), cupy.take_along_axis(indices, order, 1)


__all__ = ["top_k"]
