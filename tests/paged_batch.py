"""Random paged KV batches for the CPU tests: page tables with shuffled page ids."""

from __future__ import annotations

import numpy as np


def page_table_for(lengths, page_size: int, rng: np.random.Generator, spare_pages: int = 3):
    """A table for requests of the given token lengths, pages drawn from a shuffled pool.

    Returns (kv_indptr int32[B+1], kv_indices int32[P], kv_last_page_len int32[B], num_pages)
    where the cache holds num_pages = P + spare_pages pages (some never referenced).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    pages = -(-lengths // page_size)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last = np.where(pages > 0, lengths - (pages - 1) * page_size, 0).astype(np.int32)
    num_pages = int(indptr[-1]) + spare_pages
    indices = rng.permutation(num_pages)[: indptr[-1]].astype(np.int32)
    return indptr, indices, last, num_pages


def random_paged_cache(
    rng: np.random.Generator,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    kv_layout: str = "NHD",
    as_tuple: bool = False,
    dtype=np.float64,
):
    """A random cache in one of FlashInfer's four forms (5-D array or (k, v) tuple, NHD/HND)."""
    inner = (page_size, num_kv_heads) if kv_layout == "NHD" else (num_kv_heads, page_size)
    k = rng.standard_normal((num_pages, *inner, head_dim)).astype(dtype)
    v = rng.standard_normal((num_pages, *inner, head_dim)).astype(dtype)
    return (k, v) if as_tuple else np.stack([k, v], axis=1)
