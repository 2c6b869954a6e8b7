"""The prefill API's arguments checked: plan()'s made into a PrefillConfig, FlashInfer's that
select nothing here (the backends, one kernel serving them all; PLAN_NOTES; the options with no
counterpart, raised), the CUDA-graph mask buffer (its size reserves room in the
workspace), and run()'s q, out and lse strides (io_fields)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..interop.arrays import dtype_name
from .decode_kernel import HEAD_DIMS, Config, keeps_hash, make_config
from .prefill_kernel import DIM_PAIRS, check_dims
from .run_options import refuse


@keeps_hash
@dataclass(frozen=True)
class PrefillConfig:
    """The static part of a prefill plan: decode's Config (page_size: the paged cache's, or
    RAGGED_PAGE) and the mask: causal, or a custom one (which replaces it, as FlashInfer's);
    head_dim_vo: v's and o's head_dim where it is not q's and k's (attn.head_dim), else None;
    mla: MLA's kernel (attention/mla.py: attn's one kv head takes all the heads, v is the
    keys' first head_dim_vo dims)."""

    attn: Config
    causal: bool
    custom_mask: bool = False
    head_dim_vo: int | None = None
    mla: bool = False

    @property
    def dim_vo(self) -> int:
        """v's and o's head_dim."""
        return self.attn.head_dim if self.head_dim_vo is None else self.head_dim_vo


def make_prefill_config(num_qo_heads, num_kv_heads, head_dim, page_size, causal,
                        pos_encoding_mode, window_left, logits_soft_cap, q_dtype, kv_dtype,
                        o_dtype, sm_scale, rope_scale, rope_theta, custom_mask=False,
                        head_dim_vo=None) -> PrefillConfig:  # fmt: skip
    """plan()'s static arguments checked (head_dim: q's and k's; head_dim_vo: v's, None for
    the same: prefill_kernel.check_dims)."""
    if head_dim_vo is not None:
        if isinstance(head_dim_vo, bool) or not isinstance(head_dim_vo, (int, np.integer)):
            raise TypeError(f"head_dim_vo must be an int or None, got {head_dim_vo!r}")
        head_dim_vo = None if head_dim_vo == head_dim else int(head_dim_vo)
    # q's and k's head_dim: the usual ones, or a pair's beside v's fewer
    qk_dims = HEAD_DIMS if head_dim_vo is None else HEAD_DIMS + tuple(qk for qk, _ in DIM_PAIRS)
    attn = make_config(num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode,
                       window_left, logits_soft_cap, q_dtype, kv_dtype, o_dtype, sm_scale,
                       rope_scale, rope_theta, qk_dims)  # fmt: skip
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    check_dims(attn.head_dim, head_dim_vo, attn.q_dtype, attn.kv_dtype, attn.pos_encoding_mode)
    return PrefillConfig(attn, bool(causal) and not custom_mask, bool(custom_mask), head_dim_vo)


BACKENDS = ("auto", "fa2", "fa3")  # FlashInfer's names; one kernel here serves them all


def check_backend(backend, jit_args=None, jit_kwargs=None, variant_owns_mask=False) -> None:
    """FlashInfer's constructor options that have no counterpart here raise; the backends
    that compute the same thing are accepted."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    refuse("custom attention variants", jit_args=jit_args, jit_kwargs=jit_kwargs,
           variant_owns_mask=variant_owns_mask or None)  # fmt: skip


# plan()'s FlashInfer 0.7.2 parameters that select nothing here:
PLAN_NOTES = """
use_fp16_qk_reduction: QK products accumulate in fp32 whatever it says (at least FlashInfer's
    precision).
seq_lens, seq_lens_q, block_tables, max_token_per_sequence, max_sequence_kv, v_indptr,
    o_indptr: FlashInfer's cuDNN and trtllm-gen backends read them and its fa2 and fa3 ignore
    them; the backends here are those two, so they are ignored.
uniform_q_len: a hint for FlashInfer's fa2 CUDA-graph scheduler; ignored (the plan sees the
    query lengths themselves).
max_item_len_ptr: a hint for FlashInfer's multi-item scoring kernel; ignored (the mask is
    built from prefix_len_ptr and token_pos_in_items_ptr: attention/multi_item.py).
"""


def mask_capacity_bytes(custom_mask_buf) -> int | None:
    """The packed-mask bytes a CUDA-graph wrapper reserves, from FlashInfer's custom_mask_buf
    (a uint8 device buffer: its size; the mask itself travels in the workspace), or None."""
    if custom_mask_buf is None:
        return None
    if dtype_name(custom_mask_buf) != "uint8":
        raise ValueError(f"custom_mask_buf: expected uint8, got {dtype_name(custom_mask_buf)}")
    return int(np.prod(custom_mask_buf.shape))


def check_query(q, rows: int, cfg: PrefillConfig) -> tuple:
    """q [rows, Hq, D] of the plan's dtype; returns o's shape, [rows, Hq, D_vo]."""
    attn = cfg.attn
    shape = (rows, attn.num_qo_heads, attn.head_dim)
    if q.shape != shape or q.dtype != attn.q_dtype:
        raise ValueError(
            f"q: expected shape {shape} and dtype {attn.q_dtype} (the plan), "
            f"got {q.shape} and {q.dtype}"
        )
    return (rows, attn.num_qo_heads, cfg.dim_vo)


def io_fields(q, out, lse, cfg: PrefillConfig) -> dict:
    """Strides (elements) of q, o and lse, checked; out and lse may be None (dense outputs);
    cfg: the plan's configuration (head counts, o's head_dim)."""
    heads, dim = cfg.attn.num_qo_heads, cfg.dim_vo
    o_strides = out.strides if out is not None else (heads * dim, dim, 1)
    lse_strides = lse.strides if lse is not None else (heads, 1)
    if q.strides[2] != 1 or o_strides[2] != 1 or lse_strides[1] != 1:
        raise ValueError(
            f"q, out and lse must be contiguous in their last dimension, got strides "
            f"(elements) q {q.strides}, out {o_strides}, lse {lse_strides}"
        )
    if q.offset % 16 or any(s % 8 for s in q.strides[:2]):
        raise ValueError(
            f"q: needs 16-byte aligned rows (cp.async), got address offset {q.offset} and "
            f"strides {q.strides} (elements)"
        )
    if out is not None and (out.offset % 16 or any(s % 8 for s in o_strides[:2])):
        raise ValueError(
            f"out: needs 16-byte aligned rows (written in 16-byte pieces), got address offset "
            f"{out.offset} and strides {o_strides} (elements)"
        )
    return dict(q_stride_n=q.strides[0], q_stride_h=q.strides[1], o_stride_n=o_strides[0],
                o_stride_h=o_strides[1], lse_stride_n=lse_strides[0])  # fmt: skip


__all__ = [
    "BACKENDS",
    "check_backend",
    "check_query",
    "io_fields",
    "mask_capacity_bytes",
]
