"""Naive float64 NumPy references of attention: dense attention with every variant, single and
batch decode over a paged cache, merging of partial states, the append to the paged cache.
As tests/reference.py, they define what the kernels compute, written for clarity."""

from __future__ import annotations

import math

import numpy as np

from .reference import f64, rope_inv_freq, rope_ref

# --- attention: decode, merge, paged cache ---
#
# Conventions (FlashInfer's): LSE is base 2, lse = log2(sum_j exp(s_j)); an empty or fully
# masked row has o = 0 and lse = -inf; query head h reads kv head h // (Hq // Hkv).
# Inputs may be float16, bfloat16, float8_e4m3fn or float8_e5m2 (ml_dtypes): everything is
# converted to float64 before any arithmetic.

LOG2E = 1.0 / math.log(2.0)
POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")
KV_LAYOUTS = ("NHD", "HND")


def _group_size(num_qo_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        raise ValueError(
            f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    return num_qo_heads // num_kv_heads


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes, float64[num_heads], also for head counts that are not powers of two.

    n = 2 ** floor(log2(num_heads))
    slope[h] = 2 ** (-8 (h + 1) / n)                 for h < n
    slope[h] = 2 ** (-4 (2 (h - n) + 1) / n)         for h >= n (odd steps of the 2n series)
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    n = 1 << (num_heads.bit_length() - 1)
    h = np.arange(num_heads, dtype=np.float64)
    return np.where(h < n, 2.0 ** (-8.0 * (h + 1) / n), 2.0 ** (-4.0 * (2 * (h - n) + 1) / n))


def rope_ref_llama(x, positions, rope_scale: float = 1.0, rope_theta: float = 1e4) -> np.ndarray:
    """Non-interleaved RoPE over the whole head dim of x [N, ..., D] at positions [N], as
    pos_encoding_mode="ROPE_LLAMA" applies it (freq[i] = theta ** (-2 i / D) / rope_scale)."""
    x = f64(x)
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {d}")
    if len(positions) != x.shape[0]:
        raise ValueError(f"positions has {len(positions)} entries for {x.shape[0]} rows of x")
    rows = x.reshape(x.shape[0], int(np.prod(x.shape[1:-1])), d)
    inv = rope_inv_freq(d, rope_scale, rope_theta)
    return rope_ref(rows, positions, d, False, inv).reshape(x.shape)


def attention_ref(
    q,
    k,
    v,
    *,
    sm_scale: float,
    logits_soft_cap: float = 0.0,
    window_left: int = -1,
    causal: bool = False,
    alibi_slopes=None,
    q_positions=None,
    k_positions=None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    mask=None,
    sinks=None,
):
    """Attention of q [qo_len, Hq, D] over k [kv_len, Hkv, D], v [kv_len, Hkv, Dv].

        s[i, h, j] = q[i, h] . k[j, h // g] * sm_scale * k_scale + slope[h] * (kp[j] - qp[i])
        s = cap * tanh(s / cap) if cap > 0;   s = -inf where key j is hidden from query i
        o[i, h] = softmax_j(s[i, h]) @ v[:, h // g] * v_scale;  lse[i, h] = log2(sum_j exp(s))

    Positions default to bottom-right alignment: kp = arange(kv_len), qp = the last qo_len
    of them (decode: qp = kv_len - 1). Key j is hidden when causal and kp[j] > qp[i], or when
    window_left >= 0 and qp[i] - kp[j] > window_left, or when mask (bool [qo_len, kv_len])
    is given and mask[i, j] is False. ALiBi is added before the soft cap,
    the order of FlashInfer's attention variant. sinks [Hq] (attention sinks): one more key in
    every row of head h, always visible, of logit sinks[h] and value 0 (so a row with no
    visible key gets o = 0, lse = sinks[h] * log2(e)). Returns (o float64, lse float64
    [qo_len, Hq]).
    Notes on FlashInfer's kernels: decode measures the ALiBi distance from index 0, so its LSE
    is ours + slope[h] * qp * log2(e) (o is the same: a per-row shift cancels); with ALiBi and
    the soft cap both on, its fused variant scales the biased logit by sm_scale once more
    before the tanh. The reference keeps the plain formulas above.
    """
    q, k, v = f64(q), f64(k), f64(v)
    qo_len, num_qo_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    if v.shape[:2] != (kv_len, num_kv_heads):
        raise ValueError(f"v shape {v.shape} does not match k shape {k.shape}")
    g = _group_size(num_qo_heads, num_kv_heads)
    o = np.zeros((qo_len, num_qo_heads, v.shape[2]))
    lse = np.full((qo_len, num_qo_heads), -np.inf)
    if sinks is not None:
        lse[:] = np.asarray(sinks, dtype=np.float64) * LOG2E
    if kv_len == 0 or qo_len == 0:
        return o, lse
    qp = np.arange(kv_len - qo_len, kv_len) if q_positions is None else np.asarray(q_positions)
    kp = np.arange(kv_len) if k_positions is None else np.asarray(k_positions)
    dist = kp[None, :].astype(np.float64) - qp[:, None]  # [qo_len, kv_len], k_pos - q_pos
    k_h, v_h = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # kv head of each query head
    s = np.einsum("ihd,jhd->hij", q, k_h) * (sm_scale * k_scale)
    if alibi_slopes is not None:
        s = s + np.asarray(alibi_slopes, dtype=np.float64)[:, None, None] * dist[None]
    if logits_soft_cap > 0:
        s = logits_soft_cap * np.tanh(s / logits_soft_cap)
    visible = np.ones((qo_len, kv_len), dtype=bool)
    if causal:
        visible &= dist <= 0
    if window_left >= 0:
        visible &= -dist <= window_left
    if mask is not None:
        visible &= np.asarray(mask, dtype=bool).reshape(qo_len, kv_len)
    s = np.where(visible[None], s, -np.inf)
    if sinks is not None:  # the sink: key kv_len, value 0 (dropped from p before p @ v)
        sink = np.asarray(sinks, dtype=np.float64)[:, None, None]
        s = np.concatenate([s, np.broadcast_to(sink, (num_qo_heads, qo_len, 1))], axis=-1)
    m = s.max(axis=-1, keepdims=True)  # [Hq, qo_len, 1]
    empty = m == -np.inf
    m = np.where(empty, 0.0, m)
    p = np.exp(s - m)  # exp(-inf) = 0 for hidden keys
    denom = np.where(empty, 1.0, p.sum(axis=-1, keepdims=True))
    o = np.einsum("hij,jhd->ihd", (p / denom)[..., :kv_len], v_h) * v_scale
    lse = np.where(empty, -np.inf, (m + np.log(denom)) * LOG2E)[..., 0].T
    return o, lse


def decode_step_ref(
    q,
    k,
    v,
    k_positions,
    q_position: int,
    *,
    pos_encoding_mode: str = "NONE",
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    sm_scale: float,
    rope_scale: float = 1.0,
    rope_theta: float = 1e4,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks=None,
):
    """One decode query q [Hq, D] against keys k, v [n, Hkv, D] at absolute k_positions.

        ROPE_LLAMA: q = rope(q, q_position); k = rope(k, k_positions)
        ALIBI: slopes = alibi_slopes(Hq)
        o, lse = attention_ref(q[None], k, v, q_positions=[q_position], ...)[..][0]

    The keys may be any subset of the request (a split-KV chunk): positions stay absolute,
    so RoPE, ALiBi and the window see the same values as for the whole request.
    """
    _check_choice("pos_encoding_mode", pos_encoding_mode, POS_ENCODING_MODES)
    q, k = f64(q), f64(k)
    k_positions = np.asarray(k_positions, dtype=np.int64)
    if pos_encoding_mode == "ROPE_LLAMA":
        q = rope_ref_llama(q[None], [q_position], rope_scale, rope_theta)[0]
        k = rope_ref_llama(k, k_positions, rope_scale, rope_theta)
    slopes = alibi_slopes(q.shape[0]) if pos_encoding_mode == "ALIBI" else None
    o, lse = attention_ref(
        q[None],
        k,
        v,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        window_left=window_left,
        alibi_slopes=slopes,
        q_positions=[q_position],
        k_positions=k_positions,
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
    )
    return o[0], lse[0]


def decode_features(
    head_dim, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, sm_scale=None,
    rope_scale=None, rope_theta=None, q_scale=None, k_scale=None, v_scale=None,
) -> dict:  # fmt: skip
    """Keyword arguments of ``decode_step_ref`` with FlashInfer's defaults filled in.

    sm_scale = (sm_scale or 1 / sqrt(head_dim)) * (1 if q_scale is None else q_scale)
    cap, k_scale, v_scale, rope_scale, rope_theta: None -> 0, 1, 1, 1, 1e4
    """
    sm = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    return dict(
        pos_encoding_mode=pos_encoding_mode,
        window_left=int(window_left),
        logits_soft_cap=float(logits_soft_cap or 0.0),
        sm_scale=sm * (1.0 if q_scale is None else float(q_scale)),
        rope_scale=1.0 if rope_scale is None else float(rope_scale),
        rope_theta=1e4 if rope_theta is None else float(rope_theta),
        k_scale=1.0 if k_scale is None else float(k_scale),
        v_scale=1.0 if v_scale is None else float(v_scale),
    )


def single_decode_ref(
    q,
    k,
    v,
    *,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sm_scale: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    return_lse: bool = False,
):
    """``single_decode_with_kv_cache``: q [Hq, D], k/v [kv_len, Hkv, D] (NHD) or [Hkv, kv_len, D].

    o, lse = decode_step_ref(q, k, v, arange(kv_len), kv_len - 1, ...)
    """
    _check_choice("kv_layout", kv_layout, KV_LAYOUTS)
    k, v = f64(k), f64(v)
    if kv_layout == "HND":
        k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
    feats = decode_features(
        np.shape(q)[-1], pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
        rope_scale, rope_theta, q_scale, k_scale, v_scale,
    )  # fmt: skip
    o, lse = decode_step_ref(q, k, v, np.arange(k.shape[0]), k.shape[0] - 1, **feats)
    return (o, lse) if return_lse else o


def split_paged_kv_cache(paged_kv_cache, kv_layout: str = "NHD"):
    """(k_cache, v_cache) views, each [pages, page_size, H, D] (NHD) or [pages, H, page_size, D].

    Accepts a tuple of the two, or one 5-D array [pages, 2, ...] with keys at [:, 0].
    """
    _check_choice("kv_layout", kv_layout, KV_LAYOUTS)
    if isinstance(paged_kv_cache, (tuple, list)):
        k_cache, v_cache = paged_kv_cache
    else:
        cache = np.asarray(paged_kv_cache)
        if cache.ndim != 5 or cache.shape[1] != 2:
            raise ValueError(f"a single paged_kv_cache must be [pages, 2, ...], got {cache.shape}")
        k_cache, v_cache = cache[:, 0], cache[:, 1]
    if np.ndim(k_cache) != 4 or np.shape(k_cache)[:3] != np.shape(v_cache)[:3]:
        raise ValueError(f"bad k/v cache shapes {np.shape(k_cache)} and {np.shape(v_cache)}")
    return k_cache, v_cache


def cache_page_size(k_cache, kv_layout: str) -> int:
    """Tokens per page of a k or v cache in the given layout."""
    return int(np.shape(k_cache)[1 if kv_layout == "NHD" else 2])


def gather_pages_ref(cache, page_ids, kv_layout: str, num_tokens: int) -> np.ndarray:
    """The first num_tokens tokens stored in pages page_ids (in order), float64 [n, H, D]."""
    pages = np.asarray(cache)[np.asarray(page_ids, dtype=np.int64)]
    if kv_layout == "HND":
        pages = pages.transpose(0, 2, 1, 3)
    tokens = pages.reshape((-1,) + pages.shape[2:])
    return f64(tokens[:num_tokens])


def batch_decode_paged_ref(
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
    return_lse: bool = False,
    sinks=None,
):
    """``BatchDecodeWithPagedKVCacheWrapper`` (plan + run): q [B, Hq, D] -> o [B, Hq, D].

    pages_b = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
    kv_len_b = (len(pages_b) - 1) * page_size + kv_last_page_len[b]   (0 without pages)
    o[b], lse[b] = decode_step_ref(q[b], K[pages_b][:kv_len_b], V[...], arange(kv_len_b),
                                   kv_len_b - 1, ...)
    """
    q = f64(q)
    k_cache, v_cache = split_paged_kv_cache(paged_kv_cache, kv_layout)
    page_size = cache_page_size(k_cache, kv_layout)
    indptr = np.asarray(kv_indptr, dtype=np.int64)
    indices = np.asarray(kv_indices, dtype=np.int64)
    last = np.asarray(kv_last_page_len, dtype=np.int64)
    batch_size = q.shape[0]
    if indptr.shape != (batch_size + 1,) or last.shape != (batch_size,):
        raise ValueError(
            f"kv_indptr {indptr.shape} / kv_last_page_len {last.shape} do not match "
            f"batch_size ({batch_size})"
        )
    feats = decode_features(
        q.shape[-1], pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
        rope_scale, rope_theta, q_scale, k_scale, v_scale,
    )  # fmt: skip
    o = np.zeros((batch_size, q.shape[1], np.shape(v_cache)[-1]))
    lse = np.full((batch_size, q.shape[1]), -np.inf)
    for b in range(batch_size):
        pages = indices[indptr[b] : indptr[b + 1]]
        kv_len = (len(pages) - 1) * page_size + int(last[b]) if len(pages) else 0
        k = gather_pages_ref(k_cache, pages, kv_layout, kv_len)
        v = gather_pages_ref(v_cache, pages, kv_layout, kv_len)
        o[b], lse[b] = decode_step_ref(q[b], k, v, np.arange(kv_len), kv_len - 1, **feats,
                                       sinks=sinks)  # fmt: skip
    return (o, lse) if return_lse else o


def merge_state_ref(v_a, s_a, v_b, s_b):
    """Merge two partial attention states, v [n, H, D], s (base-2 LSE) [n, H].

        s = log2(2 ** s_a + 2 ** s_b)
        v = v_a * 2 ** (s_a - s) + v_b * 2 ** (s_b - s)
    An empty state (s = -inf) is the identity; two empty states give v = 0, s = -inf.
    """
    return merge_states_ref(
        np.stack([f64(v_a), f64(v_b)], axis=1), np.stack([f64(s_a), f64(s_b)], axis=1)
    )


def merge_states_ref(v, s):
    """Merge S partial states per row: v [n, S, H, D], s [n, S, H] -> (v [n, H, D], s [n, H]).

        m = max_k s[:, k];  w[:, k] = 2 ** (s[:, k] - m)
        s_out = m + log2(sum_k w);  v_out = sum_k w[:, k] v[:, k] / sum_k w
    Rows whose states are all empty (-inf, or S == 0) give v_out = 0, s_out = -inf.
    """
    v, s = f64(v), f64(s)
    n, _, h, d = v.shape
    if s.shape != v.shape[:3]:
        raise ValueError(f"s shape {s.shape} does not match v shape {v.shape}")
    if v.shape[1] == 0:
        return np.zeros((n, h, d)), np.full((n, h), -np.inf)
    m = s.max(axis=1)
    empty = m == -np.inf
    m = np.where(empty, 0.0, m)
    w = np.exp2(s - m[:, None])  # 0 for empty states
    total = np.where(empty, 1.0, w.sum(axis=1))
    weighted = np.where(w[..., None] > 0, w[..., None] * v, 0.0)  # empty states add nothing
    v_out = weighted.sum(axis=1) / total[..., None]
    s_out = np.where(empty, -np.inf, m + np.log2(total))
    return v_out, s_out


def append_paged_kv_cache_ref(
    append_key,
    append_value,
    batch_indices,
    positions,
    paged_kv_cache,
    kv_indices,
    kv_indptr,
    kv_last_page_len,
    kv_layout: str = "NHD",
):
    """``append_paged_kv_cache`` on a copy of the cache, which is returned (same structure).

        b, p = batch_indices[t], positions[t]
        page = kv_indices[kv_indptr[b] + p // page_size];  slot = p % page_size
        K[page, slot] = append_key[t];  V[page, slot] = append_value[t]   (HND: [page, :, slot])
    The table must already include the new tokens: 0 <= p < seq_len of request b. Rows with
    b < 0 or p < 0 (the padding get_batch_indices_positions writes) are skipped.
    """
    if isinstance(paged_kv_cache, (tuple, list)):
        out = tuple(np.array(c, copy=True) for c in paged_kv_cache)
    else:
        out = np.array(paged_kv_cache, copy=True)
    k_cache, v_cache = split_paged_kv_cache(out, kv_layout)
    page_size = cache_page_size(k_cache, kv_layout)
    indptr = np.asarray(kv_indptr, dtype=np.int64)
    indices = np.asarray(kv_indices, dtype=np.int64)
    last = np.asarray(kv_last_page_len, dtype=np.int64)
    keys, values = np.asarray(append_key), np.asarray(append_value)
    batch_indices, positions = np.asarray(batch_indices), np.asarray(positions)
    if not keys.shape[0] == values.shape[0] == batch_indices.shape[0] == positions.shape[0]:
        raise ValueError(
            f"append_key ({keys.shape[0]}), append_value ({values.shape[0]}), batch_indices "
            f"({batch_indices.shape[0]}) and positions ({positions.shape[0]}) differ in length"
        )
    for t in range(keys.shape[0]):
        b, p = int(batch_indices[t]), int(positions[t])
        if b < 0 or p < 0:
            continue
        num_pages = int(indptr[b + 1] - indptr[b])
        seq_len = (num_pages - 1) * page_size + int(last[b]) if num_pages else 0
        if not 0 <= p < seq_len:
            raise ValueError(f"positions[{t}] ({p}) is outside request {b} (seq_len {seq_len})")
        page = indices[indptr[b] + p // page_size]
        slot = p % page_size
        dst = (page, slot) if kv_layout == "NHD" else (page, slice(None), slot)
        k_cache[dst] = keys[t].astype(k_cache.dtype)
        v_cache[dst] = values[t].astype(v_cache.dtype)
    return out


# --- block-sparse attention ---


def block_sparse_ref(q, k, v, indptr, indices, R: int, C: int, *, sm_scale: float, mask=None,
                     causal: bool = False, logits_soft_cap: float = 0.0):  # fmt: skip
    """Block-sparse attention as FlashInfer defines it: block row i, queries iR..min(iR + R, M)
    of q [M, Hq, D], attends to the keys of its kept column blocks indices[indptr[i]:
    indptr[i + 1]] in that order (block j: keys jC..jC + C of k, v [N, Hkv, D]), key c of a
    kept block hidden where mask [nnz, R, C] is False; causal aligns the row's queries to the
    bottom right of its kept keys. (o, lse) as attention_ref's."""
    q, k, v = f64(q), f64(k), f64(v)
    indptr, indices = np.asarray(indptr, np.int64), np.asarray(indices, np.int64)
    M = q.shape[0]
    o = np.zeros((M, q.shape[1], v.shape[2]))
    lse = np.full((M, q.shape[1]), -np.inf)
    for i in range(indptr.shape[0] - 1):
        rows = np.arange(i * R, min(i * R + R, M))
        blocks = indices[indptr[i] : indptr[i + 1]]
        keys = (blocks[:, None] * C + np.arange(C)).reshape(-1)
        seen = None
        if mask is not None:
            seen = np.asarray(mask)[indptr[i] : indptr[i + 1], : rows.size]  # [kept, rows, C]
            seen = seen.transpose(1, 0, 2).reshape(rows.size, keys.size)
        o[rows], lse[rows] = attention_ref(q[rows], k[keys], v[keys], sm_scale=sm_scale,
                                           causal=causal, mask=seen,
                                           logits_soft_cap=logits_soft_cap)  # fmt: skip
    return o, lse


def block_sparse_dense_mask(M: int, N: int, indptr, indices, R: int, C: int, mask=None):
    """The M x N boolean matrix of the entries a block-sparse pattern keeps (and leaves
    unmasked): its attention without causal masking is attention_ref with this mask."""
    dense = np.zeros((M, N), bool)
    for i in range(len(indptr) - 1):
        rows = slice(i * R, min(i * R + R, M))
        for n, j in enumerate(indices[indptr[i] : indptr[i + 1]]):
            block = True if mask is None else np.asarray(mask)[indptr[i] + n, : min(R, M - i * R)]
            dense[rows, j * C : (j + 1) * C] = block
    return dense


def multi_item_visible_ref(qo_len: int, kv_len: int, prefix_len: int, token_pos) -> np.ndarray:
    """FlashInfer's multi-item scoring mask, element by element: bool [qo_len, kv_len]. Query i
    sits at key position x = i + kv_len - qo_len; token t >= prefix_len is at position
    token_pos[t - prefix_len] of its item (0: a delimiter). Key j is visible when j <= x, and,
    for a query past the prefix, when j is in the prefix or x < j + token_pos[x - prefix_len]."""
    visible = np.zeros((qo_len, kv_len), bool)
    for i in range(qo_len):
        x = i + kv_len - qo_len
        for j in range(kv_len):
            if j > x:
                continue
            if x < prefix_len or j < prefix_len:
                visible[i, j] = True
            else:
                visible[i, j] = x < j + int(token_pos[x - prefix_len])
    return visible


def variable_block_sparse_ref(q, k, v, block_mask_map, block_row_sz, block_col_sz, *,
                              sm_scale: float, causal: bool = False):  # fmt: skip
    """FlashInfer's variable block-sparse attention: q [Hq, L, D], k, v [Hkv, Lk, D]; kv head
    h's row block r (its block_row_sz[h][r] queries, of each query head of h's group) attends
    to the keys of the column blocks c with block_mask_map[h][r][c], in column order; causal
    aligns the block's queries to the bottom right of its kept keys. (o [Hq, L, D], lse
    [Hq, L]) as attention_ref's."""
    q, k, v = f64(q), f64(k), f64(v)
    hq, L, _ = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    o = np.zeros((hq, L, v.shape[2]))
    lse = np.full((hq, L), -np.inf)
    for h in range(hkv):
        row0, col0 = np.cumsum(block_row_sz[h]) - block_row_sz[h], np.cumsum(block_col_sz[h])
        col0 = col0 - np.asarray(block_col_sz[h])
        for r, n in enumerate(block_row_sz[h]):
            rows = np.arange(row0[r], row0[r] + n)
            keys = [np.arange(col0[c], col0[c] + block_col_sz[h][c])
                    for c in range(len(block_col_sz[h])) if block_mask_map[h][r][c]]  # fmt: skip
            keys = np.concatenate(keys) if keys else np.zeros(0, np.int64)
            heads = slice(h * g, (h + 1) * g)
            oi, li = attention_ref(q[heads, rows].transpose(1, 0, 2), k[h, keys][:, None],
                                   v[h, keys][:, None], sm_scale=sm_scale,
                                   causal=causal)  # fmt: skip
            o[heads, rows], lse[heads, rows] = oi.transpose(1, 0, 2), li.T
    return o, lse
