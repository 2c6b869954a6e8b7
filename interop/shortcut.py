"""A public function's shortcut for PyTorch tensors or CuPy arrays of a signature it has
already run.

call() reads each array, keys the prepared launch on the signature and allocates the outputs,
below the public function's own frame and call()'s dispatch. A function that declares how it
calls its op (`Shortcut`: the parameter in each op slot, the op's static arguments and its
scalars as expressions of the parameters) gets, in the wrapper `compilable` generates, a
first branch for PyTorch tensors and a second for CuPy arrays: the signature's key read
straight from the parameters, and on a hit the outputs allocated and the prepared run
launched, nothing else; a miss runs the function (call()'s path) and, the second time a
signature misses, `learn`s it (a signature seen once, as each new token count of a prefill
is, costs one dict entry of its hash: call.seen_before). A branch is taken only where call()
would take the same path to the same launch:
every slot array of the branch's framework (a torch.Tensor or a subclass, as call() takes
them: an nn.Parameter weight; a cupy.ndarray itself), a given output too (`out=`: its
attributes are part of the key, as in call()'s), no launching_on stream, PyTorch not tracing
(torch.compile), and a prepared call of one launch (prepared.one_launch) with no dense
copies and one GPU in the process (learn keeps no shortcut for the others). A hit fills the
launch's parameters and issues it in the branch's one more frame (_launcher). The shortcuts
live in the op's cache (dropped with it).

A plan()/run() wrapper's run() has one too (`Shortcut.owner`): its op is the wrapper's own,
its key holds the current plan's configuration and batch, and a hit launches the current
plan's launch (prepared.Planned, _planned_launcher)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from ..launch import RECORDINGS
from .generated import define
from .prepared import Op

_call = importlib.import_module(".call", __package__)  # the module (the package's `call` is
# its function); read at each use, so that what a test patches there is seen here


@dataclass(frozen=True)
class Shortcut:
    """`op`'s slots as the function's parameters (None: a slot the function never fills; a
    slot among op.given, an output the caller may pass, is None or an array), and the op's
    static arguments and scalars as Python expressions of the parameters, as the function's
    body passes them (calling, by name, the body's own `helpers` where it does). `when`: a
    condition on the parameters under which the body calls the op so (the samplers: no
    per-row arrays, no seed arrays, no indices), else every call takes the body.

    A plan()/run() wrapper's run (`owner`: the parameter holding the wrapper, "self"): the op
    is the owner's own (`owner._op`; `op` gives its slots), `bind`, tested first, binds `_st`
    to the owner's current plan state (and may bind the names slots read, with :=), and the
    branch hands the owner and `_st` to the launch (prepared.Planned). `optional`: slot
    parameters that may be None (as given outputs may: a signature of each)."""

    op: Op
    slots: tuple[str | None, ...]
    static: str
    scalars: str = "()"
    helpers: tuple = ()  # functions the expressions call, by their names (the body's own)
    when: str = ""
    owner: str = ""
    bind: str = ""
    optional: tuple[str, ...] = ()


class _Tag:
    """The first element of a shortcut's key in the op's cache (call()'s keys start with the
    op itself): one for PyTorch's signatures, one for CuPy's."""

    __slots__ = ()


TAG, CUPY_TAG = _Tag(), _Tag()
# [whether shortcuts are taken]: cleared by the first call learn sees in a process with
# several GPUs (whose calls keep to call()'s path), so that their branches cost one test.
ENABLED = [True]


@dataclass(frozen=True)
class _Reads:
    """How a branch tests and reads one framework's arrays: `{p}` the parameter, `{i}` its
    place among the branch's arrays (its pointer is `_p{i}`)."""

    tag: str  # the global holding the keys' first element
    test: str  # the array's type test
    also: str  # what else the branch needs
    pointer: str  # the array's address
    device: str  # its device
    attrs: str  # its part of the key, but for the device


_TORCH = _Reads(
    tag="_tag",
    test="(type({p}) is _tensor[0] or isinstance({p}, _tensor[0]))",
    also="not _tensor[1]()",  # torch.compiler.is_compiling: traced calls take the op
    pointer="{p}.data_ptr()",
    device="{p}.get_device()",
    attrs="{p}.shape, {p}.stride(), {p}.dtype",
)
_CUPY = _Reads(
    tag="_cupy_tag",
    test="type({p}) is _ndarray[0]",
    also="",
    pointer="{p}.data.ptr",
    device="{p}.data.device_id",
    attrs="{p}.shape, {p}.strides, {p}.dtype",
)


def source(cut: Shortcut, call_fn: str) -> str:
    """The lines (4-space indented) of the shortcut's branches, PyTorch's then CuPy's, for a
    generated function whose parameters hold the slots; `call_fn` is the generated call of the
    function itself."""
    op = cut.op
    if len(cut.slots) != len(op.slots):
        raise ValueError(f"{op.name}: {len(cut.slots)} slot parameters for {len(op.slots)} slots")
    return _branch(cut, call_fn, _TORCH) + _branch(cut, call_fn, _CUPY)


def _branch(cut: Shortcut, call_fn: str, reads: _Reads) -> str:
    """One framework's branch. A given output's parameter may be None or an array: its part
    of the key is None or its attributes (a signature of each)."""
    op = cut.op
    maybe = [i in op.given or p in cut.optional for i, p in enumerate(cut.slots)]
    given = [p for i, p in enumerate(cut.slots) if maybe[i] and p is not None]
    arrays = [p for i, p in enumerate(cut.slots) if p is not None and not maybe[i]]
    slot_params = arrays + given
    the_op = f"{cut.owner}._op" if cut.owner else "_op"
    conds = ["_enabled[0]"] + ([f"({cut.bind})"] if cut.bind else [])
    conds += [reads.test.format(p=p) for p in arrays]
    conds += [f"({p} is None or {reads.test.format(p=p)})" for p in given]
    conds += [reads.also] if reads.also else []
    conds += [f"({cut.when})"] if cut.when else []
    values = [p if p is not None else "None" for p in cut.slots]
    pointers = [f"_p{slot_params.index(p)}" if p is not None else "0" for p in cut.slots]
    attrs = [f"{reads.attrs.format(p=p)}, {reads.device.format(p=p) if i else '_d'}, _p{i} & 15"
             for i, p in enumerate(slot_params)]  # fmt: skip
    parts = "".join(f"{a}, " for a in attrs[: len(arrays)])
    parts += "".join(f"({a}) if {p} is not None else None, "
                     for p, a in zip(given, attrs[len(arrays):], strict=True))  # fmt: skip
    lines = [f"    if {' and '.join(conds)} and not _local.stream:"]
    lines += [f"        _p{i} = {reads.pointer.format(p=p)}" for i, p in enumerate(arrays)]
    lines += [f"        _p{len(arrays) + i} = {reads.pointer.format(p=p)} if {p} is not None else 0"
              for i, p in enumerate(given)]  # fmt: skip
    lines += [f"        _d = {reads.device.format(p=arrays[0])}"]
    lines += [
        f"        _static = {cut.static}",
        f"        _key = ({reads.tag}, _static, {parts})",
        f"        _launch = {the_op}.cache.get(_key)",
        "        if _launch:",
        f"            return _launch(({', '.join(values)},), [{', '.join(pointers)}], _d,",
        f"                           {cut.scalars}{f', {cut.owner}, _st' if cut.owner else ''})",
        f"        _result = {call_fn}",
        "        # seen twice: learnt (False: learnt, no shortcut for it); once: noted by its hash",
        f"        if _launch is None and _seen_before({the_op}, _key):",
        f"            _learn({the_op}, _key, ({', '.join(values)},), _static, _d)",
        "        return _result",
    ]
    return "\n".join(lines) + "\n"


def names(cut: Shortcut) -> dict:
    """The generated function's globals the branches read."""
    names = {"_tensor": _call.TORCH_TENSOR, "_ndarray": _call.CUPY_NDARRAY,
             "_local": _call._LOCAL, "_tag": TAG, "_cupy_tag": CUPY_TAG, "_learn": learn,
             "_enabled": ENABLED, "_seen_before": _call.seen_before,
             **{f.__name__: f for f in cut.helpers}}  # fmt: skip
    if not cut.owner:  # an owner's op is its own (the branch reads it)
        names["_op"] = cut.op
    return names


def learn(op: Op, key: tuple, arrays: tuple, static: tuple, device: int) -> None:
    """Keep under `key` the launch of the signature call() has just prepared for `arrays` on
    `device`, where the shortcut takes the same path (module docstring)."""
    torch = key[0] is TAG
    call_key = (_call.torch_call_key if torch else _call.cupy_call_key)(op, arrays, static)
    prep = op.cache.get(call_key)
    if prep is None:  # the call raised or went elsewhere: learn it at the next call
        return
    op.cache[key] = False  # no shortcut for the signature, unless made below
    if not prep.one_device:
        ENABLED[0] = False
    if prep.dense or not prep.one_device or prep.fill is None or prep.scratch or prep.check:
        return
    if prep.launch is None and prep.planned is None:  # a wrapper's run that launches nothing
        return
    if prep.record is not None and prep.record.device != device:
        return
    kit = _torch_kit() if torch else _cupy_kit()
    outs = []  # (input slot, it is the output itself) or (None, a maker of the new output)
    for slot in prep.outs:
        if slot.source is not None:
            outs.append((slot.source, True))
        elif slot.like is not None:
            outs.append((slot.like, False))
        else:
            outs.append((None, kit.new(slot.shape, slot.dtype, arrays[0])))
    op.cache[key] = _launcher(outs, prep, kit, device, partial(op.cache.__setitem__, key))


class _Kit(NamedTuple):
    """How a framework's launcher (generated) reads the current stream and makes and reads its
    outputs, as expressions over `names`: `stream` the current stream's handle on `device`,
    `new_like` a new C-contiguous array of the shape and dtype of `{a}`, `address` the address
    of array `{a}`; and new(sizes, dtype name, first array) -> a maker of new arrays of these
    sizes and dtype on the first array's device, as call() allocates them (its key holds the
    devices)."""

    names: dict
    stream: str
    new_like: str
    address: str
    new: Callable


def _torch_kit() -> _Kit:
    torch, _, raw_stream, empty_like = _call._torch()

    def new(sizes, dtype, first):
        return partial(torch.empty, *(sizes or ((),)), dtype=_call._torch_dtype(dtype),
                       device=first.device)  # fmt: skip

    names = {"_raw_stream": raw_stream, "_empty_like": empty_like}
    return _Kit(names, "_raw_stream(device)", "_empty_like({a})", "{a}.data_ptr()", new)


def _cupy_kit() -> _Kit:
    ndarray, current_stream = _call._cupy()[1:]

    def new(sizes, dtype, first):  # on the current device, as _run_cupy's
        return partial(ndarray, sizes, _call.storage_dtype(dtype))

    names = {"_ndarray": ndarray, "_current_stream": current_stream}
    return _Kit(names, "_current_stream().ptr", "_ndarray({a}.shape, {a}.dtype)", "{a}.data.ptr",
                new)  # fmt: skip


def _launcher(outs: list, prep, kit: _Kit, device: int, keep: Callable, issue=None):
    """launch(arrays, ptrs, device, scalars) -> what call() returns: the outputs allocated as
    call() allocates them (`outs`: learn's list), their pointers appended, and prep's one
    launch issued as its run would (prepared.one_launch): the pointers and scalars written
    (prep.fill's statements) and the launch issued under its lock, in this one frame; while a
    recording is under way, through prep.run; a kernel that checks indices on the device
    (prep.record) first raises what an earlier call reported, as its run does. Generated for
    the pattern of outputs. `issue`:
    the launch's issuer on `device`; None: the first launch asks for it (loading the kernel,
    which a call recorded only has not) and keep()s the launcher made with it in its place."""
    if prep.planned is not None:
        return _planned_launcher(outs, prep, kit)
    launch = prep.launch
    if issue is None:

        def issue(stream: int) -> int:  # the first launch: made with the issuer from now on
            found = launch.issuer(device)
            keep(_launcher(outs, prep, kit, device, keep, found))
            return found(stream)

    names = {"_run": prep.run, "_issue": issue, "_lock": launch.lock, "_failed": launch.failed,
             "_recordings": RECORDINGS, "_record": prep.record, **kit.names,
             **prep.fill.names("_p", launch.params)}  # fmt: skip
    checked, recorded = [], []  # a kernel that checks indices: raise what a call reported
    if prep.record is not None:
        from .. import errors

        names["_raise_reported"] = errors.raise_reported
        checked = ["    if _record.reported.value:", "        _raise_reported(_record, stream)"]
        recorded = ["            _p.bad, _p.bad_host = _record.device_ptr, _record.host_ptr"]
    lines = ["def launch(arrays, ptrs, device, scalars):"]
    made, results = _outputs(outs, kit, names)
    lines += [
        *made,
        f"    stream = {kit.stream}",
        "    if _recordings[0]:",
        "        _run(stream, device, ptrs, scalars)",
        "    else:",
        *["    " + line for line in checked],
        "        _lock.acquire()",
        "        try:",
        *prep.fill.lines("_p", "            "),
        *recorded,
        "            status = _issue(stream)",
        "        finally:",
        "            _lock.release()",
        "        if status:",
        "            _failed(status, stream, device)",
        f"    return {results}",
    ]
    return define(lines, names, "<shortcut launch>")


def _outputs(outs: list, kit: _Kit, names: dict) -> tuple[list, str]:
    """A launcher's lines that allocate its outputs (learn's `outs`) and append their
    pointers, and the expression of what it returns; the makers of new arrays go into
    `names`."""
    lines, results = [], []
    for n, (i, same) in enumerate(outs):
        if i is None:  # a new array of its own shape
            names[f"_new{n}"] = same
            lines.append(f"    o{n} = _new{n}()")
        elif same:  # an input, updated in place, or a given out=
            lines.append(f"    ptrs.append(ptrs[{i}])")
            results.append(f"arrays[{i}]")
            continue
        else:  # a new array like input i
            lines.append(f"    o{n} = {kit.new_like.format(a=f'arrays[{i}]')}")
        lines.append(f"    ptrs.append({kit.address.format(a=f'o{n}')})")
        results.append(f"o{n}")
    return lines, results[0] if len(results) == 1 else "(" + ", ".join(results) + ")"


def _planned_launcher(outs: list, prep, kit: _Kit):
    """launch(arrays, ptrs, device, scalars, owner, _st) -> what call() returns, for a
    wrapper's run (prepared.Planned): the outputs allocated as call() allocates them, then,
    under the lock of the launch of the owner's current plan state `_st` (the one the branch
    keyed on), the signature's fields written where another signature filled the launch last,
    the pointers and scalars (prep.fill), the owner's _before_run and the launch; through
    prep.run while a recording is under way or where the signature must not launch on `_st`
    (planned.stale: the run raises why)."""
    planned = prep.planned
    names = {"_run": prep.run, "_recordings": RECORDINGS, "_fields": planned.fields,
             "_limit": planned.limit, **kit.names, **prep.fill.names("_p", None)}  # fmt: skip
    del names["_p"]  # the current launch's block, read at each call
    written = []
    for n, (field, value) in enumerate(planned.fields.items()):
        names[f"_f{n}"] = value
        written.append(f"            _p.{field} = _f{n}")
    made, results = _outputs(outs, kit, names)
    lines = [
        "def launch(arrays, ptrs, device, scalars, owner, _st):",
        *made,
        f"    stream = {kit.stream}",
        f"    if _recordings[0] or {planned.stale}:",
        "        _run(stream, device, ptrs, scalars)",
        f"        return {results}",
        "    _launch = _st.launch",
        "    _launch.lock.acquire()",
        "    try:",
        "        _p = _launch.params",
        "        if _launch.tag is not _fields:",
        *written,
        "            _launch.tag = _fields",
        *prep.fill.lines("_p", "        "),
        "        if not _launch.empty:",
        "            owner._before_run(stream, _st)",
        "            _launch(stream, device)",
        "    finally:",
        "        _launch.lock.release()",
        f"    return {results}",
    ]
    return define(lines, names, "<shortcut launch of a planned run>")


__all__ = ["CUPY_TAG", "ENABLED", "Shortcut", "TAG", "learn", "names", "source"]
