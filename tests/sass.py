"""SASS of a compiled kernel (nvdisasm, from the cuda-toolkit wheels) and where its
local-memory accesses sit: a spill outside every loop costs a few instructions per thread; one
inside the main loop costs on every tile."""

from __future__ import annotations

import re
import subprocess
import tempfile

_ADDRESS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*)$")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")


def nvdisasm() -> str | None:
    """The nvdisasm executable of the installed toolkit wheels, or None."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
    except ImportError:
        return None
    return find_nvidia_binary_utility("nvdisasm")


def disassemble(cubin: bytes, tool: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def function_text(text: str, kernel: str) -> str:
    """The lines of one function of nvdisasm's listing."""
    start = text.index(f".text.{kernel}:")
    end = text.find("\n\t.section", start)
    return text[start:] if end < 0 else text[start:end]


def loops(text: str) -> list[tuple[int, int]]:
    """[first, last] instruction addresses of every loop: a branch back to an earlier label."""
    labels, pending, spans = {}, [], []
    for line in text.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            pending.append(label.group(1))
            continue
        m = _ADDRESS.match(line)
        if not m:
            continue
        address = int(m.group(1), 16)
        for name in pending:
            labels[name] = address
        pending = []
        branch = _BRANCH.search(m.group(2))
        if branch and labels.get(branch.group(1), address + 1) <= address:
            spans.append((labels[branch.group(1)], address))
    return spans


def local_accesses_in_loops(text: str) -> list[str]:
    """The LDL / STL instructions (spill traffic) that lie inside a loop."""
    spans = loops(text)
    found = []
    for line in text.splitlines():
        m = _ADDRESS.match(line)
        if m and re.search(r"\b(LDL|STL)\b", m.group(2)):
            address = int(m.group(1), 16)
            if any(first <= address <= last for first, last in spans):
                found.append(m.group(2).strip())
    return found
