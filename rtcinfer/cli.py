"""`rtcinfer` command line: show-config, list-modules, warmup, clear-cache, demo."""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from . import __version__, catalog, gpu, jit


def gpu_arch() -> str | None:
    """Compile target of the current GPU; None when there is none (no CUDA extra, driver or
    device). A GPU that is there but cannot be used raises gpu.GpuUnavailable."""
    try:
        return gpu.compile_arch(gpu.current())
    except (gpu.NoGpuFound, gpu.CudaExtraMissing):
        return None


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


# What the cache writes: entries (and their temp files, and dumped sources) in one folder per
# arch (sm_XX: CUBIN; compute_XX: the PTX of JAX's native launches), and the sources of failed
# compiles in failed/. Nothing else in the folder is ours.
_OURS = re.compile(r"\w+-[0-9a-f]{24}\.(rtci|cu|rtci\w*\.tmp)")


def _cache_files(pattern: str = "*") -> list:
    root = jit.cache_dir()
    if not root.is_dir():
        return []
    files = [*root.glob(f"sm_*/{pattern}"), *root.glob(f"compute_*/{pattern}"),
             *root.glob(f"failed/{pattern}")]  # fmt: skip
    return sorted(p for p in files if p.is_file() and _OURS.fullmatch(p.name))


