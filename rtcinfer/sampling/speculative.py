"""Chain speculative sampling (FlashInfer's `chain_speculative_sampling`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import jit
from ..interop import Fill, Op, OutSlot, Prepared, call, dense_strides, one_launch
from ..interop.arrays import torch_compiling, with_shortcut
from ..interop.dtypes import FLOAT_DTYPES, itemsize
from ..interop.shortcut import Shortcut
from ..launch import Kernel, Launch
from ..layout import fit_vec, row_threads, widest_vec
from .philox import check_array, draw, kernel_inputs


@dataclass(frozen=True)
class SpeculativeSpec:
    dtype: str
    vec: int
    threads: int
    source: ClassVar[str] = "sampling/speculative.cu"
    kernels: ClassVar[tuple[str, ...]] = ("chain_speculative_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("SpeculativeParams",)  # crossing the seam

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


def _byte_strides(info) -> tuple[int, ...]:
    """Strides in bytes, as these messages have always given them."""
    return tuple(s * info.itemsize for s in info.strides)


def _check(draft, ids, target, accepted, emitted) -> tuple[int, int, int]:
    """(batch, n, vocab) of valid arguments."""
    d_shape, t_shape, dtype = draft.shape, target.shape, draft.dtype
    if dtype not in FLOAT_DTYPES or target.dtype != dtype:
        raise TypeError(
            f"draft_probs and target_probs must share a float dtype, got {dtype} and {target.dtype}"
        )
    if len(d_shape) != 3 or t_shape != (d_shape[0], d_shape[1] + 1, d_shape[2]) or not d_shape[2]:
        raise ValueError(
            f"expected draft_probs [batch, n, vocab] and target_probs [batch, n + 1, vocab], "
            f"got {d_shape} and {t_shape}"
        )
    batch, n, vocab = d_shape
    if ids.dtype not in ("int32", "int64") or ids.shape != (batch, n):
        raise ValueError(
            f"draft_token_ids: expected int32/int64 of shape ({batch}, {n}), got {ids.dtype} "
            f"of shape {ids.shape}"
        )
    if (accepted is None) != (emitted is None):
        raise ValueError("pass both counters (accepted and emitted) or neither")
    for name, c in (("accepted", accepted), ("emitted", emitted)):
        if c is not None and (c.dtype != "int32" or c.shape != (batch,)):
            raise ValueError(
                f"{name} counter: expected int32 of shape ({batch},), got {c.dtype} of "
                f"shape {c.shape}"
            )
    return batch, n, vocab


def _dense(info) -> bool:
    """C-contiguous as CuPy and PyTorch judge it: the strides of size-1 dims do not matter."""
    dims = zip(info.shape, info.strides, dense_strides(info.shape), strict=True)
    return info.size == 0 or all(n == 1 or s == d for n, s, d in dims)


def _check_dense(draft, ids, target, accepted, emitted) -> None:
    """The kernel indexes every array as dense."""
    for name, c in (("accepted", accepted), ("emitted", emitted)):
        if c is not None and not _dense(c):
            raise ValueError(
                f"{name}: must be contiguous (written densely), got strides {_byte_strides(c)}"
            )
    for x, name in ((draft, "draft_probs"), (ids, "draft_token_ids"), (target, "target_probs")):
        if not _dense(x):
            raise ValueError(f"{name}: expected a contiguous array, got strides {_byte_strides(x)}")


def _prepare(infos, _align: int, static: tuple) -> Prepared:
    """Slots (draft_probs, draft_token_ids, target_probs, accepted, emitted, seed, offset) ->
    (output_token_ids [batch, n + 1], accepted [batch], emitted [batch]); counters that are
    given are updated in place. Scalars: (seed, offset)."""
    draft, ids, target, accepted, emitted, seed, offset = infos
    batch, n, vocab = _check(draft, ids, target, accepted, emitted)
    seed_len = 0 if seed is None else check_array("seed", seed, batch)
    offset_len = 0 if offset is None else check_array("offset", offset, batch)
    _check_dense(draft, ids, target, accepted, emitted)
    sms = jit.device_limits(draft.device)[0]
    spec = speculative_spec(draft.dtype, vocab, batch, sms)
    vec = fit_vec(spec.vec, draft.itemsize, min(draft.align, target.align), [vocab])
    if vec != spec.vec:
        spec = speculative_spec(draft.dtype, vocab, batch, sms, vec)
    launch = Launch(Kernel(spec, "chain_speculative_kernel", "SpeculativeParams"), (batch, 1, 1),
                    (spec.threads, 1, 1))  # fmt: skip
    p = launch.params
    accumulate = accepted is not None  # add to the given counters
    p.n, p.vocab, p.accumulate = n, vocab, int(accumulate)
    p.seed_len, p.offset_len = seed_len, offset_len
    fill = Fill((("draft_probs", 0), ("target_probs", 2),
                 ("draft_ids" if ids.dtype == "int32" else "draft_ids64", 1), ("seed_arr", 5),
                 ("offset_arr", 6), ("out_tokens", 7), ("accepted", 8), ("emitted", 9)),
                (("seed_val", 0), ("offset_val", 1)))  # fmt: skip
    outs = (
        OutSlot((batch, n + 1), "int32"),
        OutSlot((batch,), "int32", 3 if accumulate else None, alias=accumulate),
        OutSlot((batch,), "int32", 4 if accumulate else None, alias=accumulate),
    )
    dense = tuple(i for i in (5, 6) if infos[i] is not None)  # seed and offset arrays
    return one_launch(outs, launch, fill, dense=dense)


_SLOTS = ("draft_probs", "draft_token_ids", "target_probs", "accepted", "emitted", "seed", "offset")
_OP = Op("chain_speculative_sampling", _SLOTS, _prepare)


@with_shortcut(Shortcut(  # new counters, the seed and offset drawn from the generator
    _OP, ("draft_probs", "draft_token_ids", "target_probs", None, None, None, None), "()",
    "draw(generator)", (draw,),
    "maybe_output_accepted_token_num is None and maybe_output_emitted_draft_token_num is None "
    "and seed is None and offset is None"))  # fmt: skip
def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs,
                               maybe_output_accepted_token_num=None,
                               maybe_output_emitted_draft_token_num=None,
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
    if torch_compiling(draft_probs):  # a custom op node (rtcinfer/torch_ops.py)
        from .. import torch_ops

        return torch_ops.speculative_sampling(
            draft_probs, draft_token_ids, target_probs, maybe_output_accepted_token_num,
            maybe_output_emitted_draft_token_num, deterministic, generator, seed, offset,
        )  # fmt: skip
    (seeds, offsets), scalars = kernel_inputs(draft_probs, generator, seed, offset)
    arrays = (draft_probs, draft_token_ids, target_probs, maybe_output_accepted_token_num,
              maybe_output_emitted_draft_token_num, seeds, offsets)  # fmt: skip
    return call(_OP, arrays, (), scalars)


__all__ = ["SpeculativeSpec", "chain_speculative_sampling", "speculative_spec"]
