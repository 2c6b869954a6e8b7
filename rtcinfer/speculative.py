"""Chain speculative sampling (FlashInfer's `chain_speculative_sampling`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import jit
from .interop import Out, dtype_name, run
from .interop.arrays import dense
from .interop.dtypes import FLOAT_DTYPES, itemsize
from .layout import fit_vec, row_threads, widest_vec
from .philox import kernel_inputs


@dataclass(frozen=True)
class SpeculativeSpec:
    dtype: str
    vec: int
    threads: int
    source: ClassVar[str] = "speculative.cu"
    kernels: ClassVar[tuple[str, ...]] = ("chain_speculative_kernel",)

    def prelude(self) -> str:
        return jit.prelude(
            T=self.dtype,
            VEC=self.vec,
            THREADS=self.threads,
            CAP=8 * self.threads,
        )


def speculative_spec(dtype: str, vocab: int, batch: int = 1, sm_count: int = 132, vec=None):
    vec = vec or widest_vec(vocab, itemsize(dtype))
    return SpeculativeSpec(dtype, vec, row_threads(vocab, batch, sm_count))


def _launch(stream, ins, outs, *, names: tuple, accumulate: bool, seed: int, offset: int):
    a = dict(zip(names, ins, strict=True))
    draft, ids, target = a["draft_probs"], a["draft_token_ids"], a["target_probs"]
    tokens = outs[0]
    accepted, emitted = (
        dense(x, n, output=True) for x, n in zip(outs[1:], ("accepted", "emitted"), strict=True)
    )
    batch, n, vocab = draft.shape
    if batch == 0:
        return
    for x, name in ((draft, "draft_probs"), (ids, "draft_token_ids"), (target, "target_probs")):
        if not x.flags.c_contiguous:
            raise ValueError(f"{name}: expected a contiguous array, got strides {x.strides}")
    spec = speculative_spec(dtype_name(draft), vocab, batch, jit.sm_count(draft.device.id))
    vec = fit_vec(spec.vec, draft.itemsize, [draft.data.ptr, target.data.ptr], [vocab])
    if vec != spec.vec:
        spec = speculative_spec(spec.dtype, vocab, batch, jit.sm_count(draft.device.id), vec)
    seeds, offsets = dense(a.get("seed"), "seed"), dense(a.get("offset"), "offset")
    fn = jit.get_function(spec, "chain_speculative_kernel")
    args = (
        draft, ids if ids.dtype == np.int32 else 0, ids if ids.dtype == np.int64 else 0, target,
        np.int32(n), np.int32(vocab), tokens, accepted, emitted, np.int32(accumulate),
        0 if seeds is None else seeds, np.uint64(seed), np.int32(_entries(seeds)),
        0 if offsets is None else offsets, np.uint64(offset), np.int32(_entries(offsets)),
    )  # fmt: skip
    fn((batch, 1, 1), (spec.threads, 1, 1), args, stream=stream)


def _entries(arr) -> int:
    return 0 if arr is None else arr.shape[0]


def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs,
                               maybe_output_accepted_token_num=None,
                               maybe_output_emitted_draft_token_num=None, *,
                               deterministic=True, generator=None, seed=None,
                               offset=None):  # fmt: skip
    """Verify a chain of n draft tokens per request against the target model.

    draft token i passes when u_i * draft_probs[b, i, d_i] < target_probs[b, i, d_i];
    j = first failing position (n if none); output[b, :j] = d[:j];
    output[b, j] ~ max(target[b, j] - draft[b, j], 0) (j < n) or ~ target[b, n] (bonus);
    output[b, j+1:] = -1; accepted[b] += #{i : u_i q_i < p_i}; emitted[b] += j.
    draft_probs: [batch, n, vocab], target_probs: [batch, n + 1, vocab] (float dtypes, both
    the same, contiguous); draft_token_ids: [batch, n] int32/int64. The counters, when given,
    are [batch] int32 arrays updated in place (new arrays for JAX); when None they are
    allocated. Returns (output_token_ids [batch, n + 1] int32, accepted, emitted).
    """
    d_shape, t_shape = tuple(draft_probs.shape), tuple(target_probs.shape)
    dtype = dtype_name(draft_probs)
    if dtype not in FLOAT_DTYPES or dtype_name(target_probs) != dtype:
        raise TypeError(
            f"draft_probs and target_probs must share a float dtype, got {dtype} and "
            f"{dtype_name(target_probs)}"
        )
    if len(d_shape) != 3 or t_shape != (d_shape[0], d_shape[1] + 1, d_shape[2]) or not d_shape[2]:
        raise ValueError(
            f"expected draft_probs [batch, n, vocab] and target_probs [batch, n + 1, vocab], "
            f"got {d_shape} and {t_shape}"
        )
    batch, n, _ = d_shape
    ids_dtype = dtype_name(draft_token_ids)
    if ids_dtype not in ("int32", "int64") or tuple(draft_token_ids.shape) != (batch, n):
        raise ValueError(
            f"draft_token_ids: expected int32/int64 of shape ({batch}, {n}), got {ids_dtype} "
            f"of shape {tuple(draft_token_ids.shape)}"
        )
    inputs = [("draft_probs", draft_probs), ("draft_token_ids", draft_token_ids),
              ("target_probs", target_probs)]  # fmt: skip
    counters = (maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num)
    accumulate = counters[0] is not None or counters[1] is not None
    if accumulate and (counters[0] is None or counters[1] is None):
        raise ValueError("pass both counters (accepted and emitted) or neither")
    outputs = [Out((batch, n + 1), "int32")]
    for name, c in zip(("accepted", "emitted"), counters, strict=True):
        if c is None:
            outputs.append(Out((batch,), "int32"))
            continue
        if dtype_name(c) != "int32" or tuple(c.shape) != (batch,):
            raise ValueError(
                f"{name} counter: expected int32 of shape ({batch},), got {dtype_name(c)} of "
                f"shape {tuple(c.shape)}"
            )
        outputs.append(Out((batch,), "int32", alias=len(inputs)))
        inputs.append((name, c))
    rand_inputs, (seed, offset) = kernel_inputs(draft_probs, batch, generator, seed, offset)
    inputs += rand_inputs
    return run(_launch, inputs, outputs, names=tuple(n for n, _ in inputs),
               accumulate=accumulate, seed=seed, offset=offset)  # fmt: skip


__all__ = ["SpeculativeSpec", "chain_speculative_sampling", "speculative_spec"]
