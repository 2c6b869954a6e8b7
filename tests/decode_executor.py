"""A float64 NumPy executor of a ``DecodePlan``: what the GPU decode + merge kernels compute.

Each work item attends over its own chunk of pages only, exactly as one split-KV CTA would;
the partial states of a request are then merged in chunk order. Matching
``batch_decode_paged_ref`` to rounding error shows that a plan covers every token once and
that the chunk boundaries keep absolute positions (RoPE, ALiBi, sliding window).
"""

from __future__ import annotations

import numpy as np

from .reference import f64
from .reference_attention import (
    cache_page_size,
    decode_features,
    decode_step_ref,
    gather_pages_ref,
    merge_state_ref,
    split_paged_kv_cache,
)


def _check_plan_matches(plan, batch_size, page_size, num_kv_heads, indptr, last):
    if plan.batch_size != batch_size:
        raise ValueError(f"plan.batch_size ({plan.batch_size}) != q.shape[0] ({batch_size})")
    if plan.page_size != page_size:
        raise ValueError(f"plan.page_size ({plan.page_size}) != cache page_size ({page_size})")
    if plan.num_kv_heads != num_kv_heads:
        raise ValueError(
            f"plan.num_kv_heads ({plan.num_kv_heads}) != cache num_kv_heads ({num_kv_heads})"
        )
    pages = np.diff(indptr)
    kv_len = np.where(pages > 0, (pages - 1) * page_size + last, 0)
    if not np.array_equal(kv_len, plan.kv_len):
        raise ValueError("plan.kv_len does not match kv_indptr / kv_last_page_len")


def execute_decode_plan(
    plan,
    q,
    paged_kv_cache,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    *,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    sm_scale: float | None = None,
    rope_scale: float = 1.0,
    rope_theta: float = 1e4,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
):
    """Run ``plan`` chunk by chunk and merge; returns (o [B, Hq, D], lse [B, Hq]) in float64.

    for w: r = work_request[w]; [t0, t1) = work_token_bounds()[w] (pages t0 / ps .. ceil(t1 / ps))
           o_w, lse_w = decode_step_ref(q[r], K_r[t0:t1], V_r[t0:t1], arange(t0, t1),
                                        kv_len[r] - 1, ...)
    o[b], lse[b] = merge_state(... merge_state(part[i0], part[i0 + 1]) ..., part[i1 - 1])
    """
    q = f64(q)
    k_cache, v_cache = split_paged_kv_cache(paged_kv_cache, kv_layout)
    page_size = cache_page_size(k_cache, kv_layout)
    num_kv_heads = np.shape(k_cache)[2 if kv_layout == "NHD" else 1]
    indptr = np.asarray(kv_indptr, dtype=np.int64)
    indices = np.asarray(kv_indices, dtype=np.int64)
    last = np.asarray(kv_last_page_len, dtype=np.int64)
    _check_plan_matches(plan, q.shape[0], page_size, num_kv_heads, indptr, last)
    feats = decode_features(
        q.shape[-1], pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
        rope_scale, rope_theta, q_scale, k_scale, v_scale,
    )  # fmt: skip

    num_qo_heads, head_dim_vo = q.shape[1], np.shape(v_cache)[-1]
    part_o = np.zeros((plan.num_work, num_qo_heads, head_dim_vo))
    part_lse = np.full((plan.num_work, num_qo_heads), -np.inf)
    starts, ends = plan.work_token_bounds()
    for w in range(plan.num_work):
        r = int(plan.work_request[w])
        t0, t1 = int(starts[w]), int(ends[w])  # t0 is page-aligned in every plan
        first = indptr[r] + t0 // page_size
        stop = indptr[r] + -(-t1 // page_size)
        k = gather_pages_ref(k_cache, indices[first:stop], kv_layout, t1 - t0)
        v = gather_pages_ref(v_cache, indices[first:stop], kv_layout, t1 - t0)
        part_o[w], part_lse[w] = decode_step_ref(
            q[r], k, v, np.arange(t0, t1), int(plan.kv_len[r]) - 1, **feats
        )

    o = np.zeros((plan.batch_size, num_qo_heads, head_dim_vo))
    lse = np.full((plan.batch_size, num_qo_heads), -np.inf)
    for b in range(plan.batch_size):
        i0, i1 = int(plan.merge_indptr[b]), int(plan.merge_indptr[b + 1])
        acc_o, acc_lse = part_o[i0][None], part_lse[i0][None]
        for i in range(i0 + 1, i1):
            acc_o, acc_lse = merge_state_ref(acc_o, acc_lse, part_o[i][None], part_lse[i][None])
        o[b], lse[b] = acc_o[0], acc_lse[0]
    return o, lse
