"""A wrapper's workspace: one device buffer laid out in regions for a capacity, and the one-copy
upload of a packed plan into its first region.

A capacity is a frozen value of the wrapper's own kind (attention/decode_plan.py's Capacity)
that gives `offsets()` (byte offset of each region, the plan at 0, and "end"),
`zeroed_bytes` (what starts at zero), `plan_ints` (the plan region's int32 count),
`covers(other)` and `grown(need)`. A plan is packed into one of two pinned host buffers and
sent with one async copy; an event per buffer keeps a buffer from being rewritten while its
copy may still be reading it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import gpu
from ..interop import OutSlot
from ..launch import driver

ALIGN = 256


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def region_offsets(sizes: dict[str, int]) -> dict[str, int]:
    """Byte offset of each region (sizes in bytes, in order, each ALIGN-aligned) and "end"."""
    out, at = {}, 0
    for name, size in sizes.items():
        out[name] = at
        at += _align(size)
    out["end"] = at
    return out


class SplitScratch(NamedTuple):
    """A one-shot call's split-KV scratch (single decode and prefill: per call, so concurrent
    calls never share it) as one float32 output, one allocation: partial o [rows, head_dim],
    then partial LSE [rows] at byte `lse_at`, then int32 merge counters [counters] at byte
    `counters_at` (zeroed by the call)."""

    slot: OutSlot
    lse_at: int
    counters_at: int


def split_scratch(rows: int, head_dim: int, counters: int) -> SplitScratch:
    """The scratch of `rows` partial rows of head_dim floats and `counters` counters."""
    return SplitScratch(OutSlot((rows * (head_dim + 1) + counters,), "float32"),
                        4 * rows * head_dim, 4 * rows * (head_dim + 1))  # fmt: skip


# cudaErrorStreamCaptureUnsupported ... cudaErrorStreamCaptureImplicit, cudaErrorCapturedEvent,
# cudaErrorStreamCaptureWrongThread: what a synchronous copy or allocation meets during capture
_CAPTURE_ERRORS = range(900, 909)


def device_copy(host, device: int, what: str = "this call"):
    """A device copy of the host array `host` (CuPy memory: it lives as long as it is
    referenced, e.g. by the prepared launch that reads it). It is made once per call
    signature, synchronously, with the thread in relaxed capture mode: inside a CUDA-graph
    capture on a non-blocking stream (torch.cuda.graph's, a CuPy capture stream) the
    allocation and copy happen now, outside the graph, and the captured kernel reads them on
    every replay. Where the copy cannot happen (a capture on a stream that synchronizes with
    the legacy stream), the error says to make `what` once before capturing."""
    import cupy

    cu = driver()
    _, mode = cu.cuThreadExchangeStreamCaptureMode(
        cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    )
    try:
        with cupy.cuda.Device(device):
            memory = cupy.cuda.alloc(host.nbytes)
            memory.copy_from_host(host.ctypes.data, host.nbytes)
    except cupy.cuda.runtime.CUDARuntimeError as e:
        if e.status not in _CAPTURE_ERRORS:
            raise
        raise RuntimeError(
            f"{what} uploads its plan once for its shapes, which cannot happen inside this "
            f"CUDA-graph capture ({e}): make the same call once before capturing (the warm-up "
            "run CUDA graphs want anyway), then capture it"
        ) from e
    finally:
        cu.cuThreadExchangeStreamCaptureMode(mode)
    return memory


def user_base(ptr: int, nbytes: int, need: int, cap) -> int:
    """Where the layout starts in a caller's buffer of `nbytes` at `ptr`: the first ALIGN-byte
    boundary (the kernel reads the plan as int4 and the partials as float4); raises when the
    rest is smaller than `need`."""
    base = _align(ptr)
    if nbytes - (base - ptr) < need:
        raise ValueError(
            f"workspace: {nbytes} bytes at address {ptr:#x} ({base - ptr} skipped to align it "
            f"to {ALIGN} bytes) is too small for this plan, which needs {need} bytes ({cap})"
        )
    return base


class Workspace:
    """Device buffer with a capacity's layout, plus the pinned double buffer of the upload.

    `buffer` (any CUDA array, its bytes are used) is the caller's memory; None allocates with
    CuPy. reserve() lays the buffer out for a capacity: a fixed workspace keeps its layout for
    as long as the configuration is the same, a growing one doubles what is too small.
    Re-allocating waits for the device (earlier launches may still use the old buffer).
    """

    def __init__(self, device_id: int, buffer=None):
        self.device_id = device_id
        self.user = buffer
        self.capacity = None
        self.base = 0
        self._memory = None
        self._host: list[np.ndarray] = []
        self._pinned: list = []
        self._events: list = []
        self._pending = [False, False]
        self._next = 0
        self.stream_ptr = None  # stream of the latest upload
        self.pointers: dict[str, int] = {}

    def reserve(self, need, stream, grow: bool) -> None:
        if self.capacity is not None and (
            self.capacity.covers(need) if grow else self.capacity == need
        ):
            return
        import cupy

        runtime = gpu.runtime()
        cap = self.capacity.grown(need) if grow and self.capacity is not None else need
        nbytes = cap.offsets()["end"]
        if self.capacity is not None:
            cupy.cuda.Device(self.device_id).synchronize()
        if self.user is not None:
            self.base = user_base(int(self.user.data.ptr), self.user.nbytes, nbytes, cap)
        else:
            self._memory = None
            with cupy.cuda.Device(self.device_id):
                self._memory = cupy.cuda.alloc(nbytes)
            self.base = int(self._memory.ptr)
        off = cap.offsets()
        runtime.memsetAsync(self.base, 0, cap.zeroed_bytes, stream.ptr)
        self.pointers = {name: self.base + at for name, at in off.items()}
        if not self._host or self._host[0].shape[0] < cap.plan_ints:
            self.wait_uploads()
            self._pinned = [cupy.cuda.alloc_pinned_memory(4 * cap.plan_ints) for _ in range(2)]
            self._host = [np.frombuffer(m, np.int32, cap.plan_ints) for m in self._pinned]
            self._events = [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(2)]
            self._pending = [False, False]
        self.capacity = cap

    def pointer(self, region: str) -> int:
        return self.pointers[region]

    def upload(self, fill, stream, after=None) -> None:
        """fill(int32 host buffer) -> ints written; one async copy of them to the plan region,
        then after(pointers, stream) (device work on the plan, ordered behind the copy) when
        given; last_upload() covers both."""
        runtime = gpu.runtime()
        i = self._next
        self._next ^= 1
        if self._pending[i]:
            self._events[i].synchronize()  # the copy that last read this buffer is done
        host = self._host[i]
        n = fill(host)
        runtime.memcpyAsync(self.base, self._pinned[i].ptr, 4 * n, 1, stream.ptr)  # host->device
        if after is not None:
            after(self.pointers, stream)
        self._events[i].record(stream)
        self._pending[i] = True
        self.stream_ptr = stream.ptr

    def fill_host(self, fill) -> None:
        """fill(int32 host buffer) into the buffer the next upload would use, without sending
        it (a plan no device run reads yet)."""
        i = self._next
        if self._pending[i]:
            self._events[i].synchronize()  # the copy that last read this buffer is done
            self._pending[i] = False
        fill(self._host[i])

    def last_upload(self):
        """Event recorded after the most recent upload."""
        return self._events[self._next ^ 1]

    def wait_uploads(self) -> None:
        """Wait for the copies that may still read the pinned host buffers."""
        for i, pending in enumerate(self._pending):
            if pending:
                self._events[i].synchronize()
