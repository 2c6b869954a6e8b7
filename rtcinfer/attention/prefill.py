"""Batch prefill and append attention over a ragged or paged KV cache, plan() then run(), and
single-request prefill (FlashInfer's names, argument meanings and defaults).

    query i of request b sits at key position i + kv_len_b - qo_len_b (bottom-right aligned)
    s_ij = q_i . k_j * sm_scale (+ ALiBi slope * (j - pos_i), then soft cap), with q_i and k_j
           turned by RoPE at pos_i and j under pos_encoding_mode="ROPE_LLAMA"; hidden keys:
           j > pos_i (causal), j < pos_i - window_left (window_left >= 0)
    o_i = softmax_j(s_ij) @ V;  lse_i = log2(sum_j exp(s_ij))   (0 and -inf without a key)

Custom masks (boolean or packed, FlashInfer's layout: attention/prefill_mask.py) replace the
causal mask; so does multi-item scoring (prefix_len_ptr and token_pos_in_items_ptr), the mask
it defines built at plan() (attention/multi_item.py). fp8 KV (kv_data_type float8_e4m3fn /
float8_e5m2; k_scale and v_scale at run()) is widened to q's dtype in shared memory. V may
have fewer dims than q and k (head_dim_vo: DeepSeek's 192 / 128, 16-bit KV, RoPE outside the
kernel; o has v's dims), as a ragged pair or a paged (k_cache, v_cache) pair.
"""

from __future__ import annotations

import numpy as np

from ..interop.arrays import with_shortcut
from ..interop.dtypes import itemsize
from ..plan._checks import indptr_counts
from ..plan.decode import _pages_and_lens
from .decode_kernel import Config
from .deprecated_forms import PagedForward, RaggedForward
from .multi_item import scoring_masks
from .paged_kv import (
    check_cache_view,
    check_paged_caches,
    kv_pair,
    kv_storage,
    page_table_ids,
    paged_cache_fields,
)
from .planned import PAGED_KV, PLAIN_RUN, host_ints, run_shortcut
from .prefill_args import check_backend
from .prefill_plan import RAGGED_PAGE
from .prefill_wrapper import PrefillWrapper
from .run_options import refuse


