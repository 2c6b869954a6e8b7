"""RoPE from a cos/sin table with fp8 quantization of q and k (FlashInfer's rope_quantize_fp8
and mla_rope_quantize_fp8), and the same with k and v appended to a paged fp8 cache in the
same launch (rope_quantize_fp8_append_paged_kv_cache). The math: cuda_src/rope_quantize.cu.

q and k come split into their rotary parts (q_rope [nnz, Hq, R], k_rope [nnz, Hk, R], or
[nnz, R] for MLA's one latent head) and the rest (q_nope, k_nope: [.., N], or None for N = 0).
cos_sin_cache: float32 [max_pos, R], cos in [:, :R/2], sin in [:, R/2:]; pos_ids [nnz].
is_neox=True rotates (x[i], x[i + R/2]) pairs, False (x[2i], x[2i + 1]). Every output is
fp8(scale * value) (float8_e4m3fn or float8_e5m2, rounded to nearest, saturated to the
finite range), scale quant_scale_q for q and quant_scale_kv for k and v.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from . import errors, jit
from .attention.paged_kv import cache_views, check_layout, kv_storage, token_head
from .errors import BadIndex
from .interop import Fill, Op, OutSlot, Prepared, call, dtype_name, no_launch, one_launch
from .interop.arrays import compilable, framework
from .interop.dtypes import FP8_DTYPES, normalize
from .launch import Kernel, Launch

THREADS = 128  # a CTA's units of one token
UNIT_BYTES = 16  # a unit's input bytes at most (32: two 16-byte loads and one 16-byte fp8 store
# a thread, 40 registers against 32; not yet measured)
_INPUT_DTYPES = ("float16", "bfloat16")
_INDEX_DTYPES = ("int32", "int64")


@dataclass(frozen=True)
class RopeQuantSpec:
    dtype: str  # of q, k (and v)
    out_dtype: str  # fp8
    pos_dtype: str
    rope_dim: int
    nope_dim: int
    vec: int  # elements per unit
    interleave: bool
    append: bool = False
    with_v: bool = False  # append: a V cache (GQA / MHA; MLA has none)
    row_index_dtype: str = "int32"  # append: batch_indices and positions
    index_dtype: str = "int32"  # append: kv_indices and kv_indptr
    source: ClassVar[str] = "rope_quantize.cu"
    kernels: ClassVar[tuple[str, ...]] = ("rope_quantize_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("RopeQuantParams", "BadIndexRecord")  # the seam

    def prelude(self) -> str:
        return jit.prelude(
            T=self.dtype,
            OT=self.out_dtype,
            POS_T=self.pos_dtype,
            ROW_IDX=self.row_index_dtype,
            IDX=self.index_dtype,
            ROPE_DIM=self.rope_dim,
            NOPE_DIM=self.nope_dim,
            VEC=self.vec,
            THREADS=THREADS,
            INTERLEAVE=self.interleave,
            APPEND=self.append,
            WITH_V=self.with_v,
            BadIndex=BadIndex,
        )


# ---------------------------------------------------------------- validation (per signature)


def _out_type(quantize_dtype, outs) -> str | None:
    """The fp8 type named by quantize_dtype, else by the first fp8 output given, else None
    (the default, float8_e4m3fn, is the op's)."""
    if quantize_dtype is not None:
        name = normalize(quantize_dtype)
        if name not in FP8_DTYPES:
            raise TypeError(f"quantize_dtype: expected one of {FP8_DTYPES}, got {quantize_dtype!r}")
        return name
    for out in outs:
        if out is not None and dtype_name(out) in FP8_DTYPES:
            return dtype_name(out)
    return None


def _check_out(name: str, out, shape: tuple, out_dtype: str) -> None:
    """A given output: `shape`, fp8 of out_dtype or its uint8 storage (CuPy), last dim dense."""
    if out is None:
        return
    if out.shape != shape or out.dtype not in kv_storage(out_dtype):
        raise ValueError(
            f"{name}: expected shape {shape} and dtype {out_dtype}, got {out.shape} and {out.dtype}"
        )


def _rows(name: str, x, nnz: int, heads: int | None, dim: int | None) -> tuple[int, int]:
    """(heads, dim) of a [nnz, H, D] array (heads None: [nnz, D], one head), checked."""
    rank = 2 if heads is None else 3
    if x.ndim != rank or x.shape[0] != nnz or (heads not in (None, -1) and x.shape[1] != heads):
        want = "[nnz, D]" if heads is None else "[nnz, H, D]"
        raise ValueError(f"{name}: expected {want} with nnz = {nnz}, got {x.shape}")
    if dim is not None and x.shape[-1] != dim:
        raise ValueError(f"{name}: expected a last dim of {dim}, got {x.shape}")
    if x.shape[-1] > 1 and x.strides[-1] != 1:
        raise ValueError(f"{name}: the last dim must be contiguous, got strides {x.strides}")
    return (1 if heads is None else x.shape[1]), x.shape[-1]


def _check_inputs(q_rope, k_rope, q_nope, k_nope, cache, pos_ids) -> tuple:
    """(dtype, nnz, Hq, Hk, R, N, mla) of the inputs, checked as FlashInfer's: q 3-D, k 2-D (MLA)
    or 3-D, the nope parts of one last dim N (None: N = 0), one 16-bit float dtype."""
    dtype = q_rope.dtype
    if dtype not in _INPUT_DTYPES:
        raise TypeError(f"q_rope: expected float16 or bfloat16, got {dtype}")
    for name, x in (("k_rope", k_rope), ("q_nope", q_nope), ("k_nope", k_nope)):
        if x is not None and x.dtype != dtype:
            raise TypeError(f"{name}: expected q_rope's dtype {dtype}, got {x.dtype}")
    if q_rope.ndim != 3:
        raise ValueError(f"q_rope: expected [nnz, Hq, rope_dim], got {q_rope.shape}")
    nnz, hq, rope_dim = q_rope.shape
    _rows("q_rope", q_rope, nnz, hq, rope_dim)
    mla = k_rope.ndim == 2
    hk, _ = _rows("k_rope", k_rope, nnz, None if mla else -1, rope_dim)
    if rope_dim % 2 or rope_dim < 2:
        raise ValueError(f"rope_dim (q_rope's last dim) must be even and positive, got {rope_dim}")
    nope = 0 if q_nope is None else _rows("q_nope", q_nope, nnz, hq, None)[1]
    if k_nope is not None:
        _rows("k_nope", k_nope, nnz, None if mla else hk, nope)
    elif nope:
        raise ValueError(f"k_nope is None but q_nope has {nope} dims: give k_nope of {nope} dims")
    if cache.dtype != "float32" or cache.ndim != 2 or cache.shape[1] != rope_dim:
        raise ValueError(
            f"cos_sin_cache: expected float32 [max_pos, {rope_dim}] (cos, then sin), got "
            f"{cache.dtype} {cache.shape}"
        )
    if pos_ids.shape != (nnz,) or pos_ids.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"pos_ids: expected int32 or int64 [{nnz}], got {pos_ids.dtype} {pos_ids.shape}"
        )
    return dtype, nnz, hq, hk, rope_dim, nope, mla


