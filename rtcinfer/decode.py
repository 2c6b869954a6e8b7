"""FlashInfer's `flashinfer.decode` names, so that `from flashinfer.decode import ...` becomes
`from rtcinfer.decode import ...` (the code lives in rtcinfer/attention/)."""

from .attention.decode import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    fast_decode_plan,
)
from .attention.single_decode import single_decode_with_kv_cache

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "fast_decode_plan",
    "single_decode_with_kv_cache",
]
