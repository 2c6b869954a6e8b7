"""FlashInfer's `flashinfer.prefill` names (rtcinfer/decode.py says why)."""

from .attention.prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
)
from .attention.single_prefill import (
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)

__all__ = [
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
]
