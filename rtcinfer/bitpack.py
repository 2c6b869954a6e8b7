"""Bit packing of boolean arrays for attention masks, FlashInfer's ``packbits`` and
``segment_packbits`` (cuda_src/packbits.cu):

    packbits(x, bitorder)[b] = sum_i [x[8b + i]] << (i if bitorder == "little" else 7 - i)
    segment_packbits(x, indptr, bitorder): each segment x[indptr[s]:indptr[s + 1]] packed on
        its own (its last byte zero-padded), the segments' bytes back to back; returns
        (packed, indptr_new) with indptr_new[s] the first byte of segment s.

Device arrays are packed on the GPU and returned as the caller's array type; NumPy arrays
are packed by NumPy. segment_packbits reads indptr on the host to size its output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import jit
from .interop import Op, OutSlot, Prepared, call
from .interop.arrays import device_like, framework, to_numpy
from .launch import Kernel, Launch
from .plan._checks import as_int_array, indptr_counts

BITORDERS = ("big", "little")
THREADS = 256
MAX_CTAS = 4096  # CTAs stride over segments beyond this


@dataclass(frozen=True)
class PackbitsSpec:
    little: bool
    indptr_dtype: str
    source: ClassVar[str] = "packbits.cu"
    kernels: ClassVar[tuple[str, ...]] = ("packbits_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("PackbitsParams",)

    def prelude(self) -> str:
        return jit.prelude(LITTLE=self.little, IDX=self.indptr_dtype, THREADS=THREADS)


def _check_bitorder(bitorder) -> bool:
    if bitorder not in BITORDERS:
        raise ValueError(f"bitorder must be one of {BITORDERS}, got {bitorder!r}")
    return bitorder == "little"


def packbits(x, bitorder: str = "big"):
    """uint8 [ceil(n / 8)]: the n booleans of x (flattened, row-major) packed 8 to a byte."""
    little = _check_bitorder(bitorder)
    if framework(x) == "numpy":
        return np.packbits(np.asarray(x, dtype=bool).ravel(), bitorder=bitorder)
    return call(_OP, (x, None), (little, None))


def segment_packbits(x, indptr, bitorder: str = "big"):
    """(packed uint8 [sum_s ceil(len_s / 8)], indptr_new [S + 1]) for the S segments
    x[indptr[s]:indptr[s + 1]] of the flattened x, each packed on its own."""
    little = _check_bitorder(bitorder)
    given = to_numpy(indptr)
    host = as_int_array("indptr", given)
    counts, _ = indptr_counts("indptr", host)
    new = np.zeros(counts.shape[0] + 1, dtype=given.dtype)
    new[1:] = np.cumsum((counts + 7) // 8)
    if framework(x) == "numpy":
        bits = np.asarray(x, dtype=bool).ravel()
        _check_total(int(host[-1]), bits.shape[0])
        parts = [
            np.packbits(bits[a:b], bitorder=bitorder)
            for a, b in zip(host[:-1], host[1:], strict=True)
        ]
        return np.concatenate(parts or [np.zeros(0, np.uint8)]), new
    _check_total(int(host[-1]), int(np.prod(x.shape)))
    if framework(indptr) == "numpy" or not hasattr(indptr, "__dlpack__"):
        indptr = device_like(given, x)  # the kernel reads it from the device
    return call(_OP, (x, indptr), (little, int(new[-1])))


def _check_total(last: int, n: int) -> None:
    if last > n:
        raise ValueError(f"indptr[-1] ({last}) is past the end of x ({n} elements)")


def _prepare(infos, align, static) -> Prepared:
    """Slots (x, indptr) -> packed (and indptr_new when indptr is given)."""
    little, packed_bytes = static
    x, indptr = infos
    if x.dtype not in ("bool", "uint8"):
        raise TypeError(f"x: expected a bool (or uint8) array, got {x.dtype}")
    n = x.size
    if indptr is None:
        packed_bytes, segments, idx = -(-n // 8), 1, "int32"
    else:
        if indptr.ndim != 1 or indptr.dtype not in ("int32", "int64"):
            raise ValueError(f"indptr: expected int32 or int64 [S + 1], got {indptr.dtype} "
                             f"{indptr.shape}")  # fmt: skip
        segments, idx = indptr.shape[0] - 1, indptr.dtype
    outs = [OutSlot((packed_bytes,), "uint8")]
    if indptr is not None:
        outs.append(OutSlot(indptr.shape, idx))
    kernel = Kernel(PackbitsSpec(little, idx), "packbits_kernel", "PackbitsParams")
    launch = Launch(kernel, (max(1, min(segments, MAX_CTAS)), 1, 1), (THREADS, 1, 1))
    p = launch.params
    p.n, p.segments = n, segments
    with_indptr = indptr is not None

    def run(stream, device, ptrs, scalars):
        launch.lock.acquire()
        try:
            p.x, p.indptr, p.y = ptrs[0], ptrs[1], ptrs[2]
            p.indptr_out = ptrs[3] if with_indptr else 0
            launch(stream, device)
        finally:
            launch.lock.release()

    return Prepared(tuple(outs), run, preload=launch.preload, dense=(0, 1))


_OP = Op("packbits", ("x", "indptr"), _prepare)

__all__ = ["packbits", "segment_packbits"]
