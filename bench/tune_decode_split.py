"""Decode's split and tile choices timed on this GPU (graph view, CuPy arrays, bf16 q, 32 / 8
heads, head_dim 128, page 16). The defaults of plan/decode.py (the straggler cut), plan/prefill.py
and prefill_kernel.py (the tensor-core decode's tile and split) come from these numbers.

  chunks  the CUDA-core decode over mixed and uniform batches: the planner's choice ("auto"),
          one item per request ("whole"), fixed chunks of pages, and a CUDA-graph wrapper of
          the batch's capacity ("graph auto")
  tc      use_tensor_cores=True (the prefill kernel's 8-row tiles) beside the CUDA-core
          decode: KV tile keys x ring stages x fixed split (pages), bf16 and e4m3 KV; fp8
          read from the ring (fp8_direct, the default) or widened into staging tiles

    python -m bench.tune_decode_split [chunks] [tc]
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

import rtcinfer
from bench.bench_decode import random_cache
from bench.bench_prefill import PAGE, page_table
from bench.common import Table, Tables, cupy, graph_time_us, header
from rtcinfer.attention import prefill_launch
from rtcinfer.attention.prefill_kernel import busy_decode_spec, prefill_spec, wide_decode_spec
from rtcinfer.interop.dtypes import numpy_dtype

HQ, HKV, D = 32, 8, 128  # page: bench_prefill's PAGE (16)
RNG = np.random.default_rng(0)
MIXED = {  # label: token lengths
    "64 x 256-4096": RNG.integers(256, 4097, 64),
    "128 x 16-8192": RNG.integers(16, 8193, 128),
    "256 x 128-2048": RNG.integers(128, 2049, 256),
    "16 x 1000-32000": RNG.integers(1000, 32001, 16),
    "64 x 4096": np.full(64, 4096),
    "128 x 2048": np.full(128, 2048),
}
FIXED = (16, 32, 48, 64, 96, 128)
TC_SHAPES = {"1 x 32768": [32768], "16 x 4096": [4096] * 16, "48 x 4096": [4096] * 48,
             "64 x 4096": [4096] * 64, "256 x 1024": [1024] * 256}  # fmt: skip
TC_CONFIGS = ((64, 3), (128, 2), (128, 3))  # (KV tile keys, stages)
TC_SPLITS = (None, 64, 128)  # fixed_split_size in pages (None: the planner's)


def batch(lengths, dtype="bfloat16"):
    """(page table, q, cache, out) of requests of `lengths` tokens, pages scattered."""
    indptr, indices, last = page_table(np.asarray(lengths, dtype=np.int64), RNG)
    cache = random_cache((int(indptr[-1]), 2, PAGE, HKV, D), dtype)
    q = random_cache((len(lengths), HQ, D), "bfloat16")
    out = cupy().empty(q.shape, dtype=numpy_dtype("bfloat16"))
    return (indptr, indices, last), q, cache, out


def timed(wrapper, tables, q, cache, out, dtype, **plan_kw) -> float:
    wrapper.plan(*tables, HQ, HKV, D, PAGE, q_data_type="bfloat16", kv_data_type=dtype,
                 **plan_kw)  # fmt: skip
    return graph_time_us(lambda: wrapper.run(q, cache, out=out))


def chunk_rows() -> Table:
    cp = cupy()
    table = Table("CUDA-core decode: chunk choices (graph us)",
                  ["batch", "auto", "auto items", "whole",
                   *(f"{c} pages" for c in FIXED), "graph auto",
                   "graph items"])  # fmt: skip
    for label, lengths in MIXED.items():
        tables, q, cache, out = batch(lengths)
        w = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
        auto = timed(w, tables, q, cache, out, "bfloat16")
        items = w._launch.launch.grid[1]
        whole = timed(w, tables, q, cache, out, "bfloat16", disable_split_kv=True)
        fixed = [timed(w, tables, q, cache, out, "bfloat16", fixed_split_size=c) for c in FIXED]
        n = len(lengths)
        g = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(
            use_cuda_graph=True, paged_kv_indptr_buffer=cp.empty(n + 1, np.int32),
            paged_kv_indices_buffer=cp.empty(int(tables[0][-1]), np.int32),
            paged_kv_last_page_len_buffer=cp.empty(n, np.int32))  # fmt: skip
        graph = timed(g, tables, q, cache, out, "bfloat16")
        table.add(label, auto, items, whole, *fixed, graph, g._launch.launch.grid[1])
    return table


def forced(kv_tile: int, stages: int, direct: bool):
    """prefill_launch's spec choice replaced: decode tiles (8 and 16 rows) take (kv_tile,
    stages), fp8 ones read from the ring when `direct` (and every batch keeps them: no
    wide_decode_spec or busy_decode_spec)."""
    prefill_launch.wide_decode_spec = lambda spec, max_smem: None
    prefill_launch.busy_decode_spec = lambda spec: None

    def spec(q_dtype, o_dtype, head_dim, rows, *args, **kw):
        chosen = prefill_spec(
            q_dtype, o_dtype, head_dim, rows, *args, **kw, fp8_direct=direct and rows <= 16
        )
        if rows > 16:
            return chosen
        return dataclasses.replace(chosen, kv_tile=kv_tile, stages=stages)

    prefill_launch.prefill_spec = spec


def tc_rows() -> Table:
    table = Table("tensor-core decode configurations (graph us)",
                  ["batch", "KV", "CUDA-core", "KV tile", "stages", "fp8 read", "smem KiB",
                   *(f"split {s or 'auto'}" for s in TC_SPLITS)])  # fmt: skip
    for label, lengths in TC_SHAPES.items():
        for dtype in ("bfloat16", "float8_e4m3fn"):
            if dtype != "bfloat16" and label == "16 x 4096":
                continue
            tables, q, cache, out = batch(lengths, dtype)
            core = timed(rtcinfer.BatchDecodeWithPagedKVCacheWrapper(), tables, q, cache, out,
                         dtype)  # fmt: skip
            reads = (False, True) if dtype != "bfloat16" else (False,)
            for (kv_tile, stages), direct in ((c, d) for c in TC_CONFIGS for d in reads):
                forced(kv_tile, stages, direct)
                times = []
                for split in TC_SPLITS:
                    w = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)
                    try:
                        times.append(timed(w, tables, q, cache, out, dtype,
                                           fixed_split_size=split))  # fmt: skip
                    except Exception as e:  # noqa: BLE001 - a configuration that fails is reported
                        print(f"# {label} {kv_tile}/{stages}: {type(e).__name__}: {e}"[:300])
                        times.append(None)
                smem = w._tc._launch.launch.kernel.smem / 1024 if times[-1] else None
                read = ("ring" if direct else "staged") if dtype != "bfloat16" else ""
                table.add(label, dtype, core, kv_tile, stages, read, smem, *times)
    prefill_launch.prefill_spec = prefill_spec
    prefill_launch.wide_decode_spec = wide_decode_spec
    prefill_launch.busy_decode_spec = busy_decode_spec
    return table


def main(parts=("chunks", "tc")) -> Tables:
    print(header())
    tables = Tables()
    if "chunks" in parts:
        tables.append(chunk_rows())
    if "tc" in parts:
        tables.append(tc_rows())
    return tables


if __name__ == "__main__":
    print(main(tuple(sys.argv[1:]) or ("chunks", "tc")).markdown())
