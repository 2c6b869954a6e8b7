"""Softmax with temperature (FlashInfer's `flashinfer.sampling.softmax`): one CTA per row
(cuda_src/sampling/softmax.cu), or on sm_90+ for a batch too small to fill the GPU a cluster of
CTAs per row, each taking a slice (softmax_cluster.cu)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .. import jit
from ..interop import Fill, Op, OutSlot, Prepared, call, one_launch
from ..interop.arrays import torch_compiling, with_shortcut
from ..interop.dtypes import FLOAT_DTYPES, itemsize
from ..interop.shortcut import Shortcut
from ..launch import Kernel, Launch
from ..layout import fit_vec, leading_rows, widest_vec
from .cluster import compute_capability


@dataclass(frozen=True)
class SoftmaxSpec:
    dtype: str
    vec: int
    threads: int
    source: ClassVar[str] = "sampling/softmax.cu"
    kernels: ClassVar[tuple[str, ...]] = ("softmax_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("SoftmaxParams",)  # crossing the seam

    def prelude(self) -> str:
        return jit.prelude(
            T=self.dtype,
            VEC=self.vec,
            THREADS=self.threads,
        )


@dataclass(frozen=True)
class ClusterSoftmaxSpec:
    dtype: str
    vec: int
    threads: int
    cluster: int  # CTAs per row
    source: ClassVar[str] = "sampling/softmax_cluster.cu"
    kernels: ClassVar[tuple[str, ...]] = ("cluster_softmax_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("SoftmaxParams",)  # crossing the seam
    min_sm: ClassVar[int] = 90  # thread-block clusters

    def prelude(self) -> str:
        return jit.prelude(T=self.dtype, VEC=self.vec, THREADS=self.threads, CLUSTER=self.cluster)


CLUSTERS = (8, 4, 2)
MIN_SLICE = 2048  # elements a CTA of a cluster takes at the least


def _threads(elements: int, vec: int) -> int:
    """About 8 vectors per thread, 32 to 1024 threads."""
    threads = 32
    while threads < 1024 and threads * vec * 8 < elements:
        threads *= 2
    return threads


def softmax_spec(dtype: str, vocab: int, vec: int | None = None) -> SoftmaxSpec:
    """One CTA per row: about 8 vectors per thread, 32 to 1024 threads."""
    vec = vec or widest_vec(vocab, itemsize(dtype))
    return SoftmaxSpec(dtype, vec, _threads(vocab, vec))


def cluster_softmax_spec(dtype: str, vocab: int, cluster: int,
                         vec: int | None = None) -> ClusterSoftmaxSpec:  # fmt: skip
    """`cluster` CTAs per row, each sized for its slice as softmax_spec sizes a row."""
    vec = vec or widest_vec(vocab, itemsize(dtype))
    return ClusterSoftmaxSpec(dtype, vec, _threads(-(-vocab // cluster), vec), cluster)


def softmax_cluster(rows: int, vocab: int, sm_count: int, compute_capability: int) -> int:
    """CTAs per row: the largest of 8, 4, 2 whose grid fits the SMs at one CTA each and whose
    slices keep MIN_SLICE elements; 0 (one CTA per row) when none does or before sm_90. A lone
    row read by one SM is latency-bound (1 x 32000 fp32: 12.8 us on an H200)."""
    fitting = (c for c in cluster_choices(vocab, compute_capability) if rows * c <= sm_count)
    return next(fitting, 0)


def cluster_choices(vocab: int, compute_capability: int) -> tuple[int, ...]:
    """Every cluster size softmax_cluster may give rows of `vocab` (the batch and the SM count
    choose among them), largest first; () before sm_90."""
    if compute_capability < 90:
        return ()
    return tuple(c for c in CLUSTERS if vocab >= c * MIN_SLICE)


def prepare_softmax(infos, _align: int, static: tuple) -> Prepared:
    """Slots (logits, temperature array) -> probs [rows, vocab] float32. Scalars: (temperature,)
    for rows without the array."""
    logits, temperature = infos
    shape, dtype = logits.shape, logits.dtype
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if len(shape) != 2 or shape[1] == 0:
        raise ValueError(f"logits: expected shape (batch, vocab) with vocab > 0, got {shape}")
    rows, vocab = shape
    if temperature is not None and (temperature.dtype, temperature.shape) != ("float32", (rows,)):
        raise ValueError(
            f"temperature: expected a float or a float32 array of shape ({rows},), "
            f"got {temperature.dtype} of shape {temperature.shape}"
        )
    _, _, stride, _ = leading_rows(logits, "logits")  # the vocabulary axis must be contiguous
    vec = fit_vec(widest_vec(vocab, itemsize(dtype)), itemsize(dtype), logits.align, [stride])
    launch = _launch(dtype, rows, vocab, vec, logits.device)
    p = launch.params
    p.in_stride, p.out_stride, p.vocab = stride, vocab, vocab  # the output is allocated dense
    fill = Fill((("logits", 0), ("temperature_arr", 1), ("probs", 2)), (("temperature_val", 0),))
    dense = () if temperature is None else (1,)
    return one_launch((OutSlot(shape, "float32"),), launch, fill, dense=dense)


def _launch(dtype: str, rows: int, vocab: int, vec: int, device: int) -> Launch:
    cc = compute_capability(device)
    cluster = softmax_cluster(rows, vocab, jit.sm_count(device), cc)
    if cluster:
        spec = cluster_softmax_spec(dtype, vocab, cluster, vec)
        kernel = Kernel(spec, "cluster_softmax_kernel", "SoftmaxParams")
        return Launch(kernel, (rows * cluster, 1, 1), (spec.threads, 1, 1))
    spec = softmax_spec(dtype, vocab, vec)
    return Launch(Kernel(spec, "softmax_kernel", "SoftmaxParams"), (rows, 1, 1),
                  (spec.threads, 1, 1))  # fmt: skip


_OP = Op("softmax", ("logits", "temperature"), prepare_softmax)


@with_shortcut(Shortcut(_OP, ("logits", None), "()",
                        "(1.0 if temperature is None else temperature,)",
                        when="temperature is None or type(temperature) is float"))  # fmt: skip
def softmax(logits, temperature=None, enable_pdl=None):
    """Row softmax with temperature, in fp32.

    probs = exp(logits / t - max(logits / t)) / sum(exp(logits / t - max(logits / t)), -1)
    logits: [batch, vocab] float32/float16/bfloat16 (rows may be strided); temperature: None
    (1), a float, or a [batch] float32 array. Rows of -inf give zeros; a NaN makes its row NaN.
    enable_pdl is accepted for FlashInfer compatibility (dependent launches are process-wide:
    rtcinfer/dependent_launch.py). Returns [batch, vocab] float32 in the caller's array type.
    """
    if torch_compiling(logits):  # a custom op node (rtcinfer/torch_ops.py)
        from .. import torch_ops

        return torch_ops.softmax(logits, temperature)
    if temperature is None:
        return call(_OP, (logits, None), (), (1.0,))
    if isinstance(temperature, (int, float, np.integer, np.floating)):
        return call(_OP, (logits, None), (), (float(temperature),))
    return call(_OP, (logits, temperature), (), (1.0,))


def specs_for(vocab: int, dtypes=("float32",), clusters: tuple[int, ...] = ()) -> list:
    """What a serving loop may launch (warmup): softmax of logits of each dtype, aligned rows,
    one CTA per row and at each cluster size `clusters` (cluster_choices)."""
    return [softmax_spec(d, vocab) for d in dtypes] + [
        cluster_softmax_spec(d, vocab, c) for d in dtypes for c in clusters
    ]


__all__ = [
    "ClusterSoftmaxSpec",
    "SoftmaxSpec",
    "cluster_choices",
    "cluster_softmax_spec",
    "prepare_softmax",
    "softmax",
    "softmax_cluster",
    "softmax_spec",
    "specs_for",
]
