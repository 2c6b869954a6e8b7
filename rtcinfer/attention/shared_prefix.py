"""Cascade attention over shared prefixes (FlashInfer's cascade wrappers): attention over keys
split into levels (a prefix shared by many requests, then each request's own keys) computed
level by level, each giving a state (o_l, lse_l) for every query, merged with merge_state:

    o = sum_l w_l o_l / sum_l w_l,  w_l = 2^(lse_l - max_l lse_l),  lse = log2(sum_l 2^lse_l)

which equals attention over all levels' keys at once. The shared prefix is read once per
group of requests instead of once per request.

- MultiLevelCascadeAttentionWrapper: L levels over one paged KV cache; level l groups the
  queries by qo_indptr_arr[l] (each group sees its pages of level l). The causal mask, if
  asked for, applies to the last level only (earlier levels precede every query).
- BatchDecodeWithSharedPrefixPagedKVCacheWrapper: one decode query per request, a shared
  prefix given as contiguous K/V (single prefill of all queries over it, not causal), then
  batch decode over each request's pages.
- BatchPrefillWithSharedPrefixPagedKVCacheWrapper: the same for batch prefill (causal on the
  unique part only).

Position encodings inside the kernel (ROPE_LLAMA, ALiBi) and the sliding window see each
level's own key positions, as in FlashInfer's wrappers; the two shared-prefix wrappers apply
them to the unique part only.

Levels run side by side (side_stream.py) for PyTorch and CuPy callers: the shared level is
bound by its MMAs (every query over the prefix), the requests' own level by memory (each
request's keys once), and the GPU does both at once better than one after the other
(H200, 128 requests on a 32K-token prefix: 197 us against 214). The level with the most work
(`level_work`) is launched first; levels too small to gain from it (side_stream.MIN_SIDE_WORK)
run one after the other.
"""

from __future__ import annotations

import numpy as np

from ..interop.dtypes import itemsize, normalize
from ..plan.decode import _pages_and_lens
from .cascade import merge_state_in_place
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .planned import host_ints
from .prefill import BatchPrefillWithPagedKVCacheWrapper
from .side_stream import MIN_SIDE_WORK, empty_like_in, side_by_side
from .single_prefill import single_prefill_with_kv_cache

# dense 16-bit MMA flops per byte of HBM traffic at which a level's MMAs take as long as its
# loads (H200: ~800 TFLOP/s peak, ~400 reached, over ~4 TB/s)
FLOPS_PER_BYTE = 100


def level_work(tokens: int, pairs: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
               kv_itemsize: int) -> float:  # fmt: skip
    """A level's rough GPU time, in bytes moved: its K/V bytes (each request's keys read once:
    2 * tokens * Hkv * D * itemsize) or, where they take longer, its MMA flops (4 * Hq * D a
    visible (query, key) pair, `pairs` of them) over FLOPS_PER_BYTE."""
    nbytes = 2 * tokens * num_kv_heads * head_dim * kv_itemsize
    return max(nbytes, 4 * pairs * num_qo_heads * head_dim / FLOPS_PER_BYTE)


def _prefill_level_work(wrapper) -> float:
    """level_work of a planned BatchPrefillWithPagedKVCacheWrapper (every pair counted: a
    causal level is weighed as if it were not)."""
    st = wrapper._launch
    attn, plan = st.cfg.attn, st.plan
    pairs = int(np.dot(plan.qo_len, plan.kv_len))
    return level_work(int(plan.kv_len.sum()), pairs, attn.num_qo_heads, attn.num_kv_heads,
                      attn.head_dim, itemsize(attn.kv_dtype))  # fmt: skip


def _merge_levels(states):
    """The merged (o, lse) of a list of per-level states."""
    o, lse = states[0]
    for o_next, lse_next in states[1:]:
        o, lse = merge_state_in_place(o, lse, o_next, lse_next)
    return o, lse