def _vec(dtype_bytes: int, rope_dim: int, nope: int, interleave: bool, strides, aligns) -> int:
    """Elements per unit: UNIT_BYTES of input at most, whole units in each part (a unit of a
    non-interleaved row inside one half, an interleaved one of whole pairs), every element
    stride a multiple, the inputs' addresses aligned to a unit (16 bytes at most: its loads)
    and the outputs' to its fp8 bytes (`aligns`: (input alignment, output alignment) in
    bytes, 16 at most)."""
    vec = UNIT_BYTES // dtype_bytes
    unit = rope_dim if interleave else rope_dim // 2
    while vec > 1 and (unit % vec or nope % vec or any(s % vec for s in strides)
                       or aligns[0] % min(vec * dtype_bytes, 16)
                       or aligns[1] % min(vec, 16)):  # fmt: skip
        vec //= 2
    if interleave and vec < 2:
        raise ValueError("is_neox=False needs the rotary rows aligned to pairs of elements")
    return vec


def _launch(spec: RopeQuantSpec, nnz: int, hq: int, hk: int) -> Launch:
    units = (hq + hk) * (spec.rope_dim + spec.nope_dim) // spec.vec
    if spec.with_v:
        units += hk * (spec.rope_dim + spec.nope_dim) // spec.vec
    kernel = Kernel(spec, "rope_quantize_kernel", "RopeQuantParams")
    launch = Launch(kernel, (nnz, -(-units // THREADS), 1), (THREADS, 1, 1))
    p = launch.params
    p.num_q_heads, p.num_k_heads = hq, hk
    return launch


def _head_strides(x) -> tuple[int, int]:
    """(token, head) element strides of [nnz, H, D] or [nnz, D] (one head)."""
    return (x.strides[0], x.strides[1]) if x.ndim == 3 else (x.strides[0], 0)


def _dense_head_strides(shape) -> tuple[int, int]:
    return (shape[1] * shape[2], shape[2]) if len(shape) == 3 else (shape[1], 0)


def _prepare(infos, _align: int, static: tuple) -> Prepared:
    """Slots: q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, then the given outputs
    (q_rope_out, k_rope_out, q_nope_out, k_nope_out) -> those four (new arrays where not
    given). Pointers: the slots', then the outputs'."""
    interleave, named = static
    q_rope, k_rope, q_nope, k_nope, cache, pos_ids, *given = infos
    dtype, nnz, hq, hk, rope_dim, nope, mla = _check_inputs(q_rope, k_rope, q_nope, k_nope,
                                                            cache, pos_ids)  # fmt: skip
    out_dtype = named or "float8_e4m3fn"
    k_lead = k_rope.shape[:-1]
    shapes = (q_rope.shape, k_rope.shape, (nnz, hq, nope), (*k_lead, nope))
    for name, out, shape in zip(("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out"), given,
                                shapes, strict=True):  # fmt: skip
        _check_out(name, out, shape, out_dtype)
    first_given = 6
    outs = tuple(OutSlot(shape, out_dtype, None if out is None else first_given + i)
                 for i, (out, shape) in enumerate(zip(given, shapes, strict=True)))  # fmt: skip
    if nnz == 0:
        return Prepared(outs, no_launch)
    out_strides = [_head_strides(o) if o is not None else _dense_head_strides(s)
                   for o, s in zip(given, shapes, strict=True)]  # fmt: skip
    in_strides = [_head_strides(x) if x is not None else (0, 0)
                  for x in (q_rope, q_nope, k_rope, k_nope)]  # fmt: skip
    strides = [s for pair in in_strides + out_strides for s in pair]
    item = 2
    aligns = (min(x.align for x in (q_rope, k_rope, q_nope, k_nope) if x is not None),
              min([o.align for o in given if o is not None] + [16]))  # fmt: skip
    vec = _vec(item, rope_dim, nope, bool(interleave), strides, aligns)
    spec = RopeQuantSpec(dtype, out_dtype, pos_ids.dtype, rope_dim, nope, vec, bool(interleave))
    launch = _launch(spec, nnz, hq, hk)
    p = launch.params
    (p.q_rope_tok, p.q_rope_head), (p.q_nope_tok, p.q_nope_head) = in_strides[0], in_strides[1]
    (p.k_rope_tok, p.k_rope_head), (p.k_nope_tok, p.k_nope_head) = in_strides[2], in_strides[3]
    (p.qr_out_tok, p.qr_out_head), (p.kr_tok, p.kr_head) = out_strides[0], out_strides[1]
    (p.qn_out_tok, p.qn_out_head), (p.kn_tok, p.kn_head) = out_strides[2], out_strides[3]
    p.max_pos = cache.shape[0]
    fill = Fill((("q_rope", 0), ("k_rope", 1), ("q_nope", 2), ("k_nope", 3),
                 ("cos_sin_cache", 4), ("pos_ids", 5), ("q_rope_out", -4), ("k_rope_out", -3),
                 ("q_nope_out", -2), ("k_nope_out", -1)),
                (("scale_q", 0), ("scale_kv", 1)))  # fmt: skip
    dense = tuple(i for i in (4, 5) if not infos[i].contiguous)
    return one_launch(outs, launch, fill, record=errors.record(q_rope.device),
                      check=errors.checking(), rows=nnz,
                      dense=dense)  # fmt: skip


_SLOTS = ("q_rope", "k_rope", "q_nope", "k_nope", "cos_sin_cache", "pos_ids")
_OUTS = ("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out")
_QUANTIZE = Op("rope_quantize_fp8", (*_SLOTS, *_OUTS), _prepare, given=_OUTS,
               rows=("q_rope", "k_rope", "q_nope", "k_nope", "pos_ids", *_OUTS))  # fmt: skip


@compilable("q_rope")
def rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox=True,
                      quantize_dtype=None, quant_scale_q=1.0, quant_scale_kv=1.0,
                      q_rope_out=None, k_rope_out=None, q_nope_out=None, k_nope_out=None,
                      enable_pdl=False, backend="cuda"):  # fmt: skip
    """RoPE on q_rope and k_rope, then every part quantized to fp8 (module docstring); returns
    (q_rope_out, k_rope_out, q_nope_out, k_nope_out), written to the ones given.

    q_rope [nnz, Hq, R] and q_nope [nnz, Hq, N] (None: N = 0, its output [nnz, Hq, 0]); k_rope
    and k_nope [nnz, Hk, R] / [nnz, Hk, N], or [nnz, R] / [nnz, N] (MLA); float16 or bfloat16,
    last dims contiguous. quantize_dtype: float8_e4m3fn (default) or float8_e5m2; when None,
    the first given output's fp8 dtype (CuPy has no fp8 dtype: give outputs as uint8 storage
    with quantize_dtype). A pos_ids entry outside [0, max_pos) reads no row: its rotary dims
    are quantized unrotated and the call after reports it (rtcinfer.BadIndexError, errors.py).
    enable_pdl is accepted (launches are programmatically dependent on sm_90 already);
    backend "cuda" only ("cutile" raises)."""
    if backend != "cuda":
        raise ValueError(f"backend: only 'cuda' is supported, got {backend!r}")
    outs = (q_rope_out, k_rope_out, q_nope_out, k_nope_out)
    return call(_QUANTIZE, (q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, *outs),
                (not is_neox, _out_type(quantize_dtype, outs)),
                (float(quant_scale_q), float(quant_scale_kv)))  # fmt: skip


def mla_rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox=True,
                          quantize_dtype=None, quant_scale_q=1.0, quant_scale_kv=1.0,
                          q_rope_out=None, k_rope_out=None, q_nope_out=None, k_nope_out=None,
                          enable_pdl=False):  # fmt: skip
    """rope_quantize_fp8 with MLA's layout: k_rope [nnz, R] and k_nope [nnz, N], one latent
    head (FlashInfer's name for the same call)."""
    return rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox,
                             quantize_dtype, quant_scale_q, quant_scale_kv, q_rope_out,
                             k_rope_out, q_nope_out, k_nope_out, enable_pdl)  # fmt: skip


