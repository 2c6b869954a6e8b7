"""Attention over paged and contiguous KV caches: batch and single decode, the merge of
attention states (cascade), and the paged cache's bookkeeping (append, lengths, positions)."""
