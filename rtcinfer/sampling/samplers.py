"""The samplers of `rtcinfer.sampling` (FlashInfer's names, arguments and defaults).

Samplers draw one token per output row from probs[indices[b]] (or probs[b]) restricted to the
kept set, renormalized (cuda_src/sampling/sampling.cu: dual-pivot rejection sampling, no sort;
small batches on sm_90+ split each row over a cluster of CTAs, sampling_cluster.cu). A token
with probability <= 0 (or NaN) or outside the kept set is never returned; ids are always in
[0, vocab); a row without any positive probability returns 0. An `indices` entry outside the
rows of probs is checked on the device: its sample is -1 and it is reported as
rtcinfer.BadIndexError by the next sampler call, rtcinfer.check_errors(), or at once under
RTCINFER_CHECK=1 (rtcinfer/errors.py). Per-row parameters are scalars or [batch] device arrays.
Randomness: rtcinfer.sampling.philox (seed, offset, generator); the same seed, offset and inputs
give the same tokens. The kernels are deterministic, so `deterministic` is accepted and ignored.
check_nan=True raises ValueError when probs holds NaN, negative or infinite values; it reads one
flag back from the device (a stream synchronization, and no use under jax.jit), so leave it off
in the decode loop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from .. import errors, jit
from ..errors import BadIndex
from ..interop import (
    ArrayInfo,
    Fill,
    Op,
    OutSlot,
    Prepared,
    call,
    dense_strides,
    framework,
    one_launch,
)
from ..interop.arrays import torch_compiling, with_shortcut
from ..interop.dtypes import FLOAT_DTYPES, itemsize
from ..interop.shortcut import Shortcut
from ..launch import Kernel, Launch, zero_fill
from ..layout import (
    fit_vec,
    leading_rows,
    row_smem_bytes,
    row_thread_choices,
    row_threads,
    widest_vec,
)
from .cluster import ClusterSampleSpec, cluster_launch, cluster_size, compute_capability
from .philox import Generator, check_array, draw, kernel_inputs
from .renorm import (
    clamp_int32,
    per_row,
    top_k_mask_logits,
    top_k_renorm_probs,
    top_p_renorm_probs,
)
from .softmax import prepare_softmax, softmax
from .speculative import chain_speculative_sampling


class SampleOp(enum.IntEnum):
    PLAIN = 0
    TOP_K = 1
    TOP_P = 2
    MIN_P = 3
    TOP_K_TOP_P = 4  # FlashInfer's filter_apply_order="joint"
    TOP_K_FIRST = 5


SAMPLE_OPS = {
    "plain": SampleOp.PLAIN,
    "top_k": SampleOp.TOP_K,
    "top_p": SampleOp.TOP_P,
    "min_p": SampleOp.MIN_P,
    "top_k_top_p": SampleOp.TOP_K_TOP_P,
    "top_k_first": SampleOp.TOP_K_FIRST,
}
BY_RANK = frozenset({"top_k", "top_k_top_p", "top_k_first"})  # top-k's cut (layout.row_threads)


@dataclass(frozen=True)
class SampleSpec:
    op: str  # a key of SAMPLE_OPS
    dtype: str  # probs
    out_dtype: str  # token ids (the dtype of `indices`, else int32)
    vec: int
    threads: int
    source: ClassVar[str] = "sampling/sampling.cu"
    kernels: ClassVar[tuple[str, ...]] = ("sample_kernel", "philox_kernel")
    structs: ClassVar[tuple[str, ...]] = ("SampleParams", "PhiloxParams")  # crossing the seam

    @property
    def cap(self) -> int:
        """Candidate-list slots (a value and a token id each, in dynamic shared memory)."""
        return 8 * self.threads

    def prelude(self) -> str:
        return jit.prelude(
            OP=SAMPLE_OPS[self.op],
            T=self.dtype,
            OUT_T=self.out_dtype,
            VEC=self.vec,
            THREADS=self.threads,
            CAP=self.cap,
            BadIndex=BadIndex,
        )


def sample_spec(op: str, dtype: str, vocab: int, batch: int = 1, out_dtype: str = "int32",
                sm_count: int = 132) -> SampleSpec:  # fmt: skip
    """The spec for a [batch, vocab] call (the widest vector; prepare narrows it if needed)."""
    vec = widest_vec(vocab, itemsize(dtype))
    threads = row_threads(vocab, batch, sm_count, by_rank=op in BY_RANK)
    return SampleSpec(op, dtype, out_dtype, vec, threads)


def _check_probs(probs, name="probs") -> tuple[int, int, str]:
    shape, dtype = probs.shape, probs.dtype
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if len(shape) != 2 or shape[1] == 0:
        raise ValueError(f"{name}: expected shape (batch, vocab) with vocab > 0, got {shape}")
    return shape[0], shape[1], dtype


def _check_param(name: str, info, batch: int, dtypes: tuple[str, ...]) -> None:
    """A per-row parameter given as an array: one entry per output row."""
    if info is not None and (info.dtype not in dtypes or info.shape != (batch,)):
        raise ValueError(
            f"{name}: expected a scalar or a {'/'.join(dtypes)} array of shape ({batch},), "
            f"got a rank-{len(info.shape)} {info.dtype} array of shape {info.shape}"
        )


def _check_out(out, batch: int, dtype: str) -> None:
    if out is None:
        return
    if out.shape != (batch,) or out.dtype != dtype:
        raise ValueError(
            f"out: expected shape {(batch,)} and dtype {dtype}, "
            f"got shape {out.shape} and dtype {out.dtype}"
        )
    if not out.contiguous:  # strides in bytes, as this message has always given them
        strides = tuple(s * out.itemsize for s in out.strides)
        raise ValueError(f"out: must be contiguous (written densely), got strides {strides}")


def _sample_launch(op: str, dtype: str, out_dtype: str, batch: int, vocab: int, stride: int,
                   align: int, device: int) -> Launch:  # fmt: skip
    """sample_kernel, one CTA per row; or, for a batch too small to fill the GPU on sm_90+,
    cluster_sample_kernel, a cluster of CTAs per row. Both take SampleParams."""
    sms, smem_per_block = jit.device_limits(device)
    spec = sample_spec(op, dtype, vocab, batch, out_dtype, sms)
    spec = replace(spec, vec=fit_vec(spec.vec, itemsize(dtype), align, [stride]))
    cc = compute_capability(device)
    cluster = cluster_size(batch, vocab, spec.vec, sms, cc, smem_per_block)
    if cluster:
        cspec = ClusterSampleSpec(op, dtype, out_dtype, spec.vec, cluster)
        return cluster_launch(cspec, batch, vocab)
    kernel = Kernel(spec, "sample_kernel", "SampleParams", row_smem_bytes(spec.threads))
    return Launch(kernel, (batch, 1, 1), (spec.threads, 1, 1))


# Slots 1-6, when present, are pointers of SampleParams (top_k's field depends on its dtype).
_POINTER_FIELDS = {1: "indices", 3: "top_p_arr", 4: "min_p_arr", 5: "seed_arr", 6: "offset_arr"}
_SCALAR_FIELDS = (("top_k_val", 0), ("top_p_val", 1), ("min_p_val", 2), ("seed_val", 3),
                  ("offset_val", 4))  # fmt: skip
_OUT, _FLAG = 8, 9  # the outputs' pointers follow the 8 slots


def _prepare(infos, _align: int, static: tuple) -> Prepared:
    """Slots (probs, indices, top_k, top_p, min_p, seed, offset, out) -> samples [batch]; with
    check_nan also a [1] int32 flag, zeroed before the kernel, which sets it on a bad value."""
    op, check_nan = static
    probs, indices, top_k, top_p, min_p, seed, offset, out = infos
    rows, vocab, dtype = _check_probs(probs)
    batch, out_dtype = rows, "int32"
    if indices is not None:
        out_dtype = indices.dtype
        if out_dtype not in ("int32", "int64") or indices.ndim != 1:
            raise ValueError(
                f"indices: expected a 1-D int32 or int64 array, got {out_dtype} of shape "
                f"{indices.shape}"
            )
        batch = indices.shape[0]
    _check_param("top_k", top_k, batch, ("int32", "int64"))
    _check_param("top_p", top_p, batch, ("float32",))
    _check_param("min_p", min_p, batch, ("float32",))
    seed_len = 0 if seed is None else check_array("seed", seed, batch)
    offset_len = 0 if offset is None else check_array("offset", offset, batch)
    _check_out(out, batch, out_dtype)
    _, _, stride, _ = leading_rows(probs, "probs")  # the vocabulary axis must be contiguous
    launch = _sample_launch(op, dtype, out_dtype, batch, vocab, stride, probs.align,
                           probs.device)  # fmt: skip
    p = launch.params
    p.row_stride, p.vocab, p.seed_len, p.offset_len = stride, vocab, seed_len, offset_len
    p.num_rows = rows
    rec = errors.record(probs.device) if indices is not None else None
    check = rec is not None and errors.checking()
    pointers = [("probs", 0), ("out", _OUT)]
    pointers += [(field, i) for i, field in _POINTER_FIELDS.items() if infos[i] is not None]
    if top_k is not None:
        pointers.append(("top_k_arr" if top_k.dtype == "int32" else "top_k_arr64", 2))
    if check_nan:
        pointers.append(("error_flag", _FLAG))
    fill = Fill(tuple(pointers), _SCALAR_FIELDS)
    outs = (OutSlot((batch,), out_dtype, 7 if out is not None else None),)
    if check_nan:
        outs += (OutSlot((1,), "int32"),)
    dense = tuple(i for i in range(1, 7) if infos[i] is not None)  # arrays read by index
    # indices are read on the device (rec): a call raises what an earlier one reported
    one = one_launch(outs, launch, fill, record=rec, check=check, dense=dense)
    if not check_nan:
        return one

    def run(stream, device, ptrs, scalars):  # the flag zeroed before the launch
        zero_fill(ptrs[_FLAG], 1, stream)
        one.run(stream, device, ptrs, scalars)

    return replace(one, run=run, fill=None)  # no shortcut: it would not zero the flag


_OP = Op("sample", ("probs", "indices", "top_k", "top_p", "min_p", "seed", "offset", "out"),
         _prepare, given=("out",))  # fmt: skip


def _prepare_from_logits(infos, align: int, static: tuple) -> Prepared:
    """The sampler's slots with logits [rows, vocab] in place of probs: the softmax kernel
    writes float32 probs into a scratch output (the last one), the sampler reads them; one
    call, two launches on the stream. Outputs: the sampler's, then the scratch (not returned)."""
    soft = prepare_softmax((infos[0], None), align, ())
    shape = soft.outs[0].shape
    probs = ArrayInfo(shape, dense_strides(shape), "float32", infos[0].device)
    sample = _prepare((probs, *infos[1:]), align, static)
    scratch = len(infos) + len(sample.outs)  # the probs' pointer follows the sampler's outputs

    def run(stream, device, ptrs, scalars):
        soft.run(stream, device, (ptrs[0], 0, ptrs[scratch]), (1.0,))
        sample.run(stream, device, [ptrs[scratch], *ptrs[1:scratch]], scalars)

    def preload(device):
        soft.preload(device)
        sample.preload(device)

    outs = (*sample.outs, OutSlot(shape, "float32"))
    return Prepared(outs, run, preload=preload, dense=sample.dense, scratch=1)


