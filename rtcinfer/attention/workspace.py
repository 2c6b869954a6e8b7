"""The decode workspace: one device buffer laid out for a capacity, and the plan upload.

Device layout (each region 256-byte aligned):

    plan       int32[HEADER + 8 * max_work + max_pages]       header | work items | page ids
    counters   int32[max_batch * kv_blocks]                    split-merge arrivals, zero at rest
    lse        float32[num_qo_heads * partial_work]            partial LSE of split work items
    o          float32[num_qo_heads * partial_work, head_dim]  partial outputs (rows: decode.cu)

partial_work is at least the grid's item count when a plan splits (decode.cu strides the
partial rows by it) and may be 0 for a plan of whole requests, which writes no partials.

The plan header is [num_work, 0, 0, 0, RoPE frequencies as (hi, lo) float32 pairs]; the work
items are the kernel's DecodeWorkItem structs (cuda_src/attention/decode.cu), written here by
field name through a NumPy record of the same layout; their `page_ids` index the page ids
inside the plan region. A plan is packed into one of two pinned host buffers and sent with one
async copy; an event per buffer keeps a buffer from being rewritten while its copy may still be
reading it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .. import jit
from ..params import record_dtype

ALIGN = 256
WORK_ITEM = record_dtype(jit.source_layout("attention/decode.cu", "DecodeWorkItem"))
ITEM_INTS = WORK_ITEM.itemsize // 4


def header_ints(head_dim: int) -> int:
    return 4 + head_dim


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Capacity:
    max_batch: int
    max_work: int
    max_pages: int
    num_qo_heads: int
    kv_blocks: int  # kv heads x query-head subgroups: the grid's second dimension
    head_dim: int
    partial_work: int  # items with room for partials: >= the grid's items if a plan splits

    @property
    def plan_ints(self) -> int:
        return header_ints(self.head_dim) + ITEM_INTS * self.max_work + self.max_pages

    def offsets(self) -> dict[str, int]:
        """Byte offset of every region, and "end" (the bytes needed)."""
        sizes = {
            "plan": 4 * self.plan_ints,
            "counters": 4 * self.max_batch * self.kv_blocks,
            "lse": 4 * self.partial_work * self.num_qo_heads,
            "o": 4 * self.partial_work * self.num_qo_heads * self.head_dim,
        }
        out, at = {}, 0
        for name, size in sizes.items():
            out[name] = at
            at += _align(size)
        out["end"] = at
        return out

    def same_heads(self, other: Capacity) -> bool:
        return (self.num_qo_heads, self.kv_blocks, self.head_dim) == (
            other.num_qo_heads, other.kv_blocks, other.head_dim)  # fmt: skip

    def covers(self, other: Capacity) -> bool:
        """Whether this layout serves `other`: the same heads and every count at least its."""
        return (
            self.same_heads(other)
            and self.max_batch >= other.max_batch
            and self.max_work >= other.max_work
            and self.max_pages >= other.max_pages
            and self.partial_work >= other.partial_work
        )

    def grown(self, need: Capacity) -> Capacity:
        """A capacity covering `need`, at least doubling any count that must grow; after a
        change of heads, `need` itself (the old counts belong to another layout)."""
        if not self.same_heads(need):
            return need

        def grow(have: int, want: int) -> int:
            return have if have >= want else max(want, 2 * have)

        return Capacity(
            grow(self.max_batch, need.max_batch),
            grow(self.max_work, need.max_work),
            grow(self.max_pages, need.max_pages),
            need.num_qo_heads,
            need.kv_blocks,
            need.head_dim,
            grow(self.partial_work, need.partial_work),
        )


_WHOLE = np.zeros(0, dtype=WORK_ITEM)


def _whole_requests(batch: int) -> np.ndarray:
    """The constant fields of a plan of one item per request: item b has request = b,
    token_begin = 0, merge_begin = b, merge_count = 1 for b < batch (a read-only view of one
    table, grown by doubling; the caller copies it)."""
    global _WHOLE
    if _WHOLE.shape[0] < batch:
        rows = np.zeros(max(batch, 2 * _WHOLE.shape[0]), dtype=WORK_ITEM)
        rows["request"] = rows["merge_begin"] = np.arange(rows.shape[0], dtype=np.int32)
        rows["merge_count"] = 1
        rows.flags.writeable = False
        _WHOLE = rows
    return _WHOLE[:batch]


def pack_plan(buf: np.ndarray, plan, kv_indptr: np.ndarray, kv_indices, head_dim: int, freq):
    """Write a DecodePlan into the int32 host buffer `buf` (layout above); returns ints used.

    kv_indptr: int64[B + 1] (validated); kv_indices: ints [kv_indptr[-1]]; freq: float32
    [head_dim / 2, 2] RoPE frequencies (hi, lo) or None.
    """
    hdr = header_ints(head_dim)
    w = plan.num_work
    pages_at = hdr + ITEM_INTS * w
    n = pages_at + kv_indices.shape[0]
    buf[0] = w
    buf[1:4] = 0
    if freq is not None:
        buf[4:hdr] = freq.view(np.int32).reshape(-1)
    work = buf[hdr:pages_at].view(WORK_ITEM)
    merge = plan.merge_indptr
    if w == plan.batch_size:  # one item per request: no gathers, token range [0, kv_len)
        work[:] = _whole_requests(w)
        work["token_end"] = plan.kv_len
        work["kv_len"] = plan.kv_len
        first_page = kv_indptr[:-1]
    else:
        req = plan.work_request
        work["request"] = req
        plan.work_token_bounds(work["token_begin"], work["token_end"])
        work["kv_len"] = plan.kv_len[req]
        work["merge_begin"] = merge[:-1][req]
        work["merge_count"] = (merge[1:] - merge[:-1])[req]
        work["unused"] = 0
        first_page = kv_indptr[:-1][req]
    np.add(first_page, pages_at, out=work["page_ids"], casting="unsafe")
    buf[pages_at:n] = kv_indices
    return n


@functools.cache
def _runtime():
    """CuPy's CUDA runtime module (imported on first use: this module loads without CuPy)."""
    from cupy_backends.cuda.api import runtime

    return runtime


