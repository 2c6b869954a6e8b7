"""How kernels address a paged KV cache: the host side of cuda_src/attention/paged_kv.cuh.

A cache is one 5-D array [pages, 2, page_size, H, D] (NHD) / [pages, 2, H, page_size, D] (HND),
whose V is K shifted by one step of dim 1, or a (k, v) pair of 4-D arrays [pages, page_size,
H, D] / [pages, H, page_size, D]. Layouts are strides, not code paths: a kernel reads row
(page, slot, head) of K at k + page * page_stride + slot * token_stride + head * head_stride
bytes, and V likewise. A contiguous K or V [tokens, H, D] is the same thing with pages of a
chosen number of tokens (single decode).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..interop.dtypes import FP8_DTYPES, itemsize
from ..plan._checks import INT32_MAX, first_bad

KV_LAYOUTS = ("NHD", "HND")


def check_layout(kv_layout) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")


_UNSIGNED = {4: np.uint32, 8: np.uint64}


def page_table_ids(
    indices: np.ndarray, num_pages: int, names=("indices", "indptr")
) -> tuple[np.ndarray, int]:
    """(the first indptr[-1] = num_pages entries of a page table's host `indices`, their
    largest page id or -1 without pages). As in FlashInfer, a longer `indices` (a preallocated
    buffer) is read only that far; a shorter one is refused. Each id read must be a valid page
    id (0 <= id < 2^31); whether the ids fit the cache is run()'s check. `names`: (indices,
    indptr) as the caller calls them."""
    if indices.shape[0] < num_pages:
        raise ValueError(
            f"{names[0]} must have at least {names[1]}[-1] ({num_pages}) entries, got "
            f"{indices.shape[0]}"
        )
    indices = indices[:num_pages]
    return indices, _largest(indices, names[0])


def _largest(indices: np.ndarray, name: str) -> int:
    num_pages = indices.shape[0]
    if not num_pages:
        return -1
    # One reduction: seen as unsigned (of at least 32 bits), a negative id is larger than any
    # valid one.
    ids = indices if indices.itemsize >= 4 else indices.astype(np.int32)
    largest = int(np.maximum.reduce(ids.view(_UNSIGNED[ids.itemsize])))
    if largest > INT32_MAX:
        i = first_bad((indices < 0) | (indices > INT32_MAX))
        raise ValueError(f"{name}[{i}] ({int(indices[i])}) is not a valid page id")
    return largest


def token_head(shape, strides, kv_layout: str):
    """((tokens, heads), (token, head) strides) of the [.., tokens, heads, D] (NHD) or
    [.., heads, tokens, D] (HND) trailing dims of a cache view."""
    (a, b), (sa, sb) = shape[-3:-1], strides[-3:-1]
    return ((a, b), (sa, sb)) if kv_layout == "NHD" else ((b, a), (sb, sa))


@dataclass(frozen=True)
class CacheView:
    """K or V of a cache as a kernel reads it: byte strides of a page, a token slot and a head,
    and the byte offset of its first row from the array's address (V of a 5-D cache)."""

    page: int
    token: int
    head: int
    offset: int = 0


def kv_pair(paged_kv_cache) -> tuple:
    """(k, v) of a (k, v) pair (tuple or list), or (cache, None) of one [pages, 2, ...] array."""
    if type(paged_kv_cache) is tuple or type(paged_kv_cache) is list:
        k, v = paged_kv_cache
        return k, v
    return paged_kv_cache, None


def cache_views(k, v, kv_layout: str, item: int) -> tuple[CacheView, CacheView]:
    """The views of K and V of a cache given as one 5-D array (`v` None) or a pair; `k`, `v`
    have shapes and element strides (interop's ArrayInfo); `item` is the element size."""
    if v is None:  # one [pages, 2, ...] array: V is K shifted by one step of dim 1
        arrays = ((k, 0), (k, k.strides[1] * item))
    else:
        arrays = ((k, 0), (v, 0))
    views = []
    for arr, offset in arrays:
        _, (token, head) = token_head(arr.shape, arr.strides, kv_layout)
        views.append(CacheView(arr.strides[0] * item, token * item, head * item, offset))
    return views[0], views[1]


def paged_view(arr, kv_layout: str, item: int, tokens_per_page: int) -> CacheView:
    """A contiguous-token K or V [tokens, H, D] (NHD) / [H, tokens, D] (HND), with element
    strides, read as pages of `tokens_per_page` tokens."""
    _, (token, head) = token_head(arr.shape, arr.strides, kv_layout)
    return CacheView(tokens_per_page * token * item, token * item, head * item)


