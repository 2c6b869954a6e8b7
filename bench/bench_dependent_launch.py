"""Dependent launches on and off in one process (rtcinfer/dependent_launch.py; sm_90+).

Two tables: the host time per eager call of single-kernel ops (what the launch path costs:
cuLaunchKernelEx through ctypes against CuPy's cuLaunchKernel; bench_overhead's interleaved
rounds), and the eager / loop / graph
views of large rows and of a layer's small ops called in a row (what the overlap of a launch
with the previous kernel's last CTAs saves). The setting is switched for the device between
measurements, the two settings measured in turn within each round; a CUDA graph keeps the
launches it captured. rtcinfer is called with PyTorch tensors when PyTorch is here.

    python -m bench.bench_dependent_launch
"""

from __future__ import annotations

import numpy as np

import rtcinfer
from bench.bench_overhead import interleaved
from bench.common import Table, Tables, callers, cupy, header, views
from rtcinfer import dependent_launch
from rtcinfer.interop.dtypes import numpy_dtype


def with_setting(device: int, dependent: bool, fn):
    """fn, called with the device's launches dependent or not (both cells pay the same
    dictionary write)."""
    setting = dependent_launch.DEVICES

    def call():
        setting[device] = dependent
        fn()

    return call


def main() -> Tables:
    cp = cupy()
    device = cp.cuda.Device().id
    bf16 = numpy_dtype("bfloat16")
    rng = np.random.default_rng(0)
    print(header())

    def arr(*shape, dtype=bf16):
        return cp.asarray(rng.standard_normal(shape).astype(dtype))

    sync = cp.cuda.Device().synchronize
    host = Table("host us per eager call", ["call", "plain", "dependent", "difference"])
    x, w = arr(1, 4096), arr(4096)
    g, q, k = arr(1, 8192), arr(4, 32, 128), arr(4, 8, 128)
    pos = cp.arange(4, dtype=cp.int32)
    (tx, tw, tg, tq, tk, tp), _ = callers(x, w, g, q, k, pos)
    calls = {
        "rmsnorm 1 x 4096": lambda: rtcinfer.rmsnorm(tx, tw),
        "silu_and_mul 1 x 8192": lambda: rtcinfer.silu_and_mul(tg),
        "apply_rope_pos_ids_inplace 4 tokens": lambda: rtcinfer.apply_rope_pos_ids_inplace(
            tq, tk, tp
        ),
        "rmsnorm 1 x 4096, CuPy": lambda: rtcinfer.rmsnorm(x, w),
    }
    for name, fn in calls.items():
        cells = {on: (with_setting(device, on, fn), sync) for on in (False, True)}
        best = interleaved(cells, name)
        plain, dep = best.get(False), best.get(True)
        host.add(name, plain, dep, None if None in (plain, dep) else dep - plain)

    overlap = Table("views, plain / dependent", ["case", "eager us", "loop us", "graph us"])
    cases = {}
    for rows, hidden in ((4096, 8192), (128, 8192)):
        xs, rs, ws = arr(rows, hidden), arr(rows, hidden), arr(hidden)
        cases[f"fused_add_rmsnorm {rows} x {hidden}"] = lambda xs=xs, rs=rs, ws=ws: (
            rtcinfer.fused_add_rmsnorm(xs, rs, ws)
        )
    h, res, wh = arr(64, 4096), arr(64, 4096), arr(4096)
    gate, act = arr(64, 2 * 14336), cp.empty((64, 14336), bf16)
    q64, k64 = arr(64, 32, 128), arr(64, 8, 128)
    pos64 = cp.asarray(rng.integers(0, 4096, 64).astype(np.int32))

    def layer():
        rtcinfer.fused_add_rmsnorm(h, res, wh)
        rtcinfer.apply_rope_pos_ids_inplace(q64, k64, pos64)
        rtcinfer.fused_add_rmsnorm(h, res, wh)
        rtcinfer.silu_and_mul(gate, out=act)

    cases["a layer's 4 small ops, batch 64"] = layer
    for name, fn in cases.items():
        measured = {}
        for on in (False, True):
            dependent_launch.DEVICES[device] = on
            measured[on] = views(fn)
        plain, dep = measured[False], measured[True]
        pairs = zip(plain.cells(), dep.cells(), strict=True)
        overlap.add(name, *(f"{a:.1f} / {b:.1f}" for a, b in pairs))
    dependent_launch.DEVICES.pop(device, None)  # the device's own rule again
    return Tables([host, overlap])


if __name__ == "__main__":
    print(main().markdown())
