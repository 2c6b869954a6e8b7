"""FlashInfer's BatchAttention: one plan for a batch that mixes prefill and decode requests
over a paged KV cache, given each request's key count (kv_len_arr) rather than its last
page's length, and a run() that returns (o, lse). The paged prefill wrapper already plans such
batches (a request of one query is a decode row of its tiles), so this is that wrapper with
FlashInfer's holistic-kernel API in front: plan() derives the page table of each request's
keys (its first ceil(kv_len / page_size) pages; a request may list more, reserved ahead) and
the last page lengths."""

from __future__ import annotations

import numpy as np

from ..plan._checks import as_int
from .planned import host_ints
from .prefill import BatchPrefillWithPagedKVCacheWrapper
from .run_options import refuse


def pages_of_keys(kv_indptr, kv_indices, kv_len, page_size: int):
    """(indptr, indices, last_page_len) of the pages holding each request's kv_len keys: the
    first ceil(kv_len / page_size) of its pages kv_indices[kv_indptr[b]:kv_indptr[b + 1]]."""
    kv_indptr, kv_len = np.asarray(kv_indptr, np.int64), np.asarray(kv_len, np.int64)
    if kv_indptr.ndim != 1 or kv_len.shape != (kv_indptr.shape[0] - 1,):
        raise ValueError(
            f"kv_len_arr ({kv_len.shape[0] if kv_len.ndim else kv_len}) must have one entry a "
            f"request of kv_indptr ({kv_indptr.shape[0]} entries)"
        )
    if (kv_len < 0).any():
        b = int(np.argmax(kv_len < 0))
        raise ValueError(f"kv_len_arr[{b}] = {int(kv_len[b])}: a key count cannot be negative")
    listed = np.diff(kv_indptr)
    pages = -(-kv_len // page_size)
    if (pages > listed).any():
        b = int(np.argmax(pages > listed))
        raise ValueError(
            f"request {b}: kv_len_arr says {int(kv_len[b])} keys, {int(pages[b])} pages of "
            f"{page_size}, but kv_indptr lists {int(listed[b])} pages for it"
        )
    last = np.where(pages > 0, kv_len - (pages - 1) * page_size, 0)
    if (pages == listed).all():
        return kv_indptr, kv_indices, last
    indptr = np.concatenate([[0], np.cumsum(pages)])
    take = np.concatenate([np.arange(s, s + n) for s, n in zip(kv_indptr[:-1], pages, strict=True)]
                          + [np.zeros(0, np.int64)])  # fmt: skip
    return indptr, np.asarray(kv_indices)[take], last


class BatchAttention:
    """FlashInfer's BatchAttention(kv_layout, device): plan(qo_indptr, kv_indptr, kv_indices,
    kv_len_arr, ...) then run(q, kv_cache) -> (o [nnz_q, Hq, D_vo], lse [nnz_q, Hq], base 2)."""

    def __init__(self, kv_layout="NHD", device="cuda"):
        _check_device(device)
        self._wrapper = BatchPrefillWithPagedKVCacheWrapper(None, kv_layout)
        self._soft_cap = 0.0

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_qo_heads, num_kv_heads,
             head_dim_qk, head_dim_vo, page_size, causal=False, sm_scale=None,
             logits_soft_cap=None, q_data_type="bfloat16", kv_data_type="bfloat16",
             use_profiler=False):  # fmt: skip
        """The paged prefill wrapper's plan() of the same batch, its table cut to each
        request's keys (pages_of_keys). use_profiler (FlashInfer's kernel profiler) is not
        supported."""
        refuse(use_profiler=use_profiler or None)
        page = as_int("page_size", page_size, minimum=1)
        indptr, indices, last = pages_of_keys(
            host_ints("kv_indptr", kv_indptr), host_ints("kv_indices", kv_indices, widen=False),
            host_ints("kv_len_arr", kv_len_arr), page,
        )  # fmt: skip
        self._wrapper.plan(qo_indptr, indptr, indices, last, num_qo_heads, num_kv_heads,
                           head_dim_qk, page, head_dim_vo=head_dim_vo, causal=causal,
                           sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                           q_data_type=q_data_type, kv_data_type=kv_data_type)  # fmt: skip
        self._soft_cap = float(logits_soft_cap or 0.0)

    def prewarm_paged_kv_stride_variant(self, variant: str = "independent") -> None:
        """Nothing to load (PlannedWrapper.prewarm_paged_kv_stride_variant)."""
        self._wrapper.prewarm_paged_kv_stride_variant(variant)

    def run(self, q, kv_cache, out=None, lse=None, k_scale=None, v_scale=None,
            logits_soft_cap=0.0, profiler_buffer=None, kv_cache_sf=None):  # fmt: skip
        """(o, lse) of the planned batch; logits_soft_cap: 0 (the default) or the plan's, as
        FlashInfer requires them consistent; profiler_buffer and kv_cache_sf (NVFP4) are not
        supported."""
        if profiler_buffer is not None or kv_cache_sf is not None:
            refuse(profiler_buffer=profiler_buffer, kv_cache_sf=kv_cache_sf)
        if logits_soft_cap and float(logits_soft_cap) != self._soft_cap:
            raise ValueError(
                f"run(logits_soft_cap={float(logits_soft_cap)}) differs from the plan's "
                f"({self._soft_cap}): pass it to plan()"
            )
        return self._wrapper.run(q, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out,
                                 lse=lse, return_lse=True)  # fmt: skip


def _check_device(device) -> None:
    """The wrapper lives on the current CUDA device: "cuda" (or torch.device("cuda")) names
    it; "cuda:N" must be it."""
    from .. import gpu

    text = str(device)
    if text == "cuda":
        return
    kind, _, index = text.partition(":")
    if kind != "cuda" or not index.isdigit():
        raise ValueError(f"device: expected 'cuda' or 'cuda:N', got {device!r}")
    if int(index) != gpu.current():
        raise ValueError(
            f"device {text!r} is not the current CUDA device ({gpu.current()}): make it current "
            "first (the wrapper's workspace is allocated there)"
        )


__all__ = ["BatchAttention", "pages_of_keys"]
