"""Paged KV-cache bookkeeping on the host (NumPy versions of ``flashinfer.page`` helpers)."""

from __future__ import annotations

import numpy as np

from ._checks import INT32_MAX, as_int, as_int_array, check_indptr, first_bad


def get_seq_lens(kv_indptr, kv_last_page_len, page_size: int) -> np.ndarray:
    """Tokens held by each request of a paged KV cache, as int32[batch_size].

        pages = kv_indptr[1:] - kv_indptr[:-1]
        seq_lens = max(pages - 1, 0) * page_size + kv_last_page_len

    Same formula as FlashInfer: a request with no pages gets ``kv_last_page_len`` (0 for a
    well-formed table, see ``plan_decode`` for the full validation).
    """
    page_size = as_int("page_size", page_size, minimum=1)
    indptr = as_int_array("kv_indptr", kv_indptr)
    last = as_int_array("kv_last_page_len", kv_last_page_len)
    pages = check_indptr("kv_indptr", indptr)
    if last.shape != pages.shape:
        raise ValueError(
            f"kv_last_page_len must have shape ({pages.shape[0]},) to match kv_indptr, "
            f"got {last.shape}"
        )
    seq_lens = np.maximum(pages - 1, 0) * page_size + last
    if seq_lens.size and int(seq_lens.max()) > INT32_MAX:
        raise ValueError(f"a sequence length ({int(seq_lens.max())}) does not fit in int32")
    return seq_lens.astype(np.int32)


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int, batch_indices=None,
                                positions=None):  # fmt: skip
    """Request id and cache position of every appended token (CSR -> COO).

        for b, t in enumerate(range(append_indptr[b], append_indptr[b + 1])):
            batch_indices[t] = b
            positions[t] = seq_lens[b] - append_indptr[b + 1] + t

    ``seq_lens`` are the lengths *after* the append, so the new tokens of request b sit at the
    end of its sequence. Returns two int32[nnz] arrays: ``batch_indices`` and ``positions``
    when given (int32 NumPy arrays of shape (nnz,), written), else new ones. ``nnz`` may exceed
    ``append_indptr[-1]`` (a padded buffer); the tail entries are set to -1.
    """
    indptr = as_int_array("append_indptr", append_indptr)
    lens = as_int_array("seq_lens", seq_lens)
    nnz = as_int("nnz", nnz, minimum=0)
    counts = check_indptr("append_indptr", indptr)
    if lens.shape != counts.shape:
        raise ValueError(
            f"seq_lens must have shape ({counts.shape[0]},) to match append_indptr, "
            f"got {lens.shape}"
        )
    total = int(indptr[-1])
    if nnz < total:
        raise ValueError(f"nnz ({nnz}) must be >= append_indptr[-1] ({total})")
    if lens.size and int(lens.max()) > INT32_MAX:
        b = int(lens.argmax())
        raise ValueError(f"seq_lens[{b}] ({int(lens[b])}) does not fit in int32")
    short = lens < counts
    if short.any():
        b = first_bad(short)
        raise ValueError(
            f"seq_lens[{b}] ({int(lens[b])}) is smaller than the {int(counts[b])} tokens "
            f"appended to request {b}"
        )
    batch_indices = _output("batch_indices", batch_indices, nnz)
    positions = _output("positions", positions, nnz)
    batch_indices[total:] = -1
    positions[total:] = -1
    request = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)
    token = np.arange(total, dtype=np.int64)
    batch_indices[:total] = request
    positions[:total] = token + (lens - indptr[1:])[request]
    return batch_indices, positions


def _output(name: str, buffer, nnz: int) -> np.ndarray:
    """A caller's int32 [nnz] NumPy buffer to write, or a new one."""
    if buffer is None:
        return np.empty(nnz, dtype=np.int32)
    if not isinstance(buffer, np.ndarray) or buffer.dtype != np.int32 or buffer.shape != (nnz,):
        raise ValueError(
            f"{name}: expected an int32 NumPy array of shape ({nnz},) like append_indptr, got "
            f"{type(buffer).__name__} {getattr(buffer, 'dtype', '')} of shape "
            f"{getattr(buffer, 'shape', None)}"
        )
    return buffer
