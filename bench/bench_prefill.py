"""Batch prefill on the GPU over a ragged and a paged KV cache (page 16, permuted pages), three
views (eager, loop, graph; bench/common.py), effective TFLOP/s from the graph view (visible
(query, key) pairs only), % of a bf16 GEMM measured in the same run, the three views of
FlashInfer's fa2 wrapper of the same form and fa3's graph view at head_dim 128, measured in the
same run; then plan() host time for batches of 64 and 256 mixed requests (against fa2).
`python -m bench.bench_prefill ragged` (or paged) times one form only. rtcinfer is called with
PyTorch tensors when PyTorch is installed (as FlashInfer is); "CuPy graph us" is the same call
on CuPy arrays captured with CuPy's stream capture; "mma.sync graph us" the same call on the
mma.sync kernel (RTCINFER_PREFILL_WGMMA=0) where plan() chose the warpgroup-MMA one (sm_90a)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time

import numpy as np

import rtcinfer
from bench.bench_decode import random_cache
from bench.common import (
    PEER_COLUMNS,
    VIEW_COLUMNS,
    Table,
    Tables,
    callers,
    cupy,
    graph_time_us,
    header,
    peer,
    peer_cells,
    peer_views,
    ratio,
    time_us,
    views,
)
from rtcinfer.interop.dtypes import numpy_dtype

PAGE = 16
# 64 prompts of 16 to 240 tokens (mean ~128), the same every run
MIXED = tuple(int(n) for n in np.random.default_rng(1).integers(16, 241, 64))
# label, qo_len of each request, keys cached before its queries, Hq, Hkv, head_dim (or q's and
# v's: (192, 128), DeepSeek's prefill, with its 16 heads a GPU at 8-way tensor parallelism;
# paged as a (k_cache, v_cache) pair), causal
ROWS = [
    ("1 x 4096", (4096,), 0, 32, 8, 128, True),
    ("1 x 16384", (16384,), 0, 32, 8, 128, True),
    ("1 x 16384, non-causal", (16384,), 0, 32, 8, 128, False),
    ("4 x 4096", (4096,) * 4, 0, 32, 8, 128, True),
    ("4 x 4096, non-causal", (4096,) * 4, 0, 32, 8, 128, False),
    ("16 x 1024", (1024,) * 16, 0, 32, 8, 128, True),
    ("32 x 512", (512,) * 32, 0, 32, 8, 128, True),
    (f"64 x 16-240 (mixed, {sum(MIXED)} tokens)", MIXED, 0, 32, 8, 128, True),
    ("8192 + 63 x 128 (skewed)", (8192,) + (128,) * 63, 0, 32, 8, 128, True),
    ("append 16 x 256 to 4096", (256,) * 16, 4096, 32, 8, 128, True),
    ("verify 64 x 4 over 2048 (16-row tiles)", (4,) * 64, 2048, 32, 8, 128, True),
    ("16 x 1024, non-causal", (1024,) * 16, 0, 32, 8, 128, False),
    ("16 x 1024, MHA (Hkv 32)", (1024,) * 16, 0, 32, 32, 128, True),
    ("4 x 4096, head_dim 64", (4096,) * 4, 0, 32, 8, 64, True),
    ("4 x 4096, head_dim 256", (4096,) * 4, 0, 32, 8, 256, True),
    ("4 x 4096, head_dim 192 / 128, Hq = Hkv 16", (4096,) * 4, 0, 16, 16, (192, 128), True),
    ("16 x 1024, head_dim 192 / 128, Hq = Hkv 16", (1024,) * 16, 0, 16, 16, (192, 128), True),
]  # fmt: skip
FORMS = {"ragged": "BatchPrefillWithRaggedKVCacheWrapper",
         "paged": "BatchPrefillWithPagedKVCacheWrapper"}  # fmt: skip
# FlashInfer is measured with fa2 on every row (the three views and the ratios) and with fa3,
# its own choice on sm90, in the graph view at head_dim 128 (its nvcc JIT takes ~100 s per
# head_dim, fa2's ~15 s). One module per (backend, head_dim) serves both forms, causal or not.
FA3_HEAD_DIMS = (128,)


@contextlib.contextmanager
def mma_sync_kernel():
    """Kernels planned inside are the mma.sync ones (no warpgroup MMAs)."""
    before = os.environ.get("RTCINFER_PREFILL_WGMMA")
    os.environ["RTCINFER_PREFILL_WGMMA"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["RTCINFER_PREFILL_WGMMA"]
        else:
            os.environ["RTCINFER_PREFILL_WGMMA"] = before


def indptr_of(lengths: np.ndarray) -> np.ndarray:
    indptr = np.zeros(lengths.shape[0] + 1, dtype=np.int32)
    np.cumsum(lengths, out=indptr[1:])
    return indptr


def page_table(kv_len: np.ndarray, rng):
    pages = -(-kv_len // PAGE)
    indptr = indptr_of(pages)
    indices = rng.permutation(int(indptr[-1])).astype(np.int32)  # scattered pages
    last = (kv_len - (pages - 1) * PAGE).astype(np.int32)
    return indptr, indices, last


def visible_pairs(qo_len: np.ndarray, kv_len: np.ndarray, causal: bool) -> int:
    """(query, key) pairs the mask lets through: causal (bottom-right aligned), query i of a
    request sees keys 0 .. kv_len - qo_len + i; otherwise all kv_len keys."""
    if not causal:
        return int(np.dot(qo_len.astype(np.int64), kv_len))
    pairs = 0
    for q, k in zip(qo_len.tolist(), kv_len.tolist(), strict=True):
        pairs += int(np.clip(k - q + np.arange(q) + 1, 0, k).sum())
    return pairs


@functools.cache
def gemm_tflops(n: int = 8192) -> float:
    """The bf16 GEMM ceiling, n^3 (PyTorch; CuPy float16 without it): 2 n^3 / time, TFLOP/s."""
    torch = peer("torch")
    if torch is not None:
        a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        c = torch.empty_like(a)
        us = time_us(lambda: torch.matmul(a, b, out=c), repeat=10, flush=False)
    else:
        cp = cupy()
        a, b = (cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
                for _ in range(2))  # fmt: skip
        c = cp.empty_like(a)
        us = time_us(lambda: cp.matmul(a, b, out=c), repeat=10, flush=False)
    return 2 * n**3 / us / 1e6


def plan_tables(form: str, qo_len: np.ndarray, kv_len: np.ndarray, rng) -> tuple:
    """The host tables plan() takes before the head counts: ragged (qo_indptr, kv_indptr);
    paged (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)."""
    if form == "ragged":
        return indptr_of(qo_len), indptr_of(kv_len)
    return (indptr_of(qo_len), *page_table(kv_len, rng))


def kv_arrays(form: str, tables: tuple, hkv: int, head_dim: int, head_dim_vo: int) -> tuple:
    """The K/V arrays run() takes after q: ragged (k, v) [nnz_kv, Hkv, D] each (v: D_vo);
    paged one [pages, 2, PAGE, Hkv, D] cache, or k and v [pages, PAGE, Hkv, D or D_vo] (a
    pair, passed as one argument) where the dims differ."""
    rows = int(tables[1][-1])
    if form == "ragged":
        return (random_cache((rows, hkv, head_dim), "bfloat16"),
                random_cache((rows, hkv, head_dim_vo), "bfloat16"))  # fmt: skip
    if head_dim != head_dim_vo:
        dims = (head_dim, head_dim_vo)
        return tuple(random_cache((rows, PAGE, hkv, d), "bfloat16") for d in dims)
    return (random_cache((rows, 2, PAGE, hkv, head_dim), "bfloat16"),)


def run_arguments(form: str, kv: list, head_dim: int, head_dim_vo: int) -> list:
    """kv_arrays' arrays as run() takes them (a paged pair as one (k, v) argument)."""
    return [tuple(kv)] if form == "paged" and head_dim != head_dim_vo else kv


