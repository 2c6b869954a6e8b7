"""RoPE (q and k in place) on the GPU, three views (eager, loop, graph; bench/common.py), TB/s
and % of copy bandwidth from the graph view, FlashInfer's three views. rtcinfer is called with
PyTorch tensors when PyTorch is installed (as FlashInfer is)."""

from __future__ import annotations

import numpy as np

import rtcinfer
from bench.common import (
    PEER_COLUMNS,
    VIEW_COLUMNS,
    Table,
    callers,
    copy_tbps,
    cupy,
    header,
    peer,
    peer_cells,
    peer_views,
    views,
)
from rtcinfer.interop.dtypes import numpy_dtype

CASES = [(16384, 32, 8, 128), (128, 32, 8, 128), (16384, 64, 8, 128), (4, 32, 8, 128)]


def main() -> Table:
    cp, fi = cupy(), peer("flashinfer")
    bf16 = numpy_dtype("bfloat16")
    rng = np.random.default_rng(0)
    print(header())
    table = Table("RoPE in place, pos_ids (bf16)", ["case", "tokens x (Hq+Hk) x D",
                  *VIEW_COLUMNS, "TB/s", "% copy", *PEER_COLUMNS])  # fmt: skip
    for nnz, hq, hk, d in CASES:
        q = cp.asarray(rng.standard_normal((nnz, hq, d)).astype(bf16))
        k = cp.asarray(rng.standard_normal((nnz, hk, d)).astype(bf16))
        pos = cp.asarray(rng.integers(0, 32768, nnz).astype(np.int32))
        (tq, tk, tp), is_torch = callers(q, k, pos)
        for name in ("apply_rope_pos_ids_inplace", "apply_llama31_rope_pos_ids_inplace"):
            ours = views(lambda: getattr(rtcinfer, name)(tq, tk, tp), torch_graph=is_torch)
            theirs = None
            if fi is not None and is_torch:
                theirs = peer_views("flashinfer " + name,
                                    lambda: getattr(fi.rope, name)(tq, tk, tp))  # fmt: skip
            tbps = 2 * (q.nbytes + k.nbytes) / ours.graph / 1e6
            label = name.removeprefix("apply_").removesuffix("_pos_ids_inplace")
            table.add(label, f"{nnz} x ({hq}+{hk}) x {d}", *ours.cells(), tbps,
                      100 * tbps / copy_tbps(), *peer_cells(ours, theirs))  # fmt: skip
    return table


if __name__ == "__main__":
    print(main().markdown())
