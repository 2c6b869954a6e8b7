"""Batch decode with use_tensor_cores=True (the prefill kernel, its query rows the heads of a
GQA group) against the float64 references (GPU): the cases and features of test_decode.py over
16-bit and fp8 KV, and several queries a request (speculative verification); forced tile
choices: test_decode_tensor_core_tiles.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import rtcinfer

from . import reference_attention as aref
from .gpu_decode import (
    check_attention,
    make_batch,
    random_values,
    run_batch,
    standard_lengths,
    to_gpu,
)
from .test_decode import BASE, CASES, FEATURES, seeded

pytestmark = pytest.mark.gpu


def with_decode_tiles(monkeypatch, **fields) -> None:
    """plan()'s 8- and 16-row prefill kernels (the tensor-core decode's) with `fields` replaced."""
    from rtcinfer.attention import prefill_launch
    from rtcinfer.attention.prefill_kernel import prefill_spec

    def spec(*args, **kw):
        chosen = prefill_spec(*args, **kw)
        return replace(chosen, **fields) if chosen.tile_rows <= 16 else chosen

    monkeypatch.setattr(prefill_launch, "prefill_spec", spec)


def tensor_core_decode_checked(seed: tuple):
    """Decode with use_tensor_cores=True of the case `seed` = (tag, feature, case, kv_dtype)
    against the reference; returns the prefill kernel's spec it ran."""
    _, feature, case, kv_dtype = seed
    rng = seeded(*seed)
    kwargs = {**BASE, **CASES[case], "kv_dtype": kv_dtype}
    batch = make_batch(rng, standard_lengths(kwargs["page_size"], rng), **kwargs)
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(kv_layout=batch.layout,
                                                          use_tensor_cores=True)  # fmt: skip
    o, lse = run_batch(batch, wrapper, k_scale=0.8, v_scale=1.25, **FEATURES.get(feature, {}))
    o_ref, lse_ref = batch.reference(k_scale=0.8, v_scale=1.25, **FEATURES.get(feature, {}))
    check_attention(o, lse, o_ref, lse_ref, batch.q_dtype, tensor_cores=True)
    return wrapper._tc._launch.launch.kernel.spec


@pytest.mark.parametrize("feature", ["plain", "rope", "alibi_cap_window", "window0"])
@pytest.mark.parametrize("case", ["group1", "group4", "group5_fp16", "group32", "d64", "d256",
                                  "page1", "hnd_tuple_fp16", "hnd_strided_tuple"])  # fmt: skip
@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_tensor_core_decode_through_the_prefill_kernel(feature, case, kv_dtype):
    """use_tensor_cores=True (the prefill kernel, one query per request) gives the reference's
    results, as the decode kernel does: 8-row tiles (keys on the MMAs' M side) up to 8 heads a
    group, 16-row ones up to 16, 64 beyond; fp8 read from the ring by 8- and 16-row tiles
    without RoPE."""
    spec = tensor_core_decode_checked(("tc", feature, case, kv_dtype))
    group = {**BASE, **CASES[case]}["group_size"]
    assert spec.tile_rows == (8 if group <= 8 else 16 if group <= 16 else 64)
    assert spec.fp8_direct == (kv_dtype is not None and spec.tile_rows <= 16
                               and feature != "rope")  # fmt: skip


@pytest.mark.parametrize("q_len, group_size, kv_dtype", [(2, 4, None), (4, 8, None),
                                                         (3, 5, "float8_e4m3fn")])  # fmt: skip
def test_several_queries_a_request_verify_causally(q_len, group_size, kv_dtype):
    """plan(q_len_per_req=n) with use_tensor_cores=True: request b's n queries (rows b * n to
    b * n + n - 1) are its last n positions, each seeing the keys up to its own (FlashInfer's
    speculative verification); the attention reference per request, causal."""
    rng = seeded("several queries", q_len, group_size)
    lengths = [q_len, 17, 513, q_len + 1, 40]
    batch = make_batch(rng, lengths, group_size=group_size, kv_dtype=kv_dtype)
    q = random_values(rng, (len(lengths) * q_len, batch.num_qo_heads, batch.head_dim),
                      batch.q_dtype)  # fmt: skip
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)
    batch.plan(wrapper, q_len_per_req=q_len)
    o, lse = wrapper.run(to_gpu(q), batch.cache_dev, return_lse=True, q_len_per_req=q_len)
    k_cache, v_cache = aref.split_paged_kv_cache(batch.cache, batch.layout)
    o_ref, lse_ref = [], []
    for b, n in enumerate(lengths):
        pages = batch.indices[batch.indptr[b] : batch.indptr[b + 1]]
        k = aref.gather_pages_ref(k_cache, pages, batch.layout, n)
        v = aref.gather_pages_ref(v_cache, pages, batch.layout, n)
        rows = q[b * q_len : (b + 1) * q_len]
        o_b, lse_b = aref.attention_ref(rows, k, v, causal=True,
                                        sm_scale=1 / np.sqrt(batch.head_dim))  # fmt: skip
        o_ref.append(o_b)
        lse_ref.append(lse_b)
    check_attention(o, lse, np.concatenate(o_ref), np.concatenate(lse_ref), batch.q_dtype,
                    tensor_cores=True)  # fmt: skip
