"""merge_state(s) argument checks, which run before any device work (no GPU needed)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import rtcinfer


def test_mismatched_states_name_shape_and_dtype():
    v16 = np.zeros((2, 3, 8), np.float16)
    vb = np.zeros((2, 3, 8), ml_dtypes.bfloat16)
    s = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"v_a \(float16 .*\) and v_b \(bfloat16 .*\) must match"):
        rtcinfer.merge_state(v16, s, vb, s)
    with pytest.raises(ValueError, match=r"v \(float16 .*\) and v_other \(bfloat16 .*\) must"):
        rtcinfer.merge_state_in_place(v16, s, vb, s)


def test_head_dim_zero_is_refused():
    v, s = np.zeros((2, 3, 0), np.float32), np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="head_dim must be at least 1"):
        rtcinfer.merge_state(v, s, v, s)
    with pytest.raises(ValueError, match="head_dim must be at least 1"):
        rtcinfer.merge_states(v[:, None], s[:, None])
