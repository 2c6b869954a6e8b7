"""The batch attention wrappers' run() as one PyTorch custom op, so that torch.compile traces
a step that calls them as opaque nodes (fullgraph=True) whose plan stays outside the graph;
and the single-request forms (single_decode, single_prefill: the shared-prefix wrappers' first
level) as two more, each returning (o, lse) whatever return_lse says.

    rtcinfer::attention_run(int wrapper, Tensor q, Tensor k, Tensor? v, float k_scale,
                            float v_scale, int? window_left) -> (o, lse)
    rtcinfer::attention_run_plan_array(int wrapper, Tensor q, Tensor k, Tensor? v,
                                       Tensor plan_array, ...) -> (o, lse)   (run(plan_array=))
    rtcinfer::decode_device_plan(int wrapper, Tensor indptr, Tensor indices,
                                 Tensor last_page_len, int num_pages) -> plan_array

`wrapper` is the wrapper's registry number (attention/planned.py: live_wrapper), a constant of
the compiled graph: at run time the op calls that wrapper's run() with its current plan, so
plan() between steps (new lengths, new pages) neither retraces nor recompiles, and the graph
reads nothing of the plan at trace time except the output dtype. o has q's shape in the plan's
output dtype; lse is [rows, Hq] float32 (base 2), always computed (a few bytes a row). `out=`
and `lse=` given to run() while compiling are filled by a copy. Imported only where PyTorch is.
"""

from __future__ import annotations

import torch

from .attention.decode_kernel import kv_scales
from .attention.planned import live_wrapper


def _wrapper(number: int):
    wrapper = live_wrapper(number)
    if wrapper is None:
        raise RuntimeError(
            f"the attention wrapper of this compiled graph (number {number}) was deleted: keep "
            "it alive as long as the compiled function"
        )
    return wrapper


@torch.library.custom_op(
    "rtcinfer::attention_run", mutates_args=(),
    schema="(int wrapper, Tensor q, Tensor k, Tensor? v, float k_scale, float v_scale, "
           "int? window_left) -> (Tensor, Tensor)",
)  # fmt: skip
def attention_run(wrapper, q, k, v, k_scale, v_scale, window_left):
    return tuple(_wrapper(wrapper)._compiled_run(q, k, v, k_scale, v_scale, window_left))


def _fake_outputs(wrapper: int, q):
    """(o, lse) as a run gives them: o [rows, Hq, D_vo] in the plan's output dtype, lse
    [rows, Hq] float32."""
    w = _wrapper(wrapper)
    o_dtype = getattr(torch, w._plan_o_dtype())  # a canonical dtype name
    o = q.new_empty(w._plan_o_shape(tuple(q.shape)), dtype=o_dtype)
    return o, q.new_empty(q.shape[:2], dtype=torch.float32)


@attention_run.register_fake
def _(wrapper, q, k, v, k_scale, v_scale, window_left):
    return _fake_outputs(wrapper, q)


@torch.library.custom_op(
    "rtcinfer::attention_run_plan_array", mutates_args=(),
    schema="(int wrapper, Tensor q, Tensor k, Tensor? v, Tensor plan_array, float k_scale, "
           "float v_scale, int? window_left) -> (Tensor, Tensor)",
)  # fmt: skip
def attention_run_plan_array(wrapper, q, k, v, plan_array, k_scale, v_scale, window_left):
    return tuple(_wrapper(wrapper)._compiled_run(q, k, v, k_scale, v_scale, window_left,
                                                 plan_array))  # fmt: skip


@attention_run_plan_array.register_fake
def _(wrapper, q, k, v, plan_array, k_scale, v_scale, window_left):
    return _fake_outputs(wrapper, q)


@torch.library.custom_op(
    "rtcinfer::mla_run", mutates_args=(),
    schema="(int wrapper, Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache) -> "
           "(Tensor, Tensor)",
)  # fmt: skip
def mla_run(wrapper, q_nope, q_pe, ckv_cache, kpe_cache):
    return tuple(_wrapper(wrapper)._compiled_run(q_nope, q_pe, ckv_cache, kpe_cache))


@mla_run.register_fake
def _(wrapper, q_nope, q_pe, ckv_cache, kpe_cache):
    o_dtype = getattr(torch, _wrapper(wrapper)._plan_o_dtype())
    return (q_nope.new_empty(q_nope.shape, dtype=o_dtype),
            q_nope.new_empty(q_nope.shape[:2], dtype=torch.float32))  # fmt: skip


def mla(wrapper, q_nope, q_pe, ckv_cache, kpe_cache) -> tuple:
    """An MLA wrapper's (o, lse) while PyTorch compiles: one mla_run node."""
    return torch.ops.rtcinfer.mla_run(wrapper._number, q_nope, q_pe, ckv_cache, kpe_cache)


