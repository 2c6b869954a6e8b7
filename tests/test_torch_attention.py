"""The attention wrappers' run() under torch.compile (on meta tensors, no GPU): one
rtcinfer.attention_run node per call, outputs shaped by the plan, and re-planning between
calls neither retraces nor recompiles."""

from __future__ import annotations

import numpy as np
import pytest

from .fakes import attention_without_a_gpu

torch = pytest.importorskip("torch")


@pytest.fixture
def planned(monkeypatch):
    """Decode and prefill modules whose wrappers plan without a GPU."""
    from rtcinfer.attention import decode, prefill

    attention_without_a_gpu(monkeypatch)
    return decode, prefill


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def decode_tables(lens, page=16):
    pages = [-(-n // page) for n in lens]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = np.arange(indptr[-1], dtype=np.int32)[::-1].copy()
    last = np.array([n - (p - 1) * page for n, p in zip(lens, pages, strict=True)], np.int32)
    return indptr, indices, last


def test_decode_and_prefill_runs_are_one_node_each_and_replans_do_not_recompile(planned):
    decode, prefill = planned
    dec = decode.BatchDecodeWithPagedKVCacheWrapper()
    dec.plan(*decode_tables([40, 3, 17]), 8, 2, 64, 16, q_data_type="bfloat16",
             o_data_type="float16")  # fmt: skip
    ragged = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    qo = np.array([0, 5, 12], np.int32)
    ragged.plan(qo, np.array([0, 9, 30], np.int32), 8, 2, 64, causal=True,
                q_data_type="bfloat16")  # fmt: skip
    paged = prefill.BatchPrefillWithPagedKVCacheWrapper()
    paged.plan(qo, *decode_tables([9, 21]), 8, 2, 64, 16, causal=True, q_data_type="bfloat16")
    graphs, seen = [], []

    def backend(gm, inputs):
        graphs.append(gm)
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(q_dec, cache, k_pair, v_pair, q, k, v, out):
        o_dec, lse_dec = dec.run(q_dec, cache, return_lse=True, k_scale=0.5)
        o_pair = dec.run(q_dec, (k_pair, v_pair))
        o_ragged = ragged.run(q, k, v, out=out)
        o_paged, lse_paged = paged.run(q, cache, return_lse=True)
        return o_dec, lse_dec, o_pair, o_ragged, o_paged, lse_paged

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    args = (meta(3, 8, 64), meta(10, 2, 16, 2, 64), meta(10, 16, 2, 64), meta(10, 16, 2, 64),
            meta(12, 8, 64), meta(30, 2, 64), meta(30, 2, 64), meta(12, 8, 64))  # fmt: skip
    o_dec, lse_dec, o_pair, o_ragged, o_paged, lse_paged = compiled(*args)
    assert (o_dec.shape, o_dec.dtype, lse_dec.shape) == ((3, 8, 64), torch.float16, (3, 8))
    assert lse_dec.dtype == torch.float32 and o_pair.dtype == torch.float16
    assert o_ragged is args[-1] or o_ragged.shape == (12, 8, 64)
    assert (o_paged.shape, o_paged.dtype, lse_paged.shape) == ((12, 8, 64), torch.bfloat16,
                                                               (12, 8))  # fmt: skip
    assert [s for s in seen if s.startswith("rtcinfer.")] == ["rtcinfer.attention_run"] * 4
    # new lengths and pages, same shapes: the compiled graph is reused
    dec.plan(*decode_tables([1, 33, 100]), 8, 2, 64, 16, q_data_type="bfloat16",
             o_data_type="float16")  # fmt: skip
    ragged.plan(qo, np.array([0, 5, 40], np.int32), 8, 2, 64, causal=True,
                q_data_type="bfloat16")  # fmt: skip
    paged.plan(qo, *decode_tables([30, 7]), 8, 2, 64, 16, causal=True, q_data_type="bfloat16")
    compiled(*args)
    assert len(graphs) == 1


def test_runs_with_sinks_compile_to_the_run_and_the_sink_merge(planned):
    """run(sinks=) of the decode (both kinds) and paged prefill wrappers: attention_run, then
    merge_sinks_in_place on its (o, lse), no graph break; the LSE form follows the merge."""
    decode, prefill = planned
    dec = decode.BatchDecodeWithPagedKVCacheWrapper()
    dec.plan(*decode_tables([40, 3, 17]), 8, 2, 64, 16, q_data_type="bfloat16")
    tc = decode.BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)
    tc.plan(*decode_tables([40, 3, 17]), 8, 2, 64, 16, q_data_type="bfloat16")
    paged = prefill.BatchPrefillWithPagedKVCacheWrapper()
    paged.plan(np.array([0, 5, 12], np.int32), *decode_tables([9, 21]), 8, 2, 64, 16,
               causal=True, q_data_type="bfloat16")  # fmt: skip
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(q_dec, q, cache, sinks):
        o_dec = dec.run(q_dec, cache, sinks=sinks)
        o_tc, lse_tc = tc.run(q_dec, cache, sinks=sinks, return_lse=True)
        o, lse = paged.run(q, cache, sinks=sinks, return_lse=True, lse_layout="HN")
        return o_dec, o_tc, lse_tc, o, lse

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    sinks = meta(8, dtype=torch.float32)
    o_dec, o_tc, lse_tc, o, lse = compiled(meta(3, 8, 64), meta(12, 8, 64),
                                           meta(10, 2, 16, 2, 64), sinks)  # fmt: skip
    assert o_dec.shape == o_tc.shape == (3, 8, 64) and lse_tc.shape == (3, 8)
    assert o.shape == (12, 8, 64) and lse.shape == (8, 12)
    assert [s for s in seen if s.startswith("rtcinfer.")] == [
        "rtcinfer.attention_run", "rtcinfer.merge_sinks_in_place",
    ] * 3  # fmt: skip


def test_a_compiled_graph_names_its_wrapper_and_says_when_it_is_gone(planned):
    _, prefill = planned
    from rtcinfer import torch_attention

    ragged = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    number = ragged._number
    assert torch_attention.live_wrapper(number) is ragged
    del ragged
    import gc

    gc.collect()
    with pytest.raises(RuntimeError, match=f"number {number}\\) was deleted"):
        torch.ops.rtcinfer.attention_run(number, meta(1, 8, 64), meta(1, 2, 64), None, 1.0, 1.0,
                                         None)  # fmt: skip


def test_the_cascade_wrapper_compiles_to_its_levels_and_a_merge(planned):
    """MultiLevelCascadeAttentionWrapper.run under torch.compile: one attention_run per level
    (each its level's prefill wrapper) and the in-place state merge, no graph break."""
    from rtcinfer.attention.shared_prefix import MultiLevelCascadeAttentionWrapper

    cascade = MultiLevelCascadeAttentionWrapper(2)
    shared = decode_tables([32])  # one group of every query over the shared prefix's pages
    own = decode_tables([5, 17])
    cascade.plan([np.array([0, 2], np.int32), np.array([0, 1, 2], np.int32)],
                 [shared[0], own[0]], [shared[1], own[1] + 2], [shared[2], own[2]],
                 8, 2, 64, 16, q_data_type="bfloat16")  # fmt: skip
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(lambda q, cache: cascade.run(q, cache, return_lse=True),
                             fullgraph=True, backend=backend)  # fmt: skip
    o, lse = compiled(meta(2, 8, 64), meta(8, 2, 16, 2, 64))
    assert o.shape == (2, 8, 64) and lse.shape == (2, 8)
    ours = [s for s in seen if s.startswith("rtcinfer.")]
    assert ours == ["rtcinfer.attention_run", "rtcinfer.attention_run",
                    "rtcinfer.merge_state_in_place"]  # fmt: skip


def test_single_requests_and_the_shared_prefix_wrapper_compile(planned):
    """single_decode and single_prefill are one node each (o, lse always computed; the call
    returns what return_lse asks for), and the shared-prefix decode wrapper compiles to its
    prefix level (single_prefill), its pages (attention_run) and the merge."""
    import rtcinfer
    from rtcinfer.attention.shared_prefix import BatchDecodeWithSharedPrefixPagedKVCacheWrapper

    shared = BatchDecodeWithSharedPrefixPagedKVCacheWrapper()
    shared.plan(*decode_tables([5, 17]), 8, 2, 64, 16, q_data_type="bfloat16")
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(q, k, v, q_one, cache):
        o1 = rtcinfer.single_decode_with_kv_cache(q_one, k, v, k_scale=2)
        o2, lse2 = rtcinfer.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True,
                                                         o_dtype="float16")  # fmt: skip
        o3 = shared.run(q, k, v, cache)
        return o1, o2, lse2, o3

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    o1, o2, lse2, o3 = compiled(meta(3, 8, 64), meta(40, 2, 64), meta(40, 2, 64), meta(8, 64),
                                meta(4, 2, 16, 2, 64))  # fmt: skip
    assert o1.shape == (8, 64) and o2.shape == (3, 8, 64) and o2.dtype == torch.float16
    assert lse2.shape == (3, 8) and o3.shape == (3, 8, 64)
    assert [s for s in seen if s.startswith("rtcinfer.")] == [
        "rtcinfer.single_decode", "rtcinfer.single_prefill", "rtcinfer.single_prefill",
        "rtcinfer.attention_run", "rtcinfer.merge_state_in_place",
    ]  # fmt: skip


