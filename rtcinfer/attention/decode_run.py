"""The arrays of a batch decode run() against its plan's configuration: the checks, and the
DecodeParams fields that depend only on their signature (shared by run() on the wrapper's plan,
attention/decode.py, and run(plan_array=...), attention/decode_array.py); and the prepared
launch of run() on the wrapper's plan."""

from __future__ import annotations

import weakref

from ..interop import Planned, Prepared
from ..interop.dtypes import itemsize
from .decode_kernel import Config
from .paged_kv import cache_views, check_paged_caches, paged_cache_fields
from .planned import fill_planned, planned_fields, run_fill, run_outputs, weak_hooks


def check_run_arrays(q, k, v, cfg: Config, kv_layout: str, batch: int | None) -> None:
    """q [batch (any rows for None), Hq, D] and the cache (5-D, or a k, v pair) against the
    plan's configuration."""
    rows = q.shape[0] if batch is None and q.ndim == 3 else batch
    o_shape = (rows, cfg.num_qo_heads, cfg.head_dim)
    if q.shape != o_shape or q.dtype != cfg.q_dtype:
        raise ValueError(
            f"q: expected shape {o_shape} and dtype {cfg.q_dtype} (the plan), "
            f"got {q.shape} and {q.dtype}"
        )
    check_paged_caches(k, v, cfg, kv_layout)


def run_fields(q, k, v, out, lse, kv_layout: str, cfg: Config) -> dict:
    """The DecodeParams fields of run()'s arrays that depend only on their signature: strides
    (elements for q, o and lse; bytes for the caches), after checking what the kernel needs."""
    fields = paged_cache_fields(k, v, kv_layout)
    o_strides = (
        out.strides if out is not None else (cfg.num_qo_heads * cfg.head_dim, cfg.head_dim, 1)
    )
    lse_strides = lse.strides if lse is not None else (cfg.num_qo_heads, 1)
    if q.strides[2] != 1 or o_strides[2] != 1 or lse_strides[1] != 1:
        raise ValueError(
            f"q, out and lse must be contiguous in their last dimension, got strides (elements) "
            f"q {q.strides}, out {o_strides}, lse {lse_strides}"
        )
    fields.update(q_stride_n=q.strides[0], q_stride_h=q.strides[1], o_stride_n=o_strides[0],
                  o_stride_h=o_strides[1], lse_stride_n=lse_strides[0],
                  num_rows=q.shape[0])  # fmt: skip
    return fields


def prepared_run(wrapper, infos, static) -> Prepared:
    """The prepared launch of a decode wrapper's run() for one signature of its arrays, checked
    against the plan's configuration once. Each launch reads the wrapper's latest plan (the
    wrapper weakly held: a dropped wrapper is collected) and writes only the call's pointers
    and scalars into it."""
    cfg, batch, with_lse = static
    q, k, v, out, lse = infos
    kv_layout = wrapper._kv_layout
    five_d = v is None
    o_shape = (batch, cfg.num_qo_heads, cfg.head_dim)
    check_run_arrays(q, k, v, cfg, kv_layout, batch)
    outs = run_outputs(out, lse, o_shape, cfg.o_dtype, with_lse)
    num_pages = k.shape[0]
    empty = q.size == 0  # nothing to write (and CuPy gives empty arrays 0 strides)
    fields = {} if empty else run_fields(q, k, v, out, lse, kv_layout, cfg)
    v_offset = cache_views(k, v, kv_layout, itemsize(k.dtype))[1].offset
    fill = run_fill(v_offset if five_d else None, with_lse)
    fields, write = planned_fields(fields, with_lse), fill.function()
    ref = weakref.ref(wrapper)

    def run(stream, device, ptrs, scalars):
        wrapper = ref()
        if wrapper is None:
            raise RuntimeError("the BatchDecodeWithPagedKVCacheWrapper was deleted")
        st = wrapper._launch
        if st.batch != batch or (st.cfg is not cfg and st.cfg != cfg):
            raise RuntimeError(
                "plan() changed the batch or configuration since this run() was traced; "
                "trace it again"
            )
        if st.max_page >= num_pages:
            raise ValueError(
                f"indices holds page id {st.max_page}, but the cache has {num_pages} pages"
            )
        if empty:
            return
        launch = st.launch
        launch.lock.acquire()
        try:
            fill_planned(launch, fields, write, ptrs, scalars)
            if not launch.empty:
                wrapper._before_run(stream, st)
                launch(stream, device)
        finally:
            launch.lock.release()

    on_trace, preload = weak_hooks(wrapper)
    planned = None if empty else Planned(fields, "_st.max_page >= _limit", num_pages)
    return Prepared(tuple(outs), run, preload=preload, command_buffer=wrapper._graph,
                    on_trace=on_trace, fill=fill, planned=planned)  # fmt: skip


__all__ = ["check_run_arrays", "prepared_run", "run_fields"]
