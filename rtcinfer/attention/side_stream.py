"""Two pieces of GPU work of one call run side by side: `main()` on the caller's current stream
and `side()` on a second stream of the same framework, forked from the current stream and
joined back into it (events, no host sync), so that a compute-bound kernel and a memory-bound
one share the GPU instead of queueing. A CUDA-graph capture of the caller's stream takes both
branches in (the side stream joins the capture through the fork event).

    current:  ──fork──[first launched]──────────wait(join)──> (whatever follows)
                  └──side: ...[side()]...──join──┘

`side()` must write only arrays allocated before the fork (on the current stream) or ones it
allocates itself and drops (each framework's allocator orders a stream's own reuse). JAX
arrays and calls while torch.compile traces run the two in order on the current stream (XLA
owns the streams there), as do arrays of other producers.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from ..interop.arrays import framework, torch_compiling
from ..interop.dtypes import numpy_dtype
from ..launch import record_event, wait_event

_SIDE: dict[tuple[str, int], tuple[object, object, object]] = {}  # (framework, device) -> state
# One fork-join at a time: threads share a side stream and its two events.
_LOCK = threading.RLock()


def _torch_streams(x):
    """(current stream handle, the side stream's context, its handle, fork event, join event)."""
    torch = sys.modules["torch"]
    device = x.get_device()
    side, fork, join = _side_state("torch", device)
    current = torch.cuda.current_stream(device).cuda_stream
    return current, torch.cuda.stream(side), side.cuda_stream, fork, join


def _cupy_streams(x):
    import cupy

    device = x.data.device_id
    side, fork, join = _side_state("cupy", device)
    return cupy.cuda.get_current_stream().ptr, side, side.ptr, fork, join


def _side_state(kind: str, device: int):
    state = _SIDE.get((kind, device))
    if state is None:
        import cupy

        with _LOCK, cupy.cuda.Device(device):
            if kind == "torch":
                side = sys.modules["torch"].cuda.Stream(device=device)
            else:
                side = cupy.cuda.Stream(non_blocking=True)
            events = [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(2)]
            state = _SIDE.setdefault((kind, device), (side, *events))
    return state


def side_by_side(x, main: Callable, side: Callable, side_first: bool = False) -> tuple:
    """(main(), side()), run concurrently when `x` (an array of the call) is a PyTorch or CuPy
    array, else one after the other. `side_first`: side() is launched first (the longer piece
    should start first: it then has the GPU to itself while the other fills the gaps)."""
    kind = framework(x)
    if kind not in ("torch", "cupy") or torch_compiling(x):
        if side_first:
            s = side()
            return main(), s
        return main(), side()
    with _LOCK:
        current, context, side_ptr, fork, join = (_torch_streams if kind == "torch"
                                                  else _cupy_streams)(x)  # fmt: skip
        record_event(fork.ptr, current)
        wait_event(side_ptr, fork.ptr)
        try:
            if side_first:
                with context:
                    s = side()
                m = main()
            else:
                m = main()
                with context:
                    s = side()
        finally:  # the side stream rejoins even when a call raised (a capture must end joined)
            record_event(join.ptr, side_ptr)
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


__all__ = ["empty_like_in", "side_by_side"]
