"""Spec -> expanded source -> NVRTC -> CUBIN (disk cache) -> loaded kernel.

A spec is a frozen dataclass holding a kernel family's compile-time choices. It names its
source file (`source`, in `cuda_src/`) and entry points (`kernels`), and renders the generated
prelude (`prelude()`: constexpr values and type aliases). Everything else is a kernel argument.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import os
import re
import shlex
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from . import gpu, params
from .interop.dtypes import cuda_type
from .params import StructLayout
from .toolchain import cache_dir, fingerprint, header_dir, nvrtc_version

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_MAGIC = b"RTCI1\n"


class CompileError(RuntimeError):
    """NVRTC rejected a kernel; carries the compiler log and the dumped source path."""

    def __init__(self, spec, log: str, source_path: Path):
        super().__init__(f"NVRTC failed to compile {spec!r}\nsource: {source_path}\n{log}")
        self.log = log
        self.source_path = source_path


class CacheMissError(RuntimeError):
    """RTCINFER_NO_COMPILE=1 is set and the kernel is not in the disk cache."""


@dataclass(frozen=True)
class Compiled:
    spec: object
    arch: str
    cubin: bytes  # the image: a CUBIN, or PTX text for a virtual (compute_XX) arch
    path: Path
    meta: dict  # spec, arch, nvrtc, compile_seconds, resources (per-kernel ptxas report)
    cache_hit: bool


def prelude(**entries: str | int | bool | enum.Enum | type[enum.Enum]) -> str:
    """A spec's generated lines, in order: a dtype name (str) becomes `using NAME = <CUDA
    type>;`, a bool `constexpr bool NAME = true|false;`, an int `constexpr int NAME = N;`, an
    enum member `constexpr Kind NAME = Kind::MEMBER;` after the declaration of its enum class,
    generated from the Python enum (names and values cross the seam together); an enum class
    itself (`Kind=Kind`) only its declaration, for code that names its members."""
    lines, declared = [], set()

    def declare(kind: type[enum.Enum]) -> None:
        if kind not in declared:
            declared.add(kind)
            members = ", ".join(f"{m.name} = {int(m.value)}" for m in kind)
            lines.append(f"enum class {kind.__name__} : int {{ {members} }};")

    for name, value in entries.items():
        if isinstance(value, type) and issubclass(value, enum.Enum):
            declare(value)
        elif isinstance(value, enum.Enum):
            declare(type(value))
            kind = type(value).__name__
            lines.append(f"constexpr {kind} {name} = {kind}::{value.name};")
        elif isinstance(value, str):
            lines.append(f"using {name} = {cuda_type(value)};")
        elif isinstance(value, bool):
            lines.append(f"constexpr bool {name} = {str(value).lower()};")
        else:
            lines.append(f"constexpr int {name} = {int(value)};")
    return "\n".join(lines)


def source_root():
    """Folder of the kernel sources (the installed `rtcinfer.cuda_src` package)."""
    return resources.files("rtcinfer.cuda_src")


def _expand(name: str, seen: set[str]) -> str:
    """The text of cuda_src/`name` with our own includes inlined, each file once. An include
    is looked up beside the including file first (a family's folder), then in cuda_src/."""
    if name in seen:
        return ""
    seen.add(name)
    text = (source_root() / name).read_text()
    folder = name.rpartition("/")[0]

    def include(match) -> str:
        beside = f"{folder}/{match.group(1)}" if folder else match.group(1)
        return _expand(beside if (source_root() / beside).is_file() else match.group(1), seen)

    return _INCLUDE.sub(include, text)


def expand_source(spec) -> str:
    """common.cuh, then the spec's generated prelude, then its .cu file, own includes inlined."""
    seen: set[str] = set()
    return "\n".join([_expand("common.cuh", seen), spec.prelude(), _expand(spec.source, seen)])


@functools.cache
def _struct_layout(source: str, name: str) -> StructLayout:
    return params.struct_layout(_expand("common.cuh", set()) + _expand(source, set()), name)


def struct_layout(spec, name: str) -> StructLayout:
    """Layout of struct `name` as declared in the spec's sources (its .cu and headers)."""
    return _struct_layout(spec.source, name)


def source_layout(source: str, name: str) -> StructLayout:
    """Layout of struct `name` as declared in cuda_src/`source` and the headers it includes."""
    return _struct_layout(source, name)


_HEADERS_FLAG = (
    "-I<cuda headers>"  # where the headers lie is not part of the key; what they hold is
)


def _options(arch: str) -> list[str]:
    """NVRTC's options with the header folder left as a placeholder (the key's form). A
    virtual target (compute_XX: PTX, no ptxas run) gets no ptxas report and no line table."""
    cubin = arch.startswith("sm_")
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "-default-device",
            *(["-lineinfo", "-Xptxas=-v"] if cubin else []), _HEADERS_FLAG]  # fmt: skip
    return opts + shlex.split(os.environ.get("RTCINFER_NVRTC_FLAGS", ""))


def compile_options(arch: str) -> list[str]:
    """NVRTC's options for `arch`, the header folder included."""
    include = f"-I{header_dir()}"
    return [include if o == _HEADERS_FLAG else o for o in _options(arch)]


def spec_name(spec) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", repr(spec))[:120]


def _entry_path(spec, source: str, arch: str) -> Path:
    key = hashlib.sha256("\0".join([source, *_options(arch), arch, fingerprint()]).encode())
    key = key.hexdigest()
    return cache_dir() / arch / f"{type(spec).__name__}-{key[:24]}.rtci"


def read_entry(path: Path) -> tuple[dict, bytes] | None:
    """(meta, image) of a cache entry (a CUBIN, or PTX text for a compute_XX target), or None
    when it is missing, truncated or corrupt."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    head = len(_MAGIC) + 32 + 4
    if len(blob) < head or not blob.startswith(_MAGIC):
        return None
    digest = blob[len(_MAGIC) : len(_MAGIC) + 32]
    payload = blob[head:]
    if hashlib.sha256(payload).digest() != digest:
        return None
    n = int.from_bytes(blob[head - 4 : head], "little")
    try:
        meta = json.loads(payload[:n])
    except ValueError:
        return None
    image = payload[n:]
    return (meta, image) if image.startswith((b"\x7fELF", b"//")) else None  # CUBIN or PTX


@functools.cache
def _umask() -> int:
    """The process umask, read without changing it where /proc allows."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_entry(path: Path, meta: dict, cubin: bytes) -> None:
    """Atomic: a temp file in the same folder, then os.replace; readable as a plain file would
    be (0666 less the umask: a cache warmed by one user serves another). Best effort: a cache
    that cannot be written (read-only, removed meanwhile) warns and the CUBIN is used anyway."""
    header = json.dumps(meta).encode()
    payload = header + cubin
    blob = _MAGIC + hashlib.sha256(payload).digest() + len(header).to_bytes(4, "little") + payload
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        warnings.warn(f"rtcinfer: kernel cache not written ({e})", RuntimeWarning, stacklevel=3)
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


_PTXAS_FUNC = re.compile(r"Compiling entry function '(\w+)'")
_PTXAS_PROPS = re.compile(r"Function properties for (\w+)")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """Per entry point: registers, stack, spill_stores, spill_loads, smem (static bytes); a
    device function that was not inlined has its own stack, spill_stores and spill_loads (its
    properties follow an entry's in the log and are not that entry's)."""
    out: dict[str, dict[str, int]] = {}
    current = props = None  # the entry compiled, the function whose properties follow
    for line in log.splitlines():
        if m := _PTXAS_FUNC.search(line):
            current = out.setdefault(m.group(1), {"registers": 0, "stack": 0, "smem": 0})
        elif m := _PTXAS_PROPS.search(line):
            props = out.setdefault(m.group(1), {"stack": 0})
        elif props is not None and (m := _PTXAS_STACK.search(line)):
            props.update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        elif current is not None and (m := _PTXAS_REGS.search(line)):
            current["registers"] = int(m[1])
            if s := _PTXAS_SMEM.search(line):
                current["smem"] = int(s[1])
    return out


def _nvrtc(source: str, name: str, options: list[str],
           ptx: bool = False) -> tuple[bytes | None, str]:  # fmt: skip
    """NVRTC's CUBIN of `source` (its PTX when `ptx`: for a compute_XX target) and its log;
    None and the log when it does not compile."""
    from cuda.bindings import nvrtc

    _, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    try:
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(size)  # written by NVRTC: never a shared bytes object
        nvrtc.nvrtcGetProgramLog(prog, log)
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return None, log.decode(errors="replace").rstrip("\0")
        get_size, get = ((nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if ptx else
                         (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN))  # fmt: skip
        _, size = get_size(prog)
        image = bytearray(size)
        get(prog, image)
        image = bytes(image).rstrip(b"\0") if ptx else bytes(image)  # PTX: NUL-terminated
        return image, log.decode(errors="replace").rstrip("\0")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_spec(spec, arch: str) -> Compiled:
    """CUBIN of `spec` for `arch` (e.g. "sm_90a"), from the disk cache or compiled now."""
    return _cached_or_compiled(spec, expand_source(spec), spec_name(spec), arch)


def compile_ptx(spec, source: str, name: str, arch: str) -> str:
    """PTX of `source`, a variant of `spec`'s source (rtcinfer/flat_entry.py), for the virtual
    target of `arch` ("sm_90a": compute_90a), from the disk cache or compiled now."""
    target = arch.replace("sm_", "compute_", 1)
    return _cached_or_compiled(spec, source, name, target).cubin.decode()


def _cached_or_compiled(spec, source: str, name: str, arch: str) -> Compiled:
    """The cache entry of `source` for `arch` (a CUBIN for sm_XX, PTX for compute_XX), or
    NVRTC's output, written to the cache; RTCINFER_NO_COMPILE=1 makes a miss raise."""
    path = _entry_path(spec, source, arch)
    if (entry := read_entry(path)) is not None:
        return Compiled(spec, arch, entry[1], path, entry[0], cache_hit=True)
    if os.environ.get("RTCINFER_NO_COMPILE") == "1":
        raise CacheMissError(f"RTCINFER_NO_COMPILE=1 and {spec!r} for {arch} is not cached")
    if os.environ.get("RTCINFER_DUMP_SOURCE") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".cu").write_text(source)
    start = time.perf_counter()
    image, log = _nvrtc(source, name, compile_options(arch), ptx=arch.startswith("compute_"))
    seconds = time.perf_counter() - start
    if image is None:
        dump = cache_dir() / "failed" / f"{path.stem}.cu"
        try:
            dump.parent.mkdir(parents=True, exist_ok=True)
            dump.write_text(source)
        except OSError:  # the compiler's log matters more than the dumped source
            dump = Path(tempfile.gettempdir()) / "(source not written)"
        raise CompileError(spec, log, dump)
    meta = {
        "spec": repr(spec),
        "arch": arch,
        "nvrtc": nvrtc_version(),
        "compile_seconds": round(seconds, 4),
        "resources": parse_ptxas_log(log),
    }
    _write_entry(path, meta, image)
    return Compiled(spec, arch, image, path, meta, cache_hit=False)


@functools.cache
def _module(spec, device_id: int):
    import cupy

    with cupy.cuda.Device(device_id):
        compiled = compile_spec(spec, gpu.compile_arch(device_id))
        module = cupy.cuda.function.Module()
        module.load(compiled.cubin)
    return module


def get_function(spec, name: str, device_id: int | None = None, dynamic_smem: int = 0):
    """The loaded kernel `name` of `spec` on a device (default: the current one).

    Compiles (or reads the disk cache) and loads once per (spec, device). `dynamic_smem` is the
    dynamic shared memory the caller will launch with: the function's limit is raised to the
    largest size asked for so far (the default limit is 48 KB less the static shared memory, so
    even a size below 48 KB may need it), never lowered under an earlier caller.
    """
    if device_id is None:
        device_id = gpu.current()
    key = (spec, name, device_id)
    loaded = _FUNCTIONS.get(key)
    if loaded is None or dynamic_smem > loaded.smem_limit:
        with _LOCK:  # threads asking together: one compile and load, a limit that only rises
            loaded = _FUNCTIONS.get(key)
            if loaded is None:
                loaded = _FUNCTIONS[key] = _Loaded(_module(spec, device_id).get_function(name))
            if dynamic_smem > loaded.smem_limit:
                from cupy_backends.cuda.api import driver

                attr = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                driver.funcSetAttribute(loaded.fn.ptr, attr, dynamic_smem)
                loaded.smem_limit = dynamic_smem
    return loaded.fn


def preload(spec, device_id: int | None = None) -> None:
    """Compile (or read from the cache) and load a spec's module and its `kernels` now, e.g.
    at trace time, so that no launch ever loads a module while a CUDA graph is being captured."""
    for name in spec.kernels:
        get_function(spec, name, device_id)


@dataclass
class _Loaded:
    fn: object  # cupy.cuda.Function
    smem_limit: int = 0  # the dynamic shared-memory limit set on it (0: the default)


_FUNCTIONS: dict[tuple, _Loaded] = {}  # (spec, kernel name, device) -> loaded function
_LOCK = threading.Lock()


@functools.cache
def sm_count(device_id: int) -> int:
    """Streaming multiprocessors of a device (for persistent grids and the split-KV planner)."""
    runtime = gpu.runtime()
    return runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device_id)


@functools.cache
def device_arch(device_id: int) -> str:
    """The compile target of a device (gpu.compile_arch, asked once per process)."""
    return gpu.compile_arch(device_id)


@functools.cache
def device_limits(device_id: int) -> tuple[int, int]:
    """(SM count, opt-in shared memory per block) of a device."""
    runtime = gpu.runtime()
    smem = runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id)
    return sm_count(device_id), smem


@functools.cache
def occupancy(fn, threads: int, dynamic_smem: int = 0) -> int:
    """CTAs of a loaded kernel that fit on one SM at once (for persistent grids)."""
    from cupy_backends.cuda.api import driver

    return driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, threads, dynamic_smem)
