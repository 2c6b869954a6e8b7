"""What every plan()/run() wrapper stands on: the static configuration, the workspace and its
one-copy upload, the CUDA-graph capacity, stream ordering, JAX, and run()'s prepared launches.

A wrapper (decode today; prefill and cascade levels share it) subclasses PlannedWrapper:

    plan():  config = self._configure(args, make_config, setup)     # cached by value and type
             ... validate and plan on the host (NumPy) ...
             pointers = self._upload(capacity, fill)                  # reserve, order, one copy
    run():   return self._call(arrays, static, scalars)              # interop's call path
    _prepare_run(infos, align, static) -> Prepared                   # once per run signature

and its prepared run, under the launch's lock, writes the signature's fields and the call's
pointers and scalars (run_fill) and calls `self._before_run(stream, state)` (stream order;
decode: CUDA-graph capture notes) before it launches (through a weak reference: the wrapper's
caches and the JAX handlers made from them never keep it alive). Its run() method may carry
a shortcut (run_shortcut): a repeated PyTorch or CuPy signature on the current plan fills and
launches the same way in one more frame (interop/shortcut.py, prepared.Planned).

Streams: plan() uploads on CuPy's current stream; a run() on another stream waits for that
upload and the next upload waits for that run (events, no host sync); a plan() on another
stream than the previous one synchronizes the device once.

CUDA graphs: a wrapper built with use_cuda_graph=True keeps one layout for its capacity, so a
graph captured around run() replays correctly after later plans; `_check_captured(batch)`
refuses a plan larger than the batch a capture was made with.

JAX: once a run() has been traced, every plan() waits on the host for its upload (XLA's
stream is not ordered with ours).

Plan arrays (attention/decode_array.py, prefill_array.py): a wrapper whose runs so far all
read their plan from an array keeps each plan() on the host (for plan_array()) and uploads
nothing; its first run on the workspace sends the latest plan, and later plans upload again.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from .. import gpu
from ..interop import Fill, Op, OutSlot, as_cupy, call, no_launch, release
from ..interop.arrays import device_of, to_numpy
from ..interop.shortcut import Shortcut
from ..launch import is_capturing, record_event, wait_event, zero_fill
from ..plan._checks import as_int_array
from .paged_kv import check_layout
from .workspace import ALIGN, Workspace


def weak_method(obj, name: str):
    """obj.name(...) through a weak reference (a cache owned by obj must not keep it alive)."""
    ref = weakref.ref(obj)

    def method(*args):
        return getattr(ref(), name)(*args)

    return method


def host_ints(name: str, x, widen: bool = True) -> np.ndarray:
    """Host copy of one of plan()'s index arrays, int64 (``widen=False``: its own integer
    dtype, as for page ids, which the int32 plan buffer takes as they are); a device array
    costs one copy."""
    if type(x) is not np.ndarray and hasattr(x, "__dlpack__"):
        x = to_numpy(x)
    return as_int_array(name, x, widen=widen)


def kept_fill(fill: Callable, kept: list) -> Callable:
    """An upload's fill(buf) -> ints that also appends the ints it wrote (a view of the upload's
    host buffer, valid until the next-but-one upload) to `kept`: what plan_array() copies."""

    def fill_and_keep(buf):
        n = fill(buf)
        kept.append(buf[:n])
        return n

    return fill_and_keep


def plan_array_of(packed: np.ndarray, size: int, out=None) -> np.ndarray:
    """A plan array (attention/decode_array.py): the packed plan's ints, then zeros to `size`,
    in `out` (a NumPy int32 array of that length) when given, else in a new array."""
    if out is None:
        out = np.zeros(size, np.int32)
    elif not isinstance(out, np.ndarray) or out.shape != (size,) or out.dtype != np.int32:
        raise ValueError(
            f"out: expected a NumPy int32 array of shape ({size},), got "
            f"{type(out).__name__} {getattr(out, 'dtype', '')} {getattr(out, 'shape', '')}"
        )
    else:
        out[packed.shape[0] :] = 0
    out[: packed.shape[0]] = packed
    return out


def plan_array_run(launch, first: int, with_lse: bool, v_offset: int | None, lse_at: int,
                   counters: int, mask_at: int | None = None, empty: bool = False
                   ) -> Callable:  # fmt: skip
    """run(stream, device, ptrs, scalars) of an attention launch on a plan array (decode and
    prefill share the parameter fields): slots q, k, v, out, lse, plan_array, then the
    outputs from `first`: o, lse (with_lse), int32 merge counters (`counters` of them, zeroed
    first), float32 partials (o rows, then LSE at byte `lse_at`). V is K + v_offset bytes for
    a 5-D cache (None: the v slot); the custom mask at byte `mask_at` of the plan, if any.
    empty: q has no rows, and the run writes nothing."""
    if empty:
        return no_launch
    p = launch.params
    at = first + (2 if with_lse else 1)

    def run(stream, device, ptrs, scalars):
        launch.lock.acquire()
        try:
            p.q, p.k_cache, p.o, p.plan = ptrs[0], ptrs[1], ptrs[first], ptrs[5]
            p.v_cache = ptrs[1] + v_offset if v_offset is not None else ptrs[2]
            p.lse = ptrs[first + 1] if with_lse else 0
            p.counters, p.partial_o = ptrs[at], ptrs[at + 1]
            p.partial_lse = ptrs[at + 1] + lse_at
            if mask_at is not None:
                p.mask = ptrs[5] + mask_at
            p.qk_scale, p.v_scale = scalars
            zero_fill(p.counters, counters, stream)
            launch(stream, device)
        finally:
            launch.lock.release()

    return run


def weak_hooks(wrapper) -> tuple[Callable, Callable]:
    """(on_trace, preload) of a prepared run() that holds its wrapper weakly: a JAX trace
    switches the wrapper to synchronized plans; preload loads the current launch's kernel."""
    ref = weakref.ref(wrapper)

    def on_trace():
        target = ref()
        if target is not None:
            target._traced()

    def preload(device):
        target = ref()
        if target is not None:
            target._launch.launch.preload(device)

    return on_trace, preload


