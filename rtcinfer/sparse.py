"""FlashInfer's `flashinfer.sparse` names (rtcinfer/decode.py says why)."""

from .attention.block_sparse import BlockSparseAttentionWrapper
from .attention.variable_block_sparse import VariableBlockSparseAttentionWrapper

__all__ = ["BlockSparseAttentionWrapper", "VariableBlockSparseAttentionWrapper"]
