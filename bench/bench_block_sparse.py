"""Block-sparse attention on the GPU, three views (eager, loop, graph; bench/common.py) and
TFLOP/s over the kept entries (4 D flops a kept query-key pair and query head), beside
FlashInfer's BlockSparseAttentionWrapper and VariableBlockSparseAttentionWrapper (its prefill
over the same pages) in the same process. bf16, Hq 32, Hkv 8, D 128; rtcinfer is called with
PyTorch tensors when PyTorch is installed (as FlashInfer is)."""

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

HQ, HKV, D = 32, 8, 128
# label, M = N, R, C, share of the blocks kept, share of a kept block's entries unmasked
ROWS = [
    ("4096, 64 x 64 blocks, 25% kept", 4096, 64, 64, 0.25, None),
    ("16384, 128 x 128 blocks, 10% kept", 16384, 128, 128, 0.10, None),
    ("4096, 16 x 16 blocks, 30% kept", 4096, 16, 16, 0.30, None),
    ("8192, 64 x 64 blocks, 20% kept, masked 50%", 8192, 64, 64, 0.20, 0.5),
]


def pattern(rng, n: int, R: int, C: int, density: float):
    keep = rng.random((n // R, n // C)) < density
    indptr = np.concatenate([[0], np.cumsum(keep.sum(1))]).astype(np.int32)
    indices = np.concatenate([np.flatnonzero(r) for r in keep]).astype(np.int32)
    return indptr, indices


def flashinfer_views(fi, torch, plan_args, mask, q, k, v):
    """FlashInfer's three views over the same pattern (None when it fails)."""
    t = lambda a: torch.from_dlpack(a)  # noqa: E731
    indptr, indices, *rest = plan_args
    try:
        wrapper = fi.sparse.BlockSparseAttentionWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))  # fmt: skip
        wrapper.plan(torch.from_numpy(indptr).cuda(), torch.from_numpy(indices).cuda(), *rest,
                     mask=None if mask is None else torch.from_numpy(mask).cuda(),
                     q_data_type=torch.bfloat16, o_data_type=torch.bfloat16)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a peer failing must not stop the bench
        print(f"# flashinfer block-sparse wrapper failed: {type(e).__name__}: {str(e)[:200]}")
        return None
    tq, tk, tv = t(q), t(k), t(v)
    return peer_views("flashinfer block sparse", lambda: wrapper.run(tq, tk, tv))


def main() -> Tables:
    fi, torch = peer("flashinfer"), peer("torch")
    rng = np.random.default_rng(0)
    print(header())
    columns = ["case", *VIEW_COLUMNS, "TFLOP/s", *PEER_COLUMNS]
    table = Table("block-sparse attention (bf16, Hq 32, Hkv 8, D 128)", columns)
    bsr_rows(table, (fi, torch), rng)
    variable = Table("variable block-sparse attention (bf16, Hq 32, Hkv 8, D 128)", columns)
    variable_rows(variable, (fi, torch), rng)
    return Tables([table, variable])


def bsr_rows(table: Table, peers, rng) -> None:
    fi, torch = peers
    for label, n, R, C, density, unmasked in ROWS:
        indptr, indices = pattern(rng, n, R, C, density)
        mask = None if unmasked is None else rng.random((indices.size, R, C)) < unmasked
        q = random_cache((n, HQ, D), "bfloat16")
        k, v = random_cache((n, HKV, D), "bfloat16"), random_cache((n, HKV, D), "bfloat16")
        plan_args = (indptr, indices, n, n, R, C, HQ, HKV, D)
        wrapper = rtcinfer.BlockSparseAttentionWrapper()
        wrapper.plan(*plan_args, mask=mask, q_data_type="bfloat16", o_data_type="bfloat16")
        (tq, tk, tv), is_torch = callers(q, k, v)
        ours = views(lambda: wrapper.run(tq, tk, tv), torch_graph=is_torch)
        pairs = indices.size * R * C if mask is None else int(mask.sum())
        tflops = 4 * D * HQ * pairs / ours.graph / 1e6
        theirs = None
        if fi is not None and torch is not None:
            theirs = flashinfer_views(fi, torch, plan_args, mask, q, k, v)
        table.add(label, *ours.cells(), tflops, *peer_cells(ours, theirs))


# label, L = Lk, row and column blocks a kv head (sizes varying around L / blocks), share kept
VARIABLE_ROWS = [
    ("4096, 64 x 64 blocks a head, 20% kept", 4096, 64, 0.20),
    ("16384, 128 x 128 blocks a head, 10% kept", 16384, 128, 0.10),
]


def variable_rows(table: Table, peers, rng) -> None:
    fi, torch = peers
    for label, n, blocks, density in VARIABLE_ROWS:
        sizes = [_varying(rng, n, blocks) for _ in range(2 * HKV)]
        rows, cols = np.stack(sizes[:HKV]), np.stack(sizes[HKV:])
        keep = rng.random((HKV, blocks, blocks)) < density
        q = random_cache((HQ, n, D), "bfloat16")
        k, v = random_cache((HKV, n, D), "bfloat16"), random_cache((HKV, n, D), "bfloat16")
        wrapper = rtcinfer.VariableBlockSparseAttentionWrapper()
        wrapper.plan(keep, rows, cols, HQ, HKV, D, q_data_type="bfloat16")
        (tq, tk, tv), is_torch = callers(q, k, v)
        ours = views(lambda: wrapper.run(tq, tk, tv), torch_graph=is_torch)
        pairs = sum(int(rows[h] @ keep[h] @ cols[h]) for h in range(HKV)) * (HQ // HKV)
        tflops = 4 * D * pairs / ours.graph / 1e6
        theirs = None
        if fi is not None and torch is not None:
            theirs = flashinfer_variable(fi, torch, (keep, rows, cols), q, k, v)
        table.add(label, *ours.cells(), tflops, *peer_cells(ours, theirs))


def _varying(rng, total: int, blocks: int) -> np.ndarray:
    """`blocks` sizes of at least 1 adding up to `total`, varying about total / blocks."""
    cuts = np.sort(rng.choice(np.arange(1, total), blocks - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]]))


def flashinfer_variable(fi, torch, pattern, q, k, v):
    """FlashInfer's variable wrapper's three views over the same pattern (None if it fails)."""
    keep, rows, cols = (torch.from_numpy(a).cuda() for a in pattern)
    try:
        wrapper = fi.sparse.VariableBlockSparseAttentionWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))  # fmt: skip
        wrapper.plan(keep, rows.int(), cols.int(), HQ, HKV, D, q_data_type=torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - a peer failing must not stop the bench
        print(f"# flashinfer variable block-sparse wrapper failed: {type(e).__name__}: "
              f"{str(e)[:200]}")  # fmt: skip
        return None
    tq, tk, tv = (torch.from_dlpack(a) for a in (q, k, v))
    return peer_views("flashinfer variable", lambda: wrapper.run(tq, tk, tv))


if __name__ == "__main__":
    print(main().markdown())
