"""The command line without a GPU."""

from __future__ import annotations

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


def test_warmup_list_clear(cache_dir, capsys):
    n = len(catalog.model_specs("llama3-8b"))
    assert cli.main(["warmup", "--model", "llama3-8b", "--arch", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert f"done: {n} modules ({n} compiled, 0 cached)" in out and f"[{n}/{n}]" in out
    assert "PrefillSpec(" in out  # a model's serving loop prefills too
    assert cli.main(["warmup", "--model", "llama3-8b", "--arch", "sm_80"]) == 0
    assert f"(0 compiled, {n} cached)" in capsys.readouterr().out

    assert cli.main(["list-modules"]) == 0
    out = capsys.readouterr().out
    assert f"{n} modules in" in out and "NormSpec(op='rmsnorm'" in out and "sm_80" in out

    assert cli.main(["show-config"]) == 0
    out = capsys.readouterr().out
    assert "nvrtc" in out and f"{n} modules" in out and str(cache_dir) in out

    assert cli.main(["clear-cache"]) == 0
    assert f"removed {len(catalog.model_specs('llama3-8b'))} modules" in capsys.readouterr().out
    assert not list(cache_dir.rglob("*.rtci"))


def test_list_modules_flags_corrupt_entries(cache_dir, capsys):
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
    assert "modules ready" in out
    assert list(cache_dir.rglob("*.rtci"))


@pytest.mark.gpu
def test_demo_on_gpu(cache_dir, capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and out.count(" ok ") >= 4


def test_clear_cache_deletes_only_what_the_cache_wrote(cache_dir, capsys):
    cli.main(["warmup", "--model", "llama3-8b", "--arch", "sm_80"])
    (cache_dir / "notes.txt").write_text("keep")
    (cache_dir / "data").mkdir()
    (cache_dir / "data" / "kernel.cu").write_text("keep")
    (cache_dir / "sm_80" / "README").write_text("keep")
    orphan = cache_dir / "sm_80" / "NormSpec-0123456789abcdef01234567.rtci8x_k2q.tmp"
    orphan.write_bytes(b"half written")
    capsys.readouterr()
    assert cli.main(["clear-cache"]) == 0
    assert f"removed {len(catalog.model_specs('llama3-8b'))} modules" in capsys.readouterr().out
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


def test_warmup_compiles_even_with_no_compile_set(cache_dir, monkeypatch, capsys):
    monkeypatch.setenv("RTCINFER_NO_COMPILE", "1")
    assert cli.main(["warmup", "--model", "llama3-8b", "--arch", "sm_80"]) == 0
    n = len(catalog.model_specs("llama3-8b"))
    assert f"({n} compiled, 0 cached)" in capsys.readouterr().out
