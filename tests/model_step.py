"""One serving step of a catalog model through rtcinfer's public API, as an engine runs it.

A decode step: the layer's norms (and Qwen3's q/k norm), RoPE in every position form FlashInfer
offers, the MLP activation, the KV append with its device index ops, batch decode (plain
wrapper on short requests, on long ones in pages of 64, the CUDA-graph wrapper (also over a
plan built on the device) and the tensor-core wrappers, the latter also over a batch that
fills the GPU), then softmax, every sampler and renorm at batch sizes that take every block
and cluster size. A prefill step: paged and ragged causal prefill in each query tile, their
merges, and a batch whose tiles fill the GPU (its work items expanded on the device).

`run(model, dtype, kv_dtype, arrays)` makes its arrays with `arrays` (zeros of a shape and
dtype, and device copies of host ints), so that one step serves two tests
(tests/test_warmup.py): on fake devices (torch "meta" tensors; each op's kernel is recorded,
not launched) it must ask for exactly the kernels `rtcinfer warmup` compiles, and on the GPU,
run as `python -m tests.model_step MODEL [DTYPE [KV_DTYPE]]` with RTCINFER_NO_COMPILE=1 after a
warmup, it must find all of them in the cache.
"""

from __future__ import annotations

import sys

import numpy as np

import rtcinfer
from rtcinfer import catalog
from rtcinfer.attention.prefill_kernel import TILE_ROWS

from .paged_batch import page_table_for

# With 132 SMs (an H100 or H200): clusters of 8, 4 and 2 CTAs per row (sm_90; softmax's 2 at
# 40), then one CTA per row of 1024, 512 and 256 threads.
SAMPLING_BATCHES = (1, 20, 40, 100, 200, 600)
PAGE = 16
DECODE_LENGTHS = [1, 15, 16, 17, 300, 1000]  # after the append of one token each
FULL_DECODE_LENGTHS = [64] * 40  # use_tensor_cores: enough requests to give every SM a CTA
LONG_PAGE, LONG_LENGTHS = 128, [8192] * 4  # long rows in large pages: one tile in flight ahead


class CupyArrays:
    """The GPU's arrays: CuPy zeros (fp8 as its uint8 bytes) and device copies of host ints."""

    def __init__(self):
        import cupy

        from rtcinfer.interop.dtypes import numpy_dtype

        self.cupy, self.numpy_dtype = cupy, numpy_dtype

    def zeros(self, shape, dtype: str):
        storage = "uint8" if dtype.startswith("float8") else dtype
        return self.cupy.zeros(shape, dtype=self.numpy_dtype(storage))

    def ints(self, values, dtype: str = "int32"):
        return self.cupy.asarray(np.asarray(values, dtype=dtype))


def _layer(m, dtype: str, arrays, tokens: int = 6) -> None:
    """Norms, RoPE in every position form, the activation, on a few tokens (MLA: the norms of
    its two low ranks too, RoPE on the rope_dim parts of q's heads and of the one shared k)."""
    zeros, ints = arrays.zeros, arrays.ints
    hq, hkv, d = m.num_qo_heads, m.num_kv_heads, m.head_dim
    x, residual = zeros((tokens, m.hidden), dtype), zeros((tokens, m.hidden), dtype)
    w = zeros((m.hidden,), dtype)
    rtcinfer.rmsnorm(x, w)
    rtcinfer.fused_add_rmsnorm(x, residual, w)
    if m.kv_lora_rank:
        for rank in (m.q_lora_rank, m.kv_lora_rank):
            rtcinfer.rmsnorm(zeros((tokens, rank), dtype), zeros((rank,), dtype))
        hkv, d = 1, m.rope_dim
    q, k = zeros((tokens, hq, d), dtype), zeros((tokens, hkv, d), dtype)
    if m.qk_norm:
        rtcinfer.rmsnorm(q, zeros((d,), dtype))
        rtcinfer.rmsnorm(k, zeros((d,), dtype))
    for pos_dtype in ("int32", "int64"):
        pos = ints(np.arange(tokens), pos_dtype)
        indptr, offsets = ints([0, 2, tokens], pos_dtype), ints([5, 0], pos_dtype)
        for rope in (rtcinfer.apply_rope_pos_ids, rtcinfer.apply_rope_pos_ids_inplace,
                     rtcinfer.apply_llama31_rope_pos_ids,
                     rtcinfer.apply_llama31_rope_pos_ids_inplace):  # fmt: skip
            rope(q, k, pos)
        for rope in (rtcinfer.apply_rope, rtcinfer.apply_rope_inplace,
                     rtcinfer.apply_llama31_rope, rtcinfer.apply_llama31_rope_inplace):  # fmt: skip
            rope(q, k, indptr, offsets)
        query, key = zeros((tokens, hq * d), dtype), zeros((tokens, hkv * d), dtype)
        cos_sin_cache = zeros((4096, d), "float32")
        rtcinfer.apply_rope_with_cos_sin_cache(pos, query, key, d, cos_sin_cache)
        rtcinfer.apply_rope_with_cos_sin_cache_inplace(pos, query, key, d, cos_sin_cache)
    rtcinfer.silu_and_mul(zeros((tokens, 2 * m.intermediate), dtype))


