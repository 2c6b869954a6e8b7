"""Small batches: one row per cluster of CTAs (cuda_src/sampling/sampling_cluster.cu, sm_90+).

One CTA per row leaves most SMs idle below about a hundred rows, and a single SM reads a
128K-256K row slowly. A cluster of up to 8 CTAs splits the row, keeps its slices in shared
memory (read from memory once) and runs the selection passes on them, exchanging partial
results through distributed shared memory. `cluster_size` decides when this path is taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import jit
from ..errors import BadIndex
from ..launch import Kernel, Launch

THREADS = 512
SLICE_BYTES = 200 * 1024  # the most dynamic shared memory (a CTA's slice) the path takes
STATIC_BYTES = 16 * 1024  # room for the kernel's static shared memory (about 11.5 KB)
CLUSTERS = (8, 4, 2)


@dataclass(frozen=True)
class ClusterSampleSpec:
    op: str  # a key of rtcinfer.sampling.SAMPLE_OPS
    dtype: str  # probs
    out_dtype: str  # token ids
    vec: int
    cluster: int  # CTAs per row
    threads: int = THREADS
    source: ClassVar[str] = "sampling/sampling_cluster.cu"
    kernels: ClassVar[tuple[str, ...]] = ("cluster_sample_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("SampleParams",)  # crossing the seam
    min_sm: ClassVar[int] = 90  # thread-block clusters

    def prelude(self) -> str:
        from .samplers import SAMPLE_OPS

        return jit.prelude(
            OP=SAMPLE_OPS[self.op],
            T=self.dtype,
            OUT_T=self.out_dtype,
            VEC=self.vec,
            THREADS=self.threads,
            CLUSTER=self.cluster,
            BadIndex=BadIndex,
        )


def compute_capability(device: int) -> int:
    """The device's compute capability as one int (90 for sm_90): clusters need 90 or more."""
    import cupy

    return int(cupy.cuda.Device(device).compute_capability)


def slice_elements(vocab: int, cluster: int, vec: int) -> int:
    """Elements per CTA: ceil(vocab / cluster) rounded up to a multiple of max(4, vec)."""
    align = max(4, vec)
    per_cta = -(-vocab // cluster)
    return -(-per_cta // align) * align


def cluster_size(batch: int, vocab: int, vec: int, sm_count: int, compute_capability: int,
                 smem_per_block: int = 227 * 1024) -> int:  # fmt: skip
    """CTAs per row for a [batch, vocab] call: the largest of 8, 4, 2 whose grid fits the SMs
    and whose slices fit shared memory; up to the SM count, 2 when two CTAs' slices fit one
    SM's shared memory (two waves at most: 128 x 32000 top-p 45.7 -> 30.8 us, top-k 34.2 ->
    26.7 on an H200, where one CTA per row runs each row's passes on a single SM); 0 (one CTA
    per row instead) when none does, the device predates clusters, or its opt-in shared memory
    per block (`smem_per_block`) is smaller than the kernel's."""
    if compute_capability < 90 or smem_per_block < SLICE_BYTES + STATIC_BYTES:
        return 0
    for cluster in CLUSTERS:
        fits = 4 * slice_elements(vocab, cluster, vec) <= SLICE_BYTES
        if batch * cluster <= sm_count and fits:
            return cluster
    pair = 4 * slice_elements(vocab, 2, vec) + STATIC_BYTES
    return 2 if batch <= sm_count and 2 * pair <= smem_per_block else 0


def cluster_choices(vocab: int, vec: int, compute_capability: int,
                    smem_per_block: int = 227 * 1024) -> tuple[int, ...]:  # fmt: skip
    """Every cluster size `cluster_size` may give rows of `vocab` on such a GPU (the batch and
    the SM count choose among them), largest first; () where clusters are not used."""
    if compute_capability < 90 or smem_per_block < SLICE_BYTES + STATIC_BYTES:
        return ()
    return tuple(c for c in CLUSTERS if 4 * slice_elements(vocab, c, vec) <= SLICE_BYTES)


def cluster_launch(spec: ClusterSampleSpec, batch: int, vocab: int) -> Launch:
    """cluster_sample_kernel over `batch` rows of `vocab` (its SampleParams as sample_kernel's;
    the cluster shape is compiled in, __cluster_dims__, so a plain launch forms the clusters)."""
    smem = 4 * slice_elements(vocab, spec.cluster, spec.vec)
    kernel = Kernel(spec, "cluster_sample_kernel", "SampleParams", smem)
    return Launch(kernel, (batch * spec.cluster, 1, 1), (spec.threads, 1, 1))


__all__ = ["ClusterSampleSpec", "cluster_choices", "cluster_launch", "cluster_size",
           "compute_capability", "slice_elements"]  # fmt: skip
