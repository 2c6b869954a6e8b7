"""FlashInfer's multi-item scoring in batch prefill: a request is a shared prefix followed by
items (each opened by a delimiter token), and a query of an item sees the prefix and its own
item's keys up to itself, never another item's. Here it becomes the custom mask it defines
(the prefill kernels' custom-mask path), built on the host at plan().

For request b with prefix_len p and pos[t] = token_pos_in_items[b][t - p], the position in its
item of token t >= p (0: a delimiter), query i at key position x = i + kv_len - qo_len sees
key j when
    j <= x  and  (x < p  or  j < p  or  j > x - pos[x])
(a delimiter, pos 0, sees the prefix only); window_left still applies, in the kernel."""

from __future__ import annotations

import numpy as np

from .planned import host_ints


def scoring_masks(items: tuple, qo_indptr: np.ndarray, kv_len: np.ndarray, masks: tuple,
                  causal) -> tuple[tuple, bool]:  # fmt: skip
    """plan()'s (masks, causal) with multi-item scoring applied: `items` is plan()'s
    (prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr); without
    prefix_len_ptr the masks and causal as given. With it, the scoring's boolean mask (causal
    within it) replaces them; a custom mask given too is refused (FlashInfer drops it)."""
    prefix_len_ptr, token_pos_ptr, token_pos_len, _ = items  # max_item_len_ptr: a kernel hint
    if prefix_len_ptr is None:
        if token_pos_ptr is not None or token_pos_len:
            raise ValueError(
                "token_pos_in_items_ptr and token_pos_in_items_len need prefix_len_ptr"
            )
        return masks, causal
    if masks[0] is not None or masks[1] is not None:
        raise ValueError(
            "multi-item scoring (prefix_len_ptr) defines the mask: custom_mask and "
            "packed_custom_mask cannot be given with it"
        )
    batch = kv_len.shape[0]
    prefix = host_ints("prefix_len_ptr", prefix_len_ptr)
    if prefix.shape != (batch,) or (prefix < 0).any():
        raise ValueError(f"prefix_len_ptr: expected {batch} non-negative lengths, got "
                         f"{prefix.shape[0] if prefix.ndim == 1 else prefix.shape}")  # fmt: skip
    if token_pos_ptr is None:
        raise ValueError("multi-item scoring needs token_pos_in_items_ptr")
    width = int(token_pos_len)
    pos = host_ints("token_pos_in_items_ptr", token_pos_ptr).reshape(-1)
    if pos.shape[0] < batch * width:
        raise ValueError(f"token_pos_in_items_ptr: expected {batch} rows of "
                         f"token_pos_in_items_len = {width}, got {pos.shape[0]}")  # fmt: skip
    return (multi_item_mask(np.diff(qo_indptr), kv_len, prefix, pos, width), None), False


def multi_item_mask(qo_len, kv_len, prefix, pos, width: int) -> np.ndarray:
    """The boolean custom mask (each request's qo_len x kv_len block row-major, back to back)
    of multi-item scoring (module docstring); pos: the requests' token_pos_in_items rows of
    `width` entries, back to back."""
    blocks = []
    for b, (qo, kv) in enumerate(zip(qo_len.tolist(), kv_len.tolist(), strict=True)):
        p = int(prefix[b])
        x = np.arange(kv - qo, kv)[:, None]  # the queries' key positions
        j = np.arange(kv)[None, :]
        seen = j <= x
        scored = x[:, 0] >= p  # queries in the items
        if scored.any():
            needed = int(x[-1, 0]) - p + 1
            if needed > width:
                raise ValueError(
                    f"token_pos_in_items_len ({width}) is shorter than request {b}'s items "
                    f"({needed} tokens after its prefix of {p})"
                )
            own = pos[b * width + x[scored, 0] - p][:, None]  # its position in its item
            seen[scored] &= (j < p) | (j > x[scored] - own)
        blocks.append(seen.reshape(-1))
    return np.concatenate(blocks) if blocks else np.zeros(0, np.bool_)


__all__ = ["multi_item_mask", "scoring_masks"]
