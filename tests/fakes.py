"""Stand-ins for device objects, so the launch code can be driven on a machine without a GPU."""

from __future__ import annotations

import contextlib
import math
import sys
import types

import numpy as np


class NullDevice:
    """Stands in for cupy.cuda.Device (and a stream) where no GPU is: device 0, a context
    manager that does nothing, synchronize() a no-op."""

    id, ptr = 0, 0

    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass

    def record(self, stream=None):  # as an event
        pass


def packing_upload(ws, fill, stream) -> None:
    """A stubbed upload that packs the plan into a host buffer as the real one does."""
    fill(np.zeros(ws.capacity.plan_ints, np.int32))


def planning_without_a_gpu(monkeypatch, regions: dict, upload, expand=None) -> type:
    """What a wrapper's plan() touches on a device, stubbed: the driver checks (fake_gpu),
    CuPy's Device and current stream (a NullDevice subclass of the test's own, returned, whose
    attributes a test may patch), the workspace reserve (its regions at `regions`), upload
    (`upload(self, fill, stream)`) and its event, and the device expansion of a prefill plan's
    items (`expand(layout)`, prefill_items.ItemsLayout; default: nothing)."""
    import cupy

    from rtcinfer.attention import prefill_upload
    from rtcinfer.attention.workspace import Workspace

    fake_gpu(monkeypatch)

    class Device(NullDevice):
        pass

    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: Device())

    def reserve(ws, need, stream, grow):
        ws.capacity, ws.pointers = need, regions

    monkeypatch.setattr(Workspace, "reserve", reserve)

    def upload_then_after(ws, fill, stream, after=None):
        upload(ws, fill, stream)
        if after is not None:
            after(regions, stream)

    monkeypatch.setattr(Workspace, "upload", upload_then_after)
    monkeypatch.setattr(Workspace, "fill_host", lambda ws, fill: packing_upload(ws, fill, None))
    monkeypatch.setattr(Workspace, "last_upload", lambda self: NullDevice())
    monkeypatch.setattr(prefill_upload, "expand_items",
                        lambda plan, stream, device, layout: expand and expand(layout))  # fmt: skip
    return Device


class FakeArray:
    """Shape, byte strides, item size and address: what the launch code reads of an array."""

    def __init__(self, shape, itemsize, strides=None, ptr=1 << 20):
        self.shape, self.itemsize, self.size = shape, itemsize, math.prod(shape)
        if strides is None:
            strides, step = [], itemsize
            for n in reversed(shape):
                strides.insert(0, step)
                step *= n
        self.strides = tuple(strides)
        self.data = types.SimpleNamespace(ptr=ptr)
        dense, step = True, itemsize
        for n, stride in zip(reversed(shape), reversed(self.strides), strict=True):
            dense = dense and (n == 1 or stride == step)
            step *= n
        self.flags = types.SimpleNamespace(c_contiguous=dense)


def attention_without_a_gpu(monkeypatch) -> None:
    """planning_without_a_gpu for the decode and prefill wrappers (and those built on them):
    the device's limits (132 SMs, 227 KB), two decode CTAs a SM, one prefill CTA a SM, the
    plan packed by packing_upload."""
    from rtcinfer.attention import decode, prefill_wrapper
    from rtcinfer.launch import Kernel

    regions = dict.fromkeys(("plan", "counters", "lse", "o", "end"), 0)
    planning_without_a_gpu(monkeypatch, regions, packing_upload)
    monkeypatch.setattr(decode, "device_limits", lambda device: (132, 227 * 1024))
    monkeypatch.setattr(decode, "ctas_per_sm", lambda spec, device: 2)
    monkeypatch.setattr(prefill_wrapper, "device_limits", lambda device: (132, 227 * 1024))
    monkeypatch.setattr(Kernel, "occupancy", lambda self, device, threads: 1)


