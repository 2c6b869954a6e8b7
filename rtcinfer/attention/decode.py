"""Batch decode over a paged KV cache, plan() then run() (FlashInfer's names).

    s_j = q . k_j * sm_scale * q_scale * k_scale (+ ALiBi slope * (j - (kv_len - 1)), then cap)
    o = softmax(s) @ V * v_scale;  lse = log2(sum_j exp(s_j))  (o = 0, lse = -inf if empty)

The decode kernel runs on tensor cores for every group size (the query heads of a group are
the MMA's n dimension). ``use_tensor_cores=True`` takes FlashInfer's other route: the batch
prefill kernel with one query per request, the group's heads packed into its query tiles (8
rows up to a group of 8, the heads on the MMA's n side as here; 16 rows up to 16; 64 beyond:
attention/prefill.py); same results, another kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from ..interop import Prepared
from ..interop.arrays import torch_compiling, with_shortcut
from ..jit import device_limits
from ..launch import Launch
from ..plan._checks import as_int
from ..plan.decode import plan_decode
from .cascade import merge_sinks_in_place
from .decode_array import PlanArrays
from .decode_kernel import THREADS, Config, ctas_per_sm, kernel, kv_scales, make_config, plan_kernel
from .decode_plan import Capacity, pack_plan
from .decode_run import prepared_run
from .decode_tensor_cores import plan_tensor_cores
from .deprecated_forms import DecodeForward
from .paged_kv import kv_pair, page_table_ids
from .planned import PAGED_KV, PLAIN_RUN, PlannedWrapper, host_ints, kept_fill, run_shortcut
from .prefill import BatchPrefillWithPagedKVCacheWrapper
from .prefill_args import check_backend
from .run_options import refuse

MAX_GRID_Y = 65535  # work items are the grid's second dimension


@dataclass(slots=True)
class _Launch:
    """What run() needs from the latest plan() (not frozen: a frozen dataclass costs a
    microsecond more to build, and plan() builds one every step)."""

    launch: Launch  # the kernel, its grid and its block: plan and configuration fields filled
    cfg: Config
    batch: int  # rows of q and o
    max_page: int  # largest page id in kv_indices (-1 without pages)
    packed: np.ndarray  # the packed plan (a view of the upload's host buffer: plan_array())


# plan()'s keywords that FlashInfer 0.7.2 still takes positionally after page_size, in order
PLAN_POSITIONAL = ("pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type",
                   "kv_data_type", "o_data_type", "data_type", "sm_scale", "rope_scale",
                   "rope_theta", "non_blocking", "block_tables", "seq_lens", "fixed_split_size",
                   "disable_split_kv", "q_len_per_req")  # fmt: skip


class BatchDecodeWithPagedKVCacheWrapper(DecodeForward, PlanArrays, PlannedWrapper):
    """Batch decode over a paged KV cache: plan() once per step, run() for every layer.

        pages_b = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
        kv_len_b = (len(pages_b) - 1) * page_size + kv_last_page_len[b]   (0 without pages)
        o[b], lse[b] = single_decode(q[b], K[pages_b][:kv_len_b], V[pages_b][:kv_len_b], ...)

    workspace: optional CUDA byte buffer (any framework) holding the plan, split-KV partials
    and merge counters; None allocates one on the current CuPy device.

    CUDA graphs: use_cuda_graph=True fixes capacities from the lengths of
    paged_kv_indptr_buffer (max batch + 1) and paged_kv_indices_buffer (max pages), whose
    contents are not used. Every launch argument then stays the same across plans, so a graph
    captured around run() replays correctly after a new plan() with the same configuration and
    at most the captured batch size (rows past the batch are left alone); plan() refuses a
    larger batch once a run() has been captured.
    The work-item capacity, set by the first plan(), is max(max batch, what the automatic
    split uses); a fixed_split_size plan must fit in it. Without graphs, plan() may pick a
    variant of the kernel (one K/V tile in flight ahead, for long requests in pages of at
    least a tile; tiles of half the tokens for fp8 KV in plans of whole requests:
    decode_kernel.plan_kernel); with them it keeps one kernel.

    Streams (attention/planned.py): plan() uploads on CuPy's current stream, run() may be on
    any stream, ordered by events. One run() at a time per wrapper: the merge counters are
    shared.

    Plan arrays (attention/decode_array.py): with use_cuda_graph=True, plan_array() gives each
    plan as an int32 array of one size (plan_array_size); run(q, cache, plan_array=a), with a
    on the device, reads the plan from it and nothing from the wrapper, so a step compiled once
    (jax.jit: launched by XLA itself, recorded into its command buffers) serves every later
    plan of the configuration, with no host wait in plan(). The caches such runs were prepared
    with bound the page ids later plans may hold.

    JAX (eager or inside jax.jit): a run() traced with one plan serves every later plan of the
    same batch size and configuration. A plain wrapper's launch follows each plan (its grid,
    its kernel variant), so XLA calls it on every execution and never records it into a
    command buffer; a use_cuda_graph wrapper's launch is fixed by its capacity, so XLA may
    record it and replay it after later plans. Once it has run under JAX, every plan() waits on
    the host for its upload. A traced run() holds the wrapper weakly: once the wrapper is
    deleted, a computation that still calls it raises (a replayed command buffer would write
    the freed workspace: keep the wrapper while its computations may run).
    """

    RUN_SLOTS = ("q", "paged_kv_cache", "v_cache", "out", "lse")
    RUN_GIVEN = ("out", "lse")

    def __init__(
        self, float_workspace_buffer=None, kv_layout="NHD", use_cuda_graph=False,
        use_tensor_cores=False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None, backend="auto", jit_args=None,
    ):  # fmt: skip
        check_backend(backend, jit_args)
        self._backend = backend
        workspace = float_workspace_buffer
        super().__init__(workspace, kv_layout, use_cuda_graph)
        if self._graph:
            if paged_kv_indptr_buffer is None or paged_kv_indices_buffer is None:
                raise ValueError(
                    "use_cuda_graph=True needs paged_kv_indptr_buffer and "
                    "paged_kv_indices_buffer: their lengths fix the capacity"
                )
            self._max_batch = int(paged_kv_indptr_buffer.shape[0]) - 1
            self._max_pages = int(paged_kv_indices_buffer.shape[0])
            if not 0 <= self._max_batch <= MAX_GRID_Y:
                raise ValueError(
                    f"paged_kv_indptr_buffer implies a capacity of {self._max_batch} requests; "
                    f"expected 0 to {MAX_GRID_Y}"
                )
            last = paged_kv_last_page_len_buffer
            if last is not None and int(last.shape[0]) != self._max_batch:
                raise ValueError(
                    f"paged_kv_last_page_len_buffer has {int(last.shape[0])} entries, "
                    f"paged_kv_indptr_buffer implies {self._max_batch}"
                )
        self._launch: _Launch | None = None
        self._q_len = 1  # queries a request of the latest plan (q_len_per_req)
        self._tc = None  # use_tensor_cores: the prefill wrapper that serves plan() and run()
        if use_tensor_cores:
            self._tc = BatchPrefillWithPagedKVCacheWrapper(
                workspace, kv_layout, use_cuda_graph, qo_indptr_buf=paged_kv_indptr_buffer,
                paged_kv_indices_buf=paged_kv_indices_buffer,
            )  # fmt: skip

    @property
    def use_tensor_cores(self) -> bool:
        """Whether plan() and run() go through the prefill kernel (use_tensor_cores=True)."""
        return self._tc is not None

    @property
    def resolved_backend(self) -> str:
        """FlashInfer's name for what backend="auto" resolved to: "fa2" for the CUDA-core
        decode; with use_tensor_cores=True the prefill kernel the latest plan launches, "fa3"
        where it multiplies with warpgroup MMAs (sm_90a), "fa2" where with mma.sync ("auto"
        before the first plan). A backend given by name reports itself, as FlashInfer's."""
        if self._backend != "auto":
            return self._backend
        if self._tc is None:
            return "fa2"
        planned = self._tc._launch
        if planned is None:
            return "auto"
        return "fa3" if planned.launch.kernel.spec.wgmma else "fa2"

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None) -> None:
        """PlannedWrapper.reset_workspace_buffer, for the prefill wrapper of
        use_tensor_cores=True too."""
        super().reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)
        if self._tc is not None:
            self._tc.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def _setup(self, cfg: Config) -> None:
        """A new configuration: its kernel, the planner's view of the GPU, graph capacity."""
        num_sms, max_smem = device_limits(self._device)
        spec = cfg.spec(max_smem)
        ctas = ctas_per_sm(spec, self._device)
        self._kernel = (spec, ctas, num_sms, cfg.freq())
        if self._graph:  # the most work items an automatic split makes, or two per request
            # (room to cut a straggler: plan/decode.py's _straggler_chunk fits its chunk to it)
            self._max_work = max(2 * self._max_batch, num_sms * ctas // cfg.kv_blocks, 1)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *deprecated_positional_args, **kwargs) -> None:  # fmt: skip
        """Validate the batch on the host, choose the split-KV work list, upload it (one copy).
        The keywords are _plan's; as in FlashInfer 0.7.2, the ones of PLAN_POSITIONAL may
        also follow page_size in that order (FlashInfer's deprecated form)."""
        if len(deprecated_positional_args) > len(PLAN_POSITIONAL):
            raise TypeError(
                f"plan() takes at most {len(PLAN_POSITIONAL)} optional arguments after "
                f"page_size positionally, got {len(deprecated_positional_args)}"
            )
        for name, value in zip(PLAN_POSITIONAL, deprecated_positional_args, strict=False):
            if name in kwargs:
                raise TypeError(f"plan() got multiple values for argument {name!r}")
            kwargs[name] = value
        self._plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                   page_size, **kwargs)  # fmt: skip

    def workspace_size(
        self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
        pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
        kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
        rope_theta=None, block_tables=None, seq_lens=None, fixed_split_size=None,
        disable_split_kv=False, q_len_per_req=1,
    ) -> tuple[int, int]:  # fmt: skip
        """FlashInfer's workspace_size(): (float workspace bytes, int workspace bytes) that
        plan() with these arguments needs (PlannedWrapper._workspace_bytes; with tensor cores,
        its prefill wrapper's); this wrapper's own plan is unchanged."""
        options = dict(locals())
        del options["self"]
        sized = self if self._tc is None else self._tc
        return sized._workspace_bytes(lambda: self.plan(**options))

    def _plan(
        self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
        *, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
        q_data_type="float16", kv_data_type=None, o_data_type=None, sm_scale=None,
        rope_scale=None, rope_theta=None, fixed_split_size=None, disable_split_kv=False,
        non_blocking=True, data_type=None, block_tables=None, seq_lens=None, q_len_per_req=1,
        window_right=0, is_causal=None,
    ) -> None:  # fmt: skip
        """plan() with its keywords bound.

        indptr [B + 1], indices [indptr[-1]], last_page_len [B]: integer arrays, host (no sync)
        or device (one device-to-host copy each). Page ids are checked against the cache in
        run(). fixed_split_size (pages per chunk) makes results batch-invariant; -1, as in
        FlashInfer, means None. non_blocking is accepted for drop-in compatibility: host arrays
        never wait for the device and device arrays are always copied, whatever its value.
        data_type, FlashInfer's older name, stands for q_data_type when that is None and for
        kv_data_type when that is; block_tables and seq_lens (read by FlashInfer's trtllm-gen
        backend only) are ignored. q_len_per_req: the queries of each request (speculative
        verification, as FlashInfer's), the last q_len_per_req positions of its keys, which
        must already be in the cache (kv_len >= q_len_per_req), causal among themselves; run()
        then takes q [B * q_len_per_req, Hq, D]. More than one needs use_tensor_cores=True (the
        prefill kernel serves them, as in FlashInfer). One query a request sits at its last
        position: no key lies after it, so window_right and is_causal change nothing.
        """
        if data_type is not None:
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        q_len = 1 if q_len_per_req is None else as_int("q_len_per_req", q_len_per_req, minimum=1)
        if q_len > 1 and self._tc is None:
            raise ValueError(
                f"q_len_per_req={q_len}: several queries a request run through the prefill "
                "kernel; construct the wrapper with use_tensor_cores=True"
            )
        if fixed_split_size is not None and as_int("fixed_split_size", fixed_split_size) == -1:
            fixed_split_size = None
        if self._tc is not None:  # q_len_per_req queries a request through the prefill kernel
            plan_tensor_cores(
                self._tc, q_len, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                head_dim, page_size, pos_encoding_mode=pos_encoding_mode,
                window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type,
                kv_data_type=kv_data_type, o_data_type=o_data_type,
                fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
            )  # fmt: skip
            self._q_len = q_len
            return
        args = (num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left,
                logits_soft_cap, q_data_type, kv_data_type, o_data_type, sm_scale, rope_scale,
                rope_theta)  # fmt: skip
        cfg = self._configure(args, make_config, self._setup)
        spec, ctas, num_sms, freq = self._kernel
        kv_indptr = host_ints("indptr", indptr)
        kv_indices = host_ints("indices", indices, widen=False)
        plan = plan_decode(
            kv_indptr, host_ints("last_page_len", last_page_len), cfg.page_size, cfg.kv_blocks,
            num_sms=num_sms, ctas_per_sm=ctas, fixed_split_size=fixed_split_size,
            disable_split_kv=disable_split_kv, max_work=self._max_work if self._graph else None,
        )  # fmt: skip
        if plan.batch_size > MAX_GRID_Y:
            raise ValueError(
                f"a batch of {plan.batch_size} requests exceeds the grid limit ({MAX_GRID_Y} "
                "work items, at least one per request): plan it in parts"
            )
        if plan.num_work > MAX_GRID_Y:
            raise ValueError(
                f"{plan.num_work} work items exceed the grid limit ({MAX_GRID_Y}): use a larger "
                "fixed_split_size"
            )
        num_pages = int(kv_indptr[-1])
        kv_indices, max_page = page_table_ids(kv_indices, num_pages)
        if self._graph:
            if plan.batch_size > self._max_batch or num_pages > self._max_pages:
                raise ValueError(
                    f"batch of {plan.batch_size} requests and {num_pages} pages exceeds the "
                    f"CUDA-graph capacity ({self._max_batch} requests, {self._max_pages} pages)"
                )
            self._check_captured(plan.batch_size)
            sizes = (self._max_batch, self._max_work, self._max_pages)
        else:
            sizes = (plan.batch_size, plan.num_work, num_pages)
        self._check_array_pages(max_page)
        partials = sizes[1] if self._graph or plan.split_kv else 0  # a graph may split later
        capacity = Capacity(*sizes, cfg.num_qo_heads, cfg.kv_blocks, cfg.head_dim, partials)
        packed = []
        fill = partial(pack_plan, plan=plan, kv_indptr=kv_indptr, kv_indices=kv_indices,
                       head_dim=cfg.head_dim, freq=freq,
                       items_room=self._max_work if self._graph else None)  # fmt: skip
        regions = self._upload(capacity, kept_fill(fill, packed))
        pointers = tuple(regions[r] for r in ("plan", "o", "lse", "counters"))
        items = self._max_work if self._graph else plan.num_work
        variant = spec if self._graph else plan_kernel(plan, spec, fixed_split_size)
        launch = self._launch_of(variant, items, cfg, pointers)
        self._launch = _Launch(launch, cfg, plan.batch_size, max_page, packed[0])
        self._split_args = (fixed_split_size, bool(disable_split_kv))

    def _launch_of(self, spec, items: int, cfg: Config, pointers: tuple) -> Launch:
        """The launch of `spec` over `items` work items with the current workspace: the
        previous one when nothing it holds changed (a plan's data lives in the workspace)."""
        k, grid = kernel(spec), (cfg.kv_blocks, items, 1)
        old = self._kept_launch(cfg, k, grid)
        if old is not None and old.params.plan == pointers[0]:
            return old
        launch = Launch(k, grid, (THREADS, 1, 1))
        p = launch.params
        p.plan, p.partial_o, p.partial_lse, p.counters = pointers
        cfg.fill(p)
        return launch

    @with_shortcut(run_shortcut(
        RUN_SLOTS, RUN_GIVEN, ("q", "_k", "_v", "out", "lse"), "(_st.cfg, _st.batch, return_lse)",
        "(_st.cfg.sm_scale, 1.0)", PLAIN_RUN + " and window_left is None and sinks is None and "
        "q_len_per_req is None and skip_softmax_threshold_scale_factor is None and "
        "kv_cache_sf is None and self._tc is None", PAGED_KV, ("_v",)))  # fmt: skip
    def run(self, q, paged_kv_cache, *, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse=False, enable_pdl=None, window_left=None, sinks=None,
            q_len_per_req=None, skip_softmax_threshold_scale_factor=None, kv_cache_sf=None,
            plan_array=None):  # fmt: skip
        """o [B, Hq, D] (and lse [B, Hq] float32, base 2, when return_lse) for q [B, Hq, D].

        paged_kv_cache: [pages, 2, page_size, Hkv, D] (NHD) / [pages, 2, Hkv, page_size, D]
        (HND), or a (k, v) pair of [pages, page_size, Hkv, D] / [pages, Hkv, page_size, D]; any
        strides with a contiguous, 16-byte aligned head_dim. out / lse: optional outputs.
        q_scale multiplies sm_scale as k_scale does (FlashInfer's calibration scales, None: 1);
        window_left may repeat the plan's value (None: the plan's); enable_pdl is accepted for
        drop-in compatibility: launches on sm_90+ are programmatically dependent for the whole
        process (rtcinfer/dependent_launch.py; RTCINFER_PDL=0 turns that off).
        plan_array: a plan_array() on the device, read instead of the wrapper's latest plan
        (which must have the same configuration); q may then have more rows than its batch.
        sinks: [Hq] float32 attention sink logits, one more key of logit sinks[h] and value 0
        in every row's softmax (merge_sinks_in_place, a second launch; the LSE includes it).
        After plan(q_len_per_req=n), q is [B * n, Hq, D] (request b's queries in rows b * n to
        b * n + n - 1); run's own q_len_per_req (FlashInfer's deprecated form) must be the
        plan's. skip_softmax_threshold_scale_factor and kv_cache_sf (FlashInfer's trtllm-gen
        options) are not supported: they raise when given.
        """
        if sinks is not None:
            o, s = self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale,
                            v_scale=v_scale, out=out, lse=lse, return_lse=True,
                            window_left=window_left, q_len_per_req=q_len_per_req,
                            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
                            kv_cache_sf=kv_cache_sf, plan_array=plan_array)  # fmt: skip
            o, s = merge_sinks_in_place(o, s, sinks)
            return (o, s) if return_lse else o
        if kv_cache_sf is not None or skip_softmax_threshold_scale_factor is not None:
            refuse(
                kv_cache_sf=kv_cache_sf,
                skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
            )
        if q_len_per_req is not None and q_len_per_req != self._q_len:
            raise ValueError(
                f"run(q_len_per_req={q_len_per_req!r}) differs from the plan's ({self._q_len}): "
                "pass it to plan()"
            )
        if torch_compiling(q):  # one custom op node (rtcinfer/torch_attention.py)
            from .. import torch_attention

            k, v = kv_pair(paged_kv_cache)
            return torch_attention.run(self, q, k, v, out, lse, return_lse, q_scale, k_scale,
                                       v_scale, window_left, plan_array)  # fmt: skip
        st = self._array_launch() if plan_array is not None else self._launch
        if self._tc is not None:  # the prefill wrapper's run() checks it against its plan
            return self._tc.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale,
                                v_scale=v_scale, out=out, lse=lse, return_lse=return_lse,
                                window_left=window_left)  # fmt: skip
        if st is None:
            raise RuntimeError("plan() must be called before run()")
        if window_left is not None and window_left != st.cfg.window_left:
            raise ValueError(
                f"run(window_left={window_left!r}) differs from the plan's window_left "
                f"({st.cfg.window_left}): pass None or plan() again"
            )
        k, v = kv_pair(paged_kv_cache)
        with_lse = return_lse or lse is not None
        qk, vs = kv_scales(k_scale, v_scale, q_scale)
        scalars = (st.cfg.sm_scale * qk, vs)
        if plan_array is None:
            result = self._call((q, k, v, out, lse), (st.cfg, st.batch, with_lse), scalars)
        else:
            result = self._call_array((q, k, v, out, lse, plan_array), with_lse, scalars)
        if return_lse:
            return result
        return result[0] if with_lse else result

    def _compiled_run(self, q, k, v, k_scale, v_scale, window_left, plan_array=None) -> tuple:
        """(o, lse) of run() with the current plan, or `plan_array` (torch_attention's ops at
        run time)."""
        return self.run(q, k if v is None else (k, v), k_scale=k_scale, v_scale=v_scale,
                        return_lse=True, window_left=window_left,
                        plan_array=plan_array)  # fmt: skip

    def _plan_o_shape(self, q_shape: tuple) -> tuple:
        """o's shape for q of `q_shape`: q's (torch_attention's fake outputs)."""
        return q_shape

    def _plan_o_dtype(self) -> str:
        """The current plan's output dtype (torch_attention's fake outputs)."""
        if self._tc is not None:
            return self._tc._plan_o_dtype()
        if self._launch is None:
            raise RuntimeError("plan() must be called before run()")
        return self._launch.cfg.o_dtype

    def _prepare_run(self, infos, align, static) -> Prepared:
        """Validate run()'s arrays against the plan's configuration (once per signature)."""
        return prepared_run(self, infos, static)

    def _before_run(self, stream: int, state) -> None:
        """Under the launch's lock, before a run() on the plan `state` launches: a capture
        into a CUDA graph noted (_note_capture), stream order (_order)."""
        self._note_capture(stream, state.batch)
        self._order(stream)


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """The wrapper with use_cuda_graph=True (FlashInfer's constructor): the buffers' lengths
    fix the capacity (max batch = len(indptr_buffer) - 1, max pages = len(indices_buffer))."""

    def __init__(self, workspace_buffer, indptr_buffer, indices_buffer, last_page_len_buffer,
                 kv_layout="NHD", use_tensor_cores=False):  # fmt: skip
        super().__init__(
            workspace_buffer, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=indptr_buffer, paged_kv_indices_buffer=indices_buffer,
            paged_kv_last_page_len_buffer=last_page_len_buffer,
        )  # fmt: skip


def fast_decode_plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                     page_size, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
                     q_data_type=None, kv_data_type=None, data_type=None, sm_scale=None,
                     rope_scale=None, rope_theta=None, non_blocking=True, fixed_split_size=None,
                     disable_split_kv=False, q_len_per_req=1,
                     global_override_indptr_cpu=None) -> None:  # fmt: skip
    """FlashInfer's fast_decode_plan(wrapper, ...), a plan() that skips FlashInfer's copies of
    CUDA-graph buffers: here the wrapper's own plan() (which makes one upload of the packed
    plan and no other copy), with global_override_indptr_cpu, when given, as the indptr."""
    if global_override_indptr_cpu is not None:
        indptr = global_override_indptr_cpu
    self.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
              pos_encoding_mode=pos_encoding_mode, window_left=window_left,
              logits_soft_cap=logits_soft_cap,
              q_data_type="float16" if q_data_type is None and data_type is None else q_data_type,
              kv_data_type=kv_data_type, data_type=data_type, sm_scale=sm_scale,
              rope_scale=rope_scale, rope_theta=rope_theta, non_blocking=non_blocking,
              fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
              q_len_per_req=q_len_per_req)  # fmt: skip


__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
           "fast_decode_plan"]  # fmt: skip
