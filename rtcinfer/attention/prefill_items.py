"""A prefill plan without split KV, its work items expanded on the device.

A batch whose tiles fill the GPU takes one work item per query tile (plan/prefill.py). Their 12
ints each need not cross from the host: plan() uploads the requests' table (pack_requests: a
few ints a request, after the page ids and mask in the plan region) and launches
cuda_src/attention/prefill_items.cu, which writes the items where the prefill kernel reads
them, on the upload's stream. `expand_items_host` is the same expansion in NumPy (the CPU tests'
twin of the kernel, checked against pack_plan of plan_prefill's plan, the reference).

    requests table (int32, at Capacity.requests_at): tile_indptr[B + 1], qo_start[B], qo_len[B],
        kv_len[B], page_ids[B] (where request b's page ids start in the plan), mask_byte[B]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .. import jit
from ..launch import Kernel, Launch
from ..plan.prefill import TilePlan, key_ranges
from .prefill_plan import HEADER_INTS, ITEM_COLUMN, ITEM_INTS, items_at

WARPS = 4  # requests a block (a warp each)


@dataclass(frozen=True)
class PrefillItemsSpec:
    source: ClassVar[str] = "attention/prefill_items.cu"
    kernels: ClassVar[tuple[str, ...]] = ("prefill_items_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("PrefillItemsParams",)

    def prelude(self) -> str:
        return jit.prelude()


@dataclass(frozen=True)
class ItemsLayout:
    """What the expansion needs besides the table: where the items and the table lie in the
    plan region (ints) and the tiles' shape and mask."""

    batch: int
    tile_rows: int
    group_size: int
    items_at: int
    requests_at: int
    causal: bool
    window_left: int


def requests_ints(batch: int) -> int:
    """The requests table's ints for a batch of `batch`."""
    return 6 * batch + 1


def pack_requests(buf: np.ndarray, plan: TilePlan, qo_indptr: np.ndarray,
                  first_page: np.ndarray, page_ids: np.ndarray, head_dim: int,
                  requests_at: int, freq: np.ndarray | None = None,
                  mask_byte: np.ndarray | None = None, mask: np.ndarray | None = None,
                  mask_at: int = 0) -> int:  # fmt: skip
    """Write the header, RoPE frequencies, page ids, mask and requests table of `plan` into the
    int32 host buffer `buf` (pack_plan's layout, the items left for the device); returns the
    ints used. Arguments as pack_plan's; requests_at: Capacity.requests_at."""
    w, b = plan.num_work, plan.batch_size
    start = items_at(head_dim)
    pages_at = start + ITEM_INTS * w
    buf[0] = w
    buf[1:start] = 0
    if freq is not None:
        buf[HEADER_INTS:start] = freq.view(np.int32).reshape(-1)
    buf[pages_at : pages_at + page_ids.shape[0]] = page_ids
    if mask is not None:
        buf.view(np.uint8)[4 * mask_at : 4 * mask_at + mask.shape[0]] = mask
    table = buf[requests_at : requests_at + requests_ints(b)]
    table[: b + 1] = plan.tile_indptr
    rows = table[b + 1 :].reshape(5, b)
    rows[0] = qo_indptr[:-1]
    rows[1] = plan.qo_len
    rows[2] = plan.kv_len
    np.add(first_page, pages_at, out=rows[3], casting="unsafe")
    rows[4] = 0 if mask_byte is None else mask_byte
    return requests_at + requests_ints(b)


def expand_items_host(buf: np.ndarray, layout: ItemsLayout) -> None:
    """The items of the requests table in `buf`, written into `buf` as the kernel writes them
    (each tile's keys by plan/prefill.py's key_ranges)."""
    b = layout.batch
    table = buf[layout.requests_at : layout.requests_at + requests_ints(b)].astype(np.int64)
    tile_indptr = table[: b + 1]
    qo_start, qo_len, kv_len, page_ids, mask_byte = table[b + 1 :].reshape(5, b)
    n = int(tile_indptr[-1])
    request = np.repeat(np.arange(b), np.diff(tile_indptr))
    tile_row = (np.arange(n) - tile_indptr[request]) * layout.tile_rows
    begin, end = key_ranges(qo_len, kv_len, request, tile_row, layout.group_size,
                            layout.tile_rows, layout.causal, layout.window_left)  # fmt: skip
    items = np.empty((n, ITEM_INTS), np.int32)
    for name, values in (("qo_start", qo_start[request]), ("qo_len", qo_len[request]),
                         ("kv_len", kv_len[request]), ("page_ids", page_ids[request]),
                         ("tile_row", tile_row), ("kv_begin", begin), ("kv_end", end),
                         ("slot", -1), ("tile", np.arange(n)), ("merge_slot", -1),
                         ("merge_count", 1), ("mask_byte", mask_byte[request])):  # fmt: skip
        items[:, ITEM_COLUMN[name]] = values
    buf[layout.items_at : layout.items_at + ITEM_INTS * n] = items.reshape(-1)


@functools.cache
def _kernel() -> Kernel:
    return Kernel(PrefillItemsSpec(), "prefill_items_kernel", "PrefillItemsParams")


def expand_items(plan_ptr: int, stream: int, device: int, layout: ItemsLayout) -> None:
    """Launch the expansion on `stream` of `device` (current) over the plan region at
    `plan_ptr`, whose table the upload before it on that stream wrote."""
    if not layout.batch:
        return
    launch = Launch(_kernel(), (-(-layout.batch // WARPS), 1, 1), (32 * WARPS, 1, 1))
    p = launch.params
    p.plan, p.requests = plan_ptr, plan_ptr + 4 * layout.requests_at
    p.batch, p.tile_rows, p.group_size = layout.batch, layout.tile_rows, layout.group_size
    p.items_at, p.causal, p.window_left = layout.items_at, int(layout.causal), layout.window_left
    launch(stream, device)


__all__ = [
    "ItemsLayout",
    "PrefillItemsSpec",
    "expand_items",
    "expand_items_host",
    "pack_requests",
    "requests_ints",
]
