"""Bad indices found on the device, raised on the host.

An op that reads page ids or positions from device arrays (append_paged_kv_cache,
apply_rope_with_cos_sin_cache for the rows of its table, the samplers for the rows of probs
their `indices` name, the decode planner on the device) checks every entry it uses on the
device against its valid range, does not follow a bad one (no memory is touched through it),
and counts it in its device's record (cuda_src/bad_index.cuh, BadIndexRecord: in device
memory, counted with atomics, allocated once per device and kept for the process). The first
bad entry since the record was cleared is described there and in a host copy, in pinned host
memory that the kernel writes through its mapping, its count written last. (The RoPE kernel
notes its bad positions without an atomic, and without a count: bad_index.cuh says why.)

BadIndexError, naming the array, the entry, what it held and its valid range, is raised by:
- the next call of such an op on that device: before it launches, it reads the host copy's
  count (a read of host memory, no synchronization, nothing enqueued), and when it is set
  clears both records (the device one by a memset on the call's stream) and raises. A kernel
  that has not run yet when that call is made is reported by a later call;
- `check_errors()`: synchronizes every device that has a record, reads it (the number of bad
  entries too), clears it and raises. Call it where a step must be known good;
- every such call, at once, under RTCINFER_CHECK=1 (read when a call signature is first
  prepared): the call synchronizes its stream after the launch (skipped while the stream is
  captured into a CUDA graph). A debugging aid: it stalls the host at every call.
Inside jax.jit, where JAX sees one GPU, XLA launches these kernels itself with the record's
addresses baked in (interop/xla_launch.py): no Python runs before such a launch, so what it
reports is raised by the next call made from Python or by check_errors(). (RTCINFER_CHECK=1
keeps the Python handler, which checks at every call.)

Decode and prefill (attention/decode.py, prefill.py) take page ids from their plan, which is
checked on the host: their run() refuses a plan whose largest page id is not a page of the
cache, before launching. A decode plan built on the device (the wrapper's device_plan_array)
is checked there instead: a bad table is reported and planned as no work, a page id outside
the cache reported and page 0 read in its place.
"""

from __future__ import annotations

import ctypes
import enum
import os
import threading
from dataclasses import dataclass

import numpy as np

from . import gpu, jit
from .launch import is_capturing, keep_resident, zero_fill
from .params import record_dtype


class BadIndex(enum.IntEnum):
    """Which array held a bad entry (crosses into the kernels' prelude by name)."""

    NONE = 0
    BATCH_INDICES = 1  # append_paged_kv_cache's
    POSITIONS = 2
    KV_INDPTR = 3
    KV_INDICES = 4
    COS_SIN_POSITIONS = 5  # apply_rope_with_cos_sin_cache's positions
    SAMPLE_INDICES = 6  # the samplers' indices (rows of probs)
    PLAN_INDPTR = 7  # a decode plan built on the device (attention/decode_device_plan.py)
    PLAN_PAGES = 8
    PLAN_LAST_PAGE_LEN = 9
    PLAN_KV_LEN = 10
    PLAN_WORK = 11
    PLAN_INDICES = 12
    QUANT_COS_SIN_POSITIONS = 13  # rope_quantize_fp8's positions
    QUANT_BATCH_INDICES = 14  # rope_quantize_fp8_append_paged_kv_cache's
    QUANT_POSITIONS = 15
    QUANT_KV_INDPTR = 16
    QUANT_KV_INDICES = 17


RECORD = record_dtype(jit.source_layout("bad_index.cuh", "BadIndexRecord"))
_MEMCPY_DEVICE_TO_HOST = 2  # cudaMemcpyDeviceToHost

