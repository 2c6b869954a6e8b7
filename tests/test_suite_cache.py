"""The suite's kernel cache: a temporary folder for the whole session (tests/conftest.py), in
this process and in the subprocesses tests start, never the user's ~/.cache/rtcinfer."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from rtcinfer import jit
from tests.conftest import SESSION_CACHE


def test_the_session_cache_is_a_temporary_folder_outside_the_home_cache():
    cache = jit.cache_dir().resolve()
    assert cache == Path(SESSION_CACHE).resolve()
    assert cache.is_relative_to(Path(tempfile.gettempdir()).resolve())
    assert not cache.is_relative_to(Path("~/.cache").expanduser().resolve())
    if not Path(tempfile.gettempdir()).resolve().is_relative_to(Path.home().resolve()):
        assert not cache.is_relative_to(Path.home().resolve())


def test_subprocesses_inherit_it():
    done = subprocess.run(
        [sys.executable, "-c", "from rtcinfer import jit; print(jit.cache_dir())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(done.stdout.strip()) == Path(SESSION_CACHE)
