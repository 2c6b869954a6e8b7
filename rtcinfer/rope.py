"""Rotary position embedding on q and k in one launch (FlashInfer's names and defaults).

Positions come from `pos_ids` (one per token) or from ragged `indptr`/`offsets` (token t of
request b sits at offsets[b] + t - indptr[b]). Frequencies: rope_theta ** (-2 i / rotary_dim)
/ rope_scale, the Llama 3.1 band smoothing, or a precomputed cos/sin cache.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass
from typing import ClassVar

from . import errors, jit
from .errors import BadIndex
from .interop import Fill, Op, OutSlot, Prepared, call, dense_strides, no_launch, one_launch
from .interop.arrays import compilable
from .interop.dtypes import FLOAT_DTYPES, itemsize
from .interop.shortcut import Shortcut
from .launch import Kernel, Launch
from .layout import fit_vec, widest_vec
from .rope_table import table_writer


class RopeMode(enum.IntEnum):
    THETA = 0
    LLAMA31 = 1
    COS_SIN_CACHE = 2


class PositionSource(enum.IntEnum):
    POS_IDS = 0
    INDPTR_OFFSETS = 1


MODES = {"theta": RopeMode.THETA, "llama31": RopeMode.LLAMA31,
         "cos_sin_cache": RopeMode.COS_SIN_CACHE}  # fmt: skip
POSITION_SOURCES = {"pos_ids": PositionSource.POS_IDS, "indptr": PositionSource.INDPTR_OFFSETS}


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
    structs: ClassVar[tuple[str, ...]] = ("RopeParams",)  # crossing the seam

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
            MODE=MODES[self.mode],
            POS_FROM=POSITION_SOURCES[self.pos_from],
            INPLACE=self.inplace,
            BadIndex=BadIndex,
        )


def rope_vec(dtype: str, head_dim: int, rotary_dim: int, interleave: bool) -> int:
    """Elements per lane: 16 bytes where the rotary boundaries allow, and a row <= 32 lanes."""
    unit = math.gcd(head_dim, rotary_dim if interleave else rotary_dim // 2)
    vec = widest_vec(unit, itemsize(dtype))
    while head_dim // vec > 32 and unit % (2 * vec) == 0:
        vec *= 2
    if not _lanes_fit(vec, head_dim, interleave):
        raise ValueError(
            f"head_dim {head_dim} with rotary_dim {rotary_dim} (interleave={interleave}) is "
            f"not supported: rows must split into at most 32 equal aligned vectors"
        )
    return vec


def _lanes_fit(vec: int, head_dim: int, interleave: bool) -> bool:
    """Whether a row splits into at most 32 lanes of `vec` (interleaved: whole pairs)."""
    return head_dim // vec <= 32 and not (interleave and vec < 2)


# ---------------------------------------------------------------- validation (per signature)


def _check_qk(q, k, head_dim: int | None) -> tuple[str, int]:
    """(dtype, head_dim) of q and k: [nnz, heads, head_dim] or [nnz, heads * head_dim]."""
    dtype = q.dtype
    if dtype not in FLOAT_DTYPES or k.dtype != dtype:
        raise TypeError(f"q and k must share a float dtype, got {dtype} and {k.dtype}")
    if q.ndim not in (2, 3) or k.ndim != q.ndim:
        raise ValueError(f"q and k must be [nnz, heads, head_dim], got {q.shape} and {k.shape}")
    head_dim = q.shape[-1] if head_dim is None else head_dim
    if head_dim < 1:
        raise ValueError(f"head_dim must be at least 1, got {head_dim}")
    if q.ndim == 3:  # [nnz, heads, head_dim]
        rows_fit = q.shape[-1] == k.shape[-1] == head_dim
    else:  # [nnz, heads * head_dim]
        rows_fit = q.shape[-1] % head_dim == 0 and k.shape[-1] % head_dim == 0
    if q.shape[0] != k.shape[0] or not rows_fit:
        raise ValueError(
            f"q {q.shape} and k {k.shape} must be [nnz, heads, {head_dim}] or "
            f"[nnz, heads * {head_dim}] with the same nnz"
        )
    return dtype, head_dim


def _check_positions(names: tuple[str, ...], arrays, nnz: int) -> None:
    """pos_ids / positions [nnz]; indptr [B + 1] and offsets [B] with B >= 1 when nnz > 0."""
    (first, a), *rest = zip(names, arrays, strict=True)
    if first == "indptr":
        offsets = rest[0][1]
        if a.ndim != 1 or offsets.ndim != 1 or a.shape[0] != offsets.shape[0] + 1:
            raise ValueError(
                f"indptr and offsets must be [B + 1] and [B], got {a.shape} and {offsets.shape}"
            )
        if nnz and not offsets.shape[0]:
            raise ValueError(f"{nnz} tokens need at least one request in indptr / offsets")
    elif a.shape != (nnz,):
        raise ValueError(f"{first}: expected shape ({nnz},), got {a.shape}")


def _check_pos_dtype(names: tuple[str, ...], arrays) -> None:
    """Positions are int32 or int64; indptr and offsets of one dtype."""
    dtype = arrays[0].dtype
    if dtype not in ("int32", "int64"):
        raise TypeError(f"{names[0]}: dtype must be int32 or int64, got {dtype}")
    if names[0] == "indptr" and arrays[1].dtype != dtype:
        raise TypeError(f"indptr ({dtype}) and offsets must share a dtype")


def _check_out(out, like, dtype: str, name: str) -> None:
    if out is not None and (out.shape != like.shape or out.dtype != dtype):
        raise ValueError(
            f"{name}: expected shape {like.shape} and dtype {dtype}, "
            f"got shape {out.shape} and dtype {out.dtype}"
        )


def _head_strides(a, head_dim: int) -> tuple[int, int]:
    """(token, head) strides in elements of [nnz, H, D] or of its flattened [nnz, H * D] form."""
    if a.ndim == 3:
        if a.shape[2] > 1 and a.strides[2] != 1:
            raise ValueError(f"the head dimension must be contiguous, got strides {a.strides}")
        return a.strides[0], a.strides[1]
    if a.shape[1] > 1 and a.strides[1] != 1:
        raise ValueError(f"the last dimension must be contiguous, got strides {a.strides}")
    return a.strides[0], head_dim


def _signature(positions: tuple[str, ...], infos, static: tuple):
    """Validates a call: (spec before alignment, the outputs, (q, k, q_out, k_out) as the
    kernel reads and writes them)."""
    mode, inplace, rotary_dim, interleave, head_dim = static
    q, k, *pos, q_out, k_out = infos
    if mode == "cos_sin_cache":
        cache = pos[1]
        if cache.dtype != "float32" or cache.ndim != 2:
            raise TypeError(
                f"cos_sin_cache: expected float32 [max_pos, rotary_dim], got {cache.dtype} "
                f"{cache.shape}"
            )
        rotary_dim = cache.shape[1]
    dtype, head_dim = _check_qk(q, k, None if head_dim is None else int(head_dim))
    _check_positions(positions, pos, q.shape[0])
    rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be even and in (0, {head_dim}]")
    _check_pos_dtype(positions, pos)
    interleave = bool(interleave)
    vec = rope_vec(dtype, head_dim, rotary_dim, interleave)
    pos_from = "indptr" if positions[0] == "indptr" else "pos_ids"
    spec = RopeSpec(dtype, pos[0].dtype, head_dim, rotary_dim, interleave, mode, pos_from,
                    inplace, vec)  # fmt: skip
    if inplace:
        outs = (OutSlot(q.shape, dtype, 0, alias=True), OutSlot(k.shape, dtype, 1, alias=True))
        return spec, outs, (q, k, q, k)
    _check_out(q_out, q, dtype, "out[0]")
    _check_out(k_out, k, dtype, "out[1]")
    n = len(infos)
    outs = (OutSlot(q.shape, dtype, None if q_out is None else n - 2),
            OutSlot(k.shape, dtype, None if k_out is None else n - 1))  # fmt: skip
    qo = q_out if q_out is not None else q._replace(strides=dense_strides(q.shape), offset=0)
    ko = k_out if k_out is not None else k._replace(strides=dense_strides(k.shape), offset=0)
    return spec, outs, (q, k, qo, ko)


# ---------------------------------------------------------------- launch


def _prepare(positions: tuple[str, ...], infos, _align: int, static: tuple) -> Prepared:
    """Slots (q, k, *positions, q_out, k_out) -> (q_rope, k_rope): new arrays, the given
    outs, or (inplace) q and k updated. Pointers: the slots', then the two outputs'."""
    spec, outs, views = _signature(positions, infos, static)
    q, k = views[0], views[1]
    nnz, head_dim = q.shape[0], spec.head_dim
    hq = q.size // (nnz * head_dim) if nnz else 0
    hk = k.size // (nnz * head_dim) if nnz else 0
    if hq + hk == 0:
        return Prepared(outs, no_launch)
    strides = [s for a in views for s in _head_strides(a, head_dim)]
    vec = fit_vec(spec.vec, itemsize(spec.dtype), 16, strides)
    batch = infos[3].shape[0] if spec.pos_from == "indptr" else 0  # offsets: [B]
    geometry = (q.device, nnz, hq, hk, batch, strides)
    # The position arrays and the cos/sin table are read as dense arrays. Strides are part of
    # the signature: only those strided here are listed (the others cost no check per call).
    dense = tuple(i for i in range(2, 2 + len(positions)) if not infos[i].contiguous)
    align = min(a.align for a in views)  # what q, k and their outputs allow (bytes)
    vec = fit_vec(vec, itemsize(spec.dtype), align, ())
    if not _lanes_fit(vec, head_dim, spec.interleave):
        raise ValueError(f"q and k rows are not aligned to {spec.vec} elements")
    spec = dataclasses.replace(spec, vec=vec)
    rec = errors.record(q.device) if spec.mode == "cos_sin_cache" else None
    max_pos = infos[3].shape[0] if spec.mode == "cos_sin_cache" else 0
    check = errors.checking()

    def remake(n: int, outs: tuple) -> Prepared:  # n tokens (prepared.with_rows)
        launch = _launch(spec, q.device, n, hq, hk, batch, strides)
        if rec is not None:  # positions index the table: checked on the device
            launch.params.max_pos = max_pos
        return _prepared(outs, launch, rec, check, dense, n, remake)

    return remake(nnz, outs) if nnz else _prepared(outs, _launch(spec, *geometry), rec, check,
                                                   dense)  # fmt: skip


def _launch(spec: RopeSpec, device: int, nnz: int, hq: int, hk: int, batch: int,
            strides: list[int]) -> Launch:  # fmt: skip
    """A persistent launch (each CTA builds the frequency table once); a token's head rows are
    split into chunks, down to one row an item, only when the tokens alone are too few to fill
    the GPU twice over (a few tokens' rows then spread over many warps, whose cos/sin and
    rotations are the latency of the call); an item longer than a batch of loads takes whole
    batches."""
    kernel = Kernel(spec, "rope_kernel", "RopeParams")
    sms = jit.sm_count(device)
    rows, unroll = hq + hk, spec.unroll
    chunks = min(rows, max(1, -(-sms * 2 * spec.tokens_per_cta // nnz)))
    rows_per_item = -(-rows // chunks)
    if rows_per_item > unroll:
        rows_per_item = -(-rows_per_item // unroll) * unroll
    items = nnz * -(-rows // rows_per_item)
    resident = kernel.occupancy(device, spec.threads) * sms
    grid = min(-(-items // spec.tokens_per_cta), resident)
    launch = Launch(kernel, (grid, 1, 1), (spec.threads, 1, 1))
    p = launch.params
    p.q_tok, p.q_head, p.k_tok, p.k_head, p.qo_tok, p.qo_head, p.ko_tok, p.ko_head = strides
    p.nnz, p.num_q_heads, p.num_k_heads, p.batch_size = nnz, hq, hk, batch
    p.rows_per_item = rows_per_item
    return launch


def _prepared(outs: tuple, launch: Launch, rec: errors.Record | None, check: bool,
              dense: tuple, rows: int = 0, remake=None) -> Prepared:  # fmt: skip
    """The call of `launch`: pointers (q, k, the position slots, ..., then q_out and k_out)
    and the frequency scalars (theta: 2, Llama 3.1: 5, cos/sin cache: none). With a cos/sin
    cache (`rec`: the record of its device), a call first raises what an earlier one reported
    (errors.py), and under RTCINFER_CHECK=1 (`check`) waits for its own launch. `rows`,
    `remake`: one_launch's (the call of another token count)."""
    spec = launch.kernel.spec
    p = launch.params
    q_at, k_at = (-2, -1) if spec.inplace else (0, 1)  # in place: q and k are the outputs
    # (their XLA copies for JAX)
    pointers = (("q", q_at), ("k", k_at), ("q_out", -2), ("k_out", -1))
    if spec.pos_from == "indptr":
        pointers += (("indptr", 2), ("offsets", 3))
    else:
        pointers += (("pos_ids", 2),)
    if spec.mode != "cos_sin_cache":  # theta or Llama 3.1: their scalars and table
        then = table_writer(p, spec.mode, spec.rotary_dim)
        return one_launch(outs, launch, Fill(pointers, then=then), dense=dense, rows=rows,
                          remake=remake)  # fmt: skip
    fill = Fill(pointers + (("cos_sin_cache", 3),))
    return one_launch(outs, launch, fill, record=rec, check=check, dense=dense, rows=rows,
                      remake=remake)  # fmt: skip


