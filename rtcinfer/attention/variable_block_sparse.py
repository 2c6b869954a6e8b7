"""Block-sparse attention with blocks of varying sizes and a pattern per kv head, FlashInfer's
VariableBlockSparseAttentionWrapper: q [Hq, L, D], k, v [Hkv, Lk, D] (heads first), kv head h
(and its group of Hq / Hkv query heads) cut into row blocks of block_row_sz[h] queries and
column blocks of block_col_sz[h] keys; row block r attends to the column blocks c where
block_mask_map[h, r, c] is True.

As FlashInfer runs it, it is batch prefill over a paged cache with one kv head and pages of one
token (the paged wrapper, its plan and kernels): each (kv head, row block) is a request of that
group's query heads, its keys the kept columns' tokens of its kv head (k and v viewed as
[Hkv * Lk] one-token pages, no copy), causal aligned to the bottom right of each request's kept
keys. q goes to the kernel as [Hkv * L, group, D] and the output comes back as [Hq, L, D]: with
one query head a kv head (group 1) both are views; with GQA each is a copy, made by the
caller's framework (FlashInfer copies them too)."""

from __future__ import annotations

import numpy as np

from ..interop.arrays import framework, to_numpy
from .prefill import BatchPrefillWithPagedKVCacheWrapper
from .run_options import refuse


class VariableBlockSparseAttentionWrapper:
    """plan(block_mask_map, block_row_sz, block_col_sz, num_qo_heads, num_kv_heads, head_dim,
    ...) then run(q, k, v) -> o [Hq, L, D] (and lse [Hq, L], base 2, with return_lse=True) in
    q's dtype; FlashInfer 0.7.2's names, meanings and defaults."""

    def __init__(self, float_workspace_buffer=None, backend="auto"):
        self._prefill = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, "NHD",
                                                            backend=backend)  # fmt: skip
        self._shape = None  # (num_qo_heads, num_kv_heads, head_dim, L, Lk) of the plan

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None) -> None:
        """As the paged prefill wrapper's: later plans lay out the new buffer."""
        self._prefill.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def plan(self, block_mask_map, block_row_sz, block_col_sz, num_qo_heads, num_kv_heads,
             head_dim, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
             logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True, q_data_type="float16", kv_data_type=None) -> None:  # fmt: skip
        """The (kv head, row block) requests over one-token pages, planned by the paged
        wrapper. block_mask_map: bool [Hkv, MB, NB]; block_row_sz [Hkv, MB] and block_col_sz
        [Hkv, NB]: each kv head's rows add up to the same L, its columns to the same Lk."""
        hkv = int(num_kv_heads)
        if hkv < 1 or int(num_qo_heads) % hkv:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")  # fmt: skip
        kept, rows, cols = _pattern(block_mask_map, block_row_sz, block_col_sz, hkv)
        L, Lk = int(rows[0].sum()), int(cols[0].sum())
        lengths, indices = _kept_keys(kept, cols, Lk)
        qo_indptr = np.concatenate([[0], np.cumsum(rows.reshape(-1))])
        indptr = np.concatenate([[0], np.cumsum(lengths)])
        self._prefill.plan(qo_indptr, indptr, indices, np.ones(lengths.size, np.int64),
                           int(num_qo_heads) // hkv, 1, head_dim, 1, causal=causal,
                           pos_encoding_mode=pos_encoding_mode,
                           use_fp16_qk_reduction=use_fp16_qk_reduction,
                           logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                           rope_scale=rope_scale, rope_theta=rope_theta,
                           q_data_type=q_data_type, kv_data_type=kv_data_type,
                           o_data_type=q_data_type, non_blocking=non_blocking)  # fmt: skip
        self._shape = (int(num_qo_heads), hkv, int(head_dim), L, Lk)

    def run(self, q, k, v, out=None, lse=None, return_lse=False, enable_pdl=None):
        """o [Hq, L, D] of q [Hq, L, D] over k, v [Hkv, Lk, D] (and lse [Hq, L] when
        return_lse), new arrays. out and lse are not supported (FlashInfer's are arrays of its
        kernel's layout, its result a copy out of them): they raise when given."""
        if out is not None or lse is not None:
            refuse(out=out, lse=lse)
        if self._shape is None:
            raise RuntimeError("plan() must be called before run()")
        hq, hkv, d, L, Lk = self._shape
        group = hq // hkv
        _check_shape("q", q, (hq, L, d))
        _check_shape("k", k, (hkv, Lk, d))
        _check_shape("v", v, (hkv, Lk, d))
        rows = _transposed(q.reshape(hkv, group, L, d), (0, 2, 1, 3)).reshape(hkv * L, group, d)
        pages = (k.reshape(hkv * Lk, 1, 1, d), v.reshape(hkv * Lk, 1, 1, d))
        result = self._prefill.run(rows, pages, return_lse=return_lse)
        o, s = result if return_lse else (result, None)
        o = _transposed(o.reshape(hkv, L, group, d), (0, 2, 1, 3)).reshape(hq, L, d)
        if not return_lse:
            return o
        return o, _transposed(s.reshape(hkv, L, group), (0, 2, 1)).reshape(hq, L)

    def forward(self, q, k, v, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
                logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):  # fmt: skip
        """FlashInfer's deprecated form of run(): the options must be the latest plan()'s
        (each difference is named)."""
        if self._shape is None:
            raise RuntimeError("plan() must be called before forward()")
        self._prefill._check_forward(self._prefill._launch.cfg.causal, pos_encoding_mode, -1,
                                     logits_soft_cap, sm_scale, rope_scale, rope_theta)  # fmt: skip
        return self.run(q, k, v)


