"""Batch prefill with its plan passed as an array: run(q, ..., plan_array=...), as batch decode
does (attention/decode_array.py), for a step compiled or captured once and replayed while the
plan changes.

A CUDA-graph wrapper (use_cuda_graph=True) fixes the kernel, its grid, the query rows and the
plan region's layout with its first plan of a configuration; plan_array() gives each plan as
that region's int32 contents (the work items expanded on the host where plan() has the device
expand them), zero-padded to plan_array_size. run(plan_array=a), with `a` on the device, reads
the plan (and a custom mask in it) from `a` and keeps its split-KV partials and merge counters
in scratch outputs (the counters zeroed first): it reads nothing the wrapper owns, so inside
jax.jit XLA launches it itself and may record it into a command buffer, and plan() never waits.

A custom mask must then come to plan() as a host array (a device mask is copied into the plan
region on the device, which a host array cannot hold). The caches such runs were prepared
with bound the key rows (ragged) or page ids (paged) later plans may read.
"""

from __future__ import annotations

import ctypes
import weakref

import numpy as np

from ..interop import Op, OutSlot, Prepared, call, release
from ..interop.arrays import torch_compiling
from ..launch import Launch, zero_fill
from ..plan.prefill import TilePlan
from .decode_kernel import kv_scales
from .paged_kv import cache_views
from .planned import run_outputs, weak_method
from .prefill_items import expand_items_host
from .prefill_upload import items_layout

SLOTS = ("q", "k", "v", "out", "lse", "plan_array")
PLAN = SLOTS.index("plan_array")


