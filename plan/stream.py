"""Work queue for persistent decode CTAs: whole requests first, small pieces last.

When a batch alone fills the GPU, one CTA per (request, kv head) finishes unevenly: SMs do not
stream at the same rate (the ones in less crowded parts of the chip run faster), so the fast
CTAs idle while the slowest finish and the DRAM goes under-used. The persistent kernel instead
runs P = `columns_slots` CTAs per kv head that pull work items from a queue; this module cuts
the requests into that queue so that the pulls balance themselves:

    rows: each request's token range (its window, if any), longest first
    a row longer than the average work per CTA (A = total / P) is cut into bodies of <= A
    the last 2P rows keep a tail of TAIL_FRACTION of their pages, cut into pieces that halve
      down to `unit` pages (16, 8, 4, ... of 64, say)
    queue: every body in row order, then the tail pieces, largest first

A CTA that runs slow takes fewer of the small pieces at the end, so the CTAs finish within
about one small piece of each other, while a request is cut into a handful of pieces at most.
Piece boundaries depend only on the batch and each piece writes its own partial (merged in
chunk order), so results are reproducible run to run.
"""

from __future__ import annotations

import numpy as np

# Share of each of the last 2P rows that goes to the queue's tail, in halving pieces.
TAIL_FRACTION = 0.25


def _halving(tail: np.ndarray, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """Sizes of the pieces that cut each tail (int64[R] pages) in halves down to unit pages:
    tail = t/2 + t/4 + ... + the rest (the last two pieces >= unit). Returns (row, size)."""
    rows, sizes, left = [], [], tail.copy()
    idx = np.arange(tail.shape[0])
    while True:
        live = left > 0
        if not live.any():
            break
        size = np.where(left >= 2 * unit, np.maximum(left // 2, unit), left)
        size = np.where(live, size, 0)
        rows.append(idx[live])
        sizes.append(size[live])
        left -= size
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(rows), np.concatenate(sizes)


def stream_pieces(
    pages: np.ndarray, kv_len: np.ndarray, page_size: int, columns_slots: int, unit_pages: int,
    window_left: int = -1,
):  # fmt: skip
    """Cut every request into queue-ordered pieces of whole pages.

    pages, kv_len: int64[B], every kv_len >= 1. Returns int32 arrays (request, token start,
    token end, slot) per piece in queue order and merge_indptr [B + 1]: request b's pieces own
    slots merge_indptr[b] .. merge_indptr[b + 1] - 1 in token order. Every piece holds at least
    one token of its request's window.
    """
    first_page = np.zeros_like(pages)
    if window_left >= 0:  # pages wholly before the window hold no token the query sees
        first_page = np.maximum(kv_len - 1 - window_left, 0) // page_size
    rows = pages - first_page
    order = np.argsort(-rows, kind="stable")
    n = rows[order]
    tail = np.zeros_like(n)
    last = n.shape[0] - min(n.shape[0], 2 * columns_slots)
    tail[last:] = np.minimum((n[last:] * TAIL_FRACTION).astype(np.int64), n[last:] - 1)
    tail[tail < unit_pages] = 0
    body = n - tail
    average = max(-(-int(n.sum()) // columns_slots), 1)
    bodies = -(-body // average)  # near-equal bodies per row

    # Pieces as (row in sorted order, first page, pages), bodies first, in queue order.
    b_row = np.repeat(np.arange(n.shape[0]), bodies)
    j = np.arange(b_row.shape[0]) - np.repeat(np.cumsum(bodies) - bodies, bodies)
    b_first = j * body[b_row] // bodies[b_row]
    b_size = (j + 1) * body[b_row] // bodies[b_row] - b_first
    t_row, t_size = _halving(tail, unit_pages)
    t_first = np.zeros_like(t_size)
    if t_row.shape[0]:  # a row's tail pieces follow its body in token order
        by_row = np.argsort(t_row, kind="stable")
        done = np.cumsum(t_size[by_row]) - t_size[by_row]
        row_start = np.searchsorted(t_row[by_row], np.arange(n.shape[0]))
        t_first[by_row] = (
            body[t_row[by_row]]
            + done
            - done[np.minimum(row_start, done.shape[0] - 1)][t_row[by_row]]
        )
    queue = np.argsort(-t_size, kind="stable")
    row = np.concatenate((b_row, t_row[queue]))
    first = np.concatenate((b_first, t_first[queue]))
    size = np.concatenate((b_size, t_size[queue]))

    request = order[row]
    token_start = (first_page[request] + first) * page_size
    token_end = np.minimum((first_page[request] + first + size) * page_size, kv_len[request])
    per_request = np.bincount(request, minlength=pages.shape[0])
    merge_indptr = np.zeros(pages.shape[0] + 1, dtype=np.int64)
    np.cumsum(per_request, out=merge_indptr[1:])
    by_request = np.lexsort((token_start, request))
    slot = np.empty_like(by_request)
    slot[by_request] = np.arange(by_request.shape[0])
    return tuple(a.astype(np.int32) for a in (request, token_start, token_end, slot, merge_indptr))
