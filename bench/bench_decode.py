"""Batch decode on the GPU, three views (eager, loop, graph; bench/common.py), effective TB/s
from the graph view (K and V read once, plus q and o), % of copy bandwidth, and the three
views of FlashInfer's best (by graph view) of use_tensor_cores False/True measured in the same
run; then plan() host time at batch 256 and append_paged_kv_cache bandwidth. rtcinfer is
called with PyTorch tensors when PyTorch is installed (as FlashInfer is); "CuPy graph us" is
the same call on CuPy arrays captured with CuPy's stream capture; "tc graph us" the same with
use_tensor_cores=True (the prefill kernel's 8-row tiles for groups up to 8)."""

from __future__ import annotations

import time

import numpy as np

import rtcinfer
from bench.common import (
    PEER_COLUMNS,
    VIEW_COLUMNS,
    Table,
    Tables,
    callers,
    copy_tbps,
    cupy,
    graph_time_us,
    header,
    peer,
    peer_cells,
    peer_views,
    ratio,
    run_peer,
    views,
)
from rtcinfer.interop.dtypes import itemsize, numpy_dtype

# label, batch, kv_len, num_qo_heads, num_kv_heads, page_size, kv dtype (head_dim 128, bf16 q)
ROWS = [
    ("1 x 32768", 1, 32768, 32, 8, 16, "bfloat16"),
    ("16 x 4096", 16, 4096, 32, 8, 16, "bfloat16"),
    ("64 x 4096", 64, 4096, 32, 8, 16, "bfloat16"),
    ("128 x 2048", 128, 2048, 32, 8, 16, "bfloat16"),
    ("256 x 1024", 256, 1024, 32, 8, 16, "bfloat16"),
    ("32 x 8192, page 64", 32, 8192, 32, 8, 64, "bfloat16"),
    ("64 x 4096, MHA (Hkv 32)", 64, 4096, 32, 32, 16, "bfloat16"),
    ("64 x 4096, Hq 64, page 1", 64, 4096, 64, 8, 1, "bfloat16"),
    ("1 x 32768, e4m3", 1, 32768, 32, 8, 16, "float8_e4m3fn"),
    ("64 x 4096, e4m3", 64, 4096, 32, 8, 16, "float8_e4m3fn"),
    ("256 x 1024, e4m3", 256, 1024, 32, 8, 16, "float8_e4m3fn"),
]
HEAD_DIM = 128


def random_cache(shape, dtype: str):
    """Finite random values without a host round trip: bf16 = the top half of fp32 normals;
    fp8 = random bytes with the top exponent bit cleared (|x| < 2, never NaN or inf)."""
    cp = cupy()
    if dtype == "bfloat16":
        x = cp.random.standard_normal(shape, dtype=cp.float32)
        return (x.view(cp.uint32) >> 16).astype(cp.uint16).view(numpy_dtype("bfloat16"))
    return cp.random.randint(0, 256, shape, dtype=cp.uint8) & 0xBF


def table_for(batch: int, kv_len: int, page_size: int, rng):
    pages = -(-kv_len // page_size)
    indptr = np.arange(batch + 1, dtype=np.int32) * pages
    indices = rng.permutation(batch * pages).astype(np.int32)  # scattered pages
    last = np.full(batch, kv_len - (pages - 1) * page_size, dtype=np.int32)
    return indptr, indices, last


def flashinfer_best(fi, torch, args, q, cache, dtype):
    """(views, use_tensor_cores) of FlashInfer's best by graph view of use_tensor_cores
    False/True (None if both fail)."""
    indptr, indices, last, hq, hkv, page = args
    to_t = lambda a: torch.from_dlpack(a)  # noqa: E731
    tq = to_t(q)
    tcache = to_t(cache) if dtype == "bfloat16" else to_t(cache).view(getattr(torch, dtype))
    dev = [torch.from_numpy(a).cuda() for a in (indptr, indices, last)]
    best = None
    for tc in (False, True):
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tc)
        try:
            wrapper.plan(*dev, hq, hkv, HEAD_DIM, page, q_data_type=torch.bfloat16,
                         kv_data_type=getattr(torch, dtype))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a peer failing must not stop the bench
            print(f"# flashinfer tc={tc} plan failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        seen = peer_views(f"flashinfer tc={tc}", lambda w=wrapper: w.run(tq, tcache))
        if seen.graph is not None and (best is None or seen.graph < best[0].graph):
            best = (seen, tc)
    return best


def decode_rows(table: Table, fi, torch, rng) -> None:
    cp = cupy()
    bf16 = numpy_dtype("bfloat16")
    for label, batch, kv_len, hq, hkv, page, dtype in ROWS:
        indptr, indices, last = table_for(batch, kv_len, page, rng)
        cache = random_cache((int(indptr[-1]), 2, page, hkv, HEAD_DIM), dtype)
        q = random_cache((batch, hq, HEAD_DIM), "bfloat16")
        out = cp.empty((batch, hq, HEAD_DIM), dtype=bf16)
        wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
        wrapper.plan(indptr, indices, last, hq, hkv, HEAD_DIM, page, q_data_type="bfloat16",
                     kv_data_type=dtype)  # fmt: skip
        cupy_graph = graph_time_us(lambda: wrapper.run(q, cache, out=out))
        tc = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)
        tc.plan(indptr, indices, last, hq, hkv, HEAD_DIM, page, q_data_type="bfloat16",
                kv_data_type=dtype)  # fmt: skip
        tc_graph = graph_time_us(lambda: tc.run(q, cache, out=out))  # noqa: B023 - called at once
        (tq, tcache, tout), is_torch = callers(q, cache, out)
        if is_torch and dtype != "bfloat16":
            tcache = tcache.view(getattr(torch, dtype))
        ours = views(lambda: wrapper.run(tq, tcache, out=tout), torch_graph=is_torch)
        nbytes = batch * kv_len * hkv * HEAD_DIM * itemsize(dtype) * 2 + 2 * q.nbytes
        tbps = nbytes / ours.graph / 1e6
        best = None
        if fi is not None and torch is not None:
            best = flashinfer_best(fi, torch, (indptr, indices, last, hq, hkv, page), q, cache,
                                   dtype)  # fmt: skip
        table.add(label, *ours.cells(), cupy_graph, tc_graph, tbps, 100 * tbps / copy_tbps(),
                  *peer_cells(ours, best[0] if best else None),
                  "" if best is None else f"tc={int(best[1])}")  # fmt: skip


