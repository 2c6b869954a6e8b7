"""The GPU, checked once before anything uses it, and its compile target.

Every use of the device starts at `runtime()`: its first call checks that CuPy and the CUDA
wheels are installed, that an NVIDIA driver is there and is recent enough for those wheels,
and that it sees a device, and turns CUDA's error codes (cudaErrorInsufficientDriver,
cudaErrorNoDevice) into a sentence that says what is missing and what to install; later calls
cost a cached lookup. `compile_arch` refuses GPUs below compute capability 8.0 before anything
is compiled for them.
"""

from __future__ import annotations

import ctypes
import functools
import os

NO_GPU = "rtcinfer needs an NVIDIA GPU and driver; none was found ({cause})"
MIN_COMPUTE_CAPABILITY = (8, 0)  # what the kernels assume (bf16 mma.sync, cp.async)
_CC_MAJOR, _CC_MINOR = 75, 76  # cudaDevAttrComputeCapabilityMajor / Minor
_NO_DEVICE = 100  # cudaErrorNoDevice


class GpuUnavailable(RuntimeError):
    """No GPU rtcinfer can use here; the message says why and what to do about it."""


class NoGpuFound(GpuUnavailable):
    """No NVIDIA driver, or no device visible to it."""


class CudaExtraMissing(GpuUnavailable):
    """The base install: CuPy and the CUDA wheels (the cuda13 or cuda12 extra) are missing."""


def nvidia_device_node() -> bool:
    """Whether this machine exposes an NVIDIA device to processes (Linux /dev/nvidiactl, WSL's
    /dev/dxg): a file check, no driver call."""
    return any(os.path.exists(path) for path in ("/dev/nvidiactl", "/dev/dxg"))


def driver_cuda_version() -> int | None:
    """The CUDA version the NVIDIA driver supports (1000 * major + 10 * minor), asked of the
    driver library itself, for when CuPy is missing; None without a driver."""
    for name in ("libcuda.so.1", "nvcuda.dll"):
        try:
            library = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        if library.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value > 0:
            return version.value
    return None


def _version(cuda: int) -> str:
    return f"{cuda // 1000}.{cuda % 1000 // 10}"


def install_hint(driver: int | None) -> str:
    """The pip command for the CUDA extra a driver supporting CUDA `driver` can run."""
    major = driver // 1000 if driver else 0
    if major >= 13:
        return "pip install 'rtcinfer[cuda13]'"
    if major == 12:
        return "pip install 'rtcinfer[cuda12]'"
    return "pip install 'rtcinfer[cuda13]' for a CUDA 13 driver, 'rtcinfer[cuda12]' for CUDA 12"


def require_cuda_wheels() -> None:
    """Raise CudaExtraMissing unless CuPy and cuda-bindings import (the base install has
    neither: it plans on the host and runs the command line, nothing on the GPU)."""
    try:
        import cupy  # noqa: F401
        from cuda.bindings import driver, nvrtc  # noqa: F401
    except ImportError as e:
        raise CudaExtraMissing(
            f"rtcinfer needs CuPy and the CUDA wheels, which this install lacks ({e}): "
            f"{install_hint(driver_cuda_version())}"
        ) from None


def check(runtime) -> None:
    """Raise GpuUnavailable (NoGpuFound for a missing driver or device) unless CuPy's CUDA
    `runtime` can use a GPU here."""
    driver = runtime.driverGetVersion()  # 0 without a driver
    if driver == 0:
        raise NoGpuFound(NO_GPU.format(cause="no NVIDIA driver is installed"))
    wheels = runtime.runtimeGetVersion()
    if driver // 1000 < wheels // 1000:
        fix = "update the driver (rtcinfer needs CUDA 12 or newer)"
        if driver // 1000 >= 12:
            fix = f"{install_hint(driver)}, or update the driver"
        raise GpuUnavailable(
            f"the NVIDIA driver supports CUDA {_version(driver)}, older than the CUDA "
            f"{wheels // 1000} wheels installed with rtcinfer: {fix}"
        )
    try:
        count = runtime.getDeviceCount()
    except runtime.CUDARuntimeError as e:
        if e.status != _NO_DEVICE:
            raise GpuUnavailable(f"rtcinfer cannot use this machine's GPU: CUDA says {e}") from None
        count = 0
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "" if visible is None else f"; CUDA_VISIBLE_DEVICES={visible!r}"
        raise NoGpuFound(NO_GPU.format(cause=f"the driver sees no device{shown}"))


@functools.cache
def runtime():
    """CuPy's CUDA runtime module, once `check` found a usable GPU (not cached when it raises:
    the next call checks again)."""
    require_cuda_wheels()
    from cupy_backends.cuda.api import runtime as cuda_runtime

    check(cuda_runtime)
    return cuda_runtime


def current() -> int:
    """The ordinal of CuPy's current device."""
    return runtime().getDevice()


def arch_of(compute_capability: str | int) -> str:
    """Compile target for a device: sm_90 gets the arch-specific sm_90a (wgmma, setmaxnreg)."""
    cc = str(compute_capability)
    return "sm_90a" if cc == "90" else f"sm_{cc}"


def compute_capability(device_id: int) -> tuple[int, int]:
    """(major, minor) of a device."""
    cuda = runtime()
    major = cuda.deviceGetAttribute(_CC_MAJOR, device_id)
    return major, cuda.deviceGetAttribute(_CC_MINOR, device_id)


def compile_arch(device_id: int) -> str:
    """The compile target of a device; a GPU below compute capability 8.0 raises
    GpuUnavailable."""
    major, minor = compute_capability(device_id)
    if (major, minor) < MIN_COMPUTE_CAPABILITY:
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        raise GpuUnavailable(
            f"rtcinfer needs compute capability {need} or newer; this GPU is {major}.{minor}"
        )
    return arch_of(f"{major}{minor}")


__all__ = [
    "CudaExtraMissing",
    "GpuUnavailable",
    "NoGpuFound",
    "arch_of",
    "check",
    "compile_arch",
    "compute_capability",
    "current",
    "driver_cuda_version",
    "install_hint",
    "require_cuda_wheels",
    "runtime",
]
