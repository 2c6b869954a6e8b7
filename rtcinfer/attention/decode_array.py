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

import weakref

import numpy as np

from ..interop import Op, OutSlot, Prepared, call, release
from ..interop.arrays import torch_compiling
from ..interop.dtypes import itemsize
from ..launch import Launch, zero_fill
from .decode_kernel import THREADS, kernel, kv_scales
from .decode_plan import Capacity
from .decode_run import check_run_arrays, run_fields
from .paged_kv import cache_views, kv_pair
from .planned import run_outputs, weak_method

SLOTS = ("q", "paged_kv_cache", "v_cache", "out", "lse", "plan_array")
PLAN = SLOTS.index("plan_array")


class PlanArrays:
    """plan_array() and run(plan_array=...) of the batch decode wrapper (a mixin of
    BatchDecodeWithPagedKVCacheWrapper: its _graph, _tc, _launch, _ws, _kernel, _kv_layout)."""

    def _init_plan_arrays(self) -> None:
        self._array_pages = None  # the fewest cache pages a run(plan_array=) was prepared with
        self._array_op = Op(f"{type(self).__name__}.run", SLOTS,
                            weak_method(self, "_prepare_array_run"),
                            given=("out", "lse"))  # fmt: skip
        weakref.finalize(self, release, self._array_op)

    @property
    def plan_array_size(self) -> int:
        """The int32 count of plan_array() (fixed by the capacity and the configuration)."""
        return self._array_capacity().plan_ints

    def plan_array(self, out=None) -> np.ndarray:
        """The latest plan as an int32 host array of plan_array_size ints (its packed plan, then
        zeros), written into `out` (a NumPy int32 array of that length) when given: what
        run(plan_array=...) reads, once on the device (attention/decode_array.py)."""
        packed = self._array_launch().packed
        size = self.plan_array_size
        if out is None:
            out = np.zeros(size, np.int32)
        elif not isinstance(out, np.ndarray) or out.shape != (size,) or out.dtype != np.int32:
            raise ValueError(
                f"out: expected a NumPy int32 array of shape ({size},), got "
                f"{type(out).__name__} {getattr(out, 'dtype', '')} {getattr(out, 'shape', '')}"
            )
        else:
            out[packed.shape[0] :] = 0
        out[: packed.shape[0]] = packed
        return out

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

    def _run_array(self, q, paged_kv_cache, plan_array, q_scale, k_scale, v_scale, out, lse,
                   return_lse, window_left):  # fmt: skip
        st = self._array_launch()
        if torch_compiling(q):
            raise NotImplementedError("run(plan_array=...) is not a torch.compile custom op")
        if window_left is not None and window_left != st.cfg.window_left:
            raise ValueError(
                f"run(window_left={window_left!r}) differs from the plan's window_left "
                f"({st.cfg.window_left}): pass None or plan() again"
            )
        k, v = kv_pair(paged_kv_cache)
        with_lse = return_lse or lse is not None
        qk, vs = kv_scales(k_scale, v_scale, q_scale)
        static = (st.cfg, self._kernel[0], self._ws.capacity, with_lse)
        result = call(self._array_op, (q, k, v, out, lse, plan_array), static,
                      (st.cfg.sm_scale * qk, vs))  # fmt: skip
        if return_lse:
            return result
        return result[0] if with_lse else result

    def _prepare_array_run(self, infos, align, static) -> Prepared:
        """run(plan_array=...)'s launch (decode_array.py); the cache bounds later page ids."""
        st = self._launch
        num_pages = infos[1].shape[0]
        if st.max_page >= num_pages:
            raise ValueError(
                f"indices holds page id {st.max_page}, but the cache has {num_pages} pages"
            )
        prep = prepare(infos, static, self._kv_layout)
        if self._array_pages is None or num_pages < self._array_pages:
            self._array_pages = num_pages
        return prep

    def _check_array_pages(self, max_page: int) -> None:
        """plan(): page ids must lie in the caches run(plan_array=) was prepared with."""
        if self._array_pages is not None and max_page >= self._array_pages:
            raise ValueError(
                f"indices holds page id {max_page}, but run(plan_array=...) was prepared with a "
                f"cache of {self._array_pages} pages"
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
    five_d = v is None
    v_offset = cache_views(k, v, kv_layout, itemsize(k.dtype))[1].offset
    first = len(SLOTS)  # o, then lse, then the scratch
    at = first + len(outs)

    def run(stream, device, ptrs, scalars):
        if empty:
            return
        with launch.lock:
            p.q, p.k_cache, p.o, p.plan = ptrs[0], ptrs[1], ptrs[first], ptrs[PLAN]
            p.v_cache = ptrs[1] + v_offset if five_d else ptrs[2]
            p.lse = ptrs[first + 1] if with_lse else 0
            p.counters, p.partial_o = ptrs[at], ptrs[at + 1]
            p.partial_lse = ptrs[at + 1] + 4 * partial_rows * d
            p.qk_scale, p.v_scale = scalars
            zero_fill(p.counters, counters, stream)
            launch(stream, device)

    return Prepared((*outs, *scratch), run, preload=launch.preload, scratch=len(scratch))


__all__ = ["PLAN", "SLOTS", "PlanArrays", "prepare"]
