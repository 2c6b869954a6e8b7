"""The prefill plan's layout: its capacity (workspace regions) and its packing.

Device layout (each region 256-byte aligned, the plan first):

    plan       int32[4 + D + 12 * max_work + max_pages + max_mask_ints + 6 * max_requests + 1]
                          header | RoPE | items | page ids | packed mask | requests table
    counters   int32[max_tiles * num_kv_heads]                  merge arrivals, zero at rest
    lse        float32[max_slots * num_kv_heads * tile_rows]    partial LSE of split tiles
    o          float32[max_slots * num_kv_heads * tile_rows, head_dim_vo]   partial outputs

The header is [num_work, 0, 0, 0], then D ints of RoPE frequencies (head_dim / 2 float32
(hi, lo) pairs in turns per position; zero without RoPE); the work items are the kernel's
PrefillWorkItem structs (cuda_src/attention/prefill.cu) written by field name through a NumPy
record of the same layout; their `page_ids` index the page ids inside the plan region. A ragged
KV cache is a paged one whose request b is one "page" starting at row kv_indptr[b] (page size
2^30). A custom mask's packed bytes, when they travel with the plan (a host mask, or any mask
of a CUDA-graph wrapper, whose address must not move), start at int `mask_at` of the region,
a fixed place for a given capacity; the items' mask_byte count from there. A plan without
split KV may leave its items to the device (prefill_items.py), which expands them from the
requests table at `requests_at` (room for max_requests requests; none when 0).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .. import jit
from ..params import record_dtype
from .workspace import region_offsets

WORK_ITEM = record_dtype(jit.source_layout("attention/prefill.cu", "PrefillWorkItem"))
ITEM_INTS = WORK_ITEM.itemsize // 4
# field name -> its int in an item (every field of PrefillWorkItem is one int32)
ITEM_COLUMN = {name: WORK_ITEM.fields[name][1] // 4 for name in WORK_ITEM.names}
assert len(ITEM_COLUMN) == ITEM_INTS and all(
    WORK_ITEM.fields[name][0] == np.dtype(np.int32) for name in WORK_ITEM.names
), "PrefillWorkItem is all int32 fields"
HEADER_INTS = 4
RAGGED_PAGE = 1 << 30  # a ragged request is one page of this many token slots
# a Capacity's counts (the rest is its shape)
_COUNTS = ("max_work", "max_pages", "max_tiles", "max_slots", "max_mask_ints", "max_requests")


@dataclass(frozen=True)
class Capacity:
    max_work: int
    max_pages: int
    max_tiles: int
    max_slots: int
    num_kv_heads: int
    tile_rows: int
    head_dim: int  # q's and k's (the RoPE frequencies' room)
    max_mask_ints: int = 0  # the packed custom mask's room in the plan region
    max_requests: int = 0  # the requests table's room (prefill_items.py), in requests
    head_dim_vo: int | None = None  # v's and o's (the partial outputs' rows), None: head_dim

    @property
    def dim_vo(self) -> int:
        return self.head_dim if self.head_dim_vo is None else self.head_dim_vo

    @property
    def mask_at(self) -> int:
        """Where the packed mask starts in the plan region (ints)."""
        return items_at(self.head_dim) + ITEM_INTS * self.max_work + self.max_pages

    @property
    def requests_at(self) -> int:
        """Where the requests table starts in the plan region (ints)."""
        return self.mask_at + self.max_mask_ints

    @property
    def plan_ints(self) -> int:
        return self.requests_at + (6 * self.max_requests + 1 if self.max_requests else 0)

    def offsets(self) -> dict[str, int]:
        """Byte offset of every region, and "end" (the bytes needed)."""
        rows = self.max_slots * self.num_kv_heads * self.tile_rows
        return region_offsets({
            "plan": 4 * self.plan_ints,
            "counters": 4 * self.max_tiles * self.num_kv_heads,
            "lse": 4 * rows,
            "o": 4 * rows * self.dim_vo,
        })  # fmt: skip

    @property
    def zeroed_bytes(self) -> int:
        """The plan's slots and the merge counters start at zero."""
        return self.offsets()["lse"]

    def _shape(self) -> tuple:
        return self.num_kv_heads, self.tile_rows, self.head_dim, self.dim_vo

    def covers(self, other: Capacity) -> bool:
        """Whether this layout serves `other`: the same shape and every count at least its."""
        return self._shape() == other._shape() and all(
            getattr(self, f) >= getattr(other, f) for f in _COUNTS
        )

    def grown(self, need: Capacity) -> Capacity:
        """A capacity covering `need`, at least doubling any count that must grow; after a
        change of shape, `need` itself."""
        if self._shape() != need._shape():
            return need

        def grow(have: int, want: int) -> int:
            return have if have >= want else max(want, 2 * have)

        return replace(need, **{f: grow(getattr(self, f), getattr(need, f)) for f in _COUNTS})


