"""Custom masks of batch prefill, FlashInfer's: `custom_mask` is boolean, request b's
qo_len_b x kv_len_b block row-major (True: the query sees the key), the requests back to back;
`packed_custom_mask` is the same bits as segment_packbits(custom_mask, bit_indptr, "little")
packs them: each request's block on whole bytes of its own. The kernel reads bit
i * kv_len_b + j of request b from its first byte (mask_byte[b])."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..bitpack import segment_packbits
from ..interop.arrays import as_cupy, device_of, dtype_name, framework
from ..plan._checks import INT32_MAX


def mask_layout(qo_len: np.ndarray, kv_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bit_indptr int64[B + 1] of the unpacked mask, mask_byte int64[B + 1]: each request's
    first byte in the packed one, and the total)."""
    bits = qo_len.astype(np.int64) * kv_len
    bit_indptr = np.zeros(bits.shape[0] + 1, np.int64)
    np.cumsum(bits, out=bit_indptr[1:])
    mask_byte = np.zeros_like(bit_indptr)
    np.cumsum((bits + 7) // 8, out=mask_byte[1:])
    return bit_indptr, mask_byte


def _size(x) -> int:
    return int(np.prod(x.shape))


@dataclass(frozen=True)
class PackedMask:
    """A batch's packed custom mask: on the host (`host`, uint8, to travel with the plan) or on
    the device (`device`: its address, `keep`: what keeps it alive); mask_byte: int64[B], each
    request's first byte; nbytes: its bytes."""

    host: np.ndarray | None
    device: int
    keep: object
    mask_byte: np.ndarray
    nbytes: int

    @property
    def ints(self) -> int:
        return -(-self.nbytes // 4)


def packed_mask(custom_mask, packed_custom_mask, qo_len, kv_len, device: int) -> PackedMask:
    """The packed mask of a batch: a boolean custom_mask is packed on its device (or by NumPy
    on the host); a packed one is taken as it is."""
    bit_indptr, mask_byte = mask_layout(qo_len, kv_len)
    nbytes = int(mask_byte[-1])
    if nbytes > INT32_MAX:
        raise ValueError(f"the packed mask would take {nbytes} bytes (at most 2^31)")
    if packed_custom_mask is not None:
        packed, name = packed_custom_mask, "packed_custom_mask"
        if dtype_name(packed) != "uint8" or _size(packed) < nbytes:
            raise ValueError(
                f"packed_custom_mask: expected uint8 with at least {nbytes} bytes (each "
                f"request's qo_len x kv_len bits on whole bytes), got {dtype_name(packed)} "
                f"{tuple(packed.shape)}"
            )
    else:
        name = "custom_mask"
        if dtype_name(custom_mask) != "bool" or _size(custom_mask) != int(bit_indptr[-1]):
            raise ValueError(
                f"custom_mask: expected bool with sum(qo_len * kv_len) = {int(bit_indptr[-1])} "
                f"elements, got {dtype_name(custom_mask)} {tuple(custom_mask.shape)}"
            )
        packed, _ = segment_packbits(custom_mask, bit_indptr, "little")
    if framework(packed) == "numpy":
        host = np.ascontiguousarray(packed, np.uint8).reshape(-1)[:nbytes]
        return PackedMask(host, 0, None, mask_byte[:-1], nbytes)
    if device_of(packed) != device:
        raise ValueError(f"{name} is on device {device_of(packed)}, the plan on device {device}")
    view = as_cupy(packed, name)
    if not view.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous")
    return PackedMask(None, view.data.ptr, (packed, view), mask_byte[:-1], nbytes)


__all__ = ["PackedMask", "mask_layout", "packed_mask"]
