"""rtcinfer's public API against FlashInfer 0.7.2's, from the signatures recorded below (read
from flashinfer-python 0.7.2.post1's sources): every FlashInfer parameter is accepted under its
name, FlashInfer's positional parameters are positional here in the same order (a call written
for FlashInfer binds each argument to the same parameter), and the wrappers have FlashInfer's
methods."""

import importlib
import inspect

import pytest

import rtcinfer

# name -> (positional parameters, keyword-only parameters); the decode plan's keywords are those
# its **kwargs take.
# fmt: off
FLASHINFER_0_7_2 = {
    "BatchDecodeWithPagedKVCacheWrapper.workspace_size": (
        ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim",
         "page_size", "pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type",
         "kv_data_type", "o_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta",
         "block_tables", "seq_lens", "fixed_split_size", "disable_split_kv", "q_len_per_req"),
        (),
    ),
    "BatchPrefillWithPagedKVCacheWrapper.workspace_size": (
        ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
         "num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size", "head_dim_vo", "custom_mask",
         "packed_custom_mask", "causal", "pos_encoding_mode", "sm_scale", "window_left",
         "logits_soft_cap", "rope_scale", "rope_theta", "q_data_type", "kv_data_type",
         "o_data_type", "prefix_len_ptr", "token_pos_in_items_ptr", "token_pos_in_items_len",
         "max_item_len_ptr", "seq_lens", "seq_lens_q", "block_tables", "max_token_per_sequence",
         "max_sequence_kv", "fixed_split_size", "disable_split_kv", "uniform_q_len"),
        (),
    ),
    "BatchMLAPagedAttentionWrapper.__init__": (
        ("float_workspace_buffer", "use_cuda_graph", "qo_indptr", "kv_indptr", "kv_indices",
         "kv_len_arr", "backend"),
        (),
    ),
    "BatchMLAPagedAttentionWrapper.plan": (
        ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv",
         "head_dim_kpe", "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type",
         "use_profiler"),
        ("query_layout", "kv_cache_layout", "lse_mode", "output_dtype", "output_scale",
         "scale_mode", "skip_softmax", "enable_pdl", "use_sinks"),
    ),
    "BatchMLAPagedAttentionWrapper.run": (
        ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "out", "lse", "return_lse",
         "profiler_buffer", "kv_len", "page_table", "return_lse_base_on_e", "o_scale"),
        ("query", "kv_cache", "ckv_scale", "ckv_scale_arr", "kpe_scale", "sinks",
         "skip_softmax_threshold_scale_factor", "bmm1_scale", "bmm2_scale"),
    ),
    "PODWithPagedKVCacheWrapper.__init__": (
        ("float_workspace_buffer", "kv_layout", "use_cuda_graph", "paged_kv_indptr_buffer",
         "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer", "jit_args"),
        (),
    ),
    "PODWithPagedKVCacheWrapper.plan": (
        ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim",
         "page_size", "pos_encoding_mode", "window_left", "q_data_type", "kv_data_type",
         "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking"),
        (),
    ),
    "PODWithPagedKVCacheWrapper.run": (
        ("q_p", "k_p", "v_p", "q_d", "paged_kv_cache_d", "custom_mask_p", "packed_custom_mask_p",
         "causal_p", "kv_layout_p", "pos_encoding_mode_p", "sm_scale_p", "window_left_p",
         "rope_scale_p", "rope_theta_p", "return_lse_p", "custom_mask_d", "packed_custom_mask_d",
         "causal_d", "kv_layout_d", "pos_encoding_mode_d", "sm_scale_d", "window_left_d",
         "rope_scale_d", "rope_theta_d", "q_scale", "k_scale", "v_scale", "return_lse_d",
         "use_fp16_qk_reduction", "enable_pdl"),
        (),
    ),
    "BatchPODWithPagedKVCacheWrapper.__init__": (("float_workspace_buffer", "kv_layout"), ()),
    "BatchPODWithPagedKVCacheWrapper.plan": (
        ("qo_indptr_p", "kv_indptr_p", "kv_indices_p", "last_page_len_p", "qo_indptr_d",
         "kv_indptr_d", "kv_indices_d", "last_page_len_d", "num_qo_heads", "num_kv_heads",
         "head_dim", "page_size", "pos_encoding_mode", "window_left", "q_data_type",
         "kv_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking"),
        (),
    ),
    "BatchPODWithPagedKVCacheWrapper.run": (
        ("q_p", "paged_kv_cache_p", "q_d", "paged_kv_cache_d", "custom_mask_p",
         "packed_custom_mask_p", "causal_p", "q_scale", "k_scale", "v_scale", "return_lse",
         "use_fp16_qk_reduction", "enable_pdl"),
        (),
    ),
    "BlockSparseAttentionWrapper.__init__": (
        ("float_workspace_buffer", "backend"),
        (),
    ),
    "BlockSparseAttentionWrapper.plan": (
        ("indptr", "indices", "M", "N", "R", "C", "num_qo_heads", "num_kv_heads", "head_dim",
         "mask", "packed_mask", "causal", "pos_encoding_mode", "use_fp16_qk_reduction",
         "logits_soft_cap", "sm_scale", "rope_scale", "rope_theta", "q_data_type",
         "kv_data_type", "o_data_type", "non_blocking", "block_mask", "kv_block_lens",
         "q2k_indices", "q2k_num", "kv_splits", "use_clc", "q_scale", "k_scale", "v_scale"),
        (),
    ),
    "BlockSparseAttentionWrapper.run": (
        ("q", "k", "v", "scale_q", "scale_k", "scale_v", "out", "lse", "return_lse",
         "enable_pdl"),
        (),
    ),
    "BlockSparseAttentionWrapper.forward": (
        ("q", "k", "v", "scale_q", "scale_k", "scale_v", "pos_encoding_mode",
         "use_fp16_qk_reduction", "logits_soft_cap", "sm_scale", "rope_scale", "rope_theta"),
        (),
    ),
    "VariableBlockSparseAttentionWrapper.__init__": (
        ("float_workspace_buffer", "backend"),
        (),
    ),
    "VariableBlockSparseAttentionWrapper.plan": (
        ("block_mask_map", "block_row_sz", "block_col_sz", "num_qo_heads", "num_kv_heads",
         "head_dim", "causal", "pos_encoding_mode", "use_fp16_qk_reduction", "logits_soft_cap",
         "sm_scale", "rope_scale", "rope_theta", "non_blocking", "q_data_type", "kv_data_type"),
        (),
    ),
    "VariableBlockSparseAttentionWrapper.run": (
        ("q", "k", "v", "out", "lse", "return_lse", "enable_pdl"),
        (),
    ),
    "VariableBlockSparseAttentionWrapper.forward": (
        ("q", "k", "v", "pos_encoding_mode", "use_fp16_qk_reduction", "logits_soft_cap",
         "sm_scale", "rope_scale", "rope_theta"),
        (),
    ),
    "fast_decode_plan": (
        ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim",
         "page_size", "pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type",
         "kv_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking",
         "fixed_split_size", "disable_split_kv", "q_len_per_req", "global_override_indptr_cpu"),
        (),
    ),
    "BatchAttention.__init__": (("kv_layout", "device"), ()),
    "BatchAttention.plan": (
        ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_qo_heads", "num_kv_heads",
         "head_dim_qk", "head_dim_vo", "page_size", "causal", "sm_scale", "logits_soft_cap",
         "q_data_type", "kv_data_type", "use_profiler"),
        (),
    ),
    "BatchAttention.run": (
        ("q", "kv_cache", "out", "lse", "k_scale", "v_scale", "logits_soft_cap",
         "profiler_buffer", "kv_cache_sf"),
        (),
    ),
    "BatchAttentionWithAttentionSinkWrapper.__init__": (
        ("float_workspace_buffer", "kv_layout", "use_cuda_graph", "qo_indptr_buf",
         "paged_kv_indptr_buf", "paged_kv_indices_buf", "paged_kv_last_page_len_buf",
         "custom_mask_buf", "mask_indptr_buf", "backend", "pos_encoding_mode",
         "use_fp16_qk_reduction", "q_data_type", "kv_data_type", "head_dim_qk", "head_dim_vo",
         "window_left"),
        (),
    ),
    "BatchDecodeWithPagedKVCacheWrapper.__init__": (
        ("float_workspace_buffer", "kv_layout", "use_cuda_graph", "use_tensor_cores",
         "paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer",
         "backend", "jit_args"),
        (),
    ),
    "BatchDecodeWithPagedKVCacheWrapper.plan": (
        ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim",
         "page_size"),
        ("pos_encoding_mode", "window_left", "window_right", "logits_soft_cap", "q_data_type",
         "kv_data_type", "o_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta",
         "non_blocking", "block_tables", "seq_lens", "fixed_split_size", "disable_split_kv",
         "q_len_per_req", "is_causal"),
    ),
    "BatchDecodeWithPagedKVCacheWrapper.run": (
        ("q", "paged_kv_cache"),
        ("q_scale", "k_scale", "v_scale", "out", "lse", "return_lse", "enable_pdl", "window_left",
         "sinks", "q_len_per_req", "skip_softmax_threshold_scale_factor", "kv_cache_sf"),
    ),
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper.__init__": (
        ("float_workspace_buffer", "kv_layout"),
        (),
    ),
    "BatchPrefillWithPagedKVCacheWrapper.__init__": (
        ("float_workspace_buffer", "kv_layout", "use_cuda_graph", "qo_indptr_buf",
         "paged_kv_indptr_buf", "paged_kv_indices_buf", "paged_kv_last_page_len_buf",
         "custom_mask_buf", "mask_indptr_buf", "backend", "jit_args", "jit_kwargs",
         "variant_owns_mask"),
        (),
    ),
    "BatchPrefillWithPagedKVCacheWrapper.plan": (
        ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
         "num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size", "head_dim_vo", "custom_mask",
         "packed_custom_mask", "causal", "pos_encoding_mode", "use_fp16_qk_reduction", "sm_scale",
         "window_left", "logits_soft_cap", "rope_scale", "rope_theta", "q_data_type",
         "kv_data_type", "o_data_type", "non_blocking", "prefix_len_ptr", "token_pos_in_items_ptr",
         "token_pos_in_items_len", "max_item_len_ptr", "seq_lens", "seq_lens_q", "block_tables",
         "max_token_per_sequence", "max_sequence_kv", "fixed_split_size", "disable_split_kv",
         "uniform_q_len"),
        (),
    ),
    "BatchPrefillWithPagedKVCacheWrapper.run": (
        ("q", "paged_kv_cache"),
        ("q_scale", "k_scale", "v_scale", "out", "lse", "return_lse", "lse_base", "lse_layout",
         "enable_pdl", "window_left", "sinks", "kv_cache_sf",
         "skip_softmax_threshold_scale_factor", "use_fp16_softmax", "uses_spcompress"),
    ),
    "BatchPrefillWithRaggedKVCacheWrapper.__init__": (
        ("float_workspace_buffer", "kv_layout", "use_cuda_graph", "qo_indptr_buf",
         "kv_indptr_buf", "custom_mask_buf", "mask_indptr_buf", "backend", "jit_args",
         "jit_kwargs", "variant_owns_mask"),
        (),
    ),
    "BatchPrefillWithRaggedKVCacheWrapper.plan": (
        ("qo_indptr", "kv_indptr", "num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_vo",
         "custom_mask", "packed_custom_mask", "causal", "pos_encoding_mode",
         "use_fp16_qk_reduction", "window_left", "logits_soft_cap", "sm_scale", "rope_scale",
         "rope_theta", "q_data_type", "kv_data_type", "o_data_type", "non_blocking",
         "prefix_len_ptr", "token_pos_in_items_ptr", "token_pos_in_items_len", "max_item_len_ptr",
         "fixed_split_size", "disable_split_kv", "seq_lens", "seq_lens_q",
         "max_token_per_sequence", "max_sequence_kv", "v_indptr", "o_indptr", "uniform_q_len"),
        (),
    ),
    "BatchPrefillWithRaggedKVCacheWrapper.run": (
        ("q", "k", "v"),
        ("out", "lse", "return_lse", "lse_base", "lse_layout", "enable_pdl", "kv_cache_sf"),
    ),
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper.__init__": (
        ("float_workspace_buffer", "kv_layout"),
        (),
    ),
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper.__init__": (
        ("workspace_buffer", "indptr_buffer", "indices_buffer", "last_page_len_buffer",
         "kv_layout", "use_tensor_cores"),
        (),
    ),
    "MultiLevelCascadeAttentionWrapper.__init__": (
        ("num_levels", "float_workspace_buffer", "kv_layout", "use_cuda_graph",
         "qo_indptr_buf_arr", "paged_kv_indptr_buf_arr", "paged_kv_indices_buf_arr",
         "paged_kv_last_page_len_buf_arr"),
        (),
    ),
    "MultiLevelCascadeAttentionWrapper.plan": (
        ("qo_indptr_arr", "paged_kv_indptr_arr", "paged_kv_indices_arr", "paged_kv_last_page_len",
         "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "causal", "pos_encoding_mode",
         "use_fp16_qk_reduction", "sm_scale", "window_left", "logits_soft_cap", "rope_scale",
         "rope_theta", "q_data_type", "kv_data_type"),
        (),
    ),
    "MultiLevelCascadeAttentionWrapper.run": (
        ("q", "paged_kv_cache"),
        (),
    ),
    "append_paged_mla_kv_cache": (
        ("append_ckv", "append_kpe", "batch_indices", "positions", "ckv_cache", "kpe_cache",
         "kv_indices", "kv_indptr", "kv_last_page_len"),
        (),
    ),
    "append_paged_kv_cache": (
        ("append_key", "append_value", "batch_indices", "positions", "paged_kv_cache",
         "kv_indices", "kv_indptr", "kv_last_page_len", "kv_layout"),
        (),
    ),
    "apply_llama31_rope": (
        ("q", "k", "indptr", "offsets", "rotary_dim", "interleave", "rope_scale", "rope_theta",
         "low_freq_factor", "high_freq_factor", "old_context_len"),
        (),
    ),
    "apply_llama31_rope_inplace": (
        ("q", "k", "indptr", "offsets", "rotary_dim", "interleave", "rope_scale", "rope_theta",
         "low_freq_factor", "high_freq_factor", "old_context_len"),
        (),
    ),
    "apply_llama31_rope_pos_ids": (
        ("q", "k", "pos_ids", "rotary_dim", "interleave", "rope_scale", "rope_theta",
         "low_freq_factor", "high_freq_factor", "old_context_len"),
        (),
    ),
    "apply_llama31_rope_pos_ids_inplace": (
        ("q", "k", "pos_ids", "rotary_dim", "interleave", "rope_scale", "rope_theta",
         "low_freq_factor", "high_freq_factor", "old_context_len"),
        (),
    ),
    "apply_rope": (
        ("q", "k", "indptr", "offsets", "rotary_dim", "interleave", "rope_scale", "rope_theta"),
        (),
    ),
    "apply_rope_inplace": (
        ("q", "k", "indptr", "offsets", "rotary_dim", "interleave", "rope_scale", "rope_theta"),
        (),
    ),
    "apply_rope_pos_ids": (
        ("q", "k", "pos_ids", "rotary_dim", "interleave", "rope_scale", "rope_theta"),
        (),
    ),
    "apply_rope_pos_ids_inplace": (
        ("q", "k", "pos_ids", "rotary_dim", "interleave", "rope_scale", "rope_theta"),
        (),
    ),
    "apply_rope_with_cos_sin_cache": (
        ("positions", "query", "key", "head_size", "cos_sin_cache", "is_neox"),
        (),
    ),
    "apply_rope_with_cos_sin_cache_inplace": (
        ("positions", "query", "key", "head_size", "cos_sin_cache", "is_neox"),
        (),
    ),
    "rope_quantize_fp8": (
        ("q_rope", "k_rope", "q_nope", "k_nope", "cos_sin_cache", "pos_ids", "is_neox",
         "quantize_dtype", "quant_scale_q", "quant_scale_kv", "q_rope_out", "k_rope_out",
         "q_nope_out", "k_nope_out", "enable_pdl", "backend"),
        (),
    ),
    "mla_rope_quantize_fp8": (
        ("q_rope", "k_rope", "q_nope", "k_nope", "cos_sin_cache", "pos_ids", "is_neox",
         "quantize_dtype", "quant_scale_q", "quant_scale_kv", "q_rope_out", "k_rope_out",
         "q_nope_out", "k_nope_out", "enable_pdl"),
        (),
    ),
    "rope_quantize_fp8_append_paged_kv_cache": (
        ("q_rope", "k_rope", "q_nope", "k_nope", "v", "cos_sin_cache", "pos_ids",
         "paged_kv_cache", "kv_indices", "kv_indptr", "batch_indices", "positions", "is_neox",
         "quantize_dtype", "quant_scale_q", "quant_scale_kv", "page_size", "kv_layout",
         "q_rope_out", "q_nope_out", "enable_pdl"),
        (),
    ),
    "chain_speculative_sampling": (
        ("draft_probs", "draft_token_ids", "target_probs", "maybe_output_accepted_token_num",
         "maybe_output_emitted_draft_token_num", "deterministic", "generator", "seed", "offset"),
        (),
    ),
    "fused_add_rmsnorm": (
        ("input", "residual", "weight", "eps", "enable_pdl"),
        (),
    ),
    "fused_add_rmsnorm_quant": (
        ("out", "input", "residual", "weight", "scale", "eps", "enable_pdl"),
        (),
    ),
    "gelu_and_mul": (
        ("input", "out", "enable_pdl"),
        (),
    ),
    "gelu_tanh_and_mul": (
        ("input", "out", "enable_pdl"),
        (),
    ),
    "gemma_fused_add_rmsnorm": (
        ("input", "residual", "weight", "eps", "enable_pdl"),
        (),
    ),
    "gemma_rmsnorm": (
        ("input", "weight", "eps", "out", "enable_pdl"),
        (),
    ),
    "get_batch_indices_positions": (
        ("append_indptr", "seq_lens", "nnz", "batch_indices", "positions"),
        (),
    ),
    "get_seq_lens": (
        ("kv_indptr", "kv_last_page_len", "page_size"),
        (),
    ),
    "layernorm": (
        ("input", "gemma", "beta", "eps"),
        (),
    ),
    "merge_state": (
        ("v_a", "s_a", "v_b", "s_b"),
        (),
    ),
    "merge_state_in_place": (
        ("v", "s", "v_other", "s_other", "mask"),
        (),
    ),
    "merge_states": (
        ("v", "s"),
        (),
    ),
    "min_p_sampling_from_probs": (
        ("probs", "min_p", "indices", "deterministic", "generator", "check_nan", "seed", "offset",
         "return_valid"),
        (),
    ),
    "packbits": (
        ("x", "bitorder"),
        (),
    ),
    "rmsnorm": (
        ("input", "weight", "eps", "out", "enable_pdl"),
        (),
    ),
    "rmsnorm_quant": (
        ("out", "input", "weight", "scale", "eps", "enable_pdl"),
        (),
    ),
    "sampling_from_logits": (
        ("logits", "indices", "deterministic", "generator", "check_nan", "seed", "offset"),
        (),
    ),
    "sampling_from_probs": (
        ("probs", "indices", "deterministic", "generator", "check_nan", "seed", "offset",
         "return_valid"),
        (),
    ),
    "segment_packbits": (
        ("x", "indptr", "bitorder"),
        (),
    ),
    "silu_and_mul": (
        ("input", "out", "enable_pdl"),
        (),
    ),
    "single_decode_with_kv_cache": (
        ("q", "k", "v", "kv_layout", "pos_encoding_mode", "use_tensor_cores", "q_scale",
         "k_scale", "v_scale", "window_left", "logits_soft_cap", "sm_scale", "rope_scale",
         "rope_theta", "return_lse"),
        (),
    ),
    "single_prefill_with_kv_cache": (
        ("q", "k", "v", "scale_q", "scale_k", "scale_v", "o_dtype", "custom_mask",
         "packed_custom_mask", "causal", "kv_layout", "pos_encoding_mode", "use_fp16_qk_reduction",
         "sm_scale", "window_left", "logits_soft_cap", "rope_scale", "rope_theta", "backend",
         "return_lse", "kv_cache_sf", "k_scale", "v_scale"),
        (),
    ),
    "softmax": (
        ("logits", "temperature", "enable_pdl"),
        (),
    ),
    "top_k_mask_logits": (
        ("logits", "top_k"),
        (),
    ),
    "top_k_renorm_probs": (
        ("probs", "top_k", "is_deterministic"),
        (),
    ),
    "top_k_sampling_from_probs": (
        ("probs", "top_k", "indices", "deterministic", "generator", "check_nan", "seed", "offset",
         "return_valid"),
        (),
    ),
    "top_k_top_p_sampling_from_logits": (
        ("logits", "top_k", "top_p", "indices", "filter_apply_order", "deterministic",
         "generator", "check_nan", "seed", "offset"),
        (),
    ),
    "top_k_top_p_sampling_from_probs": (
        ("probs", "top_k", "top_p", "indices", "filter_apply_order", "deterministic", "generator",
         "check_nan", "seed", "offset", "return_valid"),
        (),
    ),
    "top_p_renorm_probs": (
        ("probs", "top_p", "is_deterministic"),
        (),
    ),
    "top_p_sampling_from_probs": (
        ("probs", "top_p", "indices", "deterministic", "generator", "check_nan", "seed", "offset",
         "return_valid"),
        (),
    ),
}