_LOGITS_OP = Op("sample_from_logits", ("logits",) + _OP.slots[1:], _prepare_from_logits,
                given=("out",))  # fmt: skip


def _sample(op, probs, indices, *, top_k=0, top_p=1.0, min_p=0.0, generator=None, seed=None,
            offset=None, check_nan=False, out=None, logits=False, return_valid=False):  # fmt: skip
    """The sampler `op` on probs, or (logits=True) on softmax(probs) in the same call;
    return_valid: (samples, valid) with valid[b] whether row b has a value > 0 to draw (a row
    without one gives token 0), FlashInfer's valid flags."""
    samples = _sample_tokens(op, probs, indices, top_k, top_p, min_p, generator, seed, offset,
                             check_nan, out, logits)  # fmt: skip
    if not return_valid:
        return samples
    return samples, _valid_rows(probs, indices)


def _valid_rows(probs, indices):
    """valid[b] = any(probs[r] > 0), r = indices[b] or b (NaN and negatives are never drawn),
    in the caller's array type."""
    valid = (probs > 0).any(-1)
    if indices is None:
        return valid
    return valid[indices.long() if framework(indices) == "torch" else indices]


def _sample_tokens(op, probs, indices, top_k, top_p, min_p, generator, seed, offset, check_nan,
                   out, logits):  # fmt: skip
    if torch_compiling(probs):  # a custom op node (rtcinfer/torch_ops.py)
        from .. import torch_ops

        if logits:
            probs = softmax(probs)
        return torch_ops.sample(op, probs, indices, top_k, top_p, min_p, generator, check_nan,
                                seed, offset, out)  # fmt: skip
    k, k_arr = per_row(top_k, int)
    p, p_arr = per_row(top_p, float)
    m, m_arr = per_row(min_p, float)
    (seeds, offsets), (seed, offset) = kernel_inputs(probs, generator, seed, offset)
    arrays = (probs, indices, k_arr, p_arr, m_arr, seeds, offsets, out)
    check_nan = bool(check_nan)
    result = call(_LOGITS_OP if logits else _OP, arrays, (op, check_nan), (k, p, m, seed, offset))
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


