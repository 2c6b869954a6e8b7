"""Host time per call when every call brings a new token count, as an eager engine's prefill
steps do: bench_overhead's calls repeat one signature, which rtcinfer prepares once; here each
call slices its arrays to a row count not seen before (rtcinfer makes it from a prepared call
of another count, interop/call.py), beside FlashInfer and PyTorch on the same slices. Wall time
of `CALLS` calls / `CALLS`, the least of 5 rounds, a row's cells timed in turn in each round,
each round on counts of its own (PyTorch tensors; no sync between calls, so the GPU's few
microseconds a kernel overlap the next call's host work). The last row is an eager prefill
step's view: LAYERS layers each calling every op on the step's new count (the first layer
pays for the new count, the others repeat it), per op call.

    python -m bench.bench_new_counts
"""

from __future__ import annotations

import time
from collections.abc import Callable

import rtcinfer
from bench.common import Table, header, peer

CALLS, ROUNDS = 300, 5
FIRST = 2  # counts from here: each (cell, round) takes CALLS new ones
ROWS = FIRST + CALLS * ROUNDS


def _cells(torch, fi) -> dict[str, dict[str, Callable[[int], object]]]:
    """row -> {cell: call(n)} on slices of n rows."""
    bf16 = torch.bfloat16

    def randn(*shape, dtype=bf16):
        return torch.randn(*shape, device="cuda").to(dtype)

    x, r, w = randn(ROWS, 4096), randn(ROWS, 4096), randn(4096)
    gate = randn(ROWS, 2 * 4096)
    q, k = randn(ROWS, 32, 128), randn(ROWS, 8, 128)
    pos = torch.arange(ROWS, device="cuda", dtype=torch.int32)
    cache = randn(ROWS // 16 + 2, 2, 16, 8, 128)
    indices = torch.arange(cache.shape[0], device="cuda", dtype=torch.int32)
    indptr = torch.tensor([0, cache.shape[0]], device="cuda", dtype=torch.int32)
    last = torch.tensor([16], device="cuda", dtype=torch.int32)
    batch = torch.zeros(ROWS, device="cuda", dtype=torch.int32)
    rows = {
        "rmsnorm n x 4096": {
            "rtcinfer": lambda n: rtcinfer.rmsnorm(x[:n], w),
            "flashinfer": fi and (lambda n: fi.norm.rmsnorm(x[:n], w)),
            "pytorch": lambda n: torch.nn.functional.rms_norm(x[:n], (4096,), w),
        },
        "fused_add_rmsnorm n x 4096": {
            "rtcinfer": lambda n: rtcinfer.fused_add_rmsnorm(x[:n], r[:n], w),
            "flashinfer": fi and (lambda n: fi.norm.fused_add_rmsnorm(x[:n], r[:n], w)),
        },
        "silu_and_mul n x 4096": {
            "rtcinfer": lambda n: rtcinfer.silu_and_mul(gate[:n]),
            "flashinfer": fi and (lambda n: fi.activation.silu_and_mul(gate[:n])),
        },
        "apply_rope_pos_ids_inplace n tokens": {
            "rtcinfer": lambda n: rtcinfer.apply_rope_pos_ids_inplace(q[:n], k[:n], pos[:n]),
            "flashinfer": fi and (lambda n: fi.rope.apply_rope_pos_ids_inplace(q[:n], k[:n],
                                                                               pos[:n])),
        },
        "append_paged_kv_cache n tokens": {
            "rtcinfer": lambda n: rtcinfer.append_paged_kv_cache(
                k[:n], k[:n], batch[:n], pos[:n], cache, indices, indptr, last),
            "flashinfer": fi and (lambda n: fi.page.append_paged_kv_cache(
                k[:n], k[:n], batch[:n], pos[:n], cache, indices, indptr, last)),
        },
    }  # fmt: skip
    rows = {name: {c: f for c, f in cells.items() if f} for name, cells in rows.items()}
    sides = [c for c in ("rtcinfer", "flashinfer") if all(c in row for row in rows.values())]
    step = {c: _step([row[c] for row in rows.values()]) for c in sides}
    return rows, step


LAYERS = 32  # an eager prefill step's layers, each calling every op of the table on its count


def _step(calls: list[Callable[[int], object]]) -> Callable[[int], None]:
    def step(n: int) -> None:
        for _ in range(LAYERS):
            for call in calls:
                call(n)

    return step


def time_row(cells: dict[str, Callable[[int], object]], sync: Callable[[], object]) -> dict:
    """The least over ROUNDS of the wall time of CALLS calls / CALLS per cell, microseconds;
    round r of every cell on counts FIRST + r * CALLS onwards, new to rtcinfer's caches (the
    warmup's counts, 1 and ROWS, lie outside them; the cells' caches are their own)."""
    best = dict.fromkeys(cells, float("inf"))
    for fn in cells.values():  # warmup: the kernels loaded, FlashInfer's JIT built
        fn(1)
        fn(ROWS)
    sync()
    for r in range(ROUNDS):
        counts = range(FIRST + r * CALLS, FIRST + (r + 1) * CALLS)
        for name, fn in cells.items():
            start = time.perf_counter()
            for n in counts:
                fn(n)
            sync()
            best[name] = min(best[name], (time.perf_counter() - start) / CALLS * 1e6)
    return best


def main() -> Table:
    torch, fi = peer("torch"), peer("flashinfer")
    print(header())
    table = Table(
        f"host time per call, a new token count each call (wall time of {CALLS} calls)",
        ["call", "rtcinfer us", "FlashInfer us", "PyTorch us", "FlashInfer / rtcinfer"],
    )
    if torch is None:
        print("# needs PyTorch (the engines this row is about call with its tensors)")
        return table
    rows, step = _cells(torch, fi)
    for name, cells in rows.items():
        t = time_row(cells, torch.cuda.synchronize)
        ours, theirs = t.get("rtcinfer"), t.get("flashinfer")
        ratio = f"{theirs / ours:.2f}x" if ours and theirs else ""
        table.add(name, ours, theirs, t.get("pytorch"), ratio)
    # an engine's step: every layer repeats the step's count, so a new count is paid once an
    # op and step, then the cached call (the row: per op call, the step's time / its calls)
    t = time_row(step, torch.cuda.synchronize)
    per_call = {c: v / (LAYERS * len(rows)) for c, v in t.items()}
    ours, theirs = per_call.get("rtcinfer"), per_call.get("flashinfer")
    ratio = f"{theirs / ours:.2f}x" if ours and theirs else ""
    table.add(f"a prefill step, {LAYERS} layers of the {len(rows)} ops above, per call", ours,
              theirs, None, ratio)  # fmt: skip
    return table


if __name__ == "__main__":
    print(main().markdown())
