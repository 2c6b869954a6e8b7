"""The kernel that makes an in-place update safe inside jax.jit (interop/xla_launch.py).

An op that updates an input in place (append_paged_kv_cache's cache) declares its output
aliased to that input, and XLA then normally passes one buffer as both. Where it does not (seen
for a slice of another array), the output buffer does not hold the input: `move_kernel`, the
first launch of such a call, copies the input there when the two addresses differ and does
nothing otherwise (cuda_src/move.cu), so the update's own launch can always write through the
output.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from . import jit
from .launch import Kernel

THREADS = 256
CTAS = 256  # they stride over the words; when the buffers are one, each returns at once


@dataclass(frozen=True)
class MoveSpec:
    source: ClassVar[str] = "move.cu"
    kernels: ClassVar[tuple[str, ...]] = ("move_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("MoveParams",)

    def prelude(self) -> str:
        return jit.prelude(THREADS=THREADS)


@functools.cache
def kernel() -> Kernel:
    """The move kernel (one per process)."""
    return Kernel(MoveSpec(), "move_kernel", "MoveParams")


__all__ = ["CTAS", "THREADS", "MoveSpec", "kernel"]
