"""Sorting-free sampling: FlashInfer's `flashinfer.sampling`, names, arguments and defaults.

This module is also the `rtcinfer.sampling` namespace: the samplers below, `softmax`, the
renormalization ops (`top_k_renorm_probs`, `top_p_renorm_probs`, `top_k_mask_logits`),
`chain_speculative_sampling` and `Generator`.

Samplers draw one token per output row from probs[indices[b]] (or probs[b]) restricted to the
kept set, renormalized (cuda_src/sampling.cu: dual-pivot rejection sampling, no sort; small
batches on sm_90+ split each row over a cluster of CTAs, cuda_src/sampling_cluster.cu). A token
with probability <= 0 (or NaN) or outside the kept set is never returned; ids are always in
[0, vocab); a row without any positive probability returns 0. `indices` must hold valid rows of
probs (not checked on the host). Per-row parameters are scalars or [batch] device arrays.
Randomness: rtcinfer.philox (seed, offset, generator); the same seed, offset and inputs give the
same tokens. The kernels are deterministic, so `deterministic` is accepted and ignored.
check_nan=True raises ValueError when probs holds NaN, negative or infinite values; it reads one
flag back from the device (a stream synchronization, and no use under jax.jit), so leave it off
in the decode loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from . import jit, sampling_cluster
from .interop import Out, dtype_name, framework, run
from .interop.arrays import dense
from .interop.dtypes import FLOAT_DTYPES, itemsize
from .layout import fit_vec, leading_rows, row_smem_bytes, row_threads, widest_vec
from .philox import Generator, kernel_inputs
from .renorm import top_k_mask_logits, top_k_renorm_probs, top_p_renorm_probs
from .sampling_cluster import ClusterSampleSpec
from .softmax import softmax
from .speculative import chain_speculative_sampling

SAMPLE_OPS = ("plain", "top_k", "top_p", "min_p", "top_k_top_p", "top_k_first")


@dataclass(frozen=True)
class SampleSpec:
    op: str  # SAMPLE_OPS; "top_k_top_p" is FlashInfer's filter_apply_order="joint"
    dtype: str  # probs
    out_dtype: str  # token ids (the dtype of `indices`, else int32)
    vec: int
    threads: int
    source: ClassVar[str] = "sampling.cu"
    kernels: ClassVar[tuple[str, ...]] = ("sample_kernel", "philox_kernel")

    @property
    def cap(self) -> int:
        """Candidate-list slots (a value and a token id each, in dynamic shared memory)."""
        return 8 * self.threads

    def prelude(self) -> str:
        return jit.prelude(
            OP=SAMPLE_OPS.index(self.op),
            T=self.dtype,
            OUT_T=self.out_dtype,
            VEC=self.vec,
            THREADS=self.threads,
            CAP=self.cap,
        )


def sample_spec(op: str, dtype: str, vocab: int, batch: int = 1, out_dtype: str = "int32",
                sm_count: int = 132) -> SampleSpec:  # fmt: skip
    """The spec for a [batch, vocab] call (the widest vector; narrowed at launch if needed)."""
    vec = widest_vec(vocab, itemsize(dtype))
    return SampleSpec(op, dtype, out_dtype, vec, row_threads(vocab, batch, sm_count))


def _launch(stream, ins, outs, *, op: str, names: tuple, scalars: tuple):
    a = {n: x if n == "probs" else dense(x, n) for n, x in zip(names, ins, strict=True)}
    probs, out = a["probs"], dense(outs[0], "out", output=True)
    batch, (_, vocab) = out.shape[0], probs.shape
    if batch == 0:
        return
    _, _, stride, _ = leading_rows(probs, "probs")  # the vocabulary axis must be contiguous
    device = probs.device
    sms, smem_per_block = jit.device_limits(device.id)
    spec = sample_spec(op, dtype_name(probs), vocab, batch, dtype_name(out), sms)
    spec = replace(spec, vec=fit_vec(spec.vec, probs.itemsize, [probs.data.ptr], [stride]))
    flag = outs[1] if len(outs) > 1 else 0
    if len(outs) > 1:
        import cupy

        cupy.cuda.runtime.memsetAsync(flag.data.ptr, 0, 4, stream.ptr)
    top_k, top_p, min_p, seed, offset = scalars
    k, seeds, offsets = a.get("top_k"), a.get("seed"), a.get("offset")
    args = (
        probs, np.int64(stride), np.int32(vocab), a.get("indices", 0), out,
        k if k is not None and k.dtype == np.int32 else 0,
        k if k is not None and k.dtype == np.int64 else 0,
        np.int32(top_k), a.get("top_p", 0), np.float32(top_p),
        a.get("min_p", 0), np.float32(min_p),
        0 if seeds is None else seeds, np.uint64(seed), np.int32(_entries(seeds)),
        0 if offsets is None else offsets, np.uint64(offset), np.int32(_entries(offsets)),
        flag,
    )  # fmt: skip
    cc = int(device.compute_capability)
    cluster = sampling_cluster.cluster_size(batch, vocab, spec.vec, sms, cc, smem_per_block)
    if cluster:  # a small batch: a cluster of CTAs per row
        cspec = ClusterSampleSpec(op, spec.dtype, spec.out_dtype, spec.vec, cluster)
        sampling_cluster.launch(stream, cspec, batch, vocab, args)
        return
    smem = row_smem_bytes(spec.threads)
    fn = jit.get_function(spec, "sample_kernel", dynamic_smem=smem)
    fn((batch, 1, 1), (spec.threads, 1, 1), args, stream=stream, shared_mem=smem)


def _entries(arr) -> int:
    return 0 if arr is None else arr.shape[0]


def _check_probs(probs, name="probs") -> tuple[int, int, str]:
    shape, dtype = tuple(probs.shape), dtype_name(probs)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if len(shape) != 2 or shape[1] == 0:
        raise ValueError(f"{name}: expected shape (batch, vocab) with vocab > 0, got {shape}")
    return shape[0], shape[1], dtype


def _param(name, value, batch, dtypes, kind):
    """(scalar, array or None) of a per-row parameter given as a scalar or a [batch] array."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        return kind(value), None
    shape, dtype = tuple(getattr(value, "shape", ())), dtype_name(value)
    if dtype not in dtypes or shape != (batch,):
        raise ValueError(
            f"{name}: expected a scalar or a {'/'.join(dtypes)} array of shape ({batch},), "
            f"got {dtype} of shape {shape}"
        )
    return kind(0), value


