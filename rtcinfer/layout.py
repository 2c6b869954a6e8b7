"""How kernels see arrays: rows of a strided view, the widest aligned vector, row blocks."""

from __future__ import annotations


def leading_rows(arr, name: str) -> tuple[int, int, int, int]:
    """(rows, n1, s0, s1) of an array [..., d] whose leading dims form at most two strided levels.

    Row r starts at element (r // n1) * s0 + (r % n1) * s1. The last dimension must have unit
    stride. Leading dimensions that are contiguous with each other are merged first.
    """
    shape, item = tuple(arr.shape), arr.itemsize
    strides = [s // item for s in arr.strides]
    if not shape:
        raise ValueError(f"{name}: expected at least 1 dimension, got a 0-d array")
    if 0 in shape:
        return 0, 1, 0, 0
    if shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(
            f"{name}: the last dimension must be contiguous (stride 1), got strides {strides}"
        )
    dims = [(n, s) for n, s in zip(shape[:-1], strides[:-1], strict=True) if n != 1]
    merged: list[list[int]] = []
    for n, s in dims:
        if merged and merged[-1][1] == s * n:
            merged[-1] = [merged[-1][0] * n, s]
        else:
            merged.append([n, s])
    if len(merged) > 2:
        raise ValueError(
            f"{name}: leading dimensions {shape[:-1]} with strides {strides[:-1]} do not fold "
            f"into two strided levels; pass a contiguous array"
        )
    while len(merged) < 2:
        merged.append([1, 0])
    (n0, s0), (n1, s1) = merged
    return n0 * n1, n1, s0, s1


def fit_vec(vec: int, itemsize: int, pointers, strides) -> int:
    """Largest power of two <= vec dividing every stride (elements), with pointers aligned to
    min(16, vec * itemsize) bytes (a `Vec` wider than 16 bytes loads in 16-byte pieces)."""

    def aligned(v: int) -> bool:
        align = min(16, v * itemsize)
        return not any(p % align for p in pointers) and not any(s % v for s in strides)

    while vec > 1 and not aligned(vec):
        vec //= 2
    return vec


def widest_vec(n: int, itemsize: int) -> int:
    """Largest power of two dividing n with vec * itemsize <= 16 bytes."""
    vec = 16 // itemsize
    while vec > 1 and n % vec:
        vec //= 2
    return vec


def row_threads(vocab: int, batch: int, sm_count: int) -> int:
    """Threads of a one-CTA-per-row kernel (sampling, renorm): 8 elements per thread up to
    1024 threads, so a row of <= 8 x threads fits the candidate list whole; narrower blocks
    when rows outnumber the SMs, so several CTAs share an SM and overlap their barriers."""
    threads = 32
    while threads < 1024 and threads * 8 < vocab:
        threads *= 2
    if batch > 4 * sm_count:
        return min(threads, 256)
    if batch > sm_count:
        return min(threads, 512)
    return threads


def row_smem_bytes(threads: int) -> int:
    """Dynamic shared memory of the row kernels: a candidate list of 8 (value, token) pairs per
    thread and 256 block maxima per warp (cuda_src/row_scan.cuh, list_memory)."""
    return 8 * threads * 8 + threads // 32 * 256 * 4
