"""Where the compiler's inputs come from, and their fingerprint for the kernel cache key.

The runtime headers kernels include (cuda_fp16.h, cuda_bf16.h, cuda_fp8.h) come from the CUDA
runtime wheel (found with cuda.pathfinder) or CUDA_HOME; NVRTC lies beside them (cuda13) or in
the cuda_nvrtc wheel (cuda12). The fingerprint hashes what they hold, not where they lie, so a
reinstalled, copied or moved toolchain keeps its cache.

A warm start must not pay for finding and hashing them (cuda.pathfinder alone costs tens of
milliseconds): the header folder, the files fingerprinted and the fingerprint are remembered
in the cache folder per Python environment, and reused while every one of those files has
the size and modification time it had (a stat each).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path

from . import __version__

HEADERS = ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp", "cuda_fp8.h",
           "cuda_fp8.hpp")  # fmt: skip


def cache_dir() -> Path:
    """RTCINFER_CACHE_DIR (an empty value counts as unset), else ~/.cache/rtcinfer; absolute."""
    return Path(os.environ.get("RTCINFER_CACHE_DIR") or "~/.cache/rtcinfer").expanduser().absolute()


@functools.cache
def header_dir() -> str:
    """Directory holding cuda_fp16.h / cuda_bf16.h / cuda_fp8.h (the CUDA runtime wheel)."""
    memo = _memo()
    if memo is not None:
        return memo["header_dir"]
    return _find_header_dir()


def _find_header_dir() -> str:
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
    except Exception:  # noqa: BLE001 - any failure falls through to CUDA_HOME
        found = None
    if found is None:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        if home and (Path(home) / "include" / "cuda_fp16.h").exists():
            found = str(Path(home) / "include")
    if found is None:
        raise RuntimeError(
            "CUDA headers not found: install rtcinfer[cuda13] (or [cuda12]) or set CUDA_HOME"
        )
    return found


@functools.cache
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def _sample_digest(path: Path, chunk: int = 1 << 16) -> str:
    """Size and a hash of three 64 KB slices (start, middle, end) of a large file: another
    build of a library differs there, and reading 192 KB costs well under a millisecond."""
    size = path.stat().st_size
    digest = hashlib.blake2b(digest_size=8)
    with path.open("rb") as f:
        for at in (0, max(0, size // 2 - chunk // 2), max(0, size - chunk)):
            f.seek(at)
            digest.update(f.read(chunk))
    return f"{size}:{digest.hexdigest()}"


def _nvrtc_libraries(root: Path) -> list[Path]:
    return sorted(
        [*root.parent.glob("lib*/*nvrtc*"), *root.parent.parent.glob("cuda_nvrtc/lib*/*nvrtc*")]
    )


@functools.cache
def fingerprint() -> str:
    """The package version, the contents of the runtime headers kernels include and the NVRTC
    libraries' names, sizes and sampled contents (or, when none is found beside the headers,
    NVRTC's version): what the cache key needs to know of the toolchain."""
    root = header_dir()
    memo = _memo()
    if memo is not None and memo["header_dir"] == root:
        return memo["fingerprint"]
    folder = Path(root)
    digest = hashlib.blake2b(digest_size=16)
    files = []
    for name in HEADERS:
        path = folder / name
        if path.exists():
            digest.update(name.encode() + b"\0" + path.read_bytes())
            files.append(path)
    libs = _nvrtc_libraries(folder)
    parts = [__version__, digest.hexdigest(), *(f"{f.name}:{_sample_digest(f)}" for f in libs)]
    if not libs:
        parts.append(nvrtc_version())
    result = "|".join(parts)
    _remember(root, files + libs, result)
    return result


def _memo_path() -> Path:
    """The memo of this Python environment (its prefix and this package's location)."""
    where = f"{sys.prefix}\0{Path(__file__).resolve().parent}\0{__version__}"
    return (
        cache_dir()
        / "toolchain"
        / f"{hashlib.blake2b(where.encode(), digest_size=8).hexdigest()}.json"
    )


def _stat(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def _memo() -> dict | None:
    """The remembered toolchain, if every file it was computed from is unchanged."""
    try:
        memo = json.loads(_memo_path().read_text())
        if memo.get("env") != [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]:
            return None
        if all(_stat(path) == stat for path, stat in memo["files"]):
            return memo
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _remember(root: str, files: list[Path], result: str) -> None:
    """Best effort: a cache folder that cannot be written only costs the next start."""
    memo = {
        "header_dir": root,
        "fingerprint": result,
        "env": [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")],
        "files": [[str(f), _stat(f)] for f in files],
    }
    path = _memo_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, path)
    except OSError:
        pass


def forget() -> None:
    """Drop what this process and the memo know (tests; a toolchain changed in place is found
    by the memo's stat check anyway)."""
    header_dir.cache_clear()
    fingerprint.cache_clear()
    _memo_path().unlink(missing_ok=True)


__all__ = ["HEADERS", "cache_dir", "fingerprint", "forget", "header_dir", "nvrtc_version"]
