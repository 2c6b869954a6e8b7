"""FlashInfer's `flashinfer.mla` names (rtcinfer/decode.py says why)."""

from .attention.mla import BatchMLAPagedAttentionWrapper

__all__ = ["BatchMLAPagedAttentionWrapper"]
