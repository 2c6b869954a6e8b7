"""rtcinfer's ops as PyTorch custom ops: torch.compile traces them as single nodes with
fullgraph=True (on meta tensors here: their fake implementations give the shapes), and their
schemas follow the public functions' signatures."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import rtcinfer
from rtcinfer.interop.arrays import TORCH_TENSOR, compilable

torch = pytest.importorskip("torch")
from rtcinfer import torch_ops  # noqa: E402 - needs PyTorch


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


def test_the_norms_with_an_fp8_output_are_one_node_each():
    """rmsnorm_quant and fused_add_rmsnorm_quant: out (and the residual) written in place, the
    scale an array or a number (split in two arguments), out_dtype passed on."""
    seen = []

    def backend(gm, inputs):
        seen.extend(n for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(out, x, residual, w, scale):
        rtcinfer.fused_add_rmsnorm_quant(out, x, residual, w, scale, 1e-5)
        return rtcinfer.rmsnorm_quant(out, x, w, 0.5, out_dtype="float8_e4m3fn")

    out = torch.empty(4, 64, device="meta", dtype=torch.float8_e4m3fn)
    scale = torch.empty(1, device="meta", dtype=torch.float32)
    got = torch.compile(step, fullgraph=True, backend=backend)(out, _meta(4, 64), _meta(4, 64),
                                                               _meta(64), scale)  # fmt: skip
    assert got.shape == (4, 64) and got.dtype == torch.float8_e4m3fn
    nodes = [n for n in seen if str(n.target).startswith("rtcinfer.")]
    assert [str(n.target) for n in nodes] == ["rtcinfer.fused_add_rmsnorm_quant",
                                              "rtcinfer.rmsnorm_quant"]  # fmt: skip
    assert nodes[0].args[4] is not None and nodes[0].args[5:] == (1.0, 1e-5, None)
    assert nodes[1].args[3:] == (None, 0.5, 1e-6, "float8_e4m3fn")
    for name, written in (("rmsnorm_quant", ["out"]),
                          ("fused_add_rmsnorm_quant", ["out", "residual"])):  # fmt: skip
        args = getattr(torch.ops.rtcinfer, name).default._schema.arguments
        assert [a.name for a in args if a.alias_info and a.alias_info.is_write] == written


def test_every_rope_form_is_one_node():
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(q, k, pos, indptr, offsets, cache):
        rtcinfer.apply_rope_pos_ids_inplace(q, k, pos)
        rtcinfer.apply_llama31_rope_inplace(q, k, indptr, offsets, rope_scale=8.0)
        q2, k2 = rtcinfer.apply_rope(q, k, indptr, offsets)
        out = (torch.empty_like(q2), torch.empty_like(k2))
        rtcinfer.apply_llama31_rope_pos_ids(q2, k2, pos, out=out)
        query, key = q.reshape(4, -1), k.reshape(4, -1)
        rtcinfer.apply_rope_with_cos_sin_cache_inplace(pos, query, key, 8, cache)
        return q2, out[0]

    ints = lambda *shape: torch.empty(*shape, device="meta", dtype=torch.int32)  # noqa: E731
    cache = torch.empty(100, 8, device="meta", dtype=torch.float32)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    q2, q_out = compiled(_meta(4, 2, 8), _meta(4, 1, 8), ints(4), ints(3), ints(2), cache)
    assert q2.shape == q_out.shape == (4, 2, 8)
    assert [s for s in seen if s.startswith("rtcinfer.")] == [
        "rtcinfer.apply_rope_pos_ids_inplace", "rtcinfer.apply_llama31_rope_inplace",
        "rtcinfer.apply_rope", "rtcinfer.apply_llama31_rope_pos_ids_out",
        "rtcinfer.apply_rope_with_cos_sin_cache_inplace",
    ]  # fmt: skip


def test_rope_with_fp8_outputs_is_one_node_a_call():
    """rope_quantize_fp8 (and its MLA name) and the form that appends to a paged cache trace as
    one op each, their outputs made beside it (fp8 tensors of the right shapes)."""
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(q, k, qn, kn, v, table, pos, k_cache, v_cache, ckv, kpe, ints):
        gqa = rtcinfer.rope_quantize_fp8(q, k, qn, kn, table, pos, quantize_dtype=torch.float8_e5m2)
        mla = rtcinfer.mla_rope_quantize_fp8(q, k[:, 0], None, None, table, pos)
        appended = rtcinfer.rope_quantize_fp8_append_paged_kv_cache(
            q, k, qn, kn, v, table, pos, (k_cache, v_cache), ints, ints, pos, pos, page_size=4
        )
        latent = rtcinfer.rope_quantize_fp8_append_paged_kv_cache(
            q, k[:, 0], qn, kn[:, 0], None, table, pos, (ckv, kpe), ints, ints, pos, pos,
            page_size=4)  # fmt: skip
        return gqa, mla, appended, latent

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, device="meta", dtype=dtype)

    fp8 = torch.float8_e4m3fn
    args = (meta(4, 2, 8), meta(4, 1, 8), meta(4, 2, 16), meta(4, 1, 16), meta(4, 1, 24),
            meta(100, 8, dtype=torch.float32), meta(4, dtype=torch.int32),
            meta(6, 4, 1, 24, dtype=fp8), meta(6, 4, 1, 24, dtype=fp8),
            meta(6, 4, 16, dtype=fp8), meta(6, 4, 8, dtype=fp8),
            meta(5, dtype=torch.int32))  # fmt: skip
    gqa, mla, appended, latent = torch.compile(step, fullgraph=True, backend=backend)(*args)
    assert [tuple(o.shape) for o in gqa] == [(4, 2, 8), (4, 1, 8), (4, 2, 16), (4, 1, 16)]
    assert {o.dtype for o in gqa} == {torch.float8_e5m2}
    assert [tuple(o.shape) for o in mla] == [(4, 2, 8), (4, 8), (4, 2, 0), (4, 0)]
    assert [tuple(o.shape) for o in (*appended, *latent)] == [(4, 2, 8), (4, 2, 16)] * 2
    assert [s for s in seen if s.startswith("rtcinfer.")] == [
        "rtcinfer.rope_quantize_fp8", "rtcinfer.rope_quantize_fp8",
        "rtcinfer.rope_quantize_fp8_append_paged_kv_cache",
        "rtcinfer.rope_quantize_fp8_append_paged_kv_cache",
    ]  # fmt: skip


def test_merges_the_append_and_the_index_ops_are_one_node_each():
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(va, sa, vb, sb, vs, ss, key, bi, pos, cache, idx, indptr, last):
        seq_lens = rtcinfer.get_seq_lens(indptr, last, 16)
        bi, pos = rtcinfer.get_batch_indices_positions(indptr, seq_lens, 5, bi, pos)
        rtcinfer.get_batch_indices_positions(indptr, seq_lens, 5)
        v, s = rtcinfer.merge_state(va, sa, vb, sb)
        rtcinfer.merge_state_in_place(v, s, vb, sb)
        rtcinfer.merge_sinks_in_place(v, s, sa[0])
        v2, s2 = rtcinfer.merge_states(vs, ss)
        c = rtcinfer.append_paged_kv_cache(key, key, bi, pos, cache, idx, indptr, last)
        kc, vc = rtcinfer.append_paged_kv_cache(key, key, bi, pos, (cache[:, 0], cache[:, 1]),
                                                idx, indptr, last)  # fmt: skip
        return v, s, v2, s2, c, kc

    f32 = lambda *shape: torch.empty(*shape, device="meta", dtype=torch.float32)  # noqa: E731
    ints = lambda *shape: torch.empty(*shape, device="meta", dtype=torch.int32)  # noqa: E731
    args = (_meta(4, 8, 64), f32(4, 8), _meta(4, 8, 64), f32(4, 8), _meta(4, 3, 8, 64),
            f32(4, 3, 8), _meta(5, 2, 64), ints(5), ints(5), _meta(10, 2, 16, 2, 64), ints(10),
            ints(3), ints(2))  # fmt: skip
    outs = torch.compile(step, fullgraph=True, backend=backend)(*args)
    assert [tuple(o.shape) for o in outs] == [(4, 8, 64), (4, 8), (4, 8, 64), (4, 8),
                                              (10, 2, 16, 2, 64), (10, 16, 2, 64)]  # fmt: skip
    assert [s for s in seen if s.startswith("rtcinfer.")] == [
        "rtcinfer.get_seq_lens", "rtcinfer.get_batch_indices_positions_into",
        "rtcinfer.get_batch_indices_positions",
        "rtcinfer.merge_state", "rtcinfer.merge_state_in_place",
        "rtcinfer.merge_sinks_in_place", "rtcinfer.merge_states",
        "rtcinfer.append_paged_kv_cache", "rtcinfer.append_paged_kv_cache_pair",
    ]  # fmt: skip


@pytest.mark.parametrize("name, written", [
    ("merge_state", []), ("merge_state_in_place", ["v", "s"]), ("merge_states", []),
    ("merge_sinks_in_place", ["v", "s"]),
    ("append_paged_kv_cache", ["paged_kv_cache"]),
])  # fmt: skip
def test_merge_and_append_schemas(name, written):
    from rtcinfer import torch_ops

    assert torch_ops.call_public
    public = [p for p in inspect.signature(getattr(rtcinfer, name)).parameters if p != "out"]
    schema = getattr(torch.ops.rtcinfer, name).default._schema
    assert [a.name for a in schema.arguments] == public
    assert [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] == written


def test_samplers_renorms_and_softmax_are_one_node_each():
    """The probability samplers (one `sample` op whose scalar-or-array parameters take two
    arguments each), the renorms and the top-k mask (`threshold`) and softmax; the logits
    sampler is softmax then a sampler. A torch.Generator cannot enter a graph: seeds can."""
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(logits, probs, k, indices, out):
        a = rtcinfer.top_k_top_p_sampling_from_logits(logits, 50, 0.9, seed=3, offset=1)
        b = rtcinfer.top_k_sampling_from_probs(probs, k, indices)
        rtcinfer.min_p_sampling_from_probs(probs, 0.1, out=out, seed=1, offset=0)
        return (a, b, rtcinfer.top_p_renorm_probs(probs, 0.9),
                rtcinfer.top_k_mask_logits(logits, k), rtcinfer.softmax(logits, 0.7))  # fmt: skip

    f32 = lambda *shape: torch.empty(*shape, device="meta", dtype=torch.float32)  # noqa: E731
    ints = lambda n, dt=torch.int32: torch.empty(n, device="meta", dtype=dt)  # noqa: E731
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    a, b, r, m, sm = compiled(f32(4, 1000), f32(4, 1000), ints(4), ints(3, torch.int64), ints(4))
    assert (a.shape, a.dtype, b.shape, b.dtype) == ((4,), torch.int32, (3,), torch.int64)
    assert r.shape == m.shape == sm.shape == (4, 1000)
    assert [s for s in seen if s.startswith("rtcinfer.")] == [
        "rtcinfer.softmax", "rtcinfer.sample", "rtcinfer.sample", "rtcinfer.sample_out",
        "rtcinfer.threshold", "rtcinfer.threshold", "rtcinfer.softmax",
    ]  # fmt: skip
    generator = torch.Generator()
    with pytest.raises(Exception, match="instead of a torch.Generator"):
        torch.compile(lambda p: rtcinfer.sampling_from_probs(p, generator=generator),
                      fullgraph=True, backend="eager")(f32(4, 100))  # fmt: skip


def test_top_k_is_one_node():
    """top_k (values and indices), sorted or not, traced as one custom op a call."""
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(logits):
        v, i = rtcinfer.top_k(logits, 16)
        w, j = rtcinfer.top_k(logits, 8, sorted=True)
        return v, i, w, j

    logits = torch.empty(4, 1000, device="meta", dtype=torch.bfloat16)
    v, i, w, j = torch.compile(step, fullgraph=True, backend=backend)(logits)
    assert (v.shape, v.dtype, i.shape, i.dtype) == ((4, 16), torch.bfloat16, (4, 16), torch.int64)
    assert (w.shape, j.dtype) == ((4, 8), torch.int64)
    assert [s for s in seen if s.startswith("rtcinfer.")] == ["rtcinfer.top_k", "rtcinfer.top_k"]


def test_speculative_sampling_is_one_node():
    """chain_speculative_sampling: with new counters (three new arrays) or the caller's
    (updated in place: a second op that writes them)."""
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(draft, ids, target, accepted, emitted):
        new = rtcinfer.chain_speculative_sampling(draft, ids, target, seed=1, offset=2)
        given = rtcinfer.chain_speculative_sampling(draft, ids, target, accepted, emitted,
                                                    seed=1, offset=2)  # fmt: skip
        return new, given

    f32 = lambda *shape: torch.empty(*shape, device="meta", dtype=torch.float32)  # noqa: E731
    ints = lambda *shape: torch.empty(*shape, device="meta", dtype=torch.int32)  # noqa: E731
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    new, given = compiled(f32(2, 3, 100), ints(2, 3), f32(2, 4, 100), ints(2), ints(2))
    assert [tuple(x.shape) for x in (*new, *given)] == [(2, 4), (2,), (2,)] * 2
    assert [s for s in seen if s.startswith("rtcinfer.")] == [
        "rtcinfer.chain_speculative_sampling", "rtcinfer.chain_speculative_sampling_into"
    ]  # fmt: skip


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


ROTATED = ("q", "k", "query", "key")


@pytest.mark.parametrize("fn", rtcinfer.rope.PUBLIC, ids=lambda f: f.__name__)
def test_rope_schemas_follow_the_public_signatures(fn):
    """A RoPE op takes the function's arguments by name and in order; the in-place forms
    mutate the rotated tensors, the _out forms their two outputs."""
    from rtcinfer import torch_ops

    assert torch_ops.call_public  # registers the ops
    public = [p for p in inspect.signature(fn).parameters if p != "out"]
    schema = getattr(torch.ops.rtcinfer, fn.__name__).default._schema
    assert [a.name for a in schema.arguments] == public
    mutated = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    rotated = [n for n in public if n in ROTATED]
    assert mutated == (rotated if fn.__name__.endswith("_inplace") else [])
    out_form = getattr(torch.ops.rtcinfer, f"{fn.__name__}_out", None)
    assert (out_form is None) == fn.__name__.endswith("_inplace")
    if out_form is not None:
        args = out_form.default._schema.arguments
        assert [a.name for a in args] == [*public, *(f"{n}_out" for n in rotated)]


@pytest.mark.parametrize("name", list(PUBLIC))
def test_schemas_follow_the_public_signatures(name):
    """Each custom op takes the public function's arguments by the same names, in order (the
    _out form adds the output array last, `input_out`, and declares it written; the fused
    norms write their input and residual); enable_pdl, which changes nothing, is left out."""
    from rtcinfer import torch_ops

    assert torch_ops.call  # registers the ops
    public = [p for p in inspect.signature(PUBLIC[name]).parameters
              if p not in ("out", "enable_pdl")]  # fmt: skip
    schema = getattr(torch.ops.rtcinfer, name).default._schema
    assert [a.name for a in schema.arguments] == public
    mutated = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
    assert mutated == ({"input", "residual"} if "fused" in name else set())
    out_form = getattr(torch.ops.rtcinfer, f"{name}_out", None)
    assert (out_form is None) == ("fused" in name)
    if out_form is not None:
        args = out_form.default._schema.arguments
        assert [a.name for a in args] == [*public, "input_out"]
        assert [a.name for a in args if a.alias_info and a.alias_info.is_write] == ["input_out"]


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


@pytest.mark.gpu
def test_compiled_rope_gives_the_eager_bits():
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    pos = torch.randint(0, 4096, (64,), device="cuda", dtype=torch.int32, generator=gen)

    def step(q, k, pos):
        rtcinfer.apply_llama31_rope_pos_ids_inplace(q, k, pos)
        return rtcinfer.apply_rope_pos_ids(q, k, pos, rope_theta=5e5)

    eager_q, eager_k = q.clone(), k.clone()
    want = step(eager_q, eager_k, pos)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, pos)
    for a, b in zip((*got, q, k), (*want, eager_q, eager_k), strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_compiled_merge_and_append_give_the_eager_bits():
    gen = torch.Generator(device="cuda").manual_seed(2)
    v = torch.randn(16, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    s = torch.randn(16, 8, device="cuda", generator=gen)
    key = torch.randn(4, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    cache = torch.zeros(3, 2, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    ints = lambda *x: torch.tensor(x, device="cuda", dtype=torch.int32)  # noqa: E731
    table = (ints(2, 0, 1), ints(0, 1, 3), ints(2, 1))  # two requests: 1 page, 2 pages

    def step(v, s, v_other, s_other, cache):
        v, s = rtcinfer.merge_state(v, s, v_other, s_other)
        rtcinfer.append_paged_kv_cache(key, key, ints(0, 1, 1, 1), ints(1, 14, 15, 16), cache,
                                       *table)  # fmt: skip
        return v, s

    args = (v, s, v.flip(0), s.flip(0), cache)
    eager_cache = cache.clone()
    want = step(*args[:4], eager_cache)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(cache, eager_cache)


@pytest.mark.gpu
def test_compiled_sampling_gives_the_eager_tokens():
    gen = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(32, 32000, device="cuda", generator=gen) * 3

    def step(logits):
        probs = rtcinfer.softmax(logits, 0.8)
        return (rtcinfer.top_k_top_p_sampling_from_probs(probs, 40, 0.9, seed=7, offset=5),
                rtcinfer.top_p_renorm_probs(probs, 0.5))  # fmt: skip

    want = step(logits)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(logits)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
def test_compiled_speculative_sampling_gives_the_eager_tokens():
    gen = torch.Generator(device="cuda").manual_seed(4)
    draft = torch.softmax(torch.randn(8, 3, 1000, device="cuda", generator=gen), -1)
    target = torch.softmax(torch.randn(8, 4, 1000, device="cuda", generator=gen), -1)
    ids = torch.randint(0, 1000, (8, 3), device="cuda", dtype=torch.int32, generator=gen)

    def step(draft, ids, target, accepted, emitted):
        return rtcinfer.chain_speculative_sampling(draft, ids, target, accepted, emitted,
                                                   seed=11, offset=0)  # fmt: skip

    counters = [torch.zeros(8, device="cuda", dtype=torch.int32) for _ in range(4)]
    want = step(draft, ids, target, *counters[:2])
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(draft, ids, target,
                                                                   *counters[2:])  # fmt: skip
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(counters[2], counters[0]) and torch.equal(counters[3], counters[1])


@pytest.mark.gpu
def test_compiled_attention_runs_follow_each_new_plan():
    """A step calling batch decode and paged prefill, compiled once (inductor), gives the
    eager bits after every re-plan with new lengths and pages, without recompiling."""
    import numpy as np

    gen = torch.Generator(device="cuda").manual_seed(5)
    cache = torch.randn(64, 2, 16, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    q_dec = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(12, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    dec = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    paged = rtcinfer.BatchPrefillWithPagedKVCacheWrapper()
    rng = np.random.default_rng(6)

    def tables(lens):
        pages = [-(-n // 16) for n in lens]
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        indices = rng.permutation(64)[: indptr[-1]].astype(np.int32)
        last = np.array([n - (p - 1) * 16 for n, p in zip(lens, pages, strict=True)], np.int32)
        return indptr, indices, last

    def replan(dec_lens, pre_lens):
        dec.plan(*tables(dec_lens), 8, 2, 128, 16, q_data_type="bfloat16")
        paged.plan(np.array([0, 5, 12], np.int32), *tables(pre_lens), 8, 2, 128, 16,
                   causal=True, q_data_type="bfloat16")  # fmt: skip

    def step(q_dec, q, cache):
        o, lse = dec.run(q_dec, cache, return_lse=True)
        return o, lse, paged.run(q, cache)

    compiled = torch.compile(step, fullgraph=True)
    for dec_lens, pre_lens in (([40, 3, 170], [9, 21]), ([1, 300, 17], [5, 200]),
                               ([64, 64, 64], [12, 7])):  # fmt: skip
        replan(dec_lens, pre_lens)
        want = step(q_dec, q, cache)
        got = compiled(q_dec, q, cache)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_compiled_single_requests_and_shared_prefix_give_the_eager_bits():
    """single_decode, single_prefill and the shared-prefix decode wrapper compiled (fullgraph,
    aot_eager) give the eager calls' bits."""
    import numpy as np

    gen = torch.Generator(device="cuda").manual_seed(7)
    rand = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q_one, q, k, v = rand(8, 128), rand(3, 8, 128), rand(300, 2, 128), rand(300, 2, 128)
    cache = rand(8, 2, 16, 2, 128)
    shared = rtcinfer.BatchDecodeWithSharedPrefixPagedKVCacheWrapper()
    shared.plan(np.array([0, 1, 3, 4], np.int32), np.array([5, 0, 7, 2], np.int32),
                np.array([9, 16, 3], np.int32), 8, 2, 128, 16, q_data_type="bfloat16")  # fmt: skip

    def step(q_one, q, k, v, cache):
        o1 = rtcinfer.single_decode_with_kv_cache(q_one, k, v)
        o2, lse2 = rtcinfer.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
        return o1, o2, lse2, shared.run(q, k, v, cache)

    want = step(q_one, q, k, v, cache)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q_one, q, k, v, cache)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_compilable_wrapper_keeps_the_signature_and_passes_every_argument():
    seen = []

    def op(input, weight, eps: float = 1e-6, *, out=None, flag=False):
        """doc"""
        seen.append((input, weight, eps, out, flag))
        return "ran"

    wrapped = compilable("input")(op)
    assert inspect.signature(wrapped) == inspect.signature(op)
    assert (wrapped.__name__, wrapped.__doc__, wrapped.__wrapped__) == ("op", "doc", op)
    assert wrapped(1, 2) == "ran" and seen[-1] == (1, 2, 1e-6, None, False)
    assert wrapped(1, weight=2, eps=3.0, out=4, flag=True) == "ran"
    assert seen[-1] == (1, 2, 3.0, 4, True)
    with pytest.raises(TypeError):
        wrapped(1, 2, 3.0, 4)  # out is keyword-only, as in the function
    with pytest.raises(TypeError, match="not supported"):
        compilable("x")(lambda x, *rest: None)