def test_plans_on_the_device_and_plan_arrays_are_one_node_each(planned):
    """A decode step that plans on the device (device_plan_array) and runs over that plan, and
    a prefill run over a plan array: one node each; new plans do not recompile."""
    decode, prefill = planned
    dec = decode.BatchDecodeWithPagedKVCacheWrapper(
        use_cuda_graph=True, paged_kv_indptr_buffer=np.zeros(4, np.int32),
        paged_kv_indices_buffer=np.zeros(16, np.int32))  # fmt: skip
    dec.plan(*decode_tables([40, 3, 17]), 8, 2, 64, 16, q_data_type="bfloat16",
             o_data_type="float16")  # fmt: skip
    pre = prefill.BatchPrefillWithRaggedKVCacheWrapper(
        use_cuda_graph=True, qo_indptr_buf=np.zeros(3, np.int32),
        kv_indptr_buf=np.zeros(3, np.int32))  # fmt: skip
    qo = np.array([0, 5, 12], np.int32)
    pre.plan(qo, np.array([0, 9, 30], np.int32), 8, 2, 64, causal=True, q_data_type="bfloat16")
    graphs, seen = [], []

    def backend(gm, inputs):
        graphs.append(gm)
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(q_dec, cache, indptr, indices, last, q, k, v, prefill_plan):
        plan = dec.device_plan_array(indptr, indices, last, 10)
        o_dec, lse_dec = dec.run(q_dec, cache, return_lse=True, plan_array=plan)
        o_pre = pre.run(q, k, v, plan_array=prefill_plan)
        return plan, o_dec, lse_dec, o_pre

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    ints = lambda n: meta(n, dtype=torch.int32)  # noqa: E731
    args = (meta(3, 8, 64), meta(10, 2, 16, 2, 64), ints(4), ints(16), ints(3), meta(12, 8, 64),
            meta(30, 2, 64), meta(30, 2, 64), ints(pre.plan_array_size))  # fmt: skip
    plan, o_dec, lse_dec, o_pre = compiled(*args)
    assert plan.shape == (dec.plan_array_size,) and plan.dtype == torch.int32
    assert (o_dec.shape, o_dec.dtype, lse_dec.shape) == ((3, 8, 64), torch.float16, (3, 8))
    assert o_pre.shape == (12, 8, 64)
    assert [s for s in seen if s.startswith("rtcinfer.")] == [
        "rtcinfer.decode_device_plan", "rtcinfer.attention_run_plan_array",
        "rtcinfer.attention_run_plan_array"]  # fmt: skip
    dec.plan(*decode_tables([1, 33, 100]), 8, 2, 64, 16, q_data_type="bfloat16",
             o_data_type="float16")  # fmt: skip
    compiled(*args)
    assert len(graphs) == 1