def _out_of_place(static: tuple) -> tuple:
    """An `_inplace` call on JAX arrays (immutable): the out-of-place kernel, into two new
    arrays (no output aliases an input, so XLA can launch it itself)."""
    return (static[0], False, *static[2:])


def _op(name: str, positions: tuple[str, ...]) -> Op:
    slots = ("q", "k", *positions, "q_out", "k_out")
    per_token = [s for s in slots if s not in ("indptr", "offsets", "cos_sin_cache")]
    return Op(name, slots, functools.partial(_prepare, positions), given=("q_out", "k_out"),
              jax_static=_out_of_place, rows=per_token)  # fmt: skip


_RAGGED = _op("rope", ("indptr", "offsets"))
_POS_IDS = _op("rope_pos_ids", ("pos_ids",))
_CACHE = _op("rope_cos_sin_cache", ("positions", "cos_sin_cache"))


def _llama31(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len):
    """The kernel's frequency scalars of Llama 3.1 RoPE (theta RoPE passes the first two)."""
    return (float(rope_scale), float(rope_theta), float(low_freq_factor),
            float(high_freq_factor), float(old_context_len))  # fmt: skip


# The in-place forms' PyTorch shortcuts (interop/shortcut.py): their slots, static arguments
# and frequency scalars as the functions below pass them.
_THETA = "(float(rope_scale), float(rope_theta))"
_LLAMA31 = "_llama31(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)"
_SHORTCUTS = {
    "rope": Shortcut(_RAGGED, ("q", "k", "indptr", "offsets", None, None),
                     '("theta", True, rotary_dim, interleave, None)', _THETA),
    "pos_ids": Shortcut(_POS_IDS, ("q", "k", "pos_ids", None, None),
                        '("theta", True, rotary_dim, interleave, None)', _THETA),
    "llama31_pos_ids": Shortcut(_POS_IDS, ("q", "k", "pos_ids", None, None),
                                '("llama31", True, rotary_dim, interleave, None)', _LLAMA31,
                                (_llama31,)),
}  # fmt: skip


