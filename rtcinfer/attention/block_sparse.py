"""Block-sparse attention, FlashInfer's BlockSparseAttentionWrapper: queries q [M, Hq, D] over
keys and values [N, Hkv, D] where only some R x C blocks of the M x N attention matrix are kept,
given in BSR form: block row i (queries iR.. min(iR + R, M)) keeps the column blocks
indices[indptr[i]:indptr[i + 1]] (keys jC.. jC + C of block j), optionally masked inside each
kept block by mask [nnz, R, C] (True: the query sees the key).

As FlashInfer runs it, it is batch prefill over a paged cache (the paged wrapper, whose plan and
kernels it uses): block row i is request i, its kept column blocks its pages, k and v viewed as
[N / C, C, Hkv, D] pages (no copy), every page full. The plan's options mean what they mean
for the paged wrapper within each block row: `causal` aligns each row's queries to the bottom
right of its kept keys, and RoPE (pos_encoding_mode="ROPE_LLAMA") counts a row's kept keys from
0, the row's queries at the last of those positions. Without either, the result is attention
over exactly the kept (and unmasked) entries of the matrix."""

from __future__ import annotations

import numpy as np

from ..interop.arrays import to_numpy
from ..plan._checks import as_int
from .paged_kv import page_table_ids
from .planned import host_ints
from .prefill import BatchPrefillWithPagedKVCacheWrapper
from .run_options import refuse


