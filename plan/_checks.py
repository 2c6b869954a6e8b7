"""Input checks shared by the host planners.

Every planner input may arrive as a Python list or a NumPy array of any integer dtype; these
helpers turn it into an int64 array (cheap when it already is one) and raise with the
offending value in the message.
"""

from __future__ import annotations

import operator

import numpy as np

INT32_MAX = np.iinfo(np.int32).max
INT64_MAX = np.iinfo(np.int64).max


def as_int_array(name: str, value, ndim: int = 1, widen: bool = True) -> np.ndarray:
    """Return ``value`` as an int64 array with ``ndim`` dimensions (``widen=False``: in its own
    integer dtype, without a copy).

    Raises TypeError for non-integer dtypes (floats, bools, objects) and ValueError for a
    wrong number of dimensions.
    """
    if type(value) is np.ndarray and value.dtype.kind == "i" and value.ndim == ndim:
        return value.astype(np.int64, copy=False) if widen else value  # the common case
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and arr.size == 0:
            arr = arr.astype(np.int64)  # np.asarray([]) is float64: treat as empty ints
        else:
            raise TypeError(f"{name} must have an integer dtype, got {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} has a value too large for int64: {int(arr.max())}")
    return arr.astype(np.int64, copy=False) if widen else arr


def as_int(name: str, value, minimum: int | None = None) -> int:
    """Return ``value`` as a Python int (anything integral: NumPy integers, 0-d integer arrays
    and tensors), rejecting bools, floats and values below minimum."""
    if type(value) is not int:  # fast path for plain ints; bool is a subclass, so not here
        try:
            if isinstance(value, (bool, np.bool_)):
                raise TypeError
            value = operator.index(value)
        except TypeError:
            raise TypeError(
                f"{name} must be an integer, got {value!r} ({type(value).__name__})"
            ) from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def first_bad(mask: np.ndarray) -> int:
    """Index of the first True in a boolean mask (the caller knows one exists)."""
    return int(np.flatnonzero(mask)[0])


def check_indptr(name: str, indptr: np.ndarray) -> np.ndarray:
    """Check that ``indptr`` (int64, 1-D) starts at 0 and never decreases; return its diff."""
    return indptr_counts(name, indptr)[0]


def indptr_counts(name: str, indptr: np.ndarray) -> tuple[np.ndarray, int]:
    """check_indptr's checks; returns (counts = diff(indptr), max(counts), 0 if empty).

    One reduction does both: seen as uint64, a negative count is larger than any valid one.
    """
    if indptr.shape[0] < 1:
        raise ValueError(f"{name} must have at least one entry (batch_size + 1), got shape (0,)")
    if indptr[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(indptr[0])}")
    counts = indptr[1:] - indptr[:-1]
    most = int(np.maximum.reduce(counts.view(np.uint64))) if counts.shape[0] else 0
    if most > INT64_MAX:
        i = first_bad(counts < 0)
        raise ValueError(
            f"{name} must be non-decreasing, got {name}[{i}] = {int(indptr[i])} > "
            f"{name}[{i + 1}] = {int(indptr[i + 1])}"
        )
    if indptr[-1] > INT32_MAX:
        raise ValueError(f"{name}[-1] ({int(indptr[-1])}) does not fit in int32")
    return counts, most
