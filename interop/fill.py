"""What a call writes into its launch's parameter block, as data: which field takes which
pointer and which scalar (Fill). prepared.one_launch writes its statements into the call's
generated run, and the shortcut (interop/shortcut.py) into its generated launcher, so that no
call spends a frame on them; Fill.function makes them a function for a run that does more."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


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
        by_source: dict[tuple[int, int], list[str]] = {}
        for name, i, *offset in self.pointers:
            by_source.setdefault((i, offset[0] if offset else 0), []).append(name)
        out = [f"{indent}{' = '.join(f'{params}.{n}' for n in names)} = ptrs[{i}]"
               + (f" + {offset}" if offset else "")
               for (i, offset), names in by_source.items()]  # fmt: skip
        out += [f"{indent}{params}.{name} = scalars[{j}]"
                + (f" * {float(factor[0])!r}" if factor else "")
                for name, j, *factor in self.scalars]  # fmt: skip
        if self.then is not None:
            out.append(f"{indent}_then(scalars)")
        return out or [f"{indent}pass"]

    def names(self, params: str, block) -> dict:
        """The generated statements' globals: the block as `params`, `then` as `_then`."""
        return {params: block, "_then": self.then}

    def function(self, block=None) -> Callable:
        """fill(ptrs, scalars): the statements, writing into `block`, as a function (for a run
        that does more than fill and launch); without a block, fill(block, ptrs, scalars) (a
        launch that changes from call to call: a wrapper's latest plan's)."""
        head = "def fill(ptrs, scalars):" if block is not None else "def fill(_p, ptrs, scalars):"
        source = head + "\n" + "\n".join(self.lines("_p", "    ")) + "\n"
        names = self.names("_p", block)
        if block is None:
            del names["_p"]
        exec(compile(source, "<fill>", "exec"), names)
        return names["fill"]


__all__ = ["Fill"]