def flashinfer_wrapper(fi, torch, wrappers: dict, form: str, backend: str):
    """FlashInfer's wrapper of `form` on `backend` with a 128 MB workspace, made once and
    re-planned for every row (None, with a note, if it cannot be made)."""
    key = (form, backend)
    if key not in wrappers:
        try:
            workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
            wrappers[key] = getattr(fi, FORMS[form])(workspace, "NHD", backend=backend)
        except Exception as e:  # noqa: BLE001 - a peer failing must not stop the bench
            print(f"# flashinfer {form} {backend} failed: {type(e).__name__}: {str(e)[:200]}")
            wrappers[key] = None
    return wrappers[key]


def flashinfer_tables(torch, form: str, tables: tuple) -> list:
    """plan()'s tables as FlashInfer takes them: host int32 tensors, the page ids on the GPU."""
    tensors = [torch.from_numpy(a) for a in tables]
    if form == "paged":
        tensors[2] = tensors[2].cuda()
    return tensors


def flashinfer_views(fi, torch, wrappers, form, backend, tables, dims, causal, tq, tkv,
                     head_dim_vo, tout):  # fmt: skip
    """views() of FlashInfer's run() on the batch (None if its plan fails)."""
    wrapper = flashinfer_wrapper(fi, torch, wrappers, form, backend)
    if wrapper is None:
        return None
    try:
        wrapper.plan(*flashinfer_tables(torch, form, tables), *dims, head_dim_vo=head_dim_vo,
                     causal=causal, q_data_type=torch.bfloat16)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a peer failing must not stop the bench
        print(f"# flashinfer {form} {backend} plan failed: {type(e).__name__}: {str(e)[:200]}")
        return None
    tout = torch.empty_like(tout)
    return peer_views(f"flashinfer {form} {backend}",
                      lambda: wrapper.run(tq, *tkv, out=tout))  # fmt: skip