def _paged(m, kv_dtype: str, arrays, lengths, page_size: int):
    """(cache, host table (indptr, indices, last)) for requests of these lengths."""
    indptr, indices, last, pages = page_table_for(lengths, page_size, np.random.default_rng(0))
    cache = arrays.zeros((pages, 2, page_size, m.num_kv_heads, m.head_dim), kv_dtype)
    return cache, (indptr, indices, last)


def _append(m, kv_dtype: str, arrays, cache, table, page_size: int) -> None:
    """One new token per request, written by the device index ops' positions (int32), into the
    cache as one array and as a (k, v) pair, through a page table of int32 and of int64; and
    with int64 positions of the engine's own."""
    batch = len(table[2])
    rows = [arrays.zeros((batch, m.num_kv_heads, m.head_dim), kv_dtype) for _ in range(2)]
    for index in ("int32", "int64"):
        indptr, indices, last = (arrays.ints(x, index) for x in table)
        seq_lens = rtcinfer.get_seq_lens(indptr, last, page_size)
        bi, pos = rtcinfer.get_batch_indices_positions(arrays.ints(np.arange(batch + 1), index),
                                                       seq_lens, batch)  # fmt: skip
        for rows_index in ("int32", "int64"):
            if rows_index == "int64":
                bi, pos = (arrays.ints(np.zeros(batch), "int64") for _ in range(2))
            rtcinfer.append_paged_kv_cache(*rows, bi, pos, cache, indices, indptr, last)
            rtcinfer.append_paged_kv_cache(*rows, bi, pos, (cache[:, 0], cache[:, 1]), indices,
                                           indptr, last)  # fmt: skip


def _decode(m, dtype: str, kv_dtype: str, arrays) -> None:
    hq, hkv, d = m.num_qo_heads, m.num_kv_heads, m.head_dim
    heads = (hq, hkv, d)
    kinds = dict(q_data_type=dtype, kv_data_type=kv_dtype)
    cache, table = _paged(m, kv_dtype, arrays, DECODE_LENGTHS, PAGE)
    _append(m, kv_dtype, arrays, cache, table, PAGE)
    q = arrays.zeros((len(DECODE_LENGTHS), hq, d), dtype)
    batch = len(DECODE_LENGTHS)
    graph = dict(use_cuda_graph=True, paged_kv_indptr_buffer=arrays.ints(np.zeros(batch + 1)),
                 paged_kv_indices_buffer=arrays.ints(np.zeros(len(table[1]))),
                 paged_kv_last_page_len_buffer=arrays.ints(np.zeros(batch)))  # fmt: skip
    for options, plans in (({}, ({}, dict(disable_split_kv=True))), (graph, ({},)),
                           (dict(use_tensor_cores=True), ({},))):  # fmt: skip
        wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(**options)
        for plan in plans:  # split or not; a plan of whole requests picks half tiles for fp8
            wrapper.plan(*table, *heads, PAGE, **plan, **kinds)
            wrapper.run(q, cache)
        if options is graph:  # the plan built on the device, and the run that reads it
            device_table = [arrays.ints(x) for x in table]
            plan_array = wrapper.device_plan_array(*device_table, cache.shape[0])
            wrapper.run(q, cache, plan_array=plan_array)
    # use_tensor_cores over a batch that fills the GPU: 64-key tiles (the small one above: 128)
    full_cache, full_table = _paged(m, kv_dtype, arrays, FULL_DECODE_LENGTHS, PAGE)
    wrapper.plan(*full_table, *heads, PAGE, **kinds)
    wrapper.run(arrays.zeros((len(FULL_DECODE_LENGTHS), hq, d), dtype), full_cache)
    long_cache, long_table = _paged(m, kv_dtype, arrays, LONG_LENGTHS, LONG_PAGE)
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    wrapper.plan(*long_table, *heads, LONG_PAGE, disable_split_kv=True, **kinds)
    wrapper.run(arrays.zeros((len(LONG_LENGTHS), hq, d), dtype), long_cache)


