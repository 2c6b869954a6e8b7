"""The prepared launch's driver calls without a GPU: CuPy's Cython wrappers faked, the launch
retried once from a thread with no current context, other failures raised with their name; on
devices whose launches are programmatically dependent (sm_90+), cuLaunchKernelEx faked, its
configuration checked against cuda.h's layout."""

from __future__ import annotations

import ctypes

import pytest

from rtcinfer import dependent_launch, launch
from rtcinfer.params import Field, StructLayout, params_type


class DriverError(RuntimeError):
    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


class FakeDriver:
    """CuPy's driver wrapper: launchKernel fails with the queued statuses, then succeeds."""

    CUDADriverError = DriverError

    def __init__(self, *statuses: int):
        self.statuses, self.launches = list(statuses), []

    def launchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):  # noqa: N802
        self.launches.append((fn, (gx, gy, gz), (bx, by, bz), smem, stream, extra))
        if self.statuses:
            raise DriverError(self.statuses.pop(0))


class FakeRuntime:
    CUDARuntimeError = type("CUDARuntimeError", (RuntimeError,), {})

    def __init__(self):
        self.calls = []

    def setDevice(self, device):  # noqa: N802
        self.calls.append(("setDevice", device))

    def memsetAsync(self, ptr, value, nbytes, stream):  # noqa: N802
        self.calls.append(("memsetAsync", ptr, value, nbytes, stream))

    def streamIsCapturing(self, stream):  # noqa: N802
        raise RuntimeError("the stream was capturing, but an error has invalidated it")


class Names:
    """cuda.bindings' error names, as CudaError asks them."""

    @staticmethod
    def CUresult(code):  # noqa: N802
        return code

    @staticmethod
    def cuGetErrorName(code):  # noqa: N802
        return 0, {201: b"CUDA_ERROR_INVALID_CONTEXT", 700: b"CUDA_ERROR_ILLEGAL_ADDRESS"}[code]


@pytest.fixture
def prepared(monkeypatch):
    """A Launch of a fake kernel (its function handle 0x1234 on device 0) and the fakes."""
    drv, rt = FakeDriver(), FakeRuntime()
    monkeypatch.setattr(launch, "cupy_api", lambda: (drv, rt))
    monkeypatch.setattr(launch, "driver", lambda: Names)
    monkeypatch.setitem(dependent_launch.DEVICES, 0, False)  # a device before sm_90

    layout = StructLayout("P", (Field("x", "ptr", 1, 0, 8),), 8, 8)

    class Kernel:
        smem, _functions = 512, {0: 0x1234}

        def function(self, device):
            return self._functions[device]

    Kernel.params_type = params_type(layout)
    return launch.Launch(Kernel(), (3, 1, 1), (128, 1, 1)), drv, rt


def test_a_launch_passes_its_handle_geometry_and_stream(prepared):
    made, drv, _ = prepared
    made(0x77, 0)
    assert drv.launches == [(0x1234, (3, 1, 1), (128, 1, 1), 512, 0x77, 0)]


def test_a_thread_without_a_context_makes_the_device_current_and_launches_again(prepared):
    made, drv, rt = prepared
    drv.statuses = [201]
    made(0x77, 0)
    assert rt.calls == [("setDevice", 0)] and len(drv.launches) == 2