class BlockSparseAttentionWrapper:
    """plan(indptr, indices, M, N, R, C, num_qo_heads, num_kv_heads, head_dim, ...) then
    run(q, k, v) -> o [M, Hq, D] (and lse [M, Hq], base 2, with return_lse=True); FlashInfer
    0.7.2's names, meanings and defaults (o_data_type "float16" unless given)."""

    def __init__(self, float_workspace_buffer=None, backend="auto"):
        self._prefill = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, "NHD",
                                                            backend=backend)  # fmt: skip
        self.M = self.N = self.R = self.C = None

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None) -> None:
        """As the paged prefill wrapper's: later plans lay out the new buffer."""
        self._prefill.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def plan(self, indptr, indices, M, N, R, C, num_qo_heads, num_kv_heads, head_dim, mask=None,
             packed_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, logits_soft_cap=None, sm_scale=None, rope_scale=None,
             rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type="float16",
             non_blocking=True, block_mask=None, kv_block_lens=None, q2k_indices=None,
             q2k_num=None, kv_splits=None, use_clc=None, q_scale=None, k_scale=None,
             v_scale=None) -> None:  # fmt: skip
        """The block rows as the paged wrapper's requests, planned by it. indptr [MB + 1] with
        MB = ceil(M / R), indices [nnz] < N / C (C must divide N); mask: bool [nnz, R, C] in
        BSR order (the last block row reads the first M - (MB - 1) R rows of its blocks), or
        packed_mask: those bits in the paged wrapper's packed layout (packbits of each block
        row's rows x kept keys, row-major, each row's block on whole bytes). The parameters
        after non_blocking belong to FlashInfer's Blackwell and cuTile backends (per-head
        block masks, direct selections, split-KV, Sage fp8 scales): not supported, a value
        other than None raises."""
        refuse("options of FlashInfer's Blackwell and cuTile backends", block_mask=block_mask,
               kv_block_lens=kv_block_lens, q2k_indices=q2k_indices, q2k_num=q2k_num,
               kv_splits=kv_splits, use_clc=use_clc, q_scale=q_scale, k_scale=k_scale,
               v_scale=v_scale)  # fmt: skip
        M, N = as_int("M", M, minimum=0), as_int("N", N, minimum=0)
        R, C = as_int("R", R, minimum=1), as_int("C", C, minimum=1)
        if N % C:
            raise ValueError(f"N ({N}) must be a multiple of the block columns C ({C})")
        rows_ptr = host_ints("indptr", indptr)
        blocks = host_ints("indices", indices, widen=False)
        row_blocks = -(-M // R)
        if rows_ptr.shape != (row_blocks + 1,):
            raise ValueError(
                f"indptr: expected ceil(M / R) + 1 = {row_blocks + 1} entries (M = {M} rows in "
                f"blocks of {R}), got {rows_ptr.shape[0]}"
            )
        blocks, largest = page_table_ids(blocks, int(rows_ptr[-1]))  # the kept ones, ids >= 0
        if largest >= N // C:  # run() checks the pages against k and v; N is known here
            raise ValueError(f"indices: column block {largest} is outside 0..{N // C - 1}")
        qo_indptr = np.minimum(np.arange(row_blocks + 1, dtype=np.int64) * R, M)
        custom = None
        if mask is not None and packed_mask is None:
            custom = _row_major_mask(mask, rows_ptr, qo_indptr, R, C)
        last = np.where(np.diff(rows_ptr) > 0, C, 0)  # a block row with no kept block: no page
        self._prefill.plan(qo_indptr, rows_ptr, blocks, last,
                           num_qo_heads, num_kv_heads, head_dim, C, custom_mask=custom,
                           packed_custom_mask=packed_mask, causal=causal,
                           pos_encoding_mode=pos_encoding_mode,
                           use_fp16_qk_reduction=use_fp16_qk_reduction,
                           logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                           rope_scale=rope_scale, rope_theta=rope_theta,
                           q_data_type=q_data_type, kv_data_type=kv_data_type,
                           o_data_type=o_data_type, non_blocking=non_blocking)  # fmt: skip
        self.M, self.N, self.R, self.C = M, N, R, C

    begin_forward = plan

    def run(self, q, k, v, scale_q=None, scale_k=None, scale_v=None, out=None, lse=None,
            return_lse=False, enable_pdl=None):  # fmt: skip
        """o [M, Hq, D] of q [M, Hq, D] over k, v [N, Hkv, D] (each token's heads at any
        stride, head_dim contiguous); out and lse may be given. scale_q / scale_k / scale_v,
        FlashInfer's per-head scales of fp8 q, k and v, are not supported (raise when given)."""
        if scale_q is not None or scale_k is not None or scale_v is not None:
            refuse(scale_q=scale_q, scale_k=scale_k, scale_v=scale_v)
        if self.C is None:
            raise RuntimeError("plan() must be called before run()")
        pages = (self._pages("k", k), self._pages("v", v))
        return self._prefill.run(q, pages, out=out, lse=lse, return_lse=return_lse)

    def forward(self, q, k, v, scale_q=None, scale_k=None, scale_v=None,
                pos_encoding_mode="NONE", use_fp16_qk_reduction=False, logits_soft_cap=None,
                sm_scale=None, rope_scale=None, rope_theta=None):  # fmt: skip
        """FlashInfer's deprecated form of run(): the options must be the latest plan()'s
        (each difference is named)."""
        if self.C is None:
            raise RuntimeError("plan() must be called before forward()")
        self._prefill._check_forward(self._prefill._launch.cfg.causal, pos_encoding_mode, -1,
                                     logits_soft_cap, sm_scale, rope_scale, rope_theta)  # fmt: skip
        return self.run(q, k, v, scale_q, scale_k, scale_v)

    def _pages(self, name: str, x):
        """x [N, Hkv, D] as the paged wrapper's NHD pages [N / C, C, Hkv, D] (a view)."""
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) != 3 or shape[0] != self.N:
            raise ValueError(f"{name}: expected shape ({self.N}, num_kv_heads, head_dim), got "
                             f"{shape}")  # fmt: skip
        return x.reshape(self.N // self.C, self.C, shape[1], shape[2])


def _row_major_mask(mask, rows_ptr, qo_indptr, R: int, C: int) -> np.ndarray:
    """The paged wrapper's custom_mask (bool, each request's rows x keys row-major, back to
    back) of a BSR mask [nnz, R, C]: block row i's kept blocks side by side, its rows only."""
    host = to_numpy(mask)
    kept = int(rows_ptr[-1])
    if host.dtype != np.bool_ or host.shape != (kept, R, C):
        raise ValueError(f"mask: expected bool [{kept}, {R}, {C}] (nnz, R, C), got {host.dtype} "
                         f"{host.shape}")  # fmt: skip
    pieces = []
    for i in range(rows_ptr.shape[0] - 1):
        rows = int(qo_indptr[i + 1] - qo_indptr[i])
        blocks = host[rows_ptr[i] : rows_ptr[i + 1], :rows]  # [kept_i, rows, C]
        pieces.append(blocks.transpose(1, 0, 2).reshape(-1))
    return np.concatenate(pieces) if pieces else np.zeros(0, np.bool_)


__all__ = ["BlockSparseAttentionWrapper"]
