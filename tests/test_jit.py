"""The runtime compiler without a GPU: every shipped spec builds, the cache is sound."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from rtcinfer import catalog, jit, toolchain
from tests import sass

ARCHS = ["sm_80", "sm_90a"]


def _targets():
    """(spec, arch) for every shipped spec and every arch it supports (min_sm: clusters)."""
    for spec in catalog.shipped_specs():
        for arch in ARCHS:
            if int(arch[3:5]) >= getattr(spec, "min_sm", 0):
                yield pytest.param(spec, arch, id=f"{spec!r}-{arch}")


@pytest.mark.parametrize("spec,arch", list(_targets()))
def test_shipped_spec_compiles_without_spills(spec, arch):
    """No spills, except in a kernel whose registers are capped for occupancy (`min_ctas`):
    there a few bytes, and no spill instruction inside a loop."""
    compiled = jit.compile_spec(spec, arch)
    assert compiled.cubin.startswith(b"\x7fELF")
    assert set(spec.kernels) <= set(compiled.meta["resources"]), "declared kernels missing"
    for kernel, usage in compiled.meta["resources"].items():
        if getattr(spec, "min_ctas", 0):
            assert usage["spill_stores"] + usage["spill_loads"] <= 64, (kernel, usage)
            assert usage["stack"] <= 16, (kernel, usage)
            tool = sass.nvdisasm()
            if tool is None:  # the cuda13 extra installs it; CUDA 12's wheels do not ship it
                pytest.skip("nvdisasm is not installed")
            text = sass.function_text(sass.disassemble(compiled.cubin, tool), kernel)
            assert sass.loops(text), "the kernel's loops were not found"
            assert not sass.local_accesses_in_loops(text), (kernel, usage)
            continue
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (kernel, usage)
        assert usage["stack"] == 0, (kernel, usage)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("q_dtype, kv_dtype, head_dim", [
    ("bfloat16", "float8_e4m3fn", 128), ("float16", "float8_e5m2", 64),
    ("bfloat16", "float8_e4m3fn", 256)])  # fmt: skip
def test_prefill_reading_fp8_from_the_ring_compiles_without_spills(arch, q_dtype, kv_dtype,
                                                                   head_dim):  # fmt: skip
    """The 16-row prefill kernel over fp8 K/V reads it from the ring (fp8_direct, the default)
    and builds unspilled, with no staging tiles in its shared memory; 128-key tiles up to
    head_dim 128."""
    from rtcinfer.attention.prefill_kernel import prefill_spec

    spec = prefill_spec(q_dtype, q_dtype, head_dim, 16, kv_dtype=kv_dtype)
    assert spec == prefill_spec(q_dtype, q_dtype, head_dim, 16, kv_dtype=kv_dtype,
                                fp8_direct=True)  # fmt: skip
    widened = prefill_spec(q_dtype, q_dtype, head_dim, 16, kv_dtype=kv_dtype, fp8_direct=False)
    assert spec.fp8_direct and not widened.fp8_direct and (spec.stages, widened.stages) == (3, 2)
    assert spec.kv_tile == (128 if head_dim <= 128 else 64) and widened.kv_tile == 64
    ring, table = 3 * 2 * spec.kv_tile * head_dim, 2 * 2 * spec.kv_tile * 8  # no staging tiles
    assert spec.smem_bytes == 16 * head_dim * 2 + ring + table + 16
    usage = jit.compile_spec(spec, arch).meta["resources"]["prefill_kernel"]
    assert usage["spill_stores"] == usage["spill_loads"] == usage["stack"] == 0, usage
    with pytest.raises(ValueError, match="fp8_direct with 64-row tiles"):
        prefill_spec(q_dtype, q_dtype, head_dim, 64, kv_dtype=kv_dtype, fp8_direct=True)


@dataclass(frozen=True)
class ToySpec:
    value: int = 1
    body: str = "x[threadIdx.x] = float(VALUE);"
    source: ClassVar[str] = "toy.cu"

    def prelude(self) -> str:
        return f"constexpr int VALUE = {self.value};"


@pytest.fixture
def toy_sources(tmp_path, monkeypatch):
    """A private copy of the kernel sources with a tiny toy.cu next to common.cuh."""
    root = tmp_path / "src"
    shutil.copytree(jit.source_root(), root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "toy.cu").write_text(
        '#include "common.cuh"\n#include "toy.cuh"\n'
        'extern "C" __global__ void toy(float* x) { TOY_BODY }\n'
    )
    (root / "toy.cuh").write_text("#pragma once\n#define TOY_BODY x[threadIdx.x] = float(VALUE);\n")
    monkeypatch.setattr(jit, "source_root", lambda: root)
    return root


def test_cache_hit_after_compile(cache_dir, toy_sources):
    first = jit.compile_spec(ToySpec(), "sm_90a")
    second = jit.compile_spec(ToySpec(), "sm_90a")
    assert not first.cache_hit and second.cache_hit
    assert first.cubin == second.cubin and first.path == second.path
    assert first.path.is_relative_to(cache_dir)
    assert second.meta["spec"] == repr(ToySpec())


def test_key_covers_included_headers(cache_dir, toy_sources):
    before = jit.compile_spec(ToySpec(), "sm_90a").path
    (toy_sources / "toy.cuh").write_text("#pragma once\n#define TOY_BODY x[0] = 2.f * VALUE;\n")
    after = jit.compile_spec(ToySpec(), "sm_90a")
    assert after.path != before and not after.cache_hit


def test_key_covers_spec_arch_and_flags(cache_dir, toy_sources, monkeypatch):
    base = jit.compile_spec(ToySpec(), "sm_90a").path
    assert jit.compile_spec(ToySpec(value=2), "sm_90a").path != base
    assert jit.compile_spec(ToySpec(), "sm_80").path != base
    monkeypatch.setenv("RTCINFER_NVRTC_FLAGS", "-DEXTRA=1")
    assert jit.compile_spec(ToySpec(), "sm_90a").path != base


def test_key_follows_header_contents_not_their_place(cache_dir, toy_sources, tmp_path,
                                                     monkeypatch):  # fmt: skip
    """The same headers copied elsewhere (a reinstall, a moved venv) keep the key; a changed
    header changes it."""

    def key_with_headers(folder):
        monkeypatch.setattr(toolchain, "header_dir", lambda: str(folder))
        toolchain.fingerprint.cache_clear()
        source = jit.expand_source(ToySpec())
        return jit._entry_path(ToySpec(), source, "sm_90a")

    original = toolchain.header_dir()
    try:
        copies = [tmp_path / "a" / "include", tmp_path / "b" / "include"]
        for copy in copies:  # the fingerprinted headers are all the key reads
            copy.mkdir(parents=True)
            for name in toolchain.HEADERS:
                shutil.copy2(Path(original) / name, copy / name)
        first, moved = key_with_headers(copies[0]), key_with_headers(copies[1])
        assert first == moved
        (copies[1] / "cuda_fp16.hpp").write_text("// another version\n")
        assert key_with_headers(copies[1]) != first
    finally:
        toolchain.fingerprint.cache_clear()


def test_a_warm_start_reuses_the_remembered_toolchain(cache_dir, monkeypatch):
    """The second process of an environment finds the header folder and the fingerprint in
    the memo (no cuda.pathfinder, no hashing) while the files are unchanged; a changed file
    (its size or time) makes it look again."""
    toolchain.forget()
    first = toolchain.fingerprint()
    folder = toolchain.header_dir()
    toolchain.header_dir.cache_clear()
    toolchain.fingerprint.cache_clear()
    monkeypatch.setattr(toolchain, "_find_header_dir", lambda: pytest.fail("searched again"))
    assert toolchain.header_dir() == folder and toolchain.fingerprint() == first
    memo = toolchain._memo_path()
    text = memo.read_text()
    memo.write_text(text.replace('"files": [["', '"files": [["/nonexistent'))  # a file gone
    toolchain.header_dir.cache_clear()
    with pytest.raises(pytest.fail.Exception, match="searched again"):
        toolchain.header_dir()
    toolchain.forget()


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_corrupt_entry_is_rebuilt(cache_dir, toy_sources, damage):
    good = jit.compile_spec(ToySpec(), "sm_90a")
    blob = good.path.read_bytes()
    broken = {
        "truncate": blob[: len(blob) // 2],
        "flip": blob[:-10] + bytes([blob[-10] ^ 0xFF]) + blob[-9:],
        "empty": b"",
        "garbage": os.urandom(len(blob)),
    }[damage]
    good.path.write_bytes(broken)
    assert jit.read_entry(good.path) is None
    rebuilt = jit.compile_spec(ToySpec(), "sm_90a")
    assert not rebuilt.cache_hit and rebuilt.cubin == good.cubin
    assert jit.read_entry(good.path) is not None


def test_no_compile_raises_on_miss(cache_dir, toy_sources, monkeypatch):
    monkeypatch.setenv("RTCINFER_NO_COMPILE", "1")
    with pytest.raises(jit.CacheMissError, match="RTCINFER_NO_COMPILE"):
        jit.compile_spec(ToySpec(), "sm_90a")
    monkeypatch.delenv("RTCINFER_NO_COMPILE")
    jit.compile_spec(ToySpec(), "sm_90a")
    monkeypatch.setenv("RTCINFER_NO_COMPILE", "1")
    assert jit.compile_spec(ToySpec(), "sm_90a").cache_hit


def test_dump_source(cache_dir, toy_sources, monkeypatch):
    monkeypatch.setenv("RTCINFER_DUMP_SOURCE", "1")
    compiled = jit.compile_spec(ToySpec(), "sm_90a")
    dumped = compiled.path.with_suffix(".cu").read_text()
    assert "constexpr int VALUE = 1;" in dumped and "TOY_BODY" in dumped
    assert '#include "' not in dumped  # own headers are inlined


def test_compile_error_carries_log_and_source(cache_dir, toy_sources):
    with pytest.raises(jit.CompileError) as info:
        jit.compile_spec(ToySpec(body="", value="undefined_name"), "sm_90a")
    err = info.value
    assert "undefined_name" in err.log
    assert err.source_path.exists() and "undefined_name" in err.source_path.read_text()
    assert str(err.source_path) in str(err)


_COMPILE_IN_CHILD = """
import sys
from rtcinfer import jit
from tests.test_jit import ToySpec
jit.source_root = lambda: __import__("pathlib").Path(sys.argv[1])
c = jit.compile_spec(ToySpec(value=7), "sm_90a")
print(c.path, c.cache_hit)
"""


def test_two_processes_compiling_at_once(cache_dir, toy_sources):
    env = {**os.environ, "RTCINFER_CACHE_DIR": str(cache_dir)}
    cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [
        subprocess.Popen([sys.executable, "-c", _COMPILE_IN_CHILD, str(toy_sources)], env=env,
                         cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]  # fmt: skip
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    paths = {out.split()[0] for out, _ in results}
    assert len(paths) == 1
    assert jit.read_entry(jit.Path(paths.pop())) is not None
    assert not list(cache_dir.rglob("*.tmp"))


def test_parse_ptxas_log():
    log = (
        "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
        "ptxas info    : Function properties for k\n"
        "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 128 bytes smem\n"
    )
    assert jit.parse_ptxas_log(log) == {
        "k": {"registers": 40, "stack": 16, "smem": 128, "spill_stores": 8, "spill_loads": 4}
    }
    device_function = (  # not inlined: its properties come after the entry's, and are its own
        "ptxas info    : Function properties for _Z6helperPi\n"
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    )
    parsed = jit.parse_ptxas_log(log + device_function)
    assert parsed["k"]["spill_stores"] == 8 and parsed["_Z6helperPi"]["spill_stores"] == 0


def test_entries_are_readable_by_others_and_writes_are_best_effort(cache_dir, toy_sources,
                                                                   monkeypatch):  # fmt: skip
    """An entry gets a plain file's mode (0666 less the umask), so a cache warmed by one user
    serves another; a cache that cannot be written warns, and the CUBIN is used anyway."""
    import os
    import stat

    first = jit.compile_spec(ToySpec(value=5), "sm_90a")
    assert stat.S_IMODE(os.stat(first.path).st_mode) == 0o666 & ~jit._umask()

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(jit.tempfile, "mkstemp", refuse)
    with pytest.warns(RuntimeWarning, match="kernel cache not written .* Permission denied"):
        second = jit.compile_spec(ToySpec(value=6), "sm_90a")
    assert second.cubin.startswith(b"\x7fELF") and not second.path.exists()


def test_threads_asking_together_compile_and_load_once(monkeypatch):
    """The first calls of a kernel from several threads: one load, one function for all."""
    import threading
    import time as time_module

    loads = []

    class Module:
        def get_function(self, name):
            return type("Function", (), {"ptr": 99})()

    def slow_module(spec, device_id):
        loads.append(spec)
        time_module.sleep(0.05)
        return Module()

    monkeypatch.setattr(jit, "_module", slow_module)
    jit._FUNCTIONS.clear()
    try:
        got = []
        threads = [threading.Thread(target=lambda: got.append(jit.get_function(ToySpec(value=3),
                                                                               "toy", 0)))
                   for _ in range(8)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(loads) == 1 and len(got) == 8 and all(f is got[0] for f in got)
    finally:
        jit._FUNCTIONS.clear()


def test_dynamic_smem_limit_only_rises(monkeypatch):
    """get_function raises a kernel's dynamic shared-memory limit to the largest size asked for
    and never lowers it, whatever order the callers come in."""
    from cupy_backends.cuda.api import driver

    class Module:
        def get_function(self, name):
            return type("Function", (), {"ptr": 1234})()

    calls = []
    monkeypatch.setattr(jit, "_module", lambda spec, device_id: Module())
    monkeypatch.setattr(driver, "funcSetAttribute", lambda ptr, attr, v: calls.append((ptr, v)))
    jit._FUNCTIONS.clear()
    try:
        spec = ToySpec(value=77)
        fn = jit.get_function(spec, "toy", 0)
        assert calls == []  # no size asked for: the default limit stays
        assert jit.get_function(spec, "toy", 0, dynamic_smem=80_000) is fn
        jit.get_function(spec, "toy", 0, dynamic_smem=20_000)
        jit.get_function(spec, "toy", 0, dynamic_smem=80_000)
        assert calls == [(1234, 80_000)]
        jit.get_function(spec, "toy", 0, dynamic_smem=150_000)
        assert calls == [(1234, 80_000), (1234, 150_000)]
    finally:
        jit._FUNCTIONS.clear()
