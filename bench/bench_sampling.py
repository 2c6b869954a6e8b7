"""Sorting-free sampling on the GPU: us per call in three views (eager, loop, graph; see
bench/common.py; rtcinfer called with PyTorch tensors when PyTorch is installed), effective
TB/s over one read of the probabilities (graph view), and the ratio to sort-based sampling
measured in the same run: CuPy argsort + cumsum + draw (event-timed eagerly, so it includes
~10 Python launches) and, when importable, the same in PyTorch (graph-timed: kernel time) and
FlashInfer. Also the cold-start compile time of the sampling kernels (a fresh cache directory,
NVRTC only).

Probabilities: softmax(3 * N(0, 1)) rows in fp32 (top-p 0.9 keeps ~3-7% of a 128K vocabulary).
Rejection sampling takes a random number of rounds, so one (seed, offset) times one outcome; at
batch 1, where a round is a visible part of the time, the mean over 16 offsets is shown too.

A second table times the exact-threshold ops (top_k_renorm_probs, top_p_renorm_probs,
top_k_mask_logits), softmax and the samplers from logits in three views, on softmax(3 N(0, 1))
rows and on U(0, 1)^8 rows (flat: top-p 0.9 keeps most of the vocabulary, so the threshold is
found over the whole row, not over a short candidate list).

Usage: python -m bench.bench_sampling [vocab ...]   (default: 32000 128256 151936)
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

import rtcinfer
from bench.common import (
    PEER_COLUMNS,
    VIEW_COLUMNS,
    Table,
    Tables,
    callers,
    copy_tbps,
    cupy,
    graph_time_us,
    header,
    peer,
    peer_cells,
    peer_views,
    ratio,
    run_peer,
    time_us,
    torch_view,
    views,
)
from rtcinfer import gpu, jit
from rtcinfer.layout import widest_vec
from rtcinfer.sampling import sample_spec
from rtcinfer.sampling.cluster import ClusterSampleSpec, cluster_size
from rtcinfer.sampling.renorm import renorm_spec
from rtcinfer.sampling.softmax import softmax_spec

BATCHES = (1, 32, 128, 512)
VOCABS = (32000, 128256, 151936)
TOP_K, TOP_P, MIN_P = 50, 0.9, 0.1
OFFSETS = 16  # batch 1 is also timed at this many offsets (draws), and averaged
OPS = {  # name -> (sampler, kwargs, rtcinfer op)
    "top-k": (rtcinfer.top_k_sampling_from_probs, {"top_k": TOP_K}, "top_k"),
    "top-p": (rtcinfer.top_p_sampling_from_probs, {"top_p": TOP_P}, "top_p"),
    "top-k+top-p": (
        rtcinfer.top_k_top_p_sampling_from_probs,
        {"top_k": TOP_K, "top_p": TOP_P},
        "top_k_first",
    ),  # fmt: skip
    "top-k+top-p joint": (
        rtcinfer.top_k_top_p_sampling_from_probs,
        {"top_k": TOP_K, "top_p": TOP_P, "filter_apply_order": "joint"},
        "top_k_top_p",
    ),  # fmt: skip
    "min-p": (rtcinfer.min_p_sampling_from_probs, {"min_p": MIN_P}, "min_p"),
}


def sort_based(xp, probs, u, top_k=0, top_p=1.0, min_p=0.0):
    """The textbook sampler: sort each row, filter the sorted prefix, draw by inverse transform.
    xp: the cupy or torch module; probs [batch, vocab], u [batch] uniforms."""
    if xp.__name__ == "torch":
        sorted_p, order = xp.sort(probs, dim=1, descending=True)
    else:
        order = xp.argsort(-probs, axis=1)
        sorted_p = xp.take_along_axis(probs, order, axis=1)
    if top_k:
        sorted_p[:, top_k:] = 0
    if top_p < 1:
        cdf = xp.cumsum(sorted_p, 1)
        sorted_p = sorted_p * ((cdf - sorted_p) < top_p * cdf[:, -1:])
    if min_p:
        sorted_p = sorted_p * (sorted_p >= min_p * sorted_p[:, :1])
    cdf = xp.cumsum(sorted_p, 1)
    hit = cdf > u[:, None] * cdf[:, -1:]
    if xp.__name__ == "torch":
        return order.gather(1, hit.int().argmax(1, keepdim=True))
    return xp.take_along_axis(order, hit.astype(xp.int32).argmax(axis=1)[:, None], axis=1)


def cold_compile_seconds(arch: str) -> tuple[float, int]:
    """NVRTC time of every sampling kernel this sweep uses, from an empty cache."""
    specs = {sample_spec(op, "float32", v, b) for _, _, op in OPS.values()
             for v in VOCABS for b in BATCHES}  # fmt: skip
    for v in VOCABS:  # the small batches' cluster kernels (on a 132-SM sm_90 GPU)
        vec = widest_vec(v, 4)
        sizes = {cluster_size(b, v, vec, 132, 90) for b in BATCHES} - {0}
        specs |= {ClusterSampleSpec(op, "float32", "int32", vec, c)
                  for _, _, op in OPS.values() for c in sizes}  # fmt: skip
    specs |= {renorm_spec(op, "float32", 128256) for op in ("top_k_renorm", "top_p_renorm")}
    specs |= {softmax_spec("float32", 128256)}
    previous = os.environ.get("RTCINFER_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["RTCINFER_CACHE_DIR"] = tmp
        try:
            start = time.perf_counter()
            for spec in specs:
                jit.compile_spec(spec, arch)
            return time.perf_counter() - start, len(specs)
        finally:
            if previous is None:
                os.environ.pop("RTCINFER_CACHE_DIR")
            else:
                os.environ["RTCINFER_CACHE_DIR"] = previous


def main(vocabs: tuple[int, ...] = VOCABS) -> Tables:
    cp, fi, torch = cupy(), peer("flashinfer"), peer("torch")
    print(header())
    arch = gpu.compile_arch(cp.cuda.Device().id)
    seconds, count = cold_compile_seconds(arch)
    print(f"cold start: {count} sampling kernels compiled by NVRTC for {arch} in {seconds:.1f} s")
    columns = ["op", "batch x vocab", *VIEW_COLUMNS, f"graph us, mean of {OFFSETS} offsets",
               "TB/s", "% copy", "CuPy sort us (eager)"]  # fmt: skip
    columns += ["vs CuPy sort", "torch sort us", "vs torch sort", "FlashInfer us", "vs FlashInfer"]
    table = Table("sorting-free sampling (fp32 probs, softmax(3 N(0,1)))", columns)
    for vocab in vocabs:
        for batch in BATCHES:
            logits = cp.random.standard_normal((batch, vocab), dtype=np.float32) * 3
            probs = rtcinfer.softmax(logits)
            u = cp.random.random(batch, dtype=np.float32)
            out = cp.empty(batch, cp.int32)
            (t_probs, t_out), is_torch = callers(probs, out)
            for name, (fn, kwargs, _) in OPS.items():
                seen = views(lambda: fn(t_probs, **kwargs, seed=1, offset=2, out=t_out),
                             torch_graph=is_torch)  # fmt: skip
                ours = seen.graph
                mean = ""  # batch 1: the rejection rounds vary with the draw; their mean cost
                if batch == 1:
                    mean = float(np.mean([
                        graph_time_us(lambda o=o: fn(probs, **kwargs, seed=1, offset=o, out=out),
                                      repeat=10) for o in range(OFFSETS)]))  # fmt: skip
                filt = {k: v for k, v in kwargs.items() if k != "filter_apply_order"}
                sort_us = time_us(lambda: sort_based(cp, probs, u, **filt))
                torch_us = fi_us = None
                if torch is not None:
                    tp, tu = torch_view(probs), torch_view(u)
                    torch_us = run_peer("torch sort", lambda: sort_based(torch, tp, tu, **filt))
                    if fi is not None:
                        fi_us = run_peer("flashinfer " + name,
                                         lambda: flashinfer_call(fi, name, tp))  # fmt: skip
                tbps = probs.nbytes / ours / 1e6
                table.add(name, f"{batch} x {vocab}", *seen.cells(), mean, tbps,
                          100 * tbps / copy_tbps(),
                          sort_us, ratio(ours, sort_us), torch_us, ratio(ours, torch_us),
                          fi_us, ratio(ours, fi_us))  # fmt: skip
    return Tables([table, threshold_ops(vocabs, fi)])


THRESHOLD_OPS = {  # name -> (rtcinfer function, FlashInfer's name, its input, kwargs)
    "top_k_renorm_probs": (rtcinfer.top_k_renorm_probs, "probs", {"top_k": TOP_K}),
    "top_p_renorm_probs": (rtcinfer.top_p_renorm_probs, "probs", {"top_p": TOP_P}),
    "top_k_mask_logits": (rtcinfer.top_k_mask_logits, "logits", {"top_k": TOP_K}),
    "softmax": (rtcinfer.softmax, "logits", {}),
    "sampling_from_logits": (rtcinfer.sampling_from_logits, "logits", {}),
    "top_k_top_p_sampling_from_logits": (
        rtcinfer.top_k_top_p_sampling_from_logits,
        "logits",
        {"top_k": TOP_K, "top_p": TOP_P},
    ),  # fmt: skip
}


def threshold_ops(vocabs: tuple[int, ...], fi) -> Table:
    """The exact-threshold ops, softmax and the samplers from logits: three views, ours and
    FlashInfer's, on two kinds of rows."""
    cp = cupy()
    table = Table("exact thresholds, softmax and sampling from logits (fp32)",
                  ["op", "rows", "batch x vocab", *VIEW_COLUMNS, *PEER_COLUMNS])  # fmt: skip
    rng = cp.random.default_rng(0)
    for vocab in vocabs:
        for batch in (1, 128):
            logits = rng.standard_normal((batch, vocab), dtype=np.float32) * 3
            rows = {"softmax(3 N)": (logits, rtcinfer.softmax(logits))}
            flat = rng.random((batch, vocab), dtype=np.float32) ** 8
            rows["U^8"] = (cp.log(flat), flat / flat.sum(axis=1, keepdims=True))
            for kind, (lg, pr) in rows.items():
                (t_logits, t_probs), is_torch = callers(lg, pr)
                for name, (fn, given, kwargs) in THRESHOLD_OPS.items():
                    x = t_logits if given == "logits" else t_probs
                    extra = {"seed": 1, "offset": 2} if "sampling" in name else {}
                    ours = views(lambda: fn(x, **kwargs, **extra), torch_graph=is_torch)
                    theirs = None
                    if fi is not None and is_torch:
                        theirs = peer_views(
                            "flashinfer " + name, lambda: getattr(fi.sampling, name)(x, **kwargs)
                        )
                    table.add(name, kind, f"{batch} x {vocab}", *ours.cells(),
                              *peer_cells(ours, theirs))  # fmt: skip
    return table


def flashinfer_call(fi, name, probs):
    s = fi.sampling
    if name == "top-k":
        return s.top_k_sampling_from_probs(probs, TOP_K)
    if name == "top-p":
        return s.top_p_sampling_from_probs(probs, TOP_P)
    if name == "min-p":
        return s.min_p_sampling_from_probs(probs, MIN_P)
    order = "joint" if name.endswith("joint") else "top_k_first"
    return s.top_k_top_p_sampling_from_probs(probs, TOP_K, TOP_P, filter_apply_order=order)


if __name__ == "__main__":
    print(main(tuple(int(v) for v in sys.argv[1:]) or VOCABS).markdown())
