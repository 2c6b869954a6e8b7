"""The prefill API's FlashInfer arguments that select nothing here, checked: the backends
(one kernel serves them all), the options with no counterpart (raised), head_dim_vo, and the
CUDA-graph mask buffer (its size reserves room in the workspace)."""

from __future__ import annotations

import numpy as np

from ..interop.arrays import dtype_name

BACKENDS = ("auto", "fa2", "fa3")  # FlashInfer's names; one kernel here serves them all


def check_backend(backend, jit_args=None) -> None:
    """FlashInfer's constructor options that have no counterpart here raise; the backends
    that compute the same thing are accepted."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if jit_args is not None:
        raise ValueError("jit_args (custom attention variants) are not supported")


def unsupported(head_dim_vo, head_dim_qk) -> None:
    if head_dim_vo is not None and head_dim_vo != head_dim_qk:
        raise ValueError(
            f"head_dim_vo ({head_dim_vo}) != head_dim_qk ({head_dim_qk}) is not supported yet"
        )


def mask_capacity_bytes(custom_mask_buf) -> int | None:
    """The packed-mask bytes a CUDA-graph wrapper reserves, from FlashInfer's custom_mask_buf
    (a uint8 device buffer: its size; the mask itself travels in the workspace), or None."""
    if custom_mask_buf is None:
        return None
    if dtype_name(custom_mask_buf) != "uint8":
        raise ValueError(f"custom_mask_buf: expected uint8, got {dtype_name(custom_mask_buf)}")
    return int(np.prod(custom_mask_buf.shape))


__all__ = ["BACKENDS", "check_backend", "mask_capacity_bytes", "unsupported"]
