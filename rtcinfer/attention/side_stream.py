"""Two pieces of GPU work of one call run side by side: `main()` on the caller's current stream
and `side()` on a second stream, forked from the current stream and joined back into it
(events, no host sync), so that a compute-bound kernel and a memory-bound one share the GPU
instead of queueing. A CUDA-graph capture of the caller's stream takes both branches in (the
side stream joins the capture through the fork event).

    current:  ──fork──[first launched]──────────wait(join)──> (whatever follows)
                  └──side: ...[side()]...──join──┘

side()'s calls launch on the side stream through interop's launching_on (no framework stream
is switched: that costs PyTorch ~10 us a call) and must be given their outputs, allocated
before the fork (`empty_like_in`). JAX arrays and calls while torch.compile traces run the two
in order on the current stream (XLA owns the streams there), as do arrays of other producers,
and so does `together=False` (too little work to gain from the overlap: the fork and join
cost a few microseconds of host time).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from ..interop.arrays import framework, torch_compiling
from ..interop.call import caller_stream, launching_on
from ..interop.dtypes import numpy_dtype
from ..launch import record_event, wait_event

# A level's work (shared_prefix.level_work, in bytes moved) below which the overlap does not
# pay for its fork and join: about 16 us of HBM traffic on an H200.
MIN_SIDE_WORK = 64 << 20

_SIDE: dict[int, tuple[object, object, object]] = {}  # device -> (side stream, fork, join)
# One fork-join at a time: threads share a side stream and its two events.
_LOCK = threading.RLock()


def _side_state(device: int):
    """(side stream, fork event, join event) of `device`: CuPy objects, their raw handles
    used whatever the caller's framework."""
    state = _SIDE.get(device)
    if state is None:
        import cupy

        with _LOCK, cupy.cuda.Device(device):
            events = [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(2)]
            state = _SIDE.setdefault(device, (cupy.cuda.Stream(non_blocking=True), *events))
    return state


def side_by_side(x, main: Callable, side: Callable, side_first: bool = False,
                 together: bool = True) -> tuple:  # fmt: skip
    """(main(), side()), run concurrently when `together` and `x` (an array of the call) is a
    PyTorch or CuPy array, else one after the other. `side_first`: side() is launched first
    (the longer piece should start first: it has the GPU to itself while the other fills the
    gaps)."""
    kind = framework(x)
    if not together or kind not in ("torch", "cupy") or torch_compiling(x):
        if side_first:
            s = side()
            return main(), s
        return main(), side()
    device, current = caller_stream(x)
    with _LOCK:
        stream, fork, join = _side_state(device)
        record_event(fork.ptr, current)
        wait_event(stream.ptr, fork.ptr)
        try:
            if side_first:
                with launching_on(stream.ptr):
                    s = side()
                m = main()
            else:
                m = main()
                with launching_on(stream.ptr):
                    s = side()
        finally:  # the side stream rejoins even when a call raised (a capture must end joined)
            record_event(join.ptr, stream.ptr)
            wait_event(current, join.ptr)
    return m, s


def empty_like_in(x, shape: tuple, dtype: str):
    """An uninitialized array of `shape` and `dtype` (a canonical name) in x's framework and on
    its device, allocated on the current stream, for side() to write; None for JAX arrays and
    other producers (their calls allocate their own outputs)."""
    kind = framework(x)
    if kind == "torch" and not torch_compiling(x):
        torch = sys.modules["torch"]
        return torch.empty(shape, dtype=getattr(torch, dtype), device=x.device)
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(x.data.device_id):
            return cupy.empty(shape, dtype=numpy_dtype(dtype))
    return None


__all__ = ["MIN_SIDE_WORK", "empty_like_in", "side_by_side"]
