"""GPU tests (marker `gpu`) run only where CuPy sees a CUDA device; the rest run anywhere.

The kernel cache of the whole session is a temporary folder, set before rtcinfer is imported
and inherited by the subprocesses tests start: the suite never writes the user's cache.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest

# JAX must not take 75% of the GPU at import: CuPy and PyTorch share the device in these tests.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
SESSION_CACHE = tempfile.mkdtemp(prefix="rtcinfer-test-cache-")
os.environ["RTCINFER_CACHE_DIR"] = SESSION_CACHE


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_CACHE, ignore_errors=True)


def gpu_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    return cupy.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty kernel cache for this test."""
    monkeypatch.setenv("RTCINFER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def jax_gpu():
    """The jax module, where JAX is installed with a GPU backend (else the test skips)."""
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    return jax


@pytest.fixture(autouse=True)
def _shortcuts_taken():
    """Each test starts with the public functions' shortcuts on (interop/shortcut.py's
    ENABLED): a test that fakes a process with several GPUs turns them off for the rest of the
    process, as it would in one."""
    from rtcinfer.interop import shortcut

    shortcut.ENABLED[0] = True
    yield
    shortcut.ENABLED[0] = True
