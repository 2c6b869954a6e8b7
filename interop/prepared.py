"""What a prepared call is made of: the arrays as a prepare function sees them (ArrayInfo),
the outputs (OutSlot), the validated launch of one call signature (Prepared) and the public op
that holds those per signature (Op). interop/call.py reads the caller's arrays into them and
runs the launch."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .dtypes import numpy_dtype
from .fill import Fill
from .generated import define


class ArrayInfo(NamedTuple):
    """One argument as a prepare function sees it."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str  # canonical name; fp8 may arrive as its uint8 storage
    device: int  # CUDA ordinal; -1 for host memory
    offset: int = 0  # its address modulo 16

    @property
    def align(self) -> int:
        """The largest power of two, at most 16, dividing its address (bytes)."""
        return common_align(self.offset)

    @property
    def itemsize(self) -> int:
        return numpy_dtype(self.dtype).itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def contiguous(self) -> bool:
        return self.strides == dense_strides(self.shape) or self.size <= 1


def dense_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides (elements) of a dense array of `shape`."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(out))


@dataclass(frozen=True)
class OutSlot:
    """An output: allocated (`source` None), or the array in input slot `source` (an `out=`
    given by the caller, or an input updated in place: `alias`). `like`: a contiguous input
    slot of the same shape and dtype, if any (allocating "like" it is cheaper; set by call)."""

    shape: tuple[int, ...]
    dtype: str
    source: int | None = None
    alias: bool = False
    like: int | None = None


class Planned(NamedTuple):
    """A one-launch call whose launch is its owner's current one (a plan()/run() wrapper's: each
    plan() may make another), for the owner's shortcut (interop/shortcut.py): the owner's
    current state `_st` (its `_launch`) holds the Launch as `_st.launch`, and
    `owner._before_run(stream, _st)` runs under the launch's lock before it is issued (stream
    ordering, CUDA-graph notes). `fields`: the signature's own fields, written where another
    signature filled the launch last (its `tag`); `stale`: an expression of `_st` and
    `_limit`, true where this signature must not launch on the state (the run raises why)."""

    fields: dict
    stale: str
    limit: int


@dataclass(eq=False)
class Prepared:
    """A validated call signature: its outputs and how to launch it.

    run(stream, device, pointers, scalars): `pointers` holds one address per input slot (0
    for absent ones) followed by one per output; `device` is current. `dense`: input slots
    that must be contiguous, copied first when they are not (index arrays read as bare
    pointers). `preload(device)` loads the kernels (before a CUDA-graph capture).

    JAX: `command_buffer=False` when `run` reads state that may change between executions of
    a compiled computation (XLA must then call it every time instead of replaying a recorded
    launch); `on_trace()` is called when a JAX computation is built on it. `scratch`: how many
    of the last outputs are per-call scratch (partials, an intermediate), allocated for the
    launch and not returned: a call returns its other outputs, one bare, several as a tuple."""

    outs: tuple[OutSlot, ...]
    run: Callable[[int, int, list, tuple], None]
    preload: Callable[[int], None] = lambda device: None
    dense: tuple[int, ...] = ()
    scratch: int = 0
    command_buffer: bool = True
    on_trace: Callable[[], None] | None = None
    keep: object = None  # what the launch reads that it owns (device memory of its own)
    one_device: bool = False  # the process sees one GPU: it is current (set by call)
    # One launch whose call-dependent fields `fill` writes (one_launch): run fills them and
    # launches under the launch's lock, as the shortcut (interop/shortcut.py) does inline.
    launch: object = None
    fill: Fill | None = None
    record: object = None  # one_launch's errors.Record, for a kernel that checks indices
    check: bool = False  # one_launch's run waits for its launch and raises what it reported
    # A launch of the owner's current plan (`launch` None) whose pointers and scalars `fill`
    # writes: run does so, and so may the owner's shortcut.
    planned: Planned | None = None
    # one_launch's `rows`: the leading dim of the op's row slots this call was made for, where
    # nothing but its grid's x and its outputs' first dims depend on it (0: where more does)
    rows: int = 0
    remake: Callable | None = None  # remake(n, outs) -> the call of n rows, where more than
    # its grid's x depends on them (one_launch's)
    _jax: dict | None = None  # scalars -> the jitted call (call_jax), made by the first
    _handlers: list | None = None  # its JAX FFI handlers (call_jax), made by the first