def test_block_sparse_runs_compile_to_one_run_each(planned):
    """The block-sparse wrappers' run(): their views (and the variable form's GQA layout
    copies) around one attention_run node, no graph break, outputs in the caller's layout."""
    import rtcinfer

    bsr = rtcinfer.BlockSparseAttentionWrapper()
    bsr.plan(np.array([0, 1, 3]), np.array([1, 0, 1]), 8, 8, 4, 4, 8, 2, 64,
             q_data_type="bfloat16", o_data_type="bfloat16")  # fmt: skip
    variable = rtcinfer.VariableBlockSparseAttentionWrapper()
    variable.plan(np.ones((2, 2, 3), bool), np.array([[3, 5], [4, 4]]),
                  np.array([[2, 2, 4], [1, 6, 1]]), 8, 2, 64, q_data_type="bfloat16")  # fmt: skip
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(q, k, v, q_heads, k_heads, v_heads):
        o, lse = bsr.run(q, k, v, return_lse=True)
        return o, lse, variable.run(q_heads, k_heads, v_heads)

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    o, lse, o_heads = compiled(meta(8, 8, 64), meta(8, 2, 64), meta(8, 2, 64), meta(8, 8, 64),
                               meta(2, 8, 64), meta(2, 8, 64))  # fmt: skip
    assert o.shape == (8, 8, 64) and lse.shape == (8, 8) and o_heads.shape == (8, 8, 64)
    assert [s for s in seen if s.startswith("rtcinfer.")] == ["rtcinfer.attention_run"] * 2


