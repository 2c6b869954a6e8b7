"""Decode attention of one request over a contiguous (or strided) K and V, FlashInfer's
``single_decode_with_kv_cache``: the batch decode kernel, with K and V read as pages of 64
tokens so that the host planner can split a long request across the GPU.

    s_j = q . k_j * sm_scale * k_scale (+ ALiBi slope * (j - (kv_len - 1)), then soft cap)
    o = softmax(s) @ V * v_scale;  lse = log2(sum_j exp(s_j))  (o = 0, lse = -inf if empty)
"""

from __future__ import annotations

import numpy as np

from ..interop import Fill, Op, OutSlot, Prepared, call, one_launch
from ..interop.arrays import torch_compiling, with_shortcut
from ..interop.shortcut import Shortcut
from ..jit import device_limits
from ..launch import Launch, zero_fill
from ..plan.decode import plan_decode
from .decode_kernel import THREADS, ctas_per_sm, kernel, kv_scales, make_config
from .decode_plan import ITEM_INTS, header_ints, pack_plan
from .paged_kv import check_cache_view, check_layout, check_strides_fit, paged_view, token_head
from .workspace import device_copy, split_scratch

PAGE = 64  # the contiguous cache is read as pages of 64 tokens, so the planner can split it


def _prepare(infos, align, static) -> Prepared:
    """Slots (q, k, v) -> o [Hq, D] (and lse [Hq]); split plans add per-call scratch outputs
    (partial o, partial lse, merge counters; not returned) so that concurrent calls never
    share them."""
    kv_layout, pos_encoding_mode, window_left, cap, sm_scale, rope_scale, rope_theta, with_lse = (
        static
    )
    q, k, v = infos
    check_layout(kv_layout)
    if q.ndim != 2 or k.ndim != 3 or k.shape != v.shape:
        raise ValueError(
            f"expected q [Hq, D] and k, v [kv_len, Hkv, D] (NHD) or [Hkv, kv_len, D] (HND), got "
            f"q {q.shape}, k {k.shape}, v {v.shape}"
        )
    (kv_len, num_kv_heads), _ = token_head(k.shape, (0, 0, 0), kv_layout)
    pages = -(-kv_len // PAGE)
    cfg = make_config(
        q.shape[0], num_kv_heads, q.shape[1], PAGE, pos_encoding_mode, window_left, cap,
        q.dtype, k.dtype, None, sm_scale, rope_scale, rope_theta,
    )  # fmt: skip
    if v.dtype != k.dtype or k.shape[2] != cfg.head_dim:
        raise ValueError(
            f"k and v must share dtype and head_dim: q head_dim {cfg.head_dim}, k "
            f"{k.dtype} {k.shape}, v {v.dtype} {v.shape}"
        )
    if q.strides[1] != 1:
        raise ValueError(f"q: head_dim must be contiguous, got strides {q.strides}")
    device = q.device
    num_sms, max_smem = device_limits(device)
    spec = cfg.spec(max_smem)
    indptr = np.array([0, pages], dtype=np.int64)
    last = np.array([kv_len - (pages - 1) * PAGE if pages else 0], dtype=np.int64)
    plan = plan_decode(indptr, last, PAGE, cfg.kv_blocks, num_sms=num_sms,
                       ctas_per_sm=ctas_per_sm(spec, device))  # fmt: skip
    host = np.zeros(header_ints(cfg.head_dim) + ITEM_INTS * plan.num_work + pages, np.int32)
    pack_plan(host, plan, indptr, np.arange(pages, dtype=np.int32), cfg.head_dim, cfg.freq())
    plan_buffer = device_copy(host, device, "single_decode_with_kv_cache")
    w, hq, d = plan.num_work, cfg.num_qo_heads, cfg.head_dim
    split = w > 1
    outs = [OutSlot((hq, d), cfg.o_dtype)]
    if with_lse:
        outs.append(OutSlot((hq,), "float32"))
    if split:  # partials [w, hq, d] and [w, hq], a counter per kv block: one allocation
        scratch = split_scratch(w * hq, d, cfg.kv_blocks)
        outs.append(scratch.slot)
    launch = Launch(kernel(spec), (cfg.kv_blocks, w, 1), (THREADS, 1, 1))
    p = launch.params
    cfg.fill(p)
    item = k.itemsize
    k_view, v_view = (paged_view(a, kv_layout, item, PAGE) for a in (k, v))
    for name, arr, view in (("k", k, k_view), ("v", v, v_view)):
        dims, _ = token_head(arr.shape, arr.strides, kv_layout)
        check_cache_view(name, arr.offset, dims, (view.token, view.head), item,
                         arr.strides[2] * item)  # fmt: skip
        if 0 not in dims:
            check_strides_fit(name, (view.page,))
    p.k_page, p.k_token, p.k_head = k_view.page, k_view.token, k_view.head
    p.v_page, p.v_token, p.v_head = v_view.page, v_view.token, v_view.head
    p.q_stride_n, p.q_stride_h, p.num_rows = 0, q.strides[0], 1
    p.o_stride_n, p.o_stride_h, p.lse_stride_n = 0, d, 0
    p.plan = plan_buffer.ptr
    pointers = (("q", 0), ("k_cache", 1), ("v_cache", 2), ("o", 3))
    pointers += (("lse", 4),) if with_lse else ()  # (else the field stays 0)
    fill = Fill(pointers, (("qk_scale", 0, cfg.sm_scale), ("v_scale", 1)))
    if not split:
        return one_launch(tuple(outs), launch, fill, keep=plan_buffer)
    fill_call, scratch_at = fill.function(p), 4 + (1 if with_lse else 0)

    def run(stream, device, ptrs, scalars):  # partials in the call's scratch, counters zeroed
        launch.lock.acquire()
        try:
            fill_call(ptrs, scalars)
            at = ptrs[scratch_at]
            p.partial_o, p.partial_lse = at, at + scratch.lse_at
            p.counters = at + scratch.counters_at
            zero_fill(p.counters, cfg.kv_blocks, stream)
            launch(stream, device)
        finally:
            launch.lock.release()

    return Prepared(tuple(outs), run, preload=launch.preload, keep=plan_buffer, scratch=1)


_OP = Op("single_decode", ("q", "k", "v"), _prepare)


@with_shortcut(Shortcut(_OP, ("q", "k", "v"), "(kv_layout, pos_encoding_mode, window_left, "
                        "logits_soft_cap, sm_scale, rope_scale, rope_theta, bool(return_lse))",
                        "kv_scales(k_scale, v_scale, q_scale)", (kv_scales,)))  # fmt: skip
def single_decode_with_kv_cache(
    q, k, v, kv_layout="NHD", pos_encoding_mode="NONE", use_tensor_cores=False, q_scale=None,
    k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None, sm_scale=None,
    rope_scale=None, rope_theta=None, return_lse=False,
):  # fmt: skip
    """Decode attention of one request (math above; sm_scale is further multiplied by q_scale).

    q: [Hq, D]; k, v: [kv_len, Hkv, D] (NHD) or [Hkv, kv_len, D] (HND), any strides with a
    contiguous head_dim; D in (64, 128, 256). ROPE_LLAMA rotates q at kv_len - 1 and key j at j.
    Returns o [Hq, D] (q's dtype), and also lse [Hq] float32 (base 2) when return_lse.
    The work list depends only on the shapes: it is built and uploaded once per signature.
    """
    if torch_compiling(q):  # one custom op node (rtcinfer/torch_attention.py)
        from .. import torch_attention as ta

        return ta.single("single_decode", q, return_lse, k, v, kv_layout, pos_encoding_mode,
                         window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                         *kv_scales(k_scale, v_scale, q_scale))  # fmt: skip
    static = (kv_layout, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
              rope_theta, bool(return_lse))  # fmt: skip
    return call(_OP, (q, k, v), static, kv_scales(k_scale, v_scale, q_scale))


__all__ = ["single_decode_with_kv_cache"]