def kv_storage(kv_dtype: str) -> tuple[str, ...]:
    """The dtypes a K or V array of kv_dtype may have: its own, or uint8 bytes for fp8 (CuPy
    has no fp8 dtype; plan() declared the type)."""
    return (kv_dtype, "uint8") if kv_dtype in FP8_DTYPES else (kv_dtype,)


def check_strides_fit(name: str, strides) -> None:
    """The kernels' loaders take the page and token strides (bytes), and a slot's offset in its
    page, as 32-bit ints."""
    if any(not -(2**31) < s < 2**31 for s in strides):
        raise ValueError(f"{name}: strides must be below 2^31 bytes, got {tuple(strides)} bytes")


def check_cache_view(name: str, offset: int, dims, strides, itemsize: int, d_stride: int) -> None:
    """cp.async moves 16-byte chunks: base (`offset`: the address modulo 16) and page/token/head
    strides (bytes) must be 16-byte multiples (dims of size 1 excepted), below 2^31 bytes, and
    head_dim contiguous. An empty cache is never read."""
    if 0 in dims:
        return
    check_strides_fit(name, strides)
    if len(strides) == 3:  # (page, token, head): a page's slots are addressed in 32 bits
        check_strides_fit(name, ((dims[1] - 1) * strides[1],))
    bad = offset % 16 or any(s % 16 for s, n in zip(strides, dims, strict=True) if n > 1)
    if bad or d_stride != itemsize:
        raise ValueError(
            f"{name}: needs a contiguous head_dim and 16-byte aligned pointer and (page, token, "
            f"head) strides, got pointer offset {offset % 16}, strides {tuple(strides)} bytes and "
            f"head_dim stride {d_stride}"
        )


def check_paged_caches(k, v, cfg, kv_layout: str, head_dim_vo: int | None = None) -> None:
    """A paged cache (5-D `k` with `v` None, or a k, v pair; interop's ArrayInfo) against a
    plan's configuration `cfg` (page_size, num_kv_heads, head_dim, kv_dtype), by name;
    head_dim_vo: v's head_dim where it differs from k's (a pair only)."""
    tokens_heads = (cfg.page_size, cfg.num_kv_heads)
    if kv_layout == "HND":
        tokens_heads = tokens_heads[::-1]
    storage = kv_storage(cfg.kv_dtype)
    dim_vo = cfg.head_dim if head_dim_vo is None else head_dim_vo
    if v is None and dim_vo != cfg.head_dim:
        raise ValueError(
            f"paged_kv_cache: one array holds k and v of one head_dim, but the plan's v has "
            f"{dim_vo} dims beside k's {cfg.head_dim}: pass a (k_cache, v_cache) pair"
        )
    caches = [("paged_kv_cache", k)] if v is None else [("k_cache", k), ("v_cache", v)]
    for name, cache in caches:
        dim = dim_vo if name == "v_cache" else cfg.head_dim
        expect = (*((2,) if v is None else ()), *tokens_heads, dim)
        if cache.shape[1:] != expect or cache.dtype not in storage:
            raise ValueError(
                f"{name}: expected shape (num_pages, {', '.join(map(str, expect))}) and "
                f"dtype {cfg.kv_dtype} ({kv_layout}, from the plan), got "
                f"{cache.shape} and {cache.dtype}"
            )


def paged_cache_fields(k, v, kv_layout: str) -> dict:
    """The parameter fields k_page, k_token, k_head, v_page, v_token, v_head (bytes) of a
    paged cache checked above, after checking what the loaders need (check_cache_view)."""
    item = itemsize(k.dtype)
    fields = {}
    views = cache_views(k, v, kv_layout, item)
    for name, arr, view in zip(("k", "v"), (k, k if v is None else v), views, strict=True):
        dims, _ = token_head(arr.shape, arr.strides, kv_layout)
        strides = (view.page, view.token, view.head)
        check_cache_view(name, arr.offset + view.offset, (arr.shape[0], *dims), strides, item,
                         arr.strides[-1] * item)  # fmt: skip
        fields[f"{name}_page"], fields[f"{name}_token"], fields[f"{name}_head"] = strides
    return fields


__all__ = ["KV_LAYOUTS", "CacheView", "cache_views", "check_cache_view", "check_layout",
           "check_paged_caches", "check_strides_fit", "kv_pair", "kv_storage", "page_table_ids",
           "paged_cache_fields", "paged_view", "token_head"]  # fmt: skip