@torch.library.custom_op(
    "rtcinfer::decode_device_plan", mutates_args=(),
    schema="(int wrapper, Tensor indptr, Tensor indices, Tensor last_page_len, int num_pages) "
           "-> Tensor",
)  # fmt: skip
def decode_device_plan(wrapper, indptr, indices, last_page_len, num_pages):
    return _wrapper(wrapper).device_plan_array(indptr, indices, last_page_len, num_pages)


@decode_device_plan.register_fake
def _(wrapper, indptr, indices, last_page_len, num_pages):
    return indptr.new_empty((_wrapper(wrapper).plan_array_size,), dtype=torch.int32)


def device_plan(wrapper, indptr, indices, last_page_len, num_pages: int):
    """A decode wrapper's device_plan_array() while PyTorch compiles: one node."""
    return torch.ops.rtcinfer.decode_device_plan(wrapper._number, indptr, indices,
                                                 last_page_len, num_pages)  # fmt: skip


def run(wrapper, q, k, v, out, lse, return_lse, q_scale=None, k_scale=None, v_scale=None,
        window_left=None, plan_array=None):  # fmt: skip
    """A wrapper's run() while PyTorch compiles: one attention_run node (with a plan array:
    one attention_run_plan_array node; the scales as run() combines them: q_scale * k_scale,
    v_scale), then the caller's out= / lse= filled, and the result shaped as run() returns
    it."""
    qk, vs = kv_scales(k_scale, v_scale, q_scale)
    ops, number = torch.ops.rtcinfer, wrapper._number
    if plan_array is None:
        o, s = ops.attention_run(number, q, k, v, qk, vs, window_left)
    else:
        o, s = ops.attention_run_plan_array(number, q, k, v, plan_array, qk, vs, window_left)
    if out is not None:
        out.copy_(o)
        o = out
    if lse is not None:
        lse.copy_(s)
        s = lse
    return (o, s) if return_lse else o


@torch.library.custom_op(
    "rtcinfer::single_prefill", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? custom_mask, Tensor? packed_custom_mask, "
           "ScalarType? o_dtype, bool causal, str kv_layout, str pos_encoding_mode, "
           "float? sm_scale, int window_left, float? logits_soft_cap, float? rope_scale, "
           "float? rope_theta) -> (Tensor, Tensor)",
)  # fmt: skip
def single_prefill_op(q, k, v, custom_mask, packed_custom_mask, o_dtype, causal, kv_layout,
                      pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale,
                      rope_theta):  # fmt: skip
    from .attention.single_prefill import single_prefill_with_kv_cache

    return tuple(single_prefill_with_kv_cache(
        q, k, v, o_dtype=o_dtype, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
        causal=causal, kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode,
        sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
        rope_scale=rope_scale, rope_theta=rope_theta, return_lse=True,
    ))  # fmt: skip


@single_prefill_op.register_fake
def _(q, k, v, custom_mask, packed_custom_mask, o_dtype, *rest):
    o_shape = (*q.shape[:2], v.shape[-1])  # v's head_dim
    return q.new_empty(o_shape, dtype=o_dtype or q.dtype), q.new_empty(
        q.shape[:2], dtype=torch.float32
    )


@torch.library.custom_op(
    "rtcinfer::single_decode", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, str kv_layout, str pos_encoding_mode, "
           "int window_left, float? logits_soft_cap, float? sm_scale, float? rope_scale, "
           "float? rope_theta, float k_scale, float v_scale) -> (Tensor, Tensor)",
)  # fmt: skip
def single_decode_op(q, k, v, kv_layout, pos_encoding_mode, window_left, logits_soft_cap,
                     sm_scale, rope_scale, rope_theta, k_scale, v_scale):  # fmt: skip
    from .attention.single_decode import single_decode_with_kv_cache

    return tuple(single_decode_with_kv_cache(
        q, k, v, kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode,
        window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
        rope_scale=rope_scale, rope_theta=rope_theta, k_scale=k_scale, v_scale=v_scale,
        return_lse=True,
    ))  # fmt: skip


@single_decode_op.register_fake
def _(q, *rest):
    return q.new_empty(q.shape), q.new_empty(q.shape[:1], dtype=torch.float32)


def single(name: str, q, return_lse, *args):
    """single_prefill / single_decode (`name`) while PyTorch compiles: its node, shaped as the
    public function returns it (o, or (o, lse))."""
    o, lse = getattr(torch.ops.rtcinfer, name)(q, *args)
    return (o, lse) if return_lse else o


def torch_dtype(dtype):
    """None, a torch dtype, or a dtype name as a torch dtype (a schema's ScalarType)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    from .interop.dtypes import normalize

    return getattr(torch, normalize(dtype))


__all__ = [
    "attention_run",
    "attention_run_plan_array",
    "decode_device_plan",
    "mla",
    "mla_run",
    "device_plan",
    "run",
    "single",
    "single_decode_op",
    "single_prefill_op",
]