# class -> its public methods and attributes
FLASHINFER_0_7_2_METHODS = {
    "BatchAttention": ("plan", "prewarm_paged_kv_stride_variant", "run"),
    "BlockSparseAttentionWrapper": ("begin_forward", "forward", "plan", "reset_workspace_buffer",
                                    "run"),
    "VariableBlockSparseAttentionWrapper": ("forward", "plan", "reset_workspace_buffer", "run"),
    "BatchDecodeWithPagedKVCacheWrapper": (
        "begin_forward", "forward", "forward_return_lse", "is_cuda_graph_enabled", "plan",
        "prewarm_paged_kv_stride_variant", "reset_workspace_buffer", "resolved_backend", "run",
        "run_return_lse", "use_tensor_cores", "workspace_size"
    ),
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper": (
        "begin_forward", "forward", "reset_workspace_buffer"
    ),
    "BatchPrefillWithPagedKVCacheWrapper": (
        "begin_forward", "forward", "forward_return_lse", "is_cuda_graph_enabled", "plan",
        "prewarm_paged_kv_stride_variant", "reset_workspace_buffer", "run", "run_return_lse",
        "workspace_size"
    ),
    "BatchPrefillWithRaggedKVCacheWrapper": (
        "begin_forward", "forward", "forward_return_lse", "is_cuda_graph_enabled", "plan",
        "reset_workspace_buffer", "run", "run_return_lse"
    ),
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper": (
        "begin_forward", "forward", "prewarm_paged_kv_stride_variant", "reset_workspace_buffer"
    ),
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper": (),
    "BatchMLAPagedAttentionWrapper": ("plan", "run"),
    "PODWithPagedKVCacheWrapper": ("begin_forward", "is_cuda_graph_enabled", "plan",
                                   "reset_workspace_buffer", "run"),
    "BatchPODWithPagedKVCacheWrapper": ("begin_forward", "is_cuda_graph_enabled", "plan", "run"),
    "MultiLevelCascadeAttentionWrapper": (
        "begin_forward", "forward", "is_cuda_graph_enabled", "plan",
        "prewarm_paged_kv_stride_variant", "reset_workspace_buffer", "run"
    ),
}

