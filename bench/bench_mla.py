"""MLA (BatchMLAPagedAttentionWrapper: DeepSeek's latent attention, absorbed, ckv 512 + kpe 64)
on the GPU, three views (eager, loop, graph; bench/common.py) and the latent cache's bytes per
graph-view microsecond, beside FlashInfer's wrapper (its default backend) in the same process.
bf16, permuted pages; rtcinfer is called with PyTorch tensors when PyTorch is installed (as
FlashInfer is)."""

from __future__ import annotations

import numpy as np

import rtcinfer
from bench.bench_decode import random_cache
from bench.common import (
    PEER_COLUMNS,
    VIEW_COLUMNS,
    Table,
    Tables,
    callers,
    header,
    peer,
    peer_cells,
    peer_views,
    views,
)

SCALE = 1 / np.sqrt(192)
# label, heads (DeepSeek's 128, 16 a GPU at 8-way tensor parallelism), queries of each request,
# keys of each request, page size, causal
ROWS = [
    ("decode 64 x 4096, 16 heads, page 1", 16, (1,) * 64, (4096,) * 64, 1, False),
    ("decode 128 x 2048, 16 heads, page 64", 16, (1,) * 128, (2048,) * 128, 64, False),
    ("decode 32 x 8192, 128 heads, page 64", 128, (1,) * 32, (8192,) * 32, 64, False),
    ("decode 1 x 32768, 16 heads, page 64", 16, (1,), (32768,), 64, False),
    ("prefill 4 x 1024, 16 heads, page 64, causal", 16, (1024,) * 4, (1024,) * 4, 64, True),
]


def tables(qo, kv, page, rng):
    qo, kv = np.array(qo), np.array(kv)
    pages = -(-kv // page)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(int(indptr[-1])).astype(np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    return qo_indptr, indptr, indices, kv.astype(np.int32)


def mla_rows(table: Table, fi, torch, rng) -> None:
    for label, heads, qo, kv, page, causal in ROWS:
        plan_tables = tables(qo, kv, page, rng)
        n, num_pages = int(plan_tables[0][-1]), int(plan_tables[1][-1])
        q_nope = random_cache((n, heads, 512), "bfloat16")
        q_pe = random_cache((n, heads, 64), "bfloat16")
        ckv = random_cache((num_pages, page, 512), "bfloat16")
        kpe = random_cache((num_pages, page, 64), "bfloat16")
        wrapper = rtcinfer.BatchMLAPagedAttentionWrapper()
        wrapper.plan(*plan_tables, heads, 512, 64, page, causal, SCALE, "bfloat16", "bfloat16")
        arrays, is_torch = callers(q_nope, q_pe, ckv, kpe)
        ours = views(lambda: wrapper.run(*arrays), torch_graph=is_torch)  # noqa: B023
        gbps = (ckv.nbytes + kpe.nbytes) / ours.graph / 1e3  # the cache read once
        theirs = None
        if fi is not None and torch is not None:
            theirs = flashinfer_mla(fi, torch, plan_tables, (heads, page, causal), arrays)
        table.add(label, *ours.cells(), gbps, *peer_cells(ours, theirs))


def flashinfer_mla(fi, torch, plan_tables, shape, arrays):
    """FlashInfer's BatchMLAPagedAttentionWrapper's three views (None if it fails)."""
    heads, page, causal = shape
    try:
        wrapper = fi.BatchMLAPagedAttentionWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))  # fmt: skip
        wrapper.plan(*(torch.from_numpy(a).cuda() for a in plan_tables), heads, 512, 64, page,
                     causal, SCALE, torch.bfloat16, torch.bfloat16)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a peer failing must not stop the bench
        print(f"# flashinfer MLA wrapper failed: {type(e).__name__}: {str(e)[:200]}")
        return None
    return peer_views("flashinfer MLA", lambda: wrapper.run(*arrays))


def main() -> Tables:
    fi, torch = peer("flashinfer"), peer("torch")
    rng = np.random.default_rng(0)
    print(header())
    table = Table("MLA, absorbed (bf16, ckv 512 + kpe 64, permuted pages)",
                  ["case", *VIEW_COLUMNS, "cache GB/s", *PEER_COLUMNS])  # fmt: skip
    mla_rows(table, fi, torch, rng)
    return Tables([table])


if __name__ == "__main__":
    print(main().markdown())