class MultiLevelCascadeAttentionWrapper:
    """Attention over num_levels levels of a paged KV cache, merged (module docstring).

    plan() takes one qo_indptr, paged_kv_indptr, paged_kv_indices and paged_kv_last_page_len
    per level (lists of num_levels arrays), with FlashInfer's meanings: in level l, query
    group g is rows qo_indptr_arr[l][g]:qo_indptr_arr[l][g + 1] of q and sees the pages
    paged_kv_indices_arr[l][paged_kv_indptr_arr[l][g]:paged_kv_indptr_arr[l][g + 1]]. Every
    level covers all nnz query rows. One BatchPrefillWithPagedKVCacheWrapper per level.
    """

    def __init__(self, num_levels, float_workspace_buffer=None, kv_layout="NHD",
                 use_cuda_graph=False, qo_indptr_buf_arr=None, paged_kv_indptr_buf_arr=None,
                 paged_kv_indices_buf_arr=None,
                 paged_kv_last_page_len_buf_arr=None):  # fmt: skip
        if isinstance(num_levels, bool) or not isinstance(num_levels, int) or num_levels < 1:
            raise ValueError(f"num_levels must be an integer >= 1, got {num_levels!r}")
        buffers = (qo_indptr_buf_arr, paged_kv_indptr_buf_arr, paged_kv_indices_buf_arr,
                   paged_kv_last_page_len_buf_arr)  # fmt: skip
        if use_cuda_graph or any(b is not None for b in buffers):
            raise ValueError("use_cuda_graph=True is not supported yet by the cascade wrapper")
        self._levels = [
            BatchPrefillWithPagedKVCacheWrapper(
                float_workspace_buffer if i == 0 else None, kv_layout
            )  # fmt: skip
            for i in range(num_levels)
        ]
        self._nnz: int | None = None
        self._work = [0.0] * num_levels  # level_work of each level's plan

    def plan(
        self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
        paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, causal=False,
        pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
        logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16",
        kv_data_type=None,
    ) -> None:  # fmt: skip
        """Plan every level (module docstring); every level must cover the same query rows."""
        arrays = (qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
                  paged_kv_last_page_len)  # fmt: skip
        names = ("qo_indptr_arr", "paged_kv_indptr_arr", "paged_kv_indices_arr",
                 "paged_kv_last_page_len")  # fmt: skip
        for name, arr in zip(names, arrays, strict=True):
            if len(arr) != len(self._levels):
                raise ValueError(
                    f"{name} has {len(arr)} entries, the wrapper {len(self._levels)} levels"
                )
        nnz = None
        last = len(self._levels) - 1
        for i, wrapper in enumerate(self._levels):
            wrapper.plan(
                qo_indptr_arr[i], paged_kv_indptr_arr[i], paged_kv_indices_arr[i],
                paged_kv_last_page_len[i], num_qo_heads, num_kv_heads, head_dim, page_size,
                causal=causal and i == last, pos_encoding_mode=pos_encoding_mode,
                sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
                rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type,
                kv_data_type=kv_data_type,
            )  # fmt: skip
            rows = wrapper._launch.nnz_q
            if nnz is not None and rows != nnz:
                raise ValueError(
                    f"level {i} covers {rows} query rows, level 0 covers {nnz}: every level "
                    "must cover every query"
                )
            nnz = rows
        self._nnz = nnz
        self._work = [_prefill_level_work(level) for level in self._levels]

    def run(self, q, paged_kv_cache, return_lse=False):
        """o [nnz, Hq, D] (and lse [nnz, Hq], base 2, when return_lse) over every level."""
        if self._nnz is None:
            raise RuntimeError("plan() must be called before run()")
        first, rest = self._levels[0], self._levels[1:]
        if not rest:
            o, lse = first.run(q, paged_kv_cache, return_lse=True)
            return (o, lse) if return_lse else o
        first_work, rest_work = self._work[0], sum(self._work[1:])
        together = min(first_work, rest_work) >= MIN_SIDE_WORK
        outs = [(empty_like_in(q, q.shape, level._plan_o_dtype()),
                 empty_like_in(q, q.shape[:2], "float32")) if together else (None, None)
                for level in rest]  # fmt: skip

        def later_levels():
            return [level.run(q, paged_kv_cache, out=o, lse=lse, return_lse=True)
                    for level, (o, lse) in zip(rest, outs, strict=True)]  # fmt: skip

        state, states = side_by_side(
            q, lambda: first.run(q, paged_kv_cache, return_lse=True), later_levels,
            side_first=rest_work > first_work, together=together,
        )  # fmt: skip
        o, lse = _merge_levels([state, *states])
        return (o, lse) if return_lse else o

    forward = run

    def begin_forward(self, *args, **kwargs) -> None:
        """plan() by FlashInfer's older name."""
        return self.plan(*args, **kwargs)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def prewarm_paged_kv_stride_variant(self, variant: str = "independent") -> None:
        """Nothing to load (PlannedWrapper.prewarm_paged_kv_stride_variant)."""
        self._levels[0].prewarm_paged_kv_stride_variant(variant)

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffers=None) -> None:
        """The first level's plans go into `float_workspace_buffer` (the other levels keep
        buffers of their own; int_workspace_buffers has no use here); plan() again before
        run() (BatchPrefillWithPagedKVCacheWrapper.reset_workspace_buffer)."""
        self._levels[0].reset_workspace_buffer(float_workspace_buffer)
        self._nnz = None


