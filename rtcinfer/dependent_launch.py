"""Programmatic dependent launches (sm_90 and later): a kernel launched with the driver's
programmatic-stream-serialization attribute may be scheduled while the kernel before it on the
stream is still running; it waits inside, at `wait_for_previous_grid()` (cuda_src/common.cuh,
the first statement of every kernel), until that kernel has finished and its writes are
visible. What the overlap saves is part of the gap between two kernels on a stream (the next
one's launch and the SMs' refill after the last CTAs of the previous one): on the H200 large
norm rows called back to back took ~3 us a call more than one replayed alone, ~1.8 us less of
it with dependent launches, and a decode layer's four small ops in one CUDA graph 16.4 -> 14.3
us (bench/RESULTS.md). FlashInfer launches this way too (its enable_pdl).

The driver's cuLaunchKernelEx is called through ctypes with a launch configuration built once
per prepared launch (only its stream is written per call); CuPy's wrapper has no such call.
RTCINFER_PDL=0 turns it off (every launch then goes through cuLaunchKernel, as before sm_90).
"""

from __future__ import annotations

import ctypes
import functools
import os

from . import gpu

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # cuda.h's CUlaunchAttributeID
MIN_MAJOR = 9  # griddepcontrol: sm_90 and later


class LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: the id, 4 bytes of padding, a 64-byte value union (whose
    first int is the attribute's flag) aligned to 8."""

    _fields_ = [("id", ctypes.c_int), ("_pad", ctypes.c_int), ("value", ctypes.c_uint64 * 8)]


class LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),  # CUstream
        ("attrs", ctypes.c_void_p),  # CUlaunchAttribute*
        ("num_attrs", ctypes.c_uint),
    ]


_DEPENDENT = LaunchAttribute(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 0)
_DEPENDENT.value[0] = 1  # programmaticStreamSerializationAllowed (an int at the union's start)


def config(grid: tuple[int, int, int], block: tuple[int, int, int], smem: int) -> LaunchConfig:
    """A dependent launch's configuration of this geometry; the caller sets `stream` per
    launch."""
    made = LaunchConfig()
    made.grid[:] = grid
    made.block[:] = block
    made.shared_mem_bytes = smem
    made.attrs = ctypes.addressof(_DEPENDENT)
    made.num_attrs = 1
    return made


@functools.cache
def launch_function():
    """libcuda's cuLaunchKernelEx(config*, CUfunction, void** params, void** extra) -> CUresult,
    arguments passed as plain integers. Called with the GIL held (PyDLL): a launch returns in
    microseconds, and handing the GIL to other threads and back around it cost more (0.34 ->
    0.55 us a ctypes call on a 2-core x86 host with four other threads waiting)."""
    fn = ctypes.PyDLL("libcuda.so.1").cuLaunchKernelEx
    fn.argtypes = [ctypes.c_void_p] * 4
    fn.restype = ctypes.c_int
    return fn


DEVICES: dict[int, bool] = {}  # device -> whether its launches are made dependent (asked once)


def enabled(device: int) -> bool:
    """Whether launches on `device` are programmatically dependent: compute capability 9.0 or
    later and RTCINFER_PDL not "0" (asked once per device)."""
    on = DEVICES.get(device)
    if on is None:
        on = DEVICES[device] = _supported(device)
    return on


def _supported(device: int) -> bool:
    if os.environ.get("RTCINFER_PDL") == "0":
        return False
    return gpu.compute_capability(device)[0] >= MIN_MAJOR


__all__ = ["LaunchAttribute", "LaunchConfig", "config", "enabled", "launch_function"]
