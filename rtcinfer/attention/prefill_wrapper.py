"""What the ragged and paged batch prefill wrappers (attention/prefill.py) share: plan() from
(qo_indptr, kv_len, page list) through the planner, the launch and the one-copy upload, the
fixed capacity of a CUDA-graph wrapper, and run(): the scales, the LSE's forms and attention
sinks around the prepared launch of the arrays' signature."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial

import numpy as np

from ..interop import Fill, Planned, Prepared
from ..interop.arrays import torch_compiling
from ..interop.dtypes import itemsize
from ..jit import device_limits
from ..launch import Launch
from ..plan.prefill import PrefillPlan, TilePlan
from . import prefill_launch as launches
from .cascade import merge_sinks_in_place
from .decode_kernel import kv_scales
from .paged_kv import cache_views
from .planned import (
    PlannedWrapper,
    fill_planned,
    kept_fill,
    planned_fields,
    run_fill,
    run_outputs,
    weak_hooks,
)
from .prefill_args import (
    PrefillConfig,
    check_query,
    io_fields,
    make_prefill_config,
    mask_capacity_bytes,
)
from .prefill_array import PrefillPlanArrays
from .prefill_mask import packed_mask
from .prefill_plan import Capacity, GraphCapacity
from .prefill_upload import plan_writers
from .run_options import finish_lse, kernel_lse


@dataclass(slots=True)
class _Launch:
    launch: Launch
    cfg: PrefillConfig
    nnz_q: int  # rows of q and o
    num_kv_rows: int  # ragged: keys the k and v arrays must hold; paged: largest page id + 1
    plan: PrefillPlan | TilePlan  # its lengths: cascade levels weigh their work by them
    packed: np.ndarray  # what the upload wrote (a view of its host buffer: plan_array())
    device_mask: bool  # a custom mask copied into the plan region on the device


class PrefillWrapper(PrefillPlanArrays, PlannedWrapper):
    """What the ragged and paged prefill wrappers share: plan() from (qo_indptr, kv_len,
    page list) and run() on (q, K view, V view). A subclass gives _check_kv(cfg, k, v) and
    _kv_fields(k, v, attn) for its cache form.

    CUDA graphs (use_cuda_graph=True, FlashInfer's rule): the first plan() of a configuration
    fixes the number of query rows; run() then always takes q (and gives o) of that many rows,
    and later plans may use fewer (rows past them are left alone) but not more, with at most
    len(qo_indptr_buf) - 1 requests (and, paged, len(paged_kv_indices_buf) pages). The kernel,
    its grid and the workspace layout stay fixed, so a graph captured around run() replays
    correctly after later plans. A custom mask travels in the workspace, at a fixed place:
    custom_mask_buf's size (bytes) is the room for it, else the first masked plan's
    (FlashInfer's mask_indptr_buf is accepted and not needed: the offsets travel in the plan).
    Such a wrapper also gives each plan as an array for run(plan_array=...)
    (attention/prefill_array.py)."""

    RUN_SLOTS = ("q", "k", "v", "out", "lse")
    RUN_GIVEN = ("out", "lse")
    # plan()'s static arguments (plan's, the custom mask flag, head_dim_vo) -> PrefillConfig
    make_config = staticmethod(make_prefill_config)

    def __init__(self, workspace=None, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf=None, max_pages=None, custom_mask_buf=None):  # fmt: skip
        super().__init__(workspace, kv_layout, use_cuda_graph)
        self._launch: _Launch | None = None
        self._mask = None  # what keeps the plan's packed custom mask alive
        self._mask_bytes = mask_capacity_bytes(custom_mask_buf)
        self._fixed: GraphCapacity | None = None
        if self._graph:
            if qo_indptr_buf is None:
                raise ValueError(
                    "use_cuda_graph=True needs qo_indptr_buf: its length fixes the batch size"
                )
            self._max_batch = int(qo_indptr_buf.shape[0]) - 1
            self._max_pages = self._max_batch if max_pages is None else int(max_pages)
            if not 0 <= self._max_batch <= launches.MAX_GRID_Y:
                raise ValueError(
                    f"qo_indptr_buf implies a capacity of {self._max_batch} requests; expected "
                    f"0 to {launches.MAX_GRID_Y}"
                )

    def _workspace_bytes(self, plan) -> tuple[int, int]:
        """PlannedWrapper._workspace_bytes, a CUDA-graph wrapper's capacity (its first plan's)
        left as it was."""
        fixed = self._fixed
        try:
            return super()._workspace_bytes(plan)
        finally:
            self._fixed = fixed

    def _setup(self, cfg: PrefillConfig) -> None:
        num_sms, max_smem = device_limits(self._device)
        self._limits = (num_sms, max_smem)
        self._kernels = {}  # chosen_kernel's cache for this configuration

    def _plan(self, qo_indptr, kv_len, first_page, page_ids, args, masks, fixed_split_size,
              disable_split_kv, num_kv_rows, head_dim_vo=None) -> None:  # fmt: skip
        """Plan (qo_indptr, kv_len) over the page list `page_ids` (request b's from
        first_page[b]) and upload it; `num_kv_rows` is how many pages run() must find;
        masks: plan()'s (custom_mask, packed_custom_mask)."""
        custom = masks[0] is not None or masks[1] is not None
        cfg = self._configure((*args, custom, head_dim_vo), self.make_config, self._setup)
        rows = int(qo_indptr[-1])
        mask = packed_mask(*masks, np.diff(qo_indptr), kv_len, self._device) if custom else None
        kw = dict(device_items=True, kernels=self._kernels, keep=partial(self._kept_launch, cfg))
        if self._graph:
            fixed = self._graph_capacity(cfg, qo_indptr, page_ids.shape[0], mask)
            launch, plan = launches.plan_launch(cfg, qo_indptr, kv_len, self._device, self._limits,
                                       fixed_split_size, disable_split_kv, fixed.tile_rows,
                                       fixed.capacity.max_work, **kw)  # fmt: skip
            capacity, rows = fixed.capacity, fixed.rows
        else:
            launch, plan = launches.plan_launch(cfg, qo_indptr, kv_len, self._device, self._limits,
                                       fixed_split_size, disable_split_kv, **kw)  # fmt: skip
            host_mask = mask is not None and mask.host is not None
            capacity = Capacity(plan.num_work, page_ids.shape[0], plan.num_tiles,
                                plan.num_slots, cfg.attn.num_kv_heads,
                                launch.kernel.spec.tile_rows, cfg.attn.head_dim,
                                mask.ints if host_mask else 0,
                                plan.batch_size if isinstance(plan, TilePlan) else 0,
                                cfg.dim_vo)  # fmt: skip
        # The mask travels with the plan (a host mask; any mask of a graph wrapper, copied
        # on the device behind the upload) or is read where it lies (a device mask).
        in_plan = mask is not None and (mask.host is not None or self._graph)
        fill, after = plan_writers(plan, capacity, cfg, qo_indptr, first_page, page_ids, mask,
                                   in_plan, self._device)  # fmt: skip
        self._check_array_rows(num_kv_rows)
        packed = []
        regions = self._upload(capacity, kept_fill(fill, packed), after)
        p = launch.params
        with launch.lock:  # a reused launch (the last plan's) may be launching in a run()
            p.plan, p.partial_o = regions["plan"], regions["o"]
            p.partial_lse, p.counters = regions["lse"], regions["counters"]
            if mask is not None:
                p.mask = regions["plan"] + 4 * capacity.mask_at if in_plan else mask.device
                self._mask = mask.keep  # a device mask read in place (or copied) stays alive
        device_mask = mask is not None and mask.host is None
        self._launch = _Launch(launch, cfg, rows, num_kv_rows, plan, packed[0], device_mask)

    def _graph_capacity(self, cfg, qo_indptr, num_pages: int, mask) -> GraphCapacity:
        """The fixed capacity of a CUDA-graph wrapper for this plan (set by the first plan of
        the configuration), after checking that the plan (and its packed mask) fits it."""
        batch, rows = qo_indptr.shape[0] - 1, int(qo_indptr[-1])
        if batch > self._max_batch or num_pages > self._max_pages:
            raise ValueError(
                f"a batch of {batch} requests and {num_pages} pages exceeds the CUDA-graph "
                f"capacity ({self._max_batch} requests, {self._max_pages} pages)"
            )
        fixed = self._fixed
        if fixed is None or fixed.cfg != cfg:
            attn = cfg.attn
            num_sms, max_smem = self._limits
            wgmma = launches.chosen_kernel(self._kernels, cfg, self._device, max_smem)
            tile_rows = launches.pick_tile_rows(cfg, qo_indptr, wgmma=wgmma)
            tiles = -(-rows * attn.group_size // tile_rows) + self._max_batch
            _, ctas = launches.chosen_kernel(self._kernels, cfg, self._device, max_smem, tile_rows)
            work = max(tiles, num_sms * ctas // attn.num_kv_heads, 1)
            mask_ints = 0
            if mask is not None:
                room = self._mask_bytes if self._mask_bytes is not None else mask.nbytes
                mask_ints = -(-room // 4)
            capacity = Capacity(work, self._max_pages, tiles, work, attn.num_kv_heads,
                                tile_rows, attn.head_dim, mask_ints, self._max_batch,
                                cfg.dim_vo)  # fmt: skip
            fixed = self._fixed = GraphCapacity(cfg, tile_rows, rows, capacity)
        elif rows > fixed.rows:
            raise ValueError(
                f"{rows} query rows, but this CUDA-graph wrapper's run() takes {fixed.rows} "
                "(fixed by its first plan): plan at most that many, padding q to it"
            )
        if mask is not None and mask.ints > fixed.capacity.max_mask_ints:
            raise ValueError(
                f"the packed custom mask takes {mask.nbytes} bytes, more than this CUDA-graph "
                f"wrapper's room ({4 * fixed.capacity.max_mask_ints} bytes, from "
                f"{'custom_mask_buf' if self._mask_bytes is not None else 'its first plan'}): "
                "give a larger custom_mask_buf to the constructor"
            )
        return fixed

    def _run(self, q, k, v, out, lse, return_lse, q_scale, k_scale, v_scale, plan_array=None,
             lse_base="log2", lse_layout="NH", window_left=None, sinks=None):  # fmt: skip
        """run() of either wrapper: (o, lse) when return_lse, else o (lse, when given, is
        written); the LSE in the base and layout asked for (run_options.py); `sinks` merged
        into the kernel's state (merge_sinks_in_place) before the LSE takes its form."""
        asked = return_lse or lse is not None
        with_lse = asked or sinks is not None
        plain_lse = lse_base == "log2" and lse_layout == "NH"  # the kernel's own form
        written = lse if plain_lse else kernel_lse(lse, lse_base, lse_layout, q.shape)
        if torch_compiling(q):  # one custom op node (rtcinfer/torch_attention.py)
            from .. import torch_attention

            result = torch_attention.run(self, q, k, v, out, written, with_lse, q_scale,
                                         k_scale, v_scale, window_left, plan_array)  # fmt: skip
        else:
            result = self._launch_run(q, k, v, out, written, with_lse, q_scale, k_scale,
                                      v_scale, plan_array, window_left)  # fmt: skip
        if sinks is not None:
            result = merge_sinks_in_place(*result, sinks)
            if not asked:
                return result[0]
        if not with_lse:
            return result
        o, s = result
        if not plain_lse:
            s = finish_lse(s, lse_base, lse_layout, lse)
        return (o, s) if return_lse else o

    def _launch_run(self, q, k, v, out, lse, with_lse, q_scale, k_scale, v_scale, plan_array,
                    window_left):  # fmt: skip
        """The kernel's part of run(): o, or (o, lse) when with_lse."""
        st = self._array_launch() if plan_array is not None else self._launch
        if st is None:
            raise RuntimeError("plan() must be called before run()")
        if window_left is not None and window_left != st.cfg.attn.window_left:
            raise ValueError(
                f"run(window_left={window_left!r}) differs from the plan's window_left "
                f"({st.cfg.attn.window_left}): pass None or plan() again"
            )
        qk, vs = kv_scales(k_scale, v_scale, q_scale)
        scalars = (st.cfg.attn.sm_scale * qk, vs)
        if plan_array is None:
            return self._call((q, k, v, out, lse), (st.cfg, st.nnz_q, with_lse), scalars)
        return self._call_array((q, k, v, out, lse, plan_array), with_lse, scalars)

    def _compiled_run(self, q, k, v, k_scale, v_scale, window_left, plan_array=None) -> tuple:
        """(o, lse) of run() with the current plan, or `plan_array` (torch_attention's ops at
        run time)."""
        return self._launch_run(q, k, v, None, None, True, None, k_scale, v_scale, plan_array,
                                window_left)  # fmt: skip

    def _plan_o_dtype(self) -> str:
        """The current plan's output dtype (torch_attention's fake outputs)."""
        if self._launch is None:
            raise RuntimeError("plan() must be called before run()")
        return self._launch.cfg.attn.o_dtype

    def _plan_o_shape(self, q_shape: tuple) -> tuple:
        """o's shape for q of `q_shape` under the current plan (its head_dim_vo)."""
        if self._launch is None:
            raise RuntimeError("plan() must be called before run()")
        return (*q_shape[:-1], self._launch.cfg.dim_vo)

    def _prepare_run(self, infos, align, static) -> Prepared:
        cfg, nnz_q, with_lse = static
        attn = cfg.attn
        q, k, v, out, lse = infos
        o_shape = check_query(q, nnz_q, cfg)
        self._check_kv(cfg, k, v)
        outs = run_outputs(out, lse, o_shape, attn.o_dtype, with_lse)
        empty = q.size == 0
        fields = {} if empty else self._run_fields(q, k, v, out, lse, cfg)
        five_d = v is None  # one [pages, 2, ...] array: V is K shifted by one step of dim 1
        v_offset = cache_views(k, v, self._kv_layout, itemsize(k.dtype))[1].offset if five_d else 0
        return self._prepared(outs, static, k.shape[0], empty, fields,
                              v_offset if five_d else None)  # fmt: skip

    def _prepared(self, outs, static, num_kv_rows: int, empty: bool, fields: dict,
                  v_offset: int | None = None, fill: Fill | None = None) -> Prepared:  # fmt: skip
        """The Prepared of a run() on the current plan, whose launch checks first that the plan
        is still the one `static` (cfg, nnz_q, with_lse) was made for and that the cache's
        num_kv_rows rows (pages) hold the ones it reads, then, under the launch's lock, fills
        in the signature's fields and the call's pointers and scalars (run_fill's, or `fill`
        for other slots) and launches (nothing when `empty`). The wrappers' run shortcut
        (prepared.Planned) does the same."""
        cfg, nnz_q, with_lse = static
        ref = weakref.ref(self)
        fill = fill if fill is not None else run_fill(v_offset, with_lse)
        fields = planned_fields(fields, with_lse)
        write = fill.function()

        def run(stream, device, ptrs, scalars):
            wrapper = ref()
            if wrapper is None:
                raise RuntimeError(f"the {type(self).__name__} was deleted")
            st = wrapper._launch
            if st.nnz_q != nnz_q or (st.cfg is not cfg and st.cfg != cfg):
                raise RuntimeError("plan() changed the batch or configuration since this run()")
            if st.num_kv_rows > num_kv_rows:
                raise ValueError(
                    f"the plan reads {st.num_kv_rows} key rows (pages), but the cache has "
                    f"{num_kv_rows}"
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

        on_trace, preload = weak_hooks(self)
        planned = None if empty else Planned(fields, "_st.num_kv_rows > _limit", num_kv_rows)
        return Prepared(tuple(outs), run, preload=preload, command_buffer=self._graph,
                        on_trace=on_trace, fill=fill, planned=planned)  # fmt: skip

    def _run_fields(self, q, k, v, out, lse, cfg: PrefillConfig) -> dict:
        fields = self._kv_fields(k, v, cfg.attn)
        fields.update(io_fields(q, out, lse, cfg))
        return fields


__all__ = ["PrefillWrapper"]
