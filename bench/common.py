"""Timing harness shared by the bench scripts (run on a GPU).

time_us(fn)          median microseconds of fn() over CUDA events, L2 flushed before each run
views(fn)            the three views of a call: eager, loop, graph (see below)
copy_tbps()          the measured device-to-device copy ceiling (read + write bytes), TB/s
Table                prints rows with napkin math: us, TB/s, % of the copy ceiling, peer ratio
peer(name)           FlashInfer / torch when importable, else None (import errors are reported)

The three views of a call, every op timed each way (ours and FlashInfer's alike):
  eager  events around one call, host included, cold L2: what a latency-bound step sees
  loop   events around LOOP calls back to back, divided by LOOP: an engine queueing ahead
  graph  the call captured once into a CUDA graph, replays timed: the kernels alone
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


def cupy():
    import cupy

    return cupy


@functools.cache
def _flush_buffer():
    return cupy().empty(256 * 1024 * 1024, dtype=np.uint8)  # > 4x the H200's 60 MB L2


def flush_l2() -> None:
    """Evict the L2 by reading 256 MB: reads leave clean lines, so the timed kernel does not
    pay for writing back dirty ones (a fill would)."""
    _flush_buffer().max()


def time_us(fn: Callable[[], object], repeat: int = 30, warmup: int = 3, flush: bool = True):
    """Median time of fn() in microseconds, each run measured alone with a cold L2."""
    cp = cupy()
    for _ in range(warmup):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeat):
        if flush:
            flush_l2()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return float(np.median(times))


LOOP = 50


def loop_us(fn: Callable[[], object], n: int = LOOP, repeat: int = 10, flush: bool = True):
    """Median over `repeat` runs of (events around n back-to-back calls) / n, L2 flushed
    before each run (unless not `flush`)."""
    cp = cupy()
    for _ in range(3):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeat):
        if flush:
            flush_l2()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / n)
    return float(np.median(times))


@dataclass(frozen=True)
class Views:
    eager: float | None
    loop: float | None
    graph: float | None

    def cells(self) -> tuple:
        return (self.eager, self.loop, self.graph)


def views(fn: Callable[[], object], torch_graph: bool = False, graph: bool = True) -> Views:
    """Eager, loop and graph microseconds of fn(). fn launching on PyTorch's current stream
    (PyTorch tensors) is captured with torch.cuda.graph (`torch_graph`), else with CuPy's
    stream capture; `graph=False` leaves the graph view out."""
    eager, loop = time_us(fn), loop_us(fn)
    g = None
    if graph:
        g = torch_graph_time_us(fn) if torch_graph else graph_time_us(fn)
    return Views(eager, loop, g)


def peer_views(label: str, fn: Callable[[], object]) -> Views:
    """views() of a peer's fn (PyTorch tensors), or blanks (with a note) if it fails."""
    try:
        return views(fn, torch_graph=True)
    except Exception as e:  # noqa: BLE001 - a peer failing must not stop the bench
        print(f"# {label} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return Views(None, None, None)


VIEW_COLUMNS = ["eager us", "loop us", "graph us"]
PEER_COLUMNS = ["FI eager", "FI loop", "FI graph", "loop vs FI", "graph vs FI"]


def callers(*arrays) -> tuple[list, bool]:
    """The arrays an engine would pass: PyTorch views of them when PyTorch is here (the
    framework FlashInfer is called with), else the CuPy arrays; and whether they are PyTorch's
    (views() then captures the graph view with torch.cuda.graph)."""
    torch = peer("torch")
    if torch is None:
        return list(arrays), False
    return [None if a is None else torch_view(a) for a in arrays], True


def peer_cells(ours: Views, theirs: Views | None) -> tuple:
    """The peer's three views and its loop and graph ratios (theirs / ours)."""
    if theirs is None:
        return (None,) * 5
    return (*theirs.cells(), _ratio(ours.loop, theirs.loop), _ratio(ours.graph, theirs.graph))


def _ratio(ours, theirs) -> str:
    return "" if ours is None or theirs is None else f"{theirs / ours:.2f}x"


def graph_time_us(fn: Callable[[], object], repeat: int = 30, flush: bool = True) -> float:
    """Like time_us, but fn is captured once into a CUDA graph and the replays are timed:
    the kernel time without Python launch overhead."""
    cp = cupy()
    # The inputs were written on the legacy default stream, which a non-blocking stream does not
    # wait for: without this sync the first call could read them before their copies land.
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # compile and load outside the capture
        stream.synchronize()
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
        return time_us(lambda: graph.launch(stream), repeat=repeat, flush=flush)  # same stream


@functools.cache
def copy_tbps(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy of 4 GiB: (read + write bytes) / time, in TB/s."""
    cp = cupy()
    src = cp.empty(nbytes, dtype=np.uint8)
    dst = cp.empty_like(src)
    us = time_us(lambda: cp.copyto(dst, src), repeat=10, flush=False)
    return 2 * nbytes / us / 1e6


@functools.cache
def peer(name: str):
    """Import a peer library for side-by-side numbers; None (with a note) when unavailable."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any failure means "no peer"
        print(f"# {name} not available: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def torch_view(x):
    """The same memory as a torch tensor (for feeding peers)."""
    return peer("torch").from_dlpack(x)


class Table:
    """Rows of measurements, printed as a Markdown table (for bench/RESULTS.md)."""

    def __init__(self, title: str, columns: list[str]):
        self.title, self.columns, self.rows = title, columns, []

    def add(self, *values) -> None:
        self.rows.append([_fmt(v) for v in values])
        print("  " + " | ".join(self.rows[-1]), flush=True)

    def markdown(self) -> str:
        head = f"| {' | '.join(self.columns)} |\n|{'---|' * len(self.columns)}\n"
        return f"### {self.title}\n\n" + head + "".join(f"| {' | '.join(r)} |\n" for r in self.rows)


class Tables(list):
    """Several tables from one bench module, printed one after the other."""

    def markdown(self) -> str:
        return "\n".join(t.markdown() for t in self)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return "" if v is None else str(v)


def header() -> str:
    """GPU, driver and commit, for the top of a results section."""
    cp = cupy()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    commit = os.environ.get("RTCINFER_COMMIT")  # a copied tree may carry a stale .git
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return (
        f"GPU: {props['name'].decode()}, driver {cp.cuda.runtime.driverGetVersion()}, "
        f"commit {commit}, copy ceiling {copy_tbps():.2f} TB/s"
    )


def torch_graph_time_us(fn: Callable[[], object], repeat: int = 30) -> float:
    """fn (PyTorch work) captured with torch.cuda.graph; the replays are timed."""
    torch = peer("torch")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_us(graph.replay, repeat=repeat)


def run_peer(label: str, fn: Callable[[], object]) -> float | None:
    """Graph-timed microseconds of a peer's fn, or None (with a note) if it fails."""
    try:
        return torch_graph_time_us(fn)
    except Exception as e:  # noqa: BLE001 - a peer failing must not stop the bench
        print(f"# {label} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return None


def ratio(ours: float, theirs: float | None) -> str:
    """Their time over ours: > 1 means we are faster."""
    return "" if theirs is None else f"{theirs / ours:.2f}x"