def one_launch(outs: tuple[OutSlot, ...], launch, fill: Fill, record=None, check=False,
               rows: int = 0, remake: Callable | None = None, **fields) -> Prepared:  # fmt: skip
    """The Prepared of a call that is one launch (rtcinfer.launch.Launch): `fill` writes the
    call's pointers and scalars into launch.params, then it launches, under launch.lock (calls
    sharing the launch write the same block). `record` (rtcinfer.errors.Record, of the
    arrays' device), for a kernel that checks indices on the device: a call first raises what
    an earlier one reported (errors.before_launch), the kernel's `bad` and `bad_host` point at
    the record of the device it runs on, and with `check` (RTCINFER_CHECK=1) the call waits
    for its launch and raises what it reported. `rows`: the leading dim of the op's row
    slots (Op.rows) the call was made for, where nothing but the grid's x (a multiple of it)
    and the outputs' first dims depend on it, so that with_rows makes the call of another
    (0, or one row, whose strides read differently: not so); `remake(n, outs)`: that call,
    where more depends on the rows (the op's own launch geometry, from the validated
    signature). `fields`: Prepared's others."""
    lines = ["def run(stream, device, ptrs, scalars):"]
    lines += ["    found = _before(_record, device, stream)"] if record is not None else []
    lines += ["    _lock.acquire()", "    try:", *fill.lines("_p", "        ")]
    if record is not None:
        lines.append("        _p.bad, _p.bad_host = found.device_ptr, found.host_ptr")
    lines += ["        _launch(stream, device)", "    finally:", "        _lock.release()"]
    lines += ["    _check(found, stream)"] if record is not None and check else []
    names = {"_lock": launch.lock, "_launch": launch, **fill.names("_p", launch.params)}
    if record is not None:
        from .. import errors

        names.update(_before=errors.before_launch, _record=record, _check=errors.check_launch)
    run = define(lines, names, "<run of a one-launch call>")
    return Prepared(outs, run, preload=launch.preload, launch=launch, fill=fill,
                    record=record, check=record is not None and check,
                    rows=rows if rows >= 2 else 0,
                    remake=remake, **fields)  # fmt: skip


def with_rows(prep: Prepared, n: int, row_slots: tuple[int, ...]) -> Prepared:
    """The call `prep` (one_launch's, made for prep.rows leading rows) for n of them: its
    launch with the grid's x scaled and the same parameters, the outputs of a row slot, or new
    ones, with n rows; the same fill, checks and copies. A call of a new token count costs
    this instead of its op's validation (the signature is the one validated but for the
    rows); an op whose launch depends on the rows otherwise makes it (prep.remake)."""
    outs = tuple(OutSlot((n, *o.shape[1:]), o.dtype, o.source, o.alias, o.like)
                 if o.source is None or o.source in row_slots else o
                 for o in prep.outs)  # fmt: skip
    if prep.remake is not None:
        made = prep.remake(n, outs)
    else:
        old = prep.launch
        launch = type(old)(old.kernel, (old.grid[0] // prep.rows * n, *old.grid[1:]), old.block)
        ctypes.memmove(ctypes.addressof(launch.params), ctypes.addressof(old.params),
                       ctypes.sizeof(old.params))  # fmt: skip
        made = one_launch(outs, launch, prep.fill, prep.record, prep.check, rows=n,
                          dense=prep.dense)  # fmt: skip
    made.one_device = prep.one_device
    return made


def row_count(x) -> int:
    """one_launch's `rows` for an op whose row slot is `x` (ArrayInfo): its leading dim where it
    has two or more dims (a 1-D array's only dim is not a row count)."""
    return x.shape[0] if x.ndim >= 2 else 0


def no_launch(stream, device, ptrs, scalars) -> None:
    """The run of a call with nothing to launch (no rows, no heads)."""


class Op:
    """A public op: its input slot names and `prepare(infos, align, static) -> Prepared`,
    where `infos` are ArrayInfo (None for an absent slot) and `align` is the largest power of
    two, at most 16, dividing every pointer (in bytes). `given`: the slots that hold outputs
    given by the caller (`out=`), which JAX arrays cannot be. `jax_static(static)`: the static
    arguments a call on JAX arrays is prepared with, where they differ (an op that updates
    inputs in place writes new arrays for JAX, whose arrays are immutable: no output aliases
    an input, so XLA can launch it itself, interop/xla_launch.py). `rows`: the slots whose
    leading dim is the call's row (token) count, where its prepared calls say they hold for
    any (one_launch's `rows`): a call that differs from a prepared one only there is made
    from it (with_rows) without the op's validation."""

    def __init__(self, name: str, slots: Sequence[str], prepare: Callable[..., Prepared],
                 given: Sequence[str] = (),
                 jax_static: Callable[[tuple], tuple] | None = None,
                 rows: Sequence[str] = ()):  # fmt: skip
        self.name, self.slots, self.prepare = name, tuple(slots), prepare
        self.given = tuple(self.slots.index(g) for g in given)
        self.jax_static = jax_static
        self.rows = tuple(self.slots.index(r) for r in rows)
        self.cache: dict[tuple, Prepared] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Op({self.name})"


def common_align(bits: int) -> int:
    """The largest power of two <= 16 dividing every pointer whose bits were OR-ed together."""
    bits &= 15
    return 16 if bits == 0 else bits & -bits


__all__ = [
    "ArrayInfo",
    "Op",
    "OutSlot",
    "Planned",
    "Prepared",
    "common_align",
    "dense_strides",
    "no_launch",
    "one_launch",
    "row_count",
    "with_rows",
]
