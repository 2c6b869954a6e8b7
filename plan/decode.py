"""Split-KV work plan for batch decode over a paged KV cache.

Decode runs one query token per request against that request's cached keys. A GPU kernel
launches one CTA per (work item, kv head); when the batch alone cannot fill the GPU, long
requests are cut into chunks of whole pages ("split KV"), each chunk producing a partial
(output, base-2 LSE) that a merge step combines. This module decides the chunking on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._checks import INT32_MAX, as_int, as_int_array, first_bad, indptr_counts

# Smallest chunk the automatic split will make, in tokens (rounded up to whole pages).
# A chunk carries fixed costs independent of its length: a CTA prologue (load q, fill the
# copy pipeline), an fp32 partial output + LSE written to global memory, and a read of that
# partial by the merge step. With head_dim 128 in fp16, 256 tokens stream 128 KiB of K and V
# per kv head while the partial is ~0.5 KiB per query head, so the fixed part stays a few
# percent; at 16-32 tokens it would rival the attention work itself. 256 also keeps at most
# 512 chunks for a 128k-token request, which bounds the merge fan-in.
MIN_CHUNK_TOKENS = 256

# A batch that fills the GPU still splits when its longest request would stream on alone after
# the rest: when it is at least STRAGGLER_SKEW times the mean request and at least
# STRAGGLER_SHARE of an SM's share of the batch's pages, requests are cut into chunks of
# 1 / STRAGGLER_CUTS of the longest. Measured on an H200 (32 / 8 heads, head_dim 128, page 16,
# bf16; bench/tune_decode_split.py): 64 requests of 256-4096 tokens 155.3 -> 146.3 us (the
# longest is 0.49 of an SM's share), 128 of 16-8192 554.0 -> 539.2 (0.26); 256 of 128-2048
# (0.12) is 2% slower cut in 64 pages, and uniform batches are fastest whole. A cut plan lists
# and packs more items: the first batch's plan() + plan_array() 120-130 us against 81 whole on
# a 2-core x86 host.
STRAGGLER_SKEW = 1.5
STRAGGLER_SHARE = 0.2
STRAGGLER_CUTS = 4

# Longest request: the kernel indexes tokens in int32, including those of a last tile past the
# end (a tile is at most 256 tokens) and a window's start, so lengths keep 2^16 of headroom.
MAX_KV_LEN = INT32_MAX - (1 << 16)


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """Work items of one batch-decode launch (arrays are read-only).

    Work item w covers request r = work_request[w], pages
    [work_chunk[w] * chunk_pages, min((work_chunk[w] + 1) * chunk_pages, pages[r])) of its
    page list; request b owns work items merge_indptr[b]:merge_indptr[b + 1], in chunk order.
    A request with no pages still owns one work item (output 0, LSE -inf).
    Equality is identity (the fields are arrays); compare fields to compare plans.
    """

    batch_size: int
    page_size: int
    num_kv_heads: int
    split_kv: bool
    chunk_pages: int
    kv_len: np.ndarray
    work_request: np.ndarray
    work_chunk: np.ndarray
    merge_indptr: np.ndarray

    @property
    def num_work(self) -> int:
        """Number of work items W (the GPU grid is W x num_kv_heads CTAs)."""
        return int(self.work_request.shape[0])

    @property
    def chunk_tokens(self) -> int:
        """Tokens per full chunk: chunk_pages * page_size."""
        return self.chunk_pages * self.page_size

    def work_token_bounds(self, start=None, end=None) -> tuple[np.ndarray, np.ndarray]:
        """Token range [start, end) of each work item within its request, int32[W] each
        (written into `start` / `end` when given, e.g. columns of the packed plan).

        start = work_chunk * chunk_tokens
        end = start + minimum(kv_len[work_request] - start, chunk_tokens)   (no int32 overflow)
        """
        chunk = min(self.chunk_tokens, INT32_MAX)  # start < kv_len < 2^31 where work_chunk > 0
        start = np.multiply(self.work_chunk, chunk, out=start)
        end = np.subtract(self.kv_len[self.work_request], start, out=end)
        np.minimum(end, chunk, out=end)
        end += start
        return start, end


def _check_last_page_len(last: np.ndarray, pages: np.ndarray, page_size: int):
    """Require 1 <= last <= page_size where a request has pages, and last == 0 where not;
    return has = min(pages, 1) (the int 1 when every request has pages).

        0 <= last - has <= has * (page_size - 1)

    One unsigned reduction checks last - has <= page_size - 1 (a negative value wraps to a huge
    one); requests without pages, counted apart as they are rare, must also have last == 0.
    """
    if last.shape != pages.shape:
        raise ValueError(
            f"kv_last_page_len must have shape ({pages.shape[0]},) to match kv_indptr, "
            f"got {last.shape}"
        )
    batch = pages.shape[0]
    empty = batch - np.count_nonzero(pages)
    has = np.minimum(pages, 1) if empty else 1
    if not batch:
        return has
    worst = int(np.maximum.reduce((last - has).view(np.uint64)))
    if worst <= page_size - 1 and not (empty and last[pages == 0].any()):
        return has
    bad = (last < has) | (last > has * page_size)
    b = first_bad(bad)
    if pages[b]:
        raise ValueError(
            f"kv_last_page_len[{b}] ({int(last[b])}) must be in [1, page_size "
            f"({page_size})] for a request with {int(pages[b])} pages"
        )
    raise ValueError(
        f"kv_last_page_len[{b}] ({int(last[b])}) must be 0 for a request with no pages"
    )


def _pages_and_lens(kv_indptr, kv_last_page_len, page_size: int):
    """Validate the page-table header; return (pages, max(pages - 1, 0), kv_len), int64[B],
    and max(pages) (0 for an empty batch)."""
    indptr = as_int_array("kv_indptr", kv_indptr)
    last = as_int_array("kv_last_page_len", kv_last_page_len)
    pages, max_pages = indptr_counts("kv_indptr", indptr)
    pm1 = pages - _check_last_page_len(last, pages, page_size)
    kv_len = pm1 * page_size
    kv_len += last
    # kv_len <= pages * page_size <= kv_indptr[-1] * page_size: scan only when that can exceed
    if int(indptr[-1]) * page_size > MAX_KV_LEN and int(kv_len.max()) > MAX_KV_LEN:
        b = int(kv_len.argmax())
        raise ValueError(
            f"request {b} has {int(kv_len[b])} tokens; at most {MAX_KV_LEN} (2^31 - 2^16 - 1) "
            "are supported"
        )
    return pages, pm1, kv_len, max_pages


def validate_page_table(
    kv_indptr, kv_indices, kv_last_page_len, page_size: int, num_pages: int
) -> None:
    """Check a whole page table against a cache of ``num_pages`` pages; raise on the first error.

    kv_indptr: [B+1], 0 = kv_indptr[0] <= kv_indptr[1] <= ...
    kv_indices: at least kv_indptr[-1] entries (a longer buffer is read only that far, as in
        FlashInfer), 0 <= kv_indices[i] < num_pages
    kv_last_page_len: [B], in [1, page_size] (0 for a request without pages)
    """
    page_size = as_int("page_size", page_size, minimum=1)
    num_pages = as_int("num_pages", num_pages, minimum=0)
    _pages_and_lens(kv_indptr, kv_last_page_len, page_size)
    total = int(np.asarray(kv_indptr)[-1])
    indices = as_int_array("kv_indices", kv_indices)
    if indices.shape[0] < total:
        raise ValueError(
            f"kv_indices must have at least kv_indptr[-1] ({total}) entries, got {indices.shape[0]}"
        )
    indices = indices[:total]
    bad = (indices < 0) | (indices >= num_pages)
    if bad.any():
        i = first_bad(bad)
        raise ValueError(
            f"kv_indices[{i}] ({int(indices[i])}) is not a valid page id in [0, {num_pages})"
        )


def _straggler_chunk(
    pages, max_pages: int, num_kv_heads: int, num_sms: int, lo: int, max_work: int | None
) -> int:
    """The chunk of a batch that fills the GPU: max_pages (one item per request), or
    1 / STRAGGLER_CUTS of the longest request (at least lo pages) when that request is a
    straggler (see STRAGGLER_SKEW), raised to fit max_work. Not for a batch that leaves slots
    free: its split already fills them, and more items would start a second wave (16 requests
    of 1000-32000 tokens on an H200: 36 items 242.6 us, the fitting 33 227.4).

        share = sum(pages) * num_kv_heads / num_sms          # pages an SM streams
        straggler: max_pages >= STRAGGLER_SKEW * mean(pages) and >= STRAGGLER_SHARE * share
        W(c) = B + sum((pages - 1) // c) <= B + sum(pages) / c, so c >= sum(pages) /
        (max_work - B) fits max_work without a search (plan() runs every step)
    """
    batch = pages.shape[0]
    total = int(pages.sum())
    if max_pages * batch < STRAGGLER_SKEW * total:
        return max_pages
    if max_pages * num_sms < STRAGGLER_SHARE * total * num_kv_heads:
        return max_pages
    chunk = max(lo, -(-max_pages // STRAGGLER_CUTS))
    if max_work is not None:
        room = max_work - batch
        chunk = max(chunk, -(-total // room)) if room > 0 else max_pages
    return min(chunk, max_pages)


def _search_chunk(pm1: np.ndarray, lo: int, hi: int, budget: int) -> int:
    """Smallest chunk c in [lo, hi] with W(c) = B + sum(pm1 // c) <= budget (pm1 = pages - 1).

    W is non-increasing in c, hi = max(pm1) + 1, and W(hi) = B <= budget.
    Requests of one length p (closed form):
        B * (p // c) <= budget - B  <=>  c >= p // ((budget - B) // B + 1) + 1
    Else, with S = sum(pm1), S / c - B < sum(pm1 // c) <= S / c, so the smallest fitting c lies
    in [S // budget + 1, ceil(S / (budget - B))]; the bisection runs on that (much narrower) range.
    """
    base = pm1.shape[0]
    total = int(pm1.sum())
    if total == base * (hi - 1):  # every pm1 <= hi - 1, so all equal hi - 1
        return min(max(lo, (hi - 1) // ((budget - base) // base + 1) + 1), hi)
    lo = min(max(lo, total // budget + 1), hi)
    if budget > base:
        hi = max(lo, min(hi, -(-total // (budget - base))))
    buf = np.empty_like(pm1)
    while lo < hi:
        mid = (lo + hi) // 2
        if base + int(np.floor_divide(pm1, mid, out=buf).sum()) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo


_IOTA = np.zeros(0, dtype=np.int32)  # arange(n), read-only, grown by doubling
_ZEROS = np.zeros(0, dtype=np.int32)


def _one_item_per_request(batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(work_request, work_chunk, merge_indptr) of one item per request: arange(batch),
    zeros(batch), arange(batch + 1), as read-only views of shared tables."""
    global _IOTA, _ZEROS
    if _IOTA.shape[0] < batch + 1:
        n = max(batch + 1, 2 * _IOTA.shape[0])
        _IOTA, _ZEROS = np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
        _IOTA.flags.writeable = _ZEROS.flags.writeable = False
    return _IOTA[:batch], _ZEROS[:batch], _IOTA[: batch + 1]


def plan_decode(
    kv_indptr,
    kv_last_page_len,
    page_size: int,
    num_kv_heads: int,
    *,
    num_sms: int,
    ctas_per_sm: int,
    fixed_split_size: int | None = None,
    disable_split_kv: bool = False,
    min_chunk_tokens: int = MIN_CHUNK_TOKENS,
    max_work: int | None = None,
) -> DecodePlan:
    """Choose the chunking of every request; a chunk is a run of whole pages.

        slots = num_sms * ctas_per_sm                      # CTAs resident at once
        W(c) = sum_b max(1, ceil(pages_b / c))             # work items for chunk c
        disable_split_kv        -> c = max_b pages_b       (W == B)
        fixed_split_size        -> c = fixed_split_size    (per-request, batch invariant)
        B * num_kv_heads >= slots -> c = max_b pages_b     (the batch fills the GPU), or
                                   ceil(max_b pages_b / STRAGGLER_CUTS) when its longest
                                   request would run on alone after the rest
                                   (_straggler_chunk)
        else c = min {c >= ceil(min_chunk_tokens / page_size) : W(c) * num_kv_heads <= slots}

    ``fixed_split_size`` is in pages, as in FlashInfer's decode ``plan`` (chunk tokens =
    fixed_split_size * page_size); it takes effect whatever the batch, so a request's chunking
    (hence its float reduction order) depends on its own length only. ``disable_split_kv``
    takes precedence over it. ``max_work`` caps W (capacity of buffers captured in a CUDA
    graph): the search respects it, and a ValueError is raised when no chunking fits.
    """
    page_size = as_int("page_size", page_size, minimum=1)
    num_kv_heads = as_int("num_kv_heads", num_kv_heads, minimum=1)
    num_sms = as_int("num_sms", num_sms, minimum=1)
    ctas_per_sm = as_int("ctas_per_sm", ctas_per_sm, minimum=1)
    min_chunk_tokens = as_int("min_chunk_tokens", min_chunk_tokens, minimum=1)
    if fixed_split_size is not None:
        fixed_split_size = as_int("fixed_split_size", fixed_split_size, minimum=1)
    if max_work is not None:
        max_work = as_int("max_work", max_work, minimum=1)
    if not isinstance(disable_split_kv, (bool, np.bool_)):
        raise TypeError(f"disable_split_kv must be a bool, got {disable_split_kv!r}")

    pages, pm1, kv_len, max_pages = _pages_and_lens(kv_indptr, kv_last_page_len, page_size)
    batch_size = int(pages.shape[0])
    if max_work is not None and batch_size > max_work:
        raise ValueError(
            f"batch_size ({batch_size}) exceeds max_work ({max_work}): every request needs at "
            "least one work item"
        )
    # ceil(p / c) == 1 + (p - 1) // c for p >= 1, and a request without pages gets 1 item too,
    # so with pm1 = max(p - 1, 0) every request needs 1 + pm1 // c work items.
    max_pages = max(max_pages, 1)  # = max(pm1) + 1
    slots = num_sms * ctas_per_sm
    lo = min(-(-min_chunk_tokens // page_size), max_pages)

    if disable_split_kv:
        chunk = max_pages
    elif fixed_split_size is not None:
        chunk = fixed_split_size
        if max_work is not None:
            num_work = batch_size + int((pm1 // chunk).sum())
            if num_work > max_work:
                raise ValueError(
                    f"fixed_split_size ({chunk} pages) gives {num_work} work items, more than "
                    f"max_work ({max_work})"
                )
    elif batch_size == 0:
        chunk = max_pages
    elif batch_size * num_kv_heads >= slots:  # the batch fills the GPU
        chunk = _straggler_chunk(pages, max_pages, num_kv_heads, num_sms, lo, max_work)
    else:
        budget = slots // num_kv_heads
        if max_work is not None:
            budget = min(budget, max_work)
        chunk = _search_chunk(pm1, lo, max_pages, budget)

    if chunk >= max_pages:  # one work item per request
        work_request, work_chunk, merge_indptr = _one_item_per_request(batch_size)
        num_work = batch_size
    else:
        nchunks = pm1 // chunk
        nchunks += 1
        merge_indptr = np.empty(batch_size + 1, dtype=np.int32)
        merge_indptr[0] = 0
        merge_indptr[1:] = nchunks.cumsum()
        num_work = int(merge_indptr[-1])
        work_request = np.repeat(_one_item_per_request(batch_size)[0], nchunks)
        work_chunk = _one_item_per_request(num_work)[0] - merge_indptr[work_request]
        for arr in (work_request, work_chunk, merge_indptr):
            arr.flags.writeable = False
    kv_len32 = kv_len.astype(np.int32)
    kv_len32.flags.writeable = False
    return DecodePlan(
        batch_size=batch_size,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        split_kv=num_work > batch_size,
        chunk_pages=chunk,
        kv_len=kv_len32,
        work_request=work_request,
        work_chunk=work_chunk,
        merge_indptr=merge_indptr,
    )
