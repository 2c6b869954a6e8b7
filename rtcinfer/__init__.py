"""rtcinfer: LLM inference kernels compiled at run time by NVRTC, for PyTorch, JAX and CuPy."""

__version__ = "0.1.0"

from . import gpu as _gpu

# On a machine with an NVIDIA device, CuPy (which imports ml_dtypes) and the CUDA bindings load
# with the package, so that the first call does not pay for them (half a second or more);
# elsewhere (planning, the CLI, CI without a GPU) they wait for the first call that needs them
# and `import rtcinfer` stays fast. PyTorch and JAX are never imported here.
if _gpu.nvidia_device_node():
    try:
        import cupy as _cupy  # noqa: F401
        from cuda.bindings import driver as _driver  # noqa: F401
    except ImportError:  # the base install (no CUDA extra): planning and the CLI still work
        pass
from .activation import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul
from .attention.attention_sink import BatchAttentionWithAttentionSinkWrapper
from .attention.batch_attention import BatchAttention
from .attention.block_sparse import BlockSparseAttentionWrapper
from .attention.cascade import (
    merge_sinks_in_place,
    merge_state,
    merge_state_in_place,
    merge_states,
)
from .attention.decode import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    fast_decode_plan,
)
from .attention.mla import BatchMLAPagedAttentionWrapper
from .attention.page import (
    append_paged_kv_cache,
    append_paged_mla_kv_cache,
    get_batch_indices_positions,
    get_seq_lens,
)
from .attention.pod import BatchPODWithPagedKVCacheWrapper, PODWithPagedKVCacheWrapper
from .attention.prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
)
from .attention.shared_prefix import (
    BatchDecodeWithSharedPrefixPagedKVCacheWrapper,
    BatchPrefillWithSharedPrefixPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
)
from .attention.single_decode import single_decode_with_kv_cache
from .attention.single_prefill import (
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)
from .attention.variable_block_sparse import VariableBlockSparseAttentionWrapper
from .bitpack import packbits, segment_packbits
from .errors import BadIndexError, check_errors
from .norm import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_quant,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    layernorm,
    layernorm_quant,
    rmsnorm,
    rmsnorm_quant,
)

__all__ = [
    "BadIndexError",
    "BatchAttention",
    "BatchAttentionWithAttentionSinkWrapper",
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
    "BatchMLAPagedAttentionWrapper",
    "BatchPODWithPagedKVCacheWrapper",
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "BlockSparseAttentionWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "PODWithPagedKVCacheWrapper",
    "VariableBlockSparseAttentionWrapper",
    "append_paged_kv_cache",
    "append_paged_mla_kv_cache",
    "check_errors",
    "get_batch_indices_positions",
    "get_seq_lens",
    "merge_state",
    "merge_sinks_in_place",
    "merge_state_in_place",
    "merge_states",
    "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "packbits",
    "segment_packbits",
    "fast_decode_plan",
    "fused_add_rmsnorm",
    "fused_add_rmsnorm_quant",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "layernorm",
    "layernorm_quant",
    "rmsnorm",
    "rmsnorm_quant",
]
from .rope import (
    apply_llama31_rope,
    apply_llama31_rope_inplace,
    apply_llama31_rope_pos_ids,
    apply_llama31_rope_pos_ids_inplace,
    apply_rope,
    apply_rope_inplace,
    apply_rope_pos_ids,
    apply_rope_pos_ids_inplace,
    apply_rope_with_cos_sin_cache,
    apply_rope_with_cos_sin_cache_inplace,
)
from .rope_quantize import (  # noqa: E402
    mla_rope_quantize_fp8,
    rope_quantize_fp8,
    rope_quantize_fp8_append_paged_kv_cache,
)

__all__ += [
    "apply_llama31_rope",
    "apply_llama31_rope_inplace",
    "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace",
    "apply_rope",
    "apply_rope_inplace",
    "apply_rope_pos_ids",
    "apply_rope_pos_ids_inplace",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "mla_rope_quantize_fp8",
    "rope_quantize_fp8",
    "rope_quantize_fp8_append_paged_kv_cache",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "silu_and_mul",
]
from . import sampling  # noqa: E402
from .sampling import (  # noqa: E402
    Generator,
    chain_speculative_sampling,
    min_p_sampling_from_probs,
    sampling_from_logits,
    sampling_from_probs,
    softmax,
    top_k,
    top_k_mask_logits,
    top_k_renorm_probs,
    top_k_sampling_from_probs,
    top_k_top_p_sampling_from_logits,
    top_k_top_p_sampling_from_probs,
    top_p_renorm_probs,
    top_p_sampling_from_probs,
)

__all__ += [
    "Generator",
    "chain_speculative_sampling",
    "min_p_sampling_from_probs",
    "sampling",
    "sampling_from_logits",
    "sampling_from_probs",
    "softmax",
    "top_k",
    "top_k_mask_logits",
    "top_k_renorm_probs",
    "top_k_sampling_from_probs",
    "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs",
    "top_p_renorm_probs",
    "top_p_sampling_from_probs",
]
