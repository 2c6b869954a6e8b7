"""Gated activations on the GPU: us, TB/s, % of copy bandwidth, FlashInfer, PyTorch."""

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

SHAPES = [(4096, 14336), (128, 14336), (16384, 28672 // 2)]


def main() -> Table:
    cp, fi, torch = cupy(), peer("flashinfer"), peer("torch")
    bf16 = numpy_dtype("bfloat16")
    rng = np.random.default_rng(0)
    print(header())
    table = Table("gated activations (bf16)", ["op", "rows x 2d", "us", "TB/s", "% copy",
                  "FlashInfer us", "vs FlashInfer", "PyTorch us", "vs PyTorch"])  # fmt: skip
    for rows, d in SHAPES:
        x = cp.asarray(rng.standard_normal((rows, 2 * d)).astype(bf16))
        out = cp.empty((rows, d), dtype=bf16)
        for op in ("silu_and_mul", "gelu_tanh_and_mul"):
            ours = graph_time_us(lambda: getattr(rtcinfer, op)(x, out=out))
            fi_us = pt_us = None
            if torch is not None:
                tx, to = torch_view(x), torch_view(out)
                if fi is not None:
                    fi_us = run_peer(
                        "flashinfer " + op, lambda: getattr(fi.activation, op)(tx, out=to)
                    )
                act = (torch.nn.functional.silu if op == "silu_and_mul"
                       else lambda a: torch.nn.functional.gelu(a, approximate="tanh"))  # fmt: skip
                pt_us = run_peer(
                    "torch " + op, lambda: torch.mul(act(tx[:, :d]), tx[:, d:], out=to)
                )
            tbps = (x.nbytes + out.nbytes) / ours / 1e6
            table.add(op, f"{rows} x 2x{d}", ours, tbps, 100 * tbps / copy_tbps(), fi_us,
                      ratio(ours, fi_us), pt_us, ratio(ours, pt_us))  # fmt: skip
    return table


if __name__ == "__main__":
    print(main().markdown())
