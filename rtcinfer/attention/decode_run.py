"""The arrays of a batch decode run() against its plan's configuration: the checks, and the
DecodeParams fields that depend only on their signature (shared by run() on the wrapper's plan,
attention/decode.py, and run(plan_array=...), attention/decode_array.py)."""

from __future__ import annotations

from .decode_kernel import Config
from .paged_kv import check_paged_caches, paged_cache_fields


def check_run_arrays(q, k, v, cfg: Config, kv_layout: str, batch: int | None) -> None:
    """q [batch (any rows for None), Hq, D] and the cache (5-D, or a k, v pair) against the
    plan's configuration."""
    rows = q.shape[0] if batch is None and q.ndim == 3 else batch
    o_shape = (rows, cfg.num_qo_heads, cfg.head_dim)
    if q.shape != o_shape or q.dtype != cfg.q_dtype:
        raise ValueError(
            f"q: expected shape {o_shape} and dtype {cfg.q_dtype} (the plan), "
            f"got {q.shape} and {q.dtype}"
        )
    check_paged_caches(k, v, cfg, kv_layout)


def run_fields(q, k, v, out, lse, kv_layout: str, cfg: Config) -> dict:
    """The DecodeParams fields of run()'s arrays that depend only on their signature: strides
    (elements for q, o and lse; bytes for the caches), after checking what the kernel needs."""
    fields = paged_cache_fields(k, v, kv_layout)
    o_strides = (
        out.strides if out is not None else (cfg.num_qo_heads * cfg.head_dim, cfg.head_dim, 1)
    )
    lse_strides = lse.strides if lse is not None else (cfg.num_qo_heads, 1)
    if q.strides[2] != 1 or o_strides[2] != 1 or lse_strides[1] != 1:
        raise ValueError(
            f"q, out and lse must be contiguous in their last dimension, got strides (elements) "
            f"q {q.strides}, out {o_strides}, lse {lse_strides}"
        )
    fields.update(q_stride_n=q.strides[0], q_stride_h=q.strides[1], o_stride_n=o_strides[0],
                  o_stride_h=o_strides[1], lse_stride_n=lse_strides[0],
                  num_rows=q.shape[0])  # fmt: skip
    return fields


__all__ = ["check_run_arrays", "run_fields"]