def user_base(ptr: int, nbytes: int, need: int, cap: Capacity) -> int:
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
    """Device buffer with a Capacity layout, plus the pinned double buffer of the upload.

    `buffer` (any CUDA array, its bytes are used) is the caller's memory; None allocates with
    CuPy. reserve() lays the buffer out for a capacity: a fixed workspace keeps its layout for
    as long as the configuration is the same, a growing one doubles what is too small.
    Re-allocating waits for the device (earlier launches may still use the old buffer).
    """

    def __init__(self, device_id: int, buffer=None):
        self.device_id = device_id
        self.user = buffer
        self.capacity: Capacity | None = None
        self.base = 0
        self._memory = None
        self._host: list[np.ndarray] = []
        self._pinned: list = []
        self._events: list = []
        self._pending = [False, False]
        self._next = 0
        self.stream_ptr = None  # stream of the latest upload
        self.pointers: dict[str, int] = {}

    def reserve(self, need: Capacity, stream, grow: bool) -> None:
        if self.capacity is not None and (
            self.capacity.covers(need) if grow else self.capacity == need
        ):
            return
        import cupy

        runtime = _runtime()
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
        runtime.memsetAsync(self.base, 0, off["lse"], stream.ptr)  # plan slots and counters
        self.pointers = {name: self.base + at for name, at in off.items()}
        if not self._host or self._host[0].shape[0] < cap.plan_ints:
            self._wait_uploads()
            self._pinned = [cupy.cuda.alloc_pinned_memory(4 * cap.plan_ints) for _ in range(2)]
            self._host = [np.frombuffer(m, np.int32, cap.plan_ints) for m in self._pinned]
            self._events = [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(2)]
            self._pending = [False, False]
        self.capacity = cap

    def pointer(self, region: str) -> int:
        return self.pointers[region]

    def upload(self, fill, stream) -> None:
        """fill(int32 host buffer) -> ints written; one async copy of them to the plan region."""
        runtime = _runtime()
        i = self._next
        self._next ^= 1
        if self._pending[i]:
            self._events[i].synchronize()  # the copy that last read this buffer is done
        host = self._host[i]
        n = fill(host)
        runtime.memcpyAsync(self.base, self._pinned[i].ptr, 4 * n, 1, stream.ptr)  # host->device
        self._events[i].record(stream)
        self._pending[i] = True
        self.stream_ptr = stream.ptr

    def last_upload(self):
        """Event recorded after the most recent upload."""
        return self._events[self._next ^ 1]

    def _wait_uploads(self) -> None:
        for i, pending in enumerate(self._pending):
            if pending:
                self._events[i].synchronize()
