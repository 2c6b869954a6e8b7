"""How kernels see arrays: rows of a strided view, the widest aligned vector, row blocks.

Arrays here are anything with `shape` and `strides` in elements (interop's ArrayInfo)."""

from __future__ import annotations


def leading_rows(arr, name: str) -> tuple[int, int, int, int]:
    """(rows, n1, s0, s1) of an array [..., d] whose leading dims form at most two strided levels.

    Row r starts at element (r // n1) * s0 + (r % n1) * s1. The last dimension must have unit
    stride. Leading dimensions that are contiguous with each other are merged first.
    """
    rows, n1, ((s0, s1),) = common_rows([arr], [name])
    return rows, n1, s0, s1


def common_rows(arrays, names) -> tuple[int, int, list[tuple[int, int]]]:
    """leading_rows for arrays with the same leading dims (their last dims may differ), folded
    the same way for all, since a kernel takes one n1: (rows, n1, [(s0, s1) per array]).

    A leading dimension merges into the one before it only where it does so in every array.
    """
    shape = tuple(arrays[0].shape)
    for arr, name in zip(arrays, names, strict=True):
        if not arr.shape:
            raise ValueError(f"{name}: expected at least 1 dimension, got a 0-d array")
        if tuple(arr.shape[:-1]) != shape[:-1]:
            raise ValueError(f"{names}: leading dimensions differ: {[a.shape for a in arrays]}")
    if 0 in shape or any(0 in arr.shape for arr in arrays):
        return 0, 1, [(0, 0)] * len(arrays)
    strides = [list(arr.strides) for arr in arrays]
    for arr, name, st in zip(arrays, names, strides, strict=True):
        if arr.shape[-1] > 1 and st[-1] != 1:
            raise ValueError(
                f"{name}: the last dimension must be contiguous (stride 1), got strides {st}"
            )
    merged: list[tuple[int, list[int]]] = []  # (count, stride in each array)
    for i, n in enumerate(shape[:-1]):
        if n == 1:
            continue
        st = [s[i] for s in strides]
        if merged and all(prev == x * n for prev, x in zip(merged[-1][1], st, strict=True)):
            merged[-1] = (merged[-1][0] * n, st)
        else:
            merged.append((n, st))
    if len(merged) > 2:
        what = names[0] if len(names) == 1 else f"{', '.join(names)} together"
        raise ValueError(
            f"{what}: leading dimensions {shape[:-1]} with strides "
            f"{[s[:-1] for s in strides] if len(names) > 1 else strides[0][:-1]} do not fold "
            f"into two strided levels; pass a contiguous array"
        )
    while len(merged) < 2:
        merged.append((1, [0] * len(arrays)))
    (n0, st0), (n1, st1) = merged
    return n0 * n1, n1, list(zip(st0, st1, strict=True))


def fit_vec(vec: int, itemsize: int, align: int, strides) -> int:
    """Largest power of two <= vec dividing every stride (elements), with the pointers'
    common alignment `align` (bytes) at least min(16, vec * itemsize) (a `Vec` wider than 16
    bytes loads in 16-byte pieces)."""
    while vec > 1 and (align < min(16, vec * itemsize) or any(s % vec for s in strides)):
        vec //= 2
    return vec


def widest_vec(n: int, itemsize: int) -> int:
    """Largest power of two dividing n with vec * itemsize <= 16 bytes."""
    vec = 16 // itemsize
    while vec > 1 and n % vec:
        vec //= 2
    return vec


def row_threads(vocab: int, batch: int, sm_count: int, by_rank: bool = False) -> int:
    """Threads of a one-CTA-per-row kernel (sampling, renorm): 8 elements per thread up to
    1024 threads, so a row of <= 8 x threads fits the candidate list whole; narrower blocks
    when rows outnumber the SMs, so several CTAs share an SM and overlap their barriers.

    The kernels hold 1024 threads a SM (64 registers a thread): 512-thread blocks run the rows
    of up to 2 x sm_count in one wave, 256-thread blocks those of 4 x sm_count. An op that cuts
    its row by rank (`by_rank`: top-k, alone or with top-p) takes 256 threads from 2 x
    sm_count rows on: one wave of the rows' pass-0 / floor / gather chains beats two waves of
    wider blocks on the H200 (512 x 32000: top-k sampling 55.4 -> 39.9 us, top-k then top-p
    72.0 -> 47.1, top_k_renorm_probs 77.9 -> 67.8; bench/LOG.md), where the samplers by mass
    or none (plain, top-p, min-p) and top_p_renorm_probs gained nothing or lost (plain 512 x
    128256: 81.2 -> 88.5)."""
    threads = 32
    while threads < 1024 and threads * 8 < vocab:
        threads *= 2
    if batch > 4 * sm_count or (by_rank and batch > 2 * sm_count):
        return min(threads, 256)
    if batch > sm_count:
        return min(threads, 512)
    return threads


def row_thread_choices(vocab: int) -> tuple[int, ...]:
    """Every block size row_threads gives rows of `vocab` on some GPU (batches within its SM
    count, within 4x it, and beyond), largest first: what warmup compiles."""
    return tuple(dict.fromkeys(row_threads(vocab, batch, 1) for batch in (1, 2, 5)))


def row_smem_bytes(threads: int) -> int:
    """Dynamic shared memory of the row kernels: a candidate list of 8 (value, token) pairs per
    thread and 256 block maxima per warp (cuda_src/sampling/row_scan.cuh, list_memory)."""
    return 8 * threads * 8 + threads // 32 * 256 * 4