@contextlib.contextmanager
def cupy_without_a_gpu(monkeypatch, backing: np.ndarray | None = None):
    """Within: CuPy arrays of device 0 over made-up, 256-byte aligned addresses with no memory
    behind them (for calls whose launches are recorded, never made): CuPy's allocator hands
    them out, and rtcinfer's CuPy path sees stream 0 as current. Yields empty(shape, dtype).
    `backing`: a host buffer the addresses are taken from instead (a model of a kernel may
    then read and write the arrays' bytes; CuPy itself never touches them)."""
    import cupy

    from rtcinfer.interop import arrays

    top = [1 << 32 if backing is None else backing.ctypes.data]
    end = None if backing is None else backing.ctypes.data + backing.nbytes

    def allocate(nbytes):
        top[0] = -(-top[0] // 256) * 256
        address = top[0]
        top[0] += (nbytes + 255) // 256 * 256 + 256
        if end is not None and top[0] > end:
            raise MemoryError(f"the backing buffer ({backing.nbytes} bytes) is full")
        memory = cupy.cuda.UnownedMemory(address, nbytes, None, device_id=0)
        return cupy.cuda.MemoryPointer(memory, 0)

    path = sys.modules["rtcinfer.interop.call"]
    monkeypatch.setattr(path, "_cupy", lambda: (cupy, cupy.ndarray, NullDevice))
    arrays.CUPY_NDARRAY[0] = cupy.ndarray  # as the first CuPy call sets it (and kept)
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(allocate)
    try:
        yield cupy.ndarray
    finally:
        cupy.cuda.set_allocator(previous)


class FakeStream:
    """A stream pointer, whether it is being captured, and the event waits it was asked for
    (appended to `log` as ("wait", ptr, the event's `on`))."""

    def __init__(self, ptr, capturing=False, log=None):
        self.ptr, self.capturing, self.log = ptr, capturing, log

    def is_capturing(self):
        return self.capturing

    def wait_event(self, event):
        self.log.append(("wait", self.ptr, event.on))


def launched(monkeypatch, prep, ptrs, scalars=()):
    """(the Launch, its parameter fields by name) that a prepared call's run launches with
    these pointers and scalars; the launch itself is recorded, not made."""
    from rtcinfer.launch import Launch

    seen = []
    monkeypatch.setattr(Launch, "__call__", lambda self, stream, device: seen.append(self))
    prep.run(0, 0, list(ptrs), scalars)
    (launch,) = seen
    fields = {f[0]: getattr(launch.params, f[0]) for f in launch.params._fields_}
    return launch, {k: v for k, v in fields.items() if not k.startswith("_pad")}


class FakeRuntime:
    """CuPy's CUDA runtime as rtcinfer.gpu reads it: the CUDA version the driver supports (0:
    no driver), that of the installed wheels, the devices the driver sees (or the CUDA error,
    (status, text), that counting them raises) and their compute capability; stream
    synchronizations are recorded."""

    class CUDARuntimeError(RuntimeError):
        def __init__(self, status: int, text: str):
            super().__init__(text)
            self.status = status

    def __init__(self, driver=13000, wheels=13020, devices=1, error=None,
                 compute_capability=(9, 0)):  # fmt: skip
        self.driver, self.wheels, self.devices, self.error = driver, wheels, devices, error
        self.compute_capability = compute_capability
        self.synchronized = []  # the streams streamSynchronize was asked to wait for

    def driverGetVersion(self):
        return self.driver

    def runtimeGetVersion(self):
        return self.wheels

    def getDeviceCount(self):
        if self.error is not None:
            raise self.CUDARuntimeError(*self.error)
        return self.devices

    def getDevice(self):
        return 0

    def deviceGetAttribute(self, attribute, device):
        return dict(zip((75, 76), self.compute_capability, strict=True))[attribute]

    def streamSynchronize(self, stream):
        self.synchronized.append(stream)


def fake_gpu(monkeypatch, **runtime) -> FakeRuntime:
    """Make rtcinfer.gpu see FakeRuntime(**runtime) as CuPy's CUDA runtime (driver=0: no
    driver); gpu.runtime() runs its real check on it."""
    from rtcinfer import gpu

    fake = FakeRuntime(**runtime)

    def checked_runtime():
        gpu.check(fake)
        return fake

    monkeypatch.setattr(gpu, "runtime", checked_runtime)
    # the compile target, asked of the fake each time (jit caches the real one per device)
    from rtcinfer import jit
    from rtcinfer.attention import prefill_launch

    for module in (jit, prefill_launch):
        monkeypatch.setattr(module, "device_arch", gpu.compile_arch)
    return fake


class FakeRecords:
    """rtcinfer.errors' per-device records in host memory, so that the host logic runs without
    a GPU: each device's record is a NumPy buffer, which `report` writes as the kernel would
    (bad_index.cuh); `log` lists the device work asked for ("sync", "clear")."""

    def __init__(self, monkeypatch):
        import ctypes

        import numpy as np

        from rtcinfer import errors

        self.buffers, self.log = {}, []

        def allocate(device):
            device_row, host_row = np.zeros(1, errors.RECORD), np.zeros(1, errors.RECORD)
            self.buffers[device] = (device_row, host_row)
            host_ptr = host_row.ctypes.data
            reported = ctypes.c_int32.from_address(host_ptr)
            keep = (device_row, host_row)
            return errors.Record(device, device_row.ctypes.data, host_ptr, reported, keep)

        def clear_device(rec, stream):
            self.log.append(("clear", rec.device, stream))
            self.buffers[rec.device][0][:] = 0

        monkeypatch.setattr(errors, "_RECORDS", {})
        monkeypatch.setattr(errors, "_allocate", allocate)
        monkeypatch.setattr(
            errors, "_synchronize", lambda device: self.log.append(("sync", device))
        )
        monkeypatch.setattr(
            errors, "_read_device", lambda rec: self.buffers[rec.device][0][0].copy()
        )
        monkeypatch.setattr(errors, "_clear_device", clear_device)

    def report(self, device, code, index, value, limit, count=1):
        """What append_kernel leaves after finding `count` bad rows, the first described."""
        device_row, host_row = self.buffers[device]
        for row in (device_row, host_row):
            row["code"], row["index"], row["value"], row["limit"] = int(code), index, value, limit
        device_row["count"], host_row["count"] = count, 1

    def device_row(self, device):
        return self.buffers[device][0][0]

    def host_row(self, device):
        return self.buffers[device][1][0]


class MetaArrays:
    """Arrays for tests/model_step.py on a fake device: torch "meta" tensors (shape, strides
    and dtype, no memory); FakeDevice makes the call path take them as CUDA arrays."""

    def __init__(self):
        import torch

        self.torch = torch

    def zeros(self, shape, dtype: str):
        return self.torch.empty(shape, dtype=getattr(self.torch, dtype), device="meta")

    def ints(self, values, dtype: str = "int32"):
        return self.zeros((len(values),), dtype)


class FakeDevice:
    """A GPU of compute capability `cc`, `sms` SMs and `max_smem` bytes of opt-in shared memory
    per block, on which ops prepare, plan and run as they would, with PyTorch meta tensors as
    device arrays, and launch nothing: `specs` collects the spec of every kernel launched.
    Uploads, occupancy queries, stream queries and the bad-index records are stubbed; the ops'
    prepared launches start empty and are put back afterwards (neither side sees the other's)."""

    def __init__(self, monkeypatch, cc=(9, 0), sms=132, max_smem=227 * 1024):
        import importlib
        import sys

        import cupy
        import numpy as np
        import torch

        from rtcinfer import jit
        from rtcinfer.attention import decode, page, planned, prefill_wrapper
        from rtcinfer.attention.workspace import Workspace
        from rtcinfer.interop import ArrayInfo, Op
        from rtcinfer.interop.dtypes import normalize
        from rtcinfer.launch import Kernel, Launch

        self.specs = []
        for name, module in list(sys.modules.items()):
            for value in vars(module).values() if name.startswith("rtcinfer") else ():
                for op in value.values() if isinstance(value, dict) else (value,):
                    if isinstance(op, Op):
                        monkeypatch.setattr(op, "cache", {})
        fake_gpu(monkeypatch, compute_capability=cc)
        FakeRecords(monkeypatch)
        limits = lambda device: (sms, max_smem)  # noqa: E731
        for module in (jit, decode, prefill_wrapper):
            monkeypatch.setattr(module, "device_limits", limits)
        monkeypatch.setattr(jit, "sm_count", lambda device: sms)
        monkeypatch.setattr(Kernel, "occupancy", lambda self, device, threads: 2)
        monkeypatch.setattr(decode, "ctas_per_sm", lambda spec, device: 2)

        def launch(self_, stream, device):
            if not self_.empty:
                self.specs.append(self_.kernel.spec)

        monkeypatch.setattr(Launch, "__call__", launch)

        class Device(NullDevice):  # as the samplers and the workspace use CuPy's
            compute_capability = f"{cc[0]}{cc[1]}"

        monkeypatch.setattr(cupy.cuda, "Device", Device)
        monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: Device())

        def reserve(ws, need, stream, grow):
            ws.capacity = need
            ws.pointers = {name: 0 for name in need.offsets()}

        def upload(ws, fill, stream, after=None):
            fill(np.zeros(ws.capacity.plan_ints, np.int32))  # packs the plan as it would
            ws.stream_ptr = stream.ptr
            if after is not None:  # device work behind the upload (launches are recorded)
                after(ws.pointers, stream)

        monkeypatch.setattr(Workspace, "reserve", reserve)
        monkeypatch.setattr(Workspace, "upload", upload)
        monkeypatch.setattr(Workspace, "fill_host", lambda ws, fill: packing_upload(ws, fill, 0))
        monkeypatch.setattr(Workspace, "last_upload", lambda ws: NullDevice())
        monkeypatch.setattr(planned, "is_capturing", lambda stream: False)
        monkeypatch.setattr(planned, "zero_fill", lambda ptr, count, stream: None)  # a memset

        def info(x, name):  # a meta tensor as a CUDA array of device 0, 16-byte aligned
            if x is None:
                return None
            return ArrayInfo(tuple(x.shape), tuple(x.stride()), normalize(x.dtype), 0)

        path = importlib.import_module("rtcinfer.interop.call")
        real = path._torch()
        monkeypatch.setattr(path, "_torch_info", info)
        monkeypatch.setattr(path, "_torch", lambda: (real[0], real[1], lambda device: 0, real[3]))
        monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
        monkeypatch.setattr(page, "_on_device", lambda x: True)  # the index ops' device form