def _order_op(filter_apply_order: str) -> str:
    if filter_apply_order not in ("top_k_first", "joint"):
        raise ValueError(
            f"filter_apply_order must be 'top_k_first' or 'joint', got {filter_apply_order!r}"
        )
    return "top_k_first" if filter_apply_order == "top_k_first" else "top_k_top_p"


_PLAIN_CALL = ("indices is None and seed is None and offset is None and not check_nan "
               "and not return_valid")  # fmt: skip


def _shortcut(op: str, k: str = "0", p: str = "1.0", m: str = "0.0", when: str = "") -> Shortcut:
    """How a sampler from probabilities calls _OP with its parameters as numbers, no indices,
    no seed arrays and none of check_nan and return_valid (interop/shortcut.py): k, p, m the
    expressions of its scalar top_k, top_p and min_p; `when` what else the parameters must be
    (a Python int top_k, a float top_p or min_p, where per_row would make an array of
    anything else)."""
    return Shortcut(_OP, ("probs", None, None, None, None, None, None, "out"),
                    f"({op}, False)", f"({k}, {p}, {m}, *draw(generator))",
                    (draw, clamp_int32, _order_op),
                    " and ".join(filter(None, (when, _PLAIN_CALL))))  # fmt: skip


@with_shortcut(_shortcut("'plain'"))
def sampling_from_probs(probs, indices=None, deterministic=True, generator=None,
                        check_nan=False, seed=None, offset=None, return_valid=False, *,
                        out=None):  # fmt: skip
    """Categorical sampling.

    samples[b] ~ probs[r] / sum(probs[r]),  r = indices[b] if indices is not None else b
    probs: [rows, vocab] float32/float16/bfloat16; indices: [batch] int32/int64 (the output
    takes its dtype, else int32). out=: a [batch] array to write (an rtcinfer extension, for
    CUDA graphs). Returns samples [batch] in the caller's array type.
    """
    return _sample("plain", probs, indices, generator=generator, seed=seed, offset=offset,
                   check_nan=check_nan, out=out, return_valid=return_valid)  # fmt: skip