def run_outputs(out, lse, o_shape: tuple, o_dtype: str, with_lse: bool) -> list:
    """The OutSlots of an attention run(): o (the caller's `out`, slot 3, or allocated) and,
    with_lse, lse (slot 4 or allocated), after checking given ones against the plan."""
    lse_shape = o_shape[:2]
    for name, given, shape, dtype in (("out", out, o_shape, o_dtype),
                                      ("lse", lse, lse_shape, "float32")):  # fmt: skip
        if given is not None and (given.shape != shape or given.dtype != dtype):
            raise ValueError(
                f"{name}: expected shape {shape} and dtype {dtype}, "
                f"got shape {given.shape} and dtype {given.dtype}"
            )
    outs = [OutSlot(o_shape, o_dtype, 3 if out is not None else None)]
    if with_lse:
        outs.append(OutSlot(lse_shape, "float32", 4 if lse is not None else None))
    return outs


@functools.lru_cache(maxsize=1024)
def run_fill(v_offset: int | None, with_lse: bool) -> Fill:
    """What an attention run() writes into its launch's parameter block a call: the pointers
    of its slots (q, k, v, out, lse, then the outputs o, lse; V is K + v_offset bytes for a 5-D
    cache, v_offset None for a (k, v) pair) and the scales (qk_scale, v_scale). Without an
    lse, the block's lse is 0: one of the signature's fields (planned_fields)."""
    v = ("v_cache", 1, v_offset) if v_offset is not None else ("v_cache", 2)
    lse = (("lse", 6),) if with_lse else ()
    return Fill((("q", 0), ("k_cache", 1), v, ("o", 5), *lse), (("qk_scale", 0), ("v_scale", 1)))


# A paged run()'s cache as its op's k and v slots, bound in its shortcut's branch: one array
# (v None) or a (k, v) tuple, as kv_pair takes them; a list, or a tuple of another length,
# takes the body.
PAGED_KV = (
    "((_k := paged_kv_cache, _v := None) if type(paged_kv_cache) is not tuple else "
    "(_k := paged_kv_cache[0], _v := paged_kv_cache[1]) if len(paged_kv_cache) == 2 else ())"
)

# run()'s options at the values under which it calls its op with its plan's scale, on the
# plan's own state and with o, or (o, lse) with return_lse (a bool), as call() returns them.
PLAIN_RUN = (
    "q_scale is None and k_scale is None and v_scale is None and lse is None "
    "and (return_lse is False or return_lse is True) and plan_array is None"
)


