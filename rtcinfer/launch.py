"""Prepared kernel launches: a loaded kernel, its geometry and its parameter block.

A call with a signature it has seen before only writes its pointers into the parameter block
and calls the driver's cuLaunchKernel through CuPy's Cython wrapper, which takes plain integers
(the function, geometry, stream and parameter pointer): no argument conversion, no CuPy launch
path (cuda.bindings' wrapper, which converts its arguments on every call, cost 0.3 us more:
4.2 against 3.9 us a launch on the H200 host, where the driver's launch of an empty kernel
takes 3.1-3.6). On sm_90 and later the launch is programmatically dependent instead
(rtcinfer/dependent_launch.py: cuLaunchKernelEx through ctypes, its configuration built here
once). The block is the kernel's parameter struct (rtcinfer.params), passed as the kernel's
single argument; the driver copies it at launch, so the block may be rewritten for the next
call at once.

    launch = Launch(Kernel(spec, "norm_kernel", "NormParams", smem), grid, block)
    launch.params.eps = 1e-6               # fields that depend only on the signature
    launch.lock.acquire()                  # per call: pointers, then the launch
    try:
        launch.params.x = x_ptr
        launch(stream, device)
    finally:
        launch.lock.release()

(A call's run takes the lock by acquire() and release() rather than a `with` block, which
costs 0.13 us more on CPython 3.12: 221 against 87 ns.) A launch's first call on a device loads
the kernel and makes the device's issuer (dependent or plain, as dependent_launch says for the
device); later calls only write the stream and call the driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from dataclasses import dataclass

from . import dependent_launch, jit
from .params import params_type

CUDA_ERROR_INVALID_CONTEXT = 201
_DEPENDENT_DEVICES = dependent_launch.DEVICES  # device -> its launches are dependent (once asked)
_RECORDING = threading.local()  # .steps: the list a recording() in this thread appends to
_recorders = [0]  # recordings under way in any thread (a launch reads the thread-local, which
_recorders_lock = threading.Lock()  # costs a microsecond when unset, only while one is)
RECORDINGS = _recorders  # [how many recordings are under way]: a caller of Launch.issuer's
# issue must launch through Launch.__call__ instead while it is not 0


class NotRecordable(RuntimeError):
    """A recorded call did something other than kernel launches and zero fills."""


@contextlib.contextmanager
def recording():
    """Record instead of run, in this thread: inside, a Launch appends a LaunchRecord and
    zero_fill a FillRecord to the yielded list; copies and events raise NotRecordable. The
    device is not touched (a kernel is not even loaded): a call can be recorded on any host."""
    steps: list = []
    outer = getattr(_RECORDING, "steps", None)
    _RECORDING.steps = steps
    with _recorders_lock:
        _recorders[0] += 1
    try:
        yield steps
    finally:
        with _recorders_lock:
            _recorders[0] -= 1
        _RECORDING.steps = outer


_RESIDENT: dict[int, int] = {}  # start address -> bytes, of memory kept for the process' life


def keep_resident(ptr: int, nbytes: int) -> None:
    """Declare [ptr, ptr + nbytes) memory that lives as long as the process and is the same for
    every call on its device (a device's bad-index record): a recorded launch may address it
    as a constant (interop/xla_launch.py bakes it into a single-device computation)."""
    _RESIDENT[ptr] = nbytes


def resident(ptr: int) -> bool:
    """Whether `ptr` lies in memory declared by keep_resident."""
    return any(start <= ptr < start + n for start, n in _RESIDENT.items())


def _recorded(what: str) -> list | None:
    if not _recorders[0]:
        return None
    steps = getattr(_RECORDING, "steps", None)
    if steps is not None and what:
        raise NotRecordable(what)
    return steps


@dataclass(frozen=True)
class LaunchRecord:
    """A launch as recorded: its kernel, geometry and a copy of its parameter block."""

    kernel: Kernel
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    params: bytes


@dataclass(frozen=True)
class FillRecord:
    """zero_fill(ptr, count) as recorded."""

    ptr: int
    count: int


@functools.cache
def driver():
    """cuda.bindings' driver module (imported with the package: see rtcinfer/__init__.py)."""
    from cuda.bindings import driver as cu

    return cu


@functools.cache
def cupy_api():
    """CuPy's Cython driver and runtime wrappers, (driver, runtime): integer arguments, no
    conversion, a failure raised as CUDADriverError / CUDARuntimeError with its `status`."""
    from cupy_backends.cuda.api import driver as cu
    from cupy_backends.cuda.api import runtime as rt

    return cu, rt


class CudaError(RuntimeError):
    """A driver call failed; `code` is the CUresult."""

    def __init__(self, code: int, what: str):
        cu = driver()
        _, name = cu.cuGetErrorName(cu.CUresult(int(code)))
        label = name.decode() if name else "unknown error"
        super().__init__(f"{what}: {label} ({int(code)})")
        self.code = int(code)


def zero_fill(ptr: int, count: int, stream: int) -> None:
    """Zero `count` 32-bit words at device address `ptr`, on `stream`."""
    if count:
        if (steps := _recorded("")) is not None:
            steps.append(FillRecord(ptr, count))
            return
        cupy_api()[1].memsetAsync(ptr, 0, 4 * count, stream)


def memcpy_async(dst: int, src: int, nbytes: int, stream) -> None:
    """Copy `nbytes` from device address `src` to `dst` on `stream` (a CuPy stream or a raw
    handle): stream-ordered, device to device."""
    if nbytes:
        _recorded("a device-to-device copy")
        handle = getattr(stream, "ptr", stream)
        (rc,) = driver().cuMemcpyDtoDAsync(dst, src, nbytes, handle)
        if rc:
            raise CudaError(rc, "cuMemcpyDtoDAsync")


def record_event(event: int, stream: int) -> None:
    """Record CUevent `event` on `stream`."""
    _recorded("an event")
    cupy_api()[1].eventRecord(event, stream)


def wait_event(stream: int, event: int) -> None:
    """Make `stream` wait (on the device) for the work recorded by `event`."""
    _recorded("an event")
    cupy_api()[1].streamWaitEvent(stream, event, 0)


def is_capturing(stream: int) -> bool:
    """Whether `stream` is being captured into a CUDA graph (also when the capture has been
    invalidated by an error, which CuPy's wrapper raises as a plain RuntimeError)."""
    rt = cupy_api()[1]
    try:
        return rt.streamIsCapturing(stream)
    except rt.CUDARuntimeError:
        raise
    except RuntimeError:
        return True


_STREAM_DEVICES: dict[int, int] = {}  # stream handle -> the CUDA ordinal of its device
_DEFAULT_STREAMS = (0, 1, 2)  # legacy, per-thread default: the current context's device


def stream_device(stream: int) -> int:
    """The CUDA ordinal of the device `stream` belongs to, asked of the driver once per stream
    handle (the streams XLA runs custom calls on live as long as its executors): a JAX handler
    launches where the computation's buffers are, whichever device is current in its thread."""
    device = _STREAM_DEVICES.get(stream)
    if device is None:
        device = _STREAM_DEVICES[stream] = _ask_stream_device(stream)
    return device


def _ask_stream_device(stream: int) -> int:
    """The stream's context's device; the current context's for a default stream, or if the
    driver cannot say (the launch then goes where it went before: the current device)."""
    cu = driver()
    if stream not in _DEFAULT_STREAMS:
        rc, ctx = cu.cuStreamGetCtx(stream)
        if not rc and not cu.cuCtxPushCurrent(ctx)[0]:
            try:
                rc, device = cu.cuCtxGetDevice()
            finally:
                cu.cuCtxPopCurrent()
            if not rc:
                return int(device)
    rc, device = cu.cuCtxGetDevice()
    if rc:
        raise CudaError(rc, "cuCtxGetDevice")
    return int(device)


class Kernel:
    """An entry point of a spec: its parameter struct and its loaded function on each device.

    `smem` is the dynamic shared memory it is launched with (the function's limit is raised to
    it when it is loaded)."""

    def __init__(self, spec, name: str, params: str, smem: int = 0):
        self.spec, self.name, self.smem, self.params_name = spec, name, smem, params
        self.params_type = params_type(jit.struct_layout(spec, params))
        self._functions: dict[int, int] = {}
        self._occupancy: dict[tuple[int, int], int] = {}

    def function(self, device: int) -> int:
        """The CUfunction handle on `device` (compiled or read from the disk cache, loaded
        once)."""
        fn = self._functions.get(device)
        if fn is None:
            ptr = jit.get_function(self.spec, self.name, device, dynamic_smem=self.smem).ptr
            fn = self._functions[device] = int(ptr)
        return fn

    def occupancy(self, device: int, threads: int) -> int:
        """CTAs of this kernel that fit on one SM at once (for persistent grids), asked of
        the driver once per (device, threads): plan() asks it every time."""
        key = (device, threads)
        ctas = self._occupancy.get(key)
        if ctas is None:
            cu, _ = cupy_api()
            ctas = cu.occupancyMaxActiveBlocksPerMultiprocessor(
                self.function(device), threads, self.smem
            )
            self._occupancy[key] = ctas
        return ctas

    def __repr__(self) -> str:
        return f"Kernel({self.name} of {self.spec!r})"


def _issue_nothing(stream: int) -> int:
    """The issue of an empty grid (Launch.issuer)."""
    return 0


class Launch:
    """One kernel launch of a fixed geometry with its parameter block (`params`, filled by
    field name). Calls sharing a Launch take `lock` around writing their pointers and
    launching."""

    __slots__ = ("kernel", "grid", "block", "params", "lock", "tag", "_argv", "_argv_array",
                 "_geometry", "_config", "_issuers", "empty")  # fmt: skip

    def __init__(self, kernel: Kernel, grid: tuple[int, int, int], block: tuple[int, int, int]):
        self.kernel, self.grid, self.block = kernel, tuple(grid), tuple(block)
        self.params = kernel.params_type()
        self.lock = threading.Lock()
        self.tag = None  # what last filled the call-dependent fields (a caller's shortcut)
        self._argv_array = (ctypes.c_void_p * 1)(ctypes.addressof(self.params))
        self._argv = ctypes.addressof(self._argv_array)  # void** kernelParams
        self._geometry = (*self.grid, *self.block, kernel.smem)
        self._config = None  # a dependent launch's configuration, made by its first launch
        self._issuers = ({}, {})  # [dependent][device] -> issue(stream) -> CUresult, made by
        # the first launch of that setting on the device
        self.empty = 0 in self.grid
        for n in (*self.grid, *self.block):
            if not 0 <= n < 2**31:
                raise ValueError(f"{kernel!r}: launch geometry {self.grid} x {self.block}")

    def preload(self, device: int) -> None:
        """Load the kernel on `device` now (not while a CUDA graph is being captured)."""
        if not self.empty:
            self.kernel.function(device)

    def __call__(self, stream: int, device: int) -> None:
        """Launch on `stream` of `device`, which must be the current device."""
        dependent = _DEPENDENT_DEVICES.get(device)  # None: not asked yet
        issue = None if dependent is None else self._issuers[dependent].get(device)
        if issue is None or _recorders[0]:
            return self._first(stream, device)
        status = issue(stream)
        if status:
            self.failed(status, stream, device)

    def issuer(self, device: int):
        """issue(stream) -> CUresult: this launch on `device` as __call__ issues it, for a caller
        that fills the parameters itself under `lock`, launches through __call__ while
        RECORDINGS[0] is not 0 and hands a nonzero result to `failed` (the shortcut,
        interop/shortcut.py). The kernel is loaded now; an empty grid issues nothing."""
        if self.empty:
            return _issue_nothing
        dependent = dependent_launch.enabled(device)
        issue = self._issuers[dependent].get(device)
        if issue is None:
            issue = self._issuers[dependent][device] = self._issuer(device, dependent)
        return issue

    def _first(self, stream: int, device: int) -> None:
        """A launch while recording, of an empty grid, or the first on `device` (of its
        setting, dependent or not): it makes the issuer that later launches call."""
        if self.empty:
            return
        if _recorders[0] and (steps := getattr(_RECORDING, "steps", None)) is not None:
            blob = ctypes.string_at(ctypes.addressof(self.params), ctypes.sizeof(self.params))
            steps.append(LaunchRecord(self.kernel, self.grid, self.block, blob))
            return
        dependent = dependent_launch.enabled(device)
        issue = self._issuers[dependent].get(device)
        if issue is None:
            issue = self._issuers[dependent][device] = self._issuer(device, dependent)
        status = issue(stream)
        if status:
            self.failed(status, stream, device)

    def _issuer(self, device: int, dependent: bool):
        """issue(stream) -> CUresult: one launch on `device` through the driver. Dependent:
        cuLaunchKernelEx with the configuration made here (only its stream written per call);
        else cuLaunchKernel through CuPy's wrapper."""
        fn, argv = self.kernel.function(device), self._argv
        if dependent:
            if self._config is None:
                self._config = dependent_launch.config(self.grid, self.block, self.kernel.smem)
            config, launch_ex = self._config, dependent_launch.launch_function()
            at = ctypes.addressof(config)

            def issue(stream: int) -> int:
                config.stream = stream
                return launch_ex(at, fn, argv, None)

            return issue
        cu = cupy_api()[0]
        launch, geometry = cu.launchKernel, self._geometry

        def issue(stream: int) -> int:
            try:
                launch(fn, *geometry, stream, argv, 0)
            except cu.CUDADriverError as e:  # its status: the CUresult
                return e.status
            return 0

        return issue

    def failed(self, status: int, stream: int, device: int) -> None:
        """A launch returned `status`: a thread with no current context makes the device
        current and launches again; any other failure raises."""
        if status == CUDA_ERROR_INVALID_CONTEXT:
            cupy_api()[1].setDevice(device)
            status = self._issuers[_DEPENDENT_DEVICES[device]][device](stream)
        if status:
            raise CudaError(status, f"launch of {self.kernel!r}, grid {self.grid}")

    def __repr__(self) -> str:
        return f"Launch({self.kernel!r}, grid={self.grid}, block={self.block})"


__all__ = [
    "RECORDINGS",
    "CudaError",
    "FillRecord",
    "Kernel",
    "Launch",
    "LaunchRecord",
    "NotRecordable",
    "driver",
    "is_capturing",
    "keep_resident",
    "resident",
    "zero_fill",
    "record_event",
    "recording",
    "stream_device",
    "wait_event",
]