# ---------------------------------------------------------------- appended to a paged cache


def _check_table(kv_indices, kv_indptr, batch_indices, positions, nnz: int) -> tuple[str, str]:
    """(batch_indices' and positions' dtype, kv_indices' and kv_indptr's), each pair int32 or
    int64, 1-D, the rows' of nnz entries."""
    pairs = ((("batch_indices", batch_indices), ("positions", positions)),
             (("kv_indices", kv_indices), ("kv_indptr", kv_indptr)))  # fmt: skip
    dtypes = []
    for (a_name, a), (b_name, b) in pairs:
        if a.dtype not in _INDEX_DTYPES or b.dtype != a.dtype or a.ndim != 1 or b.ndim != 1:
            raise TypeError(
                f"{a_name} and {b_name}: expected 1-D arrays, both int32 or both int64, got "
                f"{a.dtype} {a.shape} and {b.dtype} {b.shape}"
            )
        dtypes.append(a.dtype)
    if batch_indices.shape[0] != nnz or positions.shape[0] != nnz:
        raise ValueError(
            f"batch_indices {batch_indices.shape} and positions {positions.shape}: expected "
            f"[{nnz}] (one entry a token)"
        )
    if kv_indptr.shape[0] < 1:
        raise ValueError("kv_indptr: expected [B + 1] entries, got none")
    return dtypes[0], dtypes[1]


