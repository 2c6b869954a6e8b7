"""Functions generated from source text at run time (a call's run, a shortcut's launcher, a
Fill's statements), each distinct text compiled once: a new call signature of a form seen
before costs one exec of the cached code with its own globals (a few microseconds), where a
compile costs 50-250. The texts hold the form (field names, slot indices); what differs from
signature to signature travels in the globals."""

from __future__ import annotations

from types import CodeType

_CODE: dict[str, CodeType] = {}  # source text -> its compiled module code


def define(lines: list[str], names: dict, label: str):
    """The function the source `lines` define (one `def`, named by its first line), with
    `names` as its globals; `label`: the file name tracebacks show for a text compiled here
    first."""
    source = "\n".join(lines) + "\n"
    code = _CODE.get(source)
    if code is None:
        code = _CODE[source] = compile(source, label, "exec")
    exec(code, names)  # noqa: S102 - our own generated text
    return names[lines[0].split()[1].split("(")[0]]


__all__ = ["define"]
