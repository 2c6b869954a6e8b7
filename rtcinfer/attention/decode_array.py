"""Batch decode with its plan passed as an array: run(q, cache, plan_array=...), for a step that
is compiled or captured once and replayed while the plan changes (jax.jit, XLA command buffers,
CUDA graphs).

A wrapper of fixed capacity (use_cuda_graph=True) packs every plan() into an int32 array of one
size, plan_array_size: the header, the work items and the page ids (decode_plan.py), then
zeros. The caller sends it to the device with the step's other tables and passes it to run().
The launch reads the plan from that array and keeps its split-KV partials and merge counters in
scratch outputs of the call (the counters zeroed before it), so it reads nothing the wrapper
owns: inside jax.jit XLA launches it itself (interop/xla_launch.py) and may record it into a
command buffer, and a new plan needs neither a new trace nor a host wait.

    o[b] = decode of q[b] over request b of the plan   (b < the plan's batch)

The grid is the capacity's (kv blocks x its most work items); items past the plan's count exit
at once, and so do those of requests past q's rows (a plan for a larger batch, which the arrays
cannot refuse): rows of o past the plan's batch are not written.
"""

from __future__ import annotations

import numpy as np

from ..interop import OutSlot, Prepared, call
from ..interop.arrays import torch_compiling
from ..interop.dtypes import itemsize
from ..launch import Launch
from ..plan._checks import INT32_MAX, as_int
from .decode_device_plan import PlanRule, device_plan, plan_rule
from .decode_kernel import THREADS, kernel
from .decode_plan import Capacity
from .decode_run import check_run_arrays, run_fields
from .paged_kv import cache_views
from .planned import plan_array_of, plan_array_run, run_outputs

SLOTS = ("q", "paged_kv_cache", "v_cache", "out", "lse", "plan_array")  # planned.plan_array_run's


class PlanArrays:
    """plan_array(), device_plan_array() and run(plan_array=...) of the batch decode wrapper (a
    mixin of BatchDecodeWithPagedKVCacheWrapper: its _graph, _tc, _launch, _ws, _kernel,
    _kv_layout, _split_args: the latest plan()'s (fixed_split_size, disable_split_kv))."""

    ARRAY_SLOTS = SLOTS
    _device_pages = 0  # the most pages a device_plan_array call named
    _rule = None  # (the plan's _launch the rule was made for, the rule)

    @property
    def plan_array_size(self) -> int:
        """The int32 count of plan_array() (fixed by the capacity and the configuration)."""
        return self._array_capacity().plan_ints

    def plan_array(self, out=None) -> np.ndarray:
        """The latest plan as an int32 host array of plan_array_size ints (its packed plan, then
        zeros), written into `out` (a NumPy int32 array of that length) when given: what
        run(plan_array=...) reads, once on the device (attention/decode_array.py)."""
        return plan_array_of(self._array_launch().packed, self.plan_array_size, out)

    def device_plan_array(self, indptr, indices, last_page_len, num_pages: int):
        """plan_array() of plan(indptr, indices, last_page_len, ...) with the latest plan()'s
        configuration and split arguments, built on the device from the page table where it
        lies (attention/decode_device_plan.py): no host work, no transfer, and inside jax.jit
        or a CUDA graph a plan that follows each step's table.

        indptr [B + 1], indices, last_page_len [B]: int32 device arrays of one framework
        (B at most the capacity's batch); num_pages: the cache's pages, which every page id must
        name (run(plan_array=...) refuses a smaller cache). Returns an int32 array of
        plan_array_size in the caller's array type, written on its current stream. Bad entries
        are reported, not raised (BadIndexError from the next call or check_errors()): a bad
        table plans no work, a page id outside the cache is read as page 0.
        """
        if torch_compiling(indptr):  # one custom op node (rtcinfer/torch_attention.py)
            from .. import torch_attention

            return torch_attention.device_plan(self, indptr, indices, last_page_len, num_pages)
        self._array_launch()
        num_pages = as_int("num_pages", num_pages, minimum=1)
        if num_pages > INT32_MAX:
            raise ValueError(f"num_pages ({num_pages}) exceeds {INT32_MAX} (int32 tables)")
        self._check_array_pages(num_pages - 1)
        self._device_pages = max(self._device_pages, num_pages)
        return device_plan(self._plan_rule(), indptr, indices, last_page_len, num_pages)

    def _plan_rule(self) -> PlanRule:
        """The latest plan()'s rule, made once per plan() (each makes a new _launch)."""
        if self._rule is None or self._rule[0] is not self._launch:
            spec, ctas, num_sms, freq = self._kernel
            fixed, whole = self._split_args
            rule = plan_rule(self._launch.cfg, num_sms, ctas, freq, self._ws.capacity, fixed,
                             whole)  # fmt: skip
            self._rule = (self._launch, rule)
        return self._rule[1]

    def _array_launch(self):
        if not self._graph or self._tc is not None:
            raise ValueError(
                "plan arrays need a wrapper of fixed capacity on the decode kernel: "
                "use_cuda_graph=True (with paged_kv_indptr_buffer and paged_kv_indices_buffer) "
                "and use_tensor_cores=False"
            )
        if self._launch is None:
            raise RuntimeError("plan() must be called before plan_array()")
        return self._launch

    def _array_capacity(self) -> Capacity:
        self._array_launch()
        return self._ws.capacity

    def _call_array(self, arrays: tuple, with_lse: bool, scalars: tuple):
        """run(plan_array=...)'s call: arrays (q, k, v, out, lse, plan_array)."""
        st = self._launch
        static = (st.cfg, self._kernel[0], self._ws.capacity, with_lse)
        return call(self._array_op, arrays, static, scalars)

    def _prepare_array_run(self, infos, align, static) -> Prepared:
        """run(plan_array=...)'s launch (decode_array.py); the cache bounds later page ids."""
        st = self._launch
        num_pages = infos[1].shape[0]
        if st.max_page >= num_pages:
            raise ValueError(
                f"indices holds page id {st.max_page}, but the cache has {num_pages} pages"
            )
        if self._device_pages > num_pages:
            raise ValueError(
                f"device_plan_array was given num_pages={self._device_pages}, but the cache "
                f"has {num_pages} pages"
            )
        prep = prepare(infos, static, self._kv_layout)
        self._note_array_cache(num_pages)
        return prep

    def _check_array_pages(self, max_page: int) -> None:
        """plan(): page ids must lie in the caches run(plan_array=) was prepared with."""
        if self._array_cache is not None and max_page >= self._array_cache:
            raise ValueError(
                f"indices holds page id {max_page}, but run(plan_array=...) was prepared with a "
                f"cache of {self._array_cache} pages"
            )


