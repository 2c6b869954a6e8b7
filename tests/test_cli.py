"""The command line without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rtcinfer import catalog, cli, jit
from tests.conftest import gpu_available


def test_help(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("show-config", "list-modules", "warmup", "clear-cache", "demo"):
        assert command in out


@pytest.fixture
def few_specs(monkeypatch):
    """warmup of a few of a model's specs (for the tests of the cache, not of what a model
    needs: tests/test_warmup.py); the arguments catalog.model_specs was called with are kept."""
    calls, real = [], catalog.model_specs

    def model_specs(*args):
        calls.append(args)
        return real(*args)[:5]

    monkeypatch.setattr(catalog, "model_specs", model_specs)
    return calls


def test_warmup_list_clear(cache_dir, capsys):
    """The whole warmup of a model with fp8 KV for sm_90a (the cluster samplers included): it
    compiles, without spills, then serves from the cache."""
    fp8 = "float8_e4m3fn"
    n = len(catalog.model_specs("llama3-8b", "bfloat16", fp8, catalog.target("sm_90a")))
    argv = ["warmup", "--model", "llama3-8b", "--arch", "sm_90a", "--kv-dtype", fp8]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"warming up {n} modules for llama3-8b (bfloat16, KV {fp8}) on "
                          "sm_90a (227 KB of shared memory per block)\n")  # fmt: skip
    assert f"done: {n} modules ({n} compiled, 0 cached)" in out and f"[{n}/{n}]" in out
    for family in (
        "PrefillSpec(",
        "DecodeSpec(",
        "ClusterSampleSpec(",
        "RenormSpec(",
        "MergeSpec(",
    ):
        assert family in out  # a model's serving loop prefills, decodes and samples
    for entry in cache_dir.rglob("*.rtci"):
        for kernel, usage in jit.read_entry(entry)[0]["resources"].items():
            assert usage["spill_stores"] == usage["spill_loads"] == 0, (entry.name, kernel)
    assert cli.main(argv) == 0
    assert f"(0 compiled, {n} cached)" in capsys.readouterr().out

    assert cli.main(["list-modules"]) == 0
    out = capsys.readouterr().out
    assert f"{n} modules in" in out and "NormSpec(op='rmsnorm'" in out and "sm_90a" in out

    assert cli.main(["show-config"]) == 0
    out = capsys.readouterr().out
    assert "nvrtc" in out and f"{n} modules" in out and str(cache_dir) in out

    assert cli.main(["clear-cache"]) == 0
    assert f"removed {n} modules" in capsys.readouterr().out
    assert not list(cache_dir.rglob("*.rtci"))


def test_warmup_takes_the_kv_dtype_and_the_archs_shared_memory(cache_dir, few_specs, capsys):
    argv = ["warmup", "--model", "qwen3-32b", "--arch", "sm_86", "--kv-dtype", "float8_e4m3fn"]
    assert cli.main(argv) == 0
    assert few_specs == [("qwen3-32b", "bfloat16", "float8_e4m3fn", catalog.target("sm_86"))]
    assert capsys.readouterr().out.startswith(
        "warming up 5 modules for qwen3-32b (bfloat16, KV float8_e4m3fn) on sm_86 (99 KB of "
    )
    with pytest.raises(SystemExit):
        cli.main(["warmup", "--model", "qwen3-32b", "--kv-dtype", "int8"])


def test_list_modules_flags_corrupt_entries(cache_dir, few_specs, capsys):
    cli.main(["warmup", "--model", "llama3-8b", "--arch", "sm_80"])
    victim = next(cache_dir.rglob("*.rtci"))
    victim.write_bytes(b"junk")
    capsys.readouterr()
    cli.main(["list-modules"])
    assert "corrupt" in capsys.readouterr().out
    assert jit.read_entry(victim) is None


def test_unknown_model_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["warmup", "--model", "gpt-17"])


@pytest.mark.skipif(gpu_available(), reason="the GPU demo runs in the gpu suite")
def test_demo_without_gpu_compiles_and_exits_zero(cache_dir, capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "rtcinfer needs an NVIDIA GPU and driver; none was found (" in out
    assert "4 modules ready" in out
    assert len(list(cache_dir.rglob("*.rtci"))) == 4


@pytest.mark.gpu
def test_demo_on_gpu(cache_dir, capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and out.count(" ok ") >= 4


def test_clear_cache_deletes_only_what_the_cache_wrote(cache_dir, few_specs, capsys):
    """The modules, a half-written entry and the toolchain memo go (a fresh process writes the
    memo: forget() makes this one do so too); files the cache did not write stay."""
    from rtcinfer import toolchain

    toolchain.forget()
    cli.main(["warmup", "--model", "llama3-8b", "--arch", "sm_80"])
    assert list((cache_dir / "toolchain").glob("*.json"))
    (cache_dir / "notes.txt").write_text("keep")
    (cache_dir / "data").mkdir()
    (cache_dir / "data" / "kernel.cu").write_text("keep")
    (cache_dir / "sm_80" / "README").write_text("keep")
    orphan = cache_dir / "sm_80" / "NormSpec-0123456789abcdef01234567.rtci8x_k2q.tmp"
    orphan.write_bytes(b"half written")
    capsys.readouterr()
    assert cli.main(["clear-cache"]) == 0
    assert "removed 5 modules" in capsys.readouterr().out
    left = sorted(str(p.relative_to(cache_dir)) for p in cache_dir.rglob("*") if p.is_file())
    assert left == ["data/kernel.cu", "notes.txt", "sm_80/README"]


def test_an_empty_cache_variable_means_the_default(monkeypatch):
    monkeypatch.setenv("RTCINFER_CACHE_DIR", "")
    assert jit.cache_dir() == Path("~/.cache/rtcinfer").expanduser()
    monkeypatch.setenv("RTCINFER_CACHE_DIR", "relative/cache")
    assert jit.cache_dir().is_absolute()


def test_errors_are_messages_with_exit_code_one(cache_dir, capsys):
    assert cli.main(["warmup", "--model", "llama3-8b", "--arch", "90a"]) == 1
    err = capsys.readouterr().err
    assert "rtcinfer warmup: error: --arch must look like sm_90a" in err and "Traceback" not in err


def test_warmup_compiles_even_with_no_compile_set(cache_dir, few_specs, monkeypatch, capsys):
    monkeypatch.setenv("RTCINFER_NO_COMPILE", "1")
    assert cli.main(["warmup", "--model", "llama3-8b", "--arch", "sm_80"]) == 0
    assert "(5 compiled, 0 cached)" in capsys.readouterr().out


# The base install: neither CuPy nor the CUDA wheels import.
_BASE_INSTALL_CLI = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cupy", "cupy_backends", "cuda"):
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
from rtcinfer.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "command", [["warmup", "--model", "llama3-8b", "--arch", "sm_80"], ["warmup", "--model",
                "llama3-8b"], ["demo"]]
)  # fmt: skip
def test_the_base_install_names_the_extra_to_install(command):
    done = subprocess.run([sys.executable, "-c", _BASE_INSTALL_CLI, *command],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith(f"rtcinfer {command[0]}: error: rtcinfer needs CuPy and the ")
    assert "pip install 'rtcinfer[cuda1" in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_the_base_install_still_shows_its_configuration():
    done = subprocess.run([sys.executable, "-c", _BASE_INSTALL_CLI, "show-config"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert "gpu" in done.stdout and "cache" in done.stdout


def test_warmup_into_a_cache_it_cannot_create_says_why(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    cache = tmp_path / "file" / "cache"  # under a file: not even root can create it
    monkeypatch.setenv("RTCINFER_CACHE_DIR", str(cache))
    assert cli.main(["warmup", "--model", "llama3-8b", "--arch", "sm_80"]) == 1
    captured = capsys.readouterr()
    expect = f"rtcinfer warmup: error: cannot write the kernel cache at {cache / 'sm_80'}: "
    assert captured.err == expect + "Not a directory\n" and captured.out == ""


@pytest.mark.skipif(
    getattr(os, "geteuid", lambda: 1)() == 0, reason="root writes into a read-only folder anyway"
)
def test_warmup_into_a_read_only_cache_says_why(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    (cache / "sm_80").mkdir(parents=True)
    (cache / "sm_80").chmod(0o500)
    monkeypatch.setenv("RTCINFER_CACHE_DIR", str(cache))
    try:
        assert cli.main(["warmup", "--model", "llama3-8b", "--arch", "sm_80"]) == 1
    finally:
        (cache / "sm_80").chmod(0o700)
    expect = f"rtcinfer warmup: error: cannot write the kernel cache at {cache / 'sm_80'}: "
    assert capsys.readouterr().err == expect + "Permission denied\n"


def test_the_ptx_of_native_jax_launches_is_listed_and_cleared(cache_dir, capsys):
    """A flat entry's PTX (interop/xla_launch.py) is a cache entry like a CUBIN: listed with
    its compute_XX target, removed by clear-cache."""
    from rtcinfer import flat_entry, norm

    spec = norm.norm_spec("rmsnorm", "bfloat16", "bfloat16", 4096)
    layout = jit.struct_layout(spec, "NormParams")
    flat_entry.compile_flat(spec, "norm_kernel", layout, 3, {"x": 0, "out": 2}, "sm_90a")
    assert cli.main(["list-modules"]) == 0
    out = capsys.readouterr().out
    assert "compute_90a" in out and "1 modules in" in out and "corrupt" not in out
    assert cli.main(["clear-cache"]) == 0
    assert "removed 1 modules" in capsys.readouterr().out
    assert not list(cache_dir.rglob("*.rtci")) and not list(cache_dir.glob("compute_*"))
