"""How a batch prefill plan reaches its plan region: what the host writes (`fill`, into the
int32 staging buffer of the one upload) and the device work ordered behind the upload
(`after`): a device mask's copy into the plan, and the device expansion of a TilePlan's work
items (prefill_items.py), which leaves pack_plan's 12 ints an item off the host."""

from __future__ import annotations

from ..launch import memcpy_async
from ..plan.prefill import TilePlan
from .prefill_items import ItemsLayout, expand_items, pack_requests
from .prefill_plan import Capacity, items_at, pack_plan


def items_layout(plan: TilePlan, capacity: Capacity, cfg) -> ItemsLayout:
    """What the expansion of a TilePlan's items needs besides its requests table."""
    attn = cfg.attn
    return ItemsLayout(plan.batch_size, plan.tile_rows, attn.group_size, items_at(attn.head_dim),
                       capacity.requests_at, cfg.causal, attn.window_left)  # fmt: skip


def plan_writers(plan, capacity: Capacity, cfg, qo_indptr, first_page, page_ids, mask,
                 mask_in_plan: bool, device: int) -> tuple:  # fmt: skip
    """(fill(buf) -> ints written, after(regions, stream) or None) for PlannedWrapper._upload:
    `plan` a PrefillPlan (packed whole by pack_plan) or a TilePlan (its items expanded on
    `device`); `mask` the plan()'s PackedMask or None, its bytes written into the plan region
    when mask_in_plan (from the host, or copied there on the device)."""
    attn = cfg.attn
    freq = attn.freq()
    mask_byte = None if mask is None else mask.mask_byte
    mask_host = None if mask is None else mask.host
    copy_mask = None
    if mask_in_plan and mask_host is None:

        def copy_mask(regions, stream):
            dst = regions["plan"] + 4 * capacity.mask_at
            memcpy_async(dst, mask.device, mask.nbytes, stream)

    if not isinstance(plan, TilePlan):

        def fill(buf):
            return pack_plan(buf, plan, qo_indptr, first_page, page_ids, attn.head_dim, freq,
                             mask_byte, mask_host, capacity.mask_at)  # fmt: skip

        return fill, copy_mask

    layout = items_layout(plan, capacity, cfg)

    def fill(buf):
        return pack_requests(buf, plan, qo_indptr, first_page, page_ids, attn.head_dim,
                             capacity.requests_at, freq, mask_byte, mask_host,
                             capacity.mask_at)  # fmt: skip

    def after(regions, stream):
        if copy_mask is not None:
            copy_mask(regions, stream)
        expand_items(regions["plan"], stream.ptr, device, layout)

    return fill, after


__all__ = ["items_layout", "plan_writers"]
