"""Gated activations on the GPU, three views (eager, loop, graph; bench/common.py), TB/s and %
of copy bandwidth from the graph view, FlashInfer's three views, PyTorch's graph view.
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

SHAPES = [(4096, 14336), (128, 14336), (16384, 28672 // 2)]


def main() -> Table:
    cp, fi, torch = cupy(), peer("flashinfer"), peer("torch")
    bf16 = numpy_dtype("bfloat16")
    rng = np.random.default_rng(0)
    print(header())
    table = Table("gated activations (bf16)", ["op", "rows x 2d", *VIEW_COLUMNS, "TB/s", "% copy",
                  *PEER_COLUMNS, "PyTorch graph us", "vs PyTorch"])  # fmt: skip
    for rows, d in SHAPES:
        x = cp.asarray(rng.standard_normal((rows, 2 * d)).astype(bf16))
        out = cp.empty((rows, d), dtype=bf16)
        (tx, to), is_torch = callers(x, out)
        for op in ("silu_and_mul", "gelu_tanh_and_mul"):
            ours = views(lambda: getattr(rtcinfer, op)(tx, out=to), torch_graph=is_torch)
            theirs = pt_us = None
            if is_torch:
                if fi is not None:
                    theirs = peer_views(
                        "flashinfer " + op, lambda: getattr(fi.activation, op)(tx, out=to)
                    )
                act = (torch.nn.functional.silu if op == "silu_and_mul"
                       else lambda a: torch.nn.functional.gelu(a, approximate="tanh"))  # fmt: skip
                pt_us = run_peer(
                    "torch " + op, lambda: torch.mul(act(tx[:, :d]), tx[:, d:], out=to)
                )
            tbps = (x.nbytes + out.nbytes) / ours.graph / 1e6
            table.add(op, f"{rows} x 2x{d}", *ours.cells(), tbps, 100 * tbps / copy_tbps(),
                      *peer_cells(ours, theirs), pt_us, ratio(ours.graph, pt_us))  # fmt: skip
    return table


if __name__ == "__main__":
    print(main().markdown())
