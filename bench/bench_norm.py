"""RMSNorm / fused_add_rmsnorm on the GPU, three views (eager, loop, graph; bench/common.py),
TB/s and % of copy bandwidth from the graph view, FlashInfer's three views, PyTorch's graph.
rtcinfer is called with PyTorch tensors when PyTorch is installed (as FlashInfer is)."""

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
    ratio,
    run_peer,
    views,
)
from rtcinfer.interop.dtypes import numpy_dtype

SHAPES = [(4096, 8192), (128, 8192), (4096, 4096), (16384, 16384)]


def main() -> Table:
    cp, fi, torch = cupy(), peer("flashinfer"), peer("torch")
    bf16 = numpy_dtype("bfloat16")
    rng = np.random.default_rng(0)
    print(header())
    columns = ["op", "rows x hidden", *VIEW_COLUMNS, "TB/s", "% copy", *PEER_COLUMNS,
               "PyTorch graph us", "vs PyTorch"]  # fmt: skip
    table = Table("norm (bf16)", columns)
    for rows, hidden in SHAPES:
        x = cp.asarray(rng.standard_normal((rows, hidden)).astype(bf16))
        r = cp.asarray(rng.standard_normal((rows, hidden)).astype(bf16))
        w = cp.asarray(rng.standard_normal(hidden).astype(bf16))
        out = cp.empty_like(x)
        (tx, tr, tw, to), is_torch = callers(x, r, w, out)
        for op in ("rmsnorm", "fused_add_rmsnorm"):
            if op == "rmsnorm":
                ours = views(lambda: rtcinfer.rmsnorm(tx, tw, out=to), torch_graph=is_torch)
                nbytes = 2 * x.nbytes
            else:
                ours = views(lambda: rtcinfer.fused_add_rmsnorm(tx, tr, tw), torch_graph=is_torch)
                nbytes = 4 * x.nbytes
            theirs, pt_us = None, None
            if is_torch:
                if fi is not None:
                    fi_fn = (
                        (lambda: fi.norm.rmsnorm(tx, tw, out=to))
                        if op == "rmsnorm"
                        else (lambda: fi.norm.fused_add_rmsnorm(tx, tr, tw))
                    )
                    theirs = peer_views("flashinfer " + op, fi_fn)
                if op == "rmsnorm":
                    pt_us = run_peer(
                        "torch rms_norm",
                        lambda: torch.nn.functional.rms_norm(tx, (hidden,), tw, 1e-6),
                    )
                else:

                    def pt_fused():
                        tr.add_(tx)
                        tx.copy_(torch.nn.functional.rms_norm(tr, (hidden,), tw, 1e-6))

                    pt_us = run_peer("torch fused", pt_fused)
            tbps = nbytes / ours.graph / 1e6
            table.add(op, f"{rows} x {hidden}", *ours.cells(), tbps, 100 * tbps / copy_tbps(),
                      *peer_cells(ours, theirs), pt_us, ratio(ours.graph, pt_us))  # fmt: skip
    return table


if __name__ == "__main__":
    print(main().markdown())
