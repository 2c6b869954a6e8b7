"""RoPE with fp8 outputs on the GPU, three views (eager, loop, graph; bench/common.py), TB/s and
% of copy bandwidth from the graph view (bytes read and written once), FlashInfer's three
views: rope_quantize_fp8 (GQA, q and k wholly rotary; MLA, rope 64 + nope 512) and
rope_quantize_fp8_append_paged_kv_cache (GQA NHD cache, page 16; MLA's latent cache). rtcinfer
is called with PyTorch tensors when PyTorch is installed (as FlashInfer is)."""

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

# (label, tokens, Hq, Hk (None: MLA), rope dims, nope dims)
CASES = [
    ("gqa decode", 64, 32, 8, 128, 0),
    ("gqa prefill", 8192, 32, 8, 128, 0),
    ("mla decode", 64, 128, None, 64, 512),
    ("mla prefill", 4096, 16, None, 64, 512),
]
PAGE = 16


def _inputs(cp, rng, nnz, hq, hk, rope, nope):
    bf16 = numpy_dtype("bfloat16")

    def rand(*shape):
        return cp.asarray(rng.standard_normal(shape).astype(bf16))

    k_lead = (nnz,) if hk is None else (nnz, hk)
    q, k = rand(nnz, hq, rope), rand(*k_lead, rope)
    qn, kn = (rand(nnz, hq, nope), rand(*k_lead, nope)) if nope else (None, None)
    angle = rng.uniform(0, 2 * np.pi, (32768, rope // 2))
    table = cp.asarray(np.concatenate([np.cos(angle), np.sin(angle)], 1).astype(np.float32))
    pos = cp.asarray(rng.integers(0, 32768, nnz).astype(np.int32))
    return q, k, qn, kn, table, pos


def _cache(cp, rng, nnz, hk, rope, nope):
    """(v, the caches, kv_indices, kv_indptr, batch_indices, positions): each token its own
    request, at position 0 of a page of its own (permuted)."""
    pages = rng.permutation(nnz).astype(np.int32)
    if hk is None:
        caches = (cp.zeros((nnz, PAGE, nope), cp.uint8), cp.zeros((nnz, PAGE, rope), cp.uint8))
        v = None
    else:
        shape = (nnz, PAGE, hk, rope + nope)
        caches = (cp.zeros(shape, cp.uint8), cp.zeros(shape, cp.uint8))
        v = cp.asarray(rng.standard_normal((nnz, hk, rope + nope)).astype(numpy_dtype("bfloat16")))
    table = (cp.asarray(pages), cp.arange(nnz + 1, dtype=cp.int32), cp.arange(nnz, dtype=cp.int32),
             cp.zeros(nnz, cp.int32))  # fmt: skip
    return v, caches, table


def main() -> Table:
    cp, fi = cupy(), peer("flashinfer")
    rng = np.random.default_rng(0)
    print(header())
    table = Table("RoPE with fp8 outputs (bf16 in, e4m3 out)", ["case", "tokens x heads",
                  *VIEW_COLUMNS, "TB/s", "% copy", *PEER_COLUMNS])  # fmt: skip
    for label, nnz, hq, hk, rope, nope in CASES:
        q, k, qn, kn, cos_sin, pos = _inputs(cp, rng, nnz, hq, hk, rope, nope)
        v, caches, tbl = _cache(cp, rng, nnz, hk, rope, nope)
        arrays, is_torch = callers(q, k, qn, kn, cos_sin, pos, v, *caches, *tbl)
        tq, tk, tqn, tkn, tcs, tpos, tv, c0, c1, *ttbl = arrays
        if is_torch:  # fp8 caches as PyTorch sees them
            import torch

            c0, c1 = c0.view(torch.float8_e4m3fn), c1.view(torch.float8_e4m3fn)
        heads = f"{nnz} x ({hq}+{hk or 1})"
        moved = sum(a.nbytes for a in (q, k, qn, kn) if a is not None)
        moved += moved // 2  # read 16-bit, written fp8
        plain_kw = {"quantize_dtype": "float8_e4m3fn"}
        ours = views(lambda: rtcinfer.rope_quantize_fp8(tq, tk, tqn, tkn, tcs, tpos, **plain_kw),
                     torch_graph=is_torch)  # fmt: skip
        theirs = None
        if fi is not None and is_torch:
            theirs = peer_views(
                "flashinfer rope_quantize_fp8",
                lambda: fi.rope.rope_quantize_fp8(tq, tk, tqn, tkn, tcs, tpos),
            )
        tbps = moved / ours.graph / 1e6
        table.add(f"{label}: rope_quantize_fp8", heads, *ours.cells(), tbps,
                  100 * tbps / copy_tbps(), *peer_cells(ours, theirs))  # fmt: skip
        append_args = (tq, tk, tqn, tkn, tv, tcs, tpos, (c0, c1), *ttbl)
        append_kw = {"page_size": PAGE, "quantize_dtype": "float8_e4m3fn"}
        ours = views(lambda: rtcinfer.rope_quantize_fp8_append_paged_kv_cache(*append_args,
                                                                               **append_kw),
                     torch_graph=is_torch)  # fmt: skip
        theirs = None
        if fi is not None and is_torch:
            theirs = peer_views(
                "flashinfer rope_quantize_fp8_append_paged_kv_cache",
                lambda: fi.rope.rope_quantize_fp8_append_paged_kv_cache(
                    *append_args, page_size=PAGE),
            )  # fmt: skip
        moved_v = 0 if v is None else v.nbytes * 3 // 2
        tbps = (moved + moved_v) / ours.graph / 1e6
        table.add(f"{label}: append", heads, *ours.cells(), tbps, 100 * tbps / copy_tbps(),
                  *peer_cells(ours, theirs))  # fmt: skip
    return table


if __name__ == "__main__":
    print(main().markdown())
