"""Rotary position embedding on q and k in one launch (FlashInfer's names and defaults).

Positions come from `pos_ids` (one per token) or from ragged `indptr`/`offsets` (token t of
request b sits at offsets[b] + t - indptr[b]). Frequencies: rope_theta ** (-2 i / rotary_dim)
/ rope_scale, the Llama 3.1 band smoothing, or a precomputed cos/sin cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import jit
from .interop import Out, dtype_name, run
from .interop.arrays import dense
from .interop.dtypes import FLOAT_DTYPES, itemsize
from .layout import fit_vec, widest_vec

MODES = ("theta", "llama31", "cos_sin_cache")


@dataclass(frozen=True)
class RopeSpec:
    dtype: str
    pos_dtype: str
    head_dim: int
    rotary_dim: int
    interleave: bool
    mode: str
    pos_from: str  # "pos_ids" or "indptr"
    inplace: bool
    vec: int
    source: ClassVar[str] = "rope.cu"
    kernels: ClassVar[tuple[str, ...]] = ("rope_kernel",)

    threads: ClassVar[int] = 256

    @property
    def unroll(self) -> int:
        """Head rows per batch of loads: 8 x 16 bytes in flight per lane (4 x 32 for wide rows)."""
        return 8 if self.vec * itemsize(self.dtype) <= 16 else 4

    @property
    def tokens_per_cta(self) -> int:
        lanes = self.head_dim // self.vec
        return self.threads // (1 << (lanes - 1).bit_length())

    def prelude(self) -> str:
        return jit.prelude(
            T=self.dtype,
            POS_T=self.pos_dtype,
            HEAD_DIM=self.head_dim,
            ROTARY_DIM=self.rotary_dim,
            VEC=self.vec,
            THREADS=self.threads,
            UNROLL=self.unroll,
            INTERLEAVE=self.interleave,
            MODE=MODES.index(self.mode),
            POS_FROM=int(self.pos_from == "indptr"),
            INPLACE=self.inplace,
        )


def rope_vec(dtype: str, head_dim: int, rotary_dim: int, interleave: bool) -> int:
    """Elements per lane: 16 bytes where the rotary boundaries allow, and a row <= 32 lanes."""
    unit = math.gcd(head_dim, rotary_dim if interleave else rotary_dim // 2)
    vec = widest_vec(unit, itemsize(dtype))
    while head_dim // vec > 32 and unit % (2 * vec) == 0:
        vec *= 2
    if head_dim // vec > 32 or (interleave and vec < 2):
        raise ValueError(
            f"head_dim {head_dim} with rotary_dim {rotary_dim} (interleave={interleave}) is "
            f"not supported: rows must split into at most 32 equal aligned vectors"
        )
    return vec


def _head_strides(arr, num_heads: int, head_dim: int) -> tuple[int, int]:
    """(token, head) strides in elements of [nnz, H, D] or of its flattened [nnz, H * D] form."""
    item = arr.itemsize
    if arr.ndim == 3:
        if arr.shape[2] > 1 and arr.strides[2] != item:
            raise ValueError(f"the head dimension must be contiguous, got strides {arr.strides}")
        return arr.strides[0] // item, arr.strides[1] // item
    if arr.shape[1] > 1 and arr.strides[1] != item:
        raise ValueError(f"the last dimension must be contiguous, got strides {arr.strides}")
    return arr.strides[0] // item, head_dim


def _launch(stream, ins, outs, *, spec: RopeSpec, head_dim: int, params: tuple):
    q_out, k_out = outs
    q, k = (q_out, k_out) if spec.inplace else (ins[0], ins[1])
    names = ("cos_sin_cache",) if spec.mode == "cos_sin_cache" else ()
    names = (("pos_ids",) if spec.pos_from == "pos_ids" else ("indptr", "offsets")) + names
    extra = [dense(x, n) for x, n in zip(ins[2:], names, strict=True)]  # read as dense arrays
    nnz = q.shape[0]
    hq = q.size // (nnz * head_dim) if nnz else 0
    hk = k.size // (nnz * head_dim) if nnz else 0
    if hq + hk == 0:
        return
    strides = [
        *_head_strides(q, hq, head_dim),
        *_head_strides(k, hk, head_dim),
        *_head_strides(q_out, hq, head_dim),
        *_head_strides(k_out, hk, head_dim),
    ]
    pointers = [a.data.ptr for a in (q, k, q_out, k_out)]
    vec = fit_vec(spec.vec, itemsize(spec.dtype), pointers, strides)
    if vec != spec.vec:
        if head_dim // vec > 32 or (spec.interleave and vec < 2):
            raise ValueError(f"q and k rows are not aligned to {spec.vec} elements")
        spec = RopeSpec(**{**spec.__dict__, "vec": vec})
    fn = jit.get_function(spec, "rope_kernel")
    pos_ids = indptr = offsets = cache = 0
    if spec.mode == "cos_sin_cache":
        pos_ids, cache = extra
    elif spec.pos_from == "pos_ids":
        (pos_ids,) = extra
    else:
        indptr, offsets = extra
    batch = offsets.shape[0] if spec.pos_from == "indptr" else 0
    sms = jit.sm_count(q.device.id)
    rows = hq + hk
    unroll = spec.unroll
    chunks = min(-(-rows // unroll), max(1, -(-sms * 2 * spec.tokens_per_cta // nnz)))
    rows_per_item = -(-rows // chunks // unroll) * unroll  # a multiple of unroll
    items = nnz * -(-rows // rows_per_item)
    resident = jit.occupancy(fn, spec.threads) * sms  # persistent: the table is built once
    grid = min(-(-items // spec.tokens_per_cta), resident)
    args = (
        q,
        *strides[0:2],
        k,
        *strides[2:4],
        q_out,
        *strides[4:6],
        k_out,
        *strides[6:8],
        pos_ids,
        indptr,
        offsets,
        cache,
        np.int32(nnz),
        np.int32(hq),
        np.int32(hk),
        np.int32(batch),
        np.int32(rows_per_item),
        *(np.float32(p) for p in params),
    )
    fn((grid, 1, 1), (spec.threads, 1, 1), args, stream=stream)


def _rope(q, k, positions, mode, inplace, rotary_dim, interleave, params, out=None, head_dim=None):
    """positions: [("pos_ids", a)], [("indptr", a), ("offsets", b)] or cache inputs."""
    dtype = dtype_name(q)
    if dtype not in FLOAT_DTYPES or dtype_name(k) != dtype:
        raise TypeError(f"q and k must share a float dtype, got {dtype} and {dtype_name(k)}")
    if len(q.shape) not in (2, 3) or len(k.shape) != len(q.shape):
        raise ValueError(f"q and k must be [nnz, heads, head_dim], got {q.shape} and {k.shape}")
    head_dim = q.shape[-1] if head_dim is None else head_dim
    if head_dim < 1:
        raise ValueError(f"head_dim must be at least 1, got {head_dim}")
    if len(q.shape) == 3:  # [nnz, heads, head_dim]
        rows_fit = q.shape[-1] == k.shape[-1] == head_dim
    else:  # [nnz, heads * head_dim]
        rows_fit = q.shape[-1] % head_dim == 0 and k.shape[-1] % head_dim == 0
    if q.shape[0] != k.shape[0] or not rows_fit:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [nnz, heads, {head_dim}] or "
            f"[nnz, heads * {head_dim}] with the same nnz"
        )
    _check_positions(positions, q.shape[0])
    rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be even and in (0, {head_dim}]")
    pos_dtype = dtype_name(positions[0][1])
    if pos_dtype not in ("int32", "int64"):
        raise TypeError(f"{positions[0][0]}: dtype must be int32 or int64, got {pos_dtype}")
    if mode != "cos_sin_cache" and len(positions) == 2 and dtype_name(positions[1][1]) != pos_dtype:
        raise TypeError(f"indptr ({pos_dtype}) and offsets must share a dtype")
    vec = rope_vec(dtype, head_dim, rotary_dim, interleave)
    pos_from = "indptr" if positions[0][0] == "indptr" else "pos_ids"
    spec = RopeSpec(
        dtype, pos_dtype, head_dim, rotary_dim, interleave, mode, pos_from, inplace, vec
    )
    if inplace:
        outs = [Out(tuple(x.shape), dtype, alias=i) for i, x in enumerate((q, k))]
    else:
        given = (None, None) if out is None else tuple(out)
        outs = [Out(tuple(x.shape), dtype, g) for x, g in zip((q, k), given, strict=True)]
    ins = [("q", q), ("k", k), *positions]
    return run(_launch, ins, outs, spec=spec, head_dim=head_dim, params=params)


def _check_positions(positions, nnz: int) -> None:
    """pos_ids / positions [nnz]; indptr [B + 1] and offsets [B] with B >= 1 when nnz > 0."""
    (first, a), *rest = positions
    if first == "indptr":
        offsets = rest[0][1]
        if len(a.shape) != 1 or len(offsets.shape) != 1 or a.shape[0] != offsets.shape[0] + 1:
            raise ValueError(
                f"indptr and offsets must be [B + 1] and [B], got {tuple(a.shape)} and "
                f"{tuple(offsets.shape)}"
            )
        if nnz and not offsets.shape[0]:
            raise ValueError(f"{nnz} tokens need at least one request in indptr / offsets")
    elif tuple(a.shape) != (nnz,):
        raise ValueError(f"{first}: expected shape ({nnz},), got {tuple(a.shape)}")


def _ragged(indptr, offsets):
    return [("indptr", indptr), ("offsets", offsets)]


def _theta(rope_scale, rope_theta):
    return (float(rope_scale), float(rope_theta), 1.0, 1.0, 1.0)


def _llama31(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len):
    params = (rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    return tuple(float(p) for p in params)


def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1.0,
               rope_theta=1e4, *, out=None):  # fmt: skip
    """RoPE at ragged positions; returns (q_rope, k_rope), written to `out` = (q_out, k_out)
    when given.

    pos[t] = offsets[b] + t - indptr[b] for indptr[b] <= t < indptr[b+1]
    q_rope[t, h, i] = q[t, h, i] cos(pos f_i) - q[t, h, i + R/2] sin(pos f_i),  i < R/2
    q_rope[t, h, i] = q[t, h, i] cos(pos f_j) + q[t, h, i - R/2] sin(pos f_j),  j = i - R/2
    f_i = rope_theta ** (-2 i / R) / rope_scale, R = rotary_dim; interleave pairs (2i, 2i+1).
    q: [nnz, Hq, D], k: [nnz, Hk, D] (token and head strides free); indptr [B+1], offsets [B].
    """
    params = _theta(rope_scale, rope_theta)
    return _rope(q, k, _ragged(indptr, offsets), "theta", False, rotary_dim, interleave, params,
                 out)  # fmt: skip


def apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1.0,
                       rope_theta=1e4):  # fmt: skip
    """`apply_rope` writing q and k in place; returns (q, k) (new arrays for JAX)."""
    params = _theta(rope_scale, rope_theta)
    return _rope(q, k, _ragged(indptr, offsets), "theta", True, rotary_dim, interleave, params)


def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1.0,
                       rope_theta=1e4, *, out=None):  # fmt: skip
    """RoPE with one position per token, pos_ids: [nnz] int32/int64; returns (q_rope, k_rope)."""
    params = _theta(rope_scale, rope_theta)
    return _rope(q, k, [("pos_ids", pos_ids)], "theta", False, rotary_dim, interleave, params,
                 out)  # fmt: skip


def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1.0,
                               rope_theta=1e4):  # fmt: skip
    """`apply_rope_pos_ids` writing q and k in place; returns (q, k)."""
    params = _theta(rope_scale, rope_theta)
    return _rope(q, k, [("pos_ids", pos_ids)], "theta", True, rotary_dim, interleave, params)


def apply_llama31_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8.0,
                       rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
                       old_context_len=8192, *, out=None):  # fmt: skip
    """`apply_rope` with Llama 3.1 frequencies: f = theta ** (-2i/R), wavelength w = 2 pi / f,
    s = clip((old_context_len / w - low_freq_factor) / (high_freq_factor - low_freq_factor), 0, 1),
    f' = (1 - s) f / rope_scale + s f."""
    params = _llama31(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    return _rope(q, k, _ragged(indptr, offsets), "llama31", False, rotary_dim, interleave,
                 params, out)  # fmt: skip


def apply_llama31_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False,
                               rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0,
                               high_freq_factor=4.0, old_context_len=8192):  # fmt: skip
    """`apply_llama31_rope` writing q and k in place; returns (q, k)."""
    params = _llama31(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    return _rope(q, k, _ragged(indptr, offsets), "llama31", True, rotary_dim, interleave, params)


def apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8.0,
                               rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
                               old_context_len=8192, *, out=None):  # fmt: skip
    """Llama 3.1 RoPE with one position per token; returns (q_rope, k_rope)."""
    params = _llama31(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    return _rope(q, k, [("pos_ids", pos_ids)], "llama31", False, rotary_dim, interleave, params,
                 out)  # fmt: skip


def apply_llama31_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False,
                                       rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0,
                                       high_freq_factor=4.0, old_context_len=8192):  # fmt: skip
    """`apply_llama31_rope_pos_ids` writing q and k in place; returns (q, k)."""
    params = _llama31(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    return _rope(q, k, [("pos_ids", pos_ids)], "llama31", True, rotary_dim, interleave, params)


def _with_cache(positions, query, key, head_size, cos_sin_cache, is_neox, inplace, out=None):
    if dtype_name(cos_sin_cache) != "float32" or len(cos_sin_cache.shape) != 2:
        raise TypeError(
            f"cos_sin_cache: expected float32 [max_pos, rotary_dim], got "
            f"{dtype_name(cos_sin_cache)} {tuple(cos_sin_cache.shape)}"
        )
    pos = [("positions", positions), ("cos_sin_cache", cos_sin_cache)]
    return _rope(query, key, pos, "cos_sin_cache", inplace, cos_sin_cache.shape[1], not is_neox,
                 _theta(1, 1), out, int(head_size))  # fmt: skip


def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True,
                                  *, out=None):  # fmt: skip
    """RoPE from a cos/sin table: cos = cache[pos, :R/2], sin = cache[pos, R/2:].

    query: [nnz, Hq * head_size] or [nnz, Hq, head_size]; key likewise; positions [nnz];
    is_neox=True rotates halves, False rotates interleaved pairs. Returns (query, key) rotated.
    """
    return _with_cache(positions, query, key, head_size, cos_sin_cache, is_neox, False, out)


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                          is_neox=True):  # fmt: skip
    """`apply_rope_with_cos_sin_cache` writing query and key in place; returns (query, key)."""
    return _with_cache(positions, query, key, head_size, cos_sin_cache, is_neox, True)


def specs_for(head_dim: int, dtypes=("bfloat16", "float16")) -> list[RopeSpec]:
    """What a model's attention uses (warmup): full rotary dim, theta or Llama 3.1 frequencies,
    ragged positions in place, and one position per token in place or into new arrays."""
    forms = [("indptr", True), ("pos_ids", True), ("pos_ids", False)]
    specs = []
    for d in dtypes:
        vec = rope_vec(d, head_dim, head_dim, False)
        for mode in ("theta", "llama31"):
            for pos_from, inplace in forms:
                specs.append(
                    RopeSpec(d, "int32", head_dim, head_dim, False, mode, pos_from, inplace, vec)
                )
    return specs
