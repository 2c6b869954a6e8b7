"""Batch decode and paged prefill with attention sinks on the GPU, three views (eager, loop,
graph; bench/common.py): rtcinfer's run(sinks=) (the attention kernel, then
merge_sinks_in_place), its graph view without sinks (what the sinks cost), and FlashInfer's
three views of its BatchAttentionWithAttentionSinkWrapper (its prefill kernel with the sink
variant; one query a request for decode), in the same process. rtcinfer is called with
PyTorch tensors when PyTorch is installed (as FlashInfer is). FlashInfer compiles its sink
variant at its first call (JIT), once per head dim."""

from __future__ import annotations

import numpy as np

import rtcinfer
from bench.bench_decode import random_cache, table_for
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
    views,
)
from rtcinfer.interop.dtypes import numpy_dtype

# label, batch, kv_len, num_qo_heads, num_kv_heads, head_dim (bf16, page 16)
DECODE_ROWS = [
    ("1 x 32768", 1, 32768, 32, 8, 128),
    ("64 x 4096", 64, 4096, 32, 8, 128),
    ("256 x 1024", 256, 1024, 32, 8, 128),
    ("64 x 4096, Hq 64, D 64 (gpt-oss)", 64, 4096, 64, 8, 64),
]
# label, requests, queries a request, keys a request (its queries the last), Hq, Hkv, head_dim
PREFILL_ROWS = [
    ("prefill 16 x 1024", 16, 1024, 1024, 32, 8, 128),
    ("prefill 4 x 4096", 4, 4096, 4096, 32, 8, 128),
    ("prefill 16 x 1024, Hq 64, D 64 (gpt-oss)", 16, 1024, 1024, 64, 8, 64),
    ("append 16 x 256 to 4096, Hq 64, D 64", 16, 256, 4352, 64, 8, 64),
]
PAGE = 16


def flashinfer_sinks(fi, torch, args, q, cache, sinks):
    """FlashInfer's sink wrapper over the same batch (None when it fails); args: (qo_indptr,
    indptr, indices, last, hq, hkv, d)."""
    qo_indptr, indptr, indices, last, hq, hkv, d = args
    t = lambda a: torch.from_dlpack(a)  # noqa: E731
    tq, tcache, tsinks = t(q), t(cache), t(sinks)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    try:
        wrapper = fi.BatchAttentionWithAttentionSinkWrapper(
            workspace, "NHD", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
            head_dim_qk=d, head_dim_vo=d,
        )  # fmt: skip
        dev = [torch.from_numpy(a).cuda() for a in (qo_indptr, indptr, indices, last)]
        wrapper.plan(*dev, hq, hkv, d, PAGE, causal=True, q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a peer failing must not stop the bench
        print(f"# flashinfer sink wrapper failed: {type(e).__name__}: {str(e)[:200]}")
        return None
    scale = 1.0 / np.sqrt(d)
    return peer_views("flashinfer sinks", lambda: wrapper.run(tq, tcache, tsinks, scale))


def add_row(table: Table, label: str, wrapper, q, cache, sinks, peers, fi_table) -> None:
    """One row: wrapper.run(sinks=) three views, its graph view without sinks, FlashInfer's
    sink wrapper over the same batch (fi_table: its qo_indptr, indptr, indices, last, hq,
    hkv, head_dim)."""
    fi, torch = peers
    out = cupy().empty(q.shape, dtype=numpy_dtype("bfloat16"))
    plain = graph_time_us(lambda: wrapper.run(q, cache, out=out))
    (tq, tcache, tout, tsinks), is_torch = callers(q, cache, out, sinks)
    ours = views(lambda: wrapper.run(tq, tcache, out=tout, sinks=tsinks), torch_graph=is_torch)
    theirs = None
    if fi is not None and torch is not None:
        theirs = flashinfer_sinks(fi, torch, fi_table, q, cache, sinks)
    table.add(label, *ours.cells(), plain, ours.graph - plain, *peer_cells(ours, theirs))


def decode_rows(table: Table, peers, rng) -> None:
    for label, batch, kv_len, hq, hkv, d in DECODE_ROWS:
        indptr, indices, last = table_for(batch, kv_len, PAGE, rng)
        cache = random_cache((int(indptr[-1]), 2, PAGE, hkv, d), "bfloat16")
        q = random_cache((batch, hq, d), "bfloat16")
        sinks = cupy().asarray(rng.standard_normal(hq).astype(np.float32))
        wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
        wrapper.plan(indptr, indices, last, hq, hkv, d, PAGE, q_data_type="bfloat16")
        qo_indptr = np.arange(batch + 1, dtype=np.int32)  # FlashInfer's: one query a request
        add_row(table, label, wrapper, q, cache, sinks, peers,
                (qo_indptr, indptr, indices, last, hq, hkv, d))  # fmt: skip


def prefill_rows(table: Table, peers, rng) -> None:
    """Paged prefill (append: the queries are each request's last keys), causal."""
    for label, batch, qo_len, kv_len, hq, hkv, d in PREFILL_ROWS:
        indptr, indices, last = table_for(batch, kv_len, PAGE, rng)
        qo_indptr = np.arange(batch + 1, dtype=np.int32) * qo_len
        cache = random_cache((int(indptr[-1]), 2, PAGE, hkv, d), "bfloat16")
        q = random_cache((batch * qo_len, hq, d), "bfloat16")
        sinks = cupy().asarray(rng.standard_normal(hq).astype(np.float32))
        wrapper = rtcinfer.BatchPrefillWithPagedKVCacheWrapper()
        wrapper.plan(qo_indptr, indptr, indices, last, hq, hkv, d, PAGE, causal=True,
                     q_data_type="bfloat16")  # fmt: skip
        add_row(table, label, wrapper, q, cache, sinks, peers,
                (qo_indptr, indptr, indices, last, hq, hkv, d))  # fmt: skip


def main() -> Tables:
    fi, torch = peer("flashinfer"), peer("torch")
    rng = np.random.default_rng(0)
    print(header())
    columns = ["case", *VIEW_COLUMNS, "graph us without sinks", "sinks' cost us",
               *PEER_COLUMNS]  # fmt: skip
    decode = Table("batch decode with attention sinks (bf16, page 16)", columns)
    decode_rows(decode, (fi, torch), rng)
    prefill = Table("paged prefill with attention sinks (bf16, page 16, causal)", columns)
    prefill_rows(prefill, (fi, torch), rng)
    return Tables([decode, prefill])


if __name__ == "__main__":
    print(main().markdown())
