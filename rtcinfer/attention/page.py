"""Paged KV-cache updates and bookkeeping (FlashInfer's ``flashinfer.page`` names).

    append:  b, p = batch_indices[t], positions[t]
             page = kv_indices[kv_indptr[b] + p // page_size];  slot = p % page_size
             K[page, slot, h] = append_key[t, h];  V[page, slot, h] = append_value[t, h]  (NHD)
             (a row with b < 0 or p < 0, padding, is skipped; a row with b >= B,
             p >= seq_lens[b], or an entry of kv_indptr or kv_indices outside kv_indices or the
             cache is skipped and reported: rtcinfer/errors.py)
    get_seq_lens: max(pages_b - 1, 0) * page_size + kv_last_page_len[b]
    get_batch_indices_positions: (b, seq_lens[b] - append_indptr[b + 1] + t) for each token t

Host arrays (NumPy, lists) take the NumPy versions in rtcinfer.plan.page; device arrays
(int32 or int64: the page table's arrays of one type, append's batch_indices and positions of
one type, which may be the other) run a kernel on the caller's stream and come back in the
caller's array type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import errors, jit
from ..errors import BadIndex
from ..interop import Fill, Op, OutSlot, Prepared, call, dtype_name, one_launch
from ..interop.arrays import framework, torch_compiling, with_shortcut
from ..interop.dtypes import itemsize
from ..interop.shortcut import Shortcut
from ..launch import Kernel, Launch
from ..plan import page as host_page
from ..plan._checks import as_int
from .decode_kernel import fast_div
from .paged_kv import cache_views, check_layout, token_head

THREADS = 256


@dataclass(frozen=True)
class PageSpec:
    row_bytes: int  # head_dim * itemsize of the cache
    vec: int  # bytes per copy unit
    index_dtype: str = "int32"  # of the page table / the index ops' arrays (int32 or int64)
    row_index_dtype: str = "int32"  # of append's batch_indices and positions
    v_row_bytes: int = 0  # V's head_dim * itemsize where a (k, v) pair's differ; 0: row_bytes
    source: ClassVar[str] = "attention/page.cu"
    kernels: ClassVar[tuple[str, ...]] = (
        "append_kernel",
        "seq_lens_kernel",
        "batch_indices_positions_kernel",
    )
    structs: ClassVar[tuple[str, ...]] = (  # crossing the seam
        "AppendParams",
        "SeqLensParams",
        "BatchIndicesPositionsParams",
        "BadIndexRecord",
    )

    def prelude(self) -> str:
        return jit.prelude(
            ROW_BYTES=self.row_bytes,
            V_ROW_BYTES=self.v_row_bytes or self.row_bytes,
            VEC=self.vec,
            THREADS=THREADS,
            IDX=self.index_dtype,
            ROW_IDX=self.row_index_dtype,
            BadIndex=BadIndex,
        )


INDEX_SPECS = {d: PageSpec(16, 16, d) for d in ("int32", "int64")}  # the index kernels' modules


def _on_device(x) -> bool:
    return framework(x) in ("cupy", "jax") or (framework(x) == "torch" and x.device.type == "cuda")


def _index_dtype(**arrays) -> str:
    """The one dtype (int32 or int64) of device index arrays that go together."""
    dtypes = {name: x.dtype for name, x in arrays.items()}
    kinds = set(dtypes.values())
    if len(kinds) > 1 or not kinds <= {"int32", "int64"}:
        names = list(dtypes)
        which = f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]
        each = "both" if len(names) == 2 else "all"
        raise TypeError(
            f"{which} must be {each} int32 or {each} int64 (device index arrays), got "
            + ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        )
    return kinds.pop()


def _check_csr(indptr_name: str, indptr, rows_name: str, rows) -> tuple[int, str]:
    """Device indptr [B + 1] with a per-request array [B], both int32 or both int64; returns
    (B, their dtype)."""
    dtype = _index_dtype(**{indptr_name: indptr, rows_name: rows})
    batch = rows.shape[0]
    if indptr.shape != (batch + 1,):
        raise ValueError(f"{indptr_name} must have shape ({batch + 1},), got {indptr.shape}")
    return batch, dtype


def _pair_error(shapes) -> ValueError:
    return ValueError(
        f"a (k_cache, v_cache) pair must be two [pages, ...] arrays of one dtype and shape but "
        f"for their head_dim, got {shapes}"
    )


def _check_cache(caches, kv_layout: str) -> tuple[str, int, int, int]:
    """(dtype, heads, K's head_dim, V's) of the cache: one [pages, 2, ...] array or a (k, v)
    pair (whose head dims may differ)."""
    check_layout(kv_layout)
    pair = len(caches) == 2
    dtype = caches[0].dtype
    inner = caches[0].shape[1:] if pair else caches[0].shape[2:]
    if pair and (
        any(c.ndim != 4 or c.dtype != dtype for c in caches)
        or caches[0].shape[:-1] != caches[1].shape[:-1]
    ):
        raise _pair_error([(c.shape, c.dtype) for c in caches])
    if not pair and (caches[0].ndim != 5 or caches[0].shape[1] != 2):
        raise ValueError(f"paged_kv_cache must be [pages, 2, ...], got {caches[0].shape}")
    (_, num_heads), _ = token_head(inner, (0, 0, 0), kv_layout)
    return dtype, num_heads, inner[-1], caches[-1].shape[-1]


def _check_append(
    key, value, batch_indices, positions, caches, table, kv_layout: str
) -> tuple[str, str]:
    """The checks of append_paged_kv_cache's arguments (table: kv_indices, kv_indptr,
    kv_last_page_len); returns (the cache's dtype, the table's index dtype, that of
    batch_indices and positions)."""
    dtype, num_heads, head_dim, head_dim_v = _check_cache(caches, kv_layout)
    for name, x, expect in (("append_key", key, (num_heads, head_dim)),
                            ("append_value", value, (num_heads, head_dim_v))):  # fmt: skip
        if x.ndim != 3 or x.shape[1:] != expect or x.dtype != dtype:
            raise ValueError(
                f"{name}: expected [nnz, {expect[0]}, {expect[1]}] of dtype {dtype} (the "
                f"cache's), got {x.shape} of {x.dtype}"
            )
    nnz = key.shape[0]
    rows = _index_dtype(batch_indices=batch_indices, positions=positions)
    index = _index_dtype(kv_indices=table[0], kv_indptr=table[1], kv_last_page_len=table[2])
    _check_csr("kv_indptr", table[1], "kv_last_page_len", table[2])
    if value.shape[0] != nnz or batch_indices.shape[0] != nnz or positions.shape[0] != nnz:
        raise ValueError(
            f"append_key ({nnz}), append_value ({value.shape[0]}), batch_indices "
            f"({batch_indices.shape[0]}) and positions ({positions.shape[0]}) differ in length"
        )
    return dtype, index, rows


def _prepare_append(infos, _align: int, static: tuple) -> Prepared:
    """Slots: append_key, append_value, batch_indices, positions, the cache (paged_kv_cache, or
    k_cache and v_cache), kv_indices, kv_indptr, kv_last_page_len. Outputs: the cache array(s),
    updated in place. Pointers: the slots', then the outputs'. Before it launches, a call
    raises what an earlier one reported (errors.py); under RTCINFER_CHECK=1 it waits for its
    own launch and raises what it reported."""
    (kv_layout,) = static
    key, value, batch_indices, positions = infos[:4]
    caches = infos[4:-3]
    dtype, *index = _check_append(key, value, batch_indices, positions, caches, infos[-3:],
                                  kv_layout)  # fmt: skip
    align = min(x.align for x in (key, value, *caches))  # of what the copies move
    first, v_offset = _append_launch(key, value, caches, kv_layout, itemsize(dtype), align,
                                     index)  # fmt: skip
    pair, first_out = len(caches) == 2, len(infos)
    table = len(infos) - 3  # kv_indices, kv_indptr, kv_last_page_len
    rec, check = errors.record(key.device), errors.checking()
    # the outputs: the caches (their XLA copies for JAX); a 5-D cache's V at its byte offset
    v_cache = ("v_cache", first_out + 1) if pair else ("v_cache", first_out, v_offset)
    fill = Fill((("key", 0), ("value", 1), ("batch_indices", 2), ("positions", 3),
                 ("kv_indices", table), ("kv_indptr", table + 1), ("kv_last_page_len", table + 2),
                 ("k_cache", first_out), v_cache))  # fmt: skip
    outs = tuple(OutSlot(c.shape, dtype, 4 + i, alias=True) for i, c in enumerate(caches))
    dense = tuple(i for i in (2, 3, table, table + 1, table + 2) if not infos[i].contiguous)

    def remake(n: int, outs: tuple, launch=None) -> Prepared:  # n tokens (prepared.with_rows)
        if launch is None:
            rows = [x._replace(shape=(n, *x.shape[1:])) for x in (key, value)]
            launch = _append_launch(*rows, caches, kv_layout, itemsize(dtype), align, index)[0]
        p = launch.params
        p.batch_size, p.num_indices = infos[table + 2].shape[0], infos[table].shape[0]
        p.num_pages = caches[0].shape[0]
        return one_launch(outs, launch, fill, record=rec, check=check, dense=dense,
                          rows=n, remake=remake)  # fmt: skip

    return remake(key.shape[0], outs, first)


def _append_launch(key, value, caches, kv_layout: str, item: int, align: int, index):
    """(the append launch, V's byte offset from K in a 5-D cache). Strides are in bytes for the
    kernel's byte copy; an empty append launches nothing and is not checked further."""
    nnz, num_heads, row_bytes = key.shape[0], key.shape[1], key.shape[2] * item
    v_row_bytes = value.shape[2] * item  # (a pair's head dims may differ)
    pair = len(caches) == 2
    k_view, v_view = cache_views(caches[0], caches[1] if pair else None, kv_layout, item)
    v_offset = v_view.offset
    names = ("k_cache", "v_cache") if pair else ("paged_kv_cache",) * 2
    caches = caches if pair else caches * 2
    if nnz == 0 or num_heads == 0:
        kernel = _append_kernel(row_bytes, v_row_bytes, 16, index)
        return Launch(kernel, (0, 1, 1), (THREADS, 1, 1)), v_offset
    cache_strides = [k_view.page, k_view.token, k_view.head, v_view.page, v_view.token,
                     v_view.head]  # fmt: skip
    src = [key.strides[0] * item, key.strides[1] * item]
    src += [value.strides[0] * item, value.strides[1] * item]
    strides = [v_offset, *src, *cache_strides]
    vec = 16  # bytes per copy unit: every pointer (V's too) and stride a multiple of it
    while vec > 1 and (row_bytes % vec or v_row_bytes % vec or align % vec
                       or any(s % vec for s in strides)):  # fmt: skip
        vec //= 2
    named = (("append_key", key), ("append_value", value), *zip(names, caches, strict=True))
    for name, x in named:
        if x.shape[-1] > 1 and x.strides[-1] != 1:
            got = tuple(s * item for s in x.strides)
            raise ValueError(f"{name}: head_dim must be contiguous, got strides {got} (bytes)")
    units = nnz * num_heads * (max(row_bytes, v_row_bytes) // vec)
    page_size = token_head(caches[0].shape, caches[0].strides, kv_layout)[0][0]
    launch = Launch(_append_kernel(row_bytes, v_row_bytes, vec, index),
                    (-(-units // THREADS), 1, 1), (THREADS, 1, 1))  # fmt: skip
    p = launch.params
    p.key_token, p.key_head, p.value_token, p.value_head = src
    p.kp, p.kt, p.kh, p.vp, p.vt, p.vh = cache_strides
    p.units, p.num_heads, p.page_size = units, num_heads, page_size
    p.head_magic, p.head_shift = fast_div(num_heads)
    p.page_magic, p.page_shift = fast_div(page_size)
    return launch, v_offset


def _append_kernel(row_bytes: int, v_row_bytes: int, vec: int, index) -> Kernel:
    """index: (the table's index dtype, batch_indices and positions')."""
    v = 0 if v_row_bytes == row_bytes else v_row_bytes
    return Kernel(PageSpec(row_bytes, vec, *index, v), "append_kernel", "AppendParams")


_ROWS = ("append_key", "append_value", "batch_indices", "positions")
_TABLE = ("kv_indices", "kv_indptr", "kv_last_page_len")
_APPEND = Op("append_paged_kv_cache", (*_ROWS, "paged_kv_cache", *_TABLE), _prepare_append,
             rows=_ROWS)  # fmt: skip
_APPEND_PAIR = Op("append_kv_pair", (*_ROWS, "k_cache", "v_cache", *_TABLE), _prepare_append,
                  rows=_ROWS)  # fmt: skip


@with_shortcut(Shortcut(_APPEND, (*_ROWS, "paged_kv_cache", *_TABLE), "(kv_layout,)"))
def append_paged_kv_cache(
    append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
    kv_last_page_len, kv_layout="NHD",
):  # fmt: skip
    """Write new tokens into a paged KV cache in place (math in the module docstring).

    append_key, append_value: [nnz, H, D] in the cache's dtype (fp8 caches take fp8 rows);
    batch_indices, positions: [nnz] (see get_batch_indices_positions), rows with a negative
    entry (its padding past append_indptr[-1]) are skipped; paged_kv_cache:
    [pages, 2, page_size, H, D] (NHD) / [pages, 2, H, page_size, D] (HND) or a (k, v) pair;
    kv_indices, kv_indptr [B + 1], kv_last_page_len [B]: the table that already includes the
    new tokens. The five index arrays are all int32 or all int64.
    Bad entries: every entry used is checked on the device; a row with b >= B, p >= seq_len of
    request b (its pages and kv_last_page_len), a kv_indptr that leads outside kv_indices, or a
    page id outside the cache is skipped (nothing is written through it) and raised as
    rtcinfer.BadIndexError, naming the array and the entry, by the next call of this op, by
    rtcinfer.check_errors(), or at once under RTCINFER_CHECK=1 (rtcinfer/errors.py).
    Returns the cache (for JAX, whose arrays are immutable, the updated copy).
    """
    head = (append_key, append_value, batch_indices, positions)
    table = (kv_indices, kv_indptr, kv_last_page_len)
    if torch_compiling(append_key):  # a custom op node (rtcinfer/torch_ops.py)
        from .. import torch_ops

        pair = isinstance(paged_kv_cache, (tuple, list))
        cache = tuple(paged_kv_cache) if pair else (paged_kv_cache,)
        name = "append_paged_kv_cache_pair" if pair else "append_paged_kv_cache"
        torch_ops.call(name, *head, *cache, *table, kv_layout)
        return paged_kv_cache
    if not isinstance(paged_kv_cache, (tuple, list)):
        return call(_APPEND, (*head, paged_kv_cache, *table), (kv_layout,))
    if len(paged_kv_cache) != 2:
        check_layout(kv_layout)
        raise _pair_error([(tuple(c.shape), dtype_name(c)) for c in paged_kv_cache])
    return call(_APPEND_PAIR, (*head, *paged_kv_cache, *table), (kv_layout,))


def append_paged_mla_kv_cache(
    append_ckv, append_kpe, batch_indices, positions, ckv_cache, kpe_cache, kv_indices,
    kv_indptr, kv_last_page_len,
):  # fmt: skip
    """MLA's append (FlashInfer's): ckv_cache[page, slot] = append_ckv[t] and kpe_cache[page,
    slot] = append_kpe[t], page and slot as append_paged_kv_cache finds them (its checks and
    reports too). append_ckv [nnz, 512], append_kpe [nnz, 64]; ckv_cache [pages, page_size,
    512], kpe_cache [pages, page_size, 64]: appended as a (k, v) pair of one head, through
    views of the caller's arrays. Returns (ckv_cache, kpe_cache) (for JAX the updated
    copies)."""
    for name, x, rank in (("append_ckv", append_ckv, 2), ("append_kpe", append_kpe, 2),
                          ("ckv_cache", ckv_cache, 3), ("kpe_cache", kpe_cache, 3)):  # fmt: skip
        if len(getattr(x, "shape", ())) != rank:
            raise ValueError(f"{name}: expected {rank} dims, got {getattr(x, 'shape', x)!r}")
    caches = append_paged_kv_cache(append_ckv[:, None], append_kpe[:, None], batch_indices,
                                   positions, (ckv_cache[:, :, None], kpe_cache[:, :, None]),
                                   kv_indices, kv_indptr, kv_last_page_len)  # fmt: skip
    if framework(ckv_cache) == "jax":  # new arrays: the head dim taken out again
        return caches[0][:, :, 0], caches[1][:, :, 0]
    return ckv_cache, kpe_cache


def _prepare_seq_lens(infos, align: int, static: tuple) -> Prepared:
    """Slots: kv_indptr, kv_last_page_len -> seq_lens; the scalar: page_size."""
    kv_indptr, last = infos
    batch, index = _check_csr("kv_indptr", kv_indptr, "kv_last_page_len", last)
    kernel = Kernel(INDEX_SPECS[index], "seq_lens_kernel", "SeqLensParams")
    launch = Launch(kernel, (-(-batch // THREADS), 1, 1), (THREADS, 1, 1))
    p = launch.params
    p.batch_size = batch

    def run(stream, device, ptrs, scalars):
        launch.lock.acquire()
        try:
            p.kv_indptr, p.last, p.seq_lens = ptrs[0], ptrs[1], ptrs[2]
            p.page_size = scalars[0]
            launch(stream, device)
        finally:
            launch.lock.release()

    dense = tuple(i for i in (0, 1) if not infos[i].contiguous)
    return Prepared((OutSlot((batch,), index),), run, preload=launch.preload, dense=dense)


_SEQ_LENS = Op("get_seq_lens", ("kv_indptr", "kv_last_page_len"), _prepare_seq_lens)


def get_seq_lens(kv_indptr, kv_last_page_len, page_size: int):
    """Tokens per request: max(pages - 1, 0) * page_size + kv_last_page_len, [B].

    Host arrays give an int32 NumPy array; device arrays (both int32 or both int64) a device
    array of their framework and dtype (as FlashInfer's tensor arithmetic does).
    The host version checks the table and that every length fits in int32; the device version
    reads the table where it lies and does not (a check there would cost a synchronization).
    """
    if torch_compiling(kv_indptr):  # a custom op node (rtcinfer/torch_ops.py)
        from .. import torch_ops

        return torch_ops.call("get_seq_lens", kv_indptr, kv_last_page_len, page_size)
    if not _on_device(kv_indptr):
        return host_page.get_seq_lens(kv_indptr, kv_last_page_len, page_size)
    page_size = as_int("page_size", page_size, minimum=1)
    return call(_SEQ_LENS, (kv_indptr, kv_last_page_len), (), (page_size,))


def _check_given(name: str, info, nnz: int) -> None:
    """A caller's output buffer: a contiguous int32 array of shape (nnz,)."""
    if info is not None and (info.dtype != "int32" or info.shape != (nnz,) or not info.contiguous):
        raise ValueError(
            f"{name}: expected a contiguous int32 array of shape ({nnz},), got {info.dtype} of "
            f"shape {info.shape}"
        )


def _prepare_positions(infos, align: int, static: tuple) -> Prepared:
    """Slots: append_indptr, seq_lens, and the caller's batch_indices and positions buffers
    if given -> (batch_indices, positions) [nnz]; static: (nnz,)."""
    append_indptr, seq_lens, given_indices, given_positions = infos
    batch, index = _check_csr("append_indptr", append_indptr, "seq_lens", seq_lens)
    (nnz,) = static
    _check_given("batch_indices", given_indices, nnz)
    _check_given("positions", given_positions, nnz)
    kernel = Kernel(INDEX_SPECS[index], "batch_indices_positions_kernel",
                    "BatchIndicesPositionsParams")  # fmt: skip
    launch = Launch(kernel, (-(-nnz // THREADS), 1, 1), (THREADS, 1, 1))
    p = launch.params
    p.batch_size, p.nnz = batch, nnz

    def run(stream, device, ptrs, scalars):
        launch.lock.acquire()
        try:
            p.append_indptr, p.seq_lens = ptrs[0], ptrs[1]
            p.batch_indices, p.positions = ptrs[4], ptrs[5]  # the outputs follow the slots
            launch(stream, device)
        finally:
            launch.lock.release()

    outs = (OutSlot((nnz,), "int32", 2 if given_indices is not None else None),
            OutSlot((nnz,), "int32", 3 if given_positions is not None else None))  # fmt: skip
    dense = tuple(i for i in (0, 1) if not infos[i].contiguous)
    return Prepared(outs, run, preload=launch.preload, dense=dense)


_POSITIONS = Op("get_batch_indices_positions",
                ("append_indptr", "seq_lens", "batch_indices", "positions"), _prepare_positions,
                given=("batch_indices", "positions"))  # fmt: skip


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int, batch_indices=None,
                                positions=None):  # fmt: skip
    """(batch_indices, positions), int32 [nnz], of every appended token (CSR to COO):
    b owns tokens append_indptr[b]:append_indptr[b + 1], at positions ending at seq_lens[b];
    entries past append_indptr[-1] (a padded nnz) are -1. batch_indices, positions: buffers
    to write (int32 [nnz], as FlashInfer's preallocated outputs), returned; else allocated.
    Host arrays use NumPy, and are checked (seq_lens[b] covers the appended tokens, nnz >=
    append_indptr[-1]); device arrays are not: a seq_lens[b] shorter than its append gives
    negative positions, which append_paged_kv_cache skips as padding."""
    if torch_compiling(append_indptr):  # a custom op node (rtcinfer/torch_ops.py)
        from .. import torch_ops

        if batch_indices is None and positions is None:
            return torch_ops.call("get_batch_indices_positions", append_indptr, seq_lens, nnz)
        given = batch_indices if batch_indices is not None else positions
        batch_indices = given.new_empty(given.shape) if batch_indices is None else batch_indices
        positions = given.new_empty(given.shape) if positions is None else positions
        torch_ops.call("get_batch_indices_positions_into", append_indptr, seq_lens, nnz,
                       batch_indices, positions)  # fmt: skip
        return batch_indices, positions
    if not _on_device(append_indptr):
        return host_page.get_batch_indices_positions(append_indptr, seq_lens, nnz,
                                                     batch_indices, positions)  # fmt: skip
    nnz = as_int("nnz", nnz, minimum=0)
    return call(_POSITIONS, (append_indptr, seq_lens, batch_indices, positions), (nnz,))


def specs_for(head_dim: int, kv_dtype: str, v_head_dim: int | None = None) -> list[PageSpec]:
    """What a serving loop's cache bookkeeping uses (warmup): the append of rows of head_dim
    elements of kv_dtype (V's of v_head_dim where a (k, v) pair's differ, as MLA's ckv and kpe
    for append_paged_mla_kv_cache; 16-byte copies: aligned arrays) and the index ops' modules,
    for int32 and int64 index arrays (a table of one, positions from
    get_batch_indices_positions int32)."""
    item = itemsize(kv_dtype)
    row_bytes = head_dim * item
    v = 0 if v_head_dim in (None, head_dim) else v_head_dim * item  # as _append_kernel names it
    kinds = ("int32", "int64")
    return [PageSpec(row_bytes, 16, t, r, v) for t in kinds for r in kinds] + [
        *INDEX_SPECS.values()
    ]


__all__ = [
    "PageSpec",
    "append_paged_kv_cache",
    "append_paged_mla_kv_cache",
    "get_batch_indices_positions",
    "get_seq_lens",
    "specs_for",
]
