"""FlashInfer's `flashinfer.sparse` names (rtcinfer/decode.py says why)."""

from .attention.block_sparse import BlockSparseAttentionWrapper

__all__ = ["BlockSparseAttentionWrapper"]
