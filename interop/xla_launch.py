"""JAX calls that XLA launches itself: no Python runs when a compiled computation executes.

A prepared call (call.Prepared) is recorded once, when it is traced: its `run` is called with
stand-in addresses (one range per input and output slot) inside launch.recording(), which
keeps each launch's kernel, geometry and parameter block instead of launching. Each recorded
launch becomes one custom call to jaxlib's native kernel launcher (`triton_kernel_call_ffi`,
the one Pallas and jax-triton use): the kernel's flat entry (rtcinfer/flat_entry.py) in PTX,
its grid and shared memory, and its parameters: the call's buffers, each pointer field's
offset into its buffer, every other field's value. jaxlib compiles the PTX once per process
and launches with cuLaunchKernel from C++, so a call inside `jax.jit` costs what any XLA
kernel costs.

A call is recorded only when everything its launches read comes from its own arrays: each
non-null pointer field must address one of the call's input or output slots (or, where JAX
sees one GPU, memory kept for the process' life: launch.keep_resident, the device's bad-index
record, baked in as a constant), a fill must zero the start of an output before the launch
that first writes it, and the block must be one-dimensional (a whole number of warps). An
output that updates an input in place (the cache of append_paged_kv_cache) is aliased to it
and written through the output's address only: XLA may give such an output a buffer of its
own (seen for a slice of another array), so the chain starts with move_kernel
(rtcinfer/move.py), which copies the input there when the addresses differ and returns at once
when they do not. Anything else (a plan's workspace, copies, events, RTCINFER_CHECK=1's waits)
keeps the Python FFI handler (call_jax), as does every call when the ptxas jaxlib compiles
with refuses the PTX version NVRTC writes (ptx_accepted: NVRTC may be the newer). Multi-launch
calls become a chain of custom calls, each output passed on to the next launch that addresses
it (aliased, so it is updated in place). RTCINFER_JAX_LAUNCH=python keeps every call on the
Python handler.

jaxlib registers its launcher as not command-buffer compatible, so XLA would run it outside
the CUDA graphs it records around runs of compatible calls (ours among them), at about 5 us of
host time a launch; it is registered again here, under our own name, as compatible: its
launches depend only on the serialized call and the buffers (it checks for a capture itself
when it launches). Measured on the H200 (bench/LOG.md): a one-op jitted rmsnorm 3 us above a
jitted `x + 1`, where the Python handler cost 25 us, and ten in one jitted function recorded
into one CUDA graph again.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from dataclasses import dataclass

from .. import errors, flat_entry, jit, move
from ..launch import FillRecord, LaunchRecord, recording, resident
from .dtypes import itemsize

_BASE = 1 << 62  # stand-in address of slot s: _BASE + (s << _SHIFT); offsets below 2**_SHIFT
_SHIFT = 36
# a field's C type -> (struct format, jaxlib's scalar parameter type)
_VALUES = {
    "int": ("<i", "i32"), "int32_t": ("<i", "i32"), "unsigned": ("<I", "u32"),
    "uint32_t": ("<I", "u32"), "int64_t": ("<q", "i64"), "uint64_t": ("<Q", "u64"),
    "float": ("<f", "fp32"), "double": ("<d", "fp64"), "ptr": ("<Q", "u64"),
}  # fmt: skip


def enabled() -> bool:
    """Whether calls may be launched natively (jaxlib has its kernel launcher, registered
    here as a target XLA may capture into command buffers, and RTCINFER_JAX_LAUNCH does not
    ask for the Python handler)."""
    return os.environ.get("RTCINFER_JAX_LAUNCH", "native") != "python" and _target() is not None


_TARGET = "rtcinfer_xla_launch"


@functools.cache
def _target() -> str | None:
    """jaxlib's native launcher registered again as `_TARGET`, declared command-buffer
    compatible (its own registration is not, so XLA would run it outside the CUDA graphs it
    records around our other calls: about 5 us of host time a launch instead of none); None
    when jaxlib has no launcher or XLA refuses the registration."""
    lib = _lib()
    plugin = getattr(lib, "_cuda_triton", None)
    if plugin is None or not hasattr(plugin, "registrations"):
        return None
    handler = plugin.registrations().get("triton_kernel_call_ffi")
    if handler is None:
        return None
    try:
        from jaxlib import xla_client

        traits = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
        xla_client.register_custom_call_target(_TARGET, handler, platform="CUDA",
                                               api_version=1, traits=traits)  # fmt: skip
    except Exception:  # noqa: BLE001 - an XLA without traits: the Python handler serves
        return None
    return _TARGET


@functools.cache
def _lib():
    """jaxlib's kernel launcher module (its CUDA plugin's), or None."""
    try:
        from jax._src.lib import gpu_triton
    except ImportError:
        return None
    needed = ("TritonKernel", "TritonKernelCall", "create_array_parameter",
              "create_scalar_parameter")  # fmt: skip
    return gpu_triton if all(hasattr(gpu_triton, n) for n in needed) else None


@dataclass(frozen=True)
class Step:
    """One native launch: the slots passed as operands, the output slots it returns, which
    operand (index) each aliased result (index) updates, and the custom call's serialized
    kernel call."""

    operands: tuple[int, ...]
    results: tuple[int, ...]
    aliases: dict
    opaque: bytes


def record(prep, present: list[bool], scalars: tuple, device: int) -> list | None:
    """The launches and fills of one `prep.run` with stand-in addresses, or None when the run
    does something a native launch cannot (NotRecordable) or raises (the Python handler then
    runs it, and raises, at execution)."""
    n_in = len(present)
    ptrs = [_BASE + (i << _SHIFT) if p else 0 for i, p in enumerate(present)]
    ptrs += [_BASE + ((n_in + j) << _SHIFT) for j in range(len(prep.outs))]
    try:
        with recording() as steps:
            prep.run(0, device, ptrs, scalars)
    except errors.BadIndexError:
        raise  # an earlier call's report, taken from the record as it was raised: say it now
    except Exception:  # noqa: BLE001 - NotRecordable, or what the handler will raise
        return None
    return steps


def _slot_of(value: int, n_slots: int) -> tuple[int, int] | None:
    """(slot, byte offset) of a stand-in address, or None."""
    rel = value - _BASE
    if rel < 0 or (rel >> _SHIFT) >= n_slots:
        return None
    return rel >> _SHIFT, rel & ((1 << _SHIFT) - 1)


@dataclass(frozen=True)
class NativeLaunch:
    """A recorded launch as the native launcher takes it. Buffers are `operands` then
    `results` (slots); `bound` maps each non-null pointer field to its buffer and `offsets`
    gives its byte offset there (layout order); `values` the other fields' values with
    jaxlib's type names (value_fields order); `zero` the bytes of each result to zero first;
    `moves` (operand slot, result slot) where the result is the operand updated in place
    (besides a slot that is both)."""

    kernel: object  # launch.Kernel
    grid: tuple[int, int, int]
    warps: int
    operands: tuple[int, ...]
    results: tuple[int, ...]
    bound: dict
    offsets: tuple[int, ...]
    values: tuple[tuple[int | float, str], ...]
    zero: tuple[int, ...]
    moves: tuple[tuple[int, int], ...] = ()

    def aliases(self) -> dict:
        """{operand index: result index} of the results that update an operand."""
        pairs = [(s, s) for s in self.operands if s in self.results] + list(self.moves)
        return {self.operands.index(a): self.results.index(b) for a, b in pairs}


def _move(source: int, slot: int, nbytes: int) -> NativeLaunch:
    """The launch of move_kernel that makes output `slot` hold input `source` (rtcinfer/move.py)."""
    return NativeLaunch(move.kernel(), (move.CTAS, 1, 1), move.THREADS // 32, (source,), (slot,),
                        {"src": 0, "dst": 1}, (0, 0), ((nbytes // 16, "i64"),), (0,),
                        ((source, slot),))  # fmt: skip


def plan(prep, present: list[bool], steps: list, constants: bool = False
         ) -> list[NativeLaunch] | None:  # fmt: skip
    """The native launches of recorded `steps`, or None when one cannot be made native.
    constants: a pointer into resident memory (launch.keep_resident) may be baked in (the
    computation runs on one GPU, the one the call was recorded for)."""
    n_in, outs = len(present), prep.outs
    n_slots = n_in + len(outs)
    have = {i for i, p in enumerate(present) if p}  # slots holding a value
    zero: dict[int, int] = {}  # output slot -> bytes to zero before its first launch
    native = []
    moved = set()  # input slots updated in place: written through their outputs only
    for j, o in enumerate(outs):
        if o.alias:
            nbytes = math.prod(o.shape) * itemsize(o.dtype)
            if nbytes % 16:
                return None
            native.append(_move(o.source, n_in + j, nbytes))
            have.add(n_in + j)
            moved.add(o.source)
    for step in steps:
        if isinstance(step, FillRecord):
            found = _slot_of(step.ptr, n_slots)
            if found is None or found[1] or found[0] < n_in or found[0] in have:
                return None
            zero[found[0]] = max(zero.get(found[0], 0), 4 * step.count)
            continue
        assert isinstance(step, LaunchRecord)
        kernel, (threads, by, bz) = step.kernel, step.block
        if by != 1 or bz != 1 or threads % 32:
            return None
        layout = jit.struct_layout(kernel.spec, kernel.params_name)
        if any(f.ctype not in _VALUES for f in layout.fields):
            return None  # a CUtensorMap must stay in parameter space
        addressed: dict[str, tuple[int, int]] = {}  # pointer field -> (slot, offset)
        values = []
        for f in layout.fields:
            fmt, kind = _VALUES[f.ctype]
            width = f.size // f.count
            items = [struct.unpack_from(fmt, step.params, f.offset + i * width)[0]
                     for i in range(f.count)]  # fmt: skip
            found = _slot_of(items[0], n_slots) if f.ctype == "ptr" and items[0] else None
            if found is not None:
                if found[0] in moved:
                    return None  # read or written through the input, not its output
                addressed[f.name] = found
            elif f.ctype == "ptr" and items[0] and not (constants and resident(items[0])):
                return None  # memory the call does not own: stays on the Python handler
            else:
                values += [(v, kind) for v in items]
        slots = list(dict.fromkeys(s for s, _ in addressed.values()))
        results = [s for s in slots if s >= n_in]
        operands = [s for s in slots if s < n_in or s in have]
        index = {s: len(operands) + k for k, s in enumerate(results)}
        index.update({s: k for k, s in enumerate(operands) if s < n_in})
        bound = {name: index[slot] for name, (slot, _) in addressed.items()}
        offsets = tuple(addressed[f.name][1] for f in layout.fields if f.name in addressed)
        zeros = tuple(zero.pop(s, 0) if s not in have else 0 for s in results)
        native.append(
            NativeLaunch(
                kernel,
                tuple(step.grid),
                threads // 32,
                tuple(operands),
                tuple(results),
                bound,
                offsets,
                tuple(values),
                zeros,
            )
        )
        have.update(results)
    if zero or any(n_in + j not in have for j, o in enumerate(outs) if math.prod(o.shape)):
        return None  # a fill no launch followed, or an output no launch wrote
    return native


def materialize(native: list[NativeLaunch], arch: str) -> list[Step] | None:
    """jaxlib's serialized kernel calls of `native` for GPUs of `arch` (e.g. "sm_90a"), or None
    when the ptxas jaxlib uses would refuse their PTX (ptx_accepted)."""
    lib = _lib()
    cc = int("".join(c for c in arch if c.isdigit()))
    steps = []
    for n in native:
        layout = jit.struct_layout(n.kernel.spec, n.kernel.params_name)
        buffers = len(n.operands) + len(n.results)
        entry = flat_entry.compile_flat(n.kernel.spec, n.kernel.name, layout, buffers, n.bound,
                                        arch)  # fmt: skip
        if not ptx_accepted(_ptx_version(entry.ptx) or "", arch):
            return None
        params = [lib.create_array_parameter(0, 16) for _ in n.operands]
        params += [lib.create_array_parameter(z, 16) for z in n.zero]
        params += [lib.create_scalar_parameter(o, "i64") for o in n.offsets]
        params += [lib.create_scalar_parameter(v, kind) for v, kind in n.values]
        call = lib.TritonKernelCall(_kernel(lib, entry, n.warps, n.kernel.smem, cc), *n.grid,
                                    params)  # fmt: skip
        steps.append(Step(n.operands, n.results, n.aliases(),
                          zlib.compress(call.to_proto(entry.name, b""))))  # fmt: skip
    return steps


def _kernel(lib, entry, warps: int, smem: int, cc: int):
    """jaxlib's TritonKernel of a flat entry (its constructor's arguments vary by version)."""
    try:  # name, warps, CTAs a cluster, shared memory, PTX, Triton IR, compute capability
        return lib.TritonKernel(entry.name, warps, 1, smem, entry.ptx, "", cc)
    except TypeError:
        return lib.TritonKernel(entry.name, warps, smem, entry.ptx, "", cc)


def lower(prep, present: list[bool], native: list[Step], out_types: list):
    """run(*inputs) -> outputs: the chain of native custom calls (traced inside jax.jit)."""
    import jax

    n_in = len(present)
    slots = [i for i, p in enumerate(present) if p]

    def run(*args):
        value = dict(zip(slots, args, strict=True))
        for step in native:
            types = [out_types[s - n_in] for s in step.results]
            call = jax.ffi.ffi_call(_TARGET, types,
                                    input_output_aliases=step.aliases or None)  # fmt: skip
            produced = call(*[value[s] for s in step.operands], opaque=step.opaque)
            value.update(zip(step.results, produced, strict=True))
        # an output no launch wrote is empty (plan() made sure)
        return [value[n_in + j] if n_in + j in value else jax.numpy.zeros(t.shape, t.dtype)
                for j, t in enumerate(out_types)]  # fmt: skip

    return run


def _ptxas() -> str | None:
    """The ptxas jaxlib compiles the PTX with: in the CUDA root JAX gives XLA (its pip wheel or
    CUDA_ROOT), else the one on PATH; None when there is none."""
    try:
        from jax._src import lib

        root = getattr(lib, "cuda_path", None)
    except ImportError:
        root = None
    if root and os.path.isfile(os.path.join(root, "bin", "ptxas")):
        return os.path.join(root, "bin", "ptxas")
    return shutil.which("ptxas")


@functools.cache
def ptx_accepted(version: str, arch: str) -> bool:
    """Whether that ptxas accepts PTX of `version` (the ".version X.Y" NVRTC writes) for
    `arch`: an empty kernel assembled once per process (a few milliseconds). NVRTC may be newer
    than the ptxas JAX ships with ("Unsupported .version"), which would fail only when XLA first
    ran the computation: such calls keep the Python handler (which launches NVRTC's CUBIN)."""
    ptxas = _ptxas()
    if ptxas is None:
        return False
    probe = (f".version {version}\n.target {arch}\n.address_size 64\n"
             ".visible .entry probe()\n{\n  ret;\n}\n")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        source, image = os.path.join(folder, "probe.ptx"), os.path.join(folder, "probe.cubin")
        with open(source, "w") as f:
            f.write(probe)
        try:
            done = subprocess.run([ptxas, f"-arch={arch}", source, "-o", image],
                                  capture_output=True, timeout=60)  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return False
    return done.returncode == 0


def _ptx_version(ptx: str) -> str | None:
    found = re.search(r"^\.version\s+(\d+\.\d+)", ptx, re.M)
    return found[1] if found else None


def native_run(prep, present: list[bool], scalars: tuple, device: int, out_types,
               single: bool = False):  # fmt: skip
    """run(*inputs) -> outputs launched natively on GPUs like `device` (single: on `device`,
    the only GPU JAX sees), or None (the call keeps the Python handler)."""
    if not enabled() or errors.checking():  # RTCINFER_CHECK=1 waits after each call
        return None
    steps = record(prep, present, scalars, device)
    if not steps:
        return None
    native = plan(prep, present, steps, constants=single)
    if native is None:
        return None
    arch = jit.device_arch(device)
    try:
        steps = materialize(native, arch)
    except jit.CacheMissError:  # RTCINFER_NO_COMPILE=1: the handler launches the cached CUBIN
        return None
    return None if steps is None else lower(prep, present, steps, out_types)


__all__ = ["NativeLaunch", "Step", "enabled", "lower", "materialize", "native_run", "plan",
           "record"]  # fmt: skip