def _sample(op, probs, indices, *, top_k=0, top_p=1.0, min_p=0.0, generator=None, seed=None,
            offset=None, check_nan=False, out=None):  # fmt: skip
    rows, _, _ = _check_probs(probs)
    inputs = [("probs", probs)]
    out_dtype, batch = "int32", rows
    if indices is not None:
        out_dtype = dtype_name(indices)
        if out_dtype not in ("int32", "int64") or len(indices.shape) != 1:
            raise ValueError(
                f"indices: expected a 1-D int32 or int64 array, got {out_dtype} of shape "
                f"{tuple(indices.shape)}"
            )
        batch = indices.shape[0]
        inputs.append(("indices", indices))
    k, k_arr = _param("top_k", top_k, batch, ("int32", "int64"), int)
    p, p_arr = _param("top_p", top_p, batch, ("float32",), float)
    m, m_arr = _param("min_p", min_p, batch, ("float32",), float)
    k = max(-(2**31), min(k, 2**31 - 1))
    for name, arr in (("top_k", k_arr), ("top_p", p_arr), ("min_p", m_arr)):
        if arr is not None:
            inputs.append((name, arr))
    rand_inputs, (seed_val, offset_val) = kernel_inputs(probs, batch, generator, seed, offset)
    inputs += rand_inputs
    outputs = [Out((batch,), out_dtype, out)] + ([Out((1,), "int32")] if check_nan else [])
    result = run(_launch, inputs, outputs, op=op, names=tuple(n for n, _ in inputs),
                 scalars=(k, p, m, seed_val, offset_val))  # fmt: skip
    if not check_nan:
        return result
    samples, flag = result
    if _flag_set(flag):
        raise ValueError("probs: found NaN, negative or infinite values (check_nan=True)")
    return samples


def _flag_set(flag) -> bool:
    if framework(flag) == "torch":
        return bool(flag.item())
    return bool(int(np.asarray(flag.get() if framework(flag) == "cupy" else flag)[0]))


def sampling_from_probs(probs, indices=None, *, deterministic=True, generator=None,
                        check_nan=False, seed=None, offset=None, out=None):  # fmt: skip
    """Categorical sampling.

    samples[b] ~ probs[r] / sum(probs[r]),  r = indices[b] if indices is not None else b
    probs: [rows, vocab] float32/float16/bfloat16; indices: [batch] int32/int64 (the output
    takes its dtype, else int32). out=: a [batch] array to write (an rtcinfer extension, for
    CUDA graphs). Returns samples [batch] in the caller's array type.
    """
    return _sample("plain", probs, indices, generator=generator, seed=seed, offset=offset,
                   check_nan=check_nan, out=out)  # fmt: skip


