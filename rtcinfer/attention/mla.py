"""FlashInfer's BatchMLAPagedAttentionWrapper: DeepSeek's multi-head latent attention over a
paged latent cache, in the absorbed form FlashInfer takes (one latent KV head for all H heads):

    s_ij = (q_nope_i . ckv_j + q_pe_i . kpe_j) * sm_scale        (each head of query i)
    o_i = softmax_j(s_ij) @ ckv      [nnz_q, H, 512];   lse_i = log2(sum_j exp(s_ij))
    causal: query i of request b sees keys j <= i + kv_len_b - qo_len_b (bottom-right aligned)

ckv_cache [pages, page_size, 512] and kpe_cache [pages, page_size, 64]; request b's keys are
the first kv_len_arr[b] tokens of pages kv_indices[kv_indptr[b]:kv_indptr[b + 1]].

It runs on the batch prefill kernel (prefill.cu's MLA): K's rows are ckv + kpe (576 dims, read
from both caches into shared memory once), V their ckv part; four warps take each 16 query
rows, splitting the scores' keys, pooling the softmax through shared memory, and each
accumulating a quarter of o's 512 dims (prefill_mla.cuh). The plan is a paged prefill plan of
one kv head whose packed rows are the H heads of each query, in 16-row tiles (H / 16 of them
a query at H > 16). q, the caches and o are 16-bit (o may be the other 16-bit type).
"""

from __future__ import annotations

import numpy as np

from ..interop import Fill, OutSlot, Prepared
from ..interop.arrays import torch_compiling, with_shortcut
from ..interop.dtypes import itemsize
from ..plan._checks import as_int
from .decode_kernel import make_config
from .paged_kv import check_cache_view, page_table_ids
from .planned import host_ints, run_shortcut
from .prefill_args import PrefillConfig
from .prefill_kernel import MLA_CKV, MLA_KPE
from .prefill_wrapper import PrefillWrapper
from .run_options import finish_lse, refuse

BACKENDS = ("auto", "fa2", "fa3")  # FlashInfer's names for the kernels that compute this form


