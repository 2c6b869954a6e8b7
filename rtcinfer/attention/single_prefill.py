"""Prefill (append) attention of one request over a contiguous (or strided) K and V,
FlashInfer's ``single_prefill_with_kv_cache``: the batch prefill kernel with a batch of one,
K and V read as one ragged "page".

    query i sits at key position i + kv_len - qo_len (bottom-right aligned)
    s_ij = q_i . k_j * sm_scale (+ ALiBi slope * (j - pos_i), then soft cap), with q_i and k_j
           turned by RoPE at pos_i and j under pos_encoding_mode="ROPE_LLAMA"; hidden keys:
           j > pos_i (causal), j < pos_i - window_left (window_left >= 0)
    o_i = softmax_j(s_ij) @ V;  lse_i = log2(sum_j exp(s_ij))   (0 and -inf without a key)
"""

from __future__ import annotations

import numpy as np

from ..bitpack import packbits
from ..interop import Op, OutSlot, Prepared, call
from ..interop.arrays import device_like, framework, torch_compiling
from ..jit import device_limits
from ..launch import zero_fill
from .paged_kv import check_cache_view, check_layout, token_head
from .prefill_args import check_backend, io_fields, make_prefill_config
from .prefill_launch import plan_launch
from .prefill_plan import ITEM_INTS, RAGGED_PAGE, items_at, pack_plan
from .run_options import refuse
from .workspace import device_copy, split_scratch


def single_prefill_with_kv_cache(
    q, k, v, scale_q=None, scale_k=None, scale_v=None, o_dtype=None, custom_mask=None,
    packed_custom_mask=None, causal=False, kv_layout="NHD", pos_encoding_mode="NONE",
    use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
    rope_scale=None, rope_theta=None, backend="auto", return_lse=False, kv_cache_sf=None,
    k_scale=None, v_scale=None,
):  # fmt: skip
    """Prefill attention of one request (math above); a custom mask ([qo_len, kv_len] bool,
    True where query i sees key j, or those bits flattened and packed little-endian:
    packbits(custom_mask.flatten(), "little")) replaces the causal mask.

    q: [qo_len, Hq, D]; k, v: [kv_len, Hkv, D] (NHD) or [Hkv, kv_len, D] (HND), any token and
    head strides with a contiguous head_dim; qo_len <= kv_len is the usual append case, but any
    lengths work (queries before the first key see nothing under the causal mask). D in
    (64, 128, 256); v's last dim D_vo may be fewer (192 / 128: prefill_kernel.DIM_PAIRS, 16-bit
    KV, RoPE outside the kernel). Returns o [qo_len, Hq, D_vo] (o_dtype, default q's), and also
    lse [qo_len, Hq] float32 (base 2) when return_lse. The work list depends only on the
    shapes: it is built and uploaded once per signature. QK products accumulate in fp32
    whatever use_fp16_qk_reduction says. The fp8 scales (scale_q, scale_k, scale_v, k_scale,
    v_scale) and kv_cache_sf are not supported yet: they raise when given.
    """
    refuse(scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, k_scale=k_scale, v_scale=v_scale,
           kv_cache_sf=kv_cache_sf)  # fmt: skip
    check_backend(backend)
    if torch_compiling(q):  # one custom op node (rtcinfer/torch_attention.py)
        from .. import torch_attention as ta

        return ta.single("single_prefill", q, return_lse, k, v, custom_mask,
                         packed_custom_mask, ta.torch_dtype(o_dtype), bool(causal), kv_layout,
                         pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale,
                         rope_theta)  # fmt: skip
    mask = packed_custom_mask
    if mask is None and custom_mask is not None:
        kv_len = k.shape[0 if kv_layout == "NHD" else 1]
        if tuple(custom_mask.shape) not in ((q.shape[0], kv_len), (q.shape[0] * kv_len,)):
            raise ValueError(
                f"custom_mask: expected shape ({q.shape[0]}, {kv_len}) (qo_len, kv_len), got "
                f"{tuple(custom_mask.shape)}"
            )
        mask = packbits(custom_mask, "little")
        if framework(mask) == "numpy":
            mask = device_like(mask, q)
    static = (o_dtype, bool(causal), kv_layout, pos_encoding_mode, sm_scale, window_left,
              logits_soft_cap, rope_scale, rope_theta, bool(return_lse))  # fmt: skip
    return call(_OP, (q, k, v, mask), static)


def single_prefill_with_kv_cache_return_lse(q, k, v, *args, **kwargs):
    """single_prefill_with_kv_cache(..., return_lse=True): (o, lse)."""
    kwargs["return_lse"] = True
    return single_prefill_with_kv_cache(q, k, v, *args, **kwargs)