@with_shortcut(_shortcut("'top_k'", k="clamp_int32(top_k)", when="type(top_k) is int"))
def top_k_sampling_from_probs(probs, top_k, indices=None, deterministic=True,
                              generator=None, check_nan=False, seed=None, offset=None,
                              return_valid=False, *, out=None):  # fmt: skip
    """Top-k sampling without sorting.

    kept = {j : count(p > p[j]) < top_k}   (ties with the k-th largest value are all kept)
    samples[b] ~ p * kept / sum(p * kept),  p = probs[indices[b] or b]
    top_k: int or [batch] int32/int64; top_k <= 0 or >= vocab keeps everything.
    """
    return _sample("top_k", probs, indices, top_k=top_k, generator=generator, seed=seed,
                   offset=offset, check_nan=check_nan, out=out,
                   return_valid=return_valid)  # fmt: skip


@with_shortcut(_shortcut("'top_p'", p="top_p", when="type(top_p) is float"))
def top_p_sampling_from_probs(probs, top_p, indices=None, deterministic=True,
                              generator=None, check_nan=False, seed=None, offset=None,
                              return_valid=False, *, out=None):  # fmt: skip
    """Top-p (nucleus) sampling without sorting.

    kept = {j : sum(p[p > p[j]]) < top_p * sum(p)} | {argmax p}
    samples[b] ~ p * kept / sum(p * kept)
    top_p: float or [batch] float32; top_p >= 1 keeps everything, a tiny top_p keeps the max.
    """
    return _sample("top_p", probs, indices, top_p=top_p, generator=generator, seed=seed,
                   offset=offset, check_nan=check_nan, out=out,
                   return_valid=return_valid)  # fmt: skip


