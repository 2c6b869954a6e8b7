"""The host side of paged-KV addressing (rtcinfer/attention/paged_kv.py) without a GPU: the
byte strides and offsets kernels read K and V with, for every cache form."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer.attention.paged_kv import cache_views, check_cache_view, paged_view
from rtcinfer.interop import ArrayInfo


def info(x: np.ndarray) -> ArrayInfo:
    return ArrayInfo(x.shape, tuple(s // x.itemsize for s in x.strides), x.dtype.name, 0)


def row(x: np.ndarray, kv_layout: str, page: int, slot: int, head: int) -> np.ndarray:
    """Row (page, slot, head) of a 4-D K or V [pages, (slots, heads or heads, slots), D]."""
    return x[page, slot, head] if kv_layout == "NHD" else x[page, head, slot]


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["5d", "pair", "strided pair"])
def test_views_address_every_row_of_k_and_v(kv_layout, form):
    pages, page_size, heads, d = 5, 4, 3, 8
    inner = (page_size, heads, d) if kv_layout == "NHD" else (heads, page_size, d)
    cache = np.zeros((2 * pages, 2, *inner), np.float16)
    if form != "strided pair":
        cache = cache[:pages]
    else:
        cache = cache[::2]  # every other page
    k, v = cache[:, 0], cache[:, 1]
    if form == "5d":
        views, bases = cache_views(info(cache), None, kv_layout, 2), (cache, cache)
    else:
        views, bases = cache_views(info(k), info(v), kv_layout, 2), (k, v)
    for arr, view, base in zip((k, v), views, bases, strict=True):
        for page, slot, head in np.ndindex(pages, page_size, heads):
            address = base.ctypes.data + view.offset
            address += page * view.page + slot * view.token + head * view.head
            assert address == row(arr, kv_layout, page, slot, head).ctypes.data


def test_a_contiguous_cache_read_as_pages():
    k = np.zeros((100, 2, 64), np.float16)  # [tokens, H, D] (NHD)
    view = paged_view(info(k), "NHD", 2, 64)
    assert (view.page, view.token, view.head, view.offset) == (64 * 256, 256, 128, 0)
    hnd = np.zeros((2, 100, 64), np.float16)  # [H, tokens, D]
    view = paged_view(info(hnd), "HND", 2, 64)
    assert (view.page, view.token, view.head) == (64 * 128, 128, 100 * 128)


def test_cp_async_needs_16_byte_rows():
    check_cache_view("k", 0, (4, 16, 2), (8192, 512, 256), 2, 2)
    with pytest.raises(ValueError, match="k: needs .* pointer offset 8"):
        check_cache_view("k", 8, (4, 16, 2), (8192, 512, 256), 2, 2)
    with pytest.raises(ValueError, match="v: needs .* strides \\(8192, 520, 256\\)"):
        check_cache_view("v", 0, (4, 16, 2), (8192, 520, 256), 2, 2)
    check_cache_view("v", 0, (4, 1, 2), (8192, 520, 256), 2, 2)  # a size-1 dim: any stride
    check_cache_view("v", 8, (0, 16, 2), (8192, 512, 256), 2, 2)  # empty: never read


def test_strides_and_slot_offsets_must_fit_32_bits():
    """The loaders take page and token strides and a slot's byte offset in its page as 32-bit
    ints (the page's offset in the cache is 64-bit)."""
    check_cache_view("k", 0, (4, 16, 2), (2**31 - 16, 2**27, 256), 2, 2)
    with pytest.raises(ValueError, match=r"k: strides must be below 2\^31 bytes, got \(2147483648"):
        check_cache_view("k", 0, (4, 16, 2), (2**31, 512, 256), 2, 2)
    with pytest.raises(ValueError, match=r"v: strides must be below 2\^31 bytes, got \(4026531840"):
        check_cache_view("v", 0, (4, 16, 2), (2**31 - 16, 2**28, 256), 2, 2)  # 15 slots of 2^28