def prefill_rows(table: Table, form: str, fi, torch, wrappers: dict, rng) -> None:
    cp = cupy()
    bf16 = numpy_dtype("bfloat16")
    for label, qo_lens, prefix, hq, hkv, head_dims, causal in ROWS:
        head_dim, head_dim_vo = head_dims if isinstance(head_dims, tuple) else (head_dims,) * 2
        qo_len = np.array(qo_lens, dtype=np.int32)
        kv_len = qo_len + prefix
        tables = plan_tables(form, qo_len, kv_len, rng)
        kv = kv_arrays(form, tables, hkv, head_dim, head_dim_vo)
        dims = (hq, hkv, head_dim) + ((PAGE,) if form == "paged" else ())
        q = random_cache((int(qo_len.sum()), hq, head_dim), "bfloat16")
        out = cp.empty((q.shape[0], hq, head_dim_vo), dtype=bf16)
        wrapper = getattr(rtcinfer, FORMS[form])()
        plan_kw = dict(head_dim_vo=head_dim_vo, causal=causal, q_data_type="bfloat16")
        wrapper.plan(*tables, *dims, **plan_kw)
        run_kv = run_arguments(form, list(kv), head_dim, head_dim_vo)
        cupy_graph = graph_time_us(lambda: wrapper.run(q, *run_kv, out=out))  # noqa: B023
        mma_sync = None
        if wrapper._launch.launch.kernel.spec.wgmma:
            with mma_sync_kernel():
                alt = getattr(rtcinfer, FORMS[form])()
                alt.plan(*tables, *dims, **plan_kw)
            mma_sync = graph_time_us(lambda: alt.run(q, *run_kv, out=out))  # noqa: B023
        (tq, tout, *tkv), is_torch = callers(q, out, *kv)
        tkv = run_arguments(form, tkv, head_dim, head_dim_vo)
        ours = views(lambda: wrapper.run(tq, *tkv, out=tout), torch_graph=is_torch)  # noqa: B023
        flops = 2 * (head_dim + head_dim_vo) * hq * visible_pairs(qo_len, kv_len, causal)
        tflops = flops / ours.graph / 1e6
        theirs = fa3 = None
        if fi is not None and torch is not None:
            theirs = flashinfer_views(fi, torch, wrappers, form, "fa2", tables, dims, causal,
                                      tq, tkv, head_dim_vo, tout)  # fmt: skip
            if head_dim in FA3_HEAD_DIMS and head_dim_vo == head_dim:
                fa3 = flashinfer_views(fi, torch, wrappers, form, "fa3", tables, dims, causal,
                                       tq, tkv, head_dim_vo, tout)  # fmt: skip
        fa3_graph = None if fa3 is None else fa3.graph
        table.add(label, *ours.cells(), cupy_graph, mma_sync, tflops,
                  100 * tflops / gemm_tflops(),
                  *peer_cells(ours, theirs), fa3_graph, ratio(ours.graph, fa3_graph))  # fmt: skip