def torch_as_cuda(monkeypatch) -> None:
    """PyTorch CPU tensors taken as CUDA tensors of device 0 (one GPU, compute capability 9.0,
    132 SMs, 227 KB of shared memory a block), their current stream 7; the samplers see the
    same capability."""
    import torch

    from rtcinfer import jit, launch
    from rtcinfer.interop import ArrayInfo
    from rtcinfer.interop.dtypes import normalize

    fake_gpu(monkeypatch)
    path = sys.modules["rtcinfer.interop.call"]
    real = path._torch()

    def info(x, name):
        if x is None:
            return None
        return ArrayInfo(tuple(x.shape), tuple(x.stride()), normalize(x.dtype), 0,
                         x.data_ptr() & 15)  # fmt: skip

    monkeypatch.setattr(path, "_torch_info", info)
    monkeypatch.setattr(path, "_torch", lambda: (real[0], real[1], lambda d: 7, real[3]))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(jit, "sm_count", lambda device: 132)
    monkeypatch.setattr(jit, "device_limits", lambda device: (132, 227 * 1024))
    monkeypatch.setattr(launch.Kernel, "occupancy", lambda self, device, threads: 4)
    for name in ("rtcinfer.sampling.samplers", "rtcinfer.sampling.softmax"):
        monkeypatch.setattr(sys.modules[name], "compute_capability", lambda device: 90)


