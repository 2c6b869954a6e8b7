"""The serving loop's decode step at batch 64 with mixed contexts, on PyTorch tensors: the model
of examples/serve_torch.py (2 layers, hidden 4096, GQA 32/8, head_dim 128, RMSNorm, RoPE,
SiLU-and-mul, greedy sampling) over 64 requests of 256-4096 cached tokens each, every step
appending one token a request and decoding it. Three times per step:

    ideal  the step's forward captured in one CUDA graph and replayed back to back: its kernels'
           time with nothing between them
    graph  a step as serve_torch's graph loop runs it: copy the step's inputs into the graph's,
           replay, sample (wall time, host included); rtcinfer's graph builds its decode plan
           itself, from its page table (device_plan_array), FlashInfer's use_cuda_graph
           wrapper is plan()-ed on the host first
    eager  a step run eagerly: plan(), the forward op by op, sample (wall time)

"vs ideal" is ideal / the step's time (1.0: the step costs only its kernels). FlashInfer's
functions and wrappers are swapped in by name when it imports, as in serve_torch.py (both
sample with rtcinfer's top_k_top_p_sampling_from_logits: FlashInfer's sampling module takes
minutes to build).

    python -m bench.bench_serving [rtcinfer] [flashinfer]   (default: both)
"""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

import numpy as np

from bench.common import Table, Tables, header, peer

BATCH, CONTEXTS = 64, (256, 4096)
STEPS = 30


def _examples():
    """serve_torch and serving (examples/), the page pool sized for the batch."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import serve_torch
    import serving

    return serve_torch, serving


def decode_batch(serving, rng):
    """The step's host tables and device inputs' arrays: request b holds contexts[b] tokens and
    appends one (its pages after the append, scattered over the pool)."""
    page = serving.PAGE
    contexts = rng.integers(CONTEXTS[0], CONTEXTS[1] + 1, BATCH)
    lengths = contexts + 1
    pages = -(-lengths // page)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(int(indptr[-1])).astype(np.int32)
    last = (lengths - (pages - 1) * page).astype(np.int32)
    step = types.SimpleNamespace(
        tokens=rng.integers(0, serving.VOCAB, BATCH).astype(np.int32),
        ends=np.arange(BATCH), positions=contexts.astype(np.int32),
        batch_indices=np.arange(BATCH, dtype=np.int32), padded=indices, indptr=indptr,
        last=last,
    )  # fmt: skip
    return step, int(indptr[-1]), int(lengths.sum())


def _wall_us(torch, fn, steps: int = STEPS) -> float:
    """Wall time of one call of fn, from `steps` calls back to back (the GPU drained after)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def _replay_us(torch, graph, steps: int = STEPS) -> float:
    """Device time of one replay, from `steps` replays back to back (CUDA events)."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / steps


def _measure(lib, st, step, rng) -> tuple[float, float, float]:
    """(ideal, graph, eager) microseconds per step of `lib` (rtcinfer or flashinfer)."""
    torch = st.torch
    gen = torch.Generator(device=st.dev).manual_seed(0)
    engine = st.Engine(st.weights(gen), rng, graphs=False, lib=lib)
    plan_args = tuple(st.host(lib, a) for a in (step.indptr, step.padded[: step.indptr[-1]],
                                                step.last))  # fmt: skip
    dims = (st.HQ, st.HKV, st.D, st.PAGE)
    inputs = st.Inputs(step)

    def eager():
        engine.decode.plan(*plan_args, *dims, q_data_type=st.bf16)
        return st.greedy(engine.forward(inputs, engine.decode), 1)

    began = time.perf_counter()
    eager()  # compiles and loads the step's kernels
    torch.cuda.synchronize()
    print(f"# {lib.__name__}: first eager step {time.perf_counter() - began:.1f} s", flush=True)
    captured = st.DecodeGraph(engine, st.Inputs(step), plan_args)

    def replayed():
        if not captured.device_plan:  # rtcinfer's graph plans itself (device_plan_array)
            captured.wrapper.plan(*plan_args, *dims, q_data_type=st.bf16)
        inputs.copy_to(captured.inputs)
        captured.graph.replay()
        return st.greedy(captured.logits, 1)

    return _replay_us(torch, captured.graph), _wall_us(torch, replayed), _wall_us(torch, eager)


def main() -> Tables:
    torch = peer("torch")
    table = Table(
        f"decode step, batch {BATCH}, contexts {CONTEXTS[0]}-{CONTEXTS[1]} (serve_torch's model)",
        ["library", "ideal us", "graph us", "eager us", "graph tokens/s", "eager tokens/s",
         "graph vs ideal", "eager vs ideal"],
    )  # fmt: skip
    tables = Tables()
    tables.append(table)
    if torch is None or not torch.cuda.is_available():
        print("# bench_serving needs PyTorch with a CUDA GPU")
        return tables
    print(header())
    st, serving = _examples()
    rng = np.random.default_rng(0)
    step, pages, tokens = decode_batch(serving, rng)
    st.PAGES = serving.PAGES = pages  # the pool: exactly the batch's pages
    print(f"# {BATCH} requests, {tokens} tokens in the cache after the step, {pages} pages")
    import rtcinfer

    libs = [rtcinfer] + [fi for fi in (peer("flashinfer"),) if fi is not None]
    libs = [lib for lib in libs if lib.__name__ in (sys.argv[1:] or [lib.__name__])]
    for lib in libs:
        try:
            ideal, graph, eager = _measure(lib, st, step, np.random.default_rng(1))
        except Exception as e:  # noqa: BLE001 - a peer failing must not stop the bench
            if lib is rtcinfer:
                raise
            print(f"# {lib.__name__} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        table.add(lib.__name__, ideal, graph, eager, BATCH / graph * 1e6, BATCH / eager * 1e6,
                  f"{ideal / graph:.2f}", f"{ideal / eager:.2f}")  # fmt: skip
    return tables


if __name__ == "__main__":
    print(main().markdown())