# FlashInfer module -> the names rtcinfer has of it (`from flashinfer.<module> import ...`)
FLASHINFER_0_7_2_MODULES = {
    "activation": ("gelu_and_mul", "gelu_tanh_and_mul", "silu_and_mul"),
    "attention": ("BatchAttention", "BatchAttentionWithAttentionSinkWrapper"),
    "cascade": ("BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
                "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
                "MultiLevelCascadeAttentionWrapper", "merge_state", "merge_state_in_place",
                "merge_states"),
    "decode": ("BatchDecodeWithPagedKVCacheWrapper",
               "CUDAGraphBatchDecodeWithPagedKVCacheWrapper", "fast_decode_plan",
               "single_decode_with_kv_cache"),
    "norm": ("fused_add_rmsnorm", "fused_add_rmsnorm_quant", "gemma_fused_add_rmsnorm",
             "gemma_rmsnorm", "layernorm", "rmsnorm", "rmsnorm_quant"),
    "page": ("append_paged_kv_cache", "append_paged_mla_kv_cache", "get_batch_indices_positions",
             "get_seq_lens"),
    "prefill": ("BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
                "single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse"),
    "mla": ("BatchMLAPagedAttentionWrapper",),
    "pod": ("BatchPODWithPagedKVCacheWrapper", "PODWithPagedKVCacheWrapper"),
    "quantization": ("packbits", "segment_packbits"),
    "sparse": ("BlockSparseAttentionWrapper", "VariableBlockSparseAttentionWrapper"),
    "rope": ("apply_llama31_rope", "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids",
             "apply_llama31_rope_pos_ids_inplace", "apply_rope", "apply_rope_inplace",
             "apply_rope_pos_ids", "apply_rope_pos_ids_inplace", "apply_rope_with_cos_sin_cache",
             "apply_rope_with_cos_sin_cache_inplace", "mla_rope_quantize_fp8", "rope_quantize_fp8",
             "rope_quantize_fp8_append_paged_kv_cache"),
    "sampling": ("chain_speculative_sampling", "min_p_sampling_from_probs",
                 "sampling_from_logits", "sampling_from_probs", "softmax", "top_k_mask_logits",
                 "top_k_renorm_probs", "top_k_sampling_from_probs",
                 "top_k_top_p_sampling_from_logits", "top_k_top_p_sampling_from_probs",
                 "top_p_renorm_probs", "top_p_sampling_from_probs"),
}
# fmt: on


