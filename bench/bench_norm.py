"""RMSNorm / fused_add_rmsnorm and their fp8-output forms (e4m3) on the GPU, three views (eager,
loop, graph; bench/common.py), TB/s and % of copy bandwidth from the graph view, FlashInfer's
three views, PyTorch's graph (not of the fp8 forms, which it has no one op for).
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
        fp8, scale = _fp8_out(x, is_torch, torch), _scale(is_torch, torch)
        e4m3 = {} if is_torch else {"out_dtype": "float8_e4m3fn"}
        ops = {  # op -> (our call, FlashInfer's (PyTorch tensors), bytes moved)
            "rmsnorm": (lambda: rtcinfer.rmsnorm(tx, tw, out=to),
                        lambda: fi.norm.rmsnorm(tx, tw, out=to), 2 * x.nbytes),
            "fused_add_rmsnorm": (lambda: rtcinfer.fused_add_rmsnorm(tx, tr, tw),
                                  lambda: fi.norm.fused_add_rmsnorm(tx, tr, tw), 4 * x.nbytes),
            "rmsnorm_quant": (lambda: rtcinfer.rmsnorm_quant(fp8, tx, tw, scale, **e4m3),
                              lambda: fi.norm.rmsnorm_quant(fp8, tx, tw, scale), 1.5 * x.nbytes),
            "fused_add_rmsnorm_quant": (
                lambda: rtcinfer.fused_add_rmsnorm_quant(fp8, tx, tr, tw, scale, **e4m3),
                lambda: fi.norm.fused_add_rmsnorm_quant(fp8, tx, tr, tw, scale), 3.5 * x.nbytes),
        }  # fmt: skip
        for op, (call, fi_call, nbytes) in ops.items():
            ours = views(call, torch_graph=is_torch)
            theirs, pt_us = None, None
            if is_torch:
                if fi is not None:
                    theirs = peer_views("flashinfer " + op, fi_call)
                if op == "rmsnorm":
                    pt_us = run_peer(
                        "torch rms_norm",
                        lambda: torch.nn.functional.rms_norm(tx, (hidden,), tw, 1e-6),
                    )
                elif op == "fused_add_rmsnorm":

                    def pt_fused():
                        tr.add_(tx)
                        tx.copy_(torch.nn.functional.rms_norm(tr, (hidden,), tw, 1e-6))

                    pt_us = run_peer("torch fused", pt_fused)
            tbps = nbytes / ours.graph / 1e6
            table.add(op, f"{rows} x {hidden}", *ours.cells(), tbps, 100 * tbps / copy_tbps(),
                      *peer_cells(ours, theirs), pt_us, ratio(ours.graph, pt_us))  # fmt: skip
    return table


def _fp8_out(x, is_torch: bool, torch):
    """The e4m3 output of the _quant rows: a PyTorch fp8 tensor, or CuPy uint8 storage."""
    if is_torch:
        return torch.empty(x.shape, device="cuda", dtype=torch.float8_e4m3fn)
    return cupy().empty(x.shape, np.uint8)


def _scale(is_torch: bool, torch):
    """The _quant rows' scale: a float32 array of one element, on the device."""
    if is_torch:
        return torch.full((1,), 0.05, device="cuda")
    return cupy().full((1,), 0.05, np.float32)


if __name__ == "__main__":
    print(main().markdown())
