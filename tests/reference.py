"""Naive float64 NumPy references of the norms, gated activations and RoPE, and the helpers
the others share (reference_attention.py and reference_sampling.py hold the rest: together, one
per public op). Inputs of any dtype are read as float64.

These define what the kernels compute; they are written for clarity, never for speed, and no
kernel of ours is ever used as a reference for another.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from rtcinfer.interop.dtypes import numpy_dtype


def f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def round_to(x, dtype: str) -> np.ndarray:
    """float64 values rounded to `dtype` (round to nearest even), back in float64."""
    return f64(np.asarray(x, dtype=np.float64).astype(numpy_dtype(dtype)))


# --- norms ------------------------------------------------------------------------------------


def rmsnorm_ref(x, weight, eps=1e-6):
    x = f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * f64(weight)


def gemma_rmsnorm_ref(x, weight, eps=1e-6):
    return rmsnorm_ref(x, 1.0 + f64(weight), eps)


def fused_add_rmsnorm_ref(x, residual, weight, eps=1e-6, dtype="float32"):
    """(out, new_residual): the sum is stored in `dtype`, and the norm reads the stored sum."""
    new_residual = round_to(f64(x) + f64(residual), dtype)
    return rmsnorm_ref(new_residual, weight, eps), new_residual


def gemma_fused_add_rmsnorm_ref(x, residual, weight, eps=1e-6, dtype="float32"):
    new_residual = round_to(f64(x) + f64(residual), dtype)
    return gemma_rmsnorm_ref(new_residual, weight, eps), new_residual


def layernorm_ref(x, gamma, beta, eps=1e-6):
    x = f64(x)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * f64(gamma) + f64(beta)


def fp8_quant_ref(y, scale, dtype: str) -> np.ndarray:
    """y / scale saturated to fp8 `dtype`'s largest finite value (NaN stays NaN), in float64 and
    not yet rounded: the norms with an fp8 output round it (fp8_rounding_bounds)."""
    top = float(ml_dtypes.finfo(numpy_dtype(dtype)).max)  # (NumPy's finfo may not know fp8)
    with np.errstate(invalid="ignore"):
        return np.clip(f64(y) / float(scale), -top, top)


def fp8_rounding_bounds(exact, dtype: str, rel: float = 1e-5) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi): exact's values rounded to `dtype` after a relative nudge of -rel and +rel, in
    float64. A kernel that computes exact in fp32 (to ~1e-6) and rounds it to nearest lands in
    [lo, hi]: the rounding itself, or its neighbour where exact lies within rel of a midpoint."""
    exact = f64(exact)
    top = float(ml_dtypes.finfo(numpy_dtype(dtype)).max)
    low, high = exact - rel * np.abs(exact), exact + rel * np.abs(exact)
    return (round_to(np.clip(low, -top, top), dtype), round_to(np.clip(high, -top, top), dtype))


# --- gated activations ------------------------------------------------------------------------


def _split(x):
    x = f64(x)
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def silu_and_mul_ref(x):
    a, b = _split(x)
    return a / (1.0 + np.exp(-a)) * b


def gelu_and_mul_ref(x):
    a, b = _split(x)
    erf = np.vectorize(math.erf)
    return 0.5 * a * (1.0 + erf(a / math.sqrt(2.0))) * b


def gelu_tanh_and_mul_ref(x):
    a, b = _split(x)
    return 0.5 * a * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a**3))) * b


# --- rotary embedding -------------------------------------------------------------------------