class _SharedPrefixWrapper:
    """What the two shared-prefix wrappers share: the prefix as contiguous K/V seen by every
    query (single prefill, not causal), each request's own pages by `inner` (planned by the
    subclass), the two states merged."""

    def __init__(self, inner, kv_layout: str):
        self._kv_layout = kv_layout
        self._inner = inner
        self._config: dict | None = None  # plan()'s arguments the shared level takes too
        self._own_work = 0.0  # level_work of the requests' own pages
        self._heads = (1, 1, 1)  # (num_qo_heads, num_kv_heads, head_dim) of the plan

    def prewarm_paged_kv_stride_variant(self, variant: str = "independent") -> None:
        """Nothing to load (PlannedWrapper.prewarm_paged_kv_stride_variant)."""
        self._inner.prewarm_paged_kv_stride_variant(variant)

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None) -> None:
        """The requests' own pages are planned into `float_workspace_buffer` from now on; plan()
        again before run() (the inner wrapper's reset_workspace_buffer)."""
        self._inner.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)
        self._config = None

    def run(self, q, k_shared, v_shared, unique_kv_cache, return_lse=False):
        """o (and lse when return_lse) over the shared prefix and each request's pages."""
        if self._config is None:
            raise RuntimeError("plan() must be called before run()")
        own, prefix = self._own_work, self._prefix_work(q, k_shared)
        together = min(own, prefix) >= MIN_SIDE_WORK
        o_own = lse_own = None
        if together:  # side_by_side's side level writes arrays made before its fork
            o_own = empty_like_in(q, q.shape, self._inner._plan_o_dtype())
            lse_own = empty_like_in(q, q.shape[:2], "float32")
        shared, unique = side_by_side(
            q,
            lambda: single_prefill_with_kv_cache(q, k_shared, v_shared, causal=False,
                                                 kv_layout=self._kv_layout, return_lse=True,
                                                 **self._config),  # fmt: skip
            lambda: self._inner.run(q, unique_kv_cache, out=o_own, lse=lse_own,
                                    return_lse=True),  # fmt: skip
            side_first=own > prefix, together=together,
        )  # fmt: skip
        o, lse = _merge_levels([shared, unique])
        return (o, lse) if return_lse else o

    forward = run

    def _prefix_work(self, q, k_shared) -> float:
        """level_work of every query over the shared prefix."""
        shape = getattr(k_shared, "shape", ())
        if len(shape) != 3 or len(getattr(q, "shape", ())) != 3:
            return 0.0  # the calls name what is wrong
        prefix = shape[0] if self._kv_layout == "NHD" else shape[1]
        item = itemsize(normalize(k_shared.dtype))
        return level_work(prefix, q.shape[0] * prefix, *self._heads, item)


class BatchDecodeWithSharedPrefixPagedKVCacheWrapper(_SharedPrefixWrapper):
    """Batch decode where every request shares a prefix: q [B, Hq, D] attends to the shared
    K/V ([prefix_len, Hkv, D] NHD or [Hkv, prefix_len, D] HND, all B queries at once, not
    causal) and to its own pages (batch decode), merged."""

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD"):
        super().__init__(BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout),
                         kv_layout)  # fmt: skip

    def plan(
        self, unique_kv_indptr, unique_kv_indices, unique_kv_last_page_len, num_qo_heads,
        num_kv_heads, head_dim, page_size, q_data_type="float16", kv_data_type=None,
        sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
        pos_encoding_mode="NONE",
    ) -> None:  # fmt: skip
        """Plan the decode over each request's own pages (the shared part needs no plan)."""
        indptr = host_ints("unique_kv_indptr", unique_kv_indptr)  # copied once if on a device
        last = host_ints("unique_kv_last_page_len", unique_kv_last_page_len)
        self._inner.plan(
            indptr, unique_kv_indices, last, num_qo_heads,
            num_kv_heads, head_dim, page_size, pos_encoding_mode=pos_encoding_mode,
            window_left=window_left, logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
            kv_data_type=kv_data_type, sm_scale=sm_scale, rope_scale=rope_scale,
            rope_theta=rope_theta,
        )  # fmt: skip
        self._config = dict(sm_scale=sm_scale, logits_soft_cap=logits_soft_cap)
        cfg = self._inner._launch.cfg
        tokens = int(_pages_and_lens(indptr, last, cfg.page_size)[2].sum())  # checked by plan()
        self._heads = (cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim)
        self._own_work = level_work(tokens, tokens, *self._heads, itemsize(cfg.kv_dtype))

    begin_forward = plan


class BatchPrefillWithSharedPrefixPagedKVCacheWrapper(_SharedPrefixWrapper):
    """Batch prefill where every request shares a prefix: all query rows attend to the shared
    K/V (not causal) and each request's rows to its own pages (batch prefill, causal if
    asked), merged."""

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD"):
        super().__init__(BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout),
                         kv_layout)  # fmt: skip

    def plan(
        self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
        num_qo_heads, num_kv_heads, head_dim, page_size, causal=True, q_data_type="float16",
        kv_data_type=None, sm_scale=None, window_left=-1, logits_soft_cap=None,
        rope_scale=None, rope_theta=None, pos_encoding_mode="NONE",
    ) -> None:  # fmt: skip
        """Plan the prefill over each request's own pages (the shared part needs no plan)."""
        self._inner.plan(
            qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
            num_qo_heads, num_kv_heads, head_dim, page_size, causal=causal,
            pos_encoding_mode=pos_encoding_mode, window_left=window_left,
            logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
            rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type,
        )  # fmt: skip
        self._config = dict(sm_scale=sm_scale, logits_soft_cap=logits_soft_cap)
        attn = self._inner._launch.cfg.attn
        self._heads = (attn.num_qo_heads, attn.num_kv_heads, attn.head_dim)
        self._own_work = _prefill_level_work(self._inner)

    begin_forward = plan


__all__ = [
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
]
