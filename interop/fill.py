"""What a call writes into its launch's parameter block, as data: which field takes which
pointer and which scalar (Fill). prepared.one_launch writes its statements into the call's
generated run, and the shortcut (interop/shortcut.py) into its generated launcher, so that no
call spends a frame on them; Fill.function makes them a function for a run that does more."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from .generated import define


@dataclass(frozen=True)
class Fill:
    """params.<name> = ptrs[i] (+ offset bytes) for each (name, i) or (name, i, offset) of
    `pointers` (i may be negative: from the end, where the outputs' pointers are),
    params.<name> = scalars[j] (* factor) for each (name, j) or (name, j, factor) of
    `scalars`, then `then(scalars)` where
    given (a write that is more than a field, such as RoPE's frequency table). The fields are
    distinct, so the order of the writes is free."""

    pointers: tuple[tuple, ...]
    scalars: tuple[tuple, ...] = ()
    then: Callable[[tuple], None] | None = None

    def lines(self, params: str, indent: str) -> list[str]:
        """The statements, with `params` the parameter block's name: one per pointer index (its
        fields chained) and per scalar, then the call of `then` as `_then`."""
        return list(_lines(self.pointers, self.scalars, self.then is not None, params, indent))

    def names(self, params: str, block) -> dict:
        """The generated statements' globals: the block as `params`, `then` as `_then`."""
        return {params: block, "_then": self.then}

    def function(self, block=None) -> Callable:
        """fill(ptrs, scalars): the statements, writing into `block`, as a function (for a run
        that does more than fill and launch); without a block, fill(block, ptrs, scalars) (a
        launch that changes from call to call: a wrapper's latest plan's)."""
        if block is None:
            return _blockless(self)
        names = self.names("_p", block)
        return define(["def fill(ptrs, scalars):", *self.lines("_p", "    ")], names, "<fill>")


@functools.lru_cache(maxsize=4096)
def _blockless(fill: Fill) -> Callable:
    """Fill.function() without a block: one function per form (a wrapper's new signatures
    repeat their run's few forms)."""
    names = {"_then": fill.then}
    return define(["def fill(_p, ptrs, scalars):", *fill.lines("_p", "    ")], names, "<fill>")


@functools.lru_cache(maxsize=4096)
def _lines(pointers: tuple, scalars: tuple, then: bool, params: str, indent: str) -> tuple:
    """Fill.lines' text, made once for each form (a new call signature repeats its op's)."""
    by_source: dict[tuple[int, int], list[str]] = {}
    for name, i, *offset in pointers:
        by_source.setdefault((i, offset[0] if offset else 0), []).append(name)
    out = [f"{indent}{' = '.join(f'{params}.{n}' for n in names)} = ptrs[{i}]"
           + (f" + {offset}" if offset else "")
           for (i, offset), names in by_source.items()]  # fmt: skip
    out += [f"{indent}{params}.{name} = scalars[{j}]"
            + (f" * {float(factor[0])!r}" if factor else "")
            for name, j, *factor in scalars]  # fmt: skip
    if then:
        out.append(f"{indent}_then(scalars)")
    return tuple(out or [f"{indent}pass"])


__all__ = ["Fill"]
