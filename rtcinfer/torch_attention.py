"""The batch attention wrappers' run() as one PyTorch custom op, so that torch.compile traces
a step that calls them as opaque nodes (fullgraph=True) whose plan stays outside the graph.

    rtcinfer::attention_run(int wrapper, Tensor q, Tensor k, Tensor? v, float? q_scale,
                            float? k_scale, float? v_scale, int? window_left) -> (o, lse)

`wrapper` is the wrapper's registry number (attention/planned.py: live_wrapper), a constant of
the compiled graph: at run time the op calls that wrapper's run() with its current plan, so
plan() between steps (new lengths, new pages) neither retraces nor recompiles, and the graph
reads nothing of the plan at trace time except the output dtype. o has q's shape in the plan's
output dtype; lse is [rows, Hq] float32 (base 2), always computed (a few bytes a row). `out=`
and `lse=` given to run() while compiling are filled by a copy. Imported only where PyTorch is.
"""

from __future__ import annotations

import torch

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
    schema="(int wrapper, Tensor q, Tensor k, Tensor? v, float? q_scale, float? k_scale, "
           "float? v_scale, int? window_left) -> (Tensor, Tensor)",
)  # fmt: skip
def attention_run(wrapper, q, k, v, q_scale, k_scale, v_scale, window_left):
    return tuple(_wrapper(wrapper)._compiled_run(q, k, v, q_scale, k_scale, v_scale,
                                                 window_left))  # fmt: skip


@attention_run.register_fake
def _(wrapper, q, k, v, q_scale, k_scale, v_scale, window_left):
    o_dtype = getattr(torch, _wrapper(wrapper)._plan_o_dtype())  # a canonical dtype name
    return q.new_empty(q.shape, dtype=o_dtype), q.new_empty(q.shape[:2], dtype=torch.float32)


def run(wrapper, q, k, v, out, lse, return_lse, q_scale=None, k_scale=None, v_scale=None,
        window_left=None):  # fmt: skip
    """A wrapper's run() while PyTorch compiles: one attention_run node, then the caller's
    out= / lse= filled, and the result shaped as run() returns it."""
    scales = (_float(q_scale), _float(k_scale), _float(v_scale))
    o, s = torch.ops.rtcinfer.attention_run(wrapper._number, q, k, v, *scales, window_left)
    if out is not None:
        out.copy_(o)
        o = out
    if lse is not None:
        lse.copy_(s)
        s = lse
    return (o, s) if return_lse else o


def _float(x):
    return None if x is None else float(x)


__all__ = ["attention_run", "run"]