_SKIPPED = "its row was skipped, nothing written"
_PLANNER = "device_plan_array"
_NO_WORK = "the plan holds no work (run() with it writes nothing)"
_QUANTIZE = "rope_quantize_fp8"
_APPEND_QUANTIZED = "rope_quantize_fp8_append_paged_kv_cache"
_NOT_APPENDED = "its k and v were not appended (its q was written)"
# Each code: (the op, its entry with index, value and limit, what the op did instead, whether
# its kernel counts bad entries: the RoPE kernel only notes them, bad_index.cuh).
_ENTRIES = {
    BadIndex.BATCH_INDICES: ("append_paged_kv_cache", "batch_indices[{index}] = {value} is not "
                             "a request of the table (0 <= b < {limit})", _SKIPPED, True),
    BadIndex.POSITIONS: ("append_paged_kv_cache", "positions[{index}] = {value} is past the end "
                         "of its request, {limit} tokens by kv_indptr and kv_last_page_len",
                         _SKIPPED, True),
    BadIndex.KV_INDPTR: ("append_paged_kv_cache", "kv_indptr: request {index} reads "
                         "kv_indices[{value}], outside its {limit} entries", _SKIPPED, True),
    BadIndex.KV_INDICES: ("append_paged_kv_cache", "kv_indices[{index}] = {value} is not a page "
                          "of the cache (0 <= page < {limit})", _SKIPPED, True),
    BadIndex.COS_SIN_POSITIONS: ("apply_rope_with_cos_sin_cache", "positions[{index}] = {value} "
                                 "is not a row of cos_sin_cache (0 <= position < {limit})",
                                 "its token passed through unrotated, no row read", False),
    BadIndex.SAMPLE_INDICES: ("a sampler", "indices[{index}] = {value} is not a row of probs "
                              "(0 <= row < {limit})", "its sample is -1, no row read", True),
    BadIndex.PLAN_INDPTR: (_PLANNER, "kv_indptr[{index}] = {value}: the table must start at 0 "
                           "and never decrease (the entry before it holds {limit})", _NO_WORK,
                           True),
    BadIndex.PLAN_PAGES: (_PLANNER, "kv_indptr[{index}] = {value} pages exceed {limit}, the "
                          "entries of kv_indices or the plan's page capacity", _NO_WORK, True),
    BadIndex.PLAN_LAST_PAGE_LEN: (_PLANNER, "kv_last_page_len[{index}] = {value} is out of range "
                                  "for a request of {limit} pages (1 to page_size with pages, 0 "
                                  "without)", _NO_WORK, True),
    BadIndex.PLAN_KV_LEN: (_PLANNER, "request {index} has {value} tokens; at most {limit} are "
                           "supported", _NO_WORK, True),
    BadIndex.PLAN_WORK: (_PLANNER, "fixed_split_size makes {value} work items, more than the "
                         "capacity's {limit}", _NO_WORK, True),
    BadIndex.PLAN_INDICES: (_PLANNER, "kv_indices[{index}] = {value} is not a page of the cache "
                            "(0 <= page < {limit})", "page 0 was read in its place", True),
    BadIndex.QUANT_COS_SIN_POSITIONS: (_QUANTIZE, "pos_ids[{index}] = {value} is not a row of "
                                       "cos_sin_cache (0 <= position < {limit})", "its rotary "
                                       "dims were quantized unrotated, no row read", True),
    BadIndex.QUANT_BATCH_INDICES: (_APPEND_QUANTIZED, "batch_indices[{index}] = {value} is not a "
                                   "request of the table (0 <= b < {limit})", _NOT_APPENDED, True),
    BadIndex.QUANT_POSITIONS: (_APPEND_QUANTIZED, "positions[{index}] = {value} is past the pages "
                               "of its request, {limit} tokens by kv_indptr and page_size",
                               _NOT_APPENDED, True),
    BadIndex.QUANT_KV_INDPTR: (_APPEND_QUANTIZED, "kv_indptr: request {index} reads "
                               "kv_indices[{value}], outside its {limit} entries", _NOT_APPENDED,
                               True),
    BadIndex.QUANT_KV_INDICES: (_APPEND_QUANTIZED, "kv_indices[{index}] = {value} is not a page "
                                "of the cache (0 <= page < {limit})", _NOT_APPENDED, True),
}  # fmt: skip


class BadIndexError(IndexError):
    """A device array held an entry outside its valid range; the op did not follow it."""


def describe(record, count: int | None) -> str:
    """The message of a record (a RECORD row): the op, the first bad entry, what the op did
    instead; and `count`, the bad entries found since the last report, when it was read (and
    its kernel counts them)."""
    code = int(record["code"])
    unknown = ("an op", f"a bad entry (code {code})", "not followed", False)
    op, entry, instead, counted = _ENTRIES.get(code, unknown)
    text = f"{op}: " + entry.format(index=int(record["index"]), value=int(record["value"]),
                                    limit=int(record["limit"])) + f"; {instead}"  # fmt: skip
    if count is not None and counted:
        text += f"; {count} bad entr{'y' if count == 1 else 'ies'} in all since the last report"
    return text


@dataclass
class Record:
    """A device's BadIndexRecord and its host copy. `reported` is the host copy's count: set
    by the device when it holds a description."""

    device: int
    device_ptr: int  # the record, in device memory
    host_ptr: int  # its host copy (pinned, mapped: the same address on the device)
    reported: ctypes.c_int32
    keep: object = None  # the device allocation

    def host_copy(self) -> np.void:
        return np.frombuffer((ctypes.c_char * RECORD.itemsize).from_address(self.host_ptr),
                             RECORD)[0].copy()  # fmt: skip


