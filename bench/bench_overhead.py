"""Host time per call: what an engine calling ops eagerly (or one op per jitted step) pays.

Each row is the wall time of N back-to-back calls on tiny shapes, divided by N, after a warmup
(the GPU finishes each kernel in a few microseconds, so the host is the bottleneck): rtcinfer
with PyTorch tensors, CuPy arrays, JAX arrays eagerly and inside a one-op `jax.jit`, beside
FlashInfer (PyTorch tensors) and PyTorch's own op where one exists; a row's cells are timed
in turn in each round (the host's speed drifts between rows). Floors: `torch.add`, a CuPy
elementwise add, a jitted `x + 1`, and per row a jitted no-op of the row's own JAX arrays
(`x + 1` of each): what XLA's dispatch of that many buffers costs.

    python -m bench.bench_overhead            # every op
    python -m bench.bench_overhead rmsnorm    # rows whose name contains "rmsnorm"
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np

import rtcinfer
from bench.common import Table, cupy, header, peer
from bench.overhead_cases import CASES, Case

N = 1000


def per_call_us(fn: Callable[[], object], sync: Callable[[], object], n: int = N) -> float | None:
    """The least over 5 rounds of (wall time of n calls) / n, in microseconds (the host's
    other work only ever adds time)."""
    return interleaved({"": (fn, sync)}, n=n).get("")


def interleaved(cells: dict[str, tuple[Callable, Callable]], label: str = "",
                n: int = N) -> dict[str, float]:  # fmt: skip
    """per_call_us of each cell, the cells measured in turn within each of 5 rounds: a row's
    cells (rtcinfer, FlashInfer, PyTorch, ...) see the same host, whose speed drifts between
    rows by tens of percent. A cell whose warmup raises is left out (a blank cell)."""
    working = {}
    for name, (fn, sync) in cells.items():
        try:
            for _ in range(20):
                fn()
            sync()
            working[name] = (fn, sync)
        except Exception as e:  # noqa: BLE001 - reported, the row goes on
            print(f"# {label} {name}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
    best = dict.fromkeys(working, float("inf"))
    for _ in range(5):
        for name, (fn, sync) in working.items():
            start = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            best[name] = min(best[name], (time.perf_counter() - start) / n * 1e6)
    return best


def _made(label: str, make: Callable[[], tuple[Callable, Callable] | None]):
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - a missing peer or framework leaves a blank cell
        print(f"# {label}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        return None


def _try(label: str, make: Callable[[], tuple[Callable, Callable] | None]) -> float | None:
    made = _made(label, make)
    return None if made is None else per_call_us(*made)


def floors() -> dict[str, float | None]:
    torch, jax = peer("torch"), peer("jax")
    cp = cupy()
    out = {}
    a = cp.ones(4096, dtype=np.float32)
    out["CuPy add"] = _try("cupy add", lambda: (lambda: a + a, cp.cuda.Device().synchronize))
    if torch is not None:
        t = torch.ones(4096, device="cuda")
        out["torch.add"] = _try(
            "torch add", lambda: (lambda: torch.add(t, t), torch.cuda.synchronize)
        )
    if jax is not None:
        x = jax.numpy.ones(4096, jax.numpy.float32)
        f = jax.jit(lambda x: x + 1)

        def make():
            box = [None]

            def call():
                box[0] = f(x)

            return call, lambda: box[0].block_until_ready()

        out["jitted x + 1"] = _try("jax floor", make)
    return out


def run_case(case: Case, table: Table) -> None:
    torch, jax = peer("torch"), peer("jax")
    makers = {}
    if torch is not None:
        makers["torch"] = lambda: case.torch(torch)
        fi = peer("flashinfer")
        if fi is not None and case.flashinfer is not None:
            makers["flashinfer"] = lambda: case.flashinfer(fi, torch)
        if case.pytorch is not None:
            makers["pytorch"] = lambda: case.pytorch(torch)
    makers["cupy"] = lambda: case.cupy(cupy())
    if jax is not None and case.jax is not None:
        makers["jax eager"] = lambda: case.jax(jax, False)
        makers["jax jit"] = lambda: case.jax(jax, True)
        makers["jax floor"] = lambda: case.jax_floor(jax)
    made = {name: _made(f"{case.name} {name}", make) for name, make in makers.items()}
    cells = interleaved({name: m for name, m in made.items() if m is not None}, case.name)
    table.add(case.name, *(cells.get(name) for name in _CELLS))


_CELLS = ("torch", "flashinfer", "pytorch", "cupy", "jax eager", "jax jit", "jax floor")


def main(pattern: str = "") -> Table:
    print(header())
    print("floors (us per call):", {k: round(v, 1) for k, v in floors().items() if v})
    columns = ["call", "rtcinfer torch us", "FlashInfer us", "PyTorch us", "rtcinfer CuPy us",
               "rtcinfer JAX eager us", "rtcinfer jax.jit us",
               "jitted no-op, same arrays us"]  # fmt: skip
    table = Table(f"host time per call (wall time of {N} calls / {N})", columns)
    for case in CASES:
        if pattern in case.name:
            run_case(case, table)
    return table


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "").markdown())
    print(f"rtcinfer {rtcinfer.__version__}")
