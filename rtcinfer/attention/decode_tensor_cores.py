"""Batch decode with use_tensor_cores=True: the plan of a paged prefill wrapper whose queries
are each request's last q_len_per_req positions (one: decode; more: speculative verification,
causal among them, as FlashInfer 0.7.2 serves it), the heads of a GQA group packed into the
prefill kernel's tile rows."""

from __future__ import annotations

import numpy as np

from ..plan._checks import as_int
from ..plan.decode import _pages_and_lens
from .planned import host_ints


def plan_tensor_cores(prefill, q_len: int, indptr, indices, last_page_len, num_qo_heads,
                      num_kv_heads, head_dim, page_size, **options) -> None:  # fmt: skip
    """`prefill`.plan() of the decode batch's table with q_len queries a request; `options`
    are the prefill plan's keywords (dtypes, features, split)."""
    kv_indptr = host_ints("indptr", indptr)
    if q_len > 1:
        last_page_len = host_ints("last_page_len", last_page_len)
        _check_verified_tokens(q_len, kv_indptr, last_page_len, page_size)
    qo_indptr = np.arange(kv_indptr.shape[0], dtype=np.int64) * q_len
    prefill.plan(qo_indptr, kv_indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                 head_dim, page_size, causal=q_len > 1, **options)  # fmt: skip


def _check_verified_tokens(q_len: int, kv_indptr, last_page_len, page_size) -> None:
    """Every request's queries are among its keys (kv_len >= q_len), as FlashInfer requires:
    the verified tokens are appended to the cache first."""
    _, _, kv_len, _ = _pages_and_lens(kv_indptr, last_page_len,
                                      as_int("page_size", page_size, minimum=1))  # fmt: skip
    if kv_len.size and int(kv_len.min()) < q_len:
        b = int(np.argmin(kv_len))
        raise ValueError(
            f"q_len_per_req={q_len} needs kv_len >= {q_len} for every request (the verified "
            f"tokens appended to the cache first), got {int(kv_len[b])} keys for request {b}"
        )


__all__ = ["plan_tensor_cores"]