def top_k_sampling_from_probs(probs, top_k, indices=None, *, deterministic=True,
                              generator=None, check_nan=False, seed=None, offset=None,
                              out=None):  # fmt: skip
    """Top-k sampling without sorting.

    kept = {j : count(p > p[j]) < top_k}   (ties with the k-th largest value are all kept)
    samples[b] ~ p * kept / sum(p * kept),  p = probs[indices[b] or b]
    top_k: int or [batch] int32/int64; top_k <= 0 or >= vocab keeps everything.
    """
    return _sample("top_k", probs, indices, top_k=top_k, generator=generator, seed=seed,
                   offset=offset, check_nan=check_nan, out=out)  # fmt: skip


def top_p_sampling_from_probs(probs, top_p, indices=None, *, deterministic=True,
                              generator=None, check_nan=False, seed=None, offset=None,
                              out=None):  # fmt: skip
    """Top-p (nucleus) sampling without sorting.

    kept = {j : sum(p[p > p[j]]) < top_p * sum(p)} | {argmax p}
    samples[b] ~ p * kept / sum(p * kept)
    top_p: float or [batch] float32; top_p >= 1 keeps everything, a tiny top_p keeps the max.
    """
    return _sample("top_p", probs, indices, top_p=top_p, generator=generator, seed=seed,
                   offset=offset, check_nan=check_nan, out=out)  # fmt: skip


def min_p_sampling_from_probs(probs, min_p, indices=None, *, deterministic=True,
                              generator=None, check_nan=False, seed=None, offset=None,
                              out=None):  # fmt: skip
    """Min-p sampling: kept = {j : p[j] >= min(min_p, 1) * max(p)}; samples ~ p * kept.

    min_p: float or [batch] float32; min_p <= 0 keeps everything.
    """
    return _sample("min_p", probs, indices, min_p=min_p, generator=generator, seed=seed,
                   offset=offset, check_nan=check_nan, out=out)  # fmt: skip


def top_k_top_p_sampling_from_probs(probs, top_k, top_p, indices=None, *,
                                    filter_apply_order="top_k_first", deterministic=True,
                                    generator=None, check_nan=False, seed=None, offset=None,
                                    out=None):  # fmt: skip
    """Top-k and top-p sampling in one kernel.

    "top_k_first": q = top_k_renorm(p); kept = top_p filter of q (FlashInfer's default)
    "joint":       kept = top_k filter of p & top_p filter of p
    samples[b] ~ p * kept / sum(p * kept). top_k, top_p: scalars or [batch] arrays.
    """
    if filter_apply_order not in ("top_k_first", "joint"):
        raise ValueError(
            f"filter_apply_order must be 'top_k_first' or 'joint', got {filter_apply_order!r}"
        )
    op = "top_k_first" if filter_apply_order == "top_k_first" else "top_k_top_p"
    return _sample(op, probs, indices, top_k=top_k, top_p=top_p, generator=generator,
                   seed=seed, offset=offset, check_nan=check_nan, out=out)  # fmt: skip


def sampling_from_logits(logits, indices=None, *, deterministic=True, generator=None,
                         check_nan=False, seed=None, offset=None, out=None):  # fmt: skip
    """sampling_from_probs(softmax(logits), ...): one softmax kernel, then the sampler; the
    tokens equal those of sampling_from_probs on rtcinfer's softmax for the same seed/offset."""
    probs = softmax(logits)
    return sampling_from_probs(probs, indices, generator=generator, check_nan=check_nan,
                               seed=seed, offset=offset, out=out)  # fmt: skip


def top_k_top_p_sampling_from_logits(logits, top_k, top_p, indices=None, *,
                                     filter_apply_order="top_k_first", deterministic=True,
                                     generator=None, check_nan=False, seed=None, offset=None,
                                     out=None):  # fmt: skip
    """top_k_top_p_sampling_from_probs(softmax(logits), ...) (top_k_first: the softmax of the
    top-k masked logits equals top_k_renorm of the softmax, up to rounding)."""
    return top_k_top_p_sampling_from_probs(
        softmax(logits), top_k, top_p, indices, filter_apply_order=filter_apply_order,
        generator=generator, check_nan=check_nan, seed=seed, offset=offset, out=out,
    )  # fmt: skip


top_k_renorm_prob = top_k_renorm_probs
top_p_renorm_prob = top_p_renorm_probs

__all__ = [
    "Generator",
    "SampleSpec",
    "chain_speculative_sampling",
    "min_p_sampling_from_probs",
    "sample_spec",
    "sampling_from_logits",
    "sampling_from_probs",
    "softmax",
    "top_k_mask_logits",
    "top_k_renorm_prob",
    "top_k_renorm_probs",
    "top_k_sampling_from_probs",
    "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs",
    "top_p_renorm_prob",
    "top_p_renorm_probs",
    "top_p_sampling_from_probs",
]
