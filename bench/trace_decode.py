"""Per-CTA timeline of one batch-decode launch (on a GPU): where a latency-bound row's time goes.

A copy of decode.cu's source gets `%globaltimer` reads after named lines (ANCHORS) and `%smid`;
thread 0 of every CTA writes them to a __device__ table, read back after one cold-L2 run. The
traced kernel compiles under its own cache key (its source differs) and is never the shipped
one; its graph time is within ~1% of the shipped kernel's. Printed per case, in us from the first
CTA's start: min / p50 / max over CTAs of each event, and the merge's span for the CTAs that
merged split partials; then the graph-replay floor of an empty kernel.

    python -m bench.trace_decode                     # 1 x 32768, bf16 and e4m3 KV
    python -m bench.trace_decode 16 4096 bfloat16 8  # batch, tokens, kv dtype, fixed_split_size
"""

from __future__ import annotations

import sys
from unittest import mock

import numpy as np

import rtcinfer
from bench.bench_decode import HEAD_DIM, random_cache, table_for
from bench.common import cupy, flush_l2, graph_time_us, header
from rtcinfer import jit

SLOTS = 8  # per CTA: the events below, then the SM id
EVENTS = ("start", "first tile landed", "loop end", "epilogue written", "merge counter", "merged")
ANCHORS = [  # (lines of decode.cu, what goes right after them)
    ("  extern __shared__ __align__(128) unsigned char smem[];\n", "rtc_mark(0, true);"),
    ("    __syncthreads();  // tile landed for everyone; the stage refilled below is no longer "
     "read\n", "rtc_mark(1, tile == 0);"),
    ("  __syncthreads();\n  const bool direct = merge_count == 1;\n", "rtc_mark(2, true);"),
    ("m_s, d_s, sink, heads, p.v_scale, warp, g, t);\n", "rtc_mark(3, true);"),
    ("    *last_s = last;\n  }\n  __syncthreads();\n", "rtc_mark(4, true);"),
    ("                 o_row, p.o_stride_h, lse_row);\n", "__syncthreads();\n  rtc_mark(5, true);"),
]  # fmt: skip
TABLE = "rtc_trace"
HELPERS = f"""
__device__ unsigned long long {TABLE}[65536 * {SLOTS}];
__device__ __forceinline__ void rtc_mark(int event, bool once) {{
  if (threadIdx.x != 0 || !once) return;
  unsigned long long t;
  unsigned sm;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  unsigned long long* row = {TABLE} + {SLOTS}ull * (blockIdx.y * gridDim.x + blockIdx.x);
  row[event] = t;
  row[{SLOTS - 1}] = sm + 1;
}}
"""


def traced_source(source: str) -> str:
    """decode.cu's expanded source with the timer reads; raises if an anchor is gone."""
    for line, mark in ANCHORS:
        if source.count(line) != 1:
            raise ValueError(f"trace anchor not found once in decode.cu: {line.strip()!r}")
        source = source.replace(line, f"{line}  {mark}\n")
    at = source.index('extern "C" __global__')
    return source[:at] + HELPERS + source[at:]


def _expand(spec, _plain=jit.expand_source):
    source = _plain(spec)
    return traced_source(source) if spec.source == "attention/decode.cu" else source


def _tables(cp):
    """The trace table of every loaded decode module (a plan may pick a kernel variant)."""
    specs = {key[0] for key in list(jit._FUNCTIONS) if key[0].source == "attention/decode.cu"}
    tables = []
    for spec in specs:
        var = jit._module(spec, cp.cuda.Device().id).get_global_var(TABLE)
        ptr = int(getattr(var, "ptr", var))  # an address or a MemoryPointer, by CuPy version
        memory = cp.cuda.UnownedMemory(ptr, 65536 * SLOTS * 8, None)
        tables.append(cp.ndarray((65536, SLOTS), cp.uint64, cp.cuda.MemoryPointer(memory, 0)))
    return tables


def trace(batch: int, kv_len: int, kv_dtype: str, split: int | None) -> None:
    cp, rng = cupy(), np.random.default_rng(0)
    indptr, indices, last = table_for(batch, kv_len, 16, rng)
    cache = random_cache((len(indices), 2, 16, 8, HEAD_DIM), kv_dtype)
    q = random_cache((batch, 32, HEAD_DIM), "bfloat16")
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    wrapper.plan(indptr, indices, last, 32, 8, HEAD_DIM, 16, q_data_type="bfloat16",
                 kv_data_type=kv_dtype, fixed_split_size=split)  # fmt: skip
    us = graph_time_us(lambda: wrapper.run(q, cache))
    tables = _tables(cp)
    for table in tables:
        table[:] = 0
    cp.cuda.Device().synchronize()
    flush_l2()
    wrapper.run(q, cache)
    cp.cuda.Device().synchronize()
    rows = np.concatenate([t.get() for t in tables]).astype(np.int64)
    rows = rows[rows[:, SLOTS - 1] > 0]
    t0 = rows[:, 0].min()
    print(f"## {batch} x {kv_len}, {kv_dtype}, fixed_split_size {split}: graph {us:.1f} us, "
          f"{len(rows)} CTAs on {len(np.unique(rows[:, SLOTS - 1]))} SMs")  # fmt: skip
    for event, name in enumerate(EVENTS):
        seen = rows[rows[:, event] > 0, event]
        if seen.size:
            x = (seen - t0) / 1e3
            print(f"  {name:18s} min {x.min():7.2f}  p50 {np.median(x):7.2f}  max {x.max():7.2f}"
                  f"  ({seen.size} CTAs)")  # fmt: skip
    merged = rows[rows[:, 5] > 0]
    if merged.size:
        span = (merged[:, 5] - merged[:, 4]) / 1e3
        print(f"  merge span         min {span.min():7.2f}  max {span.max():7.2f}")


def main(argv: list[str]) -> None:
    print(header())
    with mock.patch.object(jit, "expand_source", _expand):
        if argv:
            batch, kv_len, kv_dtype, *split = argv
            trace(int(batch), int(kv_len), kv_dtype, int(split[0]) if split else None)
        else:
            for kv_dtype in ("bfloat16", "float8_e4m3fn"):
                trace(1, 32768, kv_dtype, None)
    cp = cupy()
    empty = cp.RawKernel('extern "C" __global__ void empty() {}', "empty")
    floor = graph_time_us(lambda: empty((256, 1, 1), (128, 1, 1), ()))
    print(f"empty kernel, 256 CTAs, graph-timed like the rows: {floor:.2f} us")


if __name__ == "__main__":
    main(sys.argv[1:])
