"""FlashInfer's BatchAttentionWithAttentionSinkWrapper: batch prefill or decode over a paged
KV cache with attention sinks, FlashInfer's JIT attention variant on Hopper. Here it is the
paged prefill wrapper, whose run() takes the sinks (and the logit scale) after the cache as
that variant's extra arguments: run(q, paged_kv_cache, sinks, sm_scale). The sinks are merged
into the attention state after the kernel (merge_sinks_in_place)."""

from __future__ import annotations

import math

from .prefill import BatchPrefillWithPagedKVCacheWrapper


class BatchAttentionWithAttentionSinkWrapper(BatchPrefillWithPagedKVCacheWrapper):
    """BatchPrefillWithPagedKVCacheWrapper whose run() takes `sinks` ([Hq] float32 logits, one
    more key of value 0 in every row's softmax) and `sm_scale` positionally after the cache.

    The constructor's kernel options (pos_encoding_mode, use_fp16_qk_reduction, the dtypes,
    head dims and window_left, which FlashInfer compiles its variant for) are taken for
    compatibility: plan() sets them here, as for the plain wrapper."""

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend="auto", pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
                 q_data_type="bfloat16", kv_data_type="bfloat16", head_dim_qk=128,
                 head_dim_vo=128, window_left=-1):  # fmt: skip
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf,
                         paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf,
                         custom_mask_buf, mask_indptr_buf, backend)  # fmt: skip

    def run(self, q, paged_kv_cache, sinks=None, sm_scale=None, **options):
        """run(q, paged_kv_cache, sinks, sm_scale) -> o (and lse with return_lse=True), as the
        paged prefill wrapper's run(sinks=sinks, **options). sm_scale, when given, must be
        the plan's (the logits are scaled when planned)."""
        if sm_scale is not None:
            self._check_scale(float(sm_scale))
        return super().run(q, paged_kv_cache, sinks=sinks, **options)

    def _check_scale(self, sm_scale: float) -> None:
        st = self._launch
        if st is None:
            raise RuntimeError("plan() must be called before run()")
        planned = st.cfg.attn.sm_scale
        if not math.isclose(sm_scale, planned, rel_tol=1e-6):
            raise ValueError(
                f"run(sm_scale={sm_scale!r}) differs from the plan's sm_scale ({planned!r}): "
                "plan() with it"
            )


__all__ = ["BatchAttentionWithAttentionSinkWrapper"]
