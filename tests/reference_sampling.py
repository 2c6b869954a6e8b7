"""Naive float64 NumPy references of the sampling ops (softmax, the kept sets of top-k, top-p
and min-p, renormalization, masking, inverse-transform sampling, chain speculative sampling):
as tests/reference.py, they define what the kernels compute, written for clarity."""

from __future__ import annotations

import numpy as np

from .reference import f64

# --- sampling ---------------------------------------------------------------------------------
# Kept sets follow FlashInfer: ties with a threshold are kept; the maximum always stays in top-p.


def softmax_ref(logits, temperature=None):
    """Row softmax of logits / temperature (scalar or per row); rows of -inf give zeros."""
    x = f64(logits)
    t = 1.0 if temperature is None else f64(temperature)
    x = x / (np.reshape(t, (-1, 1)) if np.ndim(t) else t)
    m = np.max(np.where(np.isneginf(x), -np.inf, x), axis=-1, keepdims=True)
    e = np.where(np.isneginf(x), 0.0, np.exp(x - np.where(np.isfinite(m), m, 0.0)))
    total = e.sum(axis=-1, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)


def _above(p, with_mass=True):
    """(count, mass) of the values strictly greater than each entry of the 1-D row p."""
    u, inv, cnt = np.unique(p, return_inverse=True, return_counts=True)
    count = (np.cumsum(cnt[::-1])[::-1] - cnt)[inv]
    if not with_mass:
        return count, None
    mass = u * cnt
    return count, (np.cumsum(mass[::-1])[::-1] - mass)[inv]


def top_k_keep_ref(p, k):
    """Rows of: #{i : p_i > p_j} < k (the k largest, ties with the k-th kept); k <= 0 or
    k >= vocab keeps all. k: int or per row."""
    p = np.atleast_2d(f64(p))
    ks = np.broadcast_to(np.asarray(k), (p.shape[0],))
    out = np.ones(p.shape, bool)
    for r, (row, kr) in enumerate(zip(p, ks, strict=True)):
        if 0 < kr < row.size:
            out[r] = _above(row, with_mass=False)[0] < kr
    return out


def top_p_keep_ref(p, top_p):
    """Rows of: sum(p[p > p_j]) < top_p * sum(p), or p_j is the maximum; top_p >= 1 keeps
    all. top_p: float or per row."""
    p = np.atleast_2d(f64(p))
    ps = np.broadcast_to(np.asarray(top_p, np.float64), (p.shape[0],))
    out = np.ones(p.shape, bool)
    for r, (row, tp) in enumerate(zip(p, ps, strict=True)):
        if tp < 1:
            count, mass = _above(row)
            out[r] = (mass < tp * row.sum()) | (count == 0)
    return out


def min_p_keep_ref(p, min_p):
    """Rows of: p_j >= min(min_p, 1) * max(p); min_p <= 0 keeps all."""
    p = np.atleast_2d(f64(p))
    mp = np.broadcast_to(np.asarray(min_p, np.float64), (p.shape[0],))[:, None]
    return (mp <= 0) | (p >= np.minimum(mp, 1.0) * p.max(axis=-1, keepdims=True))


def renorm_ref(p, keep):
    """p restricted to keep, renormalized per row (rows with no mass stay zero)."""
    q = np.where(keep, np.maximum(f64(p), 0.0), 0.0)
    total = q.sum(axis=-1, keepdims=True)
    return np.where(total > 0, q / np.where(total > 0, total, 1.0), 0.0)


def sampling_keep_ref(p, op, top_k=0, top_p=1.0, min_p=0.0):
    """Tokens a sampler may return: positive and in the kept set of op (SAMPLE_OPS)."""
    p = np.atleast_2d(f64(p))
    if op == "plain":
        keep = np.ones(p.shape, bool)
    elif op == "top_k":
        keep = top_k_keep_ref(p, top_k)
    elif op == "top_p":
        keep = top_p_keep_ref(p, top_p)
    elif op == "min_p":
        keep = min_p_keep_ref(p, min_p)
    elif op == "top_k_top_p":
        keep = top_k_keep_ref(p, top_k) & top_p_keep_ref(p, top_p)
    elif op == "top_k_first":
        keep_k = top_k_keep_ref(p, top_k)
        keep = keep_k & top_p_keep_ref(renorm_ref(p, keep_k), top_p)
    else:
        raise ValueError(f"unknown sampling op {op!r}")
    return keep & (p > 0)


