"""A public function's shortcut for PyTorch tensors of a signature it has already run.

call() reads each array, keys the prepared launch on the signature and allocates the outputs,
below the public function's own frame and call()'s dispatch. A function that declares how it
calls its op (`Shortcut`: the parameter in each op slot, the op's static arguments and its
scalars as expressions of the parameters) gets, in the wrapper `compilable` generates, a
first branch for PyTorch tensors: the signature's key read straight from the parameters, and
on a hit the outputs allocated and the prepared run launched, nothing else; a miss runs the
function (call()'s path) and then `learn`s the signature. The branch is taken only where
call() would take the same path to the same launch: every slot array a torch.Tensor (or a
subclass, as call() takes them: an nn.Parameter weight), a given output too (`out=`: its
attributes are part of the key, as in call()'s), no launching_on stream, and a prepared call
with no dense copies and one GPU in the process (learn keeps no shortcut for the others).
The shortcuts live in the op's cache (dropped with it)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .prepared import Op

_call = importlib.import_module(".call", __package__)  # the module (the package's `call` is
# its function); read at each use, so that what a test patches there is seen here


@dataclass(frozen=True)
class Shortcut:
    """`op`'s slots as the function's parameters (None: a slot the function never fills; a
    slot among op.given, an output the caller may pass, is None or a tensor), and the op's
    static arguments and scalars as Python expressions of the parameters, as the function's
    body passes them (calling, by name, the body's own `helpers` where it does)."""

    op: Op
    slots: tuple[str | None, ...]
    static: str
    scalars: str = "()"
    helpers: tuple = ()  # functions the expressions call, by their names (the body's own)


class _Tag:
    """The first element of a shortcut's key in the op's cache (call()'s keys start with the
    op itself)."""

    __slots__ = ()


TAG = _Tag()


def source(cut: Shortcut, call_fn: str) -> str:
    """The lines of the shortcut branch (4-space indented) for a generated function whose
    parameters hold the slots; `call_fn` is the generated call of the function itself. A
    given output's parameter may be None or a tensor: its part of the key is None or its
    attributes (a signature of each)."""
    op = cut.op
    if len(cut.slots) != len(op.slots):
        raise ValueError(f"{op.name}: {len(cut.slots)} slot parameters for {len(op.slots)} slots")
    given = [p for i, p in enumerate(cut.slots) if i in op.given and p is not None]
    tensors = [p for i, p in enumerate(cut.slots) if p is not None and i not in op.given]
    slot_params = tensors + given
    conds = [f"(type({p}) is _tensor[0] or isinstance({p}, _tensor[0]))" for p in tensors]
    conds += [f"({p} is None or type({p}) is _tensor[0] or isinstance({p}, _tensor[0]))"
              for p in given]  # fmt: skip
    conds.append("not _tensor[1]()")  # torch.compiler.is_compiling: traced calls take the op
    values = [p if p is not None else "None" for p in cut.slots]
    pointers = [f"_p{slot_params.index(p)}" if p is not None else "0" for p in cut.slots]
    device = [f"{p}.get_device()" if i else "_d" for i, p in enumerate(slot_params)]
    attrs = [f"{p}.shape, {p}.stride(), {p}.dtype, {device[i]}, _p{i} & 15"
             for i, p in enumerate(slot_params)]  # fmt: skip
    parts = "".join(f"{a}, " for a in attrs[: len(tensors)])
    parts += "".join(f"({a}) if {p} is not None else None, "
                     for p, a in zip(given, attrs[len(tensors):], strict=True))  # fmt: skip
    lines = [f"    if {' and '.join(conds)} and not _local.stream:"]
    lines += [f"        _p{i} = {p}.data_ptr()" for i, p in enumerate(tensors)]
    lines += [f"        _p{len(tensors) + i} = {p}.data_ptr() if {p} is not None else 0"
              for i, p in enumerate(given)]  # fmt: skip
    lines += [f"        _d = {tensors[0]}.get_device()"]
    lines += [
        f"        _static = {cut.static}",
        f"        _key = (_tag, _static, {parts})",
        "        _launch = _op.cache.get(_key)",
        "        if _launch:",
        f"            return _launch(({', '.join(values)},), [{', '.join(pointers)}], _d,",
        f"                           {cut.scalars})",
        f"        _result = {call_fn}",
        "        if _launch is None:  # False: learnt, and no shortcut for it",
        f"            _learn(_op, _key, ({', '.join(values)},), _static)",
        "        return _result",
    ]
    return "\n".join(lines) + "\n"


def names(cut: Shortcut) -> dict:
    """The generated function's globals the branch reads."""
    return {"_tensor": _call.TORCH_TENSOR, "_local": _call._LOCAL, "_tag": TAG, "_op": cut.op,
            "_learn": learn, **{f.__name__: f for f in cut.helpers}}  # fmt: skip


def learn(op: Op, key: tuple, arrays: tuple, static: tuple) -> None:
    """Keep under `key` the launch of the signature call() has just prepared for `arrays`,
    where the shortcut takes the same path (module docstring)."""
    prep = op.cache.get(_call.torch_call_key(op, arrays, static))
    if prep is None:  # the call raised or went elsewhere: learn it at the next call
        return
    op.cache[key] = False  # no shortcut for the signature, unless made below
    if prep.dense or not prep.one_device:
        return
    outs = []  # (input slot, it is the output itself) or (None, (shape sizes, torch dtype))
    for slot in prep.outs:
        if slot.source is not None:
            outs.append((slot.source, True))
        elif slot.like is not None:
            outs.append((slot.like, False))
        else:
            outs.append((None, (slot.shape, _call._torch_dtype(slot.dtype))))
    op.cache[key] = _launcher(outs, prep.run, prep.scratch)


def _launcher(outs: list, run, scratch: int):
    """launch(arrays, ptrs, device, scalars) -> what call() returns: the outputs allocated as
    call() allocates them (`outs`: learn's list), their pointers appended, `run` launched."""
    torch, _, raw_stream, empty_like = _call._torch()
    if not scratch and all(same is True for _, same in outs):  # in place: outputs are inputs
        sources = [i for i, _ in outs]
        if len(sources) == 1:
            (i,) = sources

            def launch(arrays, ptrs, device, scalars):
                ptrs.append(ptrs[i])
                run(raw_stream(device), device, ptrs, scalars)
                return arrays[i]

            return launch
        if len(sources) == 2:
            i, j = sources

            def launch(arrays, ptrs, device, scalars):
                ptrs += (ptrs[i], ptrs[j])
                run(raw_stream(device), device, ptrs, scalars)
                return arrays[i], arrays[j]

            return launch
    if not scratch and all(i is not None and same is False for i, same in outs):  # new, like
        likes = [i for i, _ in outs]  # inputs
        if len(likes) == 1:
            (i,) = likes

            def launch(arrays, ptrs, device, scalars):
                out = empty_like(arrays[i])
                ptrs.append(out.data_ptr())
                run(raw_stream(device), device, ptrs, scalars)
                return out

            return launch
        if len(likes) == 2:
            i, j = likes

            def launch(arrays, ptrs, device, scalars):
                a, b = empty_like(arrays[i]), empty_like(arrays[j])
                ptrs += (a.data_ptr(), b.data_ptr())
                run(raw_stream(device), device, ptrs, scalars)
                return a, b

            return launch
    empty = torch.empty

    def launch(arrays, ptrs, device, scalars):
        results = []
        for i, same in outs:
            if i is None:  # as call() allocates it: on the first array's device
                sizes, dtype = same
                t = empty(*sizes, dtype=dtype, device=arrays[0].device) if sizes else \
                    empty((), dtype=dtype, device=arrays[0].device)  # fmt: skip
            elif same:
                ptrs.append(ptrs[i])
                results.append(arrays[i])
                continue
            else:
                t = empty_like(arrays[i])
            ptrs.append(t.data_ptr())
            results.append(t)
        run(raw_stream(device), device, ptrs, scalars)
        return _call.returned(results, scratch)

    return launch


__all__ = ["Shortcut", "TAG", "learn", "names", "source"]
