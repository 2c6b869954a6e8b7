"""Cascade attention on a shared prefix: a decode step of requests that share a long prompt
prefix (a system prompt, few-shot examples, beam or parallel samples) plus their own suffixes,
page 16, bf16, Hq 32 / Hkv 8, head_dim 128. Three ways to run it, three views each (bench/
common.py), FlashInfer's two-level cascade wrapper beside them:

    plain decode:  BatchDecodeWithPagedKVCacheWrapper over each request's whole page list (the
                   prefix's pages listed in every request, read once per request)
    two levels:    MultiLevelCascadeAttentionWrapper: level 0 all queries over the prefix's
                   pages as one group, level 1 each query over its own pages, merged
    shared prefix: BatchDecodeWithSharedPrefixPagedKVCacheWrapper, the prefix as contiguous K/V

"vs plain" is the plain decode's graph time over the row's (> 1: faster than reading the prefix
once per request).

    python -m bench.bench_cascade
"""

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
    cupy,
    header,
    peer,
    peer_cells,
    peer_views,
    ratio,
    views,
)

PAGE, HQ, HKV, D = 16, 32, 8, 128
# label, requests, shared prefix tokens, own tokens per request
ROWS = [
    ("128 x (32768 shared + 256 own)", 128, 32768, 256),
    ("32 x (8192 shared + 512 own)", 32, 8192, 512),
    ("8 x (32768 shared + 16 own)", 8, 32768, 16),
]


def tables(batch: int, shared: int, own: int, rng):
    """Page tables over one cache: the prefix's pages (shared: pages 0..P-1, whole pages), each
    request's own pages after them (scattered). Returns (plain table, level tables, pages)."""
    prefix_pages = shared // PAGE
    own_pages = -(-own // PAGE)
    last = own - (own_pages - 1) * PAGE
    own_ids = prefix_pages + rng.permutation(batch * own_pages).astype(np.int32)
    own_ids = own_ids.reshape(batch, own_pages)
    prefix_ids = np.arange(prefix_pages, dtype=np.int32)
    plain = (
        np.arange(batch + 1, dtype=np.int32) * (prefix_pages + own_pages),
        np.concatenate([np.concatenate([prefix_ids, ids]) for ids in own_ids]),
        np.full(batch, last, dtype=np.int32),
    )
    levels = (
        [np.array([0, batch], np.int32), np.arange(batch + 1, dtype=np.int32)],  # qo_indptr
        [np.array([0, prefix_pages], np.int32),
         np.arange(batch + 1, dtype=np.int32) * own_pages],  # kv_indptr
        [prefix_ids, own_ids.reshape(-1)],  # kv_indices
        [np.array([PAGE], np.int32), np.full(batch, last, dtype=np.int32)],  # last_page_len
    )  # fmt: skip
    return plain, levels, prefix_pages + batch * own_pages, own_ids


def flashinfer_levels(fi, torch, levels, q, cache) -> object:
    """Views of FlashInfer's two-level cascade wrapper on the same cache, or None."""
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    try:
        wrapper = fi.MultiLevelCascadeAttentionWrapper(2, workspace, "NHD")
        dev = [[torch.from_numpy(a).cuda() for a in arrays] for arrays in levels]
        wrapper.plan(*dev, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - a peer failing must not stop the bench
        print(f"# flashinfer cascade plan failed: {type(e).__name__}: {str(e)[:200]}")
        return None
    tq, tcache = torch.from_dlpack(q), torch.from_dlpack(cache)
    return peer_views("flashinfer cascade", lambda: wrapper.run(tq, tcache))


def cascade_rows(table: Table, fi, torch, rng) -> None:
    for label, batch, shared, own in ROWS:
        plain_table, levels, pages, own_ids = tables(batch, shared, own, rng)
        cache = random_cache((pages, 2, PAGE, HKV, D), "bfloat16")
        q = random_cache((batch, HQ, D), "bfloat16")
        (tq, tcache), is_torch = callers(q, cache)

        plain = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
        plain.plan(*plain_table, HQ, HKV, D, PAGE, q_data_type="bfloat16")
        plain_views = views(lambda: plain.run(tq, tcache), torch_graph=is_torch)  # noqa: B023

        two = rtcinfer.MultiLevelCascadeAttentionWrapper(2)
        two.plan(*levels, HQ, HKV, D, PAGE, q_data_type="bfloat16")
        two_views = views(lambda: two.run(tq, tcache), torch_graph=is_torch)  # noqa: B023

        cp = cupy()
        prefix = cache[: shared // PAGE]  # [P, 2, PAGE, HKV, D]: the prefix, contiguous
        k_shared = cp.ascontiguousarray(prefix[:, 0].reshape(shared, HKV, D))
        v_shared = cp.ascontiguousarray(prefix[:, 1].reshape(shared, HKV, D))
        (tk, tv), _ = callers(k_shared, v_shared)
        sp = rtcinfer.BatchDecodeWithSharedPrefixPagedKVCacheWrapper()
        own_last = levels[3][1]
        sp.plan(levels[1][1], own_ids.reshape(-1), own_last, HQ, HKV, D, PAGE,
                q_data_type="bfloat16")  # fmt: skip
        sp_views = views(lambda: sp.forward(tq, tk, tv, tcache), torch_graph=is_torch)  # noqa: B023

        theirs = None
        if fi is not None and torch is not None:
            theirs = flashinfer_levels(fi, torch, levels, q, cache)
        for name, seen in (("plain decode", plain_views), ("two levels", two_views),
                           ("shared prefix", sp_views)):  # fmt: skip
            table.add(f"{label}: {name}", *seen.cells(), ratio(seen.graph, plain_views.graph),
                      *peer_cells(seen, theirs if name == "two levels" else None))  # fmt: skip


def main() -> Tables:
    fi, torch = peer("flashinfer"), peer("torch")
    print(header())
    table = Table(
        "decode over a shared prefix (bf16, Hq 32 / Hkv 8, head_dim 128, page 16)",
        ["case", *VIEW_COLUMNS, "vs plain", *PEER_COLUMNS],
    )
    cascade_rows(table, fi, torch, np.random.default_rng(0))
    tables = Tables()
    tables.append(table)
    return tables


if __name__ == "__main__":
    print(main().markdown())