def run_shortcut(run_slots: tuple, run_given: tuple, slots: tuple, static: str, scalars: str,
                 when: str, bind: str = "", optional: tuple = ()) -> Shortcut:  # fmt: skip
    """A wrapper run()'s shortcut (interop/shortcut.py), for the class's RUN_SLOTS and
    RUN_GIVEN: the branch binds `_st`, the plan's state (a run before any plan() takes the
    body, which raises), then `bind`'s names, and launches the signature's prepared run on
    `_st` with the wrapper's own op (prepared.Planned) where `when` holds. `slots`, `static`
    and `scalars` as run() passes them to its op."""
    template = Op("run", run_slots, _no_prepare, given=run_given)
    first = "(_st := self._launch) is not None" + (f" and {bind}" if bind else "")
    return Shortcut(template, slots, static, scalars, when=when, owner="self", bind=first,
                    optional=optional)  # fmt: skip


def _no_prepare(infos, align, static):
    raise AssertionError("a shortcut's op template prepares nothing: the wrapper's op does")


def planned_fields(fields: dict, with_lse: bool) -> dict:
    """A run signature's own fields (strides), with lse = 0 where the run writes none."""
    return fields if with_lse else {**fields, "lse": 0}


def fill_planned(launch, fields: dict, write, ptrs, scalars) -> None:
    """A run's arguments into its launch's parameter block (under its lock): the signature's
    `fields` (written again only where another signature filled the launch last, its tag),
    then the call's pointers and scalars (`write`: a Fill's function of the block)."""
    p = launch.params
    if launch.tag is not fields:
        for name, value in fields.items():
            setattr(p, name, value)
        launch.tag = fields
    write(p, ptrs, scalars)


def _arg_key(args: tuple) -> tuple:
    """plan()'s static arguments with their types: equal keys make the same configuration
    (1 and 1.0 or True compare equal but are not the same argument)."""
    return args + tuple(map(type, args))


def _same_key(a: tuple, b: tuple | None) -> bool:
    try:
        return b is not None and bool(a == b)
    except ValueError:  # an array argument (the configuration rejects it with a clear error)
        return False


_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # number -> wrapper
_NUMBERS = itertools.count(1)


class _Sized(Exception):
    """What _upload raises while a wrapper sizes its workspace: the capacity a plan needs."""

    def __init__(self, capacity):
        super().__init__()
        self.capacity = capacity


def live_wrapper(number: int):
    """The wrapper registered under `number` (a compiled graph's constant naming it), or None
    once it is deleted."""
    return _LIVE.get(number)