@compilable("q")
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
    q_out, k_out = (None, None) if out is None else out
    return call(_RAGGED, (q, k, indptr, offsets, q_out, k_out),
                ("theta", False, rotary_dim, interleave, None),
                (float(rope_scale), float(rope_theta)))  # fmt: skip


@compilable("q", _SHORTCUTS["rope"])
def apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1.0,
                       rope_theta=1e4):  # fmt: skip
    """`apply_rope` writing q and k in place; returns (q, k) (new arrays for JAX)."""
    return call(_RAGGED, (q, k, indptr, offsets, None, None),
                ("theta", True, rotary_dim, interleave, None),
                (float(rope_scale), float(rope_theta)))  # fmt: skip


@compilable("q")
def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1.0,
                       rope_theta=1e4, *, out=None):  # fmt: skip
    """RoPE with one position per token, pos_ids: [nnz] int32/int64; returns (q_rope, k_rope)."""
    q_out, k_out = (None, None) if out is None else out
    return call(_POS_IDS, (q, k, pos_ids, q_out, k_out),
                ("theta", False, rotary_dim, interleave, None),
                (float(rope_scale), float(rope_theta)))  # fmt: skip


@compilable("q", _SHORTCUTS["pos_ids"])
def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1.0,
                               rope_theta=1e4):  # fmt: skip
    """`apply_rope_pos_ids` writing q and k in place; returns (q, k)."""
    return call(_POS_IDS, (q, k, pos_ids, None, None),
                ("theta", True, rotary_dim, interleave, None),
                (float(rope_scale), float(rope_theta)))  # fmt: skip


