"""RoPE argument checks that run before any device work, and the launch step on fake arrays
(no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from rtcinfer import rope

from .fakes import FakeArray

Q = np.zeros((3, 4, 64), np.float16)
K = np.zeros((3, 2, 64), np.float16)
CACHE = np.zeros((16, 64), np.float32)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: rtcinfer.apply_rope_with_cos_sin_cache(
            np.arange(3), np.zeros((3, 4, 128), np.float16), K, 64, CACHE),
         r"must be \[nnz, heads, 64\] or \[nnz, heads \* 64\]"),
        (lambda: rtcinfer.apply_rope_with_cos_sin_cache(np.arange(3), Q, K, 0, CACHE),
         "head_dim must be at least 1"),
        (lambda: rtcinfer.apply_rope_pos_ids(Q, K, np.arange(1)),
         r"pos_ids: expected shape \(3,\), got \(1,\)"),
        (lambda: rtcinfer.apply_rope_pos_ids(Q, K, np.zeros((3, 3), np.int32)),
         r"pos_ids: expected shape \(3,\), got \(3, 3\)"),
        (lambda: rtcinfer.apply_rope(Q, K, np.zeros(1, np.int32), np.zeros(0, np.int32)),
         "3 tokens need at least one request"),
        (lambda: rtcinfer.apply_rope(Q, K, np.zeros(1, np.int32), np.zeros(4, np.int32)),
         r"indptr and offsets must be \[B \+ 1\] and \[B\], got \(1,\) and \(4,\)"),
    ],
)  # fmt: skip
def test_shapes_are_checked(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_zero_heads_launch_nothing(monkeypatch):
    from rtcinfer import jit

    monkeypatch.setattr(jit, "get_function", lambda *a, **k: pytest.fail("launched"))
    q, k = FakeArray((3, 0, 64), 2), FakeArray((3, 0, 64), 2)
    spec = rope.RopeSpec("float16", "int32", 64, 64, False, "theta", "pos_ids", False, 8)
    rope._launch(None, [q, k, FakeArray((3,), 4)], [q, k], spec=spec, head_dim=64,
                 params=(1.0, 1e4, 1.0, 1.0, 1.0))  # fmt: skip