def test_runs_with_fewer_value_dims_give_outputs_of_v_dims(planned):
    """head_dim_qk 192 over head_dim_vo 128: the ragged and paged (pair) runs and
    single_prefill trace to one node each with o of 128 dims."""
    import rtcinfer

    _, prefill = planned
    ragged = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    qo = np.array([0, 5, 12], np.int32)
    ragged.plan(qo, np.array([0, 9, 30], np.int32), 8, 2, 192, 128, causal=True,
                q_data_type="bfloat16")  # fmt: skip
    paged = prefill.BatchPrefillWithPagedKVCacheWrapper()
    paged.plan(qo, *decode_tables([9, 21]), 8, 2, 192, 16, head_dim_vo=128, causal=True,
               q_data_type="bfloat16")  # fmt: skip
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(q, k, v, k_cache, v_cache):
        o_ragged, lse = ragged.run(q, k, v, return_lse=True)
        o_paged = paged.run(q, (k_cache, v_cache))
        o_single = rtcinfer.single_prefill_with_kv_cache(q, k, v, causal=True)
        return o_ragged, lse, o_paged, o_single

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    o_ragged, lse, o_paged, o_single = compiled(
        meta(12, 8, 192), meta(30, 2, 192), meta(30, 2, 128), meta(3, 16, 2, 192),
        meta(3, 16, 2, 128),
    )  # fmt: skip
    assert o_ragged.shape == o_paged.shape == o_single.shape == (12, 8, 128)
    assert lse.shape == (12, 8)
    assert [s for s in seen if s.startswith("rtcinfer.")] == [
        "rtcinfer.attention_run", "rtcinfer.attention_run", "rtcinfer.single_prefill",
    ]  # fmt: skip


def test_the_mla_run_is_one_node(planned):
    """BatchMLAPagedAttentionWrapper.run under torch.compile(fullgraph=True): one mla_run node,
    o [nnz, H, 512] in the plan's output dtype; the LSE in base e is run()'s own scaling."""
    import rtcinfer

    wrapper = rtcinfer.BatchMLAPagedAttentionWrapper()
    wrapper.plan(np.array([0, 1, 2], np.int32), *decode_tables([40, 3])[:2],
                 np.array([40, 3], np.int32), 16, 512, 64, 16, False, 0.1, "bfloat16",
                 "bfloat16", output_dtype="float16")  # fmt: skip
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(q_nope, q_pe, ckv, kpe):
        o = wrapper.run(q_nope, q_pe, ckv, kpe)
        o2, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True, return_lse_base_on_e=True)
        return o, o2, lse

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    o, o2, lse = compiled(meta(2, 16, 512), meta(2, 16, 64), meta(4, 16, 512), meta(4, 16, 64))
    assert o.shape == o2.shape == (2, 16, 512) and o.dtype == torch.float16
    assert lse.shape == (2, 16) and lse.dtype == torch.float32
    assert [s for s in seen if s.startswith("rtcinfer.")] == ["rtcinfer.mla_run"] * 2


def test_the_pod_wrappers_compile_to_their_two_sides(planned):
    """POD under torch.compile(fullgraph=True): the prefill side's node and the decode side's
    (one after the other: XLA-like tracing owns the streams), shaped as run() returns them."""
    import rtcinfer

    pod = rtcinfer.PODWithPagedKVCacheWrapper()
    pod.plan(*decode_tables([40, 3]), 8, 2, 64, 16, q_data_type="bfloat16")
    batch = rtcinfer.BatchPODWithPagedKVCacheWrapper()
    qo_p = np.array([0, 5, 12], np.int32)
    batch.plan(qo_p, *decode_tables([9, 21]), np.array([0, 1, 2], np.int32),
               *decode_tables([40, 3]), 8, 2, 64, 16, q_data_type="bfloat16")  # fmt: skip
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(q_p, k_p, v_p, q_d, cache, q_bp):
        out_p, out_d = pod.run(q_p, k_p, v_p, q_d, cache, causal_p=True)
        (bp, lse_p), (bd, lse_d) = batch.run(q_bp, cache, q_d, cache, return_lse=True)
        return out_p, out_d, bp, bd, lse_p, lse_d

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    out_p, out_d, bp, bd, lse_p, lse_d = compiled(
        meta(5, 8, 64), meta(9, 2, 64), meta(9, 2, 64), meta(2, 8, 64), meta(10, 2, 16, 2, 64),
        meta(12, 8, 64),
    )  # fmt: skip
    assert out_p.shape == (5, 8, 64) and out_d.shape == bd.shape == (2, 8, 64)
    assert bp.shape == (12, 8, 64) and lse_p.shape == (12, 8) and lse_d.shape == (2, 8)
    assert [s for s in seen if s.startswith("rtcinfer.")] == [
        "rtcinfer.single_prefill", "rtcinfer.attention_run", "rtcinfer.attention_run",
        "rtcinfer.attention_run",
    ]  # fmt: skip
