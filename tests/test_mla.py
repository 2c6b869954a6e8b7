"""BatchMLAPagedAttentionWrapper on the GPU against float64 MLA (absorbed form):
o = softmax((q_nope . ckv + q_pe . kpe) sm_scale) @ ckv over each request's pages: decode and
prefill batches (causal and not), 16 and 128 heads, page sizes 1, 16 and 64 with permuted
pages, 64- and 32-key K tiles (sm_80's shared memory), split plans, given outputs, LSE in base
2 and e, CUDA-graph replay after re-plans, and PyTorch (eager and torch.compile) / JAX (eager
and jax.jit) / CuPy arrays."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer

from . import reference_attention as aref
from .checks import assert_close, to_host
from .gpu_decode import random_values, to_gpu

pytestmark = pytest.mark.gpu
SCALE = 0.1


class Batch:
    """A random MLA batch: queries, a paged latent cache with permuted pages, its table."""

    def __init__(self, rng, qo, kv, heads, page, dtype="bfloat16"):
        self.qo, self.kv, self.heads, self.page = np.array(qo), np.array(kv), heads, page
        pages = np.maximum(-(-self.kv // page), 1)
        self.indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        num_pages = int(self.indptr[-1]) + 3
        self.indices = rng.permutation(num_pages)[: self.indptr[-1]].astype(np.int32)
        self.qo_indptr = np.concatenate([[0], np.cumsum(self.qo)]).astype(np.int32)
        n = int(self.qo_indptr[-1])
        self.q_nope = random_values(rng, (n, heads, 512), dtype)
        self.q_pe = random_values(rng, (n, heads, 64), dtype)
        self.ckv = random_values(rng, (num_pages, page, 512), dtype)
        self.kpe = random_values(rng, (num_pages, page, 64), dtype)

    def plan(self, wrapper, causal, dtype="bfloat16"):
        wrapper.plan(self.qo_indptr, self.indptr, self.indices, self.kv.astype(np.int32),
                     self.heads, 512, 64, self.page, causal, SCALE, dtype, dtype)  # fmt: skip

    def reference(self, causal):
        outs = []
        for b in range(len(self.qo)):
            qs = slice(self.qo_indptr[b], self.qo_indptr[b + 1])
            t = np.arange(self.kv[b])
            ids = self.indices[self.indptr[b] + t // self.page]
            ckv, kpe = self.ckv[ids, t % self.page], self.kpe[ids, t % self.page]
            q = np.concatenate([self.q_nope[qs], self.q_pe[qs]], -1)
            k = np.concatenate([ckv, kpe], -1)[:, None]
            outs.append(aref.attention_ref(q, k, ckv[:, None], sm_scale=SCALE, causal=causal))
        return np.concatenate([o for o, _ in outs]), np.concatenate([s for _, s in outs])

    def device(self):
        return [to_gpu(x) for x in (self.q_nope, self.q_pe, self.ckv, self.kpe)]


def check(o, lse, o_ref, lse_ref, dtype="bfloat16"):
    o, lse = to_host(o), to_host(lse)
    assert not np.isnan(o).any()
    assert_close(o, o_ref, dtype, "o", per_vector=True)
    assert_close(lse, lse_ref, "float32", "lse", tol=2e-3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, qo, kv, page", [
    (16, [1] * 7, [1, 17, 300, 4096, 0, 65, 1000], 1),   # decode, a query a tile
    (128, [1] * 3, [33, 2000, 7], 64),                   # decode, 8 tiles a query
    (16, [40, 1, 130, 0], [40, 300, 200, 9], 16),         # prefill and append
    (128, [5, 20], [5, 600], 16),
])  # fmt: skip
@pytest.mark.parametrize("smem_kb", [None, 163])
def test_mla_batches(monkeypatch, smem_kb, causal, heads, qo, kv, page):
    """smem_kb 163: the device's shared memory taken as sm_80's (32-key K tiles)."""
    from rtcinfer.attention import prefill_wrapper

    if smem_kb is not None:
        limits = prefill_wrapper.device_limits
        monkeypatch.setattr(prefill_wrapper, "device_limits",
                            lambda device: (limits(device)[0], smem_kb * 1024))  # fmt: skip
    rng = np.random.default_rng(heads + page + causal + len(qo))
    batch = Batch(rng, qo, kv, heads, page)
    wrapper = rtcinfer.BatchMLAPagedAttentionWrapper()
    batch.plan(wrapper, causal)
    assert wrapper._launch.launch.kernel.spec.kv_tile == (32 if smem_kb else 64)
    o, lse = wrapper.run(*batch.device(), return_lse=True)
    assert o.shape == (int(batch.qo_indptr[-1]), heads, 512)
    check(o, lse, *batch.reference(causal))


def test_given_outputs_lse_base_e_and_float16():
    import cupy

    rng = np.random.default_rng(5)
    batch = Batch(rng, [1, 3], [900, 50], 16, 16, "float16")
    wrapper = rtcinfer.BatchMLAPagedAttentionWrapper()
    batch.plan(wrapper, True, "float16")
    out = cupy.full((4, 16, 512), np.nan, np.float16)
    lse = cupy.empty((4, 16), np.float32)
    got = wrapper.run(*batch.device(), out=out, lse=lse, return_lse=True,
                      return_lse_base_on_e=True)  # fmt: skip
    assert got[0] is out and got[1] is lse
    o_ref, lse_ref = batch.reference(True)
    check(out, lse, o_ref, lse_ref * np.log(2), "float16")


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_framework_arrays(framework):
    rng = np.random.default_rng(6)
    batch = Batch(rng, [1, 1, 9], [77, 3000, 9], 16, 16)
    wrapper = rtcinfer.BatchMLAPagedAttentionWrapper()
    batch.plan(wrapper, True)
    expect = batch.reference(True)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        arrays = [torch.from_dlpack(x) for x in batch.device()]
        o, lse = wrapper.run(*arrays, return_lse=True)
        assert isinstance(o, torch.Tensor)
        check(o, lse, *expect)
        step = torch.compile(lambda *a: wrapper.run(*a, return_lse=True), fullgraph=True)
        check(*step(*arrays), *expect)
        return
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    arrays = [jax.numpy.asarray(x) for x in (batch.q_nope, batch.q_pe, batch.ckv, batch.kpe)]
    check(*wrapper.run(*arrays, return_lse=True), *expect)
    step = jax.jit(lambda *a: wrapper.run(*a, return_lse=True))
    check(*step(*arrays), *expect)


def test_cuda_graph_replays_after_replan():
    """use_cuda_graph=True: a graph captured around run() after the first plan replays each
    later plan of the same batch size (new lengths, pages)."""
    import cupy

    rng = np.random.default_rng(8)
    heads, page, size = 16, 16, 4
    first = Batch(rng, [1] * size, [100, 7, 2000, 64], heads, page)
    num_pages = first.ckv.shape[0] + 200
    ckv = random_values(rng, (num_pages, page, 512), "bfloat16")
    kpe = random_values(rng, (num_pages, page, 64), "bfloat16")
    wrapper = rtcinfer.BatchMLAPagedAttentionWrapper(
        None, True, cupy.empty(size + 1, np.int32), cupy.empty(size + 1, np.int32),
        cupy.empty(num_pages, np.int32), cupy.empty(size, np.int32),
    )  # fmt: skip
    q_nope, q_pe = to_gpu(first.q_nope), to_gpu(first.q_pe)
    ckv_dev, kpe_dev = to_gpu(ckv), to_gpu(kpe)
    out = cupy.empty((size, heads, 512), q_nope.dtype)
    lse = cupy.empty((size, heads), np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for i, lens in enumerate(([100, 7, 2000, 64], [3000, 1, 16, 900], [5, 5, 5, 5])):
            batch = Batch(rng, [1] * size, lens, heads, page)
            batch.ckv, batch.kpe = ckv, kpe  # one pool, new pages
            batch.indices = rng.permutation(num_pages)[: batch.indptr[-1]].astype(np.int32)
            batch.q_nope, batch.q_pe = first.q_nope, first.q_pe
            batch.plan(wrapper, False)
            if i == 0:
                wrapper.run(q_nope, q_pe, ckv_dev, kpe_dev, out=out, lse=lse)
                stream.synchronize()
                stream.begin_capture()
                wrapper.run(q_nope, q_pe, ckv_dev, kpe_dev, out=out, lse=lse)
                graph = stream.end_capture()
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            check(out, lse, *batch.reference(False))


@pytest.mark.parametrize("framework", ["cupy", "torch", "jax"])
def test_append_then_attend(framework):
    """append_paged_mla_kv_cache writes new tokens' ckv and kpe rows where the table puts them
    (the caller's caches in place; for JAX the returned copies), and MLA over the appended
    cache matches float64 over the same rows."""
    rng = np.random.default_rng(12)
    batch = Batch(rng, [1, 1, 1], [30, 17, 64], 16, 16)
    new = [3, 1, 0]  # the last tokens of each request are the appended ones
    rows = np.concatenate([np.arange(k - n, k) for k, n in zip(batch.kv, new, strict=True)])
    b_idx = np.repeat(np.arange(3), new).astype(np.int32)
    ckv_new = random_values(rng, (len(rows), 512), "bfloat16")
    kpe_new = random_values(rng, (len(rows), 64), "bfloat16")
    table = (batch.indices, batch.indptr,
             (batch.kv - (-(-batch.kv // 16) - 1) * 16).astype(np.int32))  # fmt: skip
    host = (ckv_new, kpe_new, b_idx, rows.astype(np.int32), batch.ckv, batch.kpe, *table)
    arrays = [to_gpu(x) for x in host]
    if framework == "torch":
        torch = pytest.importorskip("torch")
        arrays = [torch.from_dlpack(x) for x in arrays]
    elif framework == "jax":
        jax = pytest.importorskip("jax")
        if jax.default_backend() != "gpu":
            pytest.skip("JAX has no GPU backend here")
        arrays = [jax.numpy.asarray(x) for x in host]
    ckv_cache, kpe_cache = rtcinfer.append_paged_mla_kv_cache(*arrays)
    for t, (b, p) in enumerate(zip(b_idx, rows, strict=True)):
        page = batch.indices[batch.indptr[b] + p // 16]
        batch.ckv[page, p % 16], batch.kpe[page, p % 16] = ckv_new[t], kpe_new[t]
    np.testing.assert_array_equal(to_host(ckv_cache), batch.ckv.astype(np.float64))
    np.testing.assert_array_equal(to_host(kpe_cache), batch.kpe.astype(np.float64))
    wrapper = rtcinfer.BatchMLAPagedAttentionWrapper()
    batch.plan(wrapper, True)
    q_nope, q_pe = to_gpu(batch.q_nope), to_gpu(batch.q_pe)
    if framework == "torch":
        q_nope, q_pe = torch.from_dlpack(q_nope), torch.from_dlpack(q_pe)
    elif framework == "jax":
        q_nope, q_pe = jax.numpy.asarray(batch.q_nope), jax.numpy.asarray(batch.q_pe)
    check(*wrapper.run(q_nope, q_pe, ckv_cache, kpe_cache, return_lse=True),
          *batch.reference(True))  # fmt: skip