class PrefillPlanArrays:
    """plan_array() and run(plan_array=...) of the batch prefill wrappers (a mixin of
    attention/prefill.py's _PrefillWrapper: its _graph, _fixed, _launch, _kv_layout,
    _check_kv, _run_fields)."""

    def _init_plan_arrays(self) -> None:
        self._array_rows = None  # the fewest key rows / pages a run(plan_array=) was made for
        self._array_op = Op(f"{type(self).__name__}.run", SLOTS,
                            weak_method(self, "_prepare_array_run"),
                            given=("out", "lse"))  # fmt: skip
        weakref.finalize(self, release, self._array_op)

    @property
    def plan_array_size(self) -> int:
        """The int32 count of plan_array() (fixed with the CUDA-graph capacity)."""
        self._array_launch()
        return self._fixed.capacity.plan_ints

    def plan_array(self, out=None) -> np.ndarray:
        """The latest plan as an int32 host array of plan_array_size ints, written into `out`
        (a NumPy int32 array of that length) when given: what run(plan_array=...) reads, once
        on the device."""
        st = self._array_launch()
        if st.device_mask:
            raise ValueError(
                "plan arrays carry a custom mask given to plan() as a host array; this plan's "
                "mask is on the device"
            )
        size = self.plan_array_size
        if out is None:
            out = np.zeros(size, np.int32)
        elif not isinstance(out, np.ndarray) or out.shape != (size,) or out.dtype != np.int32:
            raise ValueError(
                f"out: expected a NumPy int32 array of shape ({size},), got "
                f"{type(out).__name__} {getattr(out, 'dtype', '')} {getattr(out, 'shape', '')}"
            )
        else:
            out[st.packed.shape[0] :] = 0
        out[: st.packed.shape[0]] = st.packed
        if isinstance(st.plan, TilePlan):  # the items plan() has the device expand
            expand_items_host(out, items_layout(st.plan, self._fixed.capacity, st.cfg))
        return out

    def _array_launch(self):
        if not self._graph:
            raise ValueError(
                "plan arrays need a wrapper of fixed capacity: use_cuda_graph=True (with "
                "qo_indptr_buf, and paged_kv_indices_buf for a paged cache)"
            )
        if self._launch is None:
            raise RuntimeError("plan() must be called before plan_array()")
        return self._launch

    def _check_array_rows(self, num_kv_rows: int) -> None:
        """plan(): the keys it reads must lie in the caches run(plan_array=) was made for."""
        if self._array_rows is not None and num_kv_rows > self._array_rows:
            raise ValueError(
                f"the plan reads {num_kv_rows} key rows (pages), but run(plan_array=...) was "
                f"prepared with a cache of {self._array_rows}"
            )

    def _run_array(self, q, k, v, plan_array, out, lse, return_lse, k_scale, v_scale):
        st = self._array_launch()
        if torch_compiling(q):
            raise NotImplementedError("run(plan_array=...) is not a torch.compile custom op")
        with_lse = return_lse or lse is not None
        qk, vs = kv_scales(k_scale, v_scale)
        static = (st.cfg, st.nnz_q, self._fixed.capacity, with_lse)
        result = call(self._array_op, (q, k, v, out, lse, plan_array), static,
                      (st.cfg.attn.sm_scale * qk, vs))  # fmt: skip
        if return_lse:
            return result
        return result[0] if with_lse else result

    def _prepare_array_run(self, infos, align, static) -> Prepared:
        """run(plan_array=...)'s launch: the configuration's (a copy of the graph launch's
        block) on the call's arrays. Outputs: o (and lse), then the scratch: int32 merge
        counters [tiles * Hkv], float32 partials (o rows, then LSE)."""
        cfg, nnz_q, cap, with_lse = static
        attn = cfg.attn
        q, k, v, out, lse, plan = infos
        st = self._launch
        o_shape = (nnz_q, attn.num_qo_heads, attn.head_dim)
        if q.shape != o_shape or q.dtype != attn.q_dtype:
            raise ValueError(
                f"q: expected shape {o_shape} and dtype {attn.q_dtype} (the plan), "
                f"got {q.shape} and {q.dtype}"
            )
        self._check_kv(cfg, k, v)
        if plan.shape != (cap.plan_ints,) or plan.dtype != "int32":
            raise ValueError(
                f"plan_array: expected int32 of shape ({cap.plan_ints},) (plan_array_size), got "
                f"{plan.dtype} of shape {plan.shape}"
            )
        if st.num_kv_rows > k.shape[0]:
            raise ValueError(
                f"the plan reads {st.num_kv_rows} key rows (pages), but the cache has {k.shape[0]}"
            )
        outs = run_outputs(out, lse, o_shape, attn.o_dtype, with_lse)
        counters = cap.max_tiles * cap.num_kv_heads
        rows = cap.max_slots * cap.num_kv_heads * cap.tile_rows  # partial rows (the region's)
        scratch = (OutSlot((counters,), "int32"), OutSlot((rows * (attn.head_dim + 1),), "float32"))
        base = st.launch
        launch = Launch(base.kernel, base.grid, base.block)
        p = launch.params
        ctypes.memmove(ctypes.addressof(p), ctypes.addressof(base.params), ctypes.sizeof(p))
        empty = q.size == 0
        for name, value in ({} if empty else self._run_fields(q, k, v, out, lse, attn)).items():
            setattr(p, name, value)
        five_d = v is None
        v_offset = cache_views(k, v, self._kv_layout, k.itemsize)[1].offset if five_d else 0
        first = len(SLOTS)
        at = first + len(outs)
        mask_at = 4 * cap.mask_at if cfg.custom_mask else None
        if self._array_rows is None or k.shape[0] < self._array_rows:
            self._array_rows = k.shape[0]

        def run(stream, device, ptrs, scalars):
            if empty:
                return
            with launch.lock:
                p.q, p.k_cache, p.o, p.plan = ptrs[0], ptrs[1], ptrs[first], ptrs[PLAN]
                p.v_cache = ptrs[1] + v_offset if five_d else ptrs[2]
                p.lse = ptrs[first + 1] if with_lse else 0
                p.counters, p.partial_o = ptrs[at], ptrs[at + 1]
                p.partial_lse = ptrs[at + 1] + 4 * rows * attn.head_dim
                if mask_at is not None:
                    p.mask = ptrs[PLAN] + mask_at
                p.qk_scale, p.v_scale = scalars
                zero_fill(p.counters, counters, stream)
                launch(stream, device)

        return Prepared((*outs, *scratch), run, preload=launch.preload, scratch=len(scratch))


__all__ = ["PLAN", "SLOTS", "PrefillPlanArrays"]