class BatchPrefillWithRaggedKVCacheWrapper(RaggedForward, PrefillWrapper):
    """Batch prefill over ragged K and V: request b's queries are rows
    qo_indptr[b]:qo_indptr[b + 1] of q [nnz_q, Hq, D], its keys rows kv_indptr[b]:kv_indptr[b + 1]
    of k [nnz_kv, Hkv, D] and v [nnz_kv, Hkv, D_vo] (any token and head strides, head_dim
    contiguous; D_vo = head_dim_vo, D by default)."""

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None,
                 mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None,
                 variant_owns_mask=False):  # fmt: skip
        check_backend(backend, jit_args, jit_kwargs, variant_owns_mask)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf,
                         custom_mask_buf=custom_mask_buf)  # fmt: skip

    def plan(
        self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
        custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
        use_fp16_qk_reduction=False, window_left=-1, logits_soft_cap=None, sm_scale=None,
        rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
        o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
        token_pos_in_items_len=0, max_item_len_ptr=None, fixed_split_size=None,
        disable_split_kv=False, seq_lens=None, seq_lens_q=None, max_token_per_sequence=None,
        max_sequence_kv=None, v_indptr=None, o_indptr=None, uniform_q_len=None,
    ) -> None:  # fmt: skip
        """Validate the batch on the host, plan the work, upload it (one copy).

        FlashInfer 0.7.2's parameters, in its order (PLAN_NOTES in prefill_args.py: what the
        ones without a counterpart here do)."""
        qo = host_ints("qo_indptr", qo_indptr)
        kv = host_ints("kv_indptr", kv_indptr)
        kv_len, _ = indptr_counts("kv_indptr", kv)
        if kv.shape != qo.shape:
            raise ValueError(
                f"qo_indptr ({qo.shape[0]} entries) and kv_indptr ({kv.shape[0]}) must describe "
                "the same batch"
            )
        items = (prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        masks, causal = scoring_masks(items, qo, kv_len, (custom_mask, packed_custom_mask),
                                      causal)  # fmt: skip
        args = (num_qo_heads, num_kv_heads, head_dim_qk, RAGGED_PAGE, causal, pos_encoding_mode,
                window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type, sm_scale,
                rope_scale, rope_theta)  # fmt: skip
        batch = kv_len.shape[0]
        self._plan(qo, kv_len, np.arange(batch), kv[:-1].astype(np.int32), args, masks,
                   fixed_split_size, disable_split_kv, int(kv[-1]), head_dim_vo)  # fmt: skip

    @with_shortcut(run_shortcut(
        PrefillWrapper.RUN_SLOTS, PrefillWrapper.RUN_GIVEN, ("q", "k", "v", "out", "lse"),
        "(_st.cfg, _st.nnz_q, return_lse)", "(_st.cfg.attn.sm_scale, 1.0)", PLAIN_RUN +
        " and o_scale is None and kv_cache_sf is None and sinks is None and "
        "lse_base == 'log2' and lse_layout == 'NH'"))  # fmt: skip
    def run(self, q, k, v, *, q_scale=None, k_scale=None, v_scale=None, o_scale=None, out=None,
            lse=None, return_lse=False, lse_base="log2", lse_layout="NH", enable_pdl=None,
            kv_cache_sf=None, plan_array=None, sinks=None):  # fmt: skip
        """o [nnz_q, Hq, D_vo] (and lse [nnz_q, Hq] float32, base 2, when return_lse); plan_array:
        a plan_array() on the device, read instead of the latest plan (prefill_array.py).
        q_scale and k_scale multiply the logits, v_scale the output (FlashInfer's calibration
        scales); lse_base="ln" / lse_layout="HN": FlashInfer's other LSE forms
        (run_options.py); sinks: [Hq] float32 attention sink logits, as the paged wrapper's
        run() takes them (an rtcinfer extension here); o_scale and kv_cache_sf are not
        supported (raise when given)."""
        if o_scale is not None or kv_cache_sf is not None:
            refuse(o_scale=o_scale, kv_cache_sf=kv_cache_sf)
        return self._run(q, k, v, out, lse, return_lse, q_scale, k_scale, v_scale, plan_array,
                         lse_base, lse_layout, sinks=sinks)  # fmt: skip

    def _check_kv(self, cfg, k, v) -> None:
        attn = cfg.attn
        for name, x, dim in (("k", k, attn.head_dim), ("v", v, cfg.dim_vo)):
            if x is None or x.ndim != 3 or x.shape[1:] != (attn.num_kv_heads, dim) or (
                x.dtype not in kv_storage(attn.kv_dtype)):  # fmt: skip
                raise ValueError(
                    f"{name}: expected shape (nnz_kv, {attn.num_kv_heads}, {dim}) and "
                    f"dtype {attn.kv_dtype}, got {None if x is None else (x.shape, x.dtype)}"
                )
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k {k.shape} and v {v.shape} must have the same rows")

    def _kv_fields(self, k, v, attn: Config) -> dict:
        item = itemsize(k.dtype)
        fields = {}
        for name, x in (("k", k), ("v", v)):
            token, head = x.strides[0] * item, x.strides[1] * item
            check_cache_view(name, x.offset, (x.shape[0], x.shape[1]), (token, head), item,
                             x.strides[2] * item)  # fmt: skip
            fields.update({f"{name}_page": token, f"{name}_token": token, f"{name}_head": head})
        return fields


class BatchPrefillWithPagedKVCacheWrapper(PagedForward, PrefillWrapper):
    """Batch prefill (append) over a paged KV cache, the table as in batch decode:
    request b's keys are the first kv_len_b tokens of pages
    paged_kv_indices[paged_kv_indptr[b]:paged_kv_indptr[b + 1]]."""

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend="auto", jit_args=None, jit_kwargs=None,
                 variant_owns_mask=False):  # fmt: skip
        check_backend(backend, jit_args, jit_kwargs, variant_owns_mask)
        workspace = float_workspace_buffer
        if use_cuda_graph and paged_kv_indices_buf is None:
            raise ValueError(
                "use_cuda_graph=True needs paged_kv_indices_buf: its length fixes the pages"
            )
        max_pages = None if paged_kv_indices_buf is None else paged_kv_indices_buf.shape[0]
        super().__init__(workspace, kv_layout, use_cuda_graph, qo_indptr_buf, max_pages,
                         custom_mask_buf)  # fmt: skip

    def plan(
        self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
        num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None,
        packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
        use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
        rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
        o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
        token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None,
        block_tables=None, max_token_per_sequence=None, max_sequence_kv=None,
        fixed_split_size=None, disable_split_kv=False, uniform_q_len=None,
    ) -> None:  # fmt: skip
        """Validate the batch on the host, plan the work, upload it (one copy).

        FlashInfer 0.7.2's parameters, in its order (PLAN_NOTES in prefill_args.py: what the
        ones without a counterpart here do)."""
        qo = host_ints("qo_indptr", qo_indptr)
        indptr = host_ints("paged_kv_indptr", paged_kv_indptr)
        indices = host_ints("paged_kv_indices", paged_kv_indices, widen=False)
        last = host_ints("paged_kv_last_page_len", paged_kv_last_page_len)
        if indptr.shape != qo.shape:
            raise ValueError(
                f"qo_indptr ({qo.shape[0]} entries) and paged_kv_indptr ({indptr.shape[0]}) must "
                "describe the same batch"
            )
        page = int(page_size) if not isinstance(page_size, bool) else page_size
        _, _, kv_len, _ = _pages_and_lens(indptr, last, max(page, 1))
        indices, max_page = page_table_ids(indices, int(indptr[-1]),
                                           ("paged_kv_indices", "paged_kv_indptr"))  # fmt: skip
        items = (prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        masks, causal = scoring_masks(items, qo, kv_len, (custom_mask, packed_custom_mask),
                                      causal)  # fmt: skip
        args = (num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, pos_encoding_mode,
                window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type, sm_scale,
                rope_scale, rope_theta)  # fmt: skip
        self._plan(qo, kv_len, indptr[:-1], indices, args, masks, fixed_split_size,
                   disable_split_kv, max_page + 1, head_dim_vo)  # fmt: skip

    def workspace_size(
        self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
        num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None,
        packed_custom_mask=None, causal=False, pos_encoding_mode="NONE", sm_scale=None,
        window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
        q_data_type="float16", kv_data_type=None, o_data_type=None, prefix_len_ptr=None,
        token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None,
        seq_lens=None, seq_lens_q=None, block_tables=None, max_token_per_sequence=None,
        max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False, uniform_q_len=None,
    ) -> tuple[int, int]:  # fmt: skip
        """FlashInfer's workspace_size(): (float workspace bytes, int workspace bytes) that
        plan() with these arguments needs (PlannedWrapper._workspace_bytes); this wrapper's
        own plan is unchanged."""
        options = dict(locals())
        del options["self"]
        return self._workspace_bytes(lambda: self.plan(**options))

    @with_shortcut(run_shortcut(
        PrefillWrapper.RUN_SLOTS, PrefillWrapper.RUN_GIVEN, ("q", "_k", "_v", "out", "lse"),
        "(_st.cfg, _st.nnz_q, return_lse)", "(_st.cfg.attn.sm_scale, 1.0)", PLAIN_RUN +
        " and window_left is None and sinks is None and kv_cache_sf is None and "
        "skip_softmax_threshold_scale_factor is None and not uses_spcompress and "
        "lse_base == 'log2' and lse_layout == 'NH'", PAGED_KV, ("_v",)))  # fmt: skip
    def run(self, q, paged_kv_cache, *, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse=False, lse_base="log2", lse_layout="NH", enable_pdl=None,
            window_left=None, sinks=None, kv_cache_sf=None,
            skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None,
            uses_spcompress=None, plan_array=None):  # fmt: skip
        """o [nnz_q, Hq, D_vo] (and lse when return_lse) for q [nnz_q, Hq, D]; the cache as in
        batch decode: one [pages, 2, ...] array or a (k, v) pair (v's last dim D_vo, the plan's
        head_dim_vo: a pair where it differs from D), NHD or HND; plan_array: a
        plan_array() on the device (prefill_array.py). The scales and LSE forms as in the
        ragged wrapper's run(); window_left may repeat the plan's (None: the plan's);
        use_fp16_softmax is a precision hint (the softmax stays fp32); sinks: [Hq] float32
        attention sink logits as in batch decode's run(); kv_cache_sf,
        skip_softmax_threshold_scale_factor and uses_spcompress are not supported (raise when
        given)."""
        if (kv_cache_sf is not None or uses_spcompress
                or skip_softmax_threshold_scale_factor is not None):  # fmt: skip
            refuse(
                kv_cache_sf=kv_cache_sf,
                uses_spcompress=uses_spcompress or None,
                skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
            )
        k, v = kv_pair(paged_kv_cache)
        return self._run(q, k, v, out, lse, return_lse, q_scale, k_scale, v_scale, plan_array,
                         lse_base, lse_layout, window_left, sinks)  # fmt: skip

    def _check_kv(self, cfg, k, v) -> None:
        check_paged_caches(k, v, cfg.attn, self._kv_layout, cfg.dim_vo)

    def _kv_fields(self, k, v, attn: Config) -> dict:
        return paged_cache_fields(k, v, self._kv_layout)


__all__ = ["BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper"]