def plan_row(table: Table, fi, torch, rng) -> None:
    """plan() host time at batch 256 x 1024 tokens (host arrays, no device sync)."""
    indptr, indices, last = table_for(256, 1024, 16, rng)
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    args = (indptr, indices, last, 32, 8, HEAD_DIM, 16)
    times = []
    for _ in range(300):
        start = time.perf_counter()
        wrapper.plan(*args, q_data_type="bfloat16")
        times.append(time.perf_counter() - start)
    ours = float(np.median(times[50:])) * 1e6
    theirs = None
    if fi is not None and torch is not None:
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        fw = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        host = [torch.from_numpy(indptr), torch.from_numpy(indices).cuda(), torch.from_numpy(last)]
        for i in range(100):
            start = time.perf_counter()
            fw.plan(*host, 32, 8, HEAD_DIM, 16, q_data_type=torch.bfloat16)
            times[i] = time.perf_counter() - start
        theirs = float(np.median(times[20:100])) * 1e6
    blank = (None,) * 6  # loop, graph, CuPy graph, tc graph, TB/s, % copy of a kernel row
    table.add(
        "plan(), batch 256 (host us)",
        ours,
        *blank,
        theirs,
        None,
        None,
        ratio(ours, theirs),
        None,
        "",
    )


def append_rows(table: Table, fi, torch, rng) -> None:
    """append_paged_kv_cache, ours then FlashInfer's (on its own copies of the inputs), beside a
    device-to-device copy of the same bytes timed the same way (a small copy cannot reach the
    large-copy ceiling either: launch latency dominates)."""
    cp = cupy()
    rows = []
    for label, batch, added, kv_len in (("append 256 x 1 token", 256, 1, 1024),
                                        ("append 16 x 1024 tokens", 16, 1024, 4096)):  # fmt: skip
        indptr, indices, last = table_for(batch, kv_len, 16, rng)
        cache = random_cache((int(indptr[-1]), 2, 16, 8, HEAD_DIM), "bfloat16")
        nnz = batch * added
        append_indptr = np.arange(batch + 1, dtype=np.int32) * added
        seq = np.full(batch, kv_len, dtype=np.int32)
        bi, pos = (
            cp.asarray(a) for a in rtcinfer.get_batch_indices_positions(append_indptr, seq, nnz)
        )
        key, value = (random_cache((nnz, 8, HEAD_DIM), "bfloat16") for _ in range(2))
        dev = [cp.asarray(a) for a in (indices, indptr, last)]
        us = graph_time_us(lambda: rtcinfer.append_paged_kv_cache(key, value, bi, pos, cache, *dev))
        src = cp.empty(key.nbytes + value.nbytes, dtype=np.uint8)
        dst = cp.empty_like(src)
        copy_us = graph_time_us(lambda: cp.copyto(dst, src))  # noqa: B023 - called at once
        tbps = 2 * (key.nbytes + value.nbytes) / us / 1e6  # read + write, like the copy ceiling
        rows.append((label, us, tbps, copy_us, (key, value, bi, pos, cache, *dev)))
    for label, us, tbps, copy_us, arrays in rows:
        theirs = None
        if fi is not None and torch is not None:
            t = [torch.from_dlpack(a).clone() for a in arrays]
            theirs = run_peer("flashinfer append", lambda: fi.append_paged_kv_cache(*t))
        table.add(label, us, tbps, 100 * tbps / copy_tbps(), copy_us, 100 * copy_us / us, theirs,
                  ratio(us, theirs))  # fmt: skip


def main() -> Tables:
    fi, torch = peer("flashinfer"), peer("torch")
    rng = np.random.default_rng(0)
    print(header())
    columns = ["case", *VIEW_COLUMNS, "CuPy graph us", "tc graph us", "TB/s", "% copy",
               *PEER_COLUMNS,
               "FI best"]  # fmt: skip
    table = Table("batch decode (bf16 q, head_dim 128, page 16 unless noted)", columns)
    decode_rows(table, fi, torch, rng)
    plan_row(table, fi, torch, rng)
    append = Table(
        "append_paged_kv_cache (bf16, 8 kv heads, head_dim 128, page 16)",
        ["case", "us", "TB/s", "% copy", "same-size copy us", "% of same-size copy",
         "FlashInfer us", "vs FlashInfer"],
    )  # fmt: skip
    append_rows(append, fi, torch, rng)
    return Tables([table, append])


if __name__ == "__main__":
    print(main().markdown())
