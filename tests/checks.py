"""Tolerances (one table keyed by dtype) and a comparison that explains its failures."""

from __future__ import annotations

import numpy as np

# Output rounding dominates: half an ulp of the dtype plus fp32 arithmetic inside the kernel.
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def to_host(x) -> np.ndarray:
    """float64 NumPy copy of a CuPy, PyTorch, JAX or NumPy array (bf16 and fp8 included)."""
    module = type(x).__module__.partition(".")[0]
    if module == "torch":
        x = x.detach().float().cpu().numpy()
    elif module == "cupy":
        x = x.get()
    return np.asarray(x).astype(np.float64)


def assert_close(actual, expected, dtype: str, name: str = "output", tol: float | None = None):
    """|a - e| <= tol * (|e| + rms(e)) elementwise; NaN never passes."""
    a, e = to_host(actual), np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    tol = TOL[dtype] if tol is None else tol
    scale = np.sqrt(np.mean(e[np.isfinite(e)] ** 2)) if e.size else 0.0
    bound = tol * (np.abs(e) + scale)
    err = np.abs(a - e)
    bad = ~(err <= bound) & ~((a == e) & np.isinf(e))
    if bad.any():
        ratio = np.where(bad, np.nan_to_num(err / np.maximum(bound, 1e-300), nan=np.inf), 0)
        worst = np.unravel_index(np.argmax(ratio), a.shape)
        idx = np.argwhere(bad)[:5]
        pairs = ", ".join(
            f"{tuple(int(v) for v in i)}: {a[tuple(i)]:.6g} vs {e[tuple(i)]:.6g}" for i in idx
        )
        raise AssertionError(
            f"{name} ({dtype}): {int(bad.sum())} of {a.size} elements off; worst at "
            f"{tuple(int(v) for v in worst)}: {a[worst]!r} vs {e[worst]!r} (tol {tol}); {pairs}"
        )
