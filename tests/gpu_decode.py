"""Random paged decode batches on the GPU, with their host copies for the float64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import rtcinfer
from rtcinfer.interop.dtypes import FP8_DTYPES, numpy_dtype

from . import reference_attention as aref
from .checks import assert_close, to_host
from .paged_batch import page_table_for

FORMS = ("5d", "tuple", "strided", "strided_tuple")


def random_values(rng, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(numpy_dtype(dtype))


def to_gpu(x: np.ndarray):
    """CuPy copy of a host array; fp8 travels as its uint8 bytes (CuPy has no fp8 dtype)."""
    import cupy

    return cupy.asarray(x.view(np.uint8) if x.dtype.name in FP8_DTYPES else x)


@dataclass
class Batch:
    q: np.ndarray  # [B, Hq, D]
    cache: object  # host cache (5-D array or (k, v)), as the reference reads it
    cache_dev: object  # the same on the device, in the chosen form
    q_dev: object
    indptr: np.ndarray
    indices: np.ndarray
    last: np.ndarray
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    layout: str
    q_dtype: str
    kv_dtype: str

    def plan(self, wrapper, **kwargs) -> None:
        wrapper.plan(
            self.indptr, self.indices, self.last, self.num_qo_heads, self.num_kv_heads,
            self.head_dim, self.page_size, q_data_type=self.q_dtype, kv_data_type=self.kv_dtype,
            **kwargs,
        )  # fmt: skip

    def reference(self, **features):
        return aref.batch_decode_paged_ref(
            self.q, self.cache, self.indptr, self.indices, self.last, kv_layout=self.layout,
            return_lse=True, **features,
        )  # fmt: skip

    def with_table(self, lengths, rng) -> Batch:
        """This batch's q and cache under a new page table for `lengths` (same B)."""
        num_pages = cache_pages(self.cache, self.layout)
        indptr, indices, last, _ = page_table_for(lengths, self.page_size, rng, spare_pages=0)
        assert indptr[-1] <= num_pages, "the cache is too small for these lengths"
        indices = rng.permutation(num_pages)[: indptr[-1]].astype(np.int32)
        return Batch(**{**self.__dict__, "indptr": indptr, "indices": indices, "last": last})


def cache_pages(cache, layout) -> int:
    return (cache[0] if isinstance(cache, tuple) else cache).shape[0]


def make_batch(
    rng, lengths, *, page_size=16, num_kv_heads=2, group_size=4, head_dim=128,
    q_dtype="bfloat16", kv_dtype=None, layout="NHD", form="5d", spare_pages=3,
) -> Batch:  # fmt: skip
    """Requests of the given token lengths over a shuffled page table (see paged_batch)."""
    kv_dtype = kv_dtype or q_dtype
    indptr, indices, last, num_pages = page_table_for(lengths, page_size, rng, spare_pages)
    strided = form.startswith("strided")
    heads = num_kv_heads + (1 if strided else 0)  # a padding head makes head slices strided
    inner = (page_size, heads, head_dim) if layout == "NHD" else (heads, page_size, head_dim)
    pages = 2 * num_pages if strided else num_pages  # every other page: strided pages
    host = random_values(rng, (pages, 2, *inner), kv_dtype)
    dev = to_gpu(host)
    if strided:
        pick = (slice(None, None, 2), slice(None))
        pick += (slice(None), slice(1, None)) if layout == "NHD" else (slice(1, None),)
        host, dev = host[pick], dev[pick]
    if form in ("tuple", "strided_tuple"):
        cache, cache_dev = (host[:, 0], host[:, 1]), (dev[:, 0], dev[:, 1])
    else:
        cache, cache_dev = host, dev
    q = random_values(rng, (len(lengths), num_kv_heads * group_size, head_dim), q_dtype)
    return Batch(
        q, cache, cache_dev, to_gpu(q), indptr, indices, last, num_kv_heads * group_size,
        num_kv_heads, head_dim, page_size, layout, q_dtype, kv_dtype,
    )  # fmt: skip


def poisoned_cache(batch: Batch, window_left: int = -1):
    """The batch's device cache (5-D or tuple form) with NaN in every slot that holds no token a
    decode may read: slots past each request's last-page length, pages of no request, and
    with window_left >= 0 the tokens before the window. fp8 NaN is the byte 0x7F."""
    num_pages = cache_pages(batch.cache, batch.layout)
    live = np.zeros((num_pages, batch.page_size), dtype=bool)
    for b in range(len(batch.last)):
        pages = batch.indices[batch.indptr[b] : batch.indptr[b + 1]]
        kv_len = (len(pages) - 1) * batch.page_size + int(batch.last[b]) if len(pages) else 0
        first = max(kv_len - 1 - window_left, 0) if window_left >= 0 else 0
        tokens = np.arange(first, kv_len)
        live[pages[tokens // batch.page_size], tokens % batch.page_size] = True
    page, slot = np.nonzero(~live)

    def poison(x: np.ndarray) -> np.ndarray:  # [pages, (2,) NHD or HND inner dims]
        x = x.copy()
        raw = x.view(np.uint8) if x.dtype.name in FP8_DTYPES else x
        nan = 0x7F if raw is not x else np.nan
        lead = (page, slice(None)) if x.ndim == 5 else (page,)
        if batch.layout == "NHD":
            raw[(*lead, slot)] = nan
        else:
            raw[(*lead, slice(None), slot)] = nan
        return x

    if isinstance(batch.cache, tuple):
        return tuple(to_gpu(poison(c)) for c in batch.cache)
    return to_gpu(poison(batch.cache))


def run_batch(batch: Batch, wrapper=None, k_scale=None, v_scale=None, run_kwargs=None,
              **plan_kwargs):  # fmt: skip
    """(o, lse) of plan + run with a fresh (or the given) wrapper; run_kwargs go to run()."""
    wrapper = wrapper or rtcinfer.BatchDecodeWithPagedKVCacheWrapper(kv_layout=batch.layout)
    batch.plan(wrapper, **plan_kwargs)
    return wrapper.run(batch.q_dev, batch.cache_dev, return_lse=True, k_scale=k_scale,
                       v_scale=v_scale, **(run_kwargs or {}))  # fmt: skip


def check_attention(
    o, lse, o_ref, lse_ref, dtype: str, lse_tol: float = 1e-3, tensor_cores: bool = False
) -> None:
    """o within the dtype tolerance (tests/checks.TOL; per query head with tensor cores),
    lse (fp32) within lse_tol; no NaN."""
    o_host, lse_host = to_host(o), to_host(lse)
    assert not np.isnan(o_host).any() and not np.isnan(lse_host).any()
    assert_close(o_host, o_ref, dtype, "o", per_vector=tensor_cores)
    assert_close(lse_host, lse_ref, "float32", "lse", tol=lse_tol)


def standard_lengths(page_size: int, rng) -> list[int]:
    """The awkward lengths of every batch test, shuffled, with empty requests mixed in."""
    lengths = [1, page_size - 1, page_size, page_size + 1, 513, 0, 37, 0]
    return [int(x) for x in rng.permutation(lengths)]
