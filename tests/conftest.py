"""GPU tests (marker `gpu`) run only where CuPy sees a CUDA device; the rest run anywhere."""

from __future__ import annotations

import os

import numpy as np
import pytest

# JAX would otherwise reserve most of the GPU when first used, starving CuPy and PyTorch.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


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
