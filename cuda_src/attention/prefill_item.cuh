// A work item of the prefill plan: written by the host (rtcinfer/attention/prefill_plan.py, by
// these names) or expanded on the device from the batch's requests (prefill_items.cu); read
// by the prefill kernel (prefill.cu), one per CTA row of its grid.
#pragma once

struct alignas(16) PrefillWorkItem {
  int qo_start;     // the request's first query row in q / o
  int qo_len;       // its queries
  int kv_len;       // its keys
  int page_ids;     // where its page ids start in the plan (ints)
  int tile_row;     // the tile's first packed row
  int kv_begin;     // this item's keys: [kv_begin, kv_end)
  int kv_end;
  int slot;         // the item's partial slot; -1: the tile's only item, rows written directly
  int tile;         // the tile's index (its merge counters)
  int merge_slot;   // the tile's first slot
  int merge_count;  // the tile's items
  int mask_byte;    // CUSTOM_MASK: the request's first byte in the packed mask
};

