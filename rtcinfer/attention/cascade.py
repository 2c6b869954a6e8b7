"""Merging attention states (FlashInfer's cascade primitives), LSE in base 2.

A state (v, s) is a normalized partial attention output v over some keys and the base-2
log-sum-exp s of its logits. Merging states of disjoint key sets gives the state of the union:

    m = max_k s_k;  w_k = 2 ** (s_k - m);  s = m + log2(sum_k w_k);  v = sum_k w_k v_k / sum_k w_k

Empty states (s = -inf) contribute nothing; merging only empty states gives v = 0, s = -inf.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from .. import jit
from ..interop import Fill, Op, OutSlot, Prepared, call, dense_strides, one_launch
from ..interop.arrays import cast, compilable
from ..interop.dtypes import FLOAT_DTYPES, itemsize
from ..interop.shortcut import Shortcut
from ..launch import Kernel, Launch
from ..layout import fit_vec, widest_vec
from ..plan._checks import INT32_MAX

THREADS = 128


@dataclass(frozen=True)
class MergeSpec:
    dtype: str
    vec: int
    has_b: bool  # one more state from a second array (merge_state, merge_state_in_place)
    mask: bool
    sink: bool = False  # one more state, each head's sink (merge_sinks_in_place)
    source: ClassVar[str] = "attention/merge.cu"
    kernels: ClassVar[tuple[str, ...]] = ("merge_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("MergeParams",)  # crossing the seam

    def prelude(self) -> str:
        return jit.prelude(
            T=self.dtype,
            VEC=self.vec,
            HAS_B=self.has_b,
            MASK=self.mask,
            SINK=self.sink,
        )


def _check_state(v, s, name: str, ndim: int) -> str:
    dtype = v.dtype
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: v dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if v.ndim != ndim or s.shape != v.shape[:-1]:
        raise ValueError(
            f"{name}: expected v of {ndim} dims and s of v's shape without head_dim, got v "
            f"{v.shape} and s {s.shape}"
        )
    if s.dtype != "float32":
        raise TypeError(f"{name}: s must be float32, got {s.dtype}")
    if v.shape[-1] == 0:
        raise ValueError(f"{name}: head_dim must be at least 1, got v {v.shape}")
    return dtype


# The two-state ops' names in messages: (v, the other v, and their states for _check_state).
_PAIR_NAMES = {
    "merge_state": ("v_a", "v_b", "a", "b"),
    "in_place": ("v", "v_other", "v", "v_other"),
}


def _check_two_states(op: str, v, s, v_b, s_b, mask) -> str:
    names = _PAIR_NAMES[op]
    dtype = _check_state(v, s, names[2], 3)
    if _check_state(v_b, s_b, names[3], 3) != dtype or v_b.shape != v.shape:
        raise ValueError(
            f"{names[0]} ({dtype} {v.shape}) and {names[1]} ({v_b.dtype} {v_b.shape}) "
            "must match in shape and dtype"
        )
    if mask is not None and (mask.shape != v.shape[:1] or mask.dtype not in ("bool", "uint8")):
        raise ValueError(f"mask: expected bool [{v.shape[0]}], got {mask.dtype} {mask.shape}")
    return dtype


def _by_state(x, ndim: int) -> tuple[int, int, int]:
    """(n, state, h) strides of v [n, S, h, D] / s [n, S, h]; one state per row (v [n, h, D],
    s [n, h]) has a state stride of 0."""
    st = x.strides
    return (st[0], st[1], st[2]) if x.ndim == ndim else (st[0], 0, st[1])


def _check_sinks(v, s, sinks) -> str:
    dtype = _check_state(v, s, "v", 3)
    heads = v.shape[1]
    if sinks.shape != (heads,) or sinks.dtype != "float32":
        raise ValueError(
            f"sinks: expected float32 [{heads}] (one logit a query head), got {sinks.dtype} "
            f"{sinks.shape}"
        )
    return dtype


def _prepare(infos, _align: int, static: tuple) -> Prepared:
    """Slots: merge_states (v, s); merge_state (v_a, s_a, v_b, s_b); in_place (v, s, v_other,
    s_other, mask) and sinks (v, s, sinks), whose outputs are v and s updated. Pointers: the
    slots', then the outputs' (v, s)."""
    (op,) = static
    sinks = None
    if op == "merge_states":
        (a_v, a_s), b_v, b_s, mask = infos, None, None, None
        dtype = _check_state(a_v, a_s, "v", 4)
    elif op == "sinks":
        (a_v, a_s, sinks), b_v, b_s, mask = infos, None, None, None
        dtype = _check_sinks(a_v, a_s, sinks)
    else:
        a_v, a_s, b_v, b_s = infos[:4]
        mask = infos[4] if op == "in_place" else None
        dtype = _check_two_states(op, a_v, a_s, b_v, b_s, mask)
    n, h, d = a_v.shape[0], a_v.shape[-2], a_v.shape[-1]
    in_place = op in ("in_place", "sinks")
    if in_place:
        o_v, o_s = a_v, a_s
        outs = (
            OutSlot(a_v.shape, dtype, 0, alias=True),
            OutSlot(a_s.shape, "float32", 1, alias=True),
        )
    else:
        o_v = a_v._replace(shape=(n, h, d), strides=dense_strides((n, h, d)), offset=0)
        o_s = a_s._replace(shape=(n, h), strides=dense_strides((n, h)), offset=0)
        outs = (OutSlot(o_v.shape, dtype), OutSlot(o_s.shape, "float32"))
    has_b, masked, sink = b_v is not None, mask is not None, sinks is not None
    spec = MergeSpec(dtype, widest_vec(d, itemsize(dtype)), has_b, masked, sink)
    views = (a_v, b_v if has_b else a_v, o_v)
    align = min(v.align for v in views)

    def remake(n: int, outs: tuple) -> Prepared:  # n rows (prepared.with_rows)
        launch = _launch(spec, align, *(v._replace(shape=(n, *v.shape[1:])) for v in views))
        p = launch.params
        p.a_vn, p.a_vs, p.a_vh = _by_state(a_v, 4)
        p.a_sn, p.a_ss, p.a_sh = _by_state(a_s, 3)
        if has_b:
            (p.b_vn, p.b_vh), (p.b_sn, p.b_sh) = b_v.strides[:2], b_s.strides
        (p.o_vn, p.o_vh), (p.o_sn, p.o_sh) = o_v.strides[:2], o_s.strides
        p.rows, p.num_heads, p.head_dim = n * h, h, d
        p.num_a = a_v.shape[1] if a_v.ndim == 4 else 1
        if sink:
            (p.sinks_h,) = sinks.strides
        return one_launch(outs, launch, fill, dense=dense, rows=n,
                          remake=remake)  # fmt: skip

    o = len(infos)
    a = o if in_place else 0  # in place: read through the outputs (XLA's copies)

    pointers = [("a_v", a), ("a_s", a + 1)]
    pointers += [("b_v", 2), ("b_s", 3)] if has_b else []
    pointers += [("mask", 4)] if masked else []
    pointers += [("sinks", 2)] if sink else []
    pointers += [("o_v", o), ("o_s", o + 1)]
    dense = (4,) if masked and not mask.contiguous else ()  # read as a bare pointer
    fill = Fill(tuple(pointers))
    return remake(n, outs)


def _launch(spec: MergeSpec, align: int, a_v, b_v, o_v) -> Launch:
    """The launch over rows (n, h) of the v arrays (b_v: a_v when there is no b): one warp per
    row. An empty batch launches nothing and, reading nothing, is not checked further."""
    n, h, d = a_v.shape[0], a_v.shape[-2], a_v.shape[-1]
    rows = n * h
    if rows:
        if rows * 32 > INT32_MAX:
            raise ValueError(f"{n} x {h} rows of states exceed the kernel's int32 grid indexing")
        for arr in (a_v, b_v, o_v):
            if d > 1 and arr.size and arr.strides[-1] != 1:
                strides = tuple(s * arr.itemsize for s in arr.strides)  # in bytes, as ever
                raise ValueError(f"the head_dim of every v must be contiguous, got {strides}")
        strides = [s for arr in (a_v, b_v, o_v) for s in arr.strides[:-1]]
        vec = fit_vec(spec.vec, itemsize(spec.dtype), align, strides)
        if vec != spec.vec:
            spec = replace(spec, vec=vec)
    grid = -(-rows * 32 // THREADS)
    return Launch(Kernel(spec, "merge_kernel", "MergeParams"), (grid, 1, 1), (THREADS, 1, 1))


_STATES = Op("merge_states", ("v", "s"), _prepare, rows=("v", "s"))
_MERGE = Op("merge_state", ("v_a", "s_a", "v_b", "s_b"), _prepare,
            rows=("v_a", "s_a", "v_b", "s_b"))  # fmt: skip
_IN_PLACE = Op("merge_state_in_place", ("v", "s", "v_other", "s_other", "mask"), _prepare,
               rows=("v", "s", "v_other", "s_other", "mask"))  # fmt: skip
_SINKS = Op("merge_sinks_in_place", ("v", "s", "sinks"), _prepare, rows=("v", "s"))


@compilable("v_a", Shortcut(_MERGE, ("v_a", "s_a", "v_b", "s_b"), '("merge_state",)'))
def merge_state(v_a, s_a, v_b, s_b):
    """Merge two states: v_a, v_b [n, h, D] (fp16/bf16/fp32), s_a, s_b [n, h] float32.

    Returns (v [n, h, D] in v_a's dtype, s [n, h] float32) in the caller's array type.
    """
    return call(_MERGE, (v_a, s_a, v_b, s_b), ("merge_state",))


@compilable("v")
def merge_state_in_place(v, s, v_other, s_other, mask=None):
    """(v, s) <- merge((v, s), (v_other, s_other)) where mask [n] (bool) is true (all rows
    without a mask). Shapes as merge_state. Returns (v, s): the updated arrays (new ones for
    JAX, whose arrays are immutable)."""
    return call(_IN_PLACE, (v, s, v_other, s_other, mask), ("in_place",))


@compilable("v")
def merge_sinks_in_place(v, s, sinks):
    """(v, s) <- merge((v, s), each head's sink): attention sinks, as FlashInfer's run(sinks=),
    applied to a finished attention state (the wrappers' run(sinks=) call it).

    The sink of head h is one more key, of logit sinks[h] (natural units, like the scaled
    logits sm_scale * q.k) and value 0, in every row's softmax:

        w = 2^s / (2^s + e^sinks[h]);   v <- w * v;   s <- log2(2^s + e^sinks[h])

    v [n, h, D] (fp16/bf16/fp32), s [n, h] float32 (base-2 LSE), sinks [h] float32 (another
    float dtype is converted by the caller's framework first). A row without keys (s = -inf)
    keeps v = 0 and gets s = sinks[h] * log2(e); sinks[h] = -inf leaves head h as it is.
    Returns (v, s): the updated arrays (new ones for JAX, whose arrays are immutable)."""
    return call(_SINKS, (v, s, cast(sinks, "float32")), ("sinks",))


@compilable("v", Shortcut(_STATES, ("v", "s"), '("merge_states",)'))
def merge_states(v, s):
    """Merge S states per row: v [n, S, h, D], s [n, S, h] float32 -> (v [n, h, D], s [n, h]).

    States merge in index order (deterministic). S = 0 gives v = 0 and s = -inf.
    """
    return call(_STATES, (v, s), ("merge_states",))


def specs_for(head_dim: int, dtype: str, sinks: bool = False) -> list[MergeSpec]:
    """What a serving loop's merges use (warmup): merge_state, merge_state_in_place with and
    without a mask, merge_states, on attention outputs of `dtype`; with `sinks`,
    merge_sinks_in_place too."""
    vec = widest_vec(head_dim, itemsize(dtype))
    specs = [MergeSpec(dtype, vec, has_b, mask)
             for has_b, mask in ((True, False), (True, True), (False, False))]  # fmt: skip
    return specs + ([MergeSpec(dtype, vec, False, False, True)] if sinks else [])


__all__ = ["MergeSpec", "merge_sinks_in_place", "merge_state", "merge_state_in_place",
           "merge_states", "specs_for"]  # fmt: skip