def sampling_dist_ref(p, op, top_k=0, top_p=1.0, min_p=0.0):
    """The distribution each sampler draws from: p on its kept set, renormalized."""
    return renorm_ref(p, sampling_keep_ref(p, op, top_k, top_p, min_p))


def top_k_renorm_probs_ref(probs, top_k):
    return renorm_ref(probs, top_k_keep_ref(probs, top_k))


def top_p_renorm_probs_ref(probs, top_p):
    return renorm_ref(probs, top_p_keep_ref(probs, top_p))


def top_k_mask_logits_ref(logits, top_k):
    """Logits outside the top k (ties kept) become -inf; NaN becomes -inf."""
    x = np.atleast_2d(f64(logits))
    clean = np.where(np.isnan(x), -np.inf, x)
    keep = top_k_keep_ref(clean, top_k) & ~np.isnan(x)
    return np.where(keep, x, -np.inf)


def top_k_ref(x, k: int, ties_last: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(values, indices) [rows, k] of top_k: v = the k-th largest of row b (NaN as -inf); every
    element > v, then the elements == v of the smallest indices (ties_last: the largest), k in
    all, each group in index order. values keep the input's elements (NaN included)."""
    x = np.atleast_2d(np.asarray(x))
    clean = np.where(np.isnan(f64(x)), -np.inf, f64(x))
    values, indices = [], []
    for row, c in zip(x, clean, strict=True):
        v = np.sort(c)[::-1][k - 1]
        greater = np.flatnonzero(c > v)
        equal = np.flatnonzero(c == v)
        need = k - len(greater)
        ties = equal[len(equal) - need :] if ties_last else equal[:need]
        take = np.concatenate([greater, ties])
        values.append(row[take])
        indices.append(take)
    return np.stack(values), np.stack(indices).astype(np.int64)


def inverse_transform_ref(dist, u):
    """The first token whose inclusive cumulative mass exceeds u * total (per row)."""
    dist = np.atleast_2d(f64(dist))
    cum = np.cumsum(dist, axis=-1)
    u = np.reshape(np.asarray(u, np.float64), (-1, 1))
    hit = cum > u * cum[:, -1:]
    return np.where(hit.any(axis=-1), hit.argmax(axis=-1), dist.shape[-1] - 1)


def chain_speculative_sampling_ref(draft_probs, draft_token_ids, target_probs, uniforms):
    """Speculative verification with given uniforms [batch, n + 1] (u_i for draft token i,
    u_n for the final draw). Returns (tokens [batch, n + 1], accepted [batch], emitted)."""
    q, p = f64(draft_probs), f64(target_probs)
    ids, u = np.asarray(draft_token_ids), f64(uniforms)
    batch, n, _ = q.shape
    tokens = np.full((batch, n + 1), -1, np.int64)
    accepted, emitted = np.zeros(batch, np.int64), np.zeros(batch, np.int64)
    for b in range(batch):
        rows = np.arange(n)
        ok = u[b, :n] * q[b, rows, ids[b]] < p[b, rows, ids[b]]
        j = int(np.argmin(ok)) if not ok.all() else n
        accepted[b], emitted[b] = ok.sum(), j
        tokens[b, :j] = ids[b, :j]
        dist = np.maximum(p[b, j] - q[b, j], 0.0) if j < n else p[b, n]
        if not dist.sum() > 0:
            dist = p[b, j]
        tokens[b, j] = inverse_transform_ref(dist, u[b, n])[0]
    return tokens, accepted, emitted