def make_mla_config(num_heads, page_size, causal, sm_scale, q_dtype, kv_dtype, o_dtype,
                    custom_mask=False, head_dim_vo=None) -> PrefillConfig:  # fmt: skip
    """MLA's configuration: one kv head of num_heads query heads (the kernel's group), head_dim
    ckv + kpe, v's the ckv dims (custom_mask and head_dim_vo: PrefillWrapper's _plan passes
    them; MLA has none)."""
    heads = as_int("num_heads", num_heads, minimum=1)
    attn = make_config(heads, 1, MLA_CKV + MLA_KPE, page_size, "NONE", -1, None,
                       q_dtype, kv_dtype, o_dtype, sm_scale, None, None,
                       head_dims=(MLA_CKV + MLA_KPE,))  # fmt: skip
    if attn.kv_dtype != attn.q_dtype:
        raise TypeError(f"kv_data_type must be q's dtype ({attn.q_dtype}), got {attn.kv_dtype}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    return PrefillConfig(attn, bool(causal), False, MLA_CKV, mla=True)


class BatchMLAPagedAttentionWrapper(PrefillWrapper):
    """plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, 512, 64, page_size,
    causal, sm_scale, q_data_type, kv_data_type) then run(q_nope, q_pe, ckv_cache, kpe_cache)
    -> o (and lse with return_lse): module docstring. use_cuda_graph=True fixes the capacity
    at the first plan (qo_indptr: its length fixes the batch size; kv_indices: the pages), as
    the prefill wrappers do."""

    RUN_SLOTS = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "out", "lse")
    RUN_GIVEN = ("out", "lse")
    ARRAY_SLOTS = ()  # no run(plan_array=...)
    make_config = staticmethod(make_mla_config)

    def __init__(self, float_workspace_buffer=None, use_cuda_graph=False, qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto"):  # fmt: skip
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        max_pages = None if kv_indices is None else int(kv_indices.shape[0])
        if use_cuda_graph and kv_indices is None:
            raise ValueError("use_cuda_graph=True needs kv_indices: its length fixes the pages")
        super().__init__(float_workspace_buffer, "NHD", use_cuda_graph, qo_indptr, max_pages)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type,
             use_profiler=False, *, query_layout="split", kv_cache_layout="split",
             lse_mode="none", output_dtype=None, output_scale="none", scale_mode="default",
             skip_softmax=False, enable_pdl=None, use_sinks=False) -> None:  # fmt: skip
        """Validate the batch on the host, plan the work, upload it (one copy). head_dim_ckv
        512 and head_dim_kpe 64 (DeepSeek's, the ones FlashInfer takes); output_dtype: o's
        (default q's); lse_mode is run()'s business here (return_lse). The layouts other than
        "split", output and scale modes other than the defaults, skip_softmax, use_sinks and
        use_profiler are not supported (they raise)."""
        if (head_dim_ckv, head_dim_kpe) != (MLA_CKV, MLA_KPE):
            raise ValueError(
                f"head_dim_ckv, head_dim_kpe: expected ({MLA_CKV}, {MLA_KPE}), got "
                f"({head_dim_ckv}, {head_dim_kpe})"
            )
        odd = {name: value for name, value, default in (
            ("query_layout", query_layout, "split"), ("kv_cache_layout", kv_cache_layout, "split"),
            ("output_scale", output_scale, "none"), ("scale_mode", scale_mode, "default"),
            ("skip_softmax", skip_softmax, False), ("use_sinks", use_sinks, False),
            ("use_profiler", use_profiler, False),
        ) if value != default}  # fmt: skip
        refuse("MLA options", **odd)
        if lse_mode not in ("none", "base2", "basee"):
            raise ValueError(f"lse_mode must be 'none', 'base2' or 'basee', got {lse_mode!r}")
        qo = host_ints("qo_indptr", qo_indptr)
        indptr = host_ints("kv_indptr", kv_indptr)
        lens = host_ints("kv_len_arr", kv_len_arr)
        if indptr.shape != qo.shape or lens.shape[0] != qo.shape[0] - 1:
            raise ValueError(
                f"qo_indptr ({qo.shape[0]} entries), kv_indptr ({indptr.shape[0]}) and "
                f"kv_len_arr ({lens.shape[0]}) must describe the same batch"
            )
        page = as_int("page_size", page_size, minimum=1)
        pages = np.diff(indptr)
        if (pages < 0).any() or (lens < 0).any() or (lens > pages * page).any():
            bad = int(np.flatnonzero((lens < 0) | (lens > pages * page) | (pages < 0))[0])
            raise ValueError(
                f"request {bad}: kv_len_arr {int(lens[bad])} keys over {int(pages[bad])} pages "
                f"of {page}: expected 0 <= kv_len <= pages x page_size"
            )
        ids = host_ints("kv_indices", kv_indices, widen=False)
        indices, max_page = page_table_ids(ids, int(indptr[-1]), ("kv_indices", "kv_indptr"))
        args = (num_heads, page, causal, sm_scale, q_data_type, kv_data_type, output_dtype)
        self._plan(qo, lens, indptr[:-1], indices, args, (None, None), None, False,
                   max_page + 1)  # fmt: skip

    @with_shortcut(run_shortcut(
        RUN_SLOTS, RUN_GIVEN, ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "out", "lse"),
        "(_st.cfg, _st.nnz_q, return_lse)", "(_st.cfg.attn.sm_scale, 1.0)",
        "lse is None and (return_lse is False or return_lse is True) and "
        "profiler_buffer is None and kv_len is None and page_table is None and "
        "return_lse_base_on_e is False and o_scale is None and query is None and "
        "kv_cache is None and ckv_scale is None and ckv_scale_arr is None and "
        "kpe_scale is None and sinks is None and "
        "skip_softmax_threshold_scale_factor is None and bmm1_scale is None and "
        "bmm2_scale is None"))  # fmt: skip
    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False,
            profiler_buffer=None, kv_len=None, page_table=None, return_lse_base_on_e=False,
            o_scale=None, *, query=None, kv_cache=None, ckv_scale=None, ckv_scale_arr=None,
            kpe_scale=None, sinks=None, skip_softmax_threshold_scale_factor=None,
            bmm1_scale=None, bmm2_scale=None):  # fmt: skip
        """o [nnz_q, H, 512] (out, when given, is written), and lse [nnz_q, H] float32 (base 2,
        or e with return_lse_base_on_e) as (o, lse) when return_lse. kv_len and page_table
        (FlashInfer's cutlass backend's), the scales, sinks, profiler_buffer and the
        query= / kv_cache= forms are not supported (they raise)."""
        refuse("MLA run() options", profiler_buffer=profiler_buffer, kv_len=kv_len,
               page_table=page_table, o_scale=o_scale, query=query, kv_cache=kv_cache,
               ckv_scale=ckv_scale, ckv_scale_arr=ckv_scale_arr, kpe_scale=kpe_scale,
               sinks=sinks,
               skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
               bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale)  # fmt: skip
        st = self._launch
        if st is None:
            raise RuntimeError("plan() must be called before run()")
        base = "ln" if return_lse_base_on_e else "log2"
        with_lse = bool(return_lse) or lse is not None
        written = lse  # the kernel's base-2 LSE, then (base e) scaled in place
        if torch_compiling(q_nope):  # one custom op node (rtcinfer/torch_attention.py)
            from .. import torch_attention

            o, s = torch_attention.mla(self, q_nope, q_pe, ckv_cache, kpe_cache)
            if out is not None:
                o = out.copy_(o)
            if written is not None:
                s = written.copy_(s)
            result = (o, s) if with_lse else o
        else:
            arrays = (q_nope, q_pe, ckv_cache, kpe_cache, out, written)
            scalars = (st.cfg.attn.sm_scale, 1.0)
            result = self._call(arrays, (st.cfg, st.nnz_q, with_lse), scalars)
        if not with_lse:
            return result
        o, s = result
        if base != "log2":
            s = finish_lse(s, base, "NH")
        return (o, s) if return_lse else o

    def _compiled_run(self, q_nope, q_pe, ckv_cache, kpe_cache) -> tuple:
        """(o, lse) of run() with the current plan (torch_attention's mla_run at run time)."""
        st = self._launch
        if st is None:
            raise RuntimeError("plan() must be called before run()")
        return self._call((q_nope, q_pe, ckv_cache, kpe_cache, None, None),
                          (st.cfg, st.nnz_q, True), (st.cfg.attn.sm_scale, 1.0))  # fmt: skip

    def _prepare_run(self, infos, align, static) -> Prepared:
        cfg, nnz_q, with_lse = static
        attn = cfg.attn
        q_nope, q_pe, ckv, kpe, out, lse = infos
        heads = attn.group_size
        expect = {"q_nope": (q_nope, (nnz_q, heads, MLA_CKV), attn.q_dtype),
                  "q_pe": (q_pe, (nnz_q, heads, MLA_KPE), attn.q_dtype),
                  "ckv_cache": (ckv, (None, attn.page_size, MLA_CKV), attn.kv_dtype),
                  "kpe_cache": (kpe, (None, attn.page_size, MLA_KPE), attn.kv_dtype)}  # fmt: skip
        for name, (x, shape, dtype) in expect.items():
            fits = x is not None and x.ndim == 3 and x.dtype == dtype and all(
                s is None or s == n for s, n in zip(shape, x.shape, strict=True))  # fmt: skip
            if not fits:
                want = tuple("num_pages" if s is None else s for s in shape)
                got = None if x is None else (x.shape, x.dtype)
                raise ValueError(f"{name}: expected shape {want} and dtype {dtype}, got {got}")
        if kpe.shape[0] != ckv.shape[0]:
            raise ValueError(f"ckv_cache {ckv.shape} and kpe_cache {kpe.shape}: one page count")
        o_shape = (nnz_q, heads, MLA_CKV)
        outs = [OutSlot(o_shape, attn.o_dtype, 4 if out is not None else None)]
        if with_lse:
            outs.append(OutSlot(o_shape[:2], "float32", 5 if lse is not None else None))
        for name, given, shape, dtype in (("out", out, o_shape, attn.o_dtype),
                                          ("lse", lse, o_shape[:2], "float32")):  # fmt: skip
            if given is not None and (given.shape != shape or given.dtype != dtype):
                raise ValueError(f"{name}: expected shape {shape} and dtype {dtype}, got "
                                 f"{given.shape} and {given.dtype}")  # fmt: skip
        empty = nnz_q == 0
        fields = {} if empty else _run_fields(q_nope, q_pe, ckv, kpe, out, lse, o_shape)
        # slots: q_nope, q_pe, ckv, kpe, out, lse; then o, lse. V is read from the K tile
        # (ckv's dims), so v_cache is ckv too.
        lse_at = (("lse", 7),) if with_lse else ()
        fill = Fill((("q", 0), ("q_pe", 1), ("k_cache", 2), ("v_cache", 2), ("kpe_cache", 3),
                     ("o", 6), *lse_at), (("qk_scale", 0), ("v_scale", 1)))  # fmt: skip
        return self._prepared(outs, static, ckv.shape[0], empty, fields, fill=fill)


