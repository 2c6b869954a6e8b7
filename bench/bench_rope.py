"""RoPE (q and k in place) on the GPU: us, TB/s, % of copy bandwidth, FlashInfer."""

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

CASES = [(16384, 32, 8, 128), (128, 32, 8, 128), (16384, 64, 8, 128)]


def main() -> Table:
    cp, fi, torch = cupy(), peer("flashinfer"), peer("torch")
    bf16 = numpy_dtype("bfloat16")
    rng = np.random.default_rng(0)
    print(header())
    table = Table("RoPE in place, pos_ids (bf16)", ["case", "tokens x (Hq+Hk) x D", "us", "TB/s",
                  "% copy", "FlashInfer us", "vs FlashInfer"])  # fmt: skip
    for nnz, hq, hk, d in CASES:
        q = cp.asarray(rng.standard_normal((nnz, hq, d)).astype(bf16))
        k = cp.asarray(rng.standard_normal((nnz, hk, d)).astype(bf16))
        pos = cp.asarray(rng.integers(0, 32768, nnz).astype(np.int32))
        for name in ("apply_rope_pos_ids_inplace", "apply_llama31_rope_pos_ids_inplace"):
            ours = graph_time_us(lambda: getattr(rtcinfer, name)(q, k, pos))
            fi_us = None
            if fi is not None and torch is not None:
                tq, tk, tp = torch_view(q), torch_view(k), torch_view(pos)
                fi_us = run_peer("flashinfer " + name, lambda: getattr(fi.rope, name)(tq, tk, tp))
            tbps = 2 * (q.nbytes + k.nbytes) / ours / 1e6
            label = name.removeprefix("apply_").removesuffix("_pos_ids_inplace")
            table.add(label, f"{nnz} x ({hq}+{hk}) x {d}", ours, tbps, 100 * tbps / copy_tbps(),
                      fi_us, ratio(ours, fi_us))  # fmt: skip
    return table


if __name__ == "__main__":
    print(main().markdown())
