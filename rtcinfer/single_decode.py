"""Decode attention of one request over a contiguous (or strided) K and V, FlashInfer's
``single_decode_with_kv_cache``: the batch decode kernel, with K and V read as pages of 64
tokens so that the host planner can split a long request across the GPU.

    s_j = q . k_j * sm_scale * k_scale (+ ALiBi slope * (j - (kv_len - 1)), then soft cap)
    o = softmax(s) @ V * v_scale;  lse = log2(sum_j exp(s_j))  (o = 0, lse = -inf if empty)
"""

from __future__ import annotations

import math

import numpy as np

from .decode_kernel import (
    THREADS,
    Config,
    check_cache_view,
    check_layout,
    kernel,
    kv_scales,
    make_config,
    token_head,
)
from .interop import Out, dtype_name, run
from .interop.arrays import device_of, framework, to_device
from .jit import device_limits
from .plan.decode import plan_decode
from .workspace import header_ints, pack_plan


def single_decode_with_kv_cache(
    q, k, v, kv_layout="NHD", pos_encoding_mode="NONE", use_tensor_cores=False, q_scale=None,
    k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None, sm_scale=None,
    rope_scale=None, rope_theta=None, return_lse=False,
):  # fmt: skip
    """Decode attention of one request (math above; sm_scale is further multiplied by q_scale).

    q: [Hq, D]; k, v: [kv_len, Hkv, D] (NHD) or [Hkv, kv_len, D] (HND), any strides with a
    contiguous head_dim; D in (64, 128, 256). ROPE_LLAMA rotates q at kv_len - 1 and key j at j.
    Returns o [Hq, D] (q's dtype), and also lse [Hq] float32 (base 2) when return_lse.
    The work list is built on the host and uploaded as a small input array.
    """
    check_layout(kv_layout)
    if len(q.shape) != 2 or len(k.shape) != 3 or tuple(k.shape) != tuple(v.shape):
        raise ValueError(
            f"expected q [Hq, D] and k, v [kv_len, Hkv, D] (NHD) or [Hkv, kv_len, D] (HND), got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    (kv_len, num_kv_heads), _ = token_head(k.shape, (0, 0, 0), kv_layout)
    page = 64  # the contiguous cache is read as pages of 64 tokens, so the planner can split it
    pages = -(-kv_len // page)
    scale = 1.0 / math.sqrt(q.shape[1]) if sm_scale is None else sm_scale
    cfg = make_config(
        q.shape[0], num_kv_heads, q.shape[1], page, pos_encoding_mode, window_left,
        logits_soft_cap, dtype_name(q), dtype_name(k), None, scale, rope_scale, rope_theta,
    )  # fmt: skip
    if dtype_name(v) != dtype_name(k) or k.shape[2] != cfg.head_dim:
        raise ValueError(
            f"k and v must share dtype and head_dim: q head_dim {cfg.head_dim}, k "
            f"{dtype_name(k)} {tuple(k.shape)}, v {dtype_name(v)} {tuple(v.shape)}"
        )
    device = 0 if framework(q) == "jax" else max(device_of(q), 0)
    num_sms, max_smem = device_limits(device)
    spec = cfg.spec(max_smem)
    indptr = np.array([0, pages], dtype=np.int64)
    last = np.array([kv_len - (pages - 1) * page if pages else 0], dtype=np.int64)
    plan = plan_decode(
        indptr, last, page, cfg.kv_blocks, num_sms=num_sms, ctas_per_sm=kernel(spec, device)[1]
    )
    host = np.zeros(header_ints(cfg.head_dim) + 8 * plan.num_work + pages, dtype=np.int32)
    pack_plan(host, plan, indptr, np.arange(pages, dtype=np.int32), cfg.head_dim, cfg.freq())
    w, hq, d = plan.num_work, cfg.num_qo_heads, cfg.head_dim
    outs = [
        Out((hq, d), cfg.o_dtype),
        Out((hq,), "float32"),
        Out((w, hq, d), "float32"),  # scratch: partial outputs of split work items
        Out((w, hq), "float32"),  # scratch: their LSE
        Out((1, cfg.kv_blocks), "int32"),  # scratch: merge counters
    ]
    ins = [("q", q), ("k", k), ("v", v), ("plan", to_device(q, host))]
    scales = kv_scales(k_scale, v_scale, q_scale)
    result = run(_single_launch, ins, outs, cfg=cfg, layout=kv_layout, scales=scales, work=w)
    return (result[0], result[1]) if return_lse else result[0]


def _single_launch(stream, ins, outs, *, cfg: Config, layout, scales, work):
    from cupy_backends.cuda.api import runtime

    q, k, v, plan = ins
    o, lse, part_o, part_lse, counters = outs
    spec = cfg.spec(device_limits(q.device.id)[1])
    fn = kernel(spec, q.device.id)[0]
    strides = []
    for name, arr in (("k", k), ("v", v)):
        dims, (token, head) = token_head(arr.shape, arr.strides, layout)
        check_cache_view(name, arr.data.ptr, dims, (token, head), arr.itemsize, arr.strides[2])
        strides.append((cfg.page_size * token, token, head))
    if q.strides[1] != q.itemsize:
        raise ValueError(f"q: head_dim must be contiguous, got strides {q.strides}")
    runtime.memsetAsync(counters.data.ptr, 0, counters.nbytes, stream.ptr)
    args = (
        q.data.ptr, 0, q.strides[0] // q.itemsize, k.data.ptr, *strides[0], v.data.ptr,
        *strides[1], o.data.ptr, 0, cfg.head_dim, lse.data.ptr, 0, plan.data.ptr,
        part_o.data.ptr, part_lse.data.ptr, counters.data.ptr, *cfg.scalars(),
        np.float32(cfg.sm_scale * scales[0]), np.float32(cfg.logits_soft_cap),
        np.float32(scales[1]),
    )  # fmt: skip
    fn((cfg.kv_blocks, work, 1), (THREADS, 1, 1), args, shared_mem=spec.smem_bytes, stream=stream)


__all__ = ["single_decode_with_kv_cache"]