def _run_fields(q_nope, q_pe, ckv, kpe, out, lse, o_shape) -> dict:
    """The kernel's strides for run()'s arrays (interop's ArrayInfo), checked: rows of q_nope,
    q_pe and o 16-byte aligned with a contiguous last dim; each cache [pages, page_size, D]
    with 16-byte aligned pages and tokens. MLA's fields (prefill.cu's PrefillParams): k_* are
    ckv's strides, v_* kpe's (the row table's second offsets), k_head = v_head = 0."""
    item = itemsize(ckv.dtype)
    for name, x in (("q_nope", q_nope), ("q_pe", q_pe), ("out", out)):
        if x is None:
            continue
        if x.strides[2] != 1 or x.offset % 16 or any(s % 8 for s in x.strides[:2]):
            raise ValueError(
                f"{name}: needs a contiguous last dim and 16-byte aligned rows, got strides "
                f"{x.strides} (elements) and address offset {x.offset}"
            )
    for name, x in (("ckv_cache", ckv), ("kpe_cache", kpe)):
        strides = (x.strides[0] * item, x.strides[1] * item)
        check_cache_view(name, x.offset, (x.shape[0], x.shape[1]), strides, item,
                         x.strides[2] * item)  # fmt: skip
    o_strides = out.strides if out is not None else (o_shape[1] * o_shape[2], o_shape[2], 1)
    lse_stride = lse.strides[0] if lse is not None else o_shape[1]
    if lse is not None and lse.strides[1] != 1:
        raise ValueError(f"lse: needs a contiguous last dim, got strides {lse.strides}")
    return dict(
        q_stride_n=q_nope.strides[0], q_stride_h=q_nope.strides[1],
        qpe_stride_n=q_pe.strides[0], qpe_stride_h=q_pe.strides[1],
        o_stride_n=o_strides[0], o_stride_h=o_strides[1], lse_stride_n=lse_stride,
        k_page=ckv.strides[0] * item, k_token=ckv.strides[1] * item, k_head=0,
        v_page=kpe.strides[0] * item, v_token=kpe.strides[1] * item, v_head=0,
    )  # fmt: skip


__all__ = ["BatchMLAPagedAttentionWrapper", "make_mla_config"]
