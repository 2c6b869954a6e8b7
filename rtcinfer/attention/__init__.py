"""Attention over paged and contiguous KV caches: batch and single decode and prefill,
block-sparse attention on the paged prefill, the merge of attention states (cascade, attention
sinks), and the paged cache's bookkeeping (append, lengths, positions). As a module it also
holds FlashInfer's `flashinfer.attention` names (BatchAttention,
BatchAttentionWithAttentionSinkWrapper)."""


def __getattr__(name: str):
    """FlashInfer's `flashinfer.attention` names, imported when first asked for."""
    if name == "BatchAttention":
        from .batch_attention import BatchAttention

        return BatchAttention
    if name == "BatchAttentionWithAttentionSinkWrapper":
        from .attention_sink import BatchAttentionWithAttentionSinkWrapper

        return BatchAttentionWithAttentionSinkWrapper
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
