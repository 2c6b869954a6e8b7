"""top_k on the GPU, three views (eager, loop, graph; bench/common.py), TB/s from the graph view
(one read of the row: the select passes mostly hit L2), beside FlashInfer's top_k and
torch.topk in the same process. Rows of N(0, 1) * 4 logits (bf16 and fp32), unsorted and
sorted. rtcinfer is called with PyTorch tensors when PyTorch is installed (as FlashInfer is).

    python -m bench.bench_topk
"""

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

# (batch, vocab, k, dtype)
CASES = [
    (1, 128256, 50, "float32"),
    (64, 128256, 50, "float32"),
    (64, 151936, 1024, "bfloat16"),
    (512, 32000, 256, "float32"),
    (16, 65536, 2048, "bfloat16"),  # a sparse-attention indexer's shape
]


def main() -> Table:
    cp, fi, torch = cupy(), peer("flashinfer"), peer("torch")
    rng = np.random.default_rng(0)
    print(header())
    table = Table("top_k (values and indices)", ["case", "sorted", *VIEW_COLUMNS, "TB/s",
                  "% copy", *PEER_COLUMNS, "torch.topk graph us"])  # fmt: skip
    for batch, vocab, k, dtype in CASES:
        x = cp.asarray((rng.standard_normal((batch, vocab)) * 4).astype(numpy_dtype(dtype)))
        (tx,), is_torch = callers(x)
        for ordered in (False, True):
            ours = views(lambda: rtcinfer.top_k(tx, k, sorted=ordered), torch_graph=is_torch)
            theirs = None
            if fi is not None and is_torch:
                theirs = peer_views("flashinfer top_k",
                                    lambda: fi.top_k(tx, k, sorted=ordered))  # fmt: skip
            topk = None
            if torch is not None and is_torch:
                topk = peer_views("torch.topk", lambda: torch.topk(tx, k, sorted=ordered))
            tbps = x.nbytes / ours.graph / 1e6
            table.add(f"{batch} x {vocab}, k {k}, {dtype}", ordered, *ours.cells(), tbps,
                      100 * tbps / copy_tbps(), *peer_cells(ours, theirs),
                      None if topk is None else topk.graph)  # fmt: skip
    return table


if __name__ == "__main__":
    print(main().markdown())
