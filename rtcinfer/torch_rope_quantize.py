"""RoPE with fp8 outputs (rope_quantize_fp8 and its paged append) as PyTorch custom ops, for
torch.compile (rtcinfer/torch_ops.py routes the public functions here): the route allocates
the outputs the caller did not give, the op writes them and the caches in place."""

from __future__ import annotations

import torch

from . import rope_quantize

_ROPE_QUANT_ARGS = ("Tensor q_rope, Tensor k_rope, Tensor? q_nope, Tensor? k_nope, "
                    "Tensor cos_sin_cache, Tensor pos_ids, bool is_neox, str quantize_dtype, "
                    "float quant_scale_q, float quant_scale_kv")  # fmt: skip


def _rope_quant_run(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox,
                    quantize_dtype, quant_scale_q, quant_scale_kv, *outs) -> None:  # fmt: skip
    rope_quantize.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids,
                                    is_neox, quantize_dtype, quant_scale_q, quant_scale_kv,
                                    *outs)  # fmt: skip


_rope_quant = torch.library.custom_op(
    "rtcinfer::rope_quantize_fp8", _rope_quant_run,
    mutates_args=("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out"),
    schema=f"({_ROPE_QUANT_ARGS}, Tensor(a!) q_rope_out, Tensor(b!) k_rope_out, "
           "Tensor(c!) q_nope_out, Tensor(d!) k_nope_out) -> ()",
)  # fmt: skip
_rope_quant.register_fake(lambda *a: None)


def _fp8_out(out, like, shape, quantize_dtype: str):
    """A given output, or a new fp8 tensor of `shape` on like's device."""
    if out is not None:
        return out
    return like.new_empty(shape, dtype=getattr(torch, quantize_dtype))


def _quantize_dtype(quantize_dtype, outs) -> str:
    return rope_quantize._out_type(quantize_dtype, outs) or "float8_e4m3fn"


def _route_rope_quantize(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox,
                         quantize_dtype, quant_scale_q, quant_scale_kv, q_rope_out, k_rope_out,
                         q_nope_out, k_nope_out, backend):  # fmt: skip
    if backend != "cuda":
        raise ValueError(f"backend: only 'cuda' is supported, got {backend!r}")
    given = (q_rope_out, k_rope_out, q_nope_out, k_nope_out)
    dtype = _quantize_dtype(quantize_dtype, given)
    nope = 0 if q_nope is None else q_nope.shape[-1]
    shapes = (q_rope.shape, k_rope.shape, (*q_rope.shape[:-1], nope), (*k_rope.shape[:-1], nope))
    outs = tuple(_fp8_out(o, q_rope, s, dtype) for o, s in zip(given, shapes, strict=True))
    torch.ops.rtcinfer.rope_quantize_fp8(
        q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, bool(is_neox), dtype,
        float(quant_scale_q), float(quant_scale_kv), *outs)  # fmt: skip
    return outs


_APPEND_QUANT_ARGS = ("Tensor q_rope, Tensor k_rope, Tensor? q_nope, Tensor? k_nope, Tensor? v, "
                      "Tensor cos_sin_cache, Tensor pos_ids, Tensor(a!) cache_0, "
                      "Tensor(b!) cache_1, Tensor kv_indices, Tensor kv_indptr, "
                      "Tensor batch_indices, Tensor positions, bool is_neox, str quantize_dtype, "
                      "float quant_scale_q, float quant_scale_kv, SymInt page_size, "
                      "str kv_layout, Tensor(c!) q_rope_out, Tensor(d!) q_nope_out")  # fmt: skip


def _append_quant_run(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, cache_0,
                      cache_1, kv_indices, kv_indptr, batch_indices, positions, is_neox,
                      quantize_dtype, quant_scale_q, quant_scale_kv, page_size, kv_layout,
                      q_rope_out, q_nope_out) -> None:  # fmt: skip
    rope_quantize.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, (cache_0, cache_1),
        kv_indices, kv_indptr, batch_indices, positions, is_neox, quantize_dtype,
        quant_scale_q, quant_scale_kv, page_size, kv_layout, q_rope_out, q_nope_out,
    )  # fmt: skip


_append_quant = torch.library.custom_op(
    "rtcinfer::rope_quantize_fp8_append_paged_kv_cache", _append_quant_run,
    mutates_args=("cache_0", "cache_1", "q_rope_out", "q_nope_out"),
    schema=f"({_APPEND_QUANT_ARGS}) -> ()",
)  # fmt: skip
_append_quant.register_fake(lambda *a: None)


def _route_append_quantize(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids,
                           paged_kv_cache, kv_indices, kv_indptr, batch_indices, positions,
                           is_neox, quantize_dtype, quant_scale_q, quant_scale_kv, page_size,
                           kv_layout, q_rope_out, q_nope_out):  # fmt: skip
    if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2:
        raise ValueError("paged_kv_cache must be a tuple of 2 arrays")
    cache_0, cache_1 = paged_kv_cache
    dtype = rope_quantize._out_type(quantize_dtype, (q_rope_out, q_nope_out))
    dtype = dtype or rope_quantize._out_type(None, (cache_0,)) or "float8_e4m3fn"
    nope = 0 if q_nope is None else q_nope.shape[-1]
    q_rope_out = _fp8_out(q_rope_out, q_rope, q_rope.shape, dtype)
    q_nope_out = _fp8_out(q_nope_out, q_rope, (*q_rope.shape[:-1], nope), dtype)
    torch.ops.rtcinfer.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, cache_0, cache_1, kv_indices,
        kv_indptr, batch_indices, positions, bool(is_neox), dtype, float(quant_scale_q),
        float(quant_scale_kv), int(page_size), kv_layout, q_rope_out, q_nope_out,
    )  # fmt: skip
    return q_rope_out, q_nope_out


# public name -> its call under torch.compile (torch_ops.call_public), the arguments by name
ROUTES = {
    "rope_quantize_fp8": _route_rope_quantize,
    "rope_quantize_fp8_append_paged_kv_cache": _route_append_quantize,
}


__all__ = ["ROUTES"]
