"""Every kernel's first statement is wait_for_previous_grid() (cuda_src/common.cuh): its
launches are programmatically dependent on sm_90+ (rtcinfer/dependent_launch.py), so nothing
may touch global memory before the kernel ahead of it on the stream has finished."""

from __future__ import annotations

import re
from pathlib import Path

CUDA_SRC = Path(__file__).resolve().parent.parent / "cuda_src"


def kernels() -> list[tuple[str, str]]:
    """(file, the kernel's first statement) of every extern "C" __global__ kernel."""
    found = []
    for path in sorted(CUDA_SRC.rglob("*.cu")):
        text = path.read_text()
        for m in re.finditer(r'extern "C" __global__[^{]*\{', text):
            body = text[m.end() :].lstrip()
            while body.startswith("//"):  # a comment line after the brace
                body = body.split("\n", 1)[1].lstrip()
            found.append((path.name, body.split("\n", 1)[0].strip()))
    return found


def test_every_kernel_waits_for_the_previous_grid_first():
    entries = kernels()
    assert len(entries) >= 20
    late = [(name, first) for name, first in entries if first != "wait_for_previous_grid();"]
    assert not late, f"kernels that touch memory before waiting: {late}"