@compilable("q")
def apply_llama31_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8.0,
                       rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
                       old_context_len=8192, *, out=None):  # fmt: skip
    """`apply_rope` with Llama 3.1 frequencies: f = theta ** (-2i/R), wavelength w = 2 pi / f,
    s = clip((old_context_len / w - low_freq_factor) / (high_freq_factor - low_freq_factor), 0, 1),
    f' = (1 - s) f / rope_scale + s f."""
    q_out, k_out = (None, None) if out is None else out
    return call(_RAGGED, (q, k, indptr, offsets, q_out, k_out),
                ("llama31", False, rotary_dim, interleave, None),
                _llama31(rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                         old_context_len))  # fmt: skip


@compilable("q")
def apply_llama31_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False,
                               rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0,
                               high_freq_factor=4.0, old_context_len=8192):  # fmt: skip
    """`apply_llama31_rope` writing q and k in place; returns (q, k)."""
    return call(_RAGGED, (q, k, indptr, offsets, None, None),
                ("llama31", True, rotary_dim, interleave, None),
                _llama31(rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                         old_context_len))  # fmt: skip


@compilable("q")
def apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8.0,
                               rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
                               old_context_len=8192, *, out=None):  # fmt: skip
    """Llama 3.1 RoPE with one position per token; returns (q_rope, k_rope)."""
    q_out, k_out = (None, None) if out is None else out
    return call(_POS_IDS, (q, k, pos_ids, q_out, k_out),
                ("llama31", False, rotary_dim, interleave, None),
                _llama31(rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                         old_context_len))  # fmt: skip