def _ours(name: str):
    owner, _, method = name.partition(".")
    obj = getattr(rtcinfer, owner)
    return getattr(obj, method) if method else obj


def _parameters(fn) -> tuple[list[str], set[str]]:
    """(positional-or-keyword names in order, every name a call may pass by keyword)."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return positional, named


@pytest.mark.parametrize("name", sorted(FLASHINFER_0_7_2))
def test_flashinfer_calls_bind_the_same_parameters(name):
    positional, keywords = FLASHINFER_0_7_2[name]
    fn = _ours(name)
    ours, named = _parameters(fn)
    if name == "BatchDecodeWithPagedKVCacheWrapper.plan":  # **kwargs, as FlashInfer's: _plan's
        _, named = _parameters(rtcinfer.BatchDecodeWithPagedKVCacheWrapper._plan)
    assert ours[: len(positional)] == list(positional), f"{name}: positional order"
    missing = (set(positional) | set(keywords)) - named
    assert not missing, f"{name} does not take {sorted(missing)}"


@pytest.mark.parametrize("cls", sorted(FLASHINFER_0_7_2_METHODS))
def test_wrappers_have_flashinfer_methods(cls):
    ours = getattr(rtcinfer, cls)
    missing = [m for m in FLASHINFER_0_7_2_METHODS[cls] if not hasattr(ours, m)]
    assert not missing, f"{cls} lacks {missing}"


def test_decode_plan_takes_flashinfer_deprecated_positional_options(monkeypatch):
    """plan(..., page_size, "NONE", -1, None, "bfloat16") binds as FlashInfer 0.7.2 binds it;
    more than its 16 such arguments, or one given twice, is a TypeError."""
    seen = {}
    monkeypatch.setattr(rtcinfer.BatchDecodeWithPagedKVCacheWrapper, "_plan",
                        lambda self, *a, **kw: seen.update(kw))  # fmt: skip
    wrapper = object.__new__(rtcinfer.BatchDecodeWithPagedKVCacheWrapper)
    wrapper.plan([0, 1], [0], [1], 8, 8, 128, 16, "NONE", -1, None, "bfloat16", sm_scale=0.1)
    assert seen == {"pos_encoding_mode": "NONE", "window_left": -1, "logits_soft_cap": None,
                    "q_data_type": "bfloat16", "sm_scale": 0.1}  # fmt: skip
    with pytest.raises(TypeError, match="multiple values for argument 'window_left'"):
        wrapper.plan([0, 1], [0], [1], 8, 8, 128, 16, "NONE", -1, window_left=3)
    with pytest.raises(TypeError, match="at most 16"):
        wrapper.plan([0, 1], [0], [1], 8, 8, 128, 16, *([None] * 17))


@pytest.mark.parametrize("module", sorted(FLASHINFER_0_7_2_MODULES))
def test_flashinfer_module_paths(module):
    """`from flashinfer.<module> import name` works as `from rtcinfer.<module> import name`."""
    ours = importlib.import_module(f"rtcinfer.{module}")
    for name in FLASHINFER_0_7_2_MODULES[module]:
        assert getattr(ours, name) is getattr(rtcinfer, name), f"rtcinfer.{module}.{name}"


def test_resolved_backend_names_the_kernel_family():
    """FlashInfer's names: the CUDA-core decode "fa2"; the tensor-core route the prefill
    kernel's family ("fa3": warpgroup MMAs, "fa2": mma.sync), "auto" before a plan; a backend
    given by name reports itself."""
    from types import SimpleNamespace

    wrapper = object.__new__(rtcinfer.BatchDecodeWithPagedKVCacheWrapper)
    wrapper._backend, wrapper._tc = "auto", None
    assert wrapper.resolved_backend == "fa2"
    wrapper._tc = SimpleNamespace(_launch=None)
    assert wrapper.resolved_backend == "auto"
    for wgmma, name in ((True, "fa3"), (False, "fa2")):
        spec = SimpleNamespace(wgmma=wgmma)
        wrapper._tc._launch = SimpleNamespace(
            launch=SimpleNamespace(kernel=SimpleNamespace(spec=spec))
        )
        assert wrapper.resolved_backend == name
    wrapper._backend = "fa2"
    assert wrapper.resolved_backend == "fa2"
