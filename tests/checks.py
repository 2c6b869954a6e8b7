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


def assert_close(
    actual,
    expected,
    dtype: str,
    name: str = "output",
    tol: float | None = None,
    per_vector: bool = False,
):
    """|a - e| <= tol * (|e| + scale) elementwise, scale = rms(e); NaN never passes.

    per_vector: scale = max(rms(e), rms of e along its last axis), for tensor-core attention.
    Its kernels round the probabilities (and RoPE-rotated q and k) to the input dtype before
    the matrix products, as every FlashAttention-style kernel does, so an output's error is a
    fraction of its own query head's output vector: a head that sees a few keys has an output
    near |v| while the batch rms may be far smaller.
    """
    a, e = to_host(actual), np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    tol = TOL[dtype] if tol is None else tol
    scale = np.sqrt(np.mean(e[np.isfinite(e)] ** 2)) if e.size else 0.0
    if per_vector and e.size:
        vector = np.sqrt(np.mean(np.where(np.isfinite(e), e, 0.0) ** 2, axis=-1, keepdims=True))
        scale = np.maximum(vector, scale)
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


def assert_fp8(actual, exact, dtype: str, name: str = "output") -> None:
    """An fp8 result (`actual`: fp8 values, or their uint8 storage) is `exact` (float64, before
    rounding) rounded to `dtype`: within reference.fp8_rounding_bounds; NaN where exact is."""
    from rtcinfer.interop.dtypes import numpy_dtype

    from .reference import fp8_rounding_bounds

    host = actual.get() if type(actual).__module__.startswith("cupy") else actual
    if getattr(host, "dtype", None) == np.uint8:
        host = host.view(numpy_dtype(dtype))
    a, e = to_host(host), np.asarray(exact, dtype=np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    lo, hi = fp8_rounding_bounds(e, dtype)
    nan = np.isnan(e)
    bad = np.where(nan, ~np.isnan(a), ~((lo <= a) & (a <= hi)))
    if bad.any():
        idx = np.argwhere(bad)[:5]
        pairs = ", ".join(f"{tuple(int(v) for v in i)}: {a[tuple(i)]!r} not in "
                          f"[{lo[tuple(i)]!r}, {hi[tuple(i)]!r}] (exact {e[tuple(i)]!r})"
                          for i in idx)  # fmt: skip
        raise AssertionError(
            f"{name} ({dtype}): {int(bad.sum())} of {a.size} elements off; {pairs}"
        )