_RECORDS: dict[int, Record] = {}  # device -> its record, for the life of the process
_LOCK = threading.Lock()


def record(device: int) -> Record:
    """The record of `device`, allocated (and zeroed) by its first use."""
    found = _RECORDS.get(device)
    if found is None:
        with _LOCK:
            found = _RECORDS.get(device)
            if found is None:
                found = _RECORDS[device] = _allocate(device)
    return found


def before_launch(rec: Record, device: int, stream: int) -> Record:
    """The record a call on `device` reports to (`rec`, a prepared call's, when it is that
    device's), after raising what an earlier call reported there (raise_reported)."""
    found = rec if device == rec.device else record(device)
    if found.reported.value:
        raise_reported(found, stream)
    return found


def checking() -> bool:
    """Whether RTCINFER_CHECK=1 asks every call to synchronize and raise at once."""
    return os.environ.get("RTCINFER_CHECK") == "1"


def raise_reported(rec: Record, stream: int) -> None:
    """A call found `rec` reported (rec.reported set): clear both records without waiting (the
    device one by a memset on `stream`) and raise the host copy's description."""
    description = rec.host_copy()
    _clear_host(rec)
    _clear_device(rec, stream)
    raise BadIndexError(describe(description, None))


def check_launch(rec: Record, stream: int) -> None:
    """RTCINFER_CHECK=1: wait for `stream` after a launch and raise what it reported."""
    if is_capturing(stream):
        return
    gpu.runtime().streamSynchronize(stream)
    if rec.reported.value:
        _raise_counted(rec)


def check_errors() -> None:
    """Wait for every device that ran an op which checks device indices, and raise
    BadIndexError for the first bad entry found since the last report (with the number of rows
    skipped); then the records are clear. Returns None when there was none."""
    for device in sorted(_RECORDS):
        rec = _RECORDS[device]
        _synchronize(device)
        if int(_read_device(rec)["count"]) or rec.reported.value:
            _raise_counted(rec)


def _raise_counted(rec: Record) -> None:
    """With the device idle for `rec`: read it, clear both records, raise."""
    found = _read_device(rec)
    if not int(found["count"]):  # reported by the host copy only (cleared on the device)
        found = rec.host_copy()
    _clear_host(rec)
    _clear_device(rec, None)
    raise BadIndexError(describe(found, max(int(found["count"]), 1)))


# ---------------------------------------------------------------- the device's side


def _allocate(device: int) -> Record:
    """A zeroed record in device memory and its zeroed host copy, pinned and mapped (with
    unified addressing, on every 64-bit platform CUDA supports, the host address is the
    device address)."""
    import cupy

    runtime = gpu.runtime()
    nbytes = RECORD.itemsize
    with cupy.cuda.Device(device):
        memory = cupy.cuda.alloc(nbytes)
        runtime.memset(memory.ptr, 0, nbytes)
    host_ptr = runtime.hostAlloc(nbytes, runtime.hostAllocMapped | runtime.hostAllocPortable)
    ctypes.memset(host_ptr, 0, nbytes)
    keep_resident(memory.ptr, nbytes)  # never freed: a launch inside jax.jit may name them
    keep_resident(host_ptr, nbytes)
    return Record(device, memory.ptr, host_ptr, ctypes.c_int32.from_address(host_ptr), memory)


def _synchronize(device: int) -> None:
    import cupy

    cupy.cuda.Device(device).synchronize()


def _read_device(rec: Record) -> np.void:
    out = np.zeros(1, RECORD)
    gpu.runtime().memcpy(out.ctypes.data, rec.device_ptr, RECORD.itemsize,
                         _MEMCPY_DEVICE_TO_HOST)  # fmt: skip
    return out[0]


def _clear_device(rec: Record, stream: int | None) -> None:
    """Zero the device record: enqueued on `stream`, or at once (None: the device is idle)."""
    if stream is None:
        gpu.runtime().memset(rec.device_ptr, 0, RECORD.itemsize)
    else:
        zero_fill(rec.device_ptr, RECORD.itemsize // 4, stream)


def _clear_host(rec: Record) -> None:
    ctypes.memset(rec.host_ptr, 0, RECORD.itemsize)


__all__ = ["BadIndex", "BadIndexError", "Record", "check_errors", "describe", "record"]
