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

import numpy as np

from ..interop import OutSlot, Prepared, call
from ..launch import Launch
from ..plan.prefill import TilePlan
from .paged_kv import cache_views
from .planned import plan_array_of, plan_array_run, run_outputs
from .prefill_args import check_query
from .prefill_items import expand_items_host
from .prefill_upload import items_layout

SLOTS = ("q", "k", "v", "out", "lse", "plan_array")  # planned.plan_array_run's


class PrefillPlanArrays:
    """plan_array() and run(plan_array=...) of the batch prefill wrappers (a mixin of
    attention/prefill_wrapper.py's PrefillWrapper: its _graph, _fixed, _launch, _kv_layout,
    _check_kv, _run_fields)."""

    ARRAY_SLOTS = SLOTS

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
        out = plan_array_of(st.packed, self.plan_array_size, out)
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
        if self._array_cache is not None and num_kv_rows > self._array_cache:
            raise ValueError(
                f"the plan reads {num_kv_rows} key rows (pages), but run(plan_array=...) was "
                f"prepared with a cache of {self._array_cache}"
            )

    def _call_array(self, arrays: tuple, with_lse: bool, scalars: tuple):
        """run(plan_array=...)'s call: arrays (q, k, v, out, lse, plan_array)."""
        st = self._launch
        return call(self._array_op, arrays, (st.cfg, st.nnz_q, self._fixed.capacity, with_lse),
                    scalars)  # fmt: skip

    def _prepare_array_run(self, infos, align, static) -> Prepared:
        """run(plan_array=...)'s launch: the configuration's (a copy of the graph launch's
        block) on the call's arrays. Outputs: o (and lse), then the scratch: int32 merge
        counters [tiles * Hkv], float32 partials (o rows, then LSE)."""
        cfg, nnz_q, cap, with_lse = static
        attn = cfg.attn
        q, k, v, out, lse, plan = infos
        st = self._launch
        o_shape = check_query(q, nnz_q, cfg)
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
        scratch = (OutSlot((counters,), "int32"), OutSlot((rows * (cfg.dim_vo + 1),), "float32"))
        base = st.launch
        launch = Launch(base.kernel, base.grid, base.block)
        p = launch.params
        ctypes.memmove(ctypes.addressof(p), ctypes.addressof(base.params), ctypes.sizeof(p))
        empty = q.size == 0
        for name, value in ({} if empty else self._run_fields(q, k, v, out, lse, cfg)).items():
            setattr(p, name, value)
        v_offset = cache_views(k, v, self._kv_layout, k.itemsize)[1].offset if v is None else None
        mask_at = 4 * cap.mask_at if cfg.custom_mask else None
        run = plan_array_run(launch, len(SLOTS), with_lse, v_offset, 4 * rows * cfg.dim_vo,
                             counters, mask_at, empty)  # fmt: skip
        self._note_array_cache(k.shape[0])
        return Prepared((*outs, *scratch), run, preload=launch.preload, scratch=len(scratch))


__all__ = ["SLOTS", "PrefillPlanArrays"]
