"""rtcinfer's ops as PyTorch custom ops: torch.compile traces them as single nodes with
fullgraph=True (on meta tensors here: their fake implementations give the shapes), and their
schemas follow the public functions' signatures."""

from __future__ import annotations

import inspect

import pytest

import rtcinfer

torch = pytest.importorskip("torch")


def _meta(*shape):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16)


def test_compile_traces_each_call_as_one_custom_op():
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(x, residual, w, up, beta):
        x, residual = rtcinfer.fused_add_rmsnorm(x, residual, w)
        rtcinfer.gemma_fused_add_rmsnorm(x, residual, w, 1e-5)
        y = rtcinfer.rmsnorm(x, w, 1e-5)
        z = rtcinfer.gemma_rmsnorm(y, w)
        out = torch.empty_like(z)
        rtcinfer.layernorm(z, w, beta, out=out)
        h = rtcinfer.silu_and_mul(up)
        g = rtcinfer.gelu_and_mul(up)
        rtcinfer.gelu_tanh_and_mul(up, out=g)
        return out, h, g

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    out, h, g = compiled(_meta(4, 64), _meta(4, 64), _meta(64), _meta(4, 256), _meta(64))
    assert out.shape == (4, 64) and h.shape == g.shape == (4, 128)
    ops = [s for s in seen if s.startswith("rtcinfer.")]
    assert ops == ["rtcinfer.fused_add_rmsnorm", "rtcinfer.gemma_fused_add_rmsnorm",
                   "rtcinfer.rmsnorm", "rtcinfer.gemma_rmsnorm", "rtcinfer.layernorm_out",
                   "rtcinfer.silu_and_mul", "rtcinfer.gelu_and_mul",
                   "rtcinfer.gelu_tanh_and_mul_out"]  # fmt: skip


PUBLIC = {
    "rmsnorm": rtcinfer.rmsnorm,
    "gemma_rmsnorm": rtcinfer.gemma_rmsnorm,
    "layernorm": rtcinfer.layernorm,
    "fused_add_rmsnorm": rtcinfer.fused_add_rmsnorm,
    "gemma_fused_add_rmsnorm": rtcinfer.gemma_fused_add_rmsnorm,
    "silu_and_mul": rtcinfer.silu_and_mul,
    "gelu_and_mul": rtcinfer.gelu_and_mul,
    "gelu_tanh_and_mul": rtcinfer.gelu_tanh_and_mul,
}


@pytest.mark.parametrize("name", list(PUBLIC))
def test_schemas_follow_the_public_signatures(name):
    """Each custom op takes the public function's arguments by the same names, in order (the
    _out form adds `out` last and declares it mutated; the fused norms mutate their input and
    residual)."""
    from rtcinfer import torch_ops

    assert torch_ops.call  # registers the ops
    public = [p for p in inspect.signature(PUBLIC[name]).parameters if p != "out"]
    schema = getattr(torch.ops.rtcinfer, name).default._schema
    assert [a.name for a in schema.arguments] == public
    mutated = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
    assert mutated == ({"input", "residual"} if "fused" in name else set())
    out_form = getattr(torch.ops.rtcinfer, f"{name}_out", None)
    if out_form is not None:
        args = out_form.default._schema.arguments
        assert [a.name for a in args] == [*public, "out"]
        assert [a.name for a in args if a.alias_info and a.alias_info.is_write] == ["out"]


@pytest.mark.gpu
def test_compiled_calls_give_the_eager_bits():
    """On the GPU, with fullgraph=True and AOTAutograd (functionalization of the declared
    mutations): the same bits as the eager calls, the fused norm's in-place updates included."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step(x, residual, w, up):
        rtcinfer.fused_add_rmsnorm(x, residual, w)
        out = torch.empty_like(x)
        rtcinfer.rmsnorm(x, w, 1e-5, out=out)
        return out, rtcinfer.silu_and_mul(up)

    args = (randn(8, 4096), randn(8, 4096), randn(4096), randn(8, 2 * 14336))
    eager_args = [a.clone() for a in args]
    want = step(*eager_args)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    for a, b in zip((*got, args[0], args[1]), (*want, eager_args[0], eager_args[1]), strict=True):
        assert torch.equal(a, b)