@with_shortcut(_shortcut("'min_p'", m="min_p", when="type(min_p) is float"))
def min_p_sampling_from_probs(probs, min_p, indices=None, deterministic=True,
                              generator=None, check_nan=False, seed=None, offset=None,
                              return_valid=False, *, out=None):  # fmt: skip
    """Min-p sampling: kept = {j : p[j] >= min(min_p, 1) * max(p)}; samples ~ p * kept.

    min_p: float or [batch] float32; min_p <= 0 keeps everything.
    """
    return _sample("min_p", probs, indices, min_p=min_p, generator=generator, seed=seed,
                   offset=offset, check_nan=check_nan, out=out,
                   return_valid=return_valid)  # fmt: skip


@with_shortcut(_shortcut("_order_op(filter_apply_order)", k="clamp_int32(top_k)", p="top_p",
                         when="type(top_k) is int and type(top_p) is float"))  # fmt: skip
def top_k_top_p_sampling_from_probs(probs, top_k, top_p, indices=None,
                                    filter_apply_order="top_k_first", deterministic=True,
                                    generator=None, check_nan=False, seed=None, offset=None,
                                    return_valid=False, *, out=None):  # fmt: skip
    """Top-k and top-p sampling in one kernel.

    "top_k_first": q = top_k_renorm(p); kept = top_p filter of q (FlashInfer's default)
    "joint":       kept = top_k filter of p & top_p filter of p
    samples[b] ~ p * kept / sum(p * kept). top_k, top_p: scalars or [batch] arrays.
    """
    return _sample(_order_op(filter_apply_order), probs, indices, top_k=top_k, top_p=top_p,
                   generator=generator, seed=seed, offset=offset, check_nan=check_nan,
                   out=out, return_valid=return_valid)  # fmt: skip


def sampling_from_logits(logits, indices=None, deterministic=True, generator=None,
                         check_nan=False, seed=None, offset=None, *, out=None):  # fmt: skip
    """sampling_from_probs(softmax(logits), ...) in one call: the softmax kernel, then the
    sampler; the tokens equal those of sampling_from_probs on rtcinfer's softmax for the same
    seed/offset."""
    return _sample("plain", logits, indices, generator=generator, seed=seed, offset=offset,
                   check_nan=check_nan, out=out, logits=True)  # fmt: skip


def top_k_top_p_sampling_from_logits(logits, top_k, top_p, indices=None,
                                     filter_apply_order="top_k_first", deterministic=True,
                                     generator=None, check_nan=False, seed=None, offset=None, *,
                                     out=None):  # fmt: skip
    """top_k_top_p_sampling_from_probs(softmax(logits), ...) in one call (top_k_first: the
    softmax of the top-k masked logits equals top_k_renorm of the softmax, up to rounding)."""
    return _sample(_order_op(filter_apply_order), logits, indices, top_k=top_k, top_p=top_p,
                   generator=generator, seed=seed, offset=offset, check_nan=check_nan, out=out,
                   logits=True)  # fmt: skip


def specs_for(vocab: int, clusters: tuple[int, ...] = ()) -> list:
    """The samplers a serving loop may launch (warmup) on float32 probabilities (softmax's) of
    `vocab` tokens with int32 ids: every op at each block size a batch may get
    (row_thread_choices) and at each cluster size `clusters` (cluster.cluster_choices)."""
    vec = widest_vec(vocab, itemsize("float32"))
    specs = [SampleSpec(op, "float32", "int32", vec, threads) for op in SAMPLE_OPS
             for threads in row_thread_choices(vocab)]  # fmt: skip
    return specs + [ClusterSampleSpec(op, "float32", "int32", vec, cluster) for op in SAMPLE_OPS
                    for cluster in clusters]  # fmt: skip


top_k_renorm_prob = top_k_renorm_probs
top_p_renorm_prob = top_p_renorm_probs

__all__ = [
    "Generator",
    "SampleOp",
    "SampleSpec",
    "chain_speculative_sampling",
    "min_p_sampling_from_probs",
    "sample_spec",
    "sampling_from_logits",
    "sampling_from_probs",
    "softmax",
    "specs_for",
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