def _prepare_append(infos, _align: int, static: tuple) -> Prepared:
    """Slots: q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, the two caches (GQA:
    k_cache, v_cache; MLA: ckv_cache, kpe_cache), kv_indices, kv_indptr, batch_indices,
    positions, then the given q_rope_out, q_nope_out -> (q_rope_out, q_nope_out, the caches
    updated in place). Pointers: the slots', then the outputs'."""
    interleave, named, kv_layout, page_size = static
    q_rope, k_rope, q_nope, k_nope, v, cos_sin, pos_ids, c0, c1 = infos[:9]
    kv_indices, kv_indptr, batch_indices, positions, qr_given, qn_given = infos[9:]
    dtype, nnz, hq, hk, rope_dim, nope, mla = _check_inputs(q_rope, k_rope, q_nope, k_nope,
                                                            cos_sin, pos_ids)  # fmt: skip
    out_dtype = named or "float8_e4m3fn"
    row_index, index = _check_table(kv_indices, kv_indptr, batch_indices, positions, nnz)
    head_dim = rope_dim + nope
    if mla:
        if v is not None:
            raise ValueError("MLA (a 2-D k_rope) takes no v: pass None")
        want = ((c0, "ckv_cache", nope), (c1, "kpe_cache", rope_dim))
        for x, name, dim in want:
            if x.ndim != 3 or x.shape[1] != page_size or x.shape[2] != dim:
                raise ValueError(
                    f"{name}: expected [pages, {page_size}, {dim}] (page_size, the dims), got "
                    f"{x.shape}"
                )
        pages_ok = c0.shape[0] == c1.shape[0]
    else:
        check_layout(kv_layout)
        if v is None:
            raise ValueError("GQA / MHA (a 3-D k_rope) needs v [nnz, Hk, rope_dim + nope_dim]")
        if v.dtype != dtype:
            raise TypeError(f"v: expected q_rope's dtype {dtype}, got {v.dtype}")
        _rows("v", v, nnz, hk, head_dim)
        for x, name in ((c0, "k_cache"), (c1, "v_cache")):
            dims = token_head(x.shape, x.strides, kv_layout)[0] if x.ndim == 4 else None
            if x.ndim != 4 or dims != (page_size, hk) or x.shape[-1] != head_dim:
                form = ("[pages, page_size, Hk, D]" if kv_layout == "NHD"
                        else "[pages, Hk, page_size, D]")  # fmt: skip
                raise ValueError(
                    f"{name}: expected {form} with page_size {page_size}, Hk {hk}, D {head_dim}, "
                    f"got {x.shape}"
                )
        pages_ok = c0.shape[0] == c1.shape[0]
    names = ("ckv_cache", "kpe_cache") if mla else ("k_cache", "v_cache")
    if not pages_ok:
        raise ValueError(f"{names[0]} {c0.shape} and {names[1]} {c1.shape}: one page count")
    for name, x in zip(names, (c0, c1), strict=True):
        if x.dtype not in kv_storage(out_dtype):
            raise TypeError(f"{name}: expected {out_dtype} (or its uint8 storage), got {x.dtype}")
        if x.shape[-1] > 1 and x.strides[-1] != 1:
            raise ValueError(f"{name}: the last dim must be contiguous, got strides {x.strides}")
    q_shapes = (q_rope.shape, (nnz, hq, nope))
    _check_out("q_rope_out", qr_given, q_shapes[0], out_dtype)
    _check_out("q_nope_out", qn_given, q_shapes[1], out_dtype)
    outs = (OutSlot(q_shapes[0], out_dtype, None if qr_given is None else 13),
            OutSlot(q_shapes[1], out_dtype, None if qn_given is None else 14),
            OutSlot(c0.shape, c0.dtype, 7, alias=True),
            OutSlot(c1.shape, c1.dtype, 8, alias=True))  # fmt: skip
    if nnz == 0:
        return Prepared(outs, no_launch)
    if mla:  # the caches' (page, slot) strides in elements = bytes; one head
        kr = (c1.strides[0], c1.strides[1], 0)
        kn = (c0.strides[0], c0.strides[1], 0)
        vv = (0, 0, 0)
    else:
        k_view, v_view = cache_views(c0, c1, kv_layout, 1)
        kr = kn = (k_view.page, k_view.token, k_view.head)
        vv = (v_view.page, v_view.token, v_view.head)
    q_out_strides = [_head_strides(o) if o is not None else _dense_head_strides(s)
                     for o, s in zip((qr_given, qn_given), q_shapes, strict=True)]  # fmt: skip
    in_strides = [_head_strides(x) if x is not None else (0, 0)
                  for x in (q_rope, q_nope, k_rope, k_nope, v)]  # fmt: skip
    strides = [s for pair in in_strides + q_out_strides for s in pair] + [*kr, *kn, *vv]
    aligns = (min(x.align for x in (q_rope, k_rope, q_nope, k_nope, v) if x is not None),
              min([o.align for o in (qr_given, qn_given, c0, c1) if o is not None]))  # fmt: skip
    vec = _vec(2, rope_dim, nope, bool(interleave), strides, aligns)
    spec = RopeQuantSpec(dtype, out_dtype, pos_ids.dtype, rope_dim, nope, vec, bool(interleave),
                         True, not mla, row_index, index)  # fmt: skip
    launch = _launch(spec, nnz, hq, hk)
    p = launch.params
    (p.q_rope_tok, p.q_rope_head), (p.q_nope_tok, p.q_nope_head) = in_strides[0], in_strides[1]
    (p.k_rope_tok, p.k_rope_head), (p.k_nope_tok, p.k_nope_head) = in_strides[2], in_strides[3]
    p.v_tok, p.v_head = in_strides[4]
    (p.qr_out_tok, p.qr_out_head), (p.qn_out_tok, p.qn_out_head) = q_out_strides
    p.kr_page, p.kr_tok, p.kr_head = kr
    p.kn_page, p.kn_tok, p.kn_head = kn
    p.v_page, p.v_slot, p.v_hd = vv
    p.max_pos, p.page_size = cos_sin.shape[0], page_size
    p.batch_size, p.num_indices = kv_indptr.shape[0] - 1, kv_indices.shape[0]
    p.num_pages = c0.shape[0]
    # the outputs' pointers: q_rope_out -4, q_nope_out -3, then the caches -2, -1
    caches = ((("k_nope_out", -2), ("k_rope_out", -1)) if mla else
              (("k_rope_out", -2), ("k_nope_out", -2, rope_dim), ("v_out", -1)))  # fmt: skip
    fill = Fill((("q_rope", 0), ("k_rope", 1), ("q_nope", 2), ("k_nope", 3), ("v", 4),
                 ("cos_sin_cache", 5), ("pos_ids", 6), ("kv_indices", 9), ("kv_indptr", 10),
                 ("batch_indices", 11), ("positions", 12), ("q_rope_out", -4),
                 ("q_nope_out", -3), *caches),
                (("scale_q", 0), ("scale_kv", 1)))  # fmt: skip
    dense = tuple(i for i in (5, 6, 9, 10, 11, 12) if not infos[i].contiguous)
    return one_launch(outs, launch, fill, record=errors.record(q_rope.device),
                      check=errors.checking(), rows=nnz,
                      dense=dense)  # fmt: skip