class PlannedWrapper:
    """The shared plan()/run() machinery (module docstring). RUN_SLOTS and RUN_GIVEN are the
    subclass's run() array slots and the ones that hold caller-given outputs; ARRAY_SLOTS
    those of its run(plan_array=...) (plan_array_run's order), if it has one. Each wrapper
    has a registry number (live_wrapper) by which a torch.compile graph names it."""

    RUN_SLOTS: Sequence[str] = ()
    RUN_GIVEN: Sequence[str] = ()
    ARRAY_SLOTS: Sequence[str] = ()  # run(plan_array=...)'s slots, where a subclass has it
    _array_cache = None  # the fewest key rows (pages) of a cache run(plan_array=) was made for

    def __init__(self, workspace=None, kv_layout: str = "NHD", use_cuda_graph: bool = False):
        check_layout(kv_layout)
        self._kv_layout = kv_layout
        self._graph = bool(use_cuda_graph)
        self._device = device_of(workspace) if workspace is not None else gpu.current()
        buffer = as_cupy(workspace, "workspace") if workspace is not None else None
        self._ws = Workspace(self._device, buffer)
        self._config = None
        self._config_key: tuple | None = None  # plan()'s static arguments that made _config
        self._jax = False
        # stream ptr -> event after the latest run() there, for streams other than the upload's;
        # _unwaited: those recorded since the last plan(), which its upload must wait for
        self._run_events: dict[int, object] = {}
        self._unwaited: set[int] = set()
        self._captured = None  # the smallest batch a run() was captured into a CUDA graph with
        # runs on plan arrays (attention/decode_array.py) and on the workspace's plan so far;
        # while there are only the former, plan() keeps its plan on the host (_deferred)
        self._array_runs = self._workspace_runs = False
        self._deferred = None
        self._reserved = None  # the capacity of the latest reserve()
        self._op = Op(f"{type(self).__name__}.run", self.RUN_SLOTS,
                      weak_method(self, "_prepare_on_device"), given=self.RUN_GIVEN)  # fmt: skip
        weakref.finalize(self, release, self._op)
        if self.ARRAY_SLOTS:  # run(plan_array=...)'s op (a subclass's _prepare_array_run)
            self._array_op = Op(f"{type(self).__name__}.run", self.ARRAY_SLOTS,
                                weak_method(self, "_prepare_array_run"),
                                given=self.RUN_GIVEN)  # fmt: skip
            weakref.finalize(self, release, self._array_op)
        self._number = next(_NUMBERS)
        _LIVE[self._number] = self

    def _prepare_on_device(self, infos, align, static):
        """_prepare_run, for arrays on the workspace's device only: a run on the workspace
        reads its plan there (a plan array, run(plan_array=...), names no device)."""
        device = next(i.device for i in infos if i is not None)
        if device != self._device:
            raise ValueError(
                f"{type(self).__name__}.run: the arrays are on device {device}, this wrapper's "
                f"workspace and plan on device {self._device}; a wrapper serves the device it "
                "was made on (make one per device)"
            )
        return self._prepare_run(infos, align, static)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._graph

    def begin_forward(self, *args, **kwargs) -> None:
        """plan() by FlashInfer's older name."""
        return self.plan(*args, **kwargs)

    def run_return_lse(self, *args, **kwargs):
        """run(..., return_lse=True): (o, lse) (FlashInfer's name)."""
        return self.run(*args, return_lse=True, **kwargs)

    def prewarm_paged_kv_stride_variant(self, variant: str = "independent") -> None:
        """FlashInfer's load, before a CUDA-graph capture, of its kernel for K and V of
        different strides: nothing to load here (every kernel takes K's and V's strides
        apart, and plan() loads the kernels)."""
        if variant != "independent":
            raise ValueError(f"variant must be 'independent', got {variant!r}")

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None) -> None:
        """Later plans lay out `float_workspace_buffer` (FlashInfer's; its int_workspace_buffer
        has no use here). The current plan is dropped: plan() again before run(). Runs already
        launched may still read the old buffer, which must outlive them (as in FlashInfer). A
        wrapper whose runs a CUDA graph holds (use_cuda_graph=True, or a run() captured) keeps
        its workspace: the graphs read it."""
        if self._graph or self._captured is not None:
            raise ValueError(
                f"{type(self).__name__}: a wrapper whose run() a CUDA graph holds keeps its "
                "workspace (the graph reads it); make a new wrapper instead"
            )
        device = device_of(float_workspace_buffer)
        if device != self._device:
            raise ValueError(
                f"float_workspace_buffer is on device {device}, this wrapper's on {self._device}"
            )
        buffer = as_cupy(float_workspace_buffer, "float_workspace_buffer")
        self._ws.wait_uploads()  # no upload still reads the old plan's host buffers
        self._ws = Workspace(self._device, buffer)
        self._reserved = self._deferred = self._launch = None

    def _configure(self, args: tuple, make: Callable, setup: Callable) -> object:
        """The configuration plan()'s static `args` make: the current one when they are the
        same arguments, else make(*args), with setup(config) run when it differs from the
        current one (kernel choice; if it raises, nothing changes)."""
        key = _arg_key(args)
        if _same_key(key, self._config_key):
            return self._config
        config = make(*args)
        if config != self._config:
            setup(config)
        self._config, self._config_key = config, key
        return config

    def _check_captured(self, batch: int) -> None:
        if self._captured is not None and batch > self._captured:
            raise ValueError(
                f"batch of {batch} requests, but run() was captured into a CUDA graph with "
                f"{self._captured}: a replay would read q and write o past their rows (plan "
                "the captured batch size, padded if need be)"
            )

    _sizing = False  # inside _workspace_bytes: plan() stops at its upload

    def _workspace_bytes(self, plan: Callable[[], None]) -> tuple[int, int]:
        """FlashInfer's workspace_size() of the plan that `plan()` makes: (float workspace
        bytes, int workspace bytes), the first what a caller's float_workspace_buffer must hold
        (the plan's layout, plus ALIGN bytes for a buffer that does not start on an ALIGN
        boundary), the second 0 (no int workspace is used here). The plan is made up to its
        upload, which is not made: this wrapper's plan, workspace and buffers stay as they
        were."""
        self._sizing = True
        try:
            plan()
        except _Sized as sized:
            return sized.capacity.offsets()["end"] + ALIGN, 0
        finally:
            self._sizing = False
        raise RuntimeError("plan() made no upload")  # every plan uploads

    def _upload(self, capacity, fill: Callable, after: Callable | None = None) -> dict[str, int]:
        """Lay the workspace out for `capacity` (when it changed), order the upload after runs
        on other streams, and send fill(int32 host buffer) -> ints written in one copy, then
        after(regions, stream) (more device work ordered behind the upload); returns the
        regions' device addresses."""
        if self._sizing:
            raise _Sized(capacity)
        import cupy

        with cupy.cuda.Device(self._device):
            stream = cupy.cuda.get_current_stream()
            if self._ws.stream_ptr not in (None, stream.ptr):
                # The plan moves to another stream: runs on the old one were not recorded, and
                # the new upload must not overtake them (a rare switch, so a device sync).
                cupy.cuda.Device(self._device).synchronize()
                self._unwaited.clear()
            if capacity != self._reserved:  # the layout (and its pointers) follow the capacity
                self._reserved = None
                self._ws.reserve(capacity, stream, grow=not self._graph)
                self._reserved = capacity
            if self._array_runs and not self._workspace_runs:
                # only runs on plan arrays so far: none reads the workspace; a first run on
                # it sends this plan then (_call)
                self._ws.fill_host(fill)
                self._deferred = (capacity, fill, after)
                return self._ws.pointers
            self._deferred = None
            for ptr in self._unwaited:  # runs elsewhere may still read the plan
                if ptr != stream.ptr:
                    stream.wait_event(self._run_events[ptr])
            self._unwaited.clear()
            self._ws.upload(fill, stream, after)
            if self._jax:
                self._ws.last_upload().synchronize()
        return self._ws.pointers

    def _note_array_cache(self, rows: int) -> None:
        """A run(plan_array=...) prepared for a cache of `rows` key rows (pages): the plans it
        reads come from arrays, which it cannot check, so later plan()s must stay within."""
        if self._array_cache is None or rows < self._array_cache:
            self._array_cache = rows
        self._array_runs = True  # plan() may keep its plans on the host (_upload)

    def _kept_launch(self, cfg, kernel, grid: tuple):
        """The latest plan's launch (self._launch: a subclass's record of it, .launch and .cfg)
        when a new plan's configuration, kernel and grid are its own: its parameter block holds
        every field they fix (a plan's data lives in the workspace), so plan() keeps it."""
        last = self._launch
        if last is None or last.cfg is not cfg:
            return None
        launch = last.launch
        return launch if launch.kernel is kernel and launch.grid == grid else None

    def _call(self, arrays: Sequence, static: tuple, scalars: tuple):
        if not self._workspace_runs:  # the first run on the workspace's plan: plans upload
            self._workspace_runs = True
            if self._deferred is not None:
                self._send_deferred()
        return call(self._op, arrays, static, scalars)

    def _send_deferred(self) -> None:
        """Upload the latest plan, which plan() kept on the host while only runs on plan
        arrays were made (they do not read the workspace)."""
        self._upload(*self._deferred)

    def _note_capture(self, stream: int, batch: int) -> None:
        """A run of `batch` rows captured into a CUDA graph: later plans must fit it."""
        if self._graph and is_capturing(stream):
            self._captured = min(batch, self._captured or batch)

    def _before_run(self, stream: int, state) -> None:
        """Under the launch's lock, before a run() on the plan `state` launches on `stream`:
        stream order (_order)."""
        self._order(stream)

    def _order(self, stream: int) -> None:
        """Order a run on a stream other than the upload's after the upload, and the next
        upload after this run (an event per such stream; skipped while it is being captured)."""
        if stream == self._ws.stream_ptr or is_capturing(stream):
            return
        import cupy

        wait_event(stream, self._ws.last_upload().ptr)
        event = self._run_events.get(stream)
        if event is None:
            event = cupy.cuda.Event(block=False, disable_timing=True)
            self._run_events[stream] = event
        record_event(event.ptr, stream)
        self._unwaited.add(stream)

    def _traced(self) -> None:
        """A run() was traced by JAX: from now on every plan() waits for its upload."""
        if not self._jax:
            self._jax = True
            self._ws.last_upload().synchronize()


__all__ = ["PAGED_KV", "PLAIN_RUN", "PlannedWrapper", "run_shortcut"]