def test_a_retry_that_fails_too_raises_its_own_error(prepared):
    made, drv, rt = prepared
    drv.statuses = [201, 700]
    with pytest.raises(launch.CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        made(0x77, 0)
    assert rt.calls == [("setDevice", 0)] and len(drv.launches) == 2


def test_a_failed_launch_raises_the_driver_error_by_name(prepared):
    made, drv, _ = prepared
    drv.statuses = [700]
    with pytest.raises(launch.CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS \\(700\\)") as e:
        made(0x77, 0)
    assert e.value.code == 700


def test_a_zero_fill_is_the_runtime_byte_fill_and_an_invalidated_capture_counts(prepared):
    _, _, rt = prepared
    launch.zero_fill(0x1000, 6, 0x77)
    launch.zero_fill(0x1000, 0, 0x77)  # nothing to fill: no call
    assert rt.calls == [("memsetAsync", 0x1000, 0, 24, 0x77)]
    assert launch.is_capturing(0x77)


def test_each_device_loads_the_kernel_once_and_launches_its_own(monkeypatch):
    """Per-device module caches: a launch on device d passes the function loaded on d, loaded
    the first time d needs it (a tensor-parallel process launches one kernel on two GPUs)."""
    drv, rt = FakeDriver(), FakeRuntime()
    monkeypatch.setattr(launch, "cupy_api", lambda: (drv, rt))
    monkeypatch.setattr(dependent_launch, "DEVICES", {0: False, 1: False})
    monkeypatch.setattr(launch, "_DEPENDENT_DEVICES", dependent_launch.DEVICES)
    loads = []

    def get_function(spec, name, device, dynamic_smem=0):
        loads.append((name, device, dynamic_smem))
        return type("Function", (), {"ptr": 0x1000 + device})()

    layout = StructLayout("P", (Field("x", "ptr", 1, 0, 8),), 8, 8)
    monkeypatch.setattr(launch.jit, "struct_layout", lambda spec, name: layout)
    monkeypatch.setattr(launch.jit, "get_function", get_function)
    kernel = launch.Kernel("spec", "k", "P", smem=256)
    made = launch.Launch(kernel, (2, 1, 1), (64, 1, 1))
    made(0x10, 1)
    made(0x20, 0)
    made(0x11, 1)
    assert [(fn, stream) for fn, _, _, _, stream, _ in drv.launches] == [
        (0x1001, 0x10), (0x1000, 0x20), (0x1001, 0x11)
    ]  # fmt: skip
    assert loads == [("k", 1, 256), ("k", 0, 256)]


class FakeLaunchEx:
    """libcuda's cuLaunchKernelEx: returns the queued statuses, then 0; records what the
    configuration held at each call."""

    def __init__(self, *statuses: int):
        self.statuses, self.launches = list(statuses), []

    def __call__(self, config_at, fn, params, extra):
        c = dependent_launch.LaunchConfig.from_address(config_at)
        attr = dependent_launch.LaunchAttribute.from_address(c.attrs)
        self.launches.append((fn, tuple(c.grid), tuple(c.block), c.shared_mem_bytes, c.stream,
                              c.num_attrs, attr.id, attr.value[0], params, extra))  # fmt: skip
        return self.statuses.pop(0) if self.statuses else 0


@pytest.fixture
def dependent(prepared, monkeypatch):
    """The prepared launch on a device whose launches are dependent, cuLaunchKernelEx faked."""
    made, drv, rt = prepared
    ex = FakeLaunchEx()
    monkeypatch.setitem(dependent_launch.DEVICES, 0, True)
    monkeypatch.setattr(dependent_launch, "launch_function", lambda: ex)
    return made, ex, drv, rt


def test_the_launch_configuration_has_cuda_h_layout():
    """CUlaunchConfig: seven unsigned ints, then the stream at 32, the attributes at 40 and
    their count at 48 (56 bytes); CUlaunchAttribute: the id, 4 bytes of padding, a 64-byte
    value union at 8 (72 bytes, aligned to 8)."""
    config, attr = dependent_launch.LaunchConfig, dependent_launch.LaunchAttribute
    assert (config.stream.offset, config.attrs.offset, config.num_attrs.offset) == (32, 40, 48)
    assert ctypes.sizeof(config) == 56 and config.shared_mem_bytes.offset == 24
    assert attr.value.offset == 8 and ctypes.sizeof(attr) == 72 and ctypes.alignment(attr) == 8


def test_a_dependent_launch_passes_its_geometry_stream_and_the_attribute(dependent):
    made, ex, drv, _ = dependent
    made(0x77, 0)
    made(0x78, 0)
    programmatic = dependent_launch.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    first = (0x1234, (3, 1, 1), (128, 1, 1), 512, 0x77, 1, programmatic, 1)
    assert [e[:8] for e in ex.launches] == [first, (*first[:4], 0x78, *first[5:])]
    assert ex.launches[0][8] == made._argv and ex.launches[0][9] is None
    assert drv.launches == []  # cuLaunchKernel is not called


def test_a_dependent_launch_retries_once_without_a_context_and_names_a_failure(dependent):
    made, ex, _, rt = dependent
    ex.statuses = [201]
    made(0x77, 0)
    assert rt.calls == [("setDevice", 0)] and len(ex.launches) == 2
    ex.statuses = [700]
    with pytest.raises(launch.CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS \\(700\\)"):
        made(0x77, 0)


def test_a_device_setting_changed_between_launches_takes_effect_at_the_next(dependent):
    """Each launch reads the device's setting (bench_dependent_launch switches it between
    calls): a launch made dependent, then plain, then dependent again goes through
    cuLaunchKernelEx, cuLaunchKernel, then cuLaunchKernelEx, each issuer made once."""
    made, ex, drv, _ = dependent
    made(0x77, 0)
    dependent_launch.DEVICES[0] = False
    made(0x78, 0)
    made(0x79, 0)
    dependent_launch.DEVICES[0] = True
    made(0x7A, 0)
    assert [e[4] for e in ex.launches] == [0x77, 0x7A]
    assert [d[4] for d in drv.launches] == [0x78, 0x79]
    assert [len(issuers) for issuers in made._issuers] == [1, 1]


def test_a_recording_takes_the_launch_even_after_its_first_on_the_device(dependent):
    """A launch already issued on the device is recorded, not issued, inside recording()."""
    made, ex, _, _ = dependent
    made(0x77, 0)
    with launch.recording() as steps:
        made(0x78, 0)
    assert len(ex.launches) == 1 and len(steps) == 1 and steps[0].grid == (3, 1, 1)


def test_launches_are_dependent_from_sm_90_unless_turned_off(monkeypatch):
    capability = {0: (8, 0), 1: (9, 0), 2: (10, 0)}
    monkeypatch.setattr(dependent_launch.gpu, "compute_capability", lambda d: capability[d])
    monkeypatch.setattr(dependent_launch, "DEVICES", {})
    monkeypatch.delenv("RTCINFER_PDL", raising=False)
    assert [dependent_launch.enabled(d) for d in (0, 1, 2)] == [False, True, True]
    monkeypatch.setattr(dependent_launch, "DEVICES", {})
    monkeypatch.setenv("RTCINFER_PDL", "0")
    assert not dependent_launch.enabled(1)