@compilable("q", _SHORTCUTS["llama31_pos_ids"])
def apply_llama31_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False,
                                       rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0,
                                       high_freq_factor=4.0, old_context_len=8192):  # fmt: skip
    """`apply_llama31_rope_pos_ids` writing q and k in place; returns (q, k)."""
    return call(_POS_IDS, (q, k, pos_ids, None, None),
                ("llama31", True, rotary_dim, interleave, None),
                _llama31(rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                         old_context_len))  # fmt: skip


@compilable("query")
def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True,
                                  *, out=None):  # fmt: skip
    """RoPE from a cos/sin table: cos = cache[pos, :R/2], sin = cache[pos, R/2:].

    query: [nnz, Hq * head_size] or [nnz, Hq, head_size]; key likewise; positions [nnz];
    is_neox=True rotates halves, False rotates interleaved pairs. Returns (query, key) rotated.
    A position outside [0, max_pos) reads no row of the table: its token passes through
    unrotated and is raised as rtcinfer.BadIndexError by the next such call, by
    rtcinfer.check_errors(), or at once under RTCINFER_CHECK=1 (rtcinfer/errors.py).
    """
    q_out, k_out = (None, None) if out is None else out
    return call(_CACHE, (query, key, positions, cos_sin_cache, q_out, k_out),
                ("cos_sin_cache", False, None, not is_neox, head_size))  # fmt: skip


@compilable("query")
def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                          is_neox=True):  # fmt: skip
    """`apply_rope_with_cos_sin_cache` writing query and key in place; returns (query, key)."""
    return call(_CACHE, (query, key, positions, cos_sin_cache, None, None),
                ("cos_sin_cache", True, None, not is_neox, head_size))  # fmt: skip


PUBLIC = (apply_rope, apply_rope_inplace, apply_rope_pos_ids, apply_rope_pos_ids_inplace,
          apply_llama31_rope, apply_llama31_rope_inplace, apply_llama31_rope_pos_ids,
          apply_llama31_rope_pos_ids_inplace, apply_rope_with_cos_sin_cache,
          apply_rope_with_cos_sin_cache_inplace)  # fmt: skip


def specs_for(head_dim: int, dtypes=("bfloat16", "float16")) -> list[RopeSpec]:
    """What a model's attention may call (warmup): full rotary dim, rotated halves (NeoX
    style), every position form FlashInfer offers (theta or Llama 3.1 frequencies from ragged
    indptr/offsets or from pos_ids, and a cos/sin cache from positions), int32 or int64
    positions, in place or into new arrays."""
    forms = [(mode, pos_from) for mode in ("theta", "llama31") for pos_from in ("indptr",
             "pos_ids")] + [("cos_sin_cache", "pos_ids")]  # fmt: skip
    specs = []
    for d in dtypes:
        vec = rope_vec(d, head_dim, head_dim, False)
        for mode, pos_from in forms:
            for pos_dtype in ("int32", "int64"):
                specs += [RopeSpec(d, pos_dtype, head_dim, head_dim, False, mode, pos_from,
                                   inplace, vec) for inplace in (False, True)]  # fmt: skip
    return specs


# FlashInfer's rope module holds these too (`from flashinfer.rope import rope_quantize_fp8`)
from .rope_quantize import (  # noqa: E402, F401
    mla_rope_quantize_fp8,
    rope_quantize_fp8,
    rope_quantize_fp8_append_paged_kv_cache,
)