def _pattern(block_mask_map, block_row_sz, block_col_sz, hkv: int):
    """(kept bool [Hkv, MB, NB], rows int64 [Hkv, MB], cols int64 [Hkv, NB]) on the host,
    checked: the shapes agree, sizes are not negative, every kv head covers the same L x Lk."""
    kept = np.asarray(to_numpy(block_mask_map))
    rows, cols = (np.asarray(to_numpy(x)) for x in (block_row_sz, block_col_sz))
    for name, x in (("block_row_sz", rows), ("block_col_sz", cols)):
        if x.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected integer sizes, got {x.dtype}")
    rows, cols = rows.astype(np.int64), cols.astype(np.int64)
    if kept.dtype != np.bool_ or kept.ndim != 3 or kept.shape[0] != hkv:
        raise ValueError(f"block_mask_map: expected bool [num_kv_heads = {hkv}, MB, NB], got "
                         f"{kept.dtype} {kept.shape}")  # fmt: skip
    _, mb, nb = kept.shape
    for name, x, shape in (("block_row_sz", rows, (hkv, mb)), ("block_col_sz", cols, (hkv, nb))):
        if x.shape != shape or (x < 0).any():
            raise ValueError(f"{name}: expected non-negative sizes of shape {shape}, got "
                             f"{x.shape}")  # fmt: skip
    for name, x in (("block_row_sz", rows), ("block_col_sz", cols)):
        totals = x.sum(axis=1)
        if (totals != totals[0]).any():
            raise ValueError(f"{name}: every kv head's blocks must add up to the same length, "
                             f"got {totals.tolist()}")  # fmt: skip
    return kept, rows, cols


def _kept_keys(kept, cols, Lk: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys a request, page ids) of the (kv head, row block) requests in that order: request
    (h, r) holds the keys of the column blocks c with kept[h, r, c], in column order, kv head
    h's key j being page h * Lk + j."""
    hkv, mb, _ = kept.shape
    h, r, c = np.nonzero(kept)  # row-major: by request, then by column
    sizes = cols[h, c]
    first = h * Lk + (np.cumsum(cols, axis=1) - cols)[h, c]  # each kept block's first page
    ends = np.cumsum(sizes)
    pages = np.repeat(first - (ends - sizes), sizes) + np.arange(int(ends[-1]) if ends.size else 0)
    lengths = np.bincount(h * mb + r, weights=sizes, minlength=hkv * mb).astype(np.int64)
    return lengths, pages.astype(np.int64)


def _check_shape(name: str, x, shape: tuple) -> None:
    got = tuple(getattr(x, "shape", ()))
    if got != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {got}")


def _transposed(x, axes: tuple):
    """x with its axes in the order `axes`, by its own framework (a view where it can)."""
    return x.permute(*axes) if framework(x) == "torch" else x.transpose(axes)


__all__ = ["VariableBlockSparseAttentionWrapper"]