def _cache_entries():
    return _cache_files("*.rtci")


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def show_config(args) -> int:
    rows = [
        ("rtcinfer", __version__),
        ("python", platform.python_version()),
        ("numpy", _version("numpy")),
        (
            "cupy",
            next(
                (
                    _version(d)
                    for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy")
                    if _version(d) != "not installed"
                ),
                "not installed",
            ),
        ),  # fmt: skip
        ("cuda-bindings", _version("cuda-bindings")),
    ]
    try:
        rows += [("nvrtc", jit.nvrtc_version()), ("cuda headers", jit.header_dir())]
    except Exception as e:  # noqa: BLE001 - report, don't fail
        rows.append(("nvrtc", f"unavailable ({e})"))
    try:
        arch = gpu_arch()
    except gpu.GpuUnavailable as e:
        arch = None
        rows.append(("gpu", f"unusable: {e}"))
    if arch:
        import cupy

        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        rows += [
            ("gpu", f"{props['name'].decode()} (device {dev.id})"),
            ("arch", arch),
            ("SMs", str(jit.sm_count(dev.id))),
            ("driver", str(cupy.cuda.runtime.driverGetVersion())),
        ]
    elif not any(k == "gpu" for k, _ in rows):
        rows.append(("gpu", "none visible"))
    entries = _cache_entries()
    total = sum(p.stat().st_size for p in entries)
    rows.append(("cache", f"{jit.cache_dir()} ({len(entries)} modules, {_size(total)})"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def list_modules(args) -> int:
    entries = _cache_entries()
    if not entries:
        print(f"no cached modules in {jit.cache_dir()}")
        return 0
    for path in entries:
        entry = jit.read_entry(path)
        if entry is None:
            print(f"{path.name}  (corrupt: rebuilt on next use)")
            continue
        meta = entry[0]
        size, secs = _size(path.stat().st_size), meta["compile_seconds"]
        print(f"{meta['arch']:<7} {size:>9} {secs:7.3f} s  {meta['spec']}")
    print(f"{len(entries)} modules in {jit.cache_dir()}")
    return 0


def _check_writable(folder: Path) -> None:
    """Raise OSError, one line naming the folder and the reason, unless files can be written
    there (the cache's own writes only warn: a library call still runs without a cache)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise OSError(f"cannot write the kernel cache at {folder}: {e.strerror or e}") from None


def warmup(args) -> int:
    if args.arch is not None and not re.fullmatch(r"sm_\d+a?", args.arch):
        raise ValueError(f"--arch must look like sm_90a or sm_80, got {args.arch!r}")
    gpu.require_cuda_wheels()  # NVRTC and the CUDA headers come with the extra
    here = gpu_arch() if args.arch is None else None
    arch = args.arch or here or "sm_90a"
    # This GPU's shared memory per block when compiling for it, else the catalog's for the arch
    on = catalog.target(arch, jit.device_limits(gpu.current())[1] if here else None)
    _check_writable(jit.cache_dir() / arch)
    kv_dtype = args.kv_dtype or args.dtype
    specs = catalog.model_specs(args.model, args.dtype, kv_dtype, on)
    os.environ.pop("RTCINFER_NO_COMPILE", None)  # warming up is compiling
    print(
        f"warming up {len(specs)} modules for {args.model} ({args.dtype}, KV {kv_dtype}) on "
        f"{arch} ({on.max_smem // 1024} KB of shared memory per block)"
    )
    start, compiled = time.perf_counter(), 0
    for i, spec in enumerate(specs, 1):
        t = time.perf_counter()
        result = jit.compile_spec(spec, arch)
        compiled += not result.cache_hit
        state = "cached" if result.cache_hit else "compiled"
        print(f"[{i}/{len(specs)}] {state:8} {time.perf_counter() - t:6.3f} s  {spec!r}")
    total = sum(p.stat().st_size for p in _cache_entries())
    print(
        f"done: {len(specs)} modules ({compiled} compiled, {len(specs) - compiled} cached) in "
        f"{time.perf_counter() - start:.2f} s; cache {_size(total)} at {jit.cache_dir()}"
    )
    return 0


def clear_cache(args) -> int:
    """Delete what the cache wrote (see _OURS, and the toolchain memos: toolchain.py), then its
    folders if that left them empty."""
    root = jit.cache_dir()
    n = len(_cache_entries())
    for path in _cache_files():
        path.unlink(missing_ok=True)
    for path in (root / "toolchain").glob("*.json"):
        path.unlink(missing_ok=True)
    for path in root.glob("python-*/*"):  # generated Python code (interop/generated.py)
        if re.fullmatch(r"[0-9a-f]{32}\.code(\.\d+\.tmp)?", path.name):
            path.unlink(missing_ok=True)
    for folder in (
        [*root.glob("sm_*"), *root.glob("compute_*"), *root.glob("python-*"), root / "failed",
         root / "toolchain"]
        if root.is_dir()
        else []
    ):  # fmt: skip
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    print(f"removed {n} modules from {root}")
    return 0


def demo(args) -> int:
    from .demo import run_demo

    try:  # without the CUDA extra this raises gpu.CudaExtraMissing: the pip command
        arch = gpu.compile_arch(gpu.current())
    except gpu.NoGpuFound as e:
        print(e)
        arch = None
    return run_demo(arch)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="rtcinfer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"rtcinfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("show-config", help="versions, GPU and arch, NVRTC, headers, cache")
    sub.add_parser("list-modules", help="cached kernels: arch, size, compile time, spec")
    w = sub.add_parser("warmup", help="precompile the kernels a model's serving loop launches "
                       "(no GPU needed)")  # fmt: skip
    w.add_argument("--model", required=True, choices=sorted(catalog.MODELS))
    w.add_argument("--arch", help="compile target, e.g. sm_90a (default: this GPU, else sm_90a)")
    w.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    w.add_argument("--kv-dtype", choices=["float8_e4m3fn", "float8_e5m2"],
                   help="the paged KV cache's dtype (default: --dtype)")  # fmt: skip
    sub.add_parser("clear-cache", help="delete every cached kernel")
    sub.add_parser("demo", help="run the ops against float64 references on the GPU, with timings")
    args = parser.parse_args(argv)
    command = {
        "show-config": show_config,
        "list-modules": list_modules,
        "warmup": warmup,
        "clear-cache": clear_cache,
        "demo": demo,
    }[args.command]
    try:
        return command(args)
    except (gpu.GpuUnavailable, jit.CompileError, jit.CacheMissError, OSError, ValueError) as e:
        print(f"rtcinfer {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