def rope_inv_freq(rotary_dim, rope_scale=1.0, rope_theta=1e4):
    """inv_freq[i] = rope_theta ** (-2 i / rotary_dim) / rope_scale, i < rotary_dim / 2."""
    i = np.arange(rotary_dim // 2, dtype=np.float64)
    return rope_theta ** (-2.0 * i / rotary_dim) / rope_scale


def llama31_inv_freq(
    rotary_dim, rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
    old_context_len=8192,
):  # fmt: skip
    """Llama 3.1: keep high frequencies, divide low ones by rope_scale, ramp in between."""
    inv = rope_inv_freq(rotary_dim, 1.0, rope_theta)
    wavelen = 2 * math.pi / inv
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smooth = np.clip(smooth, 0.0, 1.0)
    return (1 - smooth) * inv / rope_scale + smooth * inv


def positions_from_indptr(indptr, offsets):
    """pos[t] = offsets[b] + t - indptr[b] for indptr[b] <= t < indptr[b+1]."""
    indptr, offsets = np.asarray(indptr, np.int64), np.asarray(offsets, np.int64)
    counts = np.diff(indptr)
    request = np.repeat(np.arange(len(counts)), counts)
    t = np.arange(indptr[-1])
    return offsets[request] + t - indptr[request]


def rope_ref(x, positions, rotary_dim, interleave=False, inv_freq=None, cos_sin=None):
    """x: [nnz, H, D]; rotates the first rotary_dim dims of every head, the rest pass through.

    Angles are pos * inv_freq, or cos/sin rows [nnz, rotary_dim / 2] each given as `cos_sin`.
    """
    x = f64(x)
    out = x.copy()
    pos = np.asarray(positions, dtype=np.float64)
    if cos_sin is None:
        angle = pos[:, None] * np.asarray(inv_freq, np.float64)[None, :]
        cos, sin = np.cos(angle), np.sin(angle)
    else:
        cos, sin = (f64(c) for c in cos_sin)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = rotary_dim // 2
    if interleave:
        a, b = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = a * cos - b * sin
        out[..., 1:rotary_dim:2] = b * cos + a * sin
    else:
        a, b = x[..., :half], x[..., half:rotary_dim]
        out[..., :half] = a * cos - b * sin
        out[..., half:rotary_dim] = b * cos + a * sin
    return out


def rope_cos_sin_cache_ref(x, positions, cos_sin_cache, interleave=False):
    """RoPE from a [max_pos, R] table: cos = cache[pos, :R/2], sin = cache[pos, R/2:]."""
    cache = f64(cos_sin_cache)
    rotary_dim = cache.shape[1]
    rows = cache[np.asarray(positions, np.int64)]
    cos_sin = (rows[:, : rotary_dim // 2], rows[:, rotary_dim // 2 :])
    return rope_ref(x, positions, rotary_dim, interleave, cos_sin=cos_sin)


# --- RoPE with fp8 outputs (rope_quantize_fp8 and its append to a paged cache) ----------------


def fp8_scaled_ref(y, scale, dtype: str) -> np.ndarray:
    """scale * y saturated to fp8 `dtype`'s largest finite value (NaN stays NaN), in float64 and
    not yet rounded (tests.checks.assert_fp8 rounds it)."""
    top = float(ml_dtypes.finfo(numpy_dtype(dtype)).max)
    with np.errstate(invalid="ignore"):
        return np.clip(f64(y) * float(scale), -top, top)


def rope_quantize_ref(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, interleave,
                      scale_q, scale_kv, dtype: str):  # fmt: skip
    """(q_rope, k_rope, q_nope, k_nope) outputs of rope_quantize_fp8, exact before rounding:
    the rotary parts rotated by cos_sin_cache's rows (a position outside the table: unrotated),
    every part times its scale, saturated. k_rope / k_nope may be [nnz, D] (MLA); a None nope
    part gives [.., 0]."""
    nnz, hq, rope_dim = np.shape(q_rope)
    k3 = f64(k_rope) if np.ndim(k_rope) == 3 else f64(k_rope)[:, None, :]
    pos = np.asarray(pos_ids, np.int64)
    inside = (pos >= 0) & (pos < np.shape(cos_sin_cache)[0])
    rotated = []
    for x in (f64(q_rope), k3):
        out = x.copy()
        if inside.any():
            out[inside] = rope_cos_sin_cache_ref(x[inside], pos[inside], cos_sin_cache, interleave)
        rotated.append(out)
    k_out = rotated[1] if np.ndim(k_rope) == 3 else rotated[1][:, 0, :]
    q_nope = np.zeros((nnz, hq, 0)) if q_nope is None else f64(q_nope)
    k_lead = np.shape(k_rope)[:-1]
    k_nope = np.zeros((*k_lead, 0)) if k_nope is None else f64(k_nope)
    return (
        fp8_scaled_ref(rotated[0], scale_q, dtype),
        fp8_scaled_ref(k_out, scale_kv, dtype),
        fp8_scaled_ref(q_nope, scale_q, dtype),
        fp8_scaled_ref(k_nope, scale_kv, dtype),
    )


def rope_quantize_append_ref(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, caches,
                             kv_indices, kv_indptr, batch_indices, positions, interleave,
                             scale_q, scale_kv, dtype: str, page_size: int,
                             kv_layout="NHD"):  # fmt: skip
    """(q_rope_out, q_nope_out, cache_0, cache_1) of rope_quantize_fp8_append_paged_kv_cache,
    exact before rounding: the q parts as rope_quantize_ref's (zeros for a padding token, b < 0
    or p < 0); `caches` (their current values, any dtype) with token t's quantized k (and v)
    in page kv_indices[kv_indptr[b] + p // page_size], slot p % page_size: GQA (a 3-D k_rope)
    caches (k, v) [pages, page_size, Hk, R + N] (NHD; HND [pages, Hk, page_size, R + N]), k's
    row its rotary part then the rest; MLA caches (ckv [.., N], kpe [.., R])."""
    qr, kr, qn, kn = rope_quantize_ref(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids,
                                       interleave, scale_q, scale_kv, dtype)  # fmt: skip
    b_all, p_all = np.asarray(batch_indices, np.int64), np.asarray(positions, np.int64)
    padding = (b_all < 0) | (p_all < 0)
    qr[padding], qn[padding] = 0.0, 0.0
    c0, c1 = (f64(c).copy() for c in caches)
    mla = np.ndim(k_rope) == 2
    vq = None if mla else fp8_scaled_ref(v, scale_kv, dtype)
    indptr, indices = np.asarray(kv_indptr, np.int64), np.asarray(kv_indices, np.int64)
    for t in np.flatnonzero(~padding):
        b, p = int(b_all[t]), int(p_all[t])
        page = int(indices[indptr[b] + p // page_size])
        slot = p % page_size
        if mla:
            c0[page, slot], c1[page, slot] = kn[t], kr[t]
        else:
            row = np.concatenate([kr[t], kn[t]], axis=-1)  # [Hk, R + N]
            if kv_layout == "NHD":
                c0[page, slot], c1[page, slot] = row, vq[t]
            else:
                c0[page, :, slot], c1[page, :, slot] = row, vq[t]
    return qr, qn, c0, c1