def issued_launches(monkeypatch) -> list:
    """Every launch issued from now on, as (kernel name, grid, block, its parameters' fields at
    issue time, the stream): Launch's issuers are replaced by ones that record and launch
    nothing (named snapshot_issuer: a launcher made with one names it)."""
    import ctypes

    from rtcinfer import launch

    log = []

    def snapshot_issuer(self, device, dependent):
        def issue(stream):
            fields = {f: getattr(self.params, f) for f, *_ in self.params._fields_}
            fields = {f: list(v) if isinstance(v, ctypes.Array) else v for f, v in fields.items()}
            log.append((self.kernel.name, self.grid, self.block, fields, stream))
            return 0

        return issue

    monkeypatch.setattr(launch.Launch, "_issuer", snapshot_issuer)
    return log


def pointed(issue, arrays, address) -> tuple:
    """An issued launch (issued_launches') with every pointer field that holds one of `arrays`'
    addresses (address(array)) named by the array's place instead, the stream left out: calls
    on other arrays of the same signature compare equal."""
    where = {address(a): f"array {i}" for i, a in enumerate(arrays)}
    kernel, grid, block, fields, _ = issue
    named = {f: where.get(v, v) if isinstance(v, int) else v for f, v in fields.items()}
    return kernel, grid, block, named


def noted(op) -> int:
    """How many signatures op.cache notes as seen once (call.seen_before: keyed by a hash)."""
    return sum(type(k) is int for k in op.cache)


def shortcut_entries(ops, tag) -> dict:
    """The shortcuts learnt in the caches of `ops` (an Op or several) for the framework of
    `tag` (shortcut.TAG: PyTorch, shortcut.CUPY_TAG: CuPy): key -> launcher (False: learnt as
    none)."""
    ops = ops if isinstance(ops, (list, tuple)) else (ops,)
    return {k: v for op in ops for k, v in op.cache.items() if type(k) is tuple and k[0] is tag}