def test_a_compilable_call_is_routed_only_while_compiling(monkeypatch):
    routed = []

    def call_public(fn, args, kwargs):
        routed.append((fn.__name__, args, kwargs))

    monkeypatch.setattr(torch_ops, "call_public", call_public)

    def op(input, scale=2.0, *, out=None):
        return "eager"

    wrapped = compilable("input")(op)
    x = torch.zeros(2)
    assert wrapped(x) == "eager" and not routed
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    bound = TORCH_TENSOR[1]
    TORCH_TENSOR[1] = torch.compiler.is_compiling  # the patched test, as bound once PyTorch
    try:  # was seen
        wrapped(x, 3.0, out=x)
    finally:
        TORCH_TENSOR[1] = bound
    assert routed == [("op", (x, 3.0), {"out": x})]
    assert wrapped(object()) == "eager"  # not a tensor: never routed


def test_eager_calls_between_compiled_ones_do_not_recompile():
    """The compile test keeps no state that TorchDynamo would guard on: calls of other
    argument types between two compiled calls leave the compiled graph valid."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda x, w: rtcinfer.rmsnorm(x, w), fullgraph=True,
                             backend=backend)  # fmt: skip
    compiled(_meta(4, 64), _meta(64))
    for x in (np.zeros((4, 64), np.float32), [0.0] * 64):  # refused by name, after the test
        with pytest.raises(TypeError):
            rtcinfer.rmsnorm(x, np.zeros(64, np.float32))
    compiled(_meta(4, 64), _meta(64))
    assert len(graphs) == 1
