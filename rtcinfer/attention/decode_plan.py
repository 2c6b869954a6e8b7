"""The decode plan's layout: its capacity (workspace regions) and its packing.

Device layout (each region 256-byte aligned, the plan first):

    plan       int32[HEADER + 8 * max_work + max_pages]       header | work items | page ids
               (a fixed capacity's page ids start after room for max_work items)
    counters   int32[max_batch * kv_blocks]                    split-merge arrivals, zero at rest
    lse        float32[num_qo_heads * partial_work]            partial LSE of split work items
    o          float32[num_qo_heads * partial_work, head_dim]  partial outputs (rows: decode.cu)

partial_work is at least the grid's item count when a plan splits (decode.cu strides the
partial rows by it) and may be 0 for a plan of whole requests, which writes no partials.

The plan header is [num_work, 0, 0, 0, RoPE frequencies as (hi, lo) float32 pairs or zeros];
the work items are the kernel's DecodeWorkItem structs (cuda_src/attention/decode_item.cuh),
written here by field name through a NumPy record of the same layout; their `page_ids` index
the page ids inside the plan region. attention/decode_device_plan.py builds the same plan on
the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import jit
from ..params import record_dtype
from .workspace import region_offsets

WORK_ITEM = record_dtype(jit.source_layout("attention/decode_item.cuh", "DecodeWorkItem"))
ITEM_INTS = WORK_ITEM.itemsize // 4


def header_ints(head_dim: int) -> int:
    return 4 + head_dim


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
        return region_offsets({
            "plan": 4 * self.plan_ints,
            "counters": 4 * self.max_batch * self.kv_blocks,
            "lse": 4 * self.partial_work * self.num_qo_heads,
            "o": 4 * self.partial_work * self.num_qo_heads * self.head_dim,
        })  # fmt: skip

    @property
    def zeroed_bytes(self) -> int:
        """The plan's slots and the merge counters start at zero."""
        return self.offsets()["lse"]

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


def pack_plan(buf: np.ndarray, plan, kv_indptr: np.ndarray, kv_indices, head_dim: int, freq,
              items_room: int | None = None):  # fmt: skip
    """Write a DecodePlan into the int32 host buffer `buf` (layout above); returns ints used.

    kv_indptr: int64[B + 1] (validated); kv_indices: ints [kv_indptr[-1]]; freq: float32
    [head_dim / 2, 2] RoPE frequencies (hi, lo) or None. items_room: the work items the page
    ids follow (a capacity's max_work: where they lie then does not depend on the plan, as in
    the plan built on the device; zeros fill the room past the plan's items), None: the plan's.
    """
    hdr = header_ints(head_dim)
    w = plan.num_work
    items_end = hdr + ITEM_INTS * w
    pages_at = items_end if items_room is None else hdr + ITEM_INTS * items_room
    buf[items_end:pages_at] = 0
    n = pages_at + kv_indices.shape[0]
    buf[0] = w
    buf[1:4] = 0
    if freq is not None:
        buf[4:hdr] = freq.view(np.int32).reshape(-1)
    else:  # zeros, not what the reused buffer held: a plan array is the same for the same plan
        buf[4:hdr] = 0
    work = buf[hdr:items_end].view(WORK_ITEM)
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
        begin_of = merge[req]
        work["merge_begin"] = begin_of
        np.subtract(merge[req + 1], begin_of, out=work["merge_count"])
        work["unused"] = 0
        first_page = kv_indptr[req]
    np.add(first_page, pages_at, out=work["page_ids"], casting="unsafe")
    buf[pages_at:n] = kv_indices
    return n
