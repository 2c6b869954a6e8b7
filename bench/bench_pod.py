"""POD attention (a prefill and a decode batch in one call) on the GPU, three views (eager, loop,
graph; bench/common.py), beside the same two calls one after the other on one stream (what the
overlap gains) and FlashInfer's POD wrappers (one fused launch) in the same process. bf16, Hq
32, Hkv 8, D 128, page 16, permuted pages; rtcinfer is called with PyTorch tensors when
PyTorch is installed (as FlashInfer is)."""

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
    ratio,
    views,
)

HQ, HKV, D, PAGE = 32, 8, 128, 16
# label, prefill query rows (one request; batch: its requests), prefill keys each, decode
# requests, decode keys each
ROWS = [
    ("prefill 1 x 2048 + decode 64 x 2048", (2048,), 2048, 64, 2048),
    ("prefill chunk 512 of 4096 + decode 128 x 1024", (512,), 4096, 128, 1024),
    ("prefill 1 x 256 + decode 32 x 8192", (256,), 256, 32, 8192),
]
BATCH_ROWS = [
    ("prefill 4 x 1024 + decode 64 x 2048", (1024,) * 4, 1024, 64, 2048),
    ("prefill 16 x 128 + decode 128 x 1024", (128,) * 16, 128, 128, 1024),
]


def page_table(lengths, first_page: int, rng):
    pages = -(-np.asarray(lengths) // PAGE)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = (first_page + rng.permutation(int(indptr[-1]))).astype(np.int32)
    last = (np.asarray(lengths) - (pages - 1) * PAGE).astype(np.int32)
    return indptr, indices, last


def pod_rows(table: Table, fi, torch, rng) -> None:
    for label, qo, kv_p, batch, kv_d in ROWS:
        tables_d = page_table([kv_d] * batch, 0, rng)
        cache = random_cache((int(tables_d[0][-1]), 2, PAGE, HKV, D), "bfloat16")
        q_p = random_cache((qo[0], HQ, D), "bfloat16")
        k_p, v_p = (random_cache((kv_p, HKV, D), "bfloat16") for _ in range(2))
        q_d = random_cache((batch, HQ, D), "bfloat16")
        wrapper = rtcinfer.PODWithPagedKVCacheWrapper()
        wrapper.plan(*tables_d, HQ, HKV, D, PAGE, q_data_type="bfloat16")
        (tq_p, tk_p, tv_p, tq_d, tcache), is_torch = callers(q_p, k_p, v_p, q_d, cache)
        ours = views(lambda: wrapper.run(tq_p, tk_p, tv_p, tq_d, tcache, causal_p=True),  # noqa: B023
                     torch_graph=is_torch)  # fmt: skip
        decode = wrapper._decode
        serial = views(lambda: (  # noqa: B023
            rtcinfer.single_prefill_with_kv_cache(tq_p, tk_p, tv_p, causal=True),  # noqa: B023
            decode.run(tq_d, tcache)), torch_graph=is_torch)  # fmt: skip  # noqa: B023
        theirs = None
        if fi is not None and torch is not None:
            theirs = flashinfer_pod(fi, torch, tables_d, (tq_p, tk_p, tv_p, tq_d, tcache))
        table.add(label, *ours.cells(), serial.graph, ratio(ours.graph, serial.graph),
                  *peer_cells(ours, theirs))  # fmt: skip


def flashinfer_pod(fi, torch, tables, arrays, name="PODWithPagedKVCacheWrapper"):
    """FlashInfer's POD wrapper `name` planned on `tables` (host arrays, as its plan()
    takes them after the wrapper), its three views of run(*arrays, causal_p=True) (None if
    it fails)."""
    try:
        wrapper = getattr(fi, name)(
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD")  # fmt: skip
        wrapper.plan(*(torch.from_numpy(a).cuda() for a in tables), HQ, HKV, D, PAGE,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a peer failing must not stop the bench
        print(f"# flashinfer {name} failed: {type(e).__name__}: {str(e)[:200]}")
        return None
    return peer_views(f"flashinfer {name}", lambda: wrapper.run(*arrays, causal_p=True))


def batch_pod_rows(table: Table, fi, torch, rng) -> None:
    for label, qo, kv_p, batch, kv_d in BATCH_ROWS:
        tables_p = page_table([kv_p] * len(qo), 0, rng)
        first = int(tables_p[0][-1])
        tables_d = page_table([kv_d] * batch, first, rng)
        cache = random_cache((first + int(tables_d[0][-1]), 2, PAGE, HKV, D), "bfloat16")
        qo_p = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
        qo_d = np.arange(batch + 1, dtype=np.int32)
        q_p = random_cache((int(qo_p[-1]), HQ, D), "bfloat16")
        q_d = random_cache((batch, HQ, D), "bfloat16")
        wrapper = rtcinfer.BatchPODWithPagedKVCacheWrapper()
        wrapper.plan(qo_p, *tables_p, qo_d, *tables_d, HQ, HKV, D, PAGE,
                     q_data_type="bfloat16")  # fmt: skip
        (tq_p, tq_d, tcache), is_torch = callers(q_p, q_d, cache)
        call = lambda: wrapper.run(tq_p, tcache, tq_d, tcache, causal_p=True)  # noqa: B023, E731
        call()  # the prefill side planned for causal_p=True outside the timing
        ours = views(call, torch_graph=is_torch)
        pre, dec = wrapper._prefill, wrapper._decode
        serial = views(lambda: (pre.run(tq_p, tcache), dec.run(tq_d, tcache)),  # noqa: B023
                       torch_graph=is_torch)  # fmt: skip
        theirs = None
        if fi is not None and torch is not None:
            theirs = flashinfer_pod(fi, torch, (qo_p, *tables_p, qo_d, *tables_d),
                                    (tq_p, tcache, tq_d, tcache),
                                    "BatchPODWithPagedKVCacheWrapper")  # fmt: skip
        table.add(label, *ours.cells(), serial.graph, ratio(ours.graph, serial.graph),
                  *peer_cells(ours, theirs))  # fmt: skip


def main() -> Tables:
    fi, torch = peer("flashinfer"), peer("torch")
    rng = np.random.default_rng(0)
    print(header())
    columns = ["case", *VIEW_COLUMNS, "one stream graph us", "overlap gain", *PEER_COLUMNS]
    pod = Table("POD: one request's prefill (causal) beside a decode batch (bf16, Hq 32, Hkv 8, "
                "D 128, page 16)", columns)  # fmt: skip
    pod_rows(pod, fi, torch, rng)
    batch = Table("batch POD: a paged prefill batch (causal) beside a decode batch (bf16, Hq 32, "
                  "Hkv 8, D 128, page 16)", columns)  # fmt: skip
    batch_pod_rows(batch, fi, torch, rng)
    return Tables([pod, batch])


if __name__ == "__main__":
    print(main().markdown())