@dataclass(frozen=True)
class GraphCapacity:
    """What a CUDA-graph prefill wrapper keeps fixed across plans of one configuration: the
    kernel's tile, the query rows run() takes (the first plan's), and the workspace layout."""

    cfg: object  # the PrefillConfig
    tile_rows: int
    rows: int
    capacity: Capacity


def items_at(head_dim: int) -> int:
    """Where the work items start in the plan (ints)."""
    return HEADER_INTS + head_dim


def pack_plan(buf: np.ndarray, plan, qo_indptr: np.ndarray, first_page: np.ndarray,
              page_ids: np.ndarray, head_dim: int, freq: np.ndarray | None = None,
              mask_byte: np.ndarray | None = None, mask: np.ndarray | None = None,
              mask_at: int = 0) -> int:  # fmt: skip
    """Write a PrefillPlan into the int32 host buffer `buf`; returns the ints used.

    qo_indptr: int64[B + 1]; first_page: int64[B], where request b's page ids start in
    `page_ids` (the paged table's kv_indptr[:-1], or arange(B) for a ragged cache whose page
    ids are its kv_indptr[:-1]); freq: float32 [head_dim / 2, 2] RoPE frequencies or None;
    mask_byte: int64[B], where request b's bits start in the packed custom mask (None: no
    mask); mask: the packed mask's bytes (uint8, host) to write at int mask_at, or None (the
    mask is elsewhere, or copied there on the device)."""
    w = plan.num_work
    start = items_at(head_dim)
    pages_at = start + ITEM_INTS * w
    n = pages_at + page_ids.shape[0]
    buf[0] = w
    buf[1:start] = 0
    if freq is not None:
        buf[HEADER_INTS:start] = freq.view(np.int32).reshape(-1)
    # The items' fields, one contiguous row each (named by the record's layout), then written
    # interleaved into the buffer in one transposing copy: faster than 12 strided writes.
    cols = np.empty((ITEM_INTS, w), np.int32)

    def put(name, values):
        cols[ITEM_COLUMN[name]] = values

    if w == plan.num_tiles:  # one item per tile (work_tile is the identity): no gathers
        tile, request = plan.work_tile, plan.tile_request
        put("tile_row", plan.tile_row)
        put("merge_slot", plan.tile_slot)
        put("merge_count", plan.tile_items)
    else:
        tile = plan.work_tile
        request = plan.tile_request[tile]
        put("tile_row", plan.tile_row[tile])
        put("merge_slot", plan.tile_slot[tile])
        put("merge_count", plan.tile_items[tile])
    put("qo_start", qo_indptr[:-1][request])
    put("qo_len", plan.qo_len[request])
    put("kv_len", plan.kv_len[request])
    np.add(first_page[request], pages_at, out=cols[ITEM_COLUMN["page_ids"]], casting="unsafe")
    put("kv_begin", plan.work_kv_begin)
    put("kv_end", plan.work_kv_end)
    put("slot", plan.work_slot)
    put("tile", tile)
    put("mask_byte", 0 if mask_byte is None else mask_byte[request])
    buf[start:pages_at].reshape(w, ITEM_INTS)[:] = cols.T
    buf[pages_at:n] = page_ids
    if mask is not None:
        buf.view(np.uint8)[4 * mask_at : 4 * mask_at + mask.shape[0]] = mask
        n = max(n, mask_at + -(-mask.shape[0] // 4))
    return n


__all__ = [
    "Capacity",
    "GraphCapacity",
    "HEADER_INTS",
    "ITEM_COLUMN",
    "ITEM_INTS",
    "RAGGED_PAGE",
    "WORK_ITEM",
    "items_at",
    "pack_plan",
]