def _prefill(m, dtype: str, kv_dtype: str, arrays) -> None:
    """Two prompts per query tile (packed rows per request: the tile's rows), after a prefix of
    40 tokens: paged and ragged causal prefill, and the merges of their states."""
    hq, hkv, d = m.num_qo_heads, m.num_kv_heads, m.head_dim
    group = hq // hkv
    for rows in (r for r in TILE_ROWS if r < 128 or d < 256):
        qo_len = max(1, rows // group)
        qo_indptr = np.arange(3, dtype=np.int32) * qo_len
        kv_lengths = [40 + qo_len] * 2
        cache, table = _paged(m, kv_dtype, arrays, kv_lengths, PAGE)
        q = arrays.zeros((2 * qo_len, hq, d), dtype)
        paged = rtcinfer.BatchPrefillWithPagedKVCacheWrapper()
        paged.plan(qo_indptr, *table, hq, hkv, d, PAGE, causal=True, q_data_type=dtype,
                   kv_data_type=kv_dtype)  # fmt: skip
        o_paged, lse_paged = paged.run(q, cache, return_lse=True)
        ragged = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
        kv_indptr = np.arange(3, dtype=np.int32) * qo_len
        ragged.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True, q_data_type=dtype)
        k, v = (arrays.zeros((2 * qo_len, hkv, d), dtype) for _ in range(2))
        o, lse = ragged.run(q, k, v, return_lse=True)
        rtcinfer.merge_state(o, lse, o_paged, lse_paged)
        rtcinfer.merge_state_in_place(o, lse, o_paged, lse_paged)
        rtcinfer.merge_state_in_place(o, lse, o_paged, lse_paged,
                                      mask=arrays.zeros((2 * qo_len,), "bool"))  # fmt: skip
    n = 3
    rtcinfer.merge_states(arrays.zeros((n, 2, hq, d), dtype), arrays.zeros((n, 2, hq), "float32"))
    # 64 prompts of a 64-row tile each fill the GPU: one item a tile, expanded on the device
    qo_indptr = np.arange(65, dtype=np.int32) * max(1, 64 // group)
    ragged = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    ragged.plan(qo_indptr, qo_indptr, hq, hkv, d, causal=True, q_data_type=dtype)
    q, k, v = (arrays.zeros((int(qo_indptr[-1]), h, d), dtype) for h in (hq, hkv, hkv))
    ragged.run(q, k, v)


def _mla(m, dtype: str, arrays) -> None:
    """MLA's attention: one token a request appended to the latent cache (as _append), then
    over the cache decode (a query a request) and a causal chunk of 4 queries a request, with
    all the heads (32-row tiles) and with a tensor-parallel shard of 16 (16-row tiles); the
    prefill of head_dim + rope_dim q and k over head_dim v (ragged, causal) in each query tile,
    its merges, and a batch whose tiles fill the GPU."""
    zeros, ints = arrays.zeros, arrays.ints
    ckv_dim, kpe_dim, batch = m.kv_lora_rank, m.rope_dim, len(DECODE_LENGTHS)
    table = page_table_for(DECODE_LENGTHS, PAGE, np.random.default_rng(0))
    ckv, kpe = zeros((table[3], PAGE, ckv_dim), dtype), zeros((table[3], PAGE, kpe_dim), dtype)
    rows = zeros((batch, ckv_dim), dtype), zeros((batch, kpe_dim), dtype)
    for index in ("int32", "int64"):
        indptr, indices, last = (ints(x, index) for x in table[:3])
        seq_lens = rtcinfer.get_seq_lens(indptr, last, PAGE)
        bi, pos = rtcinfer.get_batch_indices_positions(ints(np.arange(batch + 1), index),
                                                       seq_lens, batch)  # fmt: skip
        for rows_index in ("int32", "int64"):
            if rows_index == "int64":
                bi, pos = (ints(np.zeros(batch), "int64") for _ in range(2))
            rtcinfer.append_paged_mla_kv_cache(*rows, bi, pos, ckv, kpe, indices, indptr, last)
    kv_len = np.asarray(DECODE_LENGTHS, np.int32)
    for heads in (m.num_qo_heads, 16):
        for q_len, causal in ((1, False), (4, True)):
            qo_indptr = np.arange(batch + 1, dtype=np.int32) * q_len
            wrapper = rtcinfer.BatchMLAPagedAttentionWrapper()
            wrapper.plan(qo_indptr, table[0], table[1], np.maximum(kv_len, q_len), heads,
                         ckv_dim, kpe_dim, PAGE, causal, 0.1, dtype, dtype)  # fmt: skip
            n = batch * q_len
            wrapper.run(zeros((n, heads, ckv_dim), dtype), zeros((n, heads, kpe_dim), dtype),
                        ckv, kpe)  # fmt: skip
    hq, qk, v = m.num_qo_heads, m.head_dim + m.rope_dim, m.head_dim
    for tile_rows in TILE_ROWS:  # one head a kv head: a query a packed row
        qo_indptr = np.arange(3, dtype=np.int32) * tile_rows
        ragged = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
        ragged.plan(qo_indptr, qo_indptr, hq, hq, qk, head_dim_vo=v, causal=True,
                    q_data_type=dtype)  # fmt: skip
        q, k = (zeros((2 * tile_rows, hq, qk), dtype) for _ in range(2))
        o, lse = ragged.run(q, k, zeros((2 * tile_rows, hq, v), dtype), return_lse=True)
        rtcinfer.merge_state(o, lse, o, lse)
        rtcinfer.merge_state_in_place(o, lse, o, lse)
        rtcinfer.merge_state_in_place(o, lse, o, lse, mask=zeros((2 * tile_rows,), "bool"))
    rtcinfer.merge_states(zeros((3, 2, hq, v), dtype), zeros((3, 2, hq), "float32"))
    qo_indptr = np.arange(65, dtype=np.int32) * 64  # 64-row tiles that fill the GPU
    ragged = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    ragged.plan(qo_indptr, qo_indptr, hq, hq, qk, head_dim_vo=v, causal=True, q_data_type=dtype)
    n = int(qo_indptr[-1])
    ragged.run(zeros((n, hq, qk), dtype), zeros((n, hq, qk), dtype), zeros((n, hq, v), dtype))


def _sample(m, dtype: str, arrays, batches) -> None:
    """Softmax, every sampler and renorm, on logits of float32 and of the model's dtype."""
    for batch in batches:
        for logits_dtype in dict.fromkeys(("float32", dtype)):
            logits = arrays.zeros((batch, m.vocab), logits_dtype)
            rtcinfer.top_k_mask_logits(logits, 50)
            rtcinfer.sampling_from_logits(logits, seed=1)
            rtcinfer.top_k_top_p_sampling_from_logits(logits, 50, 0.9, seed=1)
            probs = rtcinfer.softmax(logits)
        rtcinfer.sampling_from_probs(probs, seed=1)
        rtcinfer.top_k_sampling_from_probs(probs, 50, seed=1)
        rtcinfer.top_p_sampling_from_probs(probs, 0.9, seed=1)
        rtcinfer.min_p_sampling_from_probs(probs, 0.1, seed=1)
        rtcinfer.top_k_top_p_sampling_from_probs(probs, 50, 0.9, seed=1)
        rtcinfer.top_k_top_p_sampling_from_probs(probs, 50, 0.9, filter_apply_order="joint",
                                                 seed=1)  # fmt: skip
        rtcinfer.top_k_renorm_probs(probs, 50)
        rtcinfer.top_p_renorm_probs(probs, 0.9)


def run(name: str, dtype: str, kv_dtype: str | None, arrays,
        sampling_batches=SAMPLING_BATCHES) -> None:  # fmt: skip
    """The decode and prefill steps of catalog model `name` (module docstring)."""
    m = catalog.MODELS[name]
    kv_dtype = kv_dtype or dtype
    _layer(m, dtype, arrays)
    if m.kv_lora_rank:
        _mla(m, dtype, arrays)
    else:
        _decode(m, dtype, kv_dtype, arrays)
        _prefill(m, dtype, kv_dtype, arrays)
    _sample(m, dtype, arrays, sampling_batches)


if __name__ == "__main__":
    import cupy

    model, dtype, kv_dtype = sys.argv[1], "bfloat16", None
    if len(sys.argv) > 2:
        dtype = sys.argv[2]
    if len(sys.argv) > 3:
        kv_dtype = sys.argv[3]
    run(model, dtype, kv_dtype, CupyArrays())
    cupy.cuda.Device().synchronize()
    rtcinfer.check_errors()
    print(f"step ok: {model} ({dtype}, KV {kv_dtype or dtype})")
