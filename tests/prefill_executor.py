"""A NumPy executor of a PrefillPlan: every work item's attention over its key range into its
rows (or partial slots), then each split tile's partials merged in chunk order, the way the
kernel is to run the plan; tests compare it with the float64 reference."""

from __future__ import annotations

import numpy as np

from . import reference as ref
from . import reference_attention as aref


def execute_prefill_plan(plan, q, k, v, qo_indptr, kv_indptr, *, sm_scale, causal=False,
                         window_left=-1, logits_soft_cap=0.0):  # fmt: skip
    """o [nnz_q, Hq, Dv], lse [nnz_q, Hq] of ragged q [nnz_q, Hq, D], k, v [nnz_kv, Hkv, D]."""
    q, k, v = ref.f64(q), ref.f64(k), ref.f64(v)
    num_qo_heads, num_kv_heads = q.shape[1], k.shape[1]
    g = plan.group_size
    o = np.full((q.shape[0], num_qo_heads, v.shape[2]), np.nan)
    lse = np.full((q.shape[0], num_qo_heads), np.nan)
    slots_o = np.full((plan.num_slots, num_kv_heads, plan.tile_rows, v.shape[2]), np.nan)
    slots_lse = np.full((plan.num_slots, num_kv_heads, plan.tile_rows), np.nan)
    for w in range(plan.num_work):
        t = int(plan.work_tile[w])
        b = int(plan.tile_request[t])
        qo, kv = int(plan.qo_len[b]), int(plan.kv_len[b])
        rows = np.arange(plan.tile_row[t], min(plan.tile_row[t] + plan.tile_rows, qo * g))
        queries, heads = rows // g, rows % g
        keys = np.arange(plan.work_kv_begin[w], plan.work_kv_end[w])
        for kh in range(num_kv_heads):
            qh = kh * g + heads
            qv = q[qo_indptr[b] + queries, qh]  # [rows, D]
            kk = k[kv_indptr[b] + keys, kh]  # [keys, D]
            vv = v[kv_indptr[b] + keys, kh]
            s = qv @ kk.T * sm_scale
            if logits_soft_cap > 0:
                s = logits_soft_cap * np.tanh(s / logits_soft_cap)
            qpos = (queries + kv - qo)[:, None]
            visible = np.ones(s.shape, dtype=bool)
            if causal:
                visible &= keys[None, :] <= qpos
            if window_left >= 0:
                visible &= keys[None, :] >= qpos - window_left
            s = np.where(visible, s, -np.inf)
            part_o, part_lse = _softmax_rows(s, vv)
            if plan.work_slot[w] < 0:
                o[qo_indptr[b] + queries, qh] = part_o
                lse[qo_indptr[b] + queries, qh] = part_lse
            else:
                slots_o[plan.work_slot[w], kh, : len(rows)] = part_o
                slots_lse[plan.work_slot[w], kh, : len(rows)] = part_lse
    for t in np.flatnonzero(plan.tile_items > 1):
        b = int(plan.tile_request[t])
        qo = int(plan.qo_len[b])
        rows = np.arange(plan.tile_row[t], min(plan.tile_row[t] + plan.tile_rows, qo * g))
        queries, heads = rows // g, rows % g
        first, count = int(plan.tile_slot[t]), int(plan.tile_items[t])
        for kh in range(num_kv_heads):
            parts = slots_o[first : first + count, kh, : len(rows)]  # [count, rows, Dv]
            s = slots_lse[first : first + count, kh, : len(rows)]  # [count, rows]
            merged_o, merged_lse = aref.merge_states_ref(parts.transpose(1, 0, 2)[:, :, None],
                                                        s.T[:, :, None])  # fmt: skip
            o[qo_indptr[b] + queries, kh * g + heads] = merged_o[:, 0]
            lse[qo_indptr[b] + queries, kh * g + heads] = merged_lse[:, 0]
    return o, lse


def _softmax_rows(s: np.ndarray, v: np.ndarray):
    """(softmax(s) @ v, log2-sum-exp(s)) per row; a row without a visible key gives (0, -inf)."""
    m = s.max(axis=1, initial=-np.inf)
    empty = m == -np.inf
    p = np.exp(s - np.where(empty, 0.0, m)[:, None])
    d = p.sum(axis=1)
    o = np.where(empty[:, None], 0.0, p @ v / np.where(empty, 1.0, d)[:, None])
    lse = np.where(empty, -np.inf, (np.where(empty, 0.0, m) + np.log(np.where(empty, 1, d))) *
                   aref.LOG2E)  # fmt: skip
    return o, lse
