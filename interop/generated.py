"""Functions generated from source text at run time (a public function's wrapper, a call's
run, a shortcut's launcher, a Fill's statements), each distinct text compiled once: a new call
signature of a form seen before costs one exec of the cached code with its own globals (a few
microseconds), where a compile costs 50-250. The texts hold the form (field names, slot
indices); what differs from signature to signature travels in the globals.

Compiled code is also kept on disk, as Python keeps .pyc files, under the kernel cache's
directory (rtcinfer.toolchain.cache_dir) in a folder of this interpreter's cache tag: importing
rtcinfer generates ~40 public functions' wrappers, whose compiles took 33 of the import's 151
ms (with .pyc files); a later process loads them instead. An entry holds its source, checked
on load; an unreadable, stale or unwritable entry costs a compile."""

from __future__ import annotations

import hashlib
import marshal
import os
import sys
from pathlib import Path
from types import CodeType

_CODE: dict[str, CodeType] = {}  # source text -> its compiled module code
_MAGIC = sys.version.encode()  # this interpreter's build, part of an entry's key


def compiled(source: str, label: str) -> CodeType:
    """The module code of `source` (`label`: the file name its tracebacks show): from this
    process's memory, the disk cache, or compiled (and kept in both)."""
    code = _CODE.get(source)
    if code is None:
        code = _CODE[source] = _from_disk(source, label)
    return code


def define(lines: list[str], names: dict, label: str):
    """The function the source `lines` define (one `def`, named by its first line), with
    `names` as its globals; `label`: the file name tracebacks show for a text compiled here
    first."""
    source = "\n".join(lines) + "\n"
    exec(compiled(source, label), names)  # noqa: S102 - our own generated text
    return names[lines[0].split()[1].split("(")[0]]


def _folder() -> Path | None:
    """The disk cache's folder for this interpreter (None: no cache tag, nothing kept)."""
    tag = sys.implementation.cache_tag
    if tag is None:
        return None
    from ..toolchain import cache_dir  # (here: rtcinfer imports this package first)

    return cache_dir() / f"python-{tag}"


def _from_disk(source: str, label: str) -> CodeType:
    folder = _folder()
    if folder is None:
        return compile(source, label, "exec")
    key = hashlib.sha256(_MAGIC + f"{label}\n{source}".encode()).hexdigest()[:32]
    path = folder / f"{key}.code"
    try:
        kept_source, kept_label, code = marshal.loads(path.read_bytes())
        if kept_source == source and kept_label == label and isinstance(code, CodeType):
            return code
    except (OSError, EOFError, ValueError, TypeError):
        pass  # absent, unreadable or of another form: compiled below
    code = compile(source, label, "exec")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(marshal.dumps((source, label, code)))
        os.replace(tmp, path)  # whole or not at all, for a process reading it now
    except OSError:
        pass  # a read-only or full disk: compiled each process, as without a cache
    return code


__all__ = ["compiled", "define"]
