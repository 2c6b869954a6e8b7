"""Host time per call: what an engine calling ops eagerly (or one op per jitted step) pays.

Each row is the wall time of N back-to-back calls on tiny shapes, divided by N, after a warmup
(the GPU finishes each kernel in a few microseconds, so the host is the bottleneck): rtcinfer
with PyTorch tensors, CuPy arrays, JAX arrays eagerly and inside a one-op `jax.jit`, beside
FlashInfer (PyTorch tensors) and PyTorch's own op where one exists. Floors: `torch.add`, a
CuPy elementwise add, and a jitted `x + 1`.

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


def per_call_us(fn: Callable[[], object], sync: Callable[[], object], n: int = N) -> float:
    """The least over 5 rounds of (wall time of n calls) / n, in microseconds (the host's
    other work only ever adds time)."""
    for _ in range(20):
        fn()
    sync()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        rounds.append((time.perf_counter() - start) / n * 1e6)
    return float(min(rounds))


def _try(label: str, make: Callable[[], tuple[Callable, Callable] | None]) -> float | None:
    try:
        made = make()
        return None if made is None else per_call_us(*made)
    except Exception as e:  # noqa: BLE001 - a missing peer or framework leaves a blank cell
        print(f"# {label}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        return None


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
    cells = {}
    if torch is not None:
        cells["torch"] = _try(f"{case.name} torch", lambda: case.torch(torch))
        fi = peer("flashinfer")
        if fi is not None and case.flashinfer is not None:
            cells["flashinfer"] = _try(
                f"{case.name} flashinfer", lambda: case.flashinfer(fi, torch)
            )
        if case.pytorch is not None:
            cells["pytorch"] = _try(f"{case.name} pytorch", lambda: case.pytorch(torch))
    cells["cupy"] = _try(f"{case.name} cupy", lambda: case.cupy(cupy()))
    if jax is not None and case.jax is not None:
        cells["jax eager"] = _try(f"{case.name} jax eager", lambda: case.jax(jax, False))
        cells["jax jit"] = _try(f"{case.name} jax jit", lambda: case.jax(jax, True))
    table.add(case.name, cells.get("torch"), cells.get("flashinfer"), cells.get("pytorch"),
              cells.get("cupy"), cells.get("jax eager"), cells.get("jax jit"))  # fmt: skip


def main(pattern: str = "") -> Table:
    print(header())
    print("floors (us per call):", {k: round(v, 1) for k, v in floors().items() if v})
    columns = ["call", "rtcinfer torch us", "FlashInfer us", "PyTorch us", "rtcinfer CuPy us",
               "rtcinfer JAX eager us", "rtcinfer jax.jit us"]  # fmt: skip
    table = Table(f"host time per call (wall time of {N} calls / {N})", columns)
    for case in CASES:
        if pattern in case.name:
            run_case(case, table)
    return table


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "").markdown())
    print(f"rtcinfer {rtcinfer.__version__}")