def _prepare(infos, align, static) -> Prepared:
    """Slots (q, k, v, packed mask) -> o (and lse); a split plan adds a per-call scratch output
    (not returned: partial o, partial lse and the merge counters in one float32 array, one
    allocation) so that concurrent calls never share them."""
    o_dtype, causal, kv_layout, pos_encoding_mode, sm_scale, window_left, cap = static[:7]
    rope_scale, rope_theta, with_lse = static[7:]
    q, k, v, mask = infos
    check_layout(kv_layout)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"expected q [qo_len, Hq, D] and k, v [kv_len, Hkv, D] (NHD) or [Hkv, kv_len, D] "
            f"(HND), got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    qo_len, num_qo_heads, head_dim = q.shape
    head_dim_vo = v.shape[2]
    (kv_len, num_kv_heads), (k_token, k_head) = token_head(k.shape, k.strides, kv_layout)
    _, (v_token, v_head) = token_head(v.shape, v.strides, kv_layout)
    if k.shape[2] != head_dim or v.dtype != k.dtype:
        raise ValueError(
            f"k and v must share q's head_dim ({head_dim}) and one dtype, got k {k.dtype} "
            f"{k.shape}, v {v.dtype} {v.shape}"
        )
    cfg = make_prefill_config(num_qo_heads, num_kv_heads, head_dim, RAGGED_PAGE, causal,
                              pos_encoding_mode, window_left, cap, q.dtype, k.dtype, o_dtype,
                              sm_scale, rope_scale, rope_theta, mask is not None,
                              head_dim_vo)  # fmt: skip
    if mask is not None and (mask.dtype != "uint8" or mask.size < -(-qo_len * kv_len // 8)):
        raise ValueError(
            f"the custom mask packs qo_len x kv_len = {qo_len} x {kv_len} bits: expected "
            f"packed_custom_mask uint8 of at least {-(-qo_len * kv_len // 8)} bytes, got "
            f"{mask.dtype} {mask.shape}"
        )
    attn = cfg.attn
    device = q.device
    qo_indptr = np.array([0, qo_len], dtype=np.int64)
    launch, plan = plan_launch(cfg, qo_indptr, np.array([kv_len], dtype=np.int64), device,
                               device_limits(device))  # fmt: skip
    tile_rows = launch.kernel.spec.tile_rows
    host = np.zeros(items_at(head_dim) + ITEM_INTS * plan.num_work + 1, np.int32)
    pack_plan(
        host, plan, qo_indptr, np.zeros(1, np.int64), np.zeros(1, np.int32), head_dim, attn.freq()
    )
    plan_buffer = device_copy(host, device, "single_prefill_with_kv_cache")

    outs = [OutSlot((qo_len, num_qo_heads, head_dim_vo), attn.o_dtype)]
    if with_lse:
        outs.append(OutSlot((qo_len, num_qo_heads), "float32"))
    split = plan.num_slots > 0
    counters = plan.num_tiles * num_kv_heads
    if split:
        scratch = split_scratch(plan.num_slots * num_kv_heads * tile_rows, head_dim_vo, counters)
        outs.append(scratch.slot)
    p = launch.params
    p.plan = plan_buffer.ptr
    item = k.itemsize
    for name, arr, token, head in (("k", k, k_token, k_head), ("v", v, v_token, v_head)):
        check_cache_view(name, arr.offset, (kv_len, num_kv_heads), (token * item, head * item),
                         item, arr.strides[2] * item)  # fmt: skip
    p.k_page = p.k_token = k_token * item
    p.v_page = p.v_token = v_token * item
    p.k_head, p.v_head = k_head * item, v_head * item
    for name, value in io_fields(q, None, None, cfg).items():
        setattr(p, name, value)
    p.qk_scale, p.v_scale = attn.sm_scale, 1.0
    n_lse = 1 if with_lse else 0
    empty = qo_len == 0

    def run(stream, device, ptrs, scalars):
        if empty:
            return
        launch.lock.acquire()
        try:
            p.q, p.k_cache, p.v_cache, p.mask, p.o = ptrs[:5]
            p.lse = ptrs[5] if with_lse else 0
            if split:
                at = ptrs[5 + n_lse]
                p.partial_o, p.partial_lse = at, at + scratch.lse_at
                p.counters = at + scratch.counters_at
                zero_fill(p.counters, counters, stream)
            launch(stream, device)
        finally:
            launch.lock.release()

    return Prepared(tuple(outs), run, preload=launch.preload, keep=plan_buffer, dense=(3,),
                    scratch=1 if split else 0)  # fmt: skip


_OP = Op("single_prefill", ("q", "k", "v", "packed_custom_mask"), _prepare)

__all__ = ["single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse"]
