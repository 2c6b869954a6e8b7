"""The batch decode plan built on the device (cuda_src/attention/decode_device_plan.cu).

A wrapper of fixed capacity (use_cuda_graph=True) gives, for a page table on the device,

    device_plan_array(indptr, indices, last_page_len, num_pages)
        == plan_array() after plan(indptr, indices, last_page_len, <the latest plan's arguments>)

int for int (the chunk rule of plan/decode.py's plan_decode, the layout of decode_plan.py's
pack_plan), computed by one launch on the caller's stream: its first CTA checks the table,
chooses the chunk and writes the header and the work items; the others copy the page ids
(after the capacity's room for items), each checked against the cache's num_pages. A step
that is compiled once (jax.jit) or captured once (a CUDA graph) then plans itself from the
page table it holds, so a serving loop does no planning and no plan transfer on the host.

Bad entries cannot raise where they are found: they are reported (rtcinfer/errors.py, raised
by the next call of this op or check_errors()). A bad table is planned as no work (run() with
that plan writes nothing); a page id outside the cache is read as page 0.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .. import errors, jit
from ..errors import BadIndex
from ..interop import Op, OutSlot, Prepared, call
from ..launch import Kernel, Launch
from ..plan import decode as plan_decode
from ..plan.decode import MIN_CHUNK_TOKENS
from .decode_plan import Capacity, header_ints

PLAN_THREADS = 256  # a CTA: the one that plans, and each of the page copy's
MAX_PAGE_BLOCKS = 1024
MAX_FREQ_INTS = 256  # DecodePlanParams.freq: RoPE frequencies of head_dim 256


class PlanSplit(enum.IntEnum):
    """How the chunk is chosen (plan_decode's arguments): automatically, fixed_split_size,
    disable_split_kv."""

    AUTO = 0
    FIXED = 1
    WHOLE = 2


@dataclass(frozen=True)
class DevicePlanSpec:
    source: ClassVar[str] = "attention/decode_device_plan.cu"
    kernels: ClassVar[tuple[str, ...]] = ("decode_plan_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("DecodePlanParams", "DecodeWorkItem")

    def prelude(self) -> str:
        return jit.prelude(PLAN_THREADS=PLAN_THREADS, MAX_KV_LEN=plan_decode.MAX_KV_LEN,
                           STRAGGLER_CUTS=plan_decode.STRAGGLER_CUTS, BadIndex=BadIndex,
                           PlanSplit=PlanSplit)  # fmt: skip


SPEC = DevicePlanSpec()


@dataclass(frozen=True)
class PlanRule:
    """What a wrapper's configuration and capacity fix of its plans (hashable: the RoPE
    frequencies are bytes)."""

    capacity: Capacity  # the plan array's layout: heads, head_dim, the most requests, items, pages
    page_size: int
    num_sms: int
    slots: int  # CTAs resident at once: num_sms * ctas_per_sm
    split: PlanSplit
    fixed_chunk: int  # pages (PlanSplit.FIXED), else 0
    freq: bytes  # the header's ints 4 .. header_ints (int32), empty without RoPE

    @property
    def kv_blocks(self) -> int:
        """CTAs a work item: plan_decode's num_kv_heads."""
        return self.capacity.kv_blocks

    @property
    def min_chunk(self) -> int:
        """Pages: ceil(MIN_CHUNK_TOKENS / page_size)."""
        return -(-MIN_CHUNK_TOKENS // self.page_size)

    @property
    def header_ints(self) -> int:
        return header_ints(self.capacity.head_dim)

    @property
    def max_batch(self) -> int:
        return self.capacity.max_batch

    @property
    def max_work(self) -> int:
        return self.capacity.max_work

    @property
    def max_pages(self) -> int:
        return self.capacity.max_pages

    @property
    def plan_ints(self) -> int:
        return self.capacity.plan_ints


def plan_rule(cfg, num_sms: int, ctas: int, freq, capacity: Capacity, fixed_split_size,
              disable_split_kv) -> PlanRule:  # fmt: skip
    """The rule of a wrapper's latest plan(): its configuration, the planner's view of the GPU,
    its capacity and split arguments."""
    if disable_split_kv:
        split, fixed = PlanSplit.WHOLE, 0
    elif fixed_split_size is not None:
        split, fixed = PlanSplit.FIXED, int(fixed_split_size)
    else:
        split, fixed = PlanSplit.AUTO, 0
    ints = b"" if freq is None else np.ascontiguousarray(freq, np.float32).view(np.int32).tobytes()
    return PlanRule(capacity, cfg.page_size, num_sms, num_sms * ctas, split, fixed, ints)


def _check_table(infos) -> int:
    """indptr [B + 1], indices [n], last_page_len [B]: one-dimensional int32 device arrays;
    returns B."""
    for name, x in zip(_SLOTS, infos, strict=True):
        if x.dtype != "int32" or x.ndim != 1:
            raise TypeError(
                f"{name}: expected a one-dimensional int32 array, got {x.dtype} of shape {x.shape}"
            )
    indptr, _, last = infos
    batch = last.shape[0]
    if indptr.shape != (batch + 1,):
        raise ValueError(
            f"indptr must have shape ({batch + 1},) to match last_page_len, got {indptr.shape}"
        )
    return batch


def _prepare(infos, align: int, static: tuple) -> Prepared:
    """Slots: indptr, indices, last_page_len -> the plan (int32 [rule.plan_ints]). Before it
    launches, a call raises what an earlier one reported (errors.py)."""
    rule, num_pages = static
    batch = _check_table(infos)
    if batch > rule.max_batch:
        raise ValueError(
            f"a batch of {batch} requests exceeds the wrapper's capacity ({rule.max_batch})"
        )
    blocks = min(-(-rule.max_pages // PLAN_THREADS), MAX_PAGE_BLOCKS)  # the page copy's
    launch = Launch(Kernel(SPEC, "decode_plan_kernel", "DecodePlanParams"), (1 + blocks, 1, 1),
                    (PLAN_THREADS, 1, 1))  # fmt: skip
    p = launch.params
    p.batch, p.num_indices, p.num_pages = batch, infos[1].shape[0], num_pages
    p.max_work, p.max_pages = rule.max_work, rule.max_pages
    p.page_size, p.kv_blocks = rule.page_size, rule.kv_blocks
    p.num_sms, p.slots, p.min_chunk = rule.num_sms, rule.slots, rule.min_chunk
    p.split, p.fixed_chunk, p.header_ints = int(rule.split), rule.fixed_chunk, rule.header_ints
    p.straggler_skew = plan_decode.STRAGGLER_SKEW
    p.straggler_share = plan_decode.STRAGGLER_SHARE
    freq = np.frombuffer(rule.freq, np.int32)
    p.freq[: freq.shape[0]] = freq.tolist()
    rec = errors.record(infos[0].device)
    check = errors.checking()

    def run(stream, device, ptrs, scalars):
        found = errors.before_launch(rec, device, stream)
        launch.lock.acquire()
        try:
            p.kv_indptr, p.kv_indices, p.kv_last_page_len, p.plan = ptrs[:4]
            p.bad, p.bad_host = found.device_ptr, found.host_ptr
            launch(stream, device)
        finally:
            launch.lock.release()
        if check:
            errors.check_launch(found, stream)

    dense = tuple(i for i in range(3) if not infos[i].contiguous)
    return Prepared((OutSlot((rule.plan_ints,), "int32"),), run, preload=launch.preload,
                    dense=dense)  # fmt: skip


_SLOTS = ("indptr", "indices", "last_page_len")
_OP = Op("device_plan_array", _SLOTS, _prepare)


def device_plan(rule: PlanRule, indptr, indices, last_page_len, num_pages: int):
    """The plan of `rule` for a page table on the device (module docstring), in the caller's
    array type."""
    return call(_OP, (indptr, indices, last_page_len), (rule, num_pages))


__all__ = ["SPEC", "DevicePlanSpec", "PlanRule", "PlanSplit", "device_plan", "plan_rule"]