def prepare(infos, static, kv_layout: str) -> Prepared:
    """The launch of run(plan_array=...) for one signature. static: (cfg, spec, capacity,
    with_lse). Outputs: o (and lse), then the scratch: int32 merge counters
    [max_batch * kv_blocks], float32 partials (o rows, then LSE)."""
    cfg, spec, cap, with_lse = static
    q, k, v, out, lse, plan = infos
    check_run_arrays(q, k, v, cfg, kv_layout, None)
    if plan.shape != (cap.plan_ints,) or plan.dtype != "int32":
        raise ValueError(
            f"plan_array: expected int32 of shape ({cap.plan_ints},) (plan_array_size), got "
            f"{plan.dtype} of shape {plan.shape}"
        )
    rows, d = q.shape[0], cfg.head_dim
    outs = run_outputs(out, lse, (rows, cfg.num_qo_heads, d), cfg.o_dtype, with_lse)
    counters = cap.max_batch * cfg.kv_blocks
    partial_rows = cap.max_work * cfg.num_qo_heads  # strided by the grid's items (decode.cu)
    scratch = (OutSlot((counters,), "int32"), OutSlot((partial_rows * (d + 1),), "float32"))
    launch = Launch(kernel(spec), (cfg.kv_blocks, cap.max_work, 1), (THREADS, 1, 1))
    p = launch.params
    cfg.fill(p)
    empty = q.size == 0
    for name, value in ({} if empty else run_fields(q, k, v, out, lse, kv_layout, cfg)).items():
        setattr(p, name, value)
    v_offset = cache_views(k, v, kv_layout, itemsize(k.dtype))[1].offset if v is None else None
    run = plan_array_run(launch, len(SLOTS), with_lse, v_offset, 4 * partial_rows * d, counters,
                         empty=empty)  # fmt: skip
    return Prepared((*outs, *scratch), run, preload=launch.preload, scratch=len(scratch))


__all__ = ["SLOTS", "PlanArrays", "prepare"]