def plan_row(table: Table, form: str, fi, torch, wrappers: dict, rng, batch: int = 64) -> None:
    """plan() host time for `batch` mixed requests (MIXED repeated; host arrays, no device
    sync)."""
    qo_len = np.resize(np.array(MIXED, dtype=np.int32), batch)
    tables = plan_tables(form, qo_len, qo_len, rng)
    dims = (32, 8, 128) + ((PAGE,) if form == "paged" else ())
    wrapper = getattr(rtcinfer, FORMS[form])()
    times = []
    for _ in range(300):
        start = time.perf_counter()
        wrapper.plan(*tables, *dims, causal=True, q_data_type="bfloat16")
        times.append(time.perf_counter() - start)
    ours = float(np.median(times[50:])) * 1e6
    theirs, backend = None, "fa2"
    fw = None
    if fi is not None and torch is not None:
        fw = flashinfer_wrapper(fi, torch, wrappers, form, backend)
    if fw is not None:
        host = flashinfer_tables(torch, form, tables)
        try:
            for i in range(100):
                start = time.perf_counter()
                fw.plan(*host, *dims, causal=True, q_data_type=torch.bfloat16)
                times[i] = time.perf_counter() - start
            theirs = float(np.median(times[20:100])) * 1e6
        except Exception as e:  # noqa: BLE001 - a peer failing must not stop the bench
            print(f"# flashinfer {form} plan failed: {type(e).__name__}: {str(e)[:200]}")
    blank = (None,) * 6  # loop, graph, CuPy graph, other warps, TFLOP/s, % GEMM of a kernel row
    table.add(f"plan(), {batch} mixed requests (host us)", ours, *blank, theirs, None, None,
              ratio(ours, theirs), None, None, None)  # fmt: skip


def main() -> Tables:
    fi, torch = peer("flashinfer"), peer("torch")
    rng = np.random.default_rng(0)
    print(header())
    columns = ["case", *VIEW_COLUMNS, "CuPy graph us", "mma.sync graph us", "TFLOP/s",
               "% GEMM", *PEER_COLUMNS, "FI fa3 graph us", "graph vs fa3"]  # fmt: skip
    wrappers: dict = {}  # (form, backend) -> FlashInfer's wrapper, reused
    tables = Tables()
    forms = sys.argv[1:] or ["ragged", "paged"]
    for form, kv in (("ragged", "ragged KV"), ("paged", f"paged KV, page {PAGE}, permuted pages")):
        if form not in forms:
            continue
        table = Table(
            f"batch prefill, {kv} (bf16, Hq 32 / Hkv 8, head_dim 128, causal unless noted; "
            f"% GEMM of a bf16 8192^3 GEMM at {gemm_tflops():.0f} TFLOP/s)",
            columns,
        )
        prefill_rows(table, form, fi, torch, wrappers, rng)
        for batch in (64, 256):
            plan_row(table, form, fi, torch, wrappers, rng, batch)
        tables.append(table)
    return tables


if __name__ == "__main__":
    print(main().markdown())
