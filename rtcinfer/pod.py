"""FlashInfer's `flashinfer.pod` names (rtcinfer/decode.py says why)."""

from .attention.pod import BatchPODWithPagedKVCacheWrapper, PODWithPagedKVCacheWrapper

__all__ = ["BatchPODWithPagedKVCacheWrapper", "PODWithPagedKVCacheWrapper"]
