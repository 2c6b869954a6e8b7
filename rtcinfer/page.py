"""FlashInfer's `flashinfer.page` names (rtcinfer/decode.py says why)."""

from .attention.page import (
    append_paged_kv_cache,
    append_paged_mla_kv_cache,
    get_batch_indices_positions,
    get_seq_lens,
)

__all__ = [
    "append_paged_kv_cache",
    "append_paged_mla_kv_cache",
    "get_batch_indices_positions",
    "get_seq_lens",
]
