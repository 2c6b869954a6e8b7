"""RMSNorm / fused_add_rmsnorm on the GPU: us, TB/s, % of copy bandwidth, FlashInfer, PyTorch."""

from __future__ import annotations

import numpy as np

import rtcinfer
from bench.common import (
    Table,
    copy_tbps,
    cupy,
    graph_time_us,
    header,
    peer,
    ratio,
    run_peer,
    torch_view,
)
from rtcinfer.interop.dtypes import numpy_dtype

SHAPES = [(4096, 8192), (128, 8192), (4096, 4096), (16384, 16384)]


def main() -> Table:
    cp, fi, torch = cupy(), peer("flashinfer"), peer("torch")
    bf16 = numpy_dtype("bfloat16")
    rng = np.random.default_rng(0)
    print(header())
    columns = ["op", "rows x hidden", "us", "TB/s", "% copy"]
    columns += ["FlashInfer us", "vs FlashInfer", "PyTorch us", "vs PyTorch"]
    table = Table("norm (bf16)", columns)
    for rows, hidden in SHAPES:
        x = cp.asarray(rng.standard_normal((rows, hidden)).astype(bf16))
        r = cp.asarray(rng.standard_normal((rows, hidden)).astype(bf16))
        w = cp.asarray(rng.standard_normal(hidden).astype(bf16))
        out = cp.empty_like(x)
        for op in ("rmsnorm", "fused_add_rmsnorm"):
            if op == "rmsnorm":
                ours = graph_time_us(lambda: rtcinfer.rmsnorm(x, w, out=out))
                nbytes = 2 * x.nbytes
            else:
                ours = graph_time_us(lambda: rtcinfer.fused_add_rmsnorm(x, r, w))
                nbytes = 4 * x.nbytes
            fi_us = pt_us = None
            if torch is not None:
                tx, tr, tw, to = (torch_view(a) for a in (x, r, w, out))
                if fi is not None:
                    fi_fn = (
                        (lambda: fi.norm.rmsnorm(tx, tw, out=to))
                        if op == "rmsnorm"
                        else (lambda: fi.norm.fused_add_rmsnorm(tx, tr, tw))
                    )
                    fi_us = run_peer("flashinfer " + op, fi_fn)
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
            tbps = nbytes / ours / 1e6
            table.add(op, f"{rows} x {hidden}", ours, tbps, 100 * tbps / copy_tbps(),
                      fi_us, ratio(ours, fi_us), pt_us, ratio(ours, pt_us))  # fmt: skip
    return table


if __name__ == "__main__":
    print(main().markdown())
