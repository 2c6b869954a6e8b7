"""What a machine without a usable GPU is told, before anything touches the device: no driver,
no device, a driver older than the installed CUDA wheels, a GPU below compute capability 8.0.
The driver and CuPy's runtime are faked (tests/fakes.py); this machine's own answer is checked
where it has no GPU."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import rtcinfer
from rtcinfer import cli, gpu, jit
from rtcinfer.norm import NormSpec
from tests.conftest import gpu_available

from .fakes import fake_gpu

NO_GPU = r"rtcinfer needs an NVIDIA GPU and driver; none was found \("


def test_no_driver(monkeypatch):
    fake_gpu(monkeypatch, driver=0)
    with pytest.raises(gpu.NoGpuFound, match=NO_GPU + r"no NVIDIA driver is installed\)$"):
        gpu.runtime()


def test_no_device(monkeypatch):
    fake_gpu(monkeypatch, error=(100, "cudaErrorNoDevice: no CUDA-capable device is detected"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(gpu.NoGpuFound, match=NO_GPU + r"the driver sees no device; CUDA_VIS"):
        gpu.runtime()
    fake_gpu(monkeypatch, devices=0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(gpu.NoGpuFound, match=NO_GPU + r"the driver sees no device\)$"):
        gpu.runtime()


@pytest.mark.parametrize(
    "driver, wheels, match",
    [
        (12040, 13020, r"driver supports CUDA 12\.4, older than the CUDA 13 wheels installed "
                       r"with rtcinfer: pip install 'rtcinfer\[cuda12\]', or update the driver"),
        (11080, 12080, r"supports CUDA 11\.8, older than the CUDA 12 wheels .*: update the driver"),
    ],
)  # fmt: skip
def test_a_driver_older_than_the_wheels_names_the_extra(monkeypatch, driver, wheels, match):
    fake_gpu(monkeypatch, driver=driver, wheels=wheels)
    with pytest.raises(gpu.GpuUnavailable, match=match) as info:
        gpu.runtime()
    assert not isinstance(info.value, gpu.NoGpuFound)


def test_a_newer_minor_or_major_driver_is_fine(monkeypatch):
    for driver in (13000, 13090, 14000):
        fake_gpu(monkeypatch, driver=driver, wheels=13020)
        assert gpu.current() == 0


def test_other_cuda_errors_are_said_in_a_sentence(monkeypatch):
    fake_gpu(monkeypatch, error=(46, "cudaErrorDevicesUnavailable: CUDA-capable device(s) is/are "
                                     "busy or unavailable"))  # fmt: skip
    with pytest.raises(gpu.GpuUnavailable, match="cannot use this machine's GPU: CUDA says cuda"):
        gpu.runtime()


def test_the_driver_version_without_cupy_agrees_with_cupys():
    version = gpu.driver_cuda_version()
    if gpu_available():
        from cupy_backends.cuda.api import runtime

        assert version == runtime.driverGetVersion()
    else:
        assert version is None or version >= 1000  # a driver without a visible device


def test_the_extra_to_install_follows_the_driver():
    assert gpu.install_hint(13000) == "pip install 'rtcinfer[cuda13]'"
    assert gpu.install_hint(14010) == "pip install 'rtcinfer[cuda13]'"
    assert gpu.install_hint(12080) == "pip install 'rtcinfer[cuda12]'"
    for unknown in (None, 11080):
        hint = gpu.install_hint(unknown)
        assert "'rtcinfer[cuda13]' for a CUDA 13 driver" in hint and "[cuda12]" in hint


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
def test_this_machine_without_a_gpu_says_so():
    with pytest.raises(gpu.NoGpuFound, match=NO_GPU):
        gpu.runtime()
    with pytest.raises(gpu.NoGpuFound, match=NO_GPU):
        rtcinfer.BatchDecodeWithPagedKVCacheWrapper()


@pytest.mark.parametrize(
    "make",
    [
        rtcinfer.BatchDecodeWithPagedKVCacheWrapper,
        rtcinfer.BatchPrefillWithRaggedKVCacheWrapper,
        rtcinfer.BatchPrefillWithPagedKVCacheWrapper,
    ],
)
def test_wrapper_construction_says_what_is_missing(monkeypatch, make):
    fake_gpu(monkeypatch, driver=0)
    with pytest.raises(gpu.NoGpuFound, match=NO_GPU):
        make()
    fake_gpu(monkeypatch, driver=12020)
    with pytest.raises(gpu.GpuUnavailable, match=r"rtcinfer\[cuda12\]"):
        make()


def test_the_first_op_says_what_is_missing(monkeypatch):
    """A PyTorch CUDA tensor (a CPU one standing in) reaching a driver older than the wheels:
    the op names the extra before it touches the device."""
    torch = pytest.importorskip("torch")
    call = importlib.import_module("rtcinfer.interop.call")

    def as_cuda(x, name):
        return None if x is None else call.ArrayInfo(tuple(x.shape), x.stride(), "float32", 0)

    monkeypatch.setattr(call, "_torch_info", as_cuda)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    fake_gpu(monkeypatch, driver=12080)
    with pytest.raises(gpu.GpuUnavailable, match=r"pip install 'rtcinfer\[cuda12\]'"):
        rtcinfer.rmsnorm(torch.zeros(4, 128), torch.ones(128))


def test_arch_of():
    assert gpu.arch_of(90) == "sm_90a" and gpu.arch_of("80") == "sm_80"


@pytest.mark.parametrize(
    "cc, arch", [((8, 0), "sm_80"), ((8, 6), "sm_86"), ((9, 0), "sm_90a"), ((12, 0), "sm_120")]
)
def test_compile_arch(monkeypatch, cc, arch):
    fake_gpu(monkeypatch, compute_capability=cc)
    assert gpu.compile_arch(0) == arch


def test_a_gpu_below_sm80_is_refused_before_any_compile(monkeypatch):
    import cupy

    class Device:  # entering a device's context is all _module does with it before compiling
        def __init__(self, device_id):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    compiled = []
    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(jit, "compile_spec", lambda spec, arch: compiled.append(arch))
    fake_gpu(monkeypatch, compute_capability=(7, 5))
    message = r"rtcinfer needs compute capability 8\.0 or newer; this GPU is 7\.5"
    spec = NormSpec("rmsnorm", "float16", "float16", 128, 8, 32)
    with pytest.raises(gpu.GpuUnavailable, match=message):
        jit.get_function(spec, "norm_kernel", 0)
    assert compiled == []


def test_demo_on_an_unusable_gpu_is_one_line_and_exit_code_one(monkeypatch, capsys):
    for setting, message in (
        (dict(compute_capability=(7, 5)), "needs compute capability 8.0 or newer; this GPU is 7.5"),
        (dict(driver=12040), "pip install 'rtcinfer[cuda12]'"),
    ):
        fake_gpu(monkeypatch, **setting)
        assert cli.main(["demo"]) == 1
        captured = capsys.readouterr()
        assert captured.err.startswith("rtcinfer demo: error: ") and message in captured.err
        assert captured.err.count("\n") == 1 and "Traceback" not in captured.err + captured.out


def test_host_arrays_are_named_before_the_gpu_is_asked_about(monkeypatch):
    fake_gpu(monkeypatch, driver=0)
    with pytest.raises(TypeError, match="input: expected a CUDA array .* host numpy.ndarray"):
        rtcinfer.rmsnorm(np.zeros((4, 128), np.float32), np.ones(128, np.float32))
