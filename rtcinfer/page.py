"""Paged KV-cache updates and bookkeeping (FlashInfer's ``flashinfer.page`` names).

    append:  b, p = batch_indices[t], positions[t]
             page = kv_indices[kv_indptr[b] + p // page_size];  slot = p % page_size
             K[page, slot, h] = append_key[t, h];  V[page, slot, h] = append_value[t, h]  (NHD)
             (a row with b < 0 or p < 0, padding, is skipped)
    get_seq_lens: max(pages_b - 1, 0) * page_size + kv_last_page_len[b]
    get_batch_indices_positions: (b, seq_lens[b] - append_indptr[b + 1] + t) for each token t

Host arrays (NumPy, lists) take the NumPy versions in rtcinfer.plan.page; device arrays
(int32) run a kernel on the caller's stream and come back in the caller's array type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import jit
from .decode_kernel import KV_LAYOUTS, fast_div, token_head
from .interop import Out, dtype_name, run
from .interop.arrays import dense, framework
from .interop.dtypes import itemsize
from .plan import page as host_page
from .plan._checks import as_int

THREADS = 256


@dataclass(frozen=True)
class PageSpec:
    row_bytes: int  # head_dim * itemsize of the cache
    vec: int  # bytes per copy unit
    source: ClassVar[str] = "page.cu"
    kernels: ClassVar[tuple[str, ...]] = (
        "append_kernel",
        "seq_lens_kernel",
        "batch_indices_positions_kernel",
    )

    def prelude(self) -> str:
        return jit.prelude(
            ROW_BYTES=self.row_bytes,
            VEC=self.vec,
            THREADS=THREADS,
        )


INDEX_SPEC = PageSpec(16, 16)  # the module that serves the two index kernels


def _on_device(x) -> bool:
    return framework(x) in ("cupy", "jax") or (framework(x) == "torch" and x.device.type == "cuda")


def _int32(name: str, x) -> None:
    if dtype_name(x) != "int32":
        raise TypeError(f"{name}: device index arrays must be int32, got {dtype_name(x)}")


def _check_csr(indptr_name: str, indptr, rows_name: str, rows) -> int:
    """Device int32 indptr [B + 1] with a per-request int32 array [B]; returns B."""
    _int32(indptr_name, indptr)
    _int32(rows_name, rows)
    batch = rows.shape[0]
    if tuple(indptr.shape) != (batch + 1,):
        raise ValueError(f"{indptr_name} must have shape ({batch + 1},), got {tuple(indptr.shape)}")
    return batch


def _append_launch(stream, ins, outs, *, kv_layout: str, row_bytes: int):
    key, value = ins[:2]
    batch_indices, positions = dense(ins[2], "batch_indices"), dense(ins[3], "positions")
    kv_indices, kv_indptr = dense(ins[-2], "kv_indices"), dense(ins[-1], "kv_indptr")
    nnz, num_heads = key.shape[0], key.shape[1]
    if nnz == 0 or num_heads == 0:
        return
    if len(outs) == 1:  # one [pages, 2, ...] cache: V is K shifted by one step of dim 1
        cache = outs[0]
        k_ptr, v_ptr = cache.data.ptr, cache.data.ptr + cache.strides[1]
        caches = ((cache, k_ptr), (cache, v_ptr))
    else:
        caches = ((outs[0], outs[0].data.ptr), (outs[1], outs[1].data.ptr))
    strides = []
    for arr, _ in caches:
        _, (token, head) = token_head(arr.shape, arr.strides, kv_layout)
        strides += [arr.strides[0], token, head]
    src = [key.strides[0], key.strides[1], value.strides[0], value.strides[1]]
    pointers = [key.data.ptr, value.data.ptr, caches[0][1], caches[1][1]]
    vec = 16
    while vec > 1 and (row_bytes % vec or any(v % vec for v in pointers + src + strides)):
        vec //= 2
    cache_names = ("paged_kv_cache",) * 2 if len(outs) == 1 else ("k_cache", "v_cache")
    named = [("append_key", key), ("append_value", value)]
    named += [(name, arr) for name, (arr, _) in zip(cache_names, caches, strict=True)]
    for name, arr in named:
        if arr.shape[-1] > 1 and arr.strides[-1] != arr.itemsize:
            raise ValueError(
                f"{name}: head_dim must be contiguous, got strides {arr.strides} (bytes)"
            )
    fn = jit.get_function(PageSpec(row_bytes, vec), "append_kernel")
    units_per_row = row_bytes // vec
    units = nnz * num_heads * units_per_row
    page_size = token_head(caches[0][0].shape, caches[0][0].strides, kv_layout)[0][0]
    head_magic, head_shift = fast_div(num_heads)
    page_magic, page_shift = fast_div(page_size)
    args = (
        key.data.ptr, *src[:2], value.data.ptr, *src[2:], batch_indices, positions,
        caches[0][1], *strides[:3], caches[1][1], *strides[3:], kv_indices, kv_indptr,
        units, np.int32(num_heads), np.uint32(head_magic), np.int32(head_shift),
        np.int32(page_size), np.uint32(page_magic), np.int32(page_shift),
    )  # fmt: skip
    grid = -(-units // THREADS)  # one copy unit per thread
    fn((grid, 1, 1), (THREADS, 1, 1), args, stream=stream)


def append_paged_kv_cache(
    append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
    kv_last_page_len, kv_layout="NHD",
):  # fmt: skip
    """Write new tokens into a paged KV cache in place (math in the module docstring).

    append_key, append_value: [nnz, H, D] in the cache's dtype (fp8 caches take fp8 rows);
    batch_indices, positions: int32 [nnz] (see get_batch_indices_positions), rows with a
    negative entry (its padding past append_indptr[-1]) are skipped; paged_kv_cache:
    [pages, 2, page_size, H, D] (NHD) / [pages, 2, H, page_size, D] (HND) or a (k, v) pair;
    kv_indices, kv_indptr [B + 1], kv_last_page_len [B]: int32, the table that already includes
    the new tokens. The device does not check b < B or p < seq_len of request b: such a row
    writes outside the request's pages.
    Returns the cache (for JAX, whose arrays are immutable, the updated copy).
    """
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    pair = isinstance(paged_kv_cache, (tuple, list))
    caches = list(paged_kv_cache) if pair else [paged_kv_cache]
    dtype = dtype_name(caches[0])
    inner = caches[0].shape[1:] if pair else caches[0].shape[2:]
    if pair and (
        len(caches) != 2
        or any(len(c.shape) != 4 or dtype_name(c) != dtype for c in caches)
        or tuple(caches[0].shape) != tuple(caches[1].shape)
    ):
        shapes = [(tuple(c.shape), dtype_name(c)) for c in caches]
        raise ValueError(f"a (k_cache, v_cache) pair must be two [pages, ...] arrays of one shape "
                         f"and dtype, got {shapes}")  # fmt: skip
    if not pair and (len(caches[0].shape) != 5 or caches[0].shape[1] != 2):
        raise ValueError(f"paged_kv_cache must be [pages, 2, ...], got {tuple(caches[0].shape)}")
    (_, num_heads), _ = token_head(tuple(inner), (0, 0, 0), kv_layout)
    expect = (num_heads, inner[-1])
    for name, x in (("append_key", append_key), ("append_value", append_value)):
        if len(x.shape) != 3 or tuple(x.shape[1:]) != expect or dtype_name(x) != dtype:
            raise ValueError(
                f"{name}: expected [nnz, {expect[0]}, {expect[1]}] of dtype {dtype} (the "
                f"cache's), got {tuple(x.shape)} of {dtype_name(x)}"
            )
    nnz = append_key.shape[0]
    index = [("batch_indices", batch_indices), ("positions", positions)]
    table = [("kv_indices", kv_indices), ("kv_indptr", kv_indptr)]
    for name, x in index:
        _int32(name, x)
    _int32("kv_indices", kv_indices)
    _check_csr("kv_indptr", kv_indptr, "kv_last_page_len", kv_last_page_len)
    if append_value.shape[0] != nnz or any(x.shape[0] != nnz for _, x in index):
        raise ValueError(
            f"append_key ({nnz}), append_value ({append_value.shape[0]}), batch_indices "
            f"({batch_indices.shape[0]}) and positions ({positions.shape[0]}) differ in length"
        )
    names = ("k_cache", "v_cache") if pair else ("paged_kv_cache",)
    ins = [("append_key", append_key), ("append_value", append_value), *index]
    ins += list(zip(names, caches, strict=True)) + table
    outs = [Out(tuple(c.shape), dtype, alias=4 + i) for i, c in enumerate(caches)]
    row_bytes = inner[-1] * itemsize(dtype)
    result = run(_append_launch, ins, outs, kv_layout=kv_layout, row_bytes=row_bytes)
    return tuple(result) if pair else result


def _seq_lens_launch(stream, ins, outs, *, page_size: int):
    kv_indptr, last = dense(ins[0], "kv_indptr"), dense(ins[1], "kv_last_page_len")
    batch = last.shape[0]
    if batch:
        fn = jit.get_function(INDEX_SPEC, "seq_lens_kernel")
        args = (kv_indptr, last, outs[0], np.int32(batch), np.int32(page_size))
        fn((-(-batch // THREADS), 1, 1), (THREADS, 1, 1), args, stream=stream)


def get_seq_lens(kv_indptr, kv_last_page_len, page_size: int):
    """Tokens per request: max(pages - 1, 0) * page_size + kv_last_page_len, int32 [B].

    Host arrays give a NumPy array; int32 device arrays a device array of their framework.
    The host version checks the table and that every length fits in int32; the device version
    reads the table where it lies and does not (a check there would cost a synchronization).
    """
    if not _on_device(kv_indptr):
        return host_page.get_seq_lens(kv_indptr, kv_last_page_len, page_size)
    batch = _check_csr("kv_indptr", kv_indptr, "kv_last_page_len", kv_last_page_len)
    page_size = as_int("page_size", page_size, minimum=1)
    ins = [("kv_indptr", kv_indptr), ("kv_last_page_len", kv_last_page_len)]
    return run(_seq_lens_launch, ins, [Out((batch,), "int32")], page_size=page_size)


def _positions_launch(stream, ins, outs, *, nnz: int):
    append_indptr, seq_lens = dense(ins[0], "append_indptr"), dense(ins[1], "seq_lens")
    if nnz:
        fn = jit.get_function(INDEX_SPEC, "batch_indices_positions_kernel")
        args = (append_indptr, seq_lens, *outs, np.int32(seq_lens.shape[0]), np.int32(nnz))
        fn((-(-nnz // THREADS), 1, 1), (THREADS, 1, 1), args, stream=stream)


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int):
    """(batch_indices, positions), int32 [nnz], of every appended token (CSR to COO):
    b owns tokens append_indptr[b]:append_indptr[b + 1], at positions ending at seq_lens[b];
    entries past append_indptr[-1] (a padded nnz) are -1. Host arrays use NumPy, and are
    checked (seq_lens[b] covers the appended tokens, nnz >= append_indptr[-1]); device arrays
    are not: a seq_lens[b] shorter than its append gives negative positions, which
    append_paged_kv_cache skips as padding."""
    if not _on_device(append_indptr):
        return host_page.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    _check_csr("append_indptr", append_indptr, "seq_lens", seq_lens)
    nnz = as_int("nnz", nnz, minimum=0)
    ins = [("append_indptr", append_indptr), ("seq_lens", seq_lens)]
    outs = [Out((nnz,), "int32"), Out((nnz,), "int32")]
    return run(_positions_launch, ins, outs, nnz=nnz)


__all__ = [
    "PageSpec",
    "append_paged_kv_cache",
    "get_batch_indices_positions",
    "get_seq_lens",
]
