"""Generated Python code kept on disk (interop/generated.py): a later process loads what an
earlier one compiled; a damaged, foreign or unwritable entry costs a compile, never a wrong
function; `rtcinfer cache clear` removes the entries."""

from __future__ import annotations

import builtins
import marshal

import pytest

from rtcinfer import cli
from rtcinfer.interop import generated


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache folder and an empty in-process table."""
    monkeypatch.setenv("RTCINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(generated, "_CODE", {})
    return tmp_path / "cache"


def _no_compile(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(builtins, "compile", refuse)


def _entries(root):
    return sorted(p.name for p in root.glob("python-*/*"))


def test_a_later_process_loads_what_an_earlier_one_compiled(fresh, monkeypatch):
    f = generated.define(["def f(x):", "    return x + k"], {"k": 2}, "<test f>")
    assert f(1) == 3 and len(_entries(fresh)) == 1
    monkeypatch.setattr(generated, "_CODE", {})  # a new process: only the disk remains
    _no_compile(monkeypatch)
    g = generated.define(["def f(x):", "    return x + k"], {"k": 5}, "<test f>")
    assert g(1) == 6 and g.__code__.co_filename == "<test f>"


def test_each_text_is_an_entry(fresh):
    generated.define(["def f(x):", "    return x"], {}, "<a>")
    generated.define(["def f(x):", "    return -x"], {}, "<a>")
    generated.define(["def f(x):", "    return x"], {}, "<b>")  # this process's: no new entry
    assert len(_entries(fresh)) == 2


def test_a_damaged_or_foreign_entry_is_compiled_again(fresh, monkeypatch):
    generated.define(["def f(x):", "    return x * 3"], {}, "<t>")
    (path,) = fresh.glob("python-*/*.code")
    for damage in (b"", path.read_bytes()[:10], b"not marshal data at all"):
        path.write_bytes(damage)
        monkeypatch.setattr(generated, "_CODE", {})
        assert generated.define(["def f(x):", "    return x * 3"], {}, "<t>")(2) == 6
    # an entry holding another text (a hash collision, a hand edit) is not used
    monkeypatch.setattr(generated, "_CODE", {})
    four = "def f(x):\n    return x * 4\n"
    path.write_bytes(marshal.dumps((four, "<t>", compile(four, "<t>", "exec"))))
    assert generated.define(["def f(x):", "    return x * 3"], {}, "<t>")(2) == 6


def test_an_unwritable_cache_still_gives_the_function(monkeypatch, tmp_path):
    """The cache folder cannot be made (a file stands where a folder would be)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("RTCINFER_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(generated, "_CODE", {})
    assert generated.define(["def f():", "    return 7"], {}, "<ro>")() == 7
    assert blocker.read_text() == ""


def test_cache_clear_removes_the_entries(fresh, capsys):
    generated.define(["def f():", "    return 1"], {}, "<c>")
    assert _entries(fresh)
    assert cli.clear_cache(None) == 0
    assert not list(fresh.glob("python-*"))