_APPEND_SLOTS = ("q_rope", "k_rope", "q_nope", "k_nope", "v", "cos_sin_cache", "pos_ids",
                 "cache_0", "cache_1", "kv_indices", "kv_indptr", "batch_indices", "positions",
                 "q_rope_out", "q_nope_out")  # fmt: skip
_APPEND = Op("rope_quantize_fp8_append_paged_kv_cache", _APPEND_SLOTS, _prepare_append,
             given=("q_rope_out", "q_nope_out"),
             rows=("q_rope", "k_rope", "q_nope", "k_nope", "v", "pos_ids", "batch_indices",
                   "positions", "q_rope_out", "q_nope_out"))  # fmt: skip


@compilable("q_rope")
def rope_quantize_fp8_append_paged_kv_cache(
    q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, paged_kv_cache, kv_indices,
    kv_indptr, batch_indices, positions, is_neox=True, quantize_dtype=None, quant_scale_q=1.0,
    quant_scale_kv=1.0, page_size=16, kv_layout="NHD", q_rope_out=None, q_nope_out=None,
    enable_pdl=False,
):  # fmt: skip
    """rope_quantize_fp8 whose k (and v) go straight into a paged fp8 cache; returns
    (q_rope_out, q_nope_out) (JAX, whose arrays are immutable: and the updated caches, as a
    third element).

    GQA / MHA (k_rope [nnz, Hk, R]): paged_kv_cache = (k_cache, v_cache), each [pages,
    page_size, Hk, R + N] (NHD) or [pages, Hk, page_size, R + N] (HND); a cache row holds k's
    rotary dims, then the rest; v [nnz, Hk, R + N]. MLA (k_rope [nnz, R], v None):
    paged_kv_cache = (ckv_cache [pages, page_size, N], kpe_cache [pages, page_size, R]).
    Token t of request b = batch_indices[t] at position p = positions[t] lands in page
    kv_indices[kv_indptr[b] + p // page_size], slot p % page_size (batch_indices and positions
    as get_batch_indices_positions gives them; both int32 or both int64, as kv_indices and
    kv_indptr). A token with b < 0 or p < 0 is padding: its q rows are written as zeros,
    nothing else. Bad entries (b >= B, a page past the request's, an entry outside
    kv_indices, a page outside the cache) are skipped and reported by the next call
    (rtcinfer.BadIndexError; at once under RTCINFER_CHECK=1): that token's k and v are not
    appended. The caches' dtype is the fp8 type (CuPy: uint8 storage with quantize_dtype)."""
    if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2:
        raise ValueError("paged_kv_cache must be a tuple of 2 arrays")
    c0, c1 = paged_kv_cache
    outs = (q_rope_out, q_nope_out)
    named = _out_type(quantize_dtype, outs)
    if named is None and all(dtype_name(c) in FP8_DTYPES for c in (c0, c1)):
        named = dtype_name(c0)
    result = call(_APPEND, (q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, c0, c1,
                            kv_indices, kv_indptr, batch_indices, positions, *outs),
                  (not is_neox, named, kv_layout, int(page_size)),
                  (float(quant_scale_q), float(quant_scale_kv)))  # fmt: skip
    if framework(q_rope) == "jax":
        return result[0], result[1], (result[2], result[3])
    return result[0], result[1]


@functools.cache
def specs_for(rope_dim: int, nope_dim: int, dtype: str = "bfloat16",
              fp8: str = "float8_e4m3fn") -> list[RopeQuantSpec]:  # fmt: skip
    """The specs a model of these dims uses (neox, int32 positions and tables), alone and
    appending to a GQA cache (for warmup)."""
    vec = _vec(2, rope_dim, nope_dim, False, (), (16, 16))
    return [
        RopeQuantSpec(dtype, fp8, "int32", rope_dim, nope_dim, vec, False),
        RopeQuantSpec(dtype, fp8, "int32", rope_dim, nope_dim, vec, False, True, True),
    ]


__all__ = [
    "RopeQuantSpec",
    "mla_rope_quantize_fp8",
    "rope_quantize_fp8",
    "rope_quantize_fp8_append_paged_kv_cache",
]
