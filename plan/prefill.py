"""Work plan for batch prefill (and append) attention: query tiles x KV chunks.

Request b has qo_len[b] queries and kv_len[b] keys; query i sits at key position
i + kv_len - qo_len (bottom-right alignment). The kernel packs the query heads of a GQA group
into tile rows: packed row r of request b is query r // group_size, head (r % group_size) of
its kv head's group, so a request has ceil(qo_len * group_size / tile_rows) query tiles per kv
head. A work item is (tile, KV chunk): the keys of one chunk of a fixed grid,
[k * chunk_tokens, (k + 1) * chunk_tokens), that the tile's rows may see (causal: up to the
tile's last query; sliding window: from its first query's window). A tile whose keys span
several chunks gets several items, each writing a partial (output, base-2 LSE) to a slot;
the tile's slots merge in chunk order. The grid is absolute, so with fixed_split_size a row's
reduction order depends on its own request only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._checks import INT32_MAX, as_int, as_int_array, first_bad, indptr_counts

# Smallest chunk the automatic split makes, in tokens: a work item carries fixed costs (a
# prologue, a partial of tile_rows x head_dim floats written and merged) that a few K/V tiles
# of 64 keys amortize.
MIN_CHUNK_TOKENS = 256

# More tiles than slots: the most items a tile is cut into to fill the last wave, and the
# least modeled gain that cut must bring (plan_prefill's _wave_chunk).
WAVE_SPLITS = 4
WAVE_GAIN = 0.1

# Query tile heights the kernel is built for (packed rows per CTA; 32: MLA's only; 8: rows on
# the MMAs' N side, for requests of up to 8 packed rows: decode and short verifications).
TILE_ROWS = (8, 16, 32, 64, 128)


@dataclass(frozen=True, eq=False)
class PrefillPlan:
    """Work items of one batch-prefill launch (arrays read-only; equality is identity).

    Tile t (of T) belongs to request tile_request[t] and covers its packed rows
    [tile_row[t], min(tile_row[t] + tile_rows, qo_len * group_size)). Work item w covers tile
    work_tile[w] over keys [work_kv_begin[w], work_kv_end[w]) (possibly empty: the tile's rows
    see nothing, output 0 and LSE -inf); a tile's items are tile_items[t] consecutive slots
    from tile_slot[t] (partials, merged in chunk order) when tile_items[t] > 1, and it writes
    its rows directly when it has one. work_slot[w] is the item's slot (-1: direct).
    """

    batch_size: int
    group_size: int
    tile_rows: int
    chunk_tokens: int
    split_kv: bool
    qo_len: np.ndarray  # int64[B]
    kv_len: np.ndarray  # int64[B]
    tile_request: np.ndarray  # int64[T]
    tile_row: np.ndarray  # int64[T]
    tile_items: np.ndarray  # int64[T]
    tile_slot: np.ndarray  # int64[T]
    work_tile: np.ndarray  # int64[W]
    work_kv_begin: np.ndarray  # int64[W]
    work_kv_end: np.ndarray  # int64[W]
    work_slot: np.ndarray  # int64[W]

    @property
    def num_tiles(self) -> int:
        return int(self.tile_request.shape[0])

    @property
    def num_work(self) -> int:
        """Work items W (the GPU grid is W x num_kv_heads CTAs)."""
        return int(self.work_tile.shape[0])

    @property
    def num_slots(self) -> int:
        """Partial slots (rows of tile_rows x head_dim floats per kv head)."""
        return int(self.tile_items[self.tile_items > 1].sum()) if self.split_kv else 0


@dataclass(frozen=True, eq=False)
class TilePlan:
    """A batch with one work item per query tile, none split: item t is tile t, request b's
    tiles are items tile_indptr[b] .. tile_indptr[b + 1] - 1, each over all the keys its rows
    may see (as PrefillPlan's one-item tiles). Its items are expanded on the device
    (rtcinfer/attention/prefill_items.py) from these arrays (read-only)."""

    batch_size: int
    group_size: int
    tile_rows: int
    qo_len: np.ndarray  # int64[B]
    kv_len: np.ndarray  # int64[B]
    tile_indptr: np.ndarray  # int64[B + 1]
    split_kv = False
    num_slots = 0

    @property
    def num_tiles(self) -> int:
        return int(self.tile_indptr[-1])

    @property
    def num_work(self) -> int:
        return int(self.tile_indptr[-1])


def tile_indptr_of(qo_len: np.ndarray, group_size: int, tile_rows: int) -> np.ndarray:
    """int64[B + 1]: request b's query tiles are tile_indptr[b] .. tile_indptr[b + 1] - 1
    (ceil(qo_len * group_size / tile_rows) of them)."""
    tiles = qo_len * group_size
    tiles += tile_rows - 1
    tiles //= tile_rows
    indptr = np.zeros(qo_len.shape[0] + 1, dtype=np.int64)
    np.cumsum(tiles, out=indptr[1:])
    return indptr


def _lengths(qo_indptr, kv_len) -> tuple[np.ndarray, np.ndarray]:
    """(qo_len, kv_len) int64[B] of a batch, checked: qo_indptr starts at 0 and never
    decreases, kv_len has one entry a request, each in [0, 2^31)."""
    qo_len, _ = indptr_counts("qo_indptr", as_int_array("qo_indptr", qo_indptr))
    kv = as_int_array("kv_len", kv_len)
    batch = qo_len.shape[0]
    if kv.shape != (batch,):
        raise ValueError(f"kv_len must have shape ({batch},) to match qo_indptr, got {kv.shape}")
    if batch and (int(np.minimum.reduce(kv)) < 0 or int(np.maximum.reduce(kv)) > INT32_MAX):
        b = first_bad((kv < 0) | (kv > INT32_MAX))
        raise ValueError(f"kv_len[{b}] ({int(kv[b])}) must be in [0, 2^31)")
    return qo_len, kv


def tile_counts(qo_indptr, kv_len, group_size: int, tile_rows: int) -> TilePlan:
    """The batch's query tiles as a TilePlan (one item a tile, whatever the GPU): lengths
    checked as plan_prefill checks them, arrays read-only (kv_len copied when it is the
    caller's own array). plan_prefill takes it back (`tiles=`) when the batch must split."""
    qo_len, kv = _lengths(qo_indptr, kv_len)
    if tile_rows not in TILE_ROWS:
        raise ValueError(f"tile_rows must be one of {TILE_ROWS}, got {tile_rows}")
    tile_indptr = tile_indptr_of(qo_len, group_size, tile_rows)
    if kv is kv_len:
        kv = kv.copy()  # the caller's own array
    for a in (qo_len, kv, tile_indptr):
        a.setflags(write=False)
    return TilePlan(qo_len.shape[0], group_size, tile_rows, qo_len, kv, tile_indptr)


def fills_gpu(tiles: TilePlan, num_kv_heads: int, *, num_sms: int, ctas_per_sm: int,
              fixed_split_size: int | None = None, disable_split_kv: bool = False,
              max_work: int | None = None, causal: bool = False, window_left: int = -1,
              page_size: int = 1, kv_tile: int = 1,
              min_chunk_tokens: int = MIN_CHUNK_TOKENS) -> bool:  # fmt: skip
    """Whether plan_prefill gives the batch one item per tile because the tiles alone fill the
    GPU (num_tiles * num_kv_heads >= slots, or max_work) and plan_prefill's wave cut keeps
    them whole (_wave_chunk: causal, window_left, page_size and kv_tile as plan_prefill takes
    them), the split is disabled, there are no tiles, or no request has more keys than the
    least chunk plan_prefill would cut them into (min_chunk_tokens as it takes it; and the
    tiles fit max_work; plan_prefill names the error where they do not)."""
    num_tiles = tiles.num_tiles
    budget = num_sms * ctas_per_sm // num_kv_heads
    if max_work is not None:
        if num_tiles > max_work:
            return False
        budget = min(budget, max_work)
    if disable_split_kv or num_tiles == 0:
        return True
    if fixed_split_size is not None:
        return False
    qo_len, kv = tiles.qo_len, tiles.kv_len
    if num_tiles < budget:  # plan_prefill searches a chunk: none cuts keys within its least
        whole, step = _chunk_grid(_longest(kv), page_size, kv_tile)
        return _least_steps(min_chunk_tokens, step, whole) * step >= whole
    if not _wave_cut_may_pay(num_tiles, budget, qo_len, kv):
        return True
    # requests alike, one tile each: plan_prefill's key ranges and wave cut, as it takes them
    first = np.zeros(num_tiles, np.int64)
    begin, end = key_ranges(qo_len, kv, np.arange(num_tiles), first, tiles.group_size,
                            tiles.tile_rows, causal, window_left)  # fmt: skip
    whole, step = _chunk_grid(_longest(end), page_size, kv_tile)
    return _wave_chunk(begin, end, step, whole, budget, max_work, kv_tile) == whole


def _wave_cut_may_pay(num_tiles: int, budget: int, qo_len, kv_len) -> bool:
    """Whether _wave_chunk may cut: requests alike (one query tile each, the same query and
    key counts) whose tiles fill less than 1 - WAVE_GAIN of ceil(T / budget) waves."""
    if budget < 1:  # fewer slots than kv heads: as many waves as tiles
        return False
    waves = -(-num_tiles // budget)
    if num_tiles >= (1 - WAVE_GAIN) * waves * budget or num_tiles != qo_len.shape[0]:
        return False
    return qo_len.min() == qo_len.max() and kv_len.min() == kv_len.max()


def choose_tile_rows(qo_len: np.ndarray, group_size: int, head_dim: int,
                     wgmma: bool = False) -> int:  # fmt: skip
    """Packed rows per query tile from the average packed query length: 8 for decode-like
    batches of up to 8 rows per request (a GQA group of up to 8 heads), 16 up to 16 rows, 64
    for medium ones, 128 for long prompts (64 at head_dim 256, whose accumulators would not
    fit 128 rows, except on the warpgroup-MMA kernel, `wgmma`)."""
    return tile_rows_for(int(qo_len.sum()), qo_len.shape[0], group_size, head_dim, wgmma)


def tile_rows_for(queries: int, batch: int, group_size: int, head_dim: int,
                  wgmma: bool = False) -> int:  # fmt: skip
    """choose_tile_rows from the batch's query count and size."""
    avg = queries * group_size / batch if batch else 0
    if avg > 64 and (head_dim < 256 or wgmma):
        return 128
    return 64 if avg > 16 else 16 if avg > 8 else 8


def key_ranges(qo_len, kv_len, tile_request, tile_row, group_size, tile_rows, causal,
                window_left):  # fmt: skip
    """[begin, end) of the keys any row of each tile may see, int64[T] each. Causal: up to the
    tile's last query's position, offset + ceil(min(tile_row + tile_rows, rows) / g) (never
    past kv_len); a window: from its first query's position - window_left."""
    offset = (kv_len - qo_len)[tile_request]  # key position of query 0
    if causal:
        end = np.minimum(tile_row + tile_rows, (qo_len * group_size)[tile_request])
        end += group_size - 1
        end //= group_size
        end += offset
        np.maximum(end, 0, out=end)
    else:
        end = kv_len[tile_request]
    if window_left < 0:
        return np.zeros(end.shape[0], end.dtype), end
    begin = offset + tile_row // group_size - window_left
    np.maximum(begin, 0, out=begin)
    np.minimum(begin, end, out=begin)
    return begin, end


def _items_per_tile(begin: np.ndarray, end: np.ndarray, chunk: int) -> np.ndarray:
    """Chunks of the grid that [begin, end) meets; 1 for an empty range (zeros to write)."""
    count = -(-end // chunk) - begin // chunk
    return np.maximum(count, 1)


def plan_prefill(
    qo_indptr,
    kv_len,
    group_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    num_sms: int,
    ctas_per_sm: int,
    causal: bool = False,
    window_left: int = -1,
    page_size: int = 1,
    tile_rows: int | None = None,
    fixed_split_size: int | None = None,
    disable_split_kv: bool = False,
    min_chunk_tokens: int = MIN_CHUNK_TOKENS,
    max_work: int | None = None,
    tiles: TilePlan | None = None,
    kv_tile: int = 1,
) -> PrefillPlan:
    """Choose the query tile and the KV chunk; list the work items.

        tiles_b = ceil(qo_len_b * group_size / tile_rows)
        W(c) = sum over tiles of the chunks of the grid c that its keys meet (at least 1)
        disable_split_kv         -> c = max kv_len        (one item per tile)
        fixed_split_size         -> c = fixed_split_size * page_size  (batch invariant)
        tiles * num_kv_heads >= slots -> c = max kv_len, or (requests alike, a tile each)
                                 the chunk whose waves cost least (_wave_chunk)
        else c = a chunk >= min_chunk_tokens (whole pages) with W(c) * num_kv_heads <= slots

    kv_len: int [B] keys of each request (paged: (pages - 1) * page_size + last page length);
    chunks are whole pages of page_size tokens. ``max_work`` caps W (CUDA-graph capacity).
    ``tiles``: tile_counts of this batch and tile_rows, computed already (not checked again).
    ``kv_tile``: the kernel's keys per K/V tile; an automatic chunk is whole tiles as well as
    whole pages (a chunk that starts inside a tile loads that tile twice: 1 x 32768 keys on
    the tensor-core decode of an H200, chunks of 63 pages 45.3 us, of 64 pages 42.8).
    """
    group_size = as_int("group_size", group_size, minimum=1)
    num_kv_heads = as_int("num_kv_heads", num_kv_heads, minimum=1)
    head_dim = as_int("head_dim", head_dim, minimum=1)
    num_sms = as_int("num_sms", num_sms, minimum=1)
    ctas_per_sm = as_int("ctas_per_sm", ctas_per_sm, minimum=1)
    page_size = as_int("page_size", page_size, minimum=1)
    window_left = as_int("window_left", window_left, minimum=-1)
    min_chunk_tokens = as_int("min_chunk_tokens", min_chunk_tokens, minimum=1)
    kv_tile = as_int("kv_tile", kv_tile, minimum=1)
    if fixed_split_size is not None:
        fixed_split_size = as_int("fixed_split_size", fixed_split_size, minimum=1)
    if max_work is not None:
        max_work = as_int("max_work", max_work, minimum=1)
    for name, flag in (("causal", causal), ("disable_split_kv", disable_split_kv)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {flag!r}")

    if tiles is not None and tiles.tile_rows == tile_rows:
        qo_len, kv, tile_indptr = tiles.qo_len, tiles.kv_len, tiles.tile_indptr
    else:
        qo_len, kv = _lengths(qo_indptr, kv_len)
        if tile_rows is None:
            tile_rows = 64 if fixed_split_size is not None else choose_tile_rows(
                qo_len, group_size, head_dim)  # fmt: skip
        if tile_rows not in TILE_ROWS:
            raise ValueError(f"tile_rows must be one of {TILE_ROWS}, got {tile_rows}")
        tile_indptr = tile_indptr_of(qo_len, group_size, tile_rows)
    batch = qo_len.shape[0]
    num_tiles = int(tile_indptr[-1])
    tile_request = np.repeat(np.arange(batch, dtype=np.int64), tile_indptr[1:] - tile_indptr[:-1])
    tile_row = (np.arange(num_tiles, dtype=np.int64) - tile_indptr[tile_request]) * tile_rows
    begin, end = key_ranges(qo_len, kv, tile_request, tile_row, group_size, tile_rows,
                             causal, window_left)  # fmt: skip
    whole, step = _chunk_grid(_longest(end), page_size, kv_tile)
    slots = num_sms * ctas_per_sm
    budget = slots // num_kv_heads if max_work is None else min(slots // num_kv_heads, max_work)
    if max_work is not None and num_tiles > max_work:
        raise ValueError(
            f"{num_tiles} query tiles exceed max_work ({max_work}): every tile needs at least "
            "one work item"
        )

    if disable_split_kv or num_tiles == 0:
        chunk = whole
    elif fixed_split_size is not None:
        chunk = fixed_split_size * page_size
    elif num_tiles >= budget:
        chunk = whole
        if _wave_cut_may_pay(num_tiles, budget, qo_len, kv):
            chunk = _wave_chunk(begin, end, step, whole, budget, max_work, kv_tile)
    else:
        chunk = _search_chunk(begin, end, step, min_chunk_tokens, whole, budget)
    # one chunk covering every tile's keys: one item each (no ceil/floor pass needed)
    if chunk == whole:
        items = np.ones(end.shape[0], end.dtype)
    else:
        items = _items_per_tile(begin, end, chunk)
    num_work = int(np.add.reduce(items))
    if max_work is not None and num_work > max_work:
        raise ValueError(
            f"a chunk of {chunk} tokens gives {num_work} work items, more than max_work "
            f"({max_work})"
        )
    return _items(batch, group_size, tile_rows, chunk, qo_len, kv, tile_request, tile_row,
                  begin, end, items)  # fmt: skip


def _longest(end: np.ndarray) -> int:
    """The largest entry of an int array, 0 if it is empty."""
    return int(np.maximum.reduce(end)) if end.shape[0] else 0


def _chunk_grid(longest: int, page_size: int, kv_tile: int) -> tuple[int, int]:
    """(whole, step): the chunk that covers keys [0, longest) (whole pages: every tile's keys
    when `longest` is their largest end), and the unit an automatic chunk is made of (whole
    pages and whole K/V tiles)."""
    max_end = max(longest, 1)
    return -(-max_end // page_size) * page_size, page_size * kv_tile // math.gcd(page_size, kv_tile)


def _wave_chunk(begin, end, step, whole, budget, max_work, kv_tile) -> int:
    """A chunk for more tiles than slots (`budget` a kv head). One item per tile runs in
    ceil(T / budget) waves of tiles, the last one maybe nearly empty: 64 requests of 4096 keys
    on 49 slots a head run two waves for 1.3 waves of work. For requests alike (one query tile
    each, the same query and key counts: a uniform decode batch; the caller asks
    _wave_cut_may_pay) a chunk of 1/k of their keys (k <= WAVE_SPLITS, whole steps) is taken
    when its waves cost less,

        cost(c) = ceil(W(c) / budget) * (min(c, keys) + overhead)

    by at least WAVE_GAIN (overhead: an item's fixed cost in keys, its prologue, partial and
    merge, taken as two K/V tiles) and W(c) <= max_work; otherwise one item a tile (`whole`).
    On an H200 (tensor-core decode, 64 x 4096 tokens, fp8 KV, three CTAs a SM) chunks of 2048
    keys took 148.4 us against 175.0 whole; 48 x 4096 at two CTAs a SM, cut by this rule,
    118.2 against 126.4 (bench/tune_decode_split.py)."""
    keys = end - begin
    longest = int(keys.max())
    if longest == 0:
        return whole
    overhead = 2 * kv_tile
    if max_work is None:
        max_work = keys.shape[0] * WAVE_SPLITS
    whole_cost = -(-keys.shape[0] // budget) * (longest + overhead)
    best, best_cost = whole, whole_cost
    for k in range(2, WAVE_SPLITS + 1):
        chunk = -(-longest // (k * step)) * step
        if chunk >= longest:
            continue
        items = int(_items_per_tile(begin, end, chunk).sum())
        cost = -(-items // budget) * (chunk + overhead)
        if items <= max_work and cost < best_cost:
            best, best_cost = chunk, cost
    return best if best_cost / whole_cost <= 1 - WAVE_GAIN else whole


def _least_steps(min_chunk_tokens: int, step: int, whole: int) -> int:
    """The fewest steps of an automatic chunk: min_chunk_tokens in whole steps, at most the
    steps of `whole` (_search_chunk's lower bound; a chunk of it or more keeps every tile of
    keys within `whole` in one item)."""
    return min(-(-min_chunk_tokens // step), -(-whole // step))


def _search_chunk(begin, end, step, min_chunk_tokens, whole, budget) -> int:
    """A chunk (whole steps of `step` tokens, at least min_chunk_tokens, at most `whole`) whose
    W(c) fits the budget: bisection over steps; W is not monotone in c on a fixed grid, but the
    bisection only keeps chunks that fit, and `whole` (one item per tile) always does."""
    hi = -(-whole // step)
    lo = _least_steps(min_chunk_tokens, step, whole)
    while lo < hi:
        mid = (lo + hi) // 2
        if int(_items_per_tile(begin, end, min(mid * step, whole)).sum()) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return min(hi * step, whole)


def _minus_ones(n: int) -> np.ndarray:
    """int64[n] of -1 (np.full's Python layer costs a microsecond on a small batch's plan)."""
    a = np.empty(n, np.int64)
    a.fill(-1)
    return a


def _items(batch, group_size, tile_rows, chunk, qo_len, kv, tile_request, tile_row, begin,
           end, items) -> PrefillPlan:  # fmt: skip
    num_tiles = tile_request.shape[0]
    num_work = int(np.add.reduce(items))
    if num_work == num_tiles:  # one item per tile (the common case): no slots, no repeats
        work_tile = np.arange(num_tiles, dtype=np.int64)
        work_begin, work_end = begin, end
        tile_slot = work_slot = _minus_ones(num_tiles)
    else:
        item_indptr = np.zeros(num_tiles + 1, dtype=np.int64)
        np.cumsum(items, out=item_indptr[1:])
        work_tile = np.repeat(np.arange(num_tiles, dtype=np.int64), items)
        k = np.arange(num_work, dtype=np.int64) - item_indptr[work_tile]  # chunk of the tile
        first_chunk = begin // chunk
        lo = (first_chunk[work_tile] + k) * chunk
        work_begin = np.maximum(lo, begin[work_tile])
        work_end = np.minimum(lo + chunk, end[work_tile])
        work_end = np.maximum(work_end, work_begin)  # an empty tile's single item stays empty
        split = items > 1
        tile_slot = _minus_ones(num_tiles)
        tile_slot[split] = np.concatenate([[0], np.cumsum(items[split])[:-1]])
        work_slot = np.where(split[work_tile], tile_slot[work_tile] + k, -1)

    def frozen(a):  # read-only: arrays made here (kv_len, maybe the caller's, is copied)
        a.setflags(write=False)
        return a

    return PrefillPlan(
        batch_size=batch,
        group_size=group_size,
        tile_rows=tile_rows,
        chunk_tokens=int(min(chunk, INT32_MAX)),
        split_kv=num_work > num_tiles,
        qo_len=frozen(qo_len),
        kv_len=frozen(kv.copy()),  # maybe the caller's own array
        tile_request=frozen(tile_request),
        tile_row=frozen(tile_row),
        tile_items=frozen(items),
        tile_slot=frozen(tile_slot),
        work_tile=frozen(work_tile),
        work_kv_begin=frozen(work_begin),
        work_kv_end=frozen(work_end),
        work_slot=frozen(work_slot),
    )


__all__ = [
    "MIN_CHUNK_TOKENS",
    "PrefillPlan",
    "TILE_ROWS",
    "TilePlan",
    "choose_tile_rows",
    "fills_gpu",
    "key_ranges",
    "plan_prefill",
    "tile_counts",
    "tile_indptr_of",
    "tile_rows_for",
]
